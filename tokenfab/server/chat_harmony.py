"""GPT-OSS in /v1/chat/completions through Harmony: token ids in, token ids out, no text template.

- The prompt is rendered by openai-harmony from the OpenAI messages (`reasoning/harmony_prompt.py`): the
  Harmony system message carries ``reasoning_effort`` (the request's top-level field, or
  ``chat_template_kwargs.reasoning_effort``), the developer message the instructions and function tools.
- The completion's token ids are parsed by Harmony's ``StreamableParser`` (`tools/gpt_oss.py`): ``analysis``
  -> ``reasoning_content`` (and ``reasoning``), ``commentary`` addressed ``to=functions.NAME`` -> ``tool_calls``
  (checked with `tool_plan.call_ok`: a call that is cut off, not JSON, or fails its schema is content),
  ``final`` and recipient-less ``commentary`` -> ``content``. Streamed and not, from the same parser, so the
  deltas add up to the non-streamed message.
- ``tool_choice`` required/named are grammar-enforced like every other model (`chat_grammar.grammar_format`),
  so their output is the JSON the grammar allows and is shaped by `ChoiceShaper`; for a named function the
  prompt already ends with that call's Harmony header (``<|channel|>commentary to=functions.NAME
  <|constrain|>json<|message|>``), so the model writes the arguments where it was trained to.
- A ``response_format`` (JSON) in auto/none mode: the prompt ends with ``<|channel|>final<|message|>``, so the
  grammar's JSON is the final answer and streams as content (`harmony_prefill`; the shaper is primed with it).
- ``<|return|>`` and ``<|call|>`` are added to the request's stop tokens.
"""

from __future__ import annotations

from typing import Any

from tokenfab.server.errors import APIError
from tokenfab.server.protocol import ChatCompletionRequest
from tokenfab.server.reasoning.harmony_prompt import gpt_oss_stop_token_ids, render_gpt_oss_prompt
from tokenfab.server.reasoning.harmony_vocab import HarmonyVocabUnavailable, harmony_encoding
from tokenfab.server.tool_plan import ToolPlan, call_ok
from tokenfab.server.tools.base import ContentDelta, ToolCallDelta
from tokenfab.server.tools.gpt_oss import GptOssToolStream, ReasoningDelta

HARMONY_TOOL_PARSER = "openai"
HARMONY_REASONING_PARSER = "gpt_oss"


def uses_harmony(tool_parser: str | None, reasoning_parser: str | None, body: ChatCompletionRequest) -> bool:
    """GPT-OSS's parsers are chosen (by model type or flag) and the request brings no text template."""
    harmony = tool_parser == HARMONY_TOOL_PARSER or reasoning_parser == HARMONY_REASONING_PARSER
    return harmony and body.chat_template is None


def reasoning_effort(body: ChatCompletionRequest) -> str | None:
    """The request's effort: the top-level field, else ``chat_template_kwargs.reasoning_effort``."""
    if body.reasoning_effort is not None:
        return body.reasoning_effort
    return body.chat_template_kwargs.reasoning_effort if body.chat_template_kwargs else None


def harmony_prefill(body: ChatCompletionRequest, plan: ToolPlan) -> str | None:
    """The start of the assistant's message that the prompt already holds (None: the model writes it)."""
    if plan.mode == "named":
        return f"<|channel|>commentary to=functions.{plan.named} <|constrain|>json<|message|>"
    if not plan.constrained and body.response_format is not None and body.response_format.type != "text":
        return "<|channel|>final<|message|>"
    return None


def render_harmony_prompt(body: ChatCompletionRequest, plan: ToolPlan) -> list[int]:
    """The prompt's token ids (CPU work: run it off the event loop). Bad input is a 400."""
    if body.continue_final_message or not body.add_generation_prompt:
        param = "continue_final_message" if body.continue_final_message else "add_generation_prompt"
        raise APIError(400, "GPT-OSS prompts are rendered by Harmony for a new assistant turn: "
                       "add_generation_prompt must be true and continue_final_message false", param=param)
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    tools = plan.tools if plan.tools and plan.mode != "none" else None
    try:
        ids = render_gpt_oss_prompt(messages, tools, reasoning_effort(body))
        prefill = harmony_prefill(body, plan)
        if prefill is not None:
            ids = ids + harmony_encoding().encode(prefill, allowed_special="all")
    except HarmonyVocabUnavailable as e:
        raise APIError(503, f"GPT-OSS prompts cannot be rendered on this server: {e}",
                       code="service_unavailable") from e
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from e
    return ids


def harmony_stop_token_ids() -> list[int]:
    """GPT-OSS's stop tokens: ``<|return|>`` ends an answer, ``<|call|>`` a tool call."""
    return gpt_oss_stop_token_ids()


class HarmonyShaper:
    """One choice of a GPT-OSS completion (tool_choice auto or none) -> OpenAI message / stream deltas, from
    its token ids. Same interface as `ChoiceShaper` (``feed_chunk``, ``finish``, ``final_chunk``). `prefill`:
    what the prompt already wrote of the message (`harmony_prefill`), read first so the parser is in step."""

    def __init__(self, plan: ToolPlan, prefill: str | None = None) -> None:
        self.plan = plan
        self._stream = GptOssToolStream()
        if prefill:
            self._stream.feed_ids(harmony_encoding().encode(prefill, allowed_special="all"))
        self.num_calls = 0

    def _shape(self, deltas: list[Any]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for d in deltas:
            if isinstance(d, ReasoningDelta):
                out.append({"reasoning_content": d.text, "reasoning": d.text})
            elif isinstance(d, ContentDelta):
                out.append({"content": d.text})
            elif isinstance(d, ToolCallDelta):  # a whole call (GptOssToolStream emits it when its message ends)
                if self.plan.mode != "auto" or not call_ok(self.plan, d.name, d.arguments):
                    out.append({"content": d.arguments})
                    continue
                out.append({"tool_calls": [{"index": self.num_calls, "id": d.id, "type": "function",
                                            "function": {"name": d.name, "arguments": d.arguments}}]})
                self.num_calls += 1
        return [d for d in out if next(iter(d.values()))]

    def feed_ids(self, ids: list[int]) -> list[dict[str, Any]]:
        return self._shape(self._stream.feed_ids(ids))

    def feed_chunk(self, chunk: Any) -> list[dict[str, Any]]:
        return self.feed_ids(chunk.delta_token_ids) if chunk.delta_token_ids else []

    def finish(self, finish_reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        out = self._shape(self._stream.finish())
        if self.num_calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        return out, finish_reason

    def final_chunk(self, chunk: Any, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """`final_ids` on the token ids of a choice's last engine `StreamChunk`."""
        return self.final_ids(chunk.token_ids or [], finish_reason)

    def final_ids(self, ids: list[int], finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """``(message, finish_reason)`` for the whole completion: the stream's deltas, joined."""
        deltas = self.feed_ids(ids)
        tail, finish_reason = self.finish(finish_reason)
        deltas += tail
        reasoning = "".join(d.get("reasoning_content", "") for d in deltas) or None
        content = "".join(d.get("content", "") for d in deltas) or None
        calls = [{k: v for k, v in tc.items() if k != "index"} for d in deltas for tc in d.get("tool_calls", ())]
        message: dict[str, Any] = {"role": "assistant", "content": content, "reasoning_content": reasoning,
                                   "reasoning": reasoning}
        if calls:
            message["tool_calls"] = calls
        return message, finish_reason
