"""The instances of a chaos run and their supervisor.

Each instance is one ``tokenfab serve`` process on a fixed port (the router's worker URL stays valid across
restarts). The supervisor restarts an instance the way a Kubernetes liveness probe would: when its process has
exited, or when its ``/health`` answers 503 because the engine is dead (the server outlives a killed engine core and
answers 503 until restarted: ``engine/core/client.py``), it is stopped and started again on the same port. A kill
counts as recovered when the instance answers ``/health`` 200 and a one-token completion again.

RSS is sampled per instance: the server process and, separately, its children (the engine core).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

CORE_MODULE = "tokenfab.engine.core.process"  # how the server launches its engine core (engine/core/launch.py)


@dataclass
class Kill:
    """One SIGKILL the chaos schedule sent, and when the instance served again."""

    instance: int
    kind: str  # "server": the `tokenfab serve` process; "core": its engine-core child
    pid: int
    at: float  # monotonic
    restarted_at: float | None = None
    recovered_at: float | None = None

    @property
    def recovery_s(self) -> float | None:
        return None if self.recovered_at is None else self.recovered_at - self.at


@dataclass
class Instance:
    index: int
    port: int
    cmd: list[str]
    env: dict[str, str]
    log_dir: Path | None = None
    proc: subprocess.Popen | None = None
    generation: int = 0  # how many times it was started
    healthy: bool = False
    pending: Kill | None = None  # the kill it has not recovered from yet
    rss: list[dict[str, Any]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.generation += 1
        out: Any = subprocess.DEVNULL
        if self.log_dir is not None:
            out = open(self.log_dir / f"instance{self.index}.log", "a")  # noqa: SIM115 (the child holds it)
            out.write(f"\n==== start {self.generation} at {time.time():.0f}\n")
            out.flush()
        self.proc = subprocess.Popen([*self.cmd, "--port", str(self.port)], stdout=out, stderr=subprocess.STDOUT,
                                     env=self.env)
        if out is not subprocess.DEVNULL:
            out.close()
        self.healthy = False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def core_pid(self) -> int | None:
        """The engine-core child of the server (None while it has none: loading, or in-process)."""
        if not self.alive():
            return None
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(self.proc.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    if CORE_MODULE in " ".join(child.cmdline()):
                        return child.pid
        return None

    def kill(self, kind: str) -> Kill | None:
        """SIGKILL the server or its engine core; None when there is nothing of that kind to kill."""
        pid = self.proc.pid if kind == "server" and self.alive() else self.core_pid() if kind == "core" else None
        if pid is None:
            return None
        os.kill(pid, signal.SIGKILL)
        self.healthy = False
        self.pending = Kill(self.index, kind, pid, time.monotonic())
        return self.pending

    def sample_rss(self, t: float) -> None:
        if not self.alive():
            return
        with contextlib.suppress(psutil.Error):
            server = psutil.Process(self.proc.pid)
            children = 0
            for child in server.children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    children += child.memory_info().rss
            self.rss.append({"t": round(t, 1), "generation": self.generation, "healthy": self.healthy,
                             "server_mb": round(server.memory_info().rss / 2**20, 1),
                             "core_mb": round(children / 2**20, 1)})

    def stop(self, grace: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


async def _probe(client: httpx.AsyncClient, url: str) -> int | None:
    """/health's status, None when nothing answers (loading, or just killed)."""
    try:
        return (await client.get(f"{url}/health", timeout=3)).status_code
    except httpx.HTTPError:
        return None


async def _serves(client: httpx.AsyncClient, inst: Instance, model: str) -> bool:
    try:
        r = await client.post(f"{inst.url}/v1/completions", timeout=30,
                              json={"model": model, "prompt": "ping", "max_tokens": 1})
        return r.status_code == 200
    except httpx.HTTPError:
        return False


async def _restart(inst: Instance) -> None:
    await asyncio.to_thread(inst.stop, 5.0)
    inst.start()
    if inst.pending is not None:
        inst.pending.restarted_at = time.monotonic()


async def supervise(inst: Instance, model: str, stop: asyncio.Event, period: float = 0.25) -> None:
    """Keep ``inst`` running until ``stop``: restart it when its process exited or its engine is dead; mark a
    pending kill recovered once it is healthy and serving again."""
    async with httpx.AsyncClient() as client:
        while not stop.is_set():
            await asyncio.sleep(period)
            if not inst.alive():
                await _restart(inst)
                continue
            status = await _probe(client, inst.url)
            if status == 503:  # the engine is dead: the server stays up answering 503 until restarted
                inst.healthy = False
                await _restart(inst)
            elif status == 200 and not inst.healthy:
                if inst.pending is None or await _serves(client, inst, model):
                    inst.healthy = True
                    if inst.pending is not None:
                        inst.pending.recovered_at = time.monotonic()
                        inst.pending = None
            elif status != 200:
                inst.healthy = False


async def wait_healthy(instances: list[Instance], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient() as client:
        for inst in instances:
            while await _probe(client, inst.url) != 200:
                if not inst.alive():
                    raise RuntimeError(f"instance {inst.index} exited with {inst.proc.returncode} while loading")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"instance {inst.index} was not healthy within {timeout:.0f} s")
                await asyncio.sleep(0.3)
            inst.healthy = True


async def sample_rss(instances: list[Instance], t0: float, every: float, stop: asyncio.Event) -> None:
    while not stop.is_set():
        for inst in instances:
            inst.sample_rss(time.monotonic() - t0)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), every)
