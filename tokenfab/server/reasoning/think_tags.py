"""`<think>...</think>` reasoning, shared by the DeepSeek-R1, Qwen3, GLM-4.5 and Kimi K2 families.

The families differ in three ways, all captured by `ThinkFamily`:
- whether the chat template already opened the block (the prompt ends with ``<think>``) or the model
  generates ``<think>`` itself. The caller should pass the rendered prompt; we then look at its tail, which is
  exact (ends with ``<think>``: open; with ``</think>``: thinking was switched off; neither: the model may
  open a block itself). Without a prompt the family's usual template behaviour is assumed;
- which `chat_template_kwargs` key switches thinking off (``enable_thinking`` for Qwen3/GLM, ``thinking`` for
  DeepSeek-V3.1 and Kimi) and its default. Off: the template closes the block itself, the whole output is
  content, returned verbatim;
- extra markers that end reasoning without ``</think>`` (Kimi's tool-call section), kept in the content so the
  tool parser sees them.

Conventions (stated, since vLLM's parsers differ among themselves): a leading ``<think>`` in the output is
optional and stripped; text before ``</think>`` is reasoning once a block is open; an unterminated block at
the end (e.g. cut off by max_tokens) is reasoning for every family (vLLM's deepseek_r1 does the same; its
qwen3/glm45 non-streaming parsers return such text as content, but then their streaming and non-streaming
outputs disagree); output that never opens a block is content. Reasoning is stripped of surrounding
whitespace (templates write ``<think>\n...\n</think>``), and whitespace right after ``</think>`` is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenfab.server.reasoning.base import CONTENT, REASONING, Piece, PieceBuffer, ReasoningParser, ReasoningStream


@dataclass(frozen=True)
class ThinkFamily:
    name: str
    prompt_opens: bool  # the family's template ends the generation prompt with <think> when thinking is on
    switch_key: str | None = None  # chat_template_kwargs key that turns thinking on/off
    default_on: bool = True
    start: str = "<think>"
    end: str = "</think>"
    implicit_ends: tuple[str, ...] = ()  # markers that end reasoning and stay in content


def _ends_open(prompt: str, fam: ThinkFamily) -> bool | None:
    """True/False when the prompt's tail shows an open/closed think block; None when it shows neither."""
    tail = prompt.rstrip()
    if tail.endswith(fam.start):
        return True
    if tail.endswith(fam.end):
        return False
    return None


class ThinkTagParser(ReasoningParser):
    def __init__(
        self, family: ThinkFamily, *, chat_template_kwargs: dict | None = None, prompt: str | None = None
    ) -> None:
        self.family = family
        self.name = family.name
        kwargs = chat_template_kwargs or {}
        self.thinking = bool(kwargs.get(family.switch_key, family.default_on)) if family.switch_key else True
        opened = _ends_open(prompt, family) if prompt is not None else None
        if opened is False:
            self.thinking = False  # the template closed the block: e.g. Qwen3's "<think>\n\n</think>\n\n"
        # With the prompt known, only a prompt ending in <think> opened the block; else the family's default.
        self.in_reasoning = family.prompt_opens if prompt is None else bool(opened)
        self.markers = (family.end, *family.implicit_ends)

    def extract(self, text: str) -> tuple[str | None, str | None]:
        if not self.thinking:
            return None, text or None
        fam, body, started = self.family, text, self.in_reasoning
        stripped = text.lstrip()
        if stripped.startswith(fam.start):
            body, started = stripped[len(fam.start) :], True
        if not started:
            return None, text or None
        hits = [(body.find(m), m) for m in self.markers if m in body]
        if not hits:
            return body.strip() or None, None
        i, marker = min(hits)
        rest = body[i + len(marker) :] if marker == fam.end else body[i:]
        return body[:i].strip() or None, rest.lstrip() or None

    def stream(self) -> ReasoningStream:
        return ThinkTagStream(self)


class ThinkTagStream(ReasoningStream):
    """States: "start" (an optional <think> may still come), "reasoning", "content"."""

    def __init__(self, parser: ThinkTagParser) -> None:
        self.p = parser
        self.buf = ""
        self.out = PieceBuffer()
        self.state = "start" if parser.thinking else "content"
        self.strip_ws = False  # drop whitespace at the start of the current part

    def _held_back(self) -> int:
        """Length of the tail of buf to hold: a possible start of an end marker, after trailing whitespace."""
        body = self.buf.rstrip()
        for k in range(min(len(body), max(map(len, self.p.markers)) - 1), 0, -1):
            if any(m.startswith(body[-k:]) for m in self.p.markers):
                body = body[:-k].rstrip()  # whitespace before "</thi" is dropped if the tag completes
                break
        return len(self.buf) - len(body)

    def _emit(self, kind: str, text: str) -> None:
        if self.strip_ws:
            text = text.lstrip()
            self.strip_ws = not text
        self.out.add(kind, text)

    def feed(self, delta: str) -> list[Piece]:
        self.buf += delta
        fam = self.p.family
        while self.buf:
            if self.state == "start":
                head = self.buf.lstrip()
                if head.startswith(fam.start):
                    self.buf, self.state, self.strip_ws = head[len(fam.start) :], "reasoning", True
                elif fam.start.startswith(head):
                    break  # maybe "<thi" so far: wait
                else:
                    self.state = "reasoning" if self.p.in_reasoning else "content"
                    self.strip_ws = self.p.in_reasoning
            elif self.state == "reasoning":
                hits = [(self.buf.find(m), m) for m in self.p.markers if m in self.buf]
                if hits:
                    i, marker = min(hits)
                    self._emit(REASONING, self.buf[:i].rstrip())
                    self.buf = self.buf[i + len(marker) :] if marker == fam.end else self.buf[i:]
                    self.state, self.strip_ws = "content", True
                    continue
                keep = self._held_back()
                self._emit(REASONING, self.buf[: len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep :]
                break
            else:
                self._emit(CONTENT, self.buf)
                self.buf = ""
        return self.out.take()

    def finish(self) -> list[Piece]:
        if self.state == "start":
            self.state = "reasoning" if self.p.in_reasoning else "content"
            self.strip_ws = self.p.in_reasoning
        if self.state == "reasoning":
            self._emit(REASONING, self.buf.rstrip())
        else:
            self._emit(CONTENT, self.buf)
        self.buf = ""
        return self.out.take()


DEEPSEEK_R1 = ThinkFamily("deepseek_r1", prompt_opens=True)  # R1-0528's template ends with "<think>\n"
# DeepSeek-V3.1/V3.2: `thinking` (default off); on, the template ends with "<think>", off with "</think>".
DEEPSEEK_V3 = ThinkFamily("deepseek_v3", prompt_opens=True, switch_key="thinking", default_on=False)
QWEN3 = ThinkFamily("qwen3", prompt_opens=False, switch_key="enable_thinking")  # the model writes <think>
GLM45 = ThinkFamily("glm45", prompt_opens=False, switch_key="enable_thinking")
# Kimi K2.5: `thinking` (default on) ends the generation prompt with <think> (off: <think></think>);
# K2-Thinking writes <think> itself (stripped). Reasoning may end at the tool-call section directly.
KIMI_K2 = ThinkFamily(
    "kimi_k2", prompt_opens=True, switch_key="thinking", implicit_ends=("<|tool_calls_section_begin|>",)
)
