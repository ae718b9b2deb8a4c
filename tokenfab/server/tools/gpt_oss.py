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

from tokenfab.server.reasoning.gpt_oss import (
    TOOL_CALL,
    TOOL_CALL_END,
    HarmonyEvent,
    HarmonyTextStream,
    encode_harmony_text,
)
from tokenfab.server.tools.base import ContentDelta, ToolCall, ToolCallDelta, new_call_id


@dataclass(frozen=True)
class ReasoningDelta:
    """Streamed reasoning (the analysis channel); the other deltas are `tools.base`'s."""

    text: str


HarmonyDelta = ReasoningDelta | ContentDelta | ToolCallDelta


@dataclass
class HarmonyParsed:
    reasoning: str | None
    content: str | None
    calls: list[ToolCall] = field(default_factory=list)


def _valid_arguments(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


class GptOssToolStream:
    """Streaming: `feed_ids`/`feed`/`finish` return `ReasoningDelta`, `ContentDelta` and, per complete call,
    one `ToolCallDelta` carrying its index, id, name and whole arguments."""

    def __init__(self) -> None:
        self.s = HarmonyTextStream()
        self.calls = 0
        self.pending: HarmonyEvent | None = None  # the call being written: name, arguments so far

    def _deltas(self, events: list[HarmonyEvent], final: bool = False) -> list[HarmonyDelta]:
        out: list[HarmonyDelta] = []
        for ev in events:
            if ev.kind == TOOL_CALL:
                if ev.name is not None:
                    self.pending = HarmonyEvent(TOOL_CALL, ev.text, ev.call_index, ev.name)
                elif self.pending is not None:
                    self.pending.text += ev.text
            elif ev.kind == TOOL_CALL_END:
                out += self._close_call()
            elif ev.text:
                out.append(ReasoningDelta(ev.text) if ev.kind == "reasoning" else ContentDelta(ev.text))
        if final and self.pending is not None:  # cut off inside a call
            if self.pending.text:
                out.append(ContentDelta(self.pending.text))
            self.pending = None
        return out

    def _close_call(self) -> list[HarmonyDelta]:
        call, self.pending = self.pending, None
        if call is None:
            return []
        if not (call.name and _valid_arguments(call.text)):
            return [ContentDelta(call.text)] if call.text else []
        self.calls += 1
        return [ToolCallDelta(index=self.calls - 1, id=new_call_id(), name=call.name, arguments=call.text)]

    def feed_ids(self, ids: list[int]) -> list[HarmonyDelta]:
        return self._deltas(self.s.feed_ids(ids))

    def feed(self, delta: str) -> list[HarmonyDelta]:
        return self._deltas(self.s.feed(delta))

    def finish(self) -> list[HarmonyDelta]:
        return self._deltas(self.s.finish(), final=True)


def collect(deltas: list[HarmonyDelta]) -> HarmonyParsed:
    """Join streamed deltas into one `HarmonyParsed` (what a non-streamed response returns)."""
    reasoning = "".join(d.text for d in deltas if isinstance(d, ReasoningDelta))
    content = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
    calls = [ToolCall(d.id or "", d.name or "", d.arguments) for d in deltas if isinstance(d, ToolCallDelta)]
    return HarmonyParsed(reasoning or None, content or None, calls)


class GptOssToolParser:
    """GPT-OSS (vLLM's ``--tool-call-parser openai``). Unlike the text parsers in this package it reads the
    raw completion (token ids, or text spelling the special tokens) and returns reasoning too, since the
    channels are parsed in one pass; the chat endpoint uses it in place of reasoning parser + tool parser."""

    name = "openai"

    def extract_ids(self, ids: list[int]) -> HarmonyParsed:
        s = GptOssToolStream()
        return collect(s.feed_ids(ids) + s.finish())

    def extract(self, text: str) -> HarmonyParsed:
        return self.extract_ids(encode_harmony_text(text))

    def stream(self) -> GptOssToolStream:
        return GptOssToolStream()
