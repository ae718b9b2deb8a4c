"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over a paged latent cache, absorbed form.

The cache holds, per token, one "head" of ``kv_lora_rank + rope_dim`` values: the normalized
latent ``c`` (rank r) followed by the rotated rope key ``k_pe``. Keys and values of every head are
low-rank images of the latent, ``k_h = [W_UK[h] c ; k_pe]`` and ``v_h = W_UV[h] c``, so with the
query projected into the latent space (``q_lat_h = W_UK[h]^T q_nope_h``, done by the layer)

    logits[h, j] = scale * (q_lat_h . c_j + q_pe_h . k_pe_j)
    o_lat[h]     = sum_j softmax(logits[h])_j c_j                     [r]

and the layer maps ``o_lat`` through ``W_UV`` to the head's output. This file computes the middle
step: multi-query attention whose one key is the cache row (``r + rope_dim`` values) and whose
value is its first ``r`` values (a row may carry more after them, e.g. DSA's index key; they are
not read). The queries ``q`` are ``[T, H, r + rope_dim]``: ``q_lat`` then ``q_pe``. The batch
is the engine's flat mixed batch (``ForwardBatch``): sequence ``b`` owns query tokens
``cu_seqlens_q[b]:cu_seqlens_q[b+1]``, has ``context_lens[b]`` keys after this step, and its i-th
query token sits at position ``context_lens[b] - q_len[b] + i`` (causal). The absorbed form is
exact for prefill tokens too; it reads the whole prefix once per query token.

Triton: one program per (head block, query token, KV split) runs an online softmax over its share
of the token's keys, reading each latent page once for both products (q.c and p.c); with several
splits a reduce kernel merges the partial softmaxes. Accumulation is fp32.

FP8 latent cache (``float8_e4m3fn``): the whole row (latent, rope key and whatever follows) is stored
as ``clamp(x / scale, +-448)`` with one float32 scale per layer (``store_latent(..., scale=)``, the
rule of ``kernels/kv_cache.py``); ``mla_attention(..., kv_scale=)`` widens the tiles to q's dtype in
registers and folds the scale into the softmax scale (keys) and the output row factor (values).

The reference, ``mla_attention_ref``, is ``mla_ref.py``'s.
"""

from __future__ import annotations

import torch

# isort: off
# _launch picks Triton's interpreter on machines without a GPU; it must run before triton loads
from tokenfab.kernels._launch import check_device, dot_precision, next_pow2, num_sms
import triton
import triton.language as tl
# isort: on

from tokenfab.kernels._dispatch import kernel_op
from tokenfab.kernels.batch_invariant import batch_invariant
from tokenfab.kernels.kv_cache import (
    _store_kv_triton,
    check_fp8_scales,
    check_latent_fp8,
    is_fp8,
    quantize_fp8_ref,
    raw_cache,
)
from tokenfab.kernels.mla_ref import mla_attention_ref
from tokenfab.kernels.paged import (
    LOG2E,
    MAX_DECODE_SPLITS,
    check_num_splits,
    decode_reduce_kernel,
    flat_cache,
)

#: The split count of every MLA call in batch-invariant mode is at most this (``mla_config``).
INVARIANT_MAX_SPLITS = 8

@triton.jit
def latent_query(q_ptr, t64, sqt, sqh, hb, n_heads, kv_rank, rope_dim, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
                 BLOCK_P: tl.constexpr):
    """Head block ``hb`` of query token t: (heads, their mask, latent columns r and mask, rope columns pe
    and mask, the latent queries [BLOCK_H, BLOCK_R], the rope queries [BLOCK_H, BLOCK_P])."""
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < n_heads
    r = tl.arange(0, BLOCK_R)
    pe = tl.arange(0, BLOCK_P)
    r_ok = r < kv_rank
    pe_ok = pe < rope_dim
    q_rows = q_ptr + t64 * sqt + heads.to(tl.int64) * sqh
    q_lat = tl.load(q_rows[:, None] + r[None, :], mask=h_ok[:, None] & r_ok[None, :], other=0.0)
    q_pe = tl.load(q_rows[:, None] + kv_rank + pe[None, :], mask=h_ok[:, None] & pe_ok[None, :], other=0.0)
    return heads, h_ok, r, r_ok, pe, pe_ok, q_lat, q_pe


@triton.jit
def latent_scores(rows, j_ok, r, r_ok, pe, pe_ok, kv_rank, q_lat, q_pe, scale_log2, KV_FP8: tl.constexpr,
                  DOT_PREC: tl.constexpr):
    """(scores [BLOCK_H, BLOCK_N] in log2 units, -inf at keys not ``j_ok``; the latent tile c) of the
    cache rows ``rows``: q_lat . c + q_pe . k_pe. An fp8 cache is widened to q's dtype in registers."""
    c = tl.load(rows[:, None] + r[None, :], mask=j_ok[:, None] & r_ok[None, :], other=0.0)
    kp = tl.load(rows[:, None] + kv_rank + pe[None, :], mask=j_ok[:, None] & pe_ok[None, :], other=0.0)
    if KV_FP8:
        c = c.to(q_lat.dtype)
        kp = kp.to(q_lat.dtype)
    s = tl.dot(q_lat, tl.trans(c), input_precision=DOT_PREC)
    s += tl.dot(q_pe, tl.trans(kp), input_precision=DOT_PREC)
    return tl.where(j_ok[None, :], s * scale_log2, float("-inf")), c


