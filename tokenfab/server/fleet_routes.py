"""What the fleet's routers call on a worker besides the OpenAI API: load, server and model info, a generating
health check. Found by running ``vllm-router`` 0.1.17 and ``sglang-router`` 0.3.2 in front of this server
(docs/fleet.md has the list of calls each makes).

- ``GET /get_load``: both routers poll it (``power_of_two`` reads it; the routers' own ``/get_loads`` shows it),
  each in its own shape (``load_report``): the sequences in the engine (running + waiting) for vllm-router, the
  KV tokens in use for sglang-router (what SGLang itself reports), SGLang's names beside them.
- ``GET /get_server_info`` and ``/server_info`` (sglang-router asks the newer name first, then the old one),
  ``GET /get_model_info`` and ``/model_info``: what sglang-router's worker discovery reads (served model name,
  parallel sizes, disaggregation mode); 200 instead of the 404 it otherwise logs for every worker.
- ``GET /health_generate``: SGLang's deep health check, a one-token generation through the engine; 200 when a
  token came back, 503 when the engine is dead or produced nothing within the timeout.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from tokenfab.engine.requests.sampling_params import SamplingParams
from tokenfab.server.errors import APIError, error_response
from tokenfab.server.protocol import random_id
from tokenfab.server.serving import OpenAIServer

HEALTH_GENERATE_TIMEOUT_S = 20.0


def load_report(server: OpenAIServer) -> dict[str, Any] | list[dict[str, Any]]:
    """The worker's load as the configured router reads it (``ServerConfig.load_report``): vllm-router 0.1.17
    reads the integer ``load`` of an object; sglang-router 0.3.2 reads SGLang's own shape, a list with one object
    per data-parallel rank, and sums their ``num_tokens``. Neither reads the other's (checked against both)."""
    engine = server.engine
    running, waiting = engine.num_running(), engine.num_waiting()
    stats = engine.stats()
    used_blocks = int(getattr(stats, "num_used_blocks", 0) or 0)
    total_blocks = int(getattr(stats, "num_total_blocks", 0) or 0)
    tokens = int(getattr(stats, "kv_cache_tokens", 0) or 0)
    used_tokens = used_blocks * tokens // total_blocks if total_blocks else 0
    report = {"load": running + waiting, "num_reqs": running, "num_waiting_reqs": waiting, "num_tokens": used_tokens,
              "kv_cache_usage": float(getattr(stats, "kv_cache_usage", 0.0) or 0.0)}
    return [{"dp_rank": 0, **report}] if server.config.load_report == "sglang-router" else report


def server_info(server: OpenAIServer) -> dict[str, Any]:
    """The subset of SGLang's server info that routers read, in its names."""
    engine = server.engine
    return {"model_path": server.model_name, "served_model_name": server.model_name,
            "tokenizer_path": server.model_name, "context_length": server.max_model_len,
            "max_model_len": server.max_model_len, "tp_size": int(getattr(engine, "tp_size", 1) or 1),
            "dp_size": 1, "disaggregation_mode": "null", "is_generation": True, "version": "tokenfab-0.1.0"}


def model_info(server: OpenAIServer) -> dict[str, Any]:
    return {"model_path": server.model_name, "served_model_name": server.model_name,
            "tokenizer_path": server.model_name, "is_generation": True, "max_model_len": server.max_model_len}


async def health_generate(server: OpenAIServer, timeout: float = HEALTH_GENERATE_TIMEOUT_S) -> Response:
    engine = server.engine
    if engine.is_dead:
        return error_response(503, f"The engine is dead: {engine.error}", code="engine_dead")
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    try:
        stream = await server.submit([[0]], params, 0, time.monotonic(), random_id("health"))
    except APIError as e:
        return error_response(503, f"The engine did not accept a generation: {e.message}",
                              code="service_unavailable")
    try:
        async with asyncio.timeout(timeout):
            async for chunk in stream:
                if chunk.delta_token_ids or chunk.finished:
                    return JSONResponse({"status": "ok"})
    except TimeoutError:
        pass
    except Exception as e:  # a dead engine or a failed step: unhealthy, never a 500
        return error_response(503, f"The engine failed a one-token generation: {e}", code="service_unavailable")
    finally:
        stream.abort()
    return error_response(503, f"No token within {timeout:.0f} s", code="service_unavailable")


def add_routes(app: FastAPI, server: OpenAIServer) -> None:
    """The router-facing routes (no API key: routers probe them as they probe /health)."""

    @app.get("/get_load")
    async def get_load() -> Any:
        return load_report(server)

    for path in ("/get_server_info", "/server_info"):
        app.add_api_route(path, lambda: server_info(server), methods=["GET"])
    for path in ("/get_model_info", "/model_info"):
        app.add_api_route(path, lambda: model_info(server), methods=["GET"])

    @app.get("/health_generate", responses={503: {"description": "the engine cannot generate"}})
    async def deep_health() -> Response:
        return await health_generate(server)
