"""Prefill/decode disaggregation as an operator runs it (slow tier): two ``tokenfab serve`` processes (engine cores in
their own processes: ``kv_transfer_params`` cross the engine-core IPC both ways), ``vllm-router
--vllm-pd-disaggregation`` in front. The fast twin is ``test_pd_disagg.py`` (the same path with in-process engines).

- 30 prompts, greedy, through the router: the same text as one instance (the ``LLM`` class on the same model).
- The producer killed (SIGKILL) after it answered a prefill leg: the decode leg, carrying its parameters, still gets
  the same answer from the consumer, which prefills locally."""

from __future__ import annotations

import signal

import httpx
import pytest

from tests.server.pd_harness import ENGINE, pd_processes, pd_router, prompts, stop
from tokenfab import LLM, SamplingParams

pytestmark = pytest.mark.slow

MAX_TOKENS = 8


def _complete(base: str, prompt: str, **extra: object) -> dict:
    r = httpx.post(f"{base}/v1/completions", json={"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                                                   **extra}, timeout=600)
    assert r.status_code == 200, r.text
    return r.json()


def _metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def test_thirty_prompts_through_the_router_and_a_killed_producer(tmp_path):
    texts = prompts(30)
    reference = LLM(**ENGINE)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    expected = [o.outputs[0].text for o in reference.generate(texts, greedy)]
    lone = "A last prompt, sent to the producer just before it dies: " + texts[7]
    expected_lone = reference.generate([lone], greedy)[0].outputs[0].text
    with pd_processes(tmp_path, timeout_s=5) as (producer, consumer):
        with pd_router(producer.url, consumer.url, log=tmp_path / "router.log") as base:
            bodies = [_complete(base, t) for t in texts]
        assert [b["choices"][0]["text"] for b in bodies] == expected
        # the consumer computed only the tails: every full block before a prompt's last token was either in its own
        # prefix cache (prompts share openings) or came from the producer (vLLM's "external" prefix-cache series)
        block = ENGINE["block_size"]
        want = sum((b["usage"]["prompt_tokens"] - 1) // block * block for b in bodies)
        local = _metric(consumer.url, "vllm:prefix_cache_hits_total")
        external = _metric(consumer.url, "vllm:external_prefix_cache_hits_total")
        assert local + external == want and external > want / 2
        prefill = _complete(producer.url, lone, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        assert prefill["kv_transfer_params"]["remote_block_ids"]
        stop(producer.proc, signal.SIGKILL)  # gone before the consumer reads
        answer = _complete(consumer.url, lone, kv_transfer_params=prefill["kv_transfer_params"])
        assert answer["choices"][0]["text"] == expected_lone
        assert "KV transfer failed" in (tmp_path / "kv_consumer.log").read_text()
