"""GPT-OSS: reasoning from the Harmony `analysis` channel, parsed by `openai-harmony`'s `StreamableParser`.

GPT-OSS writes messages ``<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>
...<|return|>``; the generation prompt already ends with ``<|start|>assistant``. Channels map to:
- ``analysis`` -> reasoning (also messages addressed to built-in tools such as ``browser.search``);
- ``final`` and ``commentary`` without a recipient (preambles) -> content;
- ``commentary`` with ``to=functions.NAME`` -> a tool call (handled by `tokenfab.server.tools.gpt_oss`).

Harmony works on token ids, so the id path (`feed_ids`, `extract_ids`) is exact. The text path encodes text
with special tokens allowed, holding back a partial ``<|...`` until it closes. A token sequence Harmony
rejects (malformed output) is not an error: from there on the decoded text is returned as content.
An unterminated message (cut by max_tokens) keeps its channel's kind.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenfab.server.reasoning.base import (
    CONTENT,
    REASONING,
    Piece,
    PieceBuffer,
    ReasoningParser,
    ReasoningStream,
    join_pieces,
)
from tokenfab.server.reasoning.harmony_vocab import harmony_encoding

TOOL_CALL = "tool_call"
TOOL_CALL_END = "tool_call_end"
FUNCTIONS_PREFIX = "functions."
_HEADER, _CONTENT, _BETWEEN = "header", "content", "between"


@dataclass
class HarmonyEvent:
    """One step of output: reasoning/content text; (TOOL_CALL) a call's name (first event) and argument delta;
    (TOOL_CALL_END) the call's message ended (with <|call|> or <|end|>)."""

    kind: str
    text: str
    call_index: int | None = None
    name: str | None = None


class HarmonyStream:
    """Token-level Harmony parsing of one completion into `HarmonyEvent`s."""

    def __init__(self) -> None:
        from openai_harmony import Role, StreamableParser

        self._enc = harmony_encoding()
        self._parser = StreamableParser(self._enc, Role.ASSISTANT, strict=True)
        # The parser's `state` property decodes a JSON dump of everything parsed so far (quadratic over a
        # response), so the header/content/between-messages state is followed here from the special tokens.
        special = {
            t: self._enc.encode(t, allowed_special="all")[0]
            for t in ("<|start|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>")
        }
        self._start_id, self._message_id = special["<|start|>"], special["<|message|>"]
        self._end_ids = {special["<|end|>"], special["<|call|>"], special["<|return|>"]}
        self._state = _HEADER  # the prompt ended with "<|start|>assistant"
        self._header_ids: list[int] = []  # tokens of a header not yet closed by <|message|>
        self._failed_ids: list[int] | None = None  # set once Harmony rejected a token
        self._call_index = -1
        self._in_call = False  # the current message is a function call already announced

    def _kind(self, channel: str | None, recipient: str | None) -> str:
        if recipient and recipient.startswith(FUNCTIONS_PREFIX):
            return TOOL_CALL
        if channel == "analysis" or recipient:
            return REASONING
        return CONTENT

    def feed_ids(self, ids: list[int]) -> list[HarmonyEvent]:
        events: list[HarmonyEvent] = []
        for tok in ids:
            if self._failed_ids is not None:
                self._failed_ids.append(tok)
                continue
            try:
                self._parser.process(tok)
            except Exception:  # openai_harmony.HarmonyError: from here on, plain content
                self._failed_ids = [*self._header_ids, tok]
                continue
            p = self._parser
            if tok == self._message_id and self._state == _HEADER:
                self._state = _CONTENT
            elif tok in self._end_ids and self._state == _CONTENT:
                self._state = _BETWEEN
            elif tok == self._start_id and self._state == _BETWEEN:
                self._state = _HEADER
            if self._state == _HEADER:
                self._header_ids.append(tok)
            else:
                self._header_ids = []
            if self._state != _CONTENT:
                if self._in_call:
                    events.append(HarmonyEvent(TOOL_CALL_END, "", self._call_index))
                self._in_call = False
                continue
            kind = self._kind(p.current_channel, p.current_recipient)
            delta = p.last_content_delta or ""
            if kind == TOOL_CALL:
                if not self._in_call:
                    self._in_call, self._call_index = True, self._call_index + 1
                    name = p.current_recipient[len(FUNCTIONS_PREFIX) :]
                    events.append(HarmonyEvent(TOOL_CALL, delta, self._call_index, name))
                elif delta:
                    events.append(HarmonyEvent(TOOL_CALL, delta, self._call_index))
            elif delta:
                events.append(HarmonyEvent(kind, delta))
        return events

    def finish(self) -> list[HarmonyEvent]:
        """Flush: tokens Harmony rejected, or a header never closed (plain text with no channel), are content."""
        ids = self._failed_ids if self._failed_ids is not None else self._header_ids
        self._failed_ids, self._header_ids = None, []
        return [HarmonyEvent(CONTENT, self._enc.decode(ids))] if ids else []


def encode_harmony_text(text: str) -> list[int]:
    """Token ids of output text that spells Harmony's special tokens literally."""
    return harmony_encoding().encode(text, allowed_special="all")


class HarmonyTextStream:
    """`HarmonyStream` fed with text deltas: encodes them, holding back a partial special token ``<|...``."""

    def __init__(self) -> None:
        self.h = HarmonyStream()
        self.text = ""

    def feed_ids(self, ids: list[int]) -> list[HarmonyEvent]:
        return self.h.feed_ids(ids)

    def feed(self, delta: str) -> list[HarmonyEvent]:
        self.text += delta
        cut = self.text.rfind("<|")
        if cut < 0 or "|>" in self.text[cut:]:
            cut = len(self.text) - 1 if self.text.endswith("<") else -1
        if cut >= 0:
            ready, self.text = self.text[:cut], self.text[cut:]
        else:
            ready, self.text = self.text, ""
        return self.h.feed_ids(encode_harmony_text(ready)) if ready else []

    def finish(self) -> list[HarmonyEvent]:
        events = self.h.feed_ids(encode_harmony_text(self.text)) if self.text else []
        self.text = ""
        return events + self.h.finish()


class GptOssReasoningStream(ReasoningStream):
    def __init__(self) -> None:
        self.s = HarmonyTextStream()
        self.out = PieceBuffer()

    def _pieces(self, events: list[HarmonyEvent]) -> list[Piece]:
        for ev in events:
            if ev.kind in (REASONING, CONTENT):
                self.out.add(ev.kind, ev.text)
        return self.out.take()

    def feed_ids(self, ids: list[int]) -> list[Piece]:
        return self._pieces(self.s.feed_ids(ids))

    def feed(self, delta: str) -> list[Piece]:
        return self._pieces(self.s.feed(delta))

    def finish(self) -> list[Piece]:
        return self._pieces(self.s.finish())


class GptOssReasoningParser(ReasoningParser):
    """Reasoning = the analysis channel. `chat_template_kwargs` cannot switch GPT-OSS thinking off; its
    amount is set by ``reasoning_effort`` in the system message when the prompt is rendered."""

    name = "gpt_oss"

    def __init__(self, *, chat_template_kwargs: dict | None = None, prompt: str | None = None) -> None:
        pass

    def extract_ids(self, ids: list[int]) -> tuple[str | None, str | None]:
        s = GptOssReasoningStream()
        return join_pieces(s.feed_ids(ids) + s.finish())

    def extract(self, text: str) -> tuple[str | None, str | None]:
        return self.extract_ids(encode_harmony_text(text))

    def stream(self) -> GptOssReasoningStream:
        return GptOssReasoningStream()
