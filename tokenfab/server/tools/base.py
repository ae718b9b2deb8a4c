"""The tool-call parser interface: split a finished or streaming generation into content and tool calls.

Every family parser implements one method, `scan(text, final)`, which reads the whole output seen so far and
returns the content outside calls plus each call as far as it is known (`PartialCall`). Everything else is
shared here:

- `extract(text)` scans the finished text once. If any call is cut off or malformed, the whole text is returned
  as content with no calls (a bad call never raises and never loses text).
- `stream()` gives a `ToolCallStream`: each `feed(delta)` rescans the accumulated text and emits only what is
  new since the last delta (content text, a call's header with its id and name, then argument fragments).
  `scan` keeps the content and each call's arguments prefix-stable (a partial marker or trailing whitespace
  that may still turn out to belong to a marker is held back), so for a well-formed output the deltas,
  concatenated, give exactly `extract`'s result. A call that is cut off after its header was streamed cannot
  be retracted: it stays a call with the arguments sent; one cut off or malformed before its name was known
  is flushed as content by `finish()`, with everything after it (so if it is the first call, the stream
  gives the whole text as content, like `extract`).

Whitespace between content and a call is dropped (the content before a call is right-stripped, the content
after it left-stripped, pieces on both sides of a call joined by a newline); an output without calls is returned
unchanged.
"""

from __future__ import annotations

import json
import secrets
import string
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

_ID_ALPHABET = string.ascii_letters + string.digits


def new_call_id() -> str:
    """An OpenAI-style tool-call id, ``call_`` and 24 random letters/digits."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments_json: str


@dataclass(frozen=True)
class ExtractedToolCalls:
    content: str | None
    calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    """One streamed piece of call `index`: `id` and `name` on its first delta, then `arguments` fragments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


Delta = ContentDelta | ToolCallDelta


@dataclass
class PartialCall:
    """A call as far as the text shows it. `args` is a prefix of the final arguments JSON text that later
    scans only extend; `done` means the call's end was seen; `valid` is False when the family saw the call
    is malformed (e.g. garbage after the JSON object)."""

    name: str | None
    args: str
    done: bool
    raw: str
    call_id: str | None = None
    valid: bool = True


@dataclass
class Scan:
    segments: list[str]
    calls: list[PartialCall]

    def content(self) -> str:
        """The content outside calls, with the whitespace adjoining each call dropped."""
        if len(self.segments) == 1:
            return self.segments[0]
        parts = []
        for i, seg in enumerate(self.segments):
            if i < len(self.calls):
                seg = seg.rstrip()
            if i > 0:
                seg = seg.lstrip()
            if seg:
                parts.append(seg)
        return "\n".join(parts)  # text on both sides of a call becomes two lines