@triton.jit
def latent_store(acc, m_i, l_i, kvs_ptr, out_ptr, part_o_ptr, part_ml_ptr, t64, sot, soh, heads, h_ok, r, r_ok, sp,
                 n_heads, NUM_SPLITS: tl.constexpr, BLOCK_R: tl.constexpr, KV_FP8: tl.constexpr):
    """One split's online-softmax state out: with one split the normalized rows (times an fp8 cache's
    scale) into ``out``; else the partials in the layout of the decode reduce kernel: o [T, H, S, BLOCK_R],
    (max, sum) [T, H, S, 2]."""
    if NUM_SPLITS == 1:
        if KV_FP8:
            o = acc * (tl.load(kvs_ptr) / tl.where(l_i > 0.0, l_i, 1.0))[:, None]
        else:
            o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + t64 * sot + heads.to(tl.int64)[:, None] * soh + r[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=h_ok[:, None] & r_ok[None, :],
        )
    else:
        row = (t64 * n_heads + heads.to(tl.int64)) * NUM_SPLITS + sp
        if KV_FP8:
            acc = acc * tl.load(kvs_ptr)  # the reduce merges the partials linearly
        tl.store(part_o_ptr + row[:, None] * BLOCK_R + r[None, :], acc, mask=h_ok[:, None])
        tl.store(part_ml_ptr + row * 2, m_i, mask=h_ok)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=h_ok)


@triton.jit
def _mla_split_kernel(
    q_ptr, c_ptr, bt_ptr, tok_seq_ptr, cu_ptr, ctx_ptr, kvs_ptr,
    out_ptr, part_o_ptr, part_ml_ptr,
    scale_log2, n_heads, kv_rank, rope_dim, block_size: tl.constexpr,
    sqt, sqh, scb, sct, sbt, sot, soh,
    NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    DECODE_ONLY: tl.constexpr,
    DOT_PREC: tl.constexpr,
    KV_FP8: tl.constexpr = False,
):
    """Program (head block, query token, split): BLOCK_H heads against one share of the token's keys.

    The token's sequence, query offset and key count are read on the device (DECODE_ONLY: token
    t is sequence t's only query), so the grid depends only on T, H and NUM_SPLITS (CUDA-graph
    safe). Each latent tile [BLOCK_N, r] is loaded once and used for both q.c and p.c.
    """
    hb = tl.program_id(0)
    t = tl.program_id(1)
    sp = tl.program_id(2)
    t64 = t.to(tl.int64)
    if DECODE_ONLY:
        b = t
        kv_end = tl.load(ctx_ptr + b)
    else:
        b = tl.load(tok_seq_ptr + t)
        q_start = tl.load(cu_ptr + b)
        q_len = tl.load(cu_ptr + b + 1) - q_start
        kv_end = tl.load(ctx_ptr + b) - q_len + (t - q_start) + 1
    if KV_FP8:
        scale_log2 = scale_log2 * tl.load(kvs_ptr)
    per = tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = sp * per
    end = tl.minimum(start + per, kv_end)

    heads, h_ok, r, r_ok, pe, pe_ok, q_lat, q_pe = latent_query(q_ptr, t64, sqt, sqh, hb, n_heads, kv_rank,
                                                               rope_dim, BLOCK_H, BLOCK_R, BLOCK_P)

    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_R), tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * sbt
    for n0 in range(start, end, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)
        j_ok = j < end
        page = tl.load(bt_row + j // block_size, mask=j_ok, other=0).to(tl.int64)
        rows = c_ptr + page * scb + (j % block_size).to(tl.int64) * sct
        s, c = latent_scores(rows, j_ok, r, r_ok, pe, pe_ok, kv_rank, q_lat, q_pe, scale_log2, KV_FP8, DOT_PREC)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=DOT_PREC)
        m_i = m_new

    latent_store(acc, m_i, l_i, kvs_ptr, out_ptr, part_o_ptr, part_ml_ptr, t64, sot, soh, heads, h_ok, r, r_ok, sp,
                 n_heads, NUM_SPLITS, BLOCK_R, KV_FP8)


