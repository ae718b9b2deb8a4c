"""DeepSeek Sparse Attention's lightning indexer (DeepSeek-V3.2, GLM-5): scores, then top-k.

For a query token t (position p) with indexer queries ``q_idx [Hi, di]`` and per-head weights ``w [Hi]``:

    score[t, j] = sum_h w[h] * relu(q_idx[h] . k_idx[j])          for keys j <= p (else -inf)
    sel[t]      = the ``topk`` keys of largest score (all visible keys when there are fewer)

``dsa_topk_indices`` returns ``[T, topk]`` int32 key positions (within the sequence), -1 for unused
slots; ``kernels/dsa.py`` attends over exactly those keys. Ties at the k-th score go to the lowest
positions in both paths, so a selection never depends on the batch's padded width.

Triton: the scores run as one program per (query token, key block), ``Hi`` heads at once (a
[Hi, di] x [di, BLOCK_N] product, ReLU, weighted head sum), into a [T, max_context_len] fp32 score row
per token; then one program per token selects its top-k by bisecting for the k-th largest score over
order-preserving int32 keys (32 counting passes over the row, L2-resident), writing the positions
above it and then ties (lowest first). The Triton path returns the set unsorted, the reference sorted
by score.
"""

from __future__ import annotations

import torch

# isort: off
# _launch picks Triton's interpreter on machines without a GPU; it must run before triton loads
from tokenfab.kernels._launch import check_device, dot_precision, next_pow2
import triton
import triton.language as tl
# isort: on

from tokenfab.kernels._dispatch import kernel_op
from tokenfab.kernels.mla_ref import REF_CHUNK_ELEMENTS
from tokenfab.kernels.paged import flat_cache, gather_kv

# ============================================================================ indexer


def token_layout(cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, t: int):
    """Per query token: its sequence and position (= the last key it sees)."""
    b = context_lens.shape[0]
    dev = context_lens.device
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    seq = torch.repeat_interleave(torch.arange(b, device=dev), q_lens, output_size=t)
    pos = torch.arange(t, device=dev) - cu_seqlens_q[:-1].long()[seq] + (context_lens.long() - q_lens)[seq]
    return seq, pos


