"""Tools and reasoning in the output of /v1/chat/completions (and /v1/responses): `ChoiceShaper`.

The request side (tools checked, `ToolPlan`) is ``tool_plan.py``, the grammars ``chat_grammar.py``.

- ``tool_choice: "required"`` and a named function are enforced by grammar (`chat_grammar.grammar_format`), so
  the call always parses and matches its schema, even from a model never trained on tools.
- ``tool_choice: "auto"`` reads calls out of the content with the model family's tool parser
  (``server/tools``); ``"none"`` (or no tools) leaves the content alone. Each call is checked before it is
  returned (`tool_plan.call_ok`: a tool of the request, arguments a JSON object valid against its
  ``parameters`` schema, by jsonschema). Non-streamed, one failing call turns the whole output back into
  content (as a malformed call does in the parsers). Streamed, a call is held back until it is complete and
  checked, then sent (its id, name and whole arguments in one delta) or, failing, sent as content (the model's
  own text of that call).
- ``strict: true`` tools in auto mode are also enforced by grammar for some families
  (`chat_grammar.strict_tag_format`).
- A reasoning parser (``server/reasoning``), when configured, splits reasoning off first; calls are read from
  the content only.

`ChoiceShaper` turns one choice's text into the OpenAI message (``final``, ``final_chunk``) or into stream
deltas (``feed``, ``feed_chunk``).
"""

from __future__ import annotations

import json
from typing import Any

from tokenfab.server.reasoning import CONTENT, ReasoningParser
from tokenfab.server.tool_plan import ToolPlan, call_ok
from tokenfab.server.tools import ContentDelta, ToolCallDelta, ToolParser, get_tool_parser
from tokenfab.server.tools.base import new_call_id

DEFAULT_TOOL_PARSER = "hermes"  # for models without a known tool format (e.g. the bundled SmolLM2)


def _call_json(index: int | None, call_id: str, name: str, arguments: str) -> dict[str, Any]:
    out: dict[str, Any] = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    if index is not None:
        out = {"index": index, **out}
    return out


def _constrained_calls(plan: ToolPlan, parser: ToolParser | None, text: str) -> list[dict[str, Any]] | None:
    """The calls of a grammar-constrained output, or None if it is not complete (e.g. cut by max_tokens).
    Arguments are the generated text itself (as streamed), not a re-serialisation."""
    if plan.mode == "named":
        try:
            ok = isinstance(json.loads(text), dict)
        except ValueError:
            ok = False
        return [_call_json(None, new_call_id(), plan.named or "", text)] if ok else None
    assert parser is not None
    if plan.parallel:
        text = _ArrayToSemicolons().feed(text)
    parsed = parser.extract(text)
    return [_call_json(None, c.id, c.name, c.arguments_json) for c in parsed.calls] or None


