"""The real routers (``vllm-router`` and ``sglang-router`` from PyPI) in front of three tokenfab workers (the HTTP
app over the fake engine): every worker healthy, chat and completions, streamed and not, through the router with
the official ``openai`` client, and requests spread as each policy says. A router starts in under a second, so
this is the fast tier; ``test_router_fields.py`` checks the same request shapes against the server alone."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import httpx
import openai
import pytest

from tests.server.router_harness import router, router_binary, workers

ROUTERS = ["vllm-router", "sglang-router"]
POLICIES = ["round_robin", "cache_aware", "power_of_two"]
MODEL = "fake-model"


def _installed(name: str) -> None:
    if router_binary(name) is None:
        pytest.skip(f"{name} is not installed (pip install {name})")


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)


def _chat(client: openai.OpenAI, content: str, stream: bool = False) -> str:
    messages = [{"role": "user", "content": content}]
    if stream:
        chunks = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, seed=7, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, seed=7)
    return r.choices[0].message.content


def _complete(client: openai.OpenAI, prompt: str, stream: bool = False) -> str:
    if stream:
        chunks = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, seed=7, stream=True)
        return "".join(c.choices[0].text for c in chunks if c.choices)
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, seed=7).choices[0].text


def _served(ws) -> list[int]:
    return [len(w.bodies) for w in ws]


def _report_busy(worker) -> None:
    """Make ``worker`` report a heavy load in both routers' shapes (/get_load): 50 waiting, 60 of 64 blocks."""
    worker.engine.num_waiting = lambda: 50
    worker.engine.stats = lambda: SimpleNamespace(num_used_blocks=60, num_total_blocks=64, kv_cache_tokens=1024,
                                                  kv_cache_usage=60 / 64)


def _wait_for_loads(base: str, busy_url: str) -> dict[str, int]:
    """The router's view of the loads once it has polled the busy worker's report (its own schedule)."""
    deadline = time.monotonic() + 30
    while True:
        loads = {e["worker"]: e["load"] for e in httpx.get(f"{base}/get_loads", timeout=5).json()["workers"]}
        if loads.get(busy_url, -1) > 0 and all(v == 0 for k, v in loads.items() if k != busy_url):
            return loads
        assert time.monotonic() < deadline, loads
        time.sleep(0.2)


def _check_round_robin(name, ws, client) -> None:
    before = _served(ws)
    for i in range(9):
        _chat(client, f"question {i}")
    assert [a - b for a, b in zip(_served(ws), before)] == [3, 3, 3]


def _check_cache_aware(name, ws, client) -> None:
    systems = [f"You are assistant number {k}. " + chr(ord("a") + k) * 200 for k in range(3)]
    for turn in range(4):
        for system in systems:
            _complete(client, f"{system} turn {turn}")
    where = [{i for i, w in enumerate(ws) for b in w.bodies if system in json.loads(b).get("prompt", "")}
             for system in systems]
    # every turn of a conversation on one worker (random or round_robin would scatter 12 requests)
    assert all(len(v) == 1 for v in where), where


def _check_power_of_two(name, ws, client) -> None:
    before = _served(ws)
    for i in range(12):
        _chat(client, f"question {i}")
    served = [a - b for a, b in zip(_served(ws), before)]
    if name == "vllm-router":  # it compares the loads it polled: the busy worker always loses
        assert served[2] == 0 and served[0] > 0 and served[1] > 0, served
    else:  # sglang-router 0.3.2 compares the requests it has in flight itself (its debug log: "w=0 vs busy=0")
        assert sum(served) == 12 and sum(1 for n in served if n) >= 2, served


SPREAD = {"round_robin": _check_round_robin, "cache_aware": _check_cache_aware, "power_of_two": _check_power_of_two}
BUSY_LOAD = {"vllm-router": 50, "sglang-router": 960}  # running + waiting; KV tokens in use (60 blocks of 16)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", ROUTERS)
def test_three_workers_behind_the_router(name, policy):
    """Healthy workers, the same answers through the router as from a worker, our load report read, and the
    requests spread as the policy says (worker 2 reports a heavy load: power_of_two must see it)."""
    _installed(name)
    with workers(load_report=name) as ws:
        _report_busy(ws[2])
        with router(name, policy, [w.url for w in ws]) as base:
            listed = httpx.get(f"{base}/workers", timeout=5).json()["workers"]
            assert sorted(w["url"] for w in listed) == sorted(w.url for w in ws)
            assert all(w["is_healthy"] for w in listed)
            assert _wait_for_loads(base, ws[2].url)[ws[2].url] == BUSY_LOAD[name]
            direct, routed = _client(ws[0].url), _client(base)
            for stream in (False, True):
                expected_chat = _chat(direct, "Name a color.", stream)
                expected_text = _complete(direct, "Once upon", stream)
                assert len(expected_chat) == 6 and len(expected_text) == 6
                assert _chat(routed, "Name a color.", stream) == expected_chat
                assert _complete(routed, "Once upon", stream) == expected_text
            assert sum(_served(ws)) == 8  # 4 direct + 4 routed, none lost or retried
            routed_bodies = [json.loads(b) for w in ws for b in w.bodies if b"no_stop_trim" in b]
            assert len(routed_bodies) == 4  # the router's own fields arrived and were accepted (200s above)
            SPREAD[policy](name, ws, routed)
