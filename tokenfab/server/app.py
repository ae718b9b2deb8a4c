"""The OpenAI-compatible HTTP API over an ``AsyncEngine`` (FastAPI): app assembly.

Routes: /v1/completions, /v1/chat/completions, /v1/responses (``responses_api.py``), /v1/models, /health,
/metrics, /tokenize, /detokenize. Every error is OpenAI's body ``{"error": {"message", "type", "param", "code"}}``;
bad input is a 400 (FastAPI's 422 for validation errors and malformed JSON included), a body over
``--max-request-bytes`` a 413, a full queue a 429, a dead engine a 503. The OpenAPI document
(``/openapi.json``) lists every status a route answers, with its body schema.

The endpoints live in ``completions.py`` and ``chat.py``; each shapes its request into engine inputs in one
pass (``shaping.py``). Shared state and checks are in ``serving.py``, errors in ``errors.py``, the API-key
middleware in ``auth.py``, the body limit in ``limits.py``, request and response models in ``protocol.py`` and
``responses.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from tokenfab.engine.core.async_engine import AsyncEngine
from tokenfab.server.auth import AuthMiddleware
from tokenfab.server.batch.config import BatchConfig
from tokenfab.server.batch.routes import UPLOAD_PATH, BatchService
from tokenfab.server.batch.routes import add_routes as add_batch_routes
from tokenfab.server.chat import create_chat_completion
from tokenfab.server.completions import create_completion
from tokenfab.server.errors import APIError, error_body, error_response, install_exception_handlers
from tokenfab.server.finetune.config import FineTuningConfig
from tokenfab.server.finetune.routes import FineTuningService
from tokenfab.server.finetune.routes import add_routes as add_fine_tuning_routes
from tokenfab.server.fleet_routes import add_routes as add_fleet_routes
from tokenfab.server.limits import BodySizeLimitMiddleware
from tokenfab.server.lora_routes import add_routes as add_lora_routes
from tokenfab.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from tokenfab.server.responses import (
    ChatCompletionResponse,
    CompletionResponse,
    DetokenizeResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
    error_responses,
    sse_or_json,
)
from tokenfab.server.responses_api import add_routes as add_responses_routes
from tokenfab.server.responses_store import ResponseStore
from tokenfab.server.serving import OpenAIServer, ServerConfig

__all__ = ["APIError", "OpenAIServer", "ServerConfig", "build_app", "error_body", "error_response"]


def build_app(engine: AsyncEngine, config: ServerConfig | None = None, batch: BatchConfig | None = None,
              fine_tuning: FineTuningConfig | None = None) -> FastAPI:
    """The FastAPI app; its lifespan starts the engine thread and drains it on shutdown. With ``batch``, the
    Files and Batches APIs (``batch/``) and their worker; with ``fine_tuning`` too, /v1/fine_tuning/jobs
    (``finetune/``) on the same database."""
    config = config or ServerConfig()
    server = OpenAIServer(engine, config)
    responses_store = ResponseStore(config.responses_store_size, config.responses_ttl)
    batches = BatchService(server, batch, responses_store) if batch is not None else None
    tuning = FineTuningService(server, batches, fine_tuning) if batches is not None and fine_tuning else None

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        if batches is not None:
            batches.start()
        if tuning is not None:
            tuning.start()
        yield
        if tuning is not None:  # a running job's training process is killed; the job fails after the lease
            await tuning.stop()
        if batches is not None:  # its lines in flight are aborted; they run again after a restart
            await batches.stop()
        # uvicorn has already waited for in-flight HTTP requests (graceful shutdown); drain what
        # remains in the engine, then stop its thread.
        await asyncio.to_thread(engine.shutdown, config.drain_timeout)
        server.close()

    app = FastAPI(title="tokenfab", version="0.1.0", lifespan=lifespan)
    app.state.server = server
    app.state.batches = batches
    app.state.fine_tuning = tuning
    install_exception_handlers(app, server.metrics.error)
    auth = (401,) if config.api_key else ()
    body_errors = error_responses(400, *auth, 413, 503)
    generation_errors = error_responses(400, *auth, 413, 429, 500, 503)

    @app.post("/v1/completions", response_model=None,
              responses={**sse_or_json(CompletionResponse, "The completion"), **generation_errors})
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(server, body, request)

    @app.post("/v1/chat/completions", response_model=None,
              responses={**sse_or_json(ChatCompletionResponse, "The chat completion"), **generation_errors})
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(server, body, request)

    add_responses_routes(app, server, responses_store, auth)
    if batches is not None:
        add_batch_routes(app, batches, auth)
    if tuning is not None:
        add_fine_tuning_routes(app, tuning, auth)
    add_lora_routes(app, server)  # --enable-lora: /v1/load_lora_adapter, /v1/unload_lora_adapter
    add_fleet_routes(app, server)  # what the routers call: /get_load, server and model info, /health_generate

    @app.get("/v1/models", response_model=ModelList, responses=error_responses(*auth))
    async def models() -> dict[str, Any]:
        return server.models()

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=error_responses(*auth, 404))
    async def model(model_id: str) -> dict[str, Any]:
        for card in server.models()["data"]:  # the base model, then the LoRA adapters (--enable-lora)
            if card["id"] == model_id:
                return card
        raise APIError(404, f"The model '{model_id}' does not exist", param="model", code="model_not_found")

    @app.get("/health", response_model=HealthResponse, responses=error_responses(503))
    async def health() -> Response:
        if engine.is_dead:
            return error_response(503, f"The engine is dead: {engine.error}", code="engine_dead")
        if not engine.is_running:
            return error_response(503, "The engine is not running", code="service_unavailable")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus text format",
                              "content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/tokenize", response_model=TokenizeResponse, responses=body_errors)
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        return await server.tokenize_endpoint(body)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=body_errors)
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        return await server.detokenize_endpoint(body)

    # with --enable-lora, adapters loaded at run time are valid model names too: no fixed list then
    _document_truthfully(app, None if server.loras.enabled else server.model_name,
                         priority=engine.scheduling_policy == "priority",
                         chat_template=config.trust_request_chat_template)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=config.max_request_bytes, on_reject=server.metrics.error,
                       exempt=(UPLOAD_PATH,) if batches is not None else ())
    if config.api_key:  # outermost: no body is read for a request without the key
        app.add_middleware(AuthMiddleware, api_key=config.api_key, on_reject=server.metrics.error)
    return app


def _document_truthfully(app: FastAPI, model_name: str | None, priority: bool, chat_template: bool) -> None:
    """Corrections to FastAPI's document, so that it says what this server accepts: no 422 (it
    answers 400 instead); ``model`` is the one name it serves (or absent), not any string;
    ``priority`` is 0 unless it runs the priority policy; ``suffix`` must be empty; a request's
    ``chat_template`` is null unless trusted."""
    original = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = original()
            for path in schema.get("paths", {}).values():
                for op in path.values():
                    op.get("responses", {}).pop("422", None)
                    for param in op.get("parameters", []):
                        if param.get("name") == "model_id" and model_name is not None:
                            param["schema"] = {"type": "string", "enum": [model_name], "title": "Model Id"}
            schemas = schema.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
            for name in ("CompletionRequest", "ChatCompletionRequest", "TokenizeRequest", "DetokenizeRequest",
                         "ResponsesRequest"):
                props = schemas.get(name, {}).get("properties", {})
                if "model" in props and model_name is not None:
                    props["model"] = {"anyOf": [{"type": "string", "enum": [model_name]}, {"type": "null"}],
                                      "title": "Model", "description": "the served model's name"}
                if "priority" in props and not priority:
                    props["priority"] = {**props["priority"], "minimum": 0, "maximum": 0}
                if "suffix" in props:
                    props["suffix"] = {**props["suffix"], "anyOf": [{"type": "string", "maxLength": 0},
                                                                    {"type": "null"}]}
                if "chat_template" in props and not chat_template:
                    props["chat_template"] = {**props["chat_template"], "anyOf": [{"type": "null"}]}
            _json_schema_bounds(schema)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


_BOUNDS = {"ge": "minimum", "le": "maximum", "gt": "exclusiveMinimum", "lt": "exclusiveMaximum"}


def _json_schema_bounds(node: Any) -> None:
    """Pydantic writes the bounds of a constrained type that has its own validator (our ``Int``) as
    "ge"/"le", which JSON Schema does not know: rename them to minimum/maximum so they count. And
    a dict whose keys have a pattern admits no other keys."""
    if isinstance(node, dict):
        if "patternProperties" in node:  # dict keys validated by pattern: no other key passes
            node.setdefault("additionalProperties", False)
        if node.get("type") in ("integer", "number"):
            for old, new in _BOUNDS.items():
                if old in node:
                    node[new] = node.pop(old)
        for value in node.values():
            _json_schema_bounds(value)
    elif isinstance(node, list):
        for value in node:
            _json_schema_bounds(value)
