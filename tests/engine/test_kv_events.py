"""KV-cache events (``--kv-events-config``) read by a ZeroMQ SUB socket and decoded with msgspec structs written
from vLLM's format (``vllm/distributed/kv_events.py``: events as maps tagged by ``type`` in an array-like batch), then
matched to the blocks the engine's prefix cache holds."""

from __future__ import annotations

import random
import time

import pytest
import zmq

from tests.tiny_models import run_batch, small_engine
from tokenfab.engine.requests.kv_event_publisher import KVEventsConfig

msgspec = pytest.importorskip("msgspec", reason="the decoder is written with msgspec, as vLLM's (pip install msgspec)")

BLOCK = 4  # small_engine's block size


# vLLM's event types, written from its current format (the batch array-like; events maps tagged by "type")
class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list | None = None
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


class Subscriber:
    def __init__(self, endpoint: str, topic: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.topic = topic
        self.seqs: list[int] = []

    def drain(self, timeout: float = 0.5) -> list[object]:
        """Every event received until ``timeout`` seconds pass with nothing new."""
        events = []
        while self.sock.poll(int(timeout * 1000)):
            topic, seq, payload = self.sock.recv_multipart()
            assert topic == self.topic.encode()
            self.seqs.append(int.from_bytes(seq, "big"))
            events.extend(DECODER.decode(payload).events)
        return events

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def engine_and_events(tiny_llama_dir):
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:*",
              "topic": "kv-events"}
    engine = small_engine(tiny_llama_dir, kv_events_config=config)
    sub = Subscriber(engine.kv_events.endpoint, "kv-events")
    deadline = time.monotonic() + 10
    while True:  # ZeroMQ's slow joiner: a reset (AllBlocksCleared) until the subscription is live
        engine.block_manager.reset_prefix_cache()
        if sub.drain(0.1):
            break
        assert time.monotonic() < deadline, "no event reached the subscriber"
    sub.seqs.clear()
    yield engine, sub
    sub.close()
    engine.shutdown()


def test_events_match_the_blocks_the_engine_holds(engine_and_events):
    engine, sub = engine_and_events
    rng = random.Random(0)
    shared = [rng.randrange(1, 300) for _ in range(3 * BLOCK)]
    # two prompts sharing three blocks, then enough others to evict (64 blocks of 4 tokens in all)
    prompts = [shared + [rng.randrange(1, 300) for _ in range(5)] for _ in range(2)]
    prompts += [[rng.randrange(1, 300) for _ in range(17)] for _ in range(20)]
    run_batch(engine, prompts[:2], max_tokens=2)
    first = sub.drain()
    stored = [e for e in first if isinstance(e, BlockStored)]
    assert stored and not any(isinstance(e, BlockRemoved) for e in first)
    held: dict[bytes, list[int]] = {}
    for e in stored:  # each run chains to its parent; tokens are the blocks' tokens
        assert e.block_size == BLOCK and e.medium == "GPU" and e.lora_id is None
        assert len(e.token_ids) == BLOCK * len(e.block_hashes)
        assert e.parent_block_hash is None or e.parent_block_hash in held
        for i, h in enumerate(e.block_hashes):
            held[h] = e.token_ids[i * BLOCK:(i + 1) * BLOCK]
    first_blocks = [held[h] for h in held if h not in {e.parent_block_hash for e in stored}]
    assert shared[:BLOCK] in list(held.values()) and len(held) >= 4, first_blocks  # the shared prefix, stored once
    assert set(held) == set(engine.block_manager.cached)

    run_batch(engine, prompts[2:], max_tokens=3)
    later = sub.drain()
    removed = {h for e in later if isinstance(e, BlockRemoved) for h in e.block_hashes}
    assert removed, "20 more prompts in 64 blocks must evict some"
    for e in later:  # replay the stream in order: the subscriber's view of the cache
        if isinstance(e, BlockStored):
            held.update({h: e.token_ids[i * BLOCK:(i + 1) * BLOCK] for i, h in enumerate(e.block_hashes)})
        elif isinstance(e, BlockRemoved):
            for h in e.block_hashes:
                del held[h]  # removed only what was stored
    assert set(held) == set(engine.block_manager.cached)
    assert sub.seqs == list(range(sub.seqs[0], sub.seqs[0] + len(sub.seqs)))  # no gap: nothing dropped

    engine.block_manager.reset_prefix_cache()
    assert [type(e) for e in sub.drain()] == [AllBlocksCleared]
    assert not engine.block_manager.cached


def test_config_is_vllms_shape_and_refuses_what_it_cannot_do():
    assert KVEventsConfig.parse(None) is None
    assert KVEventsConfig.parse('{"enable_kv_cache_events": false, "publisher": "zmq"}') is None
    on = KVEventsConfig.parse('{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
                              '"topic": "kv-events", "hwm": 10, "max_queue_size": 10, "buffer_steps": 5}')
    assert on is not None and on.endpoint == "tcp://*:5557" and on.topic == "kv-events"
    for bad in ('{"enable_kv_cache_events": true, "publisher": "kafka"}',
                '{"enable_kv_cache_events": true, "publisher": "zmq", "replay_endpoint": "tcp://*:5558"}',
                '{"enable_kv_cache_events": true, "endpoit": "tcp://*:5557"}', "[1]"):
        with pytest.raises(ValueError):
            KVEventsConfig.parse(bad)
