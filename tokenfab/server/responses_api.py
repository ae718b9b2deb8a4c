"""``/v1/responses`` (OpenAI's Responses API): input items -> a chat conversation -> the chat endpoint's machinery.

A request is turned into the chat request it amounts to (instructions as a first system message, the stored
conversation of ``previous_response_id``, then the input items: messages, ``function_call`` items as assistant
``tool_calls``, ``function_call_output`` items as ``tool`` messages), and from there runs the chat path's own
pieces: ``chat_tools.check_request`` (tools, tool_choice), the chat template with ``tools``, the grammar for
``tool_choice`` required/named or ``text.format`` (xgrammar), the family's tool and reasoning parsers, and
``ChoiceShaper`` to split the output. Its message becomes output items: ``reasoning`` (reasoning_text content),
``message`` (output_text), ``function_call`` (call_id, name, arguments); streaming is ``responses_stream.py``.

Stored responses (``store``, the default) keep the conversation (without instructions, as OpenAI does) in
``ResponseStore``; an unknown or expired ``previous_response_id`` is a 400 ``previous_response_not_found`` (as
OpenAI answers it), an unknown id in ``GET``/``DELETE /v1/responses/{id}`` a 404.
"""

from __future__ import annotations

import contextlib
import json
import re
import secrets
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Annotated, Any, Literal

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from tokenfab.engine.core.async_engine import StreamChunk
from tokenfab.server.chat import parser_names
from tokenfab.server.chat_harmony import HarmonyShaper, harmony_stop_token_ids, render_harmony_prompt, uses_harmony
from tokenfab.server.chat_tools import ChoiceShaper, check_request, grammar_format
from tokenfab.server.errors import APIError
from tokenfab.server.protocol import ChatCompletionRequest, JsonSchemaFormat, ResponseFormat
from tokenfab.server.reasoning import get_reasoning_parser
from tokenfab.server.responses import error_responses, sse_or_json
from tokenfab.server.responses_models import DeletedResponse, InputItemList, ResponseObject
from tokenfab.server.responses_protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
)
from tokenfab.server.responses_store import ResponseStore
from tokenfab.server.responses_stream import (
    function_call_item,
    item_id,
    message_item,
    reasoning_item,
    response_events,
)
from tokenfab.server.streaming import EngineStreamingResponse, collect, finish

if TYPE_CHECKING:
    from tokenfab.server.serving import OpenAIServer

_EFFORT = {"minimal": "low", "low": "low", "medium": "medium", "high": "high", "xhigh": "high"}
# parameter names of the chat path -> this API's
_PARAMS = [(re.compile(r"^tools\.(\d+)\.function\."), r"tools.\1."), (re.compile(r"^max_tokens$"), "max_output_tokens"),
           (re.compile(r"^messages.*"), "input"), (re.compile(r"^response_format.*"), "text.format")]


@contextlib.contextmanager
def _responses_names() -> Iterator[None]:
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


def _chat_request(body: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    fields: dict[str, Any] = {"messages": messages, "temperature": body.temperature, "top_p": body.top_p,
                              "max_tokens": body.max_output_tokens, "parallel_tool_calls": body.parallel_tool_calls}
    effort = body.reasoning.effort if body.reasoning is not None else None
    if effort in _EFFORT:  # GPT-OSS: in Harmony's system message (other templates: _template_kwargs)
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


def _text_format(body: ResponsesRequest) -> ResponseFormat | None:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat(type="json_object")
    if fmt.json_schema is None:
        raise APIError(400, "text.format.schema is required with type json_schema", param="text.format.schema")
    return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(
        name=fmt.name or "response", description=fmt.description, schema=fmt.json_schema, strict=fmt.strict))


def _template_kwargs(body: ResponsesRequest) -> dict[str, Any] | None:
    effort = body.reasoning.effort if body.reasoning is not None else None
    if effort is None:
        return None
    if effort == "none":
        return {"enable_thinking": False, "thinking": False}
    return {"reasoning_effort": _EFFORT[effort]}


