"""Helpers shared by the kernels that read the paged KV cache (standard attention, MLA, DSA).

A paged cache is ``[num_blocks, block_size, Hkv, D]`` (MLA/DSA: one "head" per token, or the
``[num_blocks, block_size, D]`` view ``flat_cache`` returns); sequence ``b`` owns the pages
``block_tables[b]``, so its key ``j`` lives at page ``block_tables[b, j // block_size]``, row
``j % block_size``.

- ``gather_kv``: the references' page gather into one padded ``[B, L, ...]`` block;
  ``pad_queries``: their scatter of the flat queries into ``[B, max_query_len, ...]`` and the
  causal mask over it.
- ``decode_reduce_kernel``: merges the partial softmaxes of a split-KV (flash-decoding) kernel;
  the decode attention, MLA and sparse-MLA kernels write ``part_o [T, H, S, BLOCK_DV]`` (fp32,
  unnormalised) and ``part_ml [T, H, S, 2]`` (running max in log2 units, sum) in this layout.
- ``softcap_log2``, ``check_paged``: the logit transform and the argument checks of the paged
  attention kernels (decode and prefill); ``load_q_tile``, ``qk_scores``: their query tile and
  q . k^T scores of a key tile.
"""

from __future__ import annotations

import torch

# isort: off
# _launch picks Triton's interpreter on machines without a GPU; it must run before triton loads
from tokenfab.kernels._launch import check_device
import triton
import triton.language as tl
# isort: on

LOG2E = 1.4426950408889634
#: The most KV splits a split-KV kernel uses (the reduce kernel merges a power of two of them).
MAX_DECODE_SPLITS = 32


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, max_context_len: int) -> torch.Tensor:
    """[B, max_context_len, Hkv, D] gathered from the pages of each sequence."""
    bs = cache.shape[1]
    nblk = (max_context_len + bs - 1) // bs
    b = block_tables.shape[0]
    # index_select on the flat block index is several times faster on CPU than advanced indexing
    pages = cache.index_select(0, block_tables[:, :nblk].reshape(-1).long())  # [B * nblk, bs, Hkv, D]
    return pages.view(b, nblk * bs, *cache.shape[2:])[:, :max_context_len]


def pad_queries(q: torch.Tensor, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, max_query_len: int,
                max_context_len: int, sliding_window: int = 0) -> tuple:
    """The references' batched layout of a flat mixed batch q [T, ...]: (q_pad [B, Q, ...], seq_idx,
    tok_idx, mask [B, Q, L]). Query i of sequence b sits at position ``context_lens[b] - q_len[b] + i``
    and sees the keys up to it (the last ``sliding_window`` of them when > 0); ``out[seq_idx, tok_idx]``
    takes the real rows back (both None when every row is a decode: q_pad is q's view). Padded query
    rows see key 0, so that their softmax stays finite; they are dropped."""
    b, t, dev = context_lens.shape[0], q.shape[0], q.device
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    ctx = context_lens.long()
    if max_query_len == 1:
        q_pad = q.view(b, 1, *q.shape[1:])
        seq_idx = tok_idx = None
    else:
        seq_idx = torch.repeat_interleave(torch.arange(b, device=dev), q_lens, output_size=t)
        tok_idx = torch.arange(t, device=dev) - cu_seqlens_q[:-1].long()[seq_idx]
        q_pad = q.new_zeros(b, max_query_len, *q.shape[1:])
        q_pad[seq_idx, tok_idx] = q
    i = torch.arange(max_query_len, device=dev)
    j = torch.arange(max_context_len, device=dev)
    qpos = (ctx - q_lens)[:, None] + i[None, :]  # [B, Q]
    mask = (j[None, None, :] <= qpos[:, :, None]) & (j[None, None, :] < ctx[:, None, None])
    if sliding_window > 0:
        mask &= j[None, None, :] > qpos[:, :, None] - sliding_window
    mask |= (i[None, :, None] >= q_lens[:, None, None]) & (j[None, None, :] == 0)
    return q_pad, seq_idx, tok_idx, mask


def flat_cache(kv_cache: torch.Tensor) -> torch.Tensor:
    """[num_blocks, block_size, 1, D] (the runner's layout) or [num_blocks, block_size, D] -> the latter."""
    if kv_cache.dim() == 4:
        if kv_cache.shape[2] != 1:
            raise ValueError(f"MLA cache has one head per token, got shape {tuple(kv_cache.shape)}")
        return kv_cache[:, :, 0]
    if kv_cache.dim() != 3:
        raise ValueError(f"MLA cache must be [blocks, block_size, (1,) D], got {tuple(kv_cache.shape)}")
    return kv_cache



