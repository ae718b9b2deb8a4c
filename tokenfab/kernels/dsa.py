"""DeepSeek Sparse Attention (DSA; DeepSeek-V3.2, GLM-5): sparse MLA over the keys the indexer picked.

The paged cache of a DSA layer holds, per token, one row ``[c (r) ; k_pe (rope) ; k_idx (di)]``: the MLA
latent and rope key, then the indexer's key. The lightning indexer (``kernels/dsa_indexer.py``, whose
names are re-exported here) gives each query token t its ``[topk]`` key positions sel[t]; then

    o_lat[t, h] = softmax_j in sel(scale * (q_lat[h] . c_j + q_pe[h] . k_pe_j)) c_j       (MLA, absorbed)

``dsa_sparse_attention`` attends over exactly those keys (-1 entries are unused). The batch layout is the
engine's flat mixed batch (``ForwardBatch``), as in ``tokenfab/kernels/mla.py``.

Triton: MLA's split-KV kernel walking the token's index list instead of a contiguous key range (one
page lookup per selected key), with MLA's reduce.

FP8 latent cache: ``dsa_sparse_attention(..., kv_scale=)`` dequantizes as MLA does. The index key in the
same row is then fp8 too (written by ``store_latent`` with the layer's scale); the indexer reads its raw
e4m3 values without the scale, which changes no selection: score = sum_h w_h relu(q_h . s k) is s times
the unscaled score for any s > 0, so the top-k is the same.
"""

from __future__ import annotations

import torch

# isort: off
# _launch picks Triton's interpreter on machines without a GPU; it must run before triton loads
from tokenfab.kernels._launch import check_device, dot_precision, num_sms
import triton
import triton.language as tl
# isort: on

from tokenfab.kernels._dispatch import kernel_op
from tokenfab.kernels.dsa_indexer import (  # noqa: F401 (the indexer's public names, re-exported)
    _dsa_index_scores_triton,
    _dsa_topk_triton,
    dsa_index_scores_ref,
    dsa_topk_indices,
    dsa_topk_indices_ref,
    index_config,
    select_topk,
    token_layout,
    topk_config,
)
from tokenfab.kernels.kv_cache import check_latent_fp8, latent_rows, raw_cache
from tokenfab.kernels.mla import latent_query, latent_scores, latent_store, mla_config
from tokenfab.kernels.mla_ref import REF_CHUNK_ELEMENTS
from tokenfab.kernels.paged import LOG2E, check_num_splits, decode_reduce_kernel, flat_cache

# ============================================================================ sparse MLA


