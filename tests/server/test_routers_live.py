"""Both routers in front of three real ``tokenfab serve`` processes (the bundled model, a small KV cache each): the
slow twin of ``test_routers.py`` (which runs the same routers over the fake engine in the fast tier). Checks greedy
answers through each router equal a worker's own, and the fleet's prefix-cache hits read from the workers'
``vllm:`` series: cache_aware keeps each conversation's shared system prompt on one worker."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.router_harness import _free_port, router, router_binary

pytestmark = pytest.mark.slow


@contextlib.contextmanager
def tokenfab_servers(n: int = 3) -> Iterator[list[str]]:
    ports = [_free_port() for _ in range(n)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "tokenfab", "serve", "--port", str(p), "--num-kv-blocks", "64",
                               "--max-model-len", "512", "--cpu-threads", "1", "--no-access-log"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env) for p in ports]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        deadline = time.monotonic() + 600
        for url, proc in zip(urls, procs):
            while True:
                assert proc.poll() is None, f"tokenfab serve exited with {proc.returncode}"
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                assert time.monotonic() < deadline, "tokenfab serve did not come up"
                time.sleep(0.5)
        yield urls
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


def prefix_hits(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "vllm:prefix_cache_hits_total")


@pytest.mark.parametrize("name", ["vllm-router", "sglang-router"])
def test_real_workers_behind_the_router(name):
    if router_binary(name) is None:
        pytest.skip(f"{name} is not installed (pip install {name})")
    with tokenfab_servers() as urls:
        model = httpx.get(f"{urls[0]}/v1/models").json()["data"][0]["id"]
        ask = {"model": model, "messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 5,
               "temperature": 0}
        expected = openai.OpenAI(base_url=f"{urls[0]}/v1", api_key="x").chat.completions.create(**ask)
        for policy in ("round_robin", "cache_aware", "power_of_two"):
            with router(name, policy, urls) as base:
                client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=120)
                assert client.chat.completions.create(**ask).choices[0].message.content == \
                    expected.choices[0].message.content
                streamed = client.chat.completions.create(**ask, stream=True)
                assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == \
                    expected.choices[0].message.content
                if policy != "cache_aware":
                    continue
                before = [prefix_hits(u) for u in urls]
                systems = [f"You are helper {k}. " + "Be precise and brief. " * 12 + f"Topic {k}." for k in range(3)]
                for turn in range(3):
                    for system in systems:
                        client.chat.completions.create(model=model, max_tokens=2, temperature=0, messages=[
                            {"role": "system", "content": system}, {"role": "user", "content": f"question {turn}"}])
                gained = [prefix_hits(u) - b for u, b in zip(urls, before)]
                # turns 2 and 3 of each conversation found its system prompt on the worker it went to
                assert sum(gained) >= 6 * 64, gained
