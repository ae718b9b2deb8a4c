"""Builds the KV tier beyond the device (``--kv-offload-bytes``, ``--kv-offload-dir``) over a runner's caches:
the connector the block manager saves evicted blocks to and loads prefix hits from (``engine/kv_transfer``)."""

from __future__ import annotations

import logging
from typing import Any

from tokenfab.engine.kv_transfer.block_io import BlockIO
from tokenfab.engine.kv_transfer.offload import OffloadConnector
from tokenfab.engine.kv_transfer.tier import KVTierStore
from tokenfab.engine.requests.block_manager import BlockManager
from tokenfab.engine.runner.model_runner import ModelRunner, attention_layers, paged_cache_layers

log = logging.getLogger("tokenfab")

DEFAULT_DISK_BYTES = 8 * 1024**3  # --kv-offload-dir without --kv-offload-disk-bytes


def runner_block_io(runner: ModelRunner) -> BlockIO:
    """Every cache tensor of the runner, all layers and cache dtypes, as the runner lays them out: attention
    caches [L, 2, NB, ...] have the block axis 2; latent caches [L, NB, ...] (MLA: a model with no Attention
    layer) axis 1; per-layer paged caches (DeepSeek-V4's ``paged_cache_shapes``) are views [NB, ...] of one flat
    tensor, taken one by one (axis 0)."""
    paged = paged_cache_layers(runner.model)
    if paged:
        caches = [(getattr(m, name), 0) for m in paged for name in m.paged_cache_shapes(runner.block_size)]
    else:
        axis = 2 if attention_layers(runner.model) else 1
        caches = [(cache, axis) for cache in runner.kv_caches.values()]
    return BlockIO(caches, runner.num_blocks)


def offload_connector_for(args: Any, runner: ModelRunner, speculative: bool = False) -> OffloadConnector | None:
    """The tier's connector, or None when neither ``kv_offload_bytes`` nor ``kv_offload_dir`` is set.
    ValueError for what it cannot serve yet (the runner's caches are not the whole KV: other ranks' shards,
    a draft model's cache)."""
    host = args.kv_offload_bytes or 0
    if not host and args.kv_offload_dir is None:
        return None
    if args.tensor_parallel_size != 1:
        raise ValueError("--kv-offload-bytes with --tensor-parallel-size > 1 is not supported yet (each rank "
                         "holds a shard of every block)")
    if speculative:
        raise ValueError("--kv-offload-bytes with --speculative-config is not supported yet (the draft's cache "
                         "is not offloaded)")
    disk = args.kv_offload_disk_bytes if args.kv_offload_disk_bytes is not None else DEFAULT_DISK_BYTES
    io = runner_block_io(runner)
    store = KVTierStore(host, args.kv_offload_dir, disk if args.kv_offload_dir is not None else 0)
    if not args.enable_prefix_caching:
        log.warning("KV tier: prefix caching is off, so no block is ever offloaded or looked up")
    log.info("KV tier: %d B per block; host %d B (%d blocks), disk %s", io.block_nbytes, host,
             host // io.block_nbytes, f"{disk} B under {store.dir}" if store.dir else "none")
    return OffloadConnector(io, store)


def offload_stats(bm: BlockManager) -> dict[str, int]:
    """The tier's fields of ``EngineStats`` (none when it is off: their defaults are 0)."""
    c = bm.connector
    if c is None:
        return {}
    s = c.stats()
    return {
        "kv_offload_queries_total": bm.connector_queries,
        "kv_offload_hits_total": bm.connector_hits,
        "kv_offload_misses_total": bm.connector_queries - bm.connector_hits,
        "kv_offload_loaded_blocks_total": s.loaded_blocks,
        "kv_offload_saved_blocks_total": s.saved_blocks,
        "kv_offload_failed_blocks_total": s.load_failed_blocks,
        "kv_offload_spilled_blocks_total": s.spilled_blocks,
        "kv_offload_dropped_blocks_total": s.dropped_blocks,
        "kv_offload_host_blocks": s.host_blocks,
        "kv_offload_host_bytes": s.host_bytes,
        "kv_offload_disk_blocks": s.disk_blocks,
        "kv_offload_disk_bytes": s.disk_bytes,
    }
