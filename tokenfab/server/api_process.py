"""``tokenfab serve --api-server-count N``: N API-server processes, one engine core.

The parent starts the engine core (``engine/core/process.py``), binds the listening socket once,
and starts N workers (``python -m tokenfab.server.api_process``) that inherit the socket's file
descriptor: the kernel spreads the connections over them. Each worker tokenizes, templates,
detokenizes and streams for its own clients, and talks to the one core over its own DEALER
socket (the core's ROUTER tells them apart). SIGTERM (or Ctrl-C) to the parent is passed to the
workers, which drain their requests; then the core is stopped.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import zmq

from tokenfab.engine.args import EngineArgs
from tokenfab.engine.core import ipc
from tokenfab.engine.core.process import pid_alive, pid_fd
from tokenfab.engine.runner.cpu_threads import configure_api_process_threads
from tokenfab.server.launch import bind, print_banner, serve_on

log = logging.getLogger("tokenfab.server")


def _core_info(address: str, proc: subprocess.Popen, timeout: float = 3600.0) -> dict[str, Any] | None:
    """The core's ``ready`` facts (None if it exits first)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        sock.send(ipc.encode("hello"))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and proc.poll() is None:
            if sock.poll(200, zmq.POLLIN):
                tag, fields = ipc.decode(sock.recv())
                if tag == "ready":
                    return fields[0]
        return None
    finally:
        sock.close(0)
        ctx.term()


def run_multi(args: argparse.Namespace) -> int:
    workdir = tempfile.mkdtemp(prefix="tokenfab-core-")
    address = f"ipc://{workdir}/core.sock"
    engine_args = dataclasses.asdict(EngineArgs.from_cli_args(args))
    t0 = time.perf_counter()
    core = subprocess.Popen([sys.executable, "-m", "tokenfab.engine.core.process", "--address", address,
                             "--args-json", json.dumps(engine_args), "--parent-pid", str(os.getpid()),
                             "--log-level", args.log_level])
    workers: list[subprocess.Popen] = []
    try:
        info = _core_info(address, core)
        if info is None:
            print(f"tokenfab serve: cannot load the model: the engine core exited (code {core.poll()}; see its log)",
                  file=sys.stderr)
            return 1
        try:
            sock = bind(args)
        except OSError:
            print(f"tokenfab serve: cannot bind {args.host}:{args.port}", file=sys.stderr)
            return 1
        serve_args = json.dumps(vars(args), default=str)
        for i in range(args.api_server_count):
            workers.append(subprocess.Popen(
                [sys.executable, "-m", "tokenfab.server.api_process", "--fd", str(sock.fileno()), "--address",
                 address, "--core-pid", str(core.pid), "--index", str(i), "--serve-args-json", serve_args],
                pass_fds=[sock.fileno()]))
        print(f"model loaded in {time.perf_counter() - t0:.1f}s; {args.api_server_count} API server processes, "
              f"engine core pid {info['pid']}", flush=True)
        print_banner(args, sock, info["model_name"], info["kv_cache_tokens"], info["max_model_len"])
        sock.close()  # the workers hold it

        def forward(signum: int, _frame: Any) -> None:
            for w in workers:
                if w.poll() is None:
                    w.send_signal(signal.SIGTERM)

        signal.signal(signal.SIGTERM, forward)
        signal.signal(signal.SIGINT, forward)
        codes = [w.wait() for w in workers]
        return 0 if all(c in (0, -signal.SIGTERM) for c in codes) else 1
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()
        if core.poll() is None:
            core.terminate()
            try:
                core.wait(15)
            except subprocess.TimeoutExpired:
                core.kill()
                core.wait()
        shutil.rmtree(workdir, ignore_errors=True)


def _exit_with_parent(parent: int) -> None:
    """The parent is gone (killed): stop as if told to (uvicorn shuts down on SIGTERM)."""
    fd = pid_fd(parent)
    if fd is not None:
        select.select([fd], [], [])
    else:
        while pid_alive(parent):
            time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGTERM)


def worker_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenfab-api-server")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--address", required=True)
    parser.add_argument("--core-pid", type=int, required=True)
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--serve-args-json", required=True)
    ns = parser.parse_args(argv)
    args = argparse.Namespace(**json.loads(ns.serve_args_json))
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format=f"%(asctime)s %(levelname)s %(name)s[api {ns.index}]: %(message)s")
    from tokenfab.engine.core.client import EngineCoreClient, load_tokenizer

    configure_api_process_threads()  # the engine core computes; this process only serves
    client = EngineCoreClient(ns.address, ns.core_pid, load_tokenizer(args.model))
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    sock = socket.socket(fileno=ns.fd)
    serve_on(args, client, sock)
    return 0


if __name__ == "__main__":
    sys.exit(worker_main())
