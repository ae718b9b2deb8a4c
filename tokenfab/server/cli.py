"""`tokenfab serve [MODEL]`: the OpenAI-compatible server on one model."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from tokenfab.distributed import admission
from tokenfab.engine.args import EngineArgs
from tokenfab.server.batch import config as batch_config
from tokenfab.server.finetune import config as fine_tuning_config

# Only argparse, EngineArgs and the (torch-free) admission rules at import time: `tokenfab --help` imports
# every command's module, and this one must not pull in torch, FastAPI and the server for that. `run` imports
# what it starts (launch.py, api_process.py, the engine); nothing imports this module back, so these
# deferred imports hide no cycle.


def add_arguments(parser: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(parser)
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    g.add_argument("--port", type=int, default=8000, help="port (0: any free port)")
    g.add_argument("--api-key", default=os.environ.get("TOKENFAB_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $TOKENFAB_API_KEY)")
    g.add_argument("--max-waiting", type=int, default=1024,
                   help="answer 429 once this many requests wait for a slot (default 1024)")
    g.add_argument("--max-request-bytes", type=int, default=8 << 20,
                   help="answer 413 to a request body larger than this (default 8 MiB)")
    g.add_argument("--max-prompts-per-request", type=int, default=256,
                   help="answer 400 to a completion request with more prompts than this (default 256)")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="let requests pass their own chat_template (default: refused with a 400)")
    g.add_argument("--tool-call-parser", default=None,
                   choices=["hermes", "llama3_json", "deepseek_v3", "deepseek_v31", "kimi_k2", "glm45", "gigachat3"],
                   help="how tool calls are read from the output with tool_choice auto (default: by model type)")
    g.add_argument("--reasoning-parser", default=None,
                   choices=["deepseek_r1", "deepseek_v3", "qwen3", "glm45", "kimi_k2", "gpt_oss"],
                   help="split reasoning_content off the output (default: by model type)")
    g.add_argument("--responses-store-size", type=int, default=1024,
                   help="/v1/responses kept in memory for previous_response_id and GET, least recently used "
                   "dropped first (default 1024; 0: keep none)")
    g.add_argument("--responses-ttl", type=float, default=3600.0,
                   help="seconds a stored /v1/responses response is kept (default 3600)")
    g.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds to let running requests finish (default 30)")
    g.add_argument("--engine-in-process", action="store_true",
                   help="run the engine in a thread of the API server process (default: its own process)")
    g.add_argument("--api-server-count", type=int, default=1,
                   help="API server processes sharing the port, all served by one engine core (default 1)")
    batch_config.add_cli_args(parser)
    fine_tuning_config.add_cli_args(parser)
    g.add_argument("--load-report", default="vllm-router", choices=["vllm-router", "sglang-router"],
                   help="the shape of GET /get_load, which the routers poll for power_of_two: vllm-router's "
                   "{\"load\": N} or sglang-router's per-rank list (the two cannot read each other's; default "
                   "vllm-router)")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    g.add_argument("--no-access-log", dest="access_log", action="store_false", help="no per-request log lines")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for flag in ("max_waiting", "max_request_bytes", "max_prompts_per_request", "api_server_count"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            print(f"tokenfab serve: --{flag.replace('_', '-')} must be at least 1", file=sys.stderr)
            return 2
    try:
        batch_config.BatchConfig.from_cli_args(args).check()
    except ValueError as e:
        print(f"tokenfab serve: {e}", file=sys.stderr)
        return 2
    if args.responses_store_size < 0 or not args.responses_ttl > 0:
        print("tokenfab serve: --responses-store-size must be >= 0 and --responses-ttl > 0", file=sys.stderr)
        return 2
    from tokenfab.executors.tp_executor import launched_by_torchrun

    if launched_by_torchrun():  # torchrun: rank 0 serves, every other rank is a TP worker
        world = int(os.environ["WORLD_SIZE"])
        try:  # the launch rule tokenfab plan checks too
            admission.check_launch(args.tensor_parallel_size, args.data_parallel_size, torchrun=True)
        except ValueError as e:
            print(f"tokenfab serve: {e}", file=sys.stderr)
            return 2
        if args.tensor_parallel_size == 1:
            args.tensor_parallel_size = world
        if int(os.environ["RANK"]) != 0:
            from tokenfab.executors.tp_worker import torchrun_worker_main

            return torchrun_worker_main(EngineArgs.from_cli_args(args))
    for flag in ("tensor_parallel_size", "data_parallel_size"):
        if getattr(args, flag) < 1:
            print(f"tokenfab serve: --{flag.replace('_', '-')} must be at least 1", file=sys.stderr)
            return 2
    if args.data_parallel_size > 1 and (args.engine_in_process or args.api_server_count > 1):
        print("tokenfab serve: --data-parallel-size > 1 needs the engine cores in their own processes behind one "
              "API server (drop --engine-in-process / --api-server-count)", file=sys.stderr)
        return 2
    if args.api_server_count > 1:
        if args.engine_in_process:
            print("tokenfab serve: --api-server-count > 1 needs the engine in its own process "
                  "(drop --engine-in-process)", file=sys.stderr)
            return 2
        from tokenfab.server.api_process import run_multi

        return run_multi(args)
    from tokenfab.server.launch import bind, close_engine, print_banner, serve_on

    t0 = time.perf_counter()
    engine = load_engine(args)
    if engine is None:
        return 1
    load_s = time.perf_counter() - t0
    try:
        sock = bind(args)
    except OSError:
        print(f"tokenfab serve: cannot bind {args.host}:{args.port}", file=sys.stderr)
        close_engine(engine)
        return 1
    core = getattr(engine, "core_pid", None)
    print(f"model loaded in {load_s:.1f}s" + (f"; engine core pid {core}" if core else " (engine in process)"),
          flush=True)
    print_banner(args, sock, engine.model_name, getattr(engine, "kv_cache_tokens", None), engine.max_model_len)
    serve_on(args, engine, sock)
    return 0


def load_engine(args: argparse.Namespace) -> object | None:
    """The engine the API server drives: an ``EngineCoreClient`` on an engine-core process
    (default), a ``DPClient`` on N of them (--data-parallel-size), or an in-process ``LLMEngine``
    (--engine-in-process). None (message printed) if the
    model cannot be loaded."""
    try:
        engine_args = EngineArgs.from_cli_args(args)  # a refused combination of options: a message, no traceback
        if args.engine_in_process:
            from tokenfab.engine.llm_engine import LLMEngine

            return LLMEngine(engine_args)
        from tokenfab.engine.runner.cpu_threads import configure_api_process_threads

        configure_api_process_threads()  # the engine cores compute in their own processes; this one only serves
        if engine_args.data_parallel_size > 1:
            from tokenfab.engine.core.dp_client import DPClient

            return DPClient.spawn(engine_args, args.log_level)
        from tokenfab.engine.core.client import EngineCoreClient

        return EngineCoreClient.spawn(engine_args, args.log_level)
    except (FileNotFoundError, ValueError, OSError, RuntimeError) as e:
        print(f"tokenfab serve: cannot load the model: {e}", file=sys.stderr)
        return None


