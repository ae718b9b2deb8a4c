"""`tokenfab serve --tensor-parallel-size 3` on the bundled model (9 query / 3 KV heads), as a user
runs it: the engine core is rank 0 and spawns two worker ranks. Its streamed and non-streamed
greedy answers equal the one-process engine's; then one worker is SIGKILLed mid-request: the
stream in flight ends with an error within seconds, /health fails and later requests get 503 with
a message naming the dead worker; the API server still stops on SIGTERM. Offline, ``LLM.generate``
raises EngineDeadError naming the worker instead of hanging. Slow tier (processes, model loads)."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.server.streams import completion_text, data_events, interrupt_stream
from tests.server.test_cli_server import API_KEY, ServeProcess
from tokenfab import LLM, SamplingParams

pytestmark = pytest.mark.slow
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three colors:"]


def _children(pid: int) -> list[int]:
    kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(k) for k in kids]


def _worker_pids(core: int) -> list[int]:
    return [p for p in _children(core) if b"tokenfab.executors.tp_worker" in Path(f"/proc/{p}/cmdline").read_bytes()]


def _complete(c: httpx.Client, prompt: str, stream: bool) -> str:
    return completion_text(c, {"prompt": prompt, "max_tokens": 10, "temperature": 0.0}, stream)


def test_tp3_serve_matches_one_process_then_a_killed_worker_gives_503():
    llm = LLM(max_model_len=256)
    expected = [o.outputs[0].text for o in llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=10))]
    del llm
    server = ServeProcess("--tensor-parallel-size", "3", "--max-model-len", "256", "--no-access-log")
    try:
        core = int(re.search(r"engine core pid (\d+)", server.output).group(1))
        workers = _worker_pids(core)
        assert len(workers) == 2
        with httpx.Client(base_url=server.url, headers=HEADERS, timeout=120) as c:
            for stream in (False, True):
                assert [_complete(c, p, stream) for p in PROMPTS] == expected
            body = {"prompt": "Write a long story.", "max_tokens": 200, "stream": True, "ignore_eos": True}
            rest, t0, ended = interrupt_stream(c, body, lambda: os.kill(workers[1], signal.SIGKILL))
        assert ended < 15
        errors = [e for e in data_events(rest) if "error" in e]
        assert errors and errors[-1]["error"]["code"] == "service_unavailable"
        h = httpx.get(f"{server.url}/health")
        assert h.status_code == 503
        r = httpx.post(f"{server.url}/v1/completions", headers=HEADERS, json={"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 503
        assert "tensor-parallel worker" in r.json()["error"]["message"], r.json()
        assert time.monotonic() - t0 < 20
        # the engine core and the other worker are gone, not left hanging
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") for p in (core, workers[0])):
            time.sleep(0.2)
        for pid in (core, workers[0]):
            assert not os.path.exists(f"/proc/{pid}") or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
        server.proc.send_signal(signal.SIGTERM)  # the API server (in its 503 state) still stops on SIGTERM
        assert server.proc.wait(30) in (0, -signal.SIGTERM)
    finally:
        server.stop()


def test_offline_llm_a_killed_worker_raises_engine_dead_not_a_hang(tmp_path):
    from tests.tiny_models import save_tiny_model, tiny_config
    from tokenfab.engine.requests.errors import EngineDeadError

    save_tiny_model(tiny_config("llama"), tmp_path)
    llm = LLM(str(tmp_path), tensor_parallel_size=2)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        assert len(llm.generate([[5, 6, 7]], params)[0].outputs[0].token_ids) == 4
        worker = llm.engine.tp.procs[0]
        os.kill(worker.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match="tensor-parallel worker rank 1"):
            llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
        assert time.monotonic() - t0 < 15
        assert not llm.engine.has_unfinished_requests()  # nothing of the failed call left queued
    finally:
        llm.shutdown()
