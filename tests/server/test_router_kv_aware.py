"""vllm-router's ``kv_aware`` policy fed by our KV-cache events: each worker publishes (``ZmqEventPublisher``, the
``--kv-events-config`` publisher) that it holds one prompt's blocks, and the router must send that prompt to that
worker. The router subscribes with its own decoder, so this checks our wire format against a real consumer (an
older tagged-array layout was refused with "KV event must be a tagged map"). The block manager's side of the events
is tested in ``tests/engine/test_kv_events.py``."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from tests.server.router_harness import router, router_binary, workers
from tokenfab.engine.requests.block_manager import hash_block, root_digest
from tokenfab.engine.requests.kv_event_publisher import KVEventsConfig, ZmqEventPublisher
from tokenfab.engine.requests.kv_events import BlockStored

BLOCK = 4
PROMPTS = ["the first conversation's long shared prefix", "a second conversation, another prefix entirely",
           "and a third one that nobody else holds at all"]


def claim(publisher: ZmqEventPublisher, ids: list[int]) -> None:
    """Publish that this worker holds the full blocks of ``ids`` (chained digests, as the prefix cache makes)."""
    hashes, parent = [], root_digest()
    for i in range(len(ids) // BLOCK):
        parent = hash_block(parent, ids[i * BLOCK:(i + 1) * BLOCK])
        hashes.append(parent)
    publisher.record(BlockStored(hashes, None, ids[:len(hashes) * BLOCK], BLOCK))


def test_kv_aware_routes_to_the_worker_that_holds_the_blocks():
    if router_binary("vllm-router") is None:
        pytest.skip("vllm-router is not installed (pip install vllm-router)")
    with workers() as ws:
        config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint="tcp://127.0.0.1:*")
        pubs = [ZmqEventPublisher(config) for _ in ws]
        try:
            sources = [arg for w, p in zip(ws, pubs) for arg in ("--kv-event-source", f"{w.url}={p.endpoint}")]
            with router("vllm-router", "kv_aware", [w.url for w in ws], *sources, "--kv-event-block-size",
                        str(BLOCK), "--kv-event-model", "fake-model") as base:
                encode = ws[0].engine.tokenizer.encode
                client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=30)
                deadline = time.monotonic() + 30
                while True:  # ZeroMQ's slow joiner: claim again until the router credits worker 2 with prompt 0
                    for k, prompt in enumerate(PROMPTS):  # worker 2 - k holds prompt k's blocks
                        claim(pubs[2 - k], encode(prompt))
                    time.sleep(0.2)
                    before = len(ws[2].bodies)
                    client.completions.create(model="fake-model", prompt=PROMPTS[0], max_tokens=1)
                    if len(ws[2].bodies) > before:
                        break
                    assert time.monotonic() < deadline, "the router never credited worker 2's blocks"
                served = [len(w.bodies) for w in ws]
                for _ in range(3):
                    for prompt in PROMPTS:
                        client.completions.create(model="fake-model", prompt=prompt, max_tokens=1)
                for k, prompt in enumerate(PROMPTS):  # each prompt went to the worker that holds its blocks
                    new = ws[2 - k].bodies[served[2 - k]:]
                    assert len(new) == 3 and all(json.loads(b)["prompt"] == prompt for b in new), (k, new)
                # chat: the router tokenizes the messages through the worker's /tokenize (continue_final_message in it)
                chat = [{"role": "user", "content": "a chat whose rendered prompt worker 1 holds"}]
                ids = httpx.post(f"{ws[0].url}/tokenize", json={"model": "fake-model", "messages": chat,
                                                                 "continue_final_message": False}).json()["tokens"]
                claim(pubs[1], ids)
                time.sleep(0.5)
                before = len(ws[1].bodies)
                for _ in range(3):
                    client.chat.completions.create(model="fake-model", messages=chat, max_tokens=1)
                assert len(ws[1].bodies) - before == 3
        finally:
            for p in pubs:
                p.close()