def dsa_index_scores_ref(
    q: torch.Tensor,
    weights: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    max_query_len: int,
    max_context_len: int,
    index_offset: int,
) -> torch.Tensor:
    """q [T, Hi, di], weights [T, Hi] -> scores [T, max_context_len] fp32, -inf at keys a token does not see.

    Batched: the index keys of every sequence are gathered into one padded [B, L, di] block and
    each token's row is computed against its sequence's block (no Python loop over sequences).
    """
    t, hi, di = q.shape
    if t == 0 or context_lens.shape[0] == 0:
        return q.new_empty(t, max_context_len, dtype=torch.float32)
    cache = flat_cache(kv_cache)[..., index_offset : index_offset + di]
    keys = gather_kv(cache, block_tables, max_context_len).float()  # [B, L, di]
    seq, pos = token_layout(cu_seqlens_q, context_lens, t)
    scores = torch.empty(t, max_context_len, dtype=torch.float32, device=q.device)
    # tokens in chunks, so the [chunk, Hi, L] products stay bounded on long prefills
    step = max(1, REF_CHUNK_ELEMENTS // max(1, hi * max_context_len + max_context_len * di))
    for t0 in range(0, t, step):
        t1 = min(t0 + step, t)
        s = torch.relu(torch.einsum("thd,tld->thl", q[t0:t1].float(), keys[seq[t0:t1]]))  # [c, Hi, L]
        scores[t0:t1] = torch.einsum("th,thl->tl", weights[t0:t1].float(), s)
    j = torch.arange(max_context_len, device=q.device)
    return scores.masked_fill(j[None, :] > pos[:, None], float("-inf"))


def select_topk(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """[T, L] scores (-inf: not visible) -> [T, topk] int32 key positions, -1 where fewer keys are visible.

    Ties at the k-th score go to the lowest positions (0.0 and -0.0 are one score), as in the Triton
    kernel. ``torch.topk`` alone breaks ties by its own algorithm, which depends on the row's width:
    a short sequence padded to a long neighbour's width picked other keys than alone (the indexer's
    ReLU makes exact ties common), so its output depended on the batch. Here each score becomes a
    unique int64 key (the score's order-preserving bits, then the position), whose top-k is one
    well-defined set."""
    t, n = scores.shape
    k = min(topk, n)
    out = torch.full((t, topk), -1, dtype=torch.int32, device=scores.device)
    if k == 0 or t == 0:
        return out
    s = scores.float() + 0.0  # -0.0 + 0.0 = +0.0
    bits = s.contiguous().view(torch.int32)
    order = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(torch.int64)
    pos = torch.arange(n, device=scores.device, dtype=torch.int64)
    _, idx = ((order << 32) | (0x7FFFFFFF - pos)).topk(k, dim=-1)
    visible = s.gather(1, idx) > float("-inf")
    out[:, :k] = torch.where(visible, idx, -1).to(torch.int32)
    return out


def dsa_topk_indices_ref(
    q: torch.Tensor,
    weights: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    max_query_len: int,
    max_context_len: int,
    index_offset: int,
    topk: int,
) -> torch.Tensor:
    """The lightning indexer's selection: [T, topk] int32 key positions (-1 for unused slots)."""
    scores = dsa_index_scores_ref(q, weights, kv_cache, block_tables, cu_seqlens_q, context_lens, max_query_len,
                                  max_context_len, index_offset)
    return select_topk(scores, topk)


@triton.jit
def _dsa_index_kernel(
    q_ptr, w_ptr, c_ptr, bt_ptr, tok_seq_ptr, cu_ptr, ctx_ptr, out_ptr,
    n_heads, head_dim, index_offset, n_cols, block_size: tl.constexpr,
    sqt, sqh, swt, scb, sct, sbt, sot,
    BLOCK_HI: tl.constexpr,
    BLOCK_DI: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Program (query token, key block): scores of BLOCK_N keys for all indexer heads at once."""
    t = tl.program_id(0)
    nb = tl.program_id(1)
    t64 = t.to(tl.int64)
    b = tl.load(tok_seq_ptr + t)
    q_start = tl.load(cu_ptr + b)
    q_len = tl.load(cu_ptr + b + 1) - q_start
    kv_end = tl.load(ctx_ptr + b) - q_len + (t - q_start) + 1
    j = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = j < n_cols
    j_ok = j < kv_end
    h = tl.arange(0, BLOCK_HI)
    d = tl.arange(0, BLOCK_DI)
    h_ok = h < n_heads
    d_ok = d < head_dim
    total = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    if nb * BLOCK_N < kv_end:
        q = tl.load(q_ptr + t64 * sqt + h.to(tl.int64)[:, None] * sqh + d[None, :],
                    mask=h_ok[:, None] & d_ok[None, :], other=0.0)
        w = tl.load(w_ptr + t64 * swt + h, mask=h_ok, other=0.0).to(tl.float32)
        page = tl.load(bt_ptr + b.to(tl.int64) * sbt + j // block_size, mask=j_ok, other=0).to(tl.int64)
        rows = c_ptr + page * scb + (j % block_size).to(tl.int64) * sct + index_offset
        k = tl.load(rows[:, None] + d[None, :], mask=j_ok[:, None] & d_ok[None, :], other=0.0).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)  # [BLOCK_HI, BLOCK_N]
        s = tl.maximum(s, 0.0)
        total = tl.where(j_ok, tl.sum(s * w[:, None], 0), float("-inf"))
    tl.store(out_ptr + t64 * sot + j, total, mask=col_ok)


def index_config(n_heads: int, head_dim: int, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Launch configuration of the indexer scores (also used by the compile test)."""
    fp32 = dtype == torch.float32
    return dict(
        BLOCK_HI=max(16, next_pow2(n_heads)),
        BLOCK_DI=max(16, next_pow2(head_dim)),
        BLOCK_N=32 if fp32 else 64,
        num_warps=4,
        num_stages=2,
    )


def _dsa_index_scores_triton(
    q: torch.Tensor,
    weights: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    max_query_len: int,
    max_context_len: int,
    index_offset: int,
    *,
    config: dict | None = None,
) -> torch.Tensor:
    t, hi, di = q.shape
    out = torch.empty(t, max_context_len, dtype=torch.float32, device=q.device)
    if t == 0 or context_lens.shape[0] == 0 or max_context_len == 0:
        return out
    check_device(q)
    cache = flat_cache(kv_cache)
    if cache.shape[-1] < index_offset + di:
        raise ValueError(f"cache rows of {cache.shape[-1]} values hold no index key at {index_offset}..+{di}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if weights.stride(-1) != 1:
        weights = weights.contiguous()
    cfg = index_config(hi, di, q.dtype)  # q's dtype = the cache's, or what an fp8 cache's keys widen to
    cfg.update(config or {})
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    tok_seq = torch.repeat_interleave(torch.arange(context_lens.shape[0], device=q.device, dtype=torch.int32),
                                      q_lens, output_size=t)
    grid = (t, triton.cdiv(max_context_len, cfg["BLOCK_N"]))
    _dsa_index_kernel[grid](
        q, weights, cache, block_tables, tok_seq, cu_seqlens_q, context_lens, out,
        hi, di, index_offset, max_context_len, cache.shape[1],
        q.stride(0), q.stride(1), weights.stride(0), cache.stride(0), cache.stride(1), block_tables.stride(0),
        out.stride(0), DOT_PREC=dot_precision(q.dtype), **cfg,
    )
    return out


@triton.jit
def _sortable_key(x):
    """fp32 -> int32 with the same order (flip the magnitude bits of negatives)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = tl.where(bits == -2147483648, 0, bits)  # -0.0 is the same score as 0.0
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _dsa_topk_kernel(
    scores_ptr, out_ptr, n_cols, k, sst, sot,
    BLOCK: tl.constexpr,
):
    """Program (token): the positions of the row's k largest scores (any order), -1 padded.

    A bisection over the scores' order-preserving int32 keys finds the k-th largest value thr
    (32 counting passes over the row); then the keys above thr are written, then keys equal to
    thr (lowest positions first) until k. Rows with at most k visible (finite) keys keep them all.
    """
    t = tl.program_id(0).to(tl.int64)
    row = scores_ptr + t * sst
    out = out_ptr + t * sot
    cols = tl.arange(0, BLOCK)
    n_vis = 0
    for c0 in range(0, n_cols, BLOCK):
        x = tl.load(row + c0 + cols, mask=c0 + cols < n_cols, other=float("-inf"))
        n_vis += tl.sum((x > float("-inf")).to(tl.int32), 0)
    lo = (-2147483647 - 1) + 0 * n_vis.to(tl.int64)  # int64 scalars: mid never overflows
    hi = 2147483647 + 0 * n_vis.to(tl.int64)
    for _ in range(32):
        mid = lo + (hi - lo + 1) // 2
        cnt = 0
        for c0 in range(0, n_cols, BLOCK):
            x = tl.load(row + c0 + cols, mask=c0 + cols < n_cols, other=float("-inf"))
            key = _sortable_key(x).to(tl.int64)
            cnt += tl.sum(((key >= mid) & (c0 + cols < n_cols)).to(tl.int32), 0)
        ok = cnt >= k
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    thr = lo
    # at most k visible keys: take exactly the visible ones (no ties to fill)
    thr = tl.where(n_vis <= k, -2139095041, thr)  # the key of -inf
    pos = 0
    for c0 in range(0, n_cols, BLOCK):
        x = tl.load(row + c0 + cols, mask=c0 + cols < n_cols, other=float("-inf"))
        key = _sortable_key(x).to(tl.int64)
        sel = (key > thr) & (c0 + cols < n_cols)
        offs = pos + tl.cumsum(sel.to(tl.int32), 0) - 1
        tl.store(out + offs, (c0 + cols).to(tl.int32), mask=sel)
        pos += tl.sum(sel.to(tl.int32), 0)
    budget = tl.where(n_vis <= k, 0, k - pos)
    taken = 0
    for c0 in range(0, n_cols, BLOCK):
        x = tl.load(row + c0 + cols, mask=c0 + cols < n_cols, other=float("-inf"))
        key = _sortable_key(x).to(tl.int64)
        eq = (key == thr) & (c0 + cols < n_cols)
        c = tl.cumsum(eq.to(tl.int32), 0)
        take = eq & (taken + c <= budget)
        tl.store(out + pos + taken + c - 1, (c0 + cols).to(tl.int32), mask=take)
        taken += tl.sum(take.to(tl.int32), 0)


def _dsa_topk_triton(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """[T, L] fp32 scores -> [T, topk] int32 positions (the set ``select_topk`` picks; not sorted)."""
    t, n = scores.shape
    out = torch.full((t, topk), -1, dtype=torch.int32, device=scores.device)
    if t == 0 or n == 0 or topk == 0:
        return out
    check_device(scores)
    if scores.stride(-1) != 1:
        scores = scores.contiguous()
    _dsa_topk_kernel[(t,)](scores, out, n, topk, scores.stride(0), out.stride(0), **topk_config(n))
    return out


def topk_config(n_cols: int) -> dict:
    return dict(BLOCK=min(1024, max(16, next_pow2(n_cols))), num_warps=4)


def _dsa_topk_indices_triton(*args) -> torch.Tensor:
    """The Triton path: every key's index score (``_dsa_index_scores_triton``), then the top-k of them."""
    *score_args, topk = args
    return _dsa_topk_triton(_dsa_index_scores_triton(*score_args), topk)


dsa_topk_indices = kernel_op(
    "dsa_topk_indices", _dsa_topk_indices_triton, dsa_topk_indices_ref,
    lambda q, *args: q.new_empty(q.shape[0], args[-1], dtype=torch.int32),
    doc="The lightning indexer: [T, topk] int32 positions of the keys each token attends to (-1: none).",
)
