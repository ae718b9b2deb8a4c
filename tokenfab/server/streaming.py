"""Consuming an engine ``RequestStream`` over HTTP: SSE framing, disconnect detection, collection."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from tokenfab.engine.core.async_engine import RequestStream, StreamChunk
from tokenfab.engine.requests.errors import EngineDeadError, RequestFailedError
from tokenfab.server.errors import APIError, error_body

logger = logging.getLogger("tokenfab.server")


class ClientGone(Exception):
    pass


class EngineStreamingResponse(StreamingResponse):
    """SSE response that aborts its engine request however the response ends (even when the
    client is gone before the body generator ever started)."""

    def __init__(self, content: AsyncIterator[str], stream: RequestStream) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._engine_stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._engine_stream.abort()


def sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


def finish(reason: str | None) -> str | None:
    if reason == "abort":
        return "stop"
    return reason


def usage(prompt_tokens: int, completion_tokens: int,
          finals: dict[int, list[StreamChunk]] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                           "total_tokens": prompt_tokens + completion_tokens}
    if finals:
        cached = {}
        for chunks in finals.values():
            if chunks:
                cached[chunks[-1].prompt_index] = chunks[-1].num_cached_tokens
        out["prompt_tokens_details"] = {"cached_tokens": sum(cached.values())}
    return out


def generated_tokens(chunks: list[StreamChunk]) -> tuple[list[int], list]:
    """A choice's generated token ids and their logprobs (empty where none were asked), over its chunks."""
    return ([t for c in chunks for t in c.delta_token_ids],
            [lp for c in chunks for lp in (c.delta_logprobs or [])])


async def sse_body(events: AsyncIterator[str], stream: RequestStream, request: Request,
                   request_id: str) -> AsyncIterator[str]:
    """An endpoint's SSE events, then ``data: [DONE]``: the client watched meanwhile (a disconnect aborts
    the request and ends the body, without [DONE]); an engine failure mid-stream reported in-band, to this
    client only; the request aborted however the body ends."""
    watcher = watch(stream, request)
    try:
        async for event in events:
            yield event
    except ClientGone:
        return
    except Exception as e:  # engine failure mid-stream: report it in-band, to this client only
        yield sse(stream_error(e, request_id))
    finally:
        watcher.cancel()
        stream.abort()
    yield sse("[DONE]")


def watch(stream: RequestStream, request: Request) -> asyncio.Task:
    """A task that aborts ``stream`` as soon as the client disconnects (cancel it when done)."""
    return asyncio.create_task(_watch_disconnect(stream, request))


async def _watch_disconnect(stream: RequestStream, request: Request) -> None:
    with contextlib.suppress(Exception, asyncio.CancelledError):
        while not stream.finished:
            message = await request.receive()
            if message.get("type") == "http.disconnect":
                if not stream.finished:
                    logger.info("client disconnected: aborting %s", stream.request_id)
                    stream.abort(ClientGone())
                return


async def collect(stream: RequestStream, request: Request) -> dict[int, list[StreamChunk]]:
    """Every chunk of every choice, by choice index (non-streamed responses)."""
    by_index: dict[int, list[StreamChunk]] = {i: [] for i in range(stream.num_choices)}
    watcher = watch(stream, request)
    try:
        async for chunk in stream:
            by_index[chunk.index].append(chunk)
    except ClientGone as e:
        raise APIError(499, "client disconnected") from e
    except EngineDeadError as e:
        raise APIError(503, str(e), code="service_unavailable") from e
    except RequestFailedError as e:  # this request failed inside a step; the others go on
        raise APIError(500, f"the request failed in the engine: {e}", code="request_failed") from e
    except ValueError as e:
        raise APIError(400, str(e)) from e
    finally:
        watcher.cancel()
        stream.abort()
    return by_index


def stream_error(error: BaseException, request_id: str) -> dict[str, Any]:
    """The in-band error event of a stream that failed after its 200 was sent."""
    if isinstance(error, EngineDeadError):
        return error_body(503, str(error), code="service_unavailable")
    if isinstance(error, RequestFailedError):
        return error_body(500, f"the request failed in the engine: {error}", code="request_failed")
    logger.error("stream %s failed", request_id, exc_info=error)
    return error_body(500, f"generation failed: {error}")
