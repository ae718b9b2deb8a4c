"""GPT-OSS tool calls through Harmony: a ``commentary`` message addressed ``to=functions.NAME``.

Built on `tokenfab.server.reasoning.gpt_oss.HarmonyStream` (openai-harmony's `StreamableParser`), so one pass
over the completion gives reasoning (``analysis``), content (``final`` and recipient-less ``commentary``)
and calls. Works on token ids (exact) or on text that spells the special tokens.

A call is emitted whole, when its message ends (``<|call|>``, or ``<|end|>``). ``<|call|>`` is one of GPT-OSS's
stop tokens, so a call is the last thing generated and waiting for its end delays nothing the client could
use: it gets the arguments when the response finishes either way. Waiting is what lets a call that is cut
off (max_tokens) or malformed (arguments that are not a JSON object) come back as content instead, the same
whether streamed or not.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from tokenfab.server.reasoning.base import CONTENT, REASONING
from tokenfab.server.reasoning.gpt_oss import (
    TOOL_CALL,
    TOOL_CALL_END,
    HarmonyEvent,
    HarmonyTextStream,
    encode_harmony_text,
)


@dataclass
class HarmonyToolCall:
    index: int  # position among this response's valid calls
    name: str
    arguments: str  # JSON object text, as the model wrote it


@dataclass
class HarmonyParsed:
    reasoning: str | None
    content: str | None
    tool_calls: list[HarmonyToolCall] = field(default_factory=list)


def _valid_arguments(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


class GptOssToolStream:
    """Streaming: `feed_ids`/`feed` return ``(kind, value)`` with kind "reasoning"/"content" (value: text) or
    "tool_call" (value: a complete `HarmonyToolCall`)."""

    def __init__(self) -> None:
        self.s = HarmonyTextStream()
        self.calls = 0
        self.pending: HarmonyEvent | None = None  # the call being written: name, arguments so far

    def _events(self, events: list[HarmonyEvent], final: bool = False) -> list[tuple[str, object]]:
        out: list[tuple[str, object]] = []
        for ev in events:
            if ev.kind == TOOL_CALL:
                if ev.name is not None:
                    self.pending = HarmonyEvent(TOOL_CALL, ev.text, ev.call_index, ev.name)
                elif self.pending is not None:
                    self.pending.text += ev.text
            elif ev.kind == TOOL_CALL_END:
                out += self._close_call()
            elif ev.text:
                out.append((ev.kind, ev.text))
        if final and self.pending is not None:  # cut off inside a call
            out.append((CONTENT, self.pending.text))
            self.pending = None
        return out

    def _close_call(self) -> list[tuple[str, object]]:
        call, self.pending = self.pending, None
        if call is None:
            return []
        if not (call.name and _valid_arguments(call.text)):
            return [(CONTENT, call.text)] if call.text else []
        self.calls += 1
        return [(TOOL_CALL, HarmonyToolCall(self.calls - 1, call.name, call.text))]

    def feed_ids(self, ids: list[int]) -> list[tuple[str, object]]:
        return self._events(self.s.feed_ids(ids))

    def feed(self, delta: str) -> list[tuple[str, object]]:
        return self._events(self.s.feed(delta))

    def finish(self) -> list[tuple[str, object]]:
        return self._events(self.s.finish(), final=True)


def collect(events: list[tuple[str, object]]) -> HarmonyParsed:
    """Join stream events into one `HarmonyParsed` (what a non-streamed response returns)."""
    reasoning = "".join(v for k, v in events if k == REASONING)
    content = "".join(v for k, v in events if k == CONTENT)
    calls = [v for k, v in events if k == TOOL_CALL]
    return HarmonyParsed(reasoning or None, content or None, calls)


class GptOssToolParser:
    """``--tool-call-parser openai`` (vLLM's name for GPT-OSS) / ``gpt_oss``."""

    name = "gpt_oss"

    def extract_ids(self, ids: list[int]) -> HarmonyParsed:
        s = GptOssToolStream()
        return collect(s.feed_ids(ids) + s.finish())

    def extract(self, text: str) -> HarmonyParsed:
        return self.extract_ids(encode_harmony_text(text))

    def stream(self) -> GptOssToolStream:
        return GptOssToolStream()
