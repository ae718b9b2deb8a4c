"""Prefill/decode disaggregation end to end (fast tier): a producer and a consumer on the bundled model, in this
process, each behind its own HTTP server, ``vllm-router --vllm-pd-disaggregation`` in front, NIXL between them.

Greedy answers through the router equal one instance's, and the consumer computed only each prompt's tail (the
transferred blocks show as cached tokens); a transfer that fails falls back to a local prefill with the same
answer; parameters an instance cannot honour are a 400. The slow twin (``test_pd_live.py``) runs the same through
two ``tokenfab serve`` processes on 30 prompts and kills the producer."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from tests.server.pd_harness import ENGINE, pd_pair, pd_router, prompts
from tokenfab import LLM, SamplingParams

MAX_TOKENS = 6
BLOCK = ENGINE["block_size"]


@pytest.fixture(scope="module")
def reference() -> LLM:
    return LLM(**ENGINE)


@pytest.fixture(scope="module")
def pair():
    with pd_pair() as (producer, consumer):
        yield producer, consumer


def _complete(base: str, prompt: str, **extra: object) -> dict:
    r = httpx.post(f"{base}/v1/completions", json={"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                                                   **extra}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_greedy_through_the_router_equals_one_instance(pair, reference, tmp_path):
    producer, consumer = pair
    texts = prompts(6)
    expected = [o.outputs[0].text for o in reference.generate(texts, SamplingParams(temperature=0,
                                                                                      max_tokens=MAX_TOKENS))]
    hits_before = consumer.llm.engine.block_manager.connector_hits
    with pd_router(producer.url, consumer.url, log=tmp_path / "router.log") as base:
        answers = [_complete(base, t) for t in texts]
        chat = httpx.post(f"{base}/v1/chat/completions", json={
            "messages": [{"role": "user", "content": texts[3]}], "max_tokens": MAX_TOKENS, "temperature": 0},
            timeout=300)
    assert [a["choices"][0]["text"] for a in answers] == expected
    assert chat.status_code == 200, chat.text
    want_chat = reference.chat([{"role": "user", "content": texts[3]}],
                               SamplingParams(temperature=0, max_tokens=MAX_TOKENS))[0].outputs[0].text
    assert chat.json()["choices"][0]["message"]["content"] == want_chat
    # the consumer computed only the tails: every full block before a prompt's last token came over (counted by
    # the consumer itself: the router's answer reports usage of its own making)
    chat_tokens = chat.json()["usage"]["prompt_tokens"]
    lengths = [a["usage"]["prompt_tokens"] for a in answers] + [chat_tokens]
    transferred = consumer.llm.engine.block_manager.connector_hits - hits_before
    assert transferred == sum((n - 1) // BLOCK * BLOCK for n in lengths) > 0
    assert consumer.llm.engine.kv_transfer.connector.failed_fetches == 0


def test_the_prefill_answer_carries_vllms_transfer_params(pair):
    producer, _ = pair
    answer = _complete(producer.url, prompts(2)[1], max_tokens=1,
                       kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False,
                                           "remote_engine_id": None, "remote_block_ids": None,
                                           "remote_host": None, "remote_port": None})  # vllm-router's exact body
    kv = answer["kv_transfer_params"]
    assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False
    assert kv["remote_engine_id"] == producer.llm.engine.kv_transfer.cfg.engine_id
    assert len(kv["remote_block_ids"]) == len(kv["remote_block_hashes"]) == answer["usage"]["prompt_tokens"] // BLOCK
    plain = _complete(producer.url, "Hello")  # a request without the parameters: an ordinary answer
    assert "kv_transfer_params" not in plain


def test_a_failed_transfer_falls_back_to_a_local_prefill(pair, reference):
    producer, consumer = pair
    text = "A prompt no instance has seen: " + prompts(4)[3]  # no local prefix hit on the consumer either
    prefill = _complete(producer.url, text, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    kv = dict(prefill["kv_transfer_params"])
    conn = consumer.llm.engine.kv_transfer.connector
    failed = conn.failed_fetches
    # the producer's side unreachable: its agent moved (a port nothing listens on, a name never seen)
    kv["remote_engine_id"], kv["remote_port"] = "gone-producer", 9  # port 9: discard, nothing listens here
    answer = _complete(consumer.url, text, kv_transfer_params=kv)
    want = reference.generate([text], SamplingParams(temperature=0, max_tokens=MAX_TOKENS))[0].outputs[0].text
    assert answer["choices"][0]["text"] == want
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # prefilled here, all of it
    assert conn.failed_fetches == failed + 1


@pytest.mark.parametrize("params, which", [
    ({"do_remote_prefill": True}, "consumer"),  # no remote fields
    ({"do_remote_decode": True}, "consumer"),  # a consumer does not prefill for others
    ({"do_remote_prefill": True, "remote_engine_id": "x", "remote_host": "127.0.0.1", "remote_port": 1,
      "remote_block_ids": [0], "remote_block_hashes": ["00" * 16], "remote_buffer": [1, 1]}, "producer"),
    ("yes", "producer"),
])
def test_parameters_an_instance_cannot_honour_are_a_400(pair, params, which):
    inst = dict(zip(("producer", "consumer"), pair))[which]
    r = httpx.post(f"{inst.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2,
                                                       "kv_transfer_params": params}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error" or "error" in r.json()
    assert _complete(inst.url, "Hi")["choices"][0]["text"] is not None  # the instance serves on


def test_an_engine_without_the_config_refuses_transfer_params(reference):
    with pytest.raises(ValueError, match="without --kv-transfer-config"):
        reference.engine.add_request("pd-refused", "Hi", SamplingParams(kv_transfer_params={"do_remote_decode": True}))
    # parameters that ask for nothing (a router's defaults) pass
    reference.engine.add_request("pd-nothing", "Hi", SamplingParams(max_tokens=1, kv_transfer_params={
        "do_remote_decode": False, "do_remote_prefill": False}))
    while reference.engine.has_unfinished_requests():
        reference.engine.step()


def test_a_bad_config_stops_serve_at_start_up_with_a_clear_message():
    r = subprocess.run([sys.executable, "-m", "tokenfab", "serve", "--kv-transfer-config",
                        '{"kv_connector": "NixlConnector", "kv_role": "kv_prefill"}'],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "--kv-transfer-config: kv_role must be one of ['kv_producer', 'kv_consumer', 'kv_both']" in r.stderr