class ResponsesAPI:
    """The endpoints of ``/v1/responses`` over one ``OpenAIServer`` and its response store."""

    def __init__(self, server: OpenAIServer, store: ResponseStore) -> None:
        self.server = server
        self.store = store

    def _stored(self, response_id: str, param: str, code: str) -> Any:
        """The stored entry. Unknown or expired: OpenAI's answers, a 400 for ``previous_response_id`` (the request
        is invalid), a 404 for ``GET``/``DELETE`` of the resource."""
        entry = self.store.get(response_id)
        if entry is None:
            if param == "previous_response_id":
                raise APIError(400, f"Previous response with id '{response_id}' not found.", param=param, code=code)
            raise APIError(404, f"Response with id '{response_id}' not found.", param=param, code=code,
                           type="invalid_request_error")
        return entry

    def retrieve(self, response_id: str) -> dict[str, Any]:
        return self._stored(response_id, "response_id", "response_not_found").response

    def input_items(self, response_id: str, limit: int, order: str, after: str | None) -> dict[str, Any]:
        """One page of the request's input items (OpenAI's list: newest first unless ``order`` is asc)."""
        items = list(self._stored(response_id, "response_id", "response_not_found").input_items)
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [it["id"] for it in items]
            if after not in ids:
                raise APIError(400, f"after: no input item {after!r} in response {response_id!r}", param="after")
            items = items[ids.index(after) + 1:]
        page = items[:limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}

    def delete(self, response_id: str) -> dict[str, Any]:
        self._stored(response_id, "response_id", "response_not_found")
        self.store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    async def create(self, body: ResponsesRequest, request: Request) -> Response:
        arrival = time.monotonic()
        server = self.server
        server.check_model(body.model)
        history: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            history = self._stored(body.previous_response_id, "previous_response_id",
                                   "previous_response_not_found").messages
        conv = conversation(body, history)
        prompt_messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + conv
        with _responses_names():
            chat = _chat_request(body, prompt_messages)
            plan = check_request(chat)
            template_kwargs = _template_kwargs(body)
            kwargs = dict(template_kwargs or {})
            if plan.tools and plan.mode != "none":
                kwargs["tools"] = plan.tools
            tool_parser, reasoning_name = parser_names(server)
            harmony = uses_harmony(tool_parser, reasoning_name, chat)
            text: str | None = None
            if harmony:  # GPT-OSS: openai-harmony renders the prompt's token ids (chat_harmony.py)
                ids = await server.offload(render_harmony_prompt, chat, plan, param="input")
            else:
                text = await server.render_chat(chat.messages, True, False, kwargs or None, None)
                ids = await server.tokenize(text, add_special_tokens=False, param="input")
            max_tokens = server.check_length(len(ids), body.max_output_tokens, body.max_output_tokens is not None,
                                             "input")
            tool_format, text_format = grammar_format(plan), _text_format(body)
            if tool_format is not None and text_format is not None:
                raise APIError(400, f"tool_choice {plan.mode} is enforced by a grammar and cannot be combined with "
                               "text.format", param="text.format")
            constraint = await server.build_constraint(tool_format or text_format)
            reasoning = (get_reasoning_parser(reasoning_name, chat_template_kwargs=template_kwargs, prompt=text)
                         if reasoning_name and not harmony else None)
            params = server.sampling_params(chat, max_tokens, None, constraint)
            if harmony:  # <|return|> ends an answer, <|call|> a tool call
                params.stop_token_ids = sorted({*params.stop_token_ids, *harmony_stop_token_ids()})
            server.check_request([ids], params, "input")
        response_id = "resp_" + secrets.token_hex(24)
        stream = await server.submit([ids], params, 0, arrival, response_id)
        shaper: ChoiceShaper | HarmonyShaper = (HarmonyShaper(plan) if harmony and not plan.constrained
                                                else ChoiceShaper(plan, None if harmony else tool_parser, reasoning))
        skeleton = self._skeleton(body, response_id)

        async def finalize(items: list[dict[str, Any]], last: StreamChunk | None,
                           reason: str | None) -> dict[str, Any]:
            return await self._finish(body, skeleton, conv, items, len(ids), last, reason)

        if body.stream:
            return EngineStreamingResponse(response_events(skeleton, request, stream, shaper, finalize), stream)
        last = (await collect(stream, request))[0][-1]
        if isinstance(shaper, HarmonyShaper):
            message, reason = shaper.final_ids(last.token_ids or [], finish(last.finish_reason))
        else:
            message, reason = shaper.final(last.text or "", finish(last.finish_reason))
        return JSONResponse(await finalize(_output_items(message, reason == "length"), last, reason))

    def _skeleton(self, body: ResponsesRequest, response_id: str) -> dict[str, Any]:
        """The response object before any output (what ``response.created`` carries)."""
        fmt = body.text.format if body.text is not None and body.text.format is not None else None
        choice = body.tool_choice
        return {
            "id": response_id, "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "background": False, "error": None, "incomplete_details": None, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "model": self.server.model_name, "output": [],
            "parallel_tool_calls": body.parallel_tool_calls, "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": body.reasoning.effort if body.reasoning else None,
                          "summary": body.reasoning.summary if body.reasoning else None},
            "store": body.store, "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "tool_choice": (choice if isinstance(choice, str) else choice.model_dump()) if choice is not None
            else ("auto" if body.tools else "none"),
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or ()],
            "top_p": 1.0 if body.top_p is None else body.top_p, "truncation": "disabled", "usage": None,
            "user": body.user, "metadata": dict(body.metadata or {}),
        }

    async def _finish(self, body: ResponsesRequest, skeleton: dict[str, Any], conv: list[dict[str, Any]],
                      items: list[dict[str, Any]], num_prompt: int, last: StreamChunk | None,
                      reason: str | None) -> dict[str, Any]:
        """The finished response object (status, usage); stored when ``store``."""
        output_tokens = len(last.token_ids or []) if last is not None else 0
        reasoning = "".join(c["text"] for it in items if it["type"] == "reasoning" for c in it["content"])
        reasoning_tokens = len(await self.server.tokenize(reasoning, False, "input")) if reasoning else 0
        incomplete = reason == "length"
        response = {
            **skeleton, "status": "incomplete" if incomplete else "completed", "output": items,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "completed_at": None if incomplete else int(time.time()),
            "usage": {"input_tokens": num_prompt,
                      "input_tokens_details": {"cached_tokens": last.num_cached_tokens if last else 0,
                                               "cache_write_tokens": 0},
                      "output_tokens": output_tokens,
                      "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, output_tokens)},
                      "total_tokens": num_prompt + output_tokens},
        }
        if body.store:
            self.store.put(response["id"], response, conv + [_assistant_message(items)], _input_items(body))
        return response


