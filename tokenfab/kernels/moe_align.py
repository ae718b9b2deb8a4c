"""MoE alignment: the (token, slot) pairs grouped by expert, each expert's run padded to a
multiple of BLOCK_M with a sentinel, so every BLOCK_M-row tile of the sorted list belongs to one
expert (``expert_ids[tile]``). Triton: per-chunk expert histograms, one program that turns them into
write offsets (and the tile -> expert table), and a scatter whose order inside an expert's run is
the pairs' order (deterministic).
"""

from __future__ import annotations

import torch

# isort: off
# _launch picks Triton's interpreter on machines without a GPU; it must run before triton loads
from tokenfab.kernels._launch import check_device, next_pow2
import triton
import triton.language as tl
# isort: on

from tokenfab.kernels._dispatch import use_triton


def max_padded_pairs(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Length of ``sorted_ids``: every expert that gets a pair pads its run by < block_m, rounded
    up to whole tiles. Depends only on the sizes (no host sync, CUDA-graph safe)."""
    padded = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return triton.cdiv(padded, block_m) * block_m


def moe_align_block_size_ref(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] -> (sorted_ids, expert_ids, num_post_padded), all int32.

    sorted_ids [max_padded_pairs]: flat pair indices (t * k + j) grouped by expert in increasing
    expert order, pairs of one expert in increasing order, each expert's run padded with the
    sentinel T * k to a multiple of ``block_m`` (experts without pairs take no room); the tail
    after ``num_post_padded`` entries is sentinel too. expert_ids [max_padded_pairs / block_m]:
    the expert of each tile, -1 past ``num_post_padded``. num_post_padded [1].
    """
    flat = topk_ids.reshape(-1).long()
    n = flat.numel()
    dev = topk_ids.device
    size = max_padded_pairs(n, num_experts, block_m)
    counts = torch.bincount(flat, minlength=num_experts)[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    start = torch.cumsum(padded, 0) - padded
    first = torch.cumsum(counts, 0) - counts  # index of the expert's first pair in sorted order
    order = torch.argsort(flat, stable=True)
    e_sorted = flat[order]
    pos = start[e_sorted] + torch.arange(n, device=dev) - first[e_sorted]
    sorted_ids = torch.full((size,), n, dtype=torch.int32, device=dev)
    sorted_ids[pos] = order.to(torch.int32)
    total = int(padded.sum())
    expert_ids = torch.full((size // block_m,), -1, dtype=torch.int32, device=dev)
    expert_ids[: total // block_m] = torch.repeat_interleave(
        torch.arange(num_experts, device=dev, dtype=torch.int32), padded // block_m
    )
    return sorted_ids, expert_ids, torch.tensor([total], dtype=torch.int32, device=dev)


@triton.jit
def _moe_count_kernel(ids_ptr, counts_ptr, num_pairs, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr):
    """Program c: histogram of the experts of pairs c*CHUNK .. (c+1)*CHUNK - 1 -> counts[c, :]."""
    c = tl.program_id(0)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1)
    es = tl.arange(0, BLOCK_E)
    cnt = tl.sum((ids[:, None] == es[None, :]).to(tl.int32), axis=0)
    tl.store(counts_ptr + c.to(tl.int64) * BLOCK_E + es, cnt)


@triton.jit
def _moe_offsets_kernel(
    counts_ptr, offsets_ptr, expert_ids_ptr, npost_ptr, num_chunks, num_tiles,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    """One program: per-expert totals -> padded runs -> offsets[c, e] = where chunk c's first pair
    of expert e goes; the tile -> expert table; the padded total."""
    es = tl.arange(0, BLOCK_E)
    total_e = tl.zeros([BLOCK_E], dtype=tl.int32)
    for c0 in range(0, num_chunks, BLOCK_C):
        cs = c0 + tl.arange(0, BLOCK_C)
        x = tl.load(counts_ptr + cs[:, None].to(tl.int64) * BLOCK_E + es[None, :], mask=cs[:, None] < num_chunks,
                    other=0)
        total_e += tl.sum(x, axis=0)
    padded = (total_e + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, axis=0)
    running = end - padded  # the expert's start in sorted_ids
    total = tl.sum(padded, axis=0)
    tl.store(npost_ptr, total)
    for c0 in range(0, num_chunks, BLOCK_C):
        cs = c0 + tl.arange(0, BLOCK_C)
        ptr = cs[:, None].to(tl.int64) * BLOCK_E + es[None, :]
        cm = cs[:, None] < num_chunks
        x = tl.load(counts_ptr + ptr, mask=cm, other=0)
        tl.store(offsets_ptr + ptr, tl.cumsum(x, axis=0) - x + running[None, :], mask=cm)
        running += tl.sum(x, axis=0)
    for b0 in range(0, num_tiles, BLOCK_B):
        bs = b0 + tl.arange(0, BLOCK_B)
        pos = bs * BLOCK_M
        e = tl.sum((end[None, :] <= pos[:, None]).to(tl.int32), axis=1)
        tl.store(expert_ids_ptr + bs, tl.where(pos < total, e, -1), mask=bs < num_tiles)


@triton.jit
def _moe_scatter_kernel(ids_ptr, offsets_ptr, sorted_ptr, num_pairs, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr):
    """Program c: each pair of the chunk goes to offsets[c, e] + (earlier pairs of e in the chunk)."""
    c = tl.program_id(0)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    m = offs < num_pairs
    ids = tl.load(ids_ptr + offs, mask=m, other=-1)
    es = tl.arange(0, BLOCK_E)
    onehot = (ids[:, None] == es[None, :]).to(tl.int32)
    rank = tl.sum(tl.cumsum(onehot, axis=0) * onehot, axis=1) - 1
    base = tl.load(offsets_ptr + c.to(tl.int64) * BLOCK_E + ids, mask=m, other=0)
    tl.store(sorted_ptr + base + rank, offs, mask=m)


def align_config(num_experts: int) -> dict:
    """Chunk sizes of the align kernels: one-hot tiles [CHUNK, BLOCK_E] of at most 8K entries,
    [BLOCK_C, BLOCK_E] count tiles of at most 2K (the offsets program's cumsum stays in registers)."""
    block_e = next_pow2(num_experts)
    return dict(BLOCK_E=block_e, CHUNK=max(16, min(256, 8192 // block_e)), BLOCK_C=max(1, min(64, 2048 // block_e)))


def _moe_align_block_size_triton(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_device(topk_ids)
    dev = topk_ids.device
    flat = topk_ids.reshape(-1)
    if flat.dtype != torch.int32 or not flat.is_contiguous():
        flat = flat.to(torch.int32).contiguous()
    n = flat.numel()
    size = max_padded_pairs(n, num_experts, block_m)
    sorted_ids = torch.full((size,), n, dtype=torch.int32, device=dev)
    num_tiles = size // block_m
    expert_ids = torch.empty(num_tiles, dtype=torch.int32, device=dev)
    npost = torch.empty(1, dtype=torch.int32, device=dev)
    cfg = align_config(num_experts)
    num_chunks = max(1, triton.cdiv(n, cfg["CHUNK"]))
    counts = torch.empty(num_chunks, cfg["BLOCK_E"], dtype=torch.int32, device=dev)
    offsets = torch.empty_like(counts)
    _moe_count_kernel[(num_chunks,)](flat, counts, n, CHUNK=cfg["CHUNK"], BLOCK_E=cfg["BLOCK_E"], num_warps=4)
    _moe_offsets_kernel[(1,)](
        counts, offsets, expert_ids, npost, num_chunks, num_tiles,
        BLOCK_M=block_m, BLOCK_C=cfg["BLOCK_C"], BLOCK_E=cfg["BLOCK_E"], BLOCK_B=max(16, 4096 // cfg["BLOCK_E"]),
        num_warps=4,
    )
    if n:
        _moe_scatter_kernel[(num_chunks,)](flat, offsets, sorted_ids, n, CHUNK=cfg["CHUNK"], BLOCK_E=cfg["BLOCK_E"],
                                           num_warps=4)
    return sorted_ids, expert_ids, npost


@torch.library.custom_op("tokenfab::moe_align_block_size", mutates_args=())
def moe_align_block_size(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group (token, slot) pairs by expert in BLOCK_M-aligned runs; see ``moe_align_block_size_ref``."""
    if use_triton(topk_ids):
        return _moe_align_block_size_triton(topk_ids, num_experts, block_m)
    return moe_align_block_size_ref(topk_ids, num_experts, block_m)


@moe_align_block_size.register_fake
def _(topk_ids, num_experts, block_m):
    size = max_padded_pairs(topk_ids.numel(), num_experts, block_m)
    return (topk_ids.new_empty(size, dtype=torch.int32), topk_ids.new_empty(size // block_m, dtype=torch.int32),
            topk_ids.new_empty(1, dtype=torch.int32))

