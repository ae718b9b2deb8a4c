"""Three workers (the HTTP app over the fake engine, each on its own localhost port) and a real router in front of
them (``vllm-router`` or ``sglang-router`` from PyPI, started as a subprocess). Each worker counts the generation
requests it served, so a test can see where the router sent them."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from starlette.middleware.base import BaseHTTPMiddleware

from tests.server.conftest import LiveServer
from tests.server.fake_engine import FakeEngine
from tokenfab.engine.core.async_engine import AsyncEngine
from tokenfab.server.app import ServerConfig, build_app

GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions")


def router_binary(name: str) -> str | None:
    """The router's console script beside this interpreter (the project's venv), else on PATH."""
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else shutil.which(name)


class _Counter(BaseHTTPMiddleware):
    def __init__(self, app: Any, worker: Worker) -> None:
        super().__init__(app)
        self.worker = worker

    async def dispatch(self, request: Any, call_next: Any) -> Any:
        if request.url.path in GENERATION_PATHS:
            self.worker.bodies.append(await request.body())
        else:
            self.worker.probes.append(request.url.path)
        return await call_next(request)


@dataclass
class Worker:
    url: str
    engine: AsyncEngine
    server: LiveServer | None = None
    bodies: list[bytes] = field(default_factory=list)  # generation requests served, in order
    probes: list[str] = field(default_factory=list)  # every other path the router called


@contextlib.contextmanager
def workers(n: int = 3, load_report: str = "vllm-router") -> Iterator[list[Worker]]:
    out: list[Worker] = []
    try:
        for _ in range(n):
            engine = AsyncEngine(FakeEngine())
            app = build_app(engine, ServerConfig(drain_timeout=1, load_report=load_report))
            worker = Worker("", engine)
            app.add_middleware(_Counter, worker=worker)
            worker.server = LiveServer(app)
            worker.url = worker.server.url
            out.append(worker)
        yield out
    finally:
        for w in out:
            if w.server is not None:
                w.server.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def router(name: str, policy: str, urls: list[str], *extra: str, log: Path | None = None) -> Iterator[str]:
    """The router's base URL once it reports every worker healthy; stopped (SIGTERM, then SIGKILL) at exit."""
    binary = router_binary(name)
    assert binary is not None, f"{name} is not installed"
    port = _free_port()
    cmd = [binary, *(["launch"] if name == "sglang-router" else []), "--host", "127.0.0.1", "--port", str(port),
           "--policy", policy, "--worker-urls", *urls, *extra]
    out = open(log, "w") if log is not None else subprocess.DEVNULL  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}: {' '.join(cmd)}")
            try:
                listed = httpx.get(f"{base}/workers", timeout=2).json()["workers"]
                if len(listed) == len(urls) and all(w["is_healthy"] for w in listed):
                    break
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not report {len(urls)} healthy workers within 60 s")
            time.sleep(0.1)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if log is not None:
            out.close()
