"""Prefill/decode disaggregation test fleet: a producer and a consumer (``--kv-transfer-config`` over NIXL), each
behind its own HTTP server, and ``vllm-router --vllm-pd-disaggregation`` in front of them.

``pd_pair`` runs both engines in this process (the fast tier: the model loads twice, no process start-up);
``pd_processes`` runs two ``tokenfab serve`` processes (the slow tier: what an operator runs)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.server.conftest import LiveServer
from tests.server.router_harness import router_binary
from tokenfab import LLM
from tokenfab.engine.core.async_engine import AsyncEngine
from tokenfab.server.app import ServerConfig, build_app

ENGINE = {"max_model_len": 512, "num_kv_blocks": 96, "block_size": 16}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def transfer_config(role: str, **extra: object) -> str:
    return json.dumps({"kv_connector": "NixlConnector", "kv_role": role, "kv_ip": "127.0.0.1", "kv_port": free_port(),
                       "kv_buffer_size": 64 << 20, **extra})


@dataclass
class Instance:
    url: str
    llm: LLM | None = None  # in-process engines (pd_pair)
    proc: subprocess.Popen | None = None  # tokenfab serve (pd_processes)


@contextlib.contextmanager
def pd_pair(timeout_s: float = 5) -> Iterator[tuple[Instance, Instance]]:
    """A producer and a consumer in this process, each on its own live HTTP server."""
    extra = {"kv_connector_extra_config": {"transfer_timeout_s": timeout_s}}
    servers: list[LiveServer] = []
    llms: list[LLM] = []
    try:
        out = []
        for role in ("kv_producer", "kv_consumer"):
            llm = LLM(kv_transfer_config=transfer_config(role, **extra), **ENGINE)
            llms.append(llm)
            server = LiveServer(build_app(AsyncEngine(llm.engine), ServerConfig(drain_timeout=2)))
            servers.append(server)
            out.append(Instance(server.url, llm=llm))
        yield out[0], out[1]
    finally:
        for server in servers:
            server.stop()
        for llm in llms:
            llm.engine.shutdown()


def _wait_healthy(url: str, proc: subprocess.Popen, deadline: float) -> None:
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"tokenfab serve exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not come up")
        time.sleep(0.2)


def serve_command(port: int, kv_config: str | None, *extra: str) -> list[str]:
    args = ["--port", str(port), "--max-model-len", str(ENGINE["max_model_len"]),
            "--num-kv-blocks", str(ENGINE["num_kv_blocks"]), "--block-size", str(ENGINE["block_size"]),
            "--no-access-log", "--log-level", "warning", *extra]
    if kv_config is not None:
        args += ["--kv-transfer-config", kv_config]
    return [sys.executable, "-m", "tokenfab", "serve", *args]


@contextlib.contextmanager
def pd_processes(log_dir: Path, timeout_s: float = 5, cores: tuple[str, str] | None = None,
                 ) -> Iterator[tuple[Instance, Instance]]:
    """Two ``tokenfab serve`` processes (producer, consumer); ``cores``: taskset CPU lists, one each."""
    extra = {"kv_connector_extra_config": {"transfer_timeout_s": timeout_s}}
    procs: list[subprocess.Popen] = []
    out = []
    try:
        for i, role in enumerate(("kv_producer", "kv_consumer")):
            port = free_port()
            cmd = serve_command(port, transfer_config(role, **extra))
            if cores is not None:
                cmd = ["taskset", "-c", cores[i], *cmd]
            log = open(log_dir / f"{role}.log", "w")  # noqa: SIM115 (the process owns it)
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
            out.append(Instance(f"http://127.0.0.1:{port}", proc=procs[-1]))
        deadline = time.monotonic() + 300
        for inst in out:
            _wait_healthy(inst.url, inst.proc, deadline)
        yield out[0], out[1]
    finally:
        for p in procs:
            stop(p)


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@contextlib.contextmanager
def pd_router(prefill: str, decode: str, log: Path | None = None) -> Iterator[str]:
    """``vllm-router --vllm-pd-disaggregation`` (vLLM's protocol: the prefill leg with ``max_tokens`` 1 and
    ``kv_transfer_params.do_remote_decode``, then the request with the prefill answer's ``kv_transfer_params`` to
    the decode instance); its base URL once both workers are healthy."""
    binary = router_binary("vllm-router")
    assert binary is not None, "vllm-router is not installed"
    port = free_port()
    cmd = [binary, "--vllm-pd-disaggregation", "--prefill", prefill, "--decode", decode, "--kv-connector", "nixl",
           "--policy", "round_robin", "--host", "127.0.0.1", "--port", str(port),
           "--prometheus-port", str(free_port())]  # its default port may be another router's
    out = open(log, "w") if log is not None else subprocess.DEVNULL  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm-router exited with {proc.returncode}: {' '.join(cmd)}")
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                workers = httpx.get(f"{base}/workers", timeout=2).json()["workers"]
                if len(workers) == 2 and all(w["is_healthy"] for w in workers):
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("vllm-router did not report its two workers healthy within 60 s")
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


def prompts(n: int) -> list[str]:
    """``n`` prompts of 5 to ~120 tokens: some shorter than a block (nothing to transfer), most several blocks."""
    topics = ["the sea", "a lighthouse", "bread", "rivers", "mountains", "owls", "trains", "the moon", "gardens",
              "copper", "winter", "bees", "clocks", "maps", "glass"]
    out = []
    for i in range(n):
        t = topics[i % len(topics)]
        body = f"Write about {t}. " + " ".join(f"Line {j}: {t} and {topics[(i + j) % len(topics)]}." for j in
                                               range(i % 9))
        out.append(body if i % 5 else f"{t.title()} is")
    return out
