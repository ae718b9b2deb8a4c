"""KV-cache events: what the block manager's prefix cache tells the fleet (a precise prefix-aware router, llm-d's
KV indexer) about which blocks this replica holds. The shapes and names are vLLM's (``vllm/distributed/
kv_events.py``, the current layout: each event a msgspec-tagged map ``{"type": "BlockStored", ...}`` inside an
array-like batch; older vLLM releases encoded events as tagged arrays, which vllm-router 0.1.17 refuses with "KV
event must be a tagged map"), so vLLM's subscribers and vllm-router's ``kv_aware`` index decode ours:

- ``BlockStored``: full blocks that became reusable (prefix-cached), with the digest of each, the digest of the
  block before the first (None at the start of a sequence), their tokens, the block size, the LoRA id, the medium;
- ``BlockRemoved``: blocks whose digests were forgotten (evicted to make room);
- ``AllBlocksCleared``: the whole prefix cache dropped (``reset_prefix_cache``).

The block manager calls its listeners with these (a list of callables: no listener, no cost beyond a check); the
ZeroMQ publisher (``kv_event_publisher.py``) is one such listener. Digests are our BLAKE2b-128 bytes (vLLM's
``ExternalBlockHash`` is bytes or int), chained as the prefix cache chains them; ``medium`` is "GPU", vLLM's word for
the engine's own KV cache (device memory, or host memory for a CPU engine), as opposed to an offload tier.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MEDIUM = "GPU"


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM
    lora_name: str | None = None

    def wire(self) -> dict[str, Any]:
        """vLLM's msgpack layout: a map tagged by ``type`` (msgspec ``tag=True``; fields with defaults omitted)."""
        return {"type": "BlockStored", "block_hashes": self.block_hashes, "parent_block_hash": self.parent_block_hash,
                "token_ids": self.token_ids, "block_size": self.block_size, "lora_id": self.lora_id,
                "medium": self.medium, "lora_name": self.lora_name}


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[bytes]
    medium: str | None = MEDIUM

    def wire(self) -> dict[str, Any]:
        return {"type": "BlockRemoved", "block_hashes": self.block_hashes, "medium": self.medium}


@dataclass(frozen=True)
class AllBlocksCleared:
    def wire(self) -> dict[str, Any]:
        return {"type": "AllBlocksCleared"}


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
KVEventListener = Callable[[KVCacheEvent], None]


def batch_wire(ts: float, events: list[KVCacheEvent], data_parallel_rank: int | None = None) -> list[Any]:
    """vLLM's ``KVEventBatch`` (array_like, omit_defaults): [ts, events] plus the data-parallel rank when set."""
    out: list[Any] = [ts, [e.wire() for e in events]]
    if data_parallel_rank is not None:
        out.append(data_parallel_rank)
    return out