def _output_items(message: dict[str, Any], incomplete: bool) -> list[dict[str, Any]]:
    """A chat message (``ChoiceShaper.final``) as Responses output items; the last is incomplete if cut."""
    items = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(message["reasoning_content"]))
    if message.get("content") or not (message.get("tool_calls") or items):
        items.append(message_item(message.get("content") or ""))
    for call in message.get("tool_calls") or ():
        items.append(function_call_item(call["id"], call["function"]["name"], call["function"]["arguments"]))
    if incomplete:
        items[-1]["status"] = "incomplete"
    return items


_ITEM_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def _input_items(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as the API lists it: every item with an id, message content as parts."""
    if isinstance(body.input, str):
        return [{"id": item_id("msg"), "type": "message", "role": "user", "status": "completed",
                 "content": [{"type": "input_text", "text": body.input}]}]
    out = []
    for item in body.input:
        d = item.model_dump(exclude_none=True)
        d.setdefault("id", item_id(_ITEM_PREFIX[d["type"]]))
        if d["type"] == "message" and isinstance(d["content"], str):
            kind = "output_text" if d["role"] == "assistant" else "input_text"
            d["content"] = [{"type": kind, "text": d["content"]}]
        out.append(d)
    return out


def _assistant_message(items: list[dict[str, Any]]) -> dict[str, Any]:
    """The output as the assistant chat message that continues the conversation (reasoning left out)."""
    content = "".join(c["text"] for it in items if it["type"] == "message" for c in it["content"])
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    calls = [{"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": it["arguments"]}}
             for it in items if it["type"] == "function_call"]
    if calls:
        msg["tool_calls"] = calls
    return msg


def add_routes(app: FastAPI, server: OpenAIServer, store: ResponseStore, auth: tuple[int, ...]) -> ResponsesAPI:
    """Register POST /v1/responses, GET and DELETE /v1/responses/{response_id}, GET .../input_items."""
    api = ResponsesAPI(server, store)

    @app.post("/v1/responses", response_model=None,
              responses={**sse_or_json(ResponseObject, "The response"),
                         **error_responses(400, *auth, 413, 429, 500, 503)})
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        return await api.create(body, request)

    @app.get("/v1/responses/{response_id}", response_model=ResponseObject, responses=error_responses(*auth, 404))
    async def retrieve_response(response_id: str) -> dict[str, Any]:
        return api.retrieve(response_id)

    @app.get("/v1/responses/{response_id}/input_items", response_model=InputItemList,
             responses=error_responses(400, *auth, 404))
    async def list_input_items(response_id: str, limit: Annotated[int, Query(ge=1, le=100)] = 20,
                               order: Literal["asc", "desc"] = "desc", after: str | None = None) -> dict[str, Any]:
        return api.input_items(response_id, limit, order, after)

    @app.delete("/v1/responses/{response_id}", response_model=DeletedResponse, responses=error_responses(*auth, 404))
    async def delete_response(response_id: str) -> dict[str, Any]:
        return api.delete(response_id)

    return api
