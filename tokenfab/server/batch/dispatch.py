"""One batch line through the same handler an online request takes (no HTTP loopback): the body parsed by the
endpoint's request model, the handler called with the server state, the answer taken as (status, JSON body).
Every request a batch line submits goes in at the lowest priority (``BatchPriorityServer``)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Message

from tokenfab.engine.core.async_engine import RequestStream
from tokenfab.engine.requests.sampling_params import SamplingParams
from tokenfab.engine.requests.sequence import BACKGROUND_PRIORITY
from tokenfab.server.chat import create_chat_completion
from tokenfab.server.completions import create_completion
from tokenfab.server.errors import APIError, error_body, validation_message
from tokenfab.server.protocol import ChatCompletionRequest, CompletionRequest
from tokenfab.server.responses_api import ResponsesAPI
from tokenfab.server.responses_protocol import ResponsesRequest
from tokenfab.server.responses_store import ResponseStore
from tokenfab.server.serving import OpenAIServer

logger = logging.getLogger("tokenfab.server.batch")
BATCH_PRIORITY = BACKGROUND_PRIORITY  # background work under any scheduling policy: it yields to online requests
Handler = Callable[[Any, Request], Awaitable[Response]]


class BatchPriorityServer(OpenAIServer):
    """The online server's own state (the same object dictionary: tokenizer pool, metrics, engine), whose
    ``submit`` puts every request at the background priority, which the engine honours under any scheduling
    policy (see docs/batches.md on isolation)."""

    def __init__(self, server: OpenAIServer) -> None:
        self.__dict__ = server.__dict__  # a view of the same server: its __init__ is not run again

    async def submit(self, prompts: list[list[int]], params: SamplingParams, priority: int, arrival: float,
                     request_id: str, cache_salt: str | None = None) -> RequestStream:
        return await super().submit(prompts, params, BATCH_PRIORITY, arrival, request_id, cache_salt)


async def _never_disconnect() -> Message:
    await asyncio.Event().wait()  # a batch line has no client to lose; cancelled with its task
    return {"type": "http.disconnect"}


def _request(url: str) -> Request:
    return Request({"type": "http", "method": "POST", "path": url, "headers": [], "query_string": b""},
                   receive=_never_disconnect)


class LineRunner:
    """``await runner.run(url, body)`` -> (status_code, JSON body) exactly as the online endpoint answers."""

    def __init__(self, server: OpenAIServer, responses_store: ResponseStore | None = None) -> None:
        low = BatchPriorityServer(server)
        responses = ResponsesAPI(low, responses_store or ResponseStore(0, 1.0))
        self.routes: dict[str, tuple[type[BaseModel], Handler]] = {
            "/v1/chat/completions": (ChatCompletionRequest, lambda b, r: create_chat_completion(low, b, r)),
            "/v1/completions": (CompletionRequest, lambda b, r: create_completion(low, b, r)),
            "/v1/responses": (ResponsesRequest, responses.create),
        }

    async def run(self, url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        model, handler = self.routes[url]
        body = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "priority")}
        try:
            parsed = model.model_validate(body)
        except ValidationError as e:
            message, param, code = validation_message(RequestValidationError(e.errors()))
            return 400, error_body(400, message, param, code)
        try:
            response = await handler(parsed, _request(url))
        except APIError as e:
            return e.status, error_body(e.status, e.message, e.param, e.code, e.type)
        except Exception as e:  # a handler bug fails this line only, never the batch
            logger.exception("batch line on %s failed", url)
            return 500, error_body(500, f"internal server error: {type(e).__name__}")
        return response.status_code, json.loads(bytes(response.body))
