"""The KV tier's connector (``--kv-offload-bytes``, ``--kv-offload-dir``): evicted prefix-cache blocks are
copied to host memory, then spill to local disk (``tier.KVTierStore``), and are copied back into device blocks
on a later prefix hit instead of being recomputed (``connector.KVConnector`` says when the engine calls)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tokenfab.engine.kv_transfer.block_io import BlockIO
from tokenfab.engine.kv_transfer.connector import KVConnector, KVConnectorStats
from tokenfab.engine.kv_transfer.tier import KVTierStore


class OffloadConnector(KVConnector):
    def __init__(self, io: BlockIO, store: KVTierStore) -> None:
        self.io = io
        self.store = store
        self._stats = KVConnectorStats()

    def lookup(self, digests: Sequence[bytes]) -> int:
        n = self.store.lookup(digests)
        self._stats.lookup_blocks += len(digests)
        self._stats.lookup_hit_blocks += n
        return n

    def load(self, digests: Sequence[bytes], block_ids: Sequence[int]) -> int:
        if len(digests) != len(block_ids):
            raise ValueError(f"{len(digests)} digests for {len(block_ids)} blocks")
        payloads = []
        for d in digests:
            p = self.store.get(d)
            if p is None:
                break
            payloads.append(p)
        n = len(payloads)
        if n:
            rows = torch.stack(payloads)
            self.io.write(block_ids[:n], rows)
        self._stats.loaded_blocks += n
        self._stats.load_failed_blocks += len(digests) - n
        return n

    def save(self, digests: Sequence[bytes], block_ids: Sequence[int]) -> None:
        if len(digests) != len(block_ids):
            raise ValueError(f"{len(digests)} digests for {len(block_ids)} blocks")
        todo = [(d, b) for d, b in zip(digests, block_ids) if not self.store.lookup([d])]  # held: touched only
        if not todo:
            return
        rows = self.io.read([b for _, b in todo])
        for (d, _), row in zip(todo, rows):
            self.store.put(d, row.clone())  # its own storage: a row view would keep the whole batch alive
        self._stats.saved_blocks += len(todo)

    def clear(self) -> None:
        self.store.clear()

    def stats(self) -> KVConnectorStats:
        s, st = self._stats, self.store
        s.host_blocks, s.host_bytes = len(st.host), st.host_bytes
        s.disk_blocks, s.disk_bytes = len(st.disk), st.disk_bytes
        s.spilled_blocks, s.dropped_blocks = st.spilled, st.dropped
        return KVConnectorStats(**vars(s))

    def close(self) -> None:
        self.store.close()

