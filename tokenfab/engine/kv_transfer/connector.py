"""The KV connector: what the block manager asks of any store of KV blocks that lives beyond the device's cache.

Blocks are named by the prefix cache's chained digest (``engine.requests.block_manager.hash_block`` over
``root_digest``, which mixes in the LoRA adapter's id and the request's ``cache_salt``): a digest names the
content of a block *and its whole prefix*, so a connector never needs the tokens, and requests of different
adapters or salts can never be handed each other's blocks. ``block_ids`` are indices into the device cache
(the runner's cache tensors, every layer and every cache dtype: ``block_io.BlockIO``).

The engine's calls, all on the engine thread, in program order with the model steps (so the data a call reads
or writes is the device's at that point of the schedule; on CUDA the copies are queued on the current stream):

- ``save(digests, block_ids)`` when the block manager is about to forget the digests of evicted blocks: the
  blocks still hold their data (the scheduler runs before the model step that overwrites them). A connector
  may keep all, some or none of them (a full store drops its least recently used); digests it holds already
  are not copied again.
- ``lookup(digests)`` when a new sequence's local prefix-cache hit ends: how many *leading* digests of the
  rest of its prompt the connector can deliver. Looked-up digests count as recently used, so the saves of the
  same schedule step are unlikely to push them out before they are loaded.
- ``load(digests, block_ids)`` right after, into freshly allocated device blocks: returns how many leading
  blocks were written. Fewer than asked (a file gone or corrupt, an entry evicted since the lookup) is not an
  error: the block manager computes the rest, exactly as on a miss. A connector never raises for a miss.
- ``clear()`` when the prefix cache is reset (weights changed: nothing held may be served again).

Implementations: ``offload.OffloadConnector`` (host memory, then local disk, LRU). A prefill/decode transfer
connector implements the same calls, its "store" being the peer instance.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class KVConnectorStats:
    """Counters of one connector (blocks unless named bytes); the engine stats copy them."""

    lookup_blocks: int = 0  # blocks asked about by lookup()
    lookup_hit_blocks: int = 0  # of which held (the leading run)
    loaded_blocks: int = 0  # blocks written into the device by load()
    load_failed_blocks: int = 0  # asked of load() and not delivered (missing or corrupt file, evicted meanwhile)
    saved_blocks: int = 0  # blocks copied out of the device by save()
    host_blocks: int = 0  # held in host memory now
    host_bytes: int = 0
    disk_blocks: int = 0  # held on local disk now
    disk_bytes: int = 0
    spilled_blocks: int = 0  # moved from host memory to disk (host full)
    dropped_blocks: int = 0  # forgotten for good (the last tier full)


class KVConnector(ABC):
    """A store of KV blocks beyond the device, keyed by prefix-cache digests (see the module docstring)."""

    @abstractmethod
    def lookup(self, digests: Sequence[bytes]) -> int:
        """How many leading ``digests`` this connector can load (0..len(digests))."""

    @abstractmethod
    def load(self, digests: Sequence[bytes], block_ids: Sequence[int]) -> int:
        """Write the blocks named by ``digests`` into device blocks ``block_ids`` (same length), in order;
        returns how many leading blocks were written (the rest of ``block_ids`` is left as it was)."""

    @abstractmethod
    def save(self, digests: Sequence[bytes], block_ids: Sequence[int]) -> None:
        """Copy device blocks ``block_ids`` out under ``digests`` (same length) before they are overwritten."""

    def clear(self) -> None:  # noqa: B027 (optional: a connector holding nothing of its own needs none)
        """Forget everything held (the prefix cache was reset)."""

    def stats(self) -> KVConnectorStats:
        return KVConnectorStats()

    def close(self) -> None:  # noqa: B027 (optional, as clear)
        """Release what the connector holds (files, connections); it serves nothing after this."""
