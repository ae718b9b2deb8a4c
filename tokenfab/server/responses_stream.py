"""Streaming ``/v1/responses``: chat-style deltas (from ``chat_tools.ChoiceShaper``) -> Responses events.

The events, each with a ``sequence_number`` counting from 0, in OpenAI's order::

    response.created, response.in_progress
    per output item, one after the other:
      reasoning:     output_item.added, content_part.added (reasoning_text), reasoning_text.delta...,
                     reasoning_text.done, content_part.done, output_item.done
      message:       output_item.added, content_part.added (output_text), output_text.delta...,
                     output_text.done, content_part.done, output_item.done
      function_call: output_item.added (call_id, name), function_call_arguments.delta...,
                     function_call_arguments.done, output_item.done
    response.completed (or response.incomplete when max_output_tokens cut it; response.failed on an engine error,
    after an ``error`` event)

An item opens when the first delta of its kind arrives and closes when a delta of another kind (or another
call) arrives, or at the end. The SSE frames carry ``event: TYPE`` and end with ``data: [DONE]`` (the official
client stops there; generic SSE consumers expect it).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Request

from tokenfab.engine.core.async_engine import RequestStream, StreamChunk
from tokenfab.server.chat_harmony import HarmonyShaper
from tokenfab.server.chat_tools import ChoiceShaper
from tokenfab.server.streaming import ClientGone, finish, stream_error, watch


def item_id(prefix: str) -> str:
    """OpenAI-style item ids: ``msg_``, ``rs_``, ``fc_`` and 48 hex digits."""
    return f"{prefix}_{secrets.token_hex(24)}"


def message_item(text: str, status: str = "completed", id: str | None = None) -> dict[str, Any]:
    return {"id": id or item_id("msg"), "type": "message", "role": "assistant", "status": status,
            "content": [output_text(text)]}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_item(text: str, status: str = "completed", id: str | None = None) -> dict[str, Any]:
    return {"id": id or item_id("rs"), "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def function_call_item(call_id: str, name: str, arguments: str, status: str = "completed",
                       id: str | None = None) -> dict[str, Any]:
    return {"id": id or item_id("fc"), "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


class EventBuilder:
    """Builds the output items and their events from the stream of chat deltas of one response."""

    def __init__(self) -> None:
        self.seq = 0
        self.items: list[dict[str, Any]] = []  # finished and open items, in output order
        self._open: dict[str, Any] | None = None  # the open item
        self._kind: tuple[str, int] | None = None  # ("reasoning"|"message", 0) or ("call", tool-call index)
        self._calls: dict[int, int] = {}  # tool-call index -> output index

    def event(self, type: str, **fields: Any) -> dict[str, Any]:
        out = {"type": type, **fields, "sequence_number": self.seq}
        self.seq += 1
        return out

    def feed(self, deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for d in deltas:
            if d.get("reasoning_content"):
                out += self._text(("reasoning", 0), d["reasoning_content"])
            if d.get("content"):
                out += self._text(("message", 0), d["content"])
            for call in d.get("tool_calls") or ():
                out += self._call(call)
        return out

    def close(self, incomplete: bool) -> list[dict[str, Any]]:
        """End of output: close the open item (``incomplete``: it was cut by the length limit). An output with
        no item at all gets one empty message, as a response always has."""
        if not self.items:
            self._open_item(("message", 0))
        return self._close("incomplete" if incomplete else "completed")

    # ---- items ----
    def _text(self, kind: tuple[str, int], text: str) -> list[dict[str, Any]]:
        out = [] if self._kind == kind else self._close() + self._open_item(kind)
        item, index = self._open, len(self.items) - 1
        assert item is not None
        part = item["content"][0]
        part["text"] += text
        name = "response.output_text.delta" if kind[0] == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind[0] == "message" else {}
        out.append(self.event(name, item_id=item["id"], output_index=index, content_index=0, delta=text, **extra))
        return out

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        index = call["index"]
        args = call.get("function", {}).get("arguments") or ""
        out: list[dict[str, Any]] = []
        if call.get("id") is not None:  # a new call: its header
            out += self._close() + self._open_item(("call", index), call)
        position = self._calls.get(index)
        if position is None:  # arguments of a call never announced: cannot happen with ChoiceShaper
            return out
        item = self.items[position]
        if args:
            item["arguments"] += args
            out.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                  output_index=position, delta=args))
        return out

    def _open_item(self, kind: tuple[str, int], call: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        index = len(self.items)
        if kind[0] == "call":
            assert call is not None
            item = function_call_item(call["id"], call["function"]["name"], "", status="in_progress")
            self._calls[kind[1]] = index
        elif kind[0] == "reasoning":
            item = reasoning_item("", status="in_progress")
        else:
            item = message_item("", status="in_progress")
        self.items.append(item)
        self._open, self._kind = item, kind
        out = [self.event("response.output_item.added", output_index=index, item=_copy(item, empty=True))]
        if kind[0] != "call":
            out.append(self.event("response.content_part.added", item_id=item["id"], output_index=index,
                                  content_index=0, part=_part(item, text="")))
        return out

    def _close(self, status: str = "completed") -> list[dict[str, Any]]:
        item, kind = self._open, self._kind
        if item is None or kind is None:
            return []
        self._open = self._kind = None
        index = self.items.index(item)
        item["status"] = status
        out = []
        if kind[0] == "call":
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                  arguments=item["arguments"]))
        else:
            text = item["content"][0]["text"]
            if kind[0] == "message":
                out.append(self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                      content_index=0, text=text, logprobs=[]))
            else:
                out.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                      content_index=0, text=text))
            out.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                  content_index=0, part=_part(item, text=text)))
        out.append(self.event("response.output_item.done", output_index=index, item=_copy(item)))
        return out


def _copy(item: dict[str, Any], empty: bool = False) -> dict[str, Any]:
    out = json.loads(json.dumps(item))
    if empty and out["type"] != "function_call":
        out["content"] = []  # added items carry no parts yet: content_part.added brings them
    return out


def _part(item: dict[str, Any], text: str) -> dict[str, Any]:
    part = dict(item["content"][0])
    part["text"] = text
    return part


def sse_event(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


Finalize = Callable[[list[dict[str, Any]], StreamChunk | None, str | None], Awaitable[dict[str, Any]]]


async def response_events(skeleton: dict[str, Any], request: Request, stream: RequestStream,
                          shaper: ChoiceShaper | HarmonyShaper, finalize: Finalize) -> AsyncIterator[str]:
    """The SSE body of a streamed response. ``skeleton``: the response object before any output;
    ``finalize(items, last_chunk, finish_reason)``: the finished response object (usage, status; stores it)."""
    b = EventBuilder()
    yield sse_event(b.event("response.created", response={**skeleton, "status": "in_progress"}))
    yield sse_event(b.event("response.in_progress", response={**skeleton, "status": "in_progress"}))
    watcher = watch(stream, request)
    try:
        last: StreamChunk | None = None
        reason: str | None = None
        async for chunk in stream:
            deltas = shaper.feed_chunk(chunk)
            if chunk.finished:
                last = chunk
                tail, reason = shaper.finish(finish(chunk.finish_reason))
                deltas += tail
            for e in b.feed(deltas):
                yield sse_event(e)
        for e in b.close(incomplete=reason == "length"):
            yield sse_event(e)
        response = await finalize(b.items, last, reason)
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        yield sse_event(b.event(kind, response=response))
    except ClientGone:
        return
    except Exception as e:  # engine failure mid-stream: report it in-band, to this client only
        err = stream_error(e, skeleton["id"])["error"]
        yield sse_event(b.event("error", code=err["code"] or "server_error", message=err["message"], param=None))
        failed = {**skeleton, "status": "failed", "output": b.items,
                  "error": {"code": "server_error", "message": err["message"]}}
        yield sse_event(b.event("response.failed", response=failed))
    finally:
        watcher.cancel()
        stream.abort()
    yield "data: [DONE]\n\n"


__all__ = ["EventBuilder", "function_call_item", "message_item", "reasoning_item",
           "response_events", "sse_event"]