def mla_config(num_tokens: int, num_heads: int, kv_lora_rank: int, rope_dim: int, num_sms: int,
               dtype: torch.dtype = torch.bfloat16, decode_only: bool = True, kv_fp8: bool = False,
               invariant: bool | None = None) -> dict:
    """Launch configuration of MLA attention (also used by the compile test).

    BLOCK_H heads share each latent tile; programs of the same token and split are adjacent in
    the grid (head block is axis 0), so the H / BLOCK_H programs reading the same pages run
    together and the re-reads hit L2. At DeepSeek-V3 sizes (128 heads, r = 512) decode is nearly
    compute-bound (about 2.2 kFLOP per key and head against 1.15 kB per key), so 16-bit decode
    with 64+ heads takes 64-head tiles, which Hopper runs on warp-group MMA (HGMMA) and which
    halve the L2 re-reads to two per page; that config uses ~254 registers per thread (no spills
    at sm_90, checked by the compile test). Mixed batches (the per-token prefill path, a few more
    live registers) take 32-head tiles; small head counts 16. The split count depends only on T,
    H and the device (never on context lengths), so one CUDA graph per batch size serves every step.
    ``dtype`` is the products' dtype (q's). An fp8 cache (``kv_fp8``) takes 32-head decode tiles: widening
    the latent tile to bf16 in registers on its way to shared memory spilled the 64-head tile at sm_90 at
    every stage count (264-272 bytes), the 32-head one fits (253 registers); its L2 re-reads of a page
    (four) move the same bytes as bf16's two, the rows being half as wide.

    ``invariant`` (None: ``kernels.batch_invariant``'s current mode): a lone token's split count and
    the mixed-batch tiles for every call, so a token's splits, tile shapes and merge, hence its bits,
    are the same in a decode step and as a verify row of a mixed step (MTP / speculative verify);
    16-bit decode with 64+ heads then gives up its 64-head tiles. The count is capped at
    ``INVARIANT_MAX_SPLITS``: every head's partial row is as wide as the latent (r fp32 values per
    split against one 576-value latent row read per key shared by all heads), so DeepSeek-V3's 32
    lone-token splits would move ~7x the cache's bytes in partials at 64 sequences x 2,048 keys.
    """
    invariant = invariant if invariant is not None else batch_invariant()
    if invariant:
        num_tokens, decode_only = 1, False
    fp32 = dtype == torch.float32
    if fp32:
        block_h, block_n, warps = 16, 16, 4
    elif num_heads >= 64 and kv_lora_rank > 128:
        block_h, block_n, warps = ((32 if kv_fp8 else 64), 16, 8) if decode_only else (32, 32, 8)
    else:
        block_h, block_n, warps = 16, 32, 4 if kv_lora_rank <= 128 else 8
    head_blocks = triton.cdiv(num_heads, block_h)
    splits = 1
    while num_tokens * head_blocks * splits < 4 * num_sms and splits < MAX_DECODE_SPLITS:
        splits *= 2
    if invariant:
        splits = min(splits, INVARIANT_MAX_SPLITS)
    return dict(
        NUM_SPLITS=splits,
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        BLOCK_R=max(16, next_pow2(kv_lora_rank)),
        BLOCK_P=max(16, next_pow2(rope_dim)),
        num_warps=warps,
        num_stages=2,
    )