def check_num_splits(num_splits: int) -> None:
    """A split count override (tests, benchmarks) must be a power of two (the reduce's arange)."""
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")


def check_paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    check_device(q)
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k_cache.shape[2]} kv heads")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("paged attention: the head dim of q and the caches must be contiguous")


@triton.jit
def softcap_log2(s, softcap, scale_log2, HAS_SOFTCAP: tl.constexpr):
    """Raw q.k products -> logits in log2 units (scale, optional softcap * tanh(x / softcap))."""
    if HAS_SOFTCAP:
        x = s * (scale_log2 / 1.4426950408889634) / softcap
        # tanh(x) = 1 - 2 / (exp(2x) + 1); exp(2x) = exp2(2x log2 e), clamped against overflow
        e = tl.exp2(tl.minimum(x * 2.8853900817779268, 126.0))
        return (softcap * 1.4426950408889634) * (1.0 - 2.0 / (e + 1.0))
    else:
        return s * scale_log2



@triton.jit
def load_q_tile(q_rows, q_ok, head_dim, BLOCK_D: tl.constexpr, D_CHUNK: tl.constexpr):
    """The query tile [rows, BLOCK_D] of the paged attention kernels when it stays in registers
    (D_CHUNK == BLOCK_D); 0.0 otherwise (``qk_scores`` then re-reads ``q_rows`` chunk by chunk)."""
    if D_CHUNK == BLOCK_D:
        d = tl.arange(0, BLOCK_D)
        q = tl.load(q_rows[:, None] + d[None, :], mask=q_ok[:, None] & (d < head_dim)[None, :], other=0.0)
    else:
        q = 0.0
    return q


@triton.jit
def qk_scores(q, q_rows, q_ok, k_rows, k_ok, head_dim, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_D: tl.constexpr, D_CHUNK: tl.constexpr, KV_FP8: tl.constexpr, DOT_PREC: tl.constexpr):
    """Raw scores q . k^T [BLOCK_Q, BLOCK_N] (fp32) of a query tile against the key rows ``k_rows``
    (``k_ok``: keys to load). D_CHUNK == BLOCK_D: one product with the register tile ``q``; smaller
    (fp32 operands) summed over head-dim chunks re-reading ``q_rows``. An fp8 cache's keys are
    widened to the queries' dtype in registers (their scale is folded into the softmax scale)."""
    if D_CHUNK == BLOCK_D:
        d = tl.arange(0, BLOCK_D)
        k = tl.load(k_rows[:, None] + d[None, :], mask=k_ok[:, None] & (d < head_dim)[None, :], other=0.0)
        if KV_FP8:
            k = k.to(q_rows.dtype.element_ty)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
    else:
        s = tl.zeros((BLOCK_Q, BLOCK_N), tl.float32)
        for dc in tl.static_range(0, BLOCK_D, D_CHUNK):
            dd = dc + tl.arange(0, D_CHUNK)
            qd = tl.load(q_rows[:, None] + dd[None, :], mask=q_ok[:, None] & (dd < head_dim)[None, :], other=0.0)
            kd = tl.load(k_rows[:, None] + dd[None, :], mask=k_ok[:, None] & (dd < head_dim)[None, :], other=0.0)
            if KV_FP8:
                kd = kd.to(q_rows.dtype.element_ty)
            s += tl.dot(qd, tl.trans(kd), input_precision=DOT_PREC)
    return s


@triton.jit
def decode_reduce_kernel(
    part_o_ptr, part_ml_ptr, sink_ptr, out_ptr,
    n_q_heads, head_dim_v, sob, soh,
    NUM_SPLITS: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    """Program (sequence, query head): merge the splits' partial softmaxes (and the sink)."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    sp = tl.arange(0, NUM_SPLITS)
    dv = tl.arange(0, BLOCK_DV)
    row = (b * n_q_heads + h) * NUM_SPLITS + sp
    m = tl.load(part_ml_ptr + row * 2)
    l = tl.load(part_ml_ptr + row * 2 + 1)
    m_all = tl.max(m, 0)
    if HAS_SINKS:
        sink = tl.load(sink_ptr + h).to(tl.float32) * 1.4426950408889634
        m_all = tl.maximum(m_all, sink)
    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)
    w = tl.exp2(m - m_all)
    total = tl.sum(l * w, 0)
    if HAS_SINKS:
        total += tl.exp2(sink - m_all)
    o = tl.load(part_o_ptr + row[:, None] * BLOCK_DV + dv[None, :])
    o = tl.sum(o * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + b * sob + h * soh + dv, o.to(out_ptr.dtype.element_ty), mask=dv < head_dim_v)

