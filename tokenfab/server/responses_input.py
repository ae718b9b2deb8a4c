"""``/v1/responses`` input -> the chat request it amounts to (``ChatCompletionRequest``), so a Responses request
is shaped by the chat path (``shaping.shape_responses``).

Instructions become a first system message, then come the stored conversation of ``previous_response_id`` and
the input items: messages, ``function_call`` items as assistant ``tool_calls``, ``function_call_output`` items as
``tool`` messages. ``text.format`` becomes a ``response_format``, ``reasoning.effort`` the template's kwargs.
Errors raised by the shared chat code name chat fields; `responses_names` renames them to this API's.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from typing import Any

from pydantic import ValidationError

from tokenfab.server.errors import APIError
from tokenfab.server.protocol import ChatCompletionRequest, JsonSchemaFormat, ResponseFormat
from tokenfab.server.responses_protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
)

_EFFORT = {"minimal": "low", "low": "low", "medium": "medium", "high": "high", "xhigh": "high"}
# parameter names of the chat path -> this API's
_PARAMS = [(re.compile(r"^tools\.(\d+)\.function\."), r"tools.\1."), (re.compile(r"^max_tokens$"), "max_output_tokens"),
           (re.compile(r"^messages.*"), "input"), (re.compile(r"^response_format.*"), "text.format")]


@contextlib.contextmanager
def responses_names() -> Iterator[None]:
    """Errors raised by the shared chat code name chat fields; say this API's names instead."""
    try:
        yield
    except APIError as e:
        if e.param:
            for pattern, repl in _PARAMS:
                e.param = pattern.sub(repl, e.param)
        e.message = re.sub(r"tools\[(\d+)\]\.function\.", r"tools[\1].", e.message)
        e.message = e.message.replace("max_tokens", "max_output_tokens").replace("response_format", "text.format")
        raise


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(getattr(p, "text", None) or getattr(p, "refusal", "") for p in content)


def conversation(body: ResponsesRequest, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation as chat messages (plain dicts): ``history`` then the input items. 400s name the item."""
    conv = [dict(m) for m in history]
    if isinstance(body.input, str):
        return conv + [{"role": "user", "content": body.input}]
    known_calls = {c["id"] for m in conv for c in m.get("tool_calls") or ()}
    for i, item in enumerate(body.input):
        if isinstance(item, MessageItem):
            conv.append({"role": item.role, "content": _text(item.content)})
        elif isinstance(item, FunctionCallItem):
            try:
                ok = isinstance(json.loads(item.arguments), dict)
            except ValueError:
                ok = False
            if not ok:
                raise APIError(400, f"input[{i}].arguments is not a JSON object's text", param=f"input.{i}.arguments")
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = conv[-1] if conv else None
            if last is not None and last["role"] == "assistant":  # calls join the assistant turn they belong to
                last["tool_calls"] = [*last.get("tool_calls", ()), call]  # a new list: history stays as stored
            else:
                conv.append({"role": "assistant", "content": "", "tool_calls": [call]})
            known_calls.add(item.call_id)
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in known_calls:
                raise APIError(400, f"input[{i}]: no function_call with call_id {item.call_id!r} comes before this "
                               "function_call_output (in input or the previous response)", param=f"input.{i}.call_id")
            conv.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
        else:
            assert isinstance(item, ReasoningItem)  # earlier reasoning is not put back into the prompt
    return conv


def chat_request(body: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request of ``messages`` (instructions included) with the request's sampling, tools and effort."""
    fields: dict[str, Any] = {"messages": messages, "temperature": body.temperature, "top_p": body.top_p,
                              "max_tokens": body.max_output_tokens, "parallel_tool_calls": body.parallel_tool_calls}
    effort = body.reasoning.effort if body.reasoning is not None else None
    if effort in _EFFORT:  # GPT-OSS: in Harmony's system message (other templates: template_kwargs)
        fields["reasoning_effort"] = _EFFORT[effort]
    if body.tools:
        fields["tools"] = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
                           for t in body.tools]
    choice = body.tool_choice
    if choice is not None:
        fields["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                       "function": {"name": choice.name}}
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:  # e.g. an empty conversation: cannot happen from a valid request
        raise APIError(400, f"input: {e.errors()[0].get('msg', 'invalid')}", param="input") from e


def text_format(body: ResponsesRequest) -> ResponseFormat | None:
    """``text.format`` as the chat path's ``response_format`` (None: plain text)."""
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat(type="json_object")
    if fmt.json_schema is None:
        raise APIError(400, "text.format.schema is required with type json_schema", param="text.format.schema")
    return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(
        name=fmt.name or "response", description=fmt.description, schema=fmt.json_schema, strict=fmt.strict))


def template_kwargs(body: ResponsesRequest) -> dict[str, Any] | None:
    """The chat template's kwargs for ``reasoning.effort`` (``none``: thinking off, for the templates that ask)."""
    effort = body.reasoning.effort if body.reasoning is not None else None
    if effort is None:
        return None
    if effort == "none":
        return {"enable_thinking": False, "thinking": False}
    return {"reasoning_effort": _EFFORT[effort]}