def _mla_attention_triton(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    max_query_len: int,
    max_context_len: int,
    scale: float,
    kv_lora_rank: int,
    kv_scale: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """q [T, H, r + rope] -> [T, H, r]; ``max_context_len`` is not needed (read on the device).
    An fp8 cache needs ``kv_scale`` (float32 [1]); the kernel then computes in q's dtype.

    ``num_splits`` (a power of two) overrides the configured split count (tests use it to exercise
    the split/reduce path cheaply in the interpreter); ``config`` overrides ``mla_config`` entries.
    """
    t, h, d = q.shape
    r = kv_lora_rank
    nseq = context_lens.shape[0]
    out = q.new_empty(t, h, r)
    if t == 0 or nseq == 0:
        return out
    cache = flat_cache(kv_cache)
    if d <= r:
        raise ValueError(f"q has {d} features per head, not kv_lora_rank {r} + a rope part")
    if cache.shape[-1] < d:
        raise ValueError(f"cache rows have {cache.shape[-1]} values, q has {d}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    check_device(q)
    if cache.stride(-1) != 1:
        raise ValueError("mla_attention: the cache's last dim must be contiguous")
    kv_fp8 = check_latent_fp8("mla_attention", q, cache, kv_scale)
    op_dtype = q.dtype if kv_fp8 else cache.dtype
    decode_only = max_query_len == 1 and t == nseq
    cfg = mla_config(t, h, r, d - r, num_sms(q.device), op_dtype, decode_only, kv_fp8)
    cfg.update(config or {})
    if num_splits is not None:
        check_num_splits(num_splits)
        cfg["NUM_SPLITS"] = num_splits
    s = cfg["NUM_SPLITS"]
    if decode_only:
        tok_seq = context_lens
    else:
        q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
        tok_seq = torch.repeat_interleave(
            torch.arange(nseq, device=q.device, dtype=torch.int32), q_lens, output_size=t
        )
    if s > 1:
        part_o = torch.empty(t, h, s, cfg["BLOCK_R"], dtype=torch.float32, device=q.device)
        part_ml = torch.empty(t, h, s, 2, dtype=torch.float32, device=q.device)
    else:
        part_o = part_ml = out
    grid = (triton.cdiv(h, cfg["BLOCK_H"]), t, s)
    _mla_split_kernel[grid](
        q, cache, block_tables, tok_seq, cu_seqlens_q, context_lens, kv_scale if kv_fp8 else q,
        out, part_o, part_ml, scale * LOG2E, h, r, d - r, cache.shape[1],
        q.stride(0), q.stride(1), cache.stride(0), cache.stride(1), block_tables.stride(0),
        out.stride(0), out.stride(1),
        DECODE_ONLY=decode_only, DOT_PREC=dot_precision(op_dtype), KV_FP8=kv_fp8, **cfg,
    )
    if s > 1:
        decode_reduce_kernel[(t, h)](
            part_o, part_ml, q, out, h, r, out.stride(0), out.stride(1),
            NUM_SPLITS=s, BLOCK_DV=cfg["BLOCK_R"], HAS_SINKS=False, num_warps=4,
        )
    return out


def store_latent_ref(latent: torch.Tensor, rest: torch.Tensor, kv_cache: torch.Tensor,
                     slot_mapping: torch.Tensor, scale: torch.Tensor | None = None) -> None:
    """Write row ``[latent (r) ; rest (n)]`` of token t to cache slot ``slot_mapping[t]`` (-1: skipped);
    cache values past r + n (e.g. another layer kind's index key) are left alone. In place.
    An fp8 cache stores the row quantized with ``scale`` (required there, ignored otherwise)."""
    cache = flat_cache(kv_cache)
    nb, bs, width = cache.shape
    latent, rest = latent.reshape(latent.shape[0], -1), rest.reshape(rest.shape[0], -1)
    r, n = latent.shape[-1], rest.shape[-1]
    slots = slot_mapping.long()
    if bool((slots < 0).any()):
        valid = slots >= 0
        slots, latent, rest = slots[valid], latent[valid], rest[valid]
    row = torch.cat((latent, rest), dim=-1)
    if is_fp8(cache.dtype):
        check_fp8_scales("store_latent", cache, scale=scale)
        row = quantize_fp8_ref(row, scale).view(torch.uint8)
    rows = raw_cache(cache).view(nb * bs, width)
    rows[:, : r + n].index_copy_(0, slots, row.to(rows.dtype))


def _store_latent_triton(latent: torch.Tensor, rest: torch.Tensor, kv_cache: torch.Tensor,
                         slot_mapping: torch.Tensor, scale: torch.Tensor | None = None) -> None:
    t = latent.shape[0]
    latent, rest = latent.reshape(t, -1), rest.reshape(t, -1)
    r, n = latent.shape[-1], rest.shape[-1]
    cache = flat_cache(kv_cache).unsqueeze(2)  # [blocks, block_size, 1, width]
    if is_fp8(cache.dtype):
        check_fp8_scales("store_latent", cache, scale=scale)
    _store_kv_triton(latent.reshape(t, 1, r), rest.reshape(t, 1, n), cache[..., :r], cache[..., r : r + n],
                     slot_mapping, scale, scale)


store_latent = kernel_op(
    "store_latent", _store_latent_triton, store_latent_ref, lambda *_: None, mutates_args=("kv_cache",),
    doc="MLA's cache write: latent [T, r] and rope key (+ more) [T, n] (or [T, 1, n]) into one row per token\n"
    "(an fp8 cache: quantized with ``scale``).",
)


def _mla_fake(q: torch.Tensor, *args) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1], args[7])  # kv_lora_rank


mla_attention = kernel_op(
    "mla_attention", _mla_attention_triton, mla_attention_ref, _mla_fake,
    doc="The MLA layer's one attention call per step (mixed prefill/decode batch), absorbed form.",
)