def dsa_sparse_attention_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    indices: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, H, r + rope], indices [T, K] (key positions, -1: unused) -> o_lat [T, H, r].

    Batched: the selected rows of every token are gathered at once ([T, K, D]); one masked softmax.
    """
    t, h, d = q.shape
    r = kv_lora_rank
    if t == 0:
        return q.new_empty(t, h, r)
    cache = flat_cache(kv_cache)
    check_latent_fp8("dsa_sparse_attention", q, cache, kv_scale)
    bs = cache.shape[1]
    seq, _ = token_layout(cu_seqlens_q, context_lens, t)
    valid = indices >= 0
    j = indices.long().clamp(min=0)
    slots = block_tables.long()[seq[:, None], j // bs] * bs + j % bs  # [T, K]
    flat = raw_cache(cache).reshape(-1, cache.shape[-1])[:, :d]
    out = q.new_empty(t, h, r)
    k = indices.shape[1]
    step = max(1, REF_CHUNK_ELEMENTS // max(1, k * (d + h)))  # tokens per chunk: bounded [c, K, D] rows
    for t0 in range(0, t, step):
        t1 = min(t0 + step, t)
        rows = latent_rows(cache, flat.index_select(0, slots[t0:t1].reshape(-1)).view(t1 - t0, k, d), kv_scale)
        logits = torch.einsum("thd,tkd->thk", q[t0:t1].float(), rows) * scale
        probs = torch.softmax(logits.masked_fill(~valid[t0:t1, None, :], float("-inf")), dim=-1)
        out[t0:t1] = torch.einsum("thk,tkr->thr", probs, rows[..., :r]).to(q.dtype)
    return out


@triton.jit
def _dsa_sparse_split_kernel(
    q_ptr, c_ptr, bt_ptr, tok_seq_ptr, idx_ptr, kvs_ptr,
    out_ptr, part_o_ptr, part_ml_ptr,
    scale_log2, n_heads, kv_rank, rope_dim, n_idx, block_size: tl.constexpr,
    sqt, sqh, scb, sct, sbt, sit, sot, soh,
    NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    DOT_PREC: tl.constexpr,
    KV_FP8: tl.constexpr = False,
):
    """Program (head block, query token, split): BLOCK_H heads over one share of the token's index list."""
    hb = tl.program_id(0)
    t = tl.program_id(1)
    sp = tl.program_id(2)
    t64 = t.to(tl.int64)
    b = tl.load(tok_seq_ptr + t)
    if KV_FP8:
        scale_log2 = scale_log2 * tl.load(kvs_ptr)
    per = tl.cdiv(tl.cdiv(n_idx, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = sp * per
    end = tl.minimum(start + per, n_idx)

    heads, h_ok, r, r_ok, pe, pe_ok, q_lat, q_pe = latent_query(q_ptr, t64, sqt, sqh, hb, n_heads, kv_rank,
                                                               rope_dim, BLOCK_H, BLOCK_R, BLOCK_P)

    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_R), tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * sbt
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        j = tl.load(idx_ptr + t64 * sit + n, mask=n < end, other=-1)
        j_ok = j >= 0
        jj = tl.where(j_ok, j, 0)
        page = tl.load(bt_row + jj // block_size, mask=j_ok, other=0).to(tl.int64)
        rows = c_ptr + page * scb + (jj % block_size).to(tl.int64) * sct
        s, c = latent_scores(rows, j_ok, r, r_ok, pe, pe_ok, kv_rank, q_lat, q_pe, scale_log2, KV_FP8, DOT_PREC)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a tile with no valid key leaves the state unchanged (m stays -inf until one is seen)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=DOT_PREC)
        m_i = m_new

    latent_store(acc, m_i, l_i, kvs_ptr, out_ptr, part_o_ptr, part_ml_ptr, t64, sot, soh, heads, h_ok, r, r_ok, sp,
                 n_heads, NUM_SPLITS, BLOCK_R, KV_FP8)


def sparse_config(num_tokens: int, num_heads: int, kv_lora_rank: int, rope_dim: int, num_sms: int,
                  dtype: torch.dtype = torch.bfloat16) -> dict:
    """Launch configuration of sparse MLA (also used by the compile test): MLA's mixed-batch tiles."""
    return mla_config(num_tokens, num_heads, kv_lora_rank, rope_dim, num_sms, dtype, decode_only=False)


def _dsa_sparse_attention_triton(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    indices: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    kv_scale: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    t, h, d = q.shape
    r = kv_lora_rank
    out = q.new_empty(t, h, r)
    if t == 0:
        return out
    check_device(q)
    cache = flat_cache(kv_cache)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if indices.stride(-1) != 1:
        indices = indices.contiguous()
    kv_fp8 = check_latent_fp8("dsa_sparse_attention", q, cache, kv_scale)
    op_dtype = q.dtype if kv_fp8 else cache.dtype
    cfg = sparse_config(t, h, r, d - r, num_sms(q.device), op_dtype)
    cfg.update(config or {})
    if num_splits is not None:
        check_num_splits(num_splits)
        cfg["NUM_SPLITS"] = num_splits
    s = cfg["NUM_SPLITS"]
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    tok_seq = torch.repeat_interleave(torch.arange(context_lens.shape[0], device=q.device, dtype=torch.int32),
                                      q_lens, output_size=t)
    if s > 1:
        part_o = torch.empty(t, h, s, cfg["BLOCK_R"], dtype=torch.float32, device=q.device)
        part_ml = torch.empty(t, h, s, 2, dtype=torch.float32, device=q.device)
    else:
        part_o = part_ml = out
    _dsa_sparse_split_kernel[(triton.cdiv(h, cfg["BLOCK_H"]), t, s)](
        q, cache, block_tables, tok_seq, indices, kv_scale if kv_fp8 else q, out, part_o, part_ml,
        scale * LOG2E, h, r, d - r, indices.shape[1], cache.shape[1],
        q.stride(0), q.stride(1), cache.stride(0), cache.stride(1), block_tables.stride(0), indices.stride(0),
        out.stride(0), out.stride(1),
        DOT_PREC=dot_precision(op_dtype), KV_FP8=kv_fp8, **cfg,
    )
    if s > 1:
        decode_reduce_kernel[(t, h)](
            part_o, part_ml, q, out, h, r, out.stride(0), out.stride(1),
            NUM_SPLITS=s, BLOCK_DV=cfg["BLOCK_R"], HAS_SINKS=False, num_warps=4,
        )
    return out


def _latent_out_fake(q: torch.Tensor, *args) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1], args[6])  # kv_lora_rank


dsa_sparse_attention = kernel_op(
    "dsa_sparse_attention", _dsa_sparse_attention_triton, dsa_sparse_attention_ref, _latent_out_fake,
    doc="MLA (absorbed form) over each token's selected keys only (an fp8 cache: with its ``kv_scale``).",
)