def partial_suffix_len(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is a proper prefix of one of `markers` (held back while
    streaming, since the next delta may complete the marker)."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best


def split_blocks(
    text: str, begin: str, end: str, final: bool, drop: tuple[str, ...] = ()
) -> tuple[list[str], list[tuple[str, bool, str]]]:
    """Split `text` at `begin ... end` call blocks: returns the content segments (one more than the blocks,
    with the `drop` markers removed) and each block's `(body, done, raw)`. Unless `final`, a partial marker
    at the end of the text is held back from the last segment or body."""
    segments: list[str] = []
    blocks: list[tuple[str, bool, str]] = []
    pos = 0
    while True:
        b = text.find(begin, pos)
        if b < 0:
            break
        segments.append(_drop(text[pos:b], drop))
        # a section marker right before the call belongs to the call's raw text (content if the call is broken)
        before = text[pos:b].rstrip()
        r = next((len(before) - len(m) + pos for m in drop if before.endswith(m)), b)
        e = text.find(end, b + len(begin))
        if e < 0:
            body = text[b + len(begin) :]
            if not final:
                body = body[: len(body) - partial_suffix_len(body, (end,))]
            blocks.append((body, False, text[r:]))
            return segments + [""], blocks
        blocks.append((text[b + len(begin) : e], True, text[r : e + len(end)]))
        pos = e + len(end)
    tail = text[pos:]
    if not final:
        tail = tail[: len(tail) - partial_suffix_len(tail, (begin, *drop))]
    segments.append(_drop(tail, drop))
    return segments, blocks


def _drop(text: str, markers: tuple[str, ...]) -> str:
    for m in markers:
        text = text.replace(m, "")
    return text


def _args_ok(args: str) -> bool:
    try:
        return isinstance(json.loads(args), dict)
    except ValueError:
        return False


class ToolParser(ABC):
    """Splits one model family's output into content and tool calls."""

    name: str = ""
    # every marker whose presence (or partial presence at the end) can start a call or be dropped from content;
    # while none has appeared, streaming passes text through without rescanning (see ToolCallStream)
    triggers: tuple[str, ...] = ()

    def plain_start(self, text: str) -> bool:
        """False when the start of the output alone makes it a call (Llama-3's leading ``{``)."""
        return True

    def __init__(self, tools: list[dict] | None = None) -> None:
        """`tools`: the request's OpenAI ``tools`` list, for formats whose values need the schema (GLM)."""
        self.tools = tools

    @abstractmethod
    def scan(self, text: str, final: bool) -> Scan:
        """Read the output so far (`final`: it is complete) into content segments and calls."""

    def extract(self, text: str) -> ExtractedToolCalls:
        """Parse a finished generation; any broken call turns the whole text back into content."""
        scan = self.scan(text, final=True)
        if not scan.calls:
            return ExtractedToolCalls(content=scan.content() or None)
        calls = []
        for c in scan.calls:
            if not (c.done and c.valid and c.name and _args_ok(c.args)):
                return ExtractedToolCalls(content=text or None)
            calls.append(ToolCall(id=c.call_id or new_call_id(), name=c.name, arguments_json=c.args))
        return ExtractedToolCalls(content=scan.content() or None, calls=calls)

    def stream(self) -> ToolCallStream:
        """A fresh streaming state for one request."""
        return ToolCallStream(self)


class ToolCallStream:
    """Per-request streaming state (see the module docstring)."""

    def __init__(self, parser: ToolParser) -> None:
        self._parser = parser
        self._text = ""
        self._content_sent = 0
        self._ids: list[str] = []
        self._args_sent: list[int] = []
        self._plain = bool(parser.triggers)  # no trigger seen yet: the fast path applies
        self._checked = 0  # text[:_checked] holds no trigger
        self._longest = max((len(t) for t in parser.triggers), default=0)

    def feed(self, delta: str) -> list[Delta]:
        self._text += delta
        if self._plain:
            fast = self._plain_feed()
            if fast is not None:
                return fast
        return self._emit(self._parser.scan(self._text, final=False), final=False)

    def _plain_feed(self) -> list[Delta] | None:
        """Plain text so far: emit it up to a possible partial trigger and trailing whitespace, looking only at
        the new text (so a long answer without calls costs O(delta) a step, not a rescan). None: use `scan`."""
        text, parser = self._text, self._parser
        lo = max(0, self._checked - self._longest)
        if any(text.find(t, lo) >= 0 for t in parser.triggers) or not parser.plain_start(text):
            self._plain = False
            return None
        if text.isspace():
            return None
        self._checked = len(text)
        end = len(text) - partial_suffix_len(text[-self._longest :], parser.triggers)
        while end > self._content_sent and text[end - 1].isspace():
            end -= 1
        if end <= self._content_sent:
            return []
        out: list[Delta] = [ContentDelta(text[self._content_sent : end])]
        self._content_sent = end
        return out

    def call_text(self, index: int) -> str:
        """The model's own text of call `index` (its markers and arguments as generated), e.g. to return a call
        that fails its schema as content."""
        calls = self._parser.scan(self._text, final=True).calls
        return calls[index].raw if index < len(calls) else ""

    def finish(self) -> list[Delta]:
        scan = self._parser.scan(self._text, final=True)
        out = self._emit(scan, final=True)
        # a call whose name never became known was never announced: it and all after it are content
        if len(scan.calls) > len(self._ids) and (raw := scan.calls[len(self._ids)].raw):
            out.append(ContentDelta(self._text[self._text.find(raw) :]))
        return out

    def _emit(self, scan: Scan, final: bool) -> list[Delta]:
        out: list[Delta] = []
        pending = next((i for i, c in enumerate(scan.calls) if c.name is None), None)
        if pending is not None:  # nothing after a call whose name is not known yet
            scan = Scan(scan.segments[: pending + 1], scan.calls[:pending])
        content = scan.content()
        if not final:
            content = content.rstrip()  # trailing whitespace is dropped if a call follows
        if len(content) > self._content_sent:
            out.append(ContentDelta(content[self._content_sent :]))
            self._content_sent = len(content)
        for i, call in enumerate(scan.calls):
            if call.name is None:
                break  # later calls wait for this one's name, so indexes stay in order
            if i == len(self._ids):
                self._ids.append(call.call_id or new_call_id())
                self._args_sent.append(len(call.args))
                out.append(ToolCallDelta(index=i, id=self._ids[i], name=call.name, arguments=call.args))
            elif len(call.args) > self._args_sent[i]:
                out.append(ToolCallDelta(index=i, arguments=call.args[self._args_sent[i] :]))
                self._args_sent[i] = len(call.args)
        return out


def assemble(deltas: list[Delta]) -> ExtractedToolCalls:
    """Concatenate streamed deltas into the shape `extract` returns (what a client reassembles)."""
    content = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
    calls: dict[int, list[str]] = {}
    for d in deltas:
        if isinstance(d, ToolCallDelta):
            if d.index not in calls:
                calls[d.index] = [d.id or "", d.name or "", ""]
            calls[d.index][2] += d.arguments
    return ExtractedToolCalls(content=content or None, calls=[ToolCall(*calls[i]) for i in sorted(calls)])