class _ArrayToSemicolons:
    """Rewrites a streamed JSON array of call objects as Llama-3 JSON calls (``{...};{...}``) so the
    llama3_json stream parser can emit its deltas: drops the outer brackets, turns top-level commas into ``;``."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escape = False

    def feed(self, text: str) -> str:
        out = []
        for ch in text:  # per character of the delta only (a few per token)
            if self.in_string:
                self.escape = not self.escape and ch == "\\"
                self.in_string = self.escape or ch != '"'
                out.append(ch)
                continue
            if ch == '"':
                self.in_string = True
            elif ch in "[{":
                self.depth += 1
                if self.depth == 1:
                    continue
            elif ch in "]}":
                self.depth -= 1
                if self.depth == 0:
                    continue
            elif ch == "," and self.depth == 1:
                ch = ";"
            out.append(ch)
        return "".join(out)


class ChoiceShaper:
    """One choice's output -> OpenAI message fields (final) or delta dicts (streaming)."""

    def __init__(self, plan: ToolPlan, tool_parser: str | None, reasoning: ReasoningParser | None) -> None:
        self.plan = plan
        self.reasoning = reasoning
        self.parser: ToolParser | None = None
        if plan.mode == "auto" and tool_parser != "openai":  # GPT-OSS (Harmony, on token ids): not wired yet
            self.parser = get_tool_parser(tool_parser or DEFAULT_TOOL_PARSER, plan.tools)
        elif plan.mode == "required":  # grammar output is Llama-3 JSON calls (an array rewritten by _ArrayTo...)
            self.parser = get_tool_parser("llama3_json", plan.tools)
        self._rstream = reasoning.stream() if reasoning is not None else None
        self._tstream = self.parser.stream() if self.parser is not None else None
        self._array = _ArrayToSemicolons() if plan.mode == "required" and plan.parallel else None
        self._named_id: str | None = None
        self.num_calls = 0
        self._held: list[Any] | None = None  # auto: [parser index, id, name, arguments] of the call being written

    def feed_chunk(self, chunk: Any) -> list[dict[str, Any]]:
        """The delta dicts for one engine `StreamChunk` (this shaper reads its text)."""
        return self.feed(chunk.delta_text) if chunk.delta_text else []

    def final_chunk(self, chunk: Any, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """`final` on the whole text of a choice's last engine `StreamChunk`."""
        return self.final(chunk.text or "", finish_reason)

    # ---- whole output ----
    def final(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """``(message, finish_reason)`` for the complete output ``text``."""
        message: dict[str, Any] = {"role": "assistant"}
        content: str | None = text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.extract(text)
            message["reasoning_content"] = message["reasoning"] = reasoning
        calls = None
        if self.plan.constrained:
            calls = _constrained_calls(self.plan, self.parser, content or "")
        elif self.parser is not None and content:
            parsed = self.parser.extract(content)
            if parsed.calls and all(call_ok(self.plan, c.name, c.arguments_json) for c in parsed.calls):
                content = parsed.content
                calls = [_call_json(None, c.id, c.name, c.arguments_json) for c in parsed.calls]
        if calls:
            message["content"] = content if not self.plan.constrained and content else None
            message["tool_calls"] = calls
            if finish_reason == "stop":
                finish_reason = "tool_calls"
        else:
            message["content"] = content if content is not None else ("" if self.reasoning is None else None)
        return message, finish_reason

    # ---- streaming ----
    def feed(self, delta_text: str) -> list[dict[str, Any]]:
        """The delta dicts for the next text delta (possibly none)."""
        if self._rstream is None:
            return self._content(delta_text)
        out: list[dict[str, Any]] = []
        for kind, piece in self._rstream.feed(delta_text):
            out.extend(self._content(piece) if kind == CONTENT else [{"reasoning_content": piece,
                                                                      "reasoning": piece}])
        return out

    def finish(self, finish_reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """Flush what was held back; the finish_reason (``tool_calls`` once a call was sent and it stopped)."""
        out: list[dict[str, Any]] = []
        if self._rstream is not None:
            for kind, piece in self._rstream.finish():
                out.extend(self._content(piece) if kind == CONTENT else [{"reasoning_content": piece,
                                                                          "reasoning": piece}])
        if self._tstream is not None:
            out.extend(self._tool_deltas(self._tstream.finish()))
            out.extend(self._release())
        if self.num_calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        return out, finish_reason

    def _content(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        if self.plan.mode == "named":
            out = []
            if self._named_id is None:
                self._named_id = new_call_id()
                self.num_calls = 1
                out.append({"tool_calls": [{"index": 0, "id": self._named_id, "type": "function",
                                            "function": {"name": self.plan.named, "arguments": ""}}]})
            out.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
            return out
        if self._tstream is None:
            return [{"content": text}]
        if self._array is not None:
            text = self._array.feed(text)
        return self._tool_deltas(self._tstream.feed(text))

    def _release(self) -> list[dict[str, Any]]:
        """auto: send the held call, now complete (or cut off), if it passes `call_ok`; else its text as content."""
        held, self._held = self._held, None
        if held is None:
            return []
        index, call_id, name, arguments = held
        if not call_ok(self.plan, name, arguments):
            text = self._tstream.call_text(index) if self._tstream is not None else arguments
            return [{"content": text}] if text else []
        self.num_calls += 1
        return [{"tool_calls": [_call_json(self.num_calls - 1, call_id, name, arguments)]}]

    def _tool_deltas(self, deltas: list[Any]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for d in deltas:
            if isinstance(d, ContentDelta):
                if d.text:
                    out.extend(self._release())  # content after a call: the call has ended
                    out.append({"content": d.text})
            elif isinstance(d, ToolCallDelta) and self.plan.mode == "auto":
                if d.id is not None:  # a new call: the one before it has ended
                    out.extend(self._release())
                    self._held = [d.index, d.id, d.name, d.arguments]
                elif self._held is not None:
                    self._held[3] += d.arguments
            elif isinstance(d, ToolCallDelta):
                call: dict[str, Any] = {"index": d.index}
                if d.id is not None:
                    self.num_calls = max(self.num_calls, d.index + 1)
                    call.update(id=d.id, type="function", function={"name": d.name, "arguments": d.arguments})
                else:
                    call["function"] = {"arguments": d.arguments}
                if d.id is not None or d.arguments:
                    out.append({"tool_calls": [call]})
        return out

