"""`tokenfab serve` with the engine core in its own process, as a user runs it (a live subprocess on
the bundled model): the same tokens as the in-process engine for 24 concurrent clients (greedy and
seeded, streamed and not) through two API-server processes; SIGTERM drains then exits 0; a
SIGKILLed engine core gives 503s and a failing /health within seconds, and the stream in flight
ends with an error instead of hanging."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.server.streams import data_events, interrupt_stream
from tests.server.test_cli_server import API_KEY, ServeProcess
from tokenfab import LLM, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three colors:", "Once upon a time",
           "The best way to learn is", "2 + 2 ="]
MAX_TOKENS = 8
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def _spec(k: int) -> dict:
    """Request k of 24: every prompt, greedy or seeded, streamed or not; one with n=2."""
    body = {"prompt": PROMPTS[k % len(PROMPTS)], "max_tokens": MAX_TOKENS}
    if k % 2:
        body.update(temperature=0.8, top_p=0.95, seed=100 + k)
    else:
        body.update(temperature=0.0)
    if k == 23:
        body.update(n=2)
    body["stream"] = k % 4 in (0, 3) and k != 23
    return body


# a KV cache of 256 blocks x 16 tokens (the 25 sequences here need ~50): allocated in a blink, where the default
# budget's gigabytes take seconds at each start; the same blocks in process and in the servers
KV_BLOCKS = 256


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[ServeProcess, ServeProcess]]:
    """The two servers of this file, started together (they load at the same time, and while the reference
    outputs are computed): two API-server processes over one engine core, and a lone one for the SIGKILL test."""
    flags = ("--max-model-len", "512", "--num-kv-blocks", str(KV_BLOCKS), "--no-access-log")
    two = ServeProcess("--api-server-count", "2", *flags, "--drain-timeout", "60", wait=False)
    lone = ServeProcess(*flags, wait=False)
    yield two, lone
    two.stop()
    lone.stop()


@pytest.fixture(scope="module")
def expected(servers) -> list[list[tuple[str, str]]]:
    """(text, finish_reason) per choice of each request, from the offline engine in this process (computed while
    the servers start)."""
    llm = LLM(max_model_len=512, num_kv_blocks=KV_BLOCKS)
    specs = [_spec(k) for k in range(24)]
    params = [SamplingParams(temperature=s["temperature"], top_p=s.get("top_p", 1.0), seed=s.get("seed"),
                             n=s.get("n", 1), max_tokens=MAX_TOKENS) for s in specs]
    outs = llm.generate([s["prompt"] for s in specs], params)
    del llm
    return [[(c.text, c.finish_reason) for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def two_front_ends(servers) -> ServeProcess:
    return servers[0].ready()


def _run(url: str, body: dict) -> list[tuple[str, str]]:
    with httpx.Client(base_url=url, headers=HEADERS, timeout=300) as c:
        if not body["stream"]:
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return [(ch["text"], ch["finish_reason"]) for ch in sorted(r.json()["choices"], key=lambda x: x["index"])]
        text, finish = "", None
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    for ch in json.loads(line[6:])["choices"]:
                        text += ch["text"]
                        finish = ch["finish_reason"] or finish
        return [(text, finish)]


def test_same_tokens_as_the_in_process_engine_24_clients(expected, two_front_ends):
    url = two_front_ends.url
    with ThreadPoolExecutor(24) as pool:
        got = list(pool.map(lambda k: _run(url, _spec(k)), range(24)))
    for k in range(24):
        assert got[k] == expected[k], (k, _spec(k))
    # two API-server processes served (each logs its own start), one engine core
    pids = set(re.findall(r"Started server process \[(\d+)\]", two_front_ends.output))
    assert len(pids) == 2, two_front_ends.output
    assert "2 API server processes" in two_front_ends.output
    assert httpx.get(f"{url}/health").status_code == 200


def test_sigterm_drains_in_flight_requests_then_exits_0(two_front_ends):
    server = two_front_ends
    body = {"prompt": "Count slowly:", "max_tokens": 12, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    with httpx.Client(base_url=server.url, headers=HEADERS, timeout=120) as c:
        rest, _, _ = interrupt_stream(c, body, lambda: server.proc.send_signal(signal.SIGTERM))
    events = data_events(rest)
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"
    assert events[-1]["usage"]["completion_tokens"] == 12
    assert server.proc.wait(60) == 0
    core = int(re.search(r"engine core pid (\d+)", server.output).group(1))
    deadline = time.monotonic() + 20
    while os.path.exists(f"/proc/{core}") and time.monotonic() < deadline:  # the core is stopped too
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{core}")


def test_killed_engine_core_gives_503_within_seconds(servers):
    server = servers[1].ready()
    try:
        core = int(re.search(r"engine core pid (\d+)", server.output).group(1))
        url = server.url
        body = {"prompt": "Write a long story.", "max_tokens": 400, "stream": True, "ignore_eos": True}
        with httpx.Client(base_url=url, headers=HEADERS, timeout=60) as c:
            rest, t0, ended = interrupt_stream(c, body, lambda: os.kill(core, signal.SIGKILL))
        assert ended < 10
        errors = [e for e in data_events(rest) if "error" in e]
        assert errors and errors[-1]["error"]["code"] == "service_unavailable"
        h = httpx.get(f"{url}/health")
        assert h.status_code == 503 and h.json()["error"]["code"] == "engine_dead"
        r = httpx.post(f"{url}/v1/completions", headers=HEADERS, json={"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 503 and "died" in r.json()["error"]["message"]
        assert time.monotonic() - t0 < 15
    finally:
        server.stop()
