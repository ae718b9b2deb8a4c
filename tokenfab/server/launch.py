"""The running server: the listening socket bound before the banner, the banner, and uvicorn over an engine
(``tokenfab serve``, ``cli.py``, and each API-server process, ``api_process.py``)."""

from __future__ import annotations

import argparse
import json
import shlex
import socket

import uvicorn

from tokenfab.engine.core.async_engine import AsyncEngine
from tokenfab.server.app import build_app
from tokenfab.server.batch.config import BatchConfig
from tokenfab.server.finetune.config import FineTuningConfig
from tokenfab.server.serving import ServerConfig


def banner(url: str, model: str, kv_tokens: int | None, max_model_len: int, api_key: bool) -> str:
    auth = ' -H "Authorization: Bearer $TOKENFAB_API_KEY"' if api_key else ""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Write a haiku about GPUs."}],
                       "max_tokens": 64})
    kv = f"{kv_tokens:,} tokens" if kv_tokens else "unknown"
    return "\n".join([
        "",
        f"tokenfab is serving {model} at {url}/v1",
        f"  KV cache: {kv}   max model length: {max_model_len:,} tokens",
        "  endpoints: /v1/completions /v1/chat/completions /v1/responses /v1/files /v1/batches /v1/models /health "
        "/metrics /tokenize /detokenize",
        "  try:",
        f"    curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d {shlex.quote(body)}",
        "",
    ])


def bind(args: argparse.Namespace) -> socket.socket:
    """The listening socket, bound and listening before the banner says the server is up:
    connections that arrive while uvicorn starts wait in the backlog instead of being refused."""
    uv_config = uvicorn.Config(None, host=args.host, port=args.port)  # type: ignore[arg-type]
    try:
        sock = uv_config.bind_socket()
    except SystemExit as e:
        raise OSError(f"cannot bind {args.host}:{args.port}") from e
    sock.listen(uv_config.backlog)
    return sock


def print_banner(args: argparse.Namespace, sock: socket.socket, model: str, kv_tokens: int | None,
                 max_model_len: int) -> None:
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(banner(f"http://{shown}:{port}", model, kv_tokens, max_model_len, bool(args.api_key)), flush=True)


def serve_on(args: argparse.Namespace, engine: object, sock: socket.socket) -> None:
    """uvicorn on ``sock`` over ``engine`` until SIGTERM/SIGINT (which drain the running requests)."""
    async_engine = AsyncEngine(engine, max_waiting=args.max_waiting)
    config = ServerConfig(api_key=args.api_key or None, max_waiting=args.max_waiting,
                          drain_timeout=args.drain_timeout, max_request_bytes=args.max_request_bytes,
                          max_prompts_per_request=args.max_prompts_per_request,
                          trust_request_chat_template=args.trust_request_chat_template,
                          tool_call_parser=getattr(args, "tool_call_parser", None),
                          reasoning_parser=getattr(args, "reasoning_parser", None),
                          responses_store_size=getattr(args, "responses_store_size", 1024),
                          responses_ttl=getattr(args, "responses_ttl", 3600.0),
                          load_report=getattr(args, "load_report", "vllm-router"),
                          enable_lora=getattr(args, "enable_lora", False),
                          lora_modules=getattr(args, "lora_modules", None),
                          max_lora_rank=getattr(args, "max_lora_rank", None),
                          max_loras=getattr(args, "max_loras", 1))
    app = build_app(async_engine, config, BatchConfig.from_cli_args(args), FineTuningConfig.from_cli_args(args))
    uv_config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level, access_log=args.access_log,
        timeout_graceful_shutdown=max(1, int(args.drain_timeout)), timeout_keep_alive=30,
    )
    server = uvicorn.Server(uv_config)
    try:
        server.run(sockets=[sock])
    finally:
        if async_engine._thread is None:  # never started (uvicorn failed early): stop the core anyway
            close_engine(engine)


def close_engine(engine: object) -> None:
    close = getattr(engine, "close", None)
    if close is not None:
        close()
