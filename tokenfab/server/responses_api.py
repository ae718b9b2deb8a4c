"""``/v1/responses`` (OpenAI's Responses API): the endpoints, the response object and the stored responses.

A request is shaped once by `shaping.shape_responses`: its input items become the chat request they amount to
(``responses_input.py``), which takes the chat path (tools, template or Harmony, grammar for ``tool_choice``
required/named or ``text.format``, the family's tool and reasoning parsers). The output shaper's message
becomes output items: ``reasoning`` (reasoning_text content), ``message`` (output_text), ``function_call``
(call_id, name, arguments); streaming is ``responses_stream.py``.

Stored responses (``store``, the default) keep the conversation (without instructions, as OpenAI does) in
``ResponseStore``; an unknown or expired ``previous_response_id`` is a 400 ``previous_response_not_found`` (as
OpenAI answers it), an unknown id in ``GET``/``DELETE /v1/responses/{id}`` a 404.
"""

from __future__ import annotations

import secrets
import time
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response

from tokenfab.engine.core.async_engine import StreamChunk
from tokenfab.server.errors import APIError
from tokenfab.server.responses import error_responses, sse_or_json
from tokenfab.server.responses_models import DeletedResponse, InputItemList, ResponseObject
from tokenfab.server.responses_protocol import ResponsesRequest
from tokenfab.server.responses_store import ResponseStore
from tokenfab.server.responses_stream import (
    function_call_item,
    item_id,
    message_item,
    reasoning_item,
    response_events,
)
from tokenfab.server.serving import OpenAIServer
from tokenfab.server.shaping import shape_responses
from tokenfab.server.streaming import EngineStreamingResponse, collect, finish


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
        shaped = await shape_responses(server, body, history)
        conv, num_prompt = shaped.messages, len(shaped.prompts[0])
        response_id = "resp_" + secrets.token_hex(24)
        stream = await server.submit(shaped.prompts, shaped.params, 0, arrival, response_id)
        shaper = shaped.shaper()
        skeleton = self._skeleton(body, response_id)

        async def finalize(items: list[dict[str, Any]], last: StreamChunk | None,
                           reason: str | None) -> dict[str, Any]:
            return await self._finish(body, skeleton, conv, items, num_prompt, last, reason)

        if body.stream:
            return EngineStreamingResponse(response_events(skeleton, request, stream, shaper, finalize), stream)
        last = (await collect(stream, request))[0][-1]
        message, reason = shaper.final_chunk(last, finish(last.finish_reason))
        return JSONResponse(await finalize(_output_items(message, reason == "length"), last, reason))

    def _skeleton(self, body: ResponsesRequest, response_id: str) -> dict[str, Any]:
        """The response object before any output (what ``response.created`` carries)."""
        fmt = body.text.format if body.text is not None and body.text.format is not None else None
        choice = body.tool_choice
        return {
            "id": response_id, "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "background": False, "error": None, "incomplete_details": None, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "model": body.model or self.server.model_name, "output": [],
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
