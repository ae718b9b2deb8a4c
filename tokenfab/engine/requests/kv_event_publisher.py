"""``--kv-events-config``: the block manager's KV-cache events published over ZeroMQ in vLLM's wire format.

The configuration is vLLM's JSON: ``{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint":
"tcp://*:5557", "topic": "kv-events"}`` (``hwm`` and ``max_queue_size`` too). Each message is a ZeroMQ PUB multipart
``(topic, sequence number as 8 bytes big-endian, msgpack payload)``; the payload is a ``KVEventBatch`` array
``[timestamp, [event, ...]]`` whose events are tagged arrays (``kv_events.py``), what vLLM's msgspec decoders read.

The block manager calls ``record`` on the engine's step thread: it only queues the event. A daemon thread owns the
socket (ZeroMQ sockets are not thread-safe), gathers what is queued into one batch and sends it. A full queue drops
the event and counts it (a subscriber that sees a gap in the sequence numbers knows to resync); it never blocks a
step. vLLM's replay socket (``replay_endpoint``) is not implemented: it is refused, not ignored.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from dataclasses import dataclass, fields
from typing import Any

import msgpack
import zmq

from tokenfab.engine.requests.kv_events import KVCacheEvent, batch_wire

logger = logging.getLogger("tokenfab.engine")


@dataclass
class KVEventsConfig:
    """vLLM's ``KVEventsConfig`` fields that apply here."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"  # "zmq" or "null"
    endpoint: str = "tcp://*:5557"
    topic: str = ""
    hwm: int = 100_000  # ZeroMQ send high-water mark (messages)
    max_queue_size: int = 100_000  # events queued for the sender thread
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # vLLM's replay buffer: accepted, unused without replay

    @classmethod
    def parse(cls, value: str | dict | None) -> KVEventsConfig | None:
        """None when events are off; ValueError naming what is wrong."""
        if value is None:
            return None
        raw = json.loads(value) if isinstance(value, str) else dict(value)
        if not isinstance(raw, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"--kv-events-config: unknown keys {unknown}; known: {sorted(known)}")
        config = cls(**raw)
        if config.replay_endpoint is not None:
            raise ValueError("--kv-events-config: replay_endpoint is not supported (no replay socket)")
        if config.publisher not in ("zmq", "null"):
            raise ValueError(f"--kv-events-config: publisher must be 'zmq' or 'null', not {config.publisher!r}")
        if config.hwm < 1 or config.max_queue_size < 1:
            raise ValueError("--kv-events-config: hwm and max_queue_size must be at least 1")
        return config if config.enable_kv_cache_events and config.publisher == "zmq" else None


class ZmqEventPublisher:
    """Binds a PUB socket at ``config.endpoint``; ``record`` is the block manager's listener."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int | None = None) -> None:
        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self.dropped = 0
        self.sent_batches = 0
        self._queue: queue.Queue[KVCacheEvent] = queue.Queue(maxsize=config.max_queue_size)
        self._stop = threading.Event()
        self._ctx = zmq.Context.instance()
        self._socket = self._ctx.socket(zmq.PUB)
        self._socket.setsockopt(zmq.SNDHWM, config.hwm)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(config.endpoint)
        self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)  # the port, when bound to tcp://*:0
        self._topic = config.topic.encode("utf-8")
        self._seq = 0
        self._thread = threading.Thread(target=self._run, name="tokenfab-kv-events", daemon=True)
        self._thread.start()
        logger.info("KV-cache events published on %s (topic %r)", self.endpoint, config.topic)

    def record(self, event: KVCacheEvent) -> None:
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            self.dropped += 1

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    first = self._queue.get(timeout=0.05)
                except queue.Empty:
                    continue
                events = [first]
                while len(events) < 1024:
                    try:
                        events.append(self._queue.get_nowait())
                    except queue.Empty:
                        break
                self._send(events)
        finally:
            self._socket.close(linger=0)

    def _send(self, events: list[KVCacheEvent]) -> None:
        payload = msgpack.packb(batch_wire(time.time(), events, self.data_parallel_rank), use_bin_type=True)
        try:
            self._socket.send_multipart((self._topic, self._seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
            self.sent_batches += 1
        except zmq.Again:  # past the high-water mark: dropped, the sequence gap tells the subscriber
            self.dropped += len(events)
        self._seq += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def attach_publisher(block_manager: Any, value: str | dict | None,
                     data_parallel_rank: int | None = None) -> ZmqEventPublisher | None:
    """The publisher for ``--kv-events-config`` (None when events are off), listening to ``block_manager``."""
    config = KVEventsConfig.parse(value)
    if config is None:
        return None
    if not block_manager.enable_prefix_caching:
        raise ValueError("--kv-events-config needs the prefix cache (drop --no-prefix-caching)")
    publisher = ZmqEventPublisher(config, data_parallel_rank)
    block_manager.event_listeners.append(publisher.record)
    return publisher
