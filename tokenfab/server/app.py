"""The OpenAI-compatible HTTP API over an ``AsyncEngine`` (FastAPI): app assembly.

Routes: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics, /tokenize,
/detokenize. Every error is OpenAI's body ``{"error": {"message", "type", "param", "code"}}``;
bad input is a 400 (FastAPI's 422 for validation errors and malformed JSON included).

The endpoints live in ``completions.py`` and ``chat.py``, shared state and checks in
``serving.py``, errors in ``errors.py``, the API-key middleware in ``auth.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tokenfab.engine.async_engine import AsyncEngine
from tokenfab.server.auth import AuthMiddleware
from tokenfab.server.chat import create_chat_completion
from tokenfab.server.completions import create_completion
from tokenfab.server.errors import APIError, error_body, error_response, install_exception_handlers
from tokenfab.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from tokenfab.server.serving import OpenAIServer, ServerConfig

__all__ = ["APIError", "OpenAIServer", "ServerConfig", "build_app", "error_body", "error_response"]


def build_app(engine: AsyncEngine, config: ServerConfig | None = None) -> FastAPI:
    """The FastAPI app; its lifespan starts the engine thread and drains it on shutdown."""
    config = config or ServerConfig()
    server = OpenAIServer(engine, config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        # uvicorn has already waited for in-flight HTTP requests (graceful shutdown); drain what
        # remains in the engine, then stop its thread.
        await asyncio.to_thread(engine.shutdown, config.drain_timeout)

    app = FastAPI(title="tokenfab", version="0.1.0", lifespan=lifespan)
    app.state.server = server
    install_exception_handlers(app, server.metrics.error)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(server, body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(server, body, request)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return server.models()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != server.model_name:
            raise APIError(404, f"The model '{model_id}' does not exist", param="model",
                           code="model_not_found")
        return server.model_card().model_dump()

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_running:
            return error_response(503, f"engine is not running: {engine.error!r}")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        return await server.tokenize_endpoint(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        return await server.detokenize_endpoint(body)

    if config.api_key:
        app.add_middleware(AuthMiddleware, api_key=config.api_key, on_reject=server.metrics.error)
    return app
