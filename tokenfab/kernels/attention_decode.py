"""Paged decode attention (one query per sequence), Triton: split-KV ("flash decoding").

Program (sequence, kv head, split): the kv group's query heads (a 16-row tile) over one share of
the sequence's keys, online softmax; a second kernel (``paged.decode_reduce_kernel``) merges the
splits. The contract is ``attention_ref.paged_decode_attention_ref``'s.

FP8 cache (``KV_FP8``): K/V tiles are loaded as e4m3 and widened to the query's dtype in registers
(exact: e4m3 values are bf16/fp16 values), so the products run on the same 16-bit MMA; k_scale is
folded into the softmax scale and v_scale into the output (one factor per row), read on the device.
"""

from __future__ import annotations

import torch

# isort: off
# _launch picks Triton's interpreter on machines without a GPU; it must run before triton loads
from tokenfab.kernels._launch import dot_precision, next_pow2, num_sms
import triton
import triton.language as tl
# isort: on

from tokenfab.kernels.batch_invariant import batch_invariant
from tokenfab.kernels.kv_cache import check_kv_dtypes
from tokenfab.kernels.paged import (
    LOG2E,
    MAX_DECODE_SPLITS,
    check_num_splits,
    check_paged,
    decode_reduce_kernel,
    load_q_tile,
    qk_scores,
    softcap_log2,
)


@triton.jit
def _decode_split_kernel(
    q_ptr, kc_ptr, vc_ptr, bt_ptr, ctx_ptr, sink_ptr, ks_ptr, vs_ptr,
    out_ptr, part_o_ptr, part_ml_ptr,
    scale_log2, softcap, window, group, head_dim, head_dim_v, block_size: tl.constexpr,
    sqb, sqh, skb, skt, skh, svb, svt, svh, sbt, sob, soh,
    NUM_SPLITS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    D_CHUNK: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_PREC: tl.constexpr,
    KV_FP8: tl.constexpr = False,
):
    """Program (sequence, kv head, split): the group's query heads against one share of the keys.

    The share is read from context_lens on the device, so the grid depends only on the batch
    size, the kv heads and NUM_SPLITS (CUDA-graph safe). With NUM_SPLITS == 1 the program
    finishes the softmax itself; otherwise it writes (acc, max, sum) for the reduce kernel.
    D_CHUNK < BLOCK_D (fp32 operands): q.k is summed over head-dim chunks, as in prefill.
    """
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    b64 = b.to(tl.int64)
    ctx = tl.load(ctx_ptr + b)
    if KV_FP8:
        scale_log2 = scale_log2 * tl.load(ks_ptr)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(ctx - window, 0)
    per = tl.cdiv(tl.cdiv(ctx - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = lo + sp * per
    end = tl.minimum(start + per, ctx)

    g = tl.arange(0, BLOCK_G)
    heads = kvh * group + g
    g_ok = g < group
    dv = tl.arange(0, BLOCK_DV)
    q_rows = q_ptr + b64 * sqb + heads.to(tl.int64) * sqh
    q = load_q_tile(q_rows, g_ok, head_dim, BLOCK_D, D_CHUNK)
    m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_G,), tl.float32)
    if HAS_SINKS and NUM_SPLITS == 1:
        m_i = tl.load(sink_ptr + heads, mask=g_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        l_i += 1.0
    acc = tl.zeros((BLOCK_G, BLOCK_DV), tl.float32)
    k_base = kc_ptr + kvh.to(tl.int64) * skh
    v_base = vc_ptr + kvh.to(tl.int64) * svh
    bt_row = bt_ptr + b64 * sbt
    for n0 in range(start, end, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)
        j_ok = j < end
        page = tl.load(bt_row + j // block_size, mask=j_ok, other=0).to(tl.int64)
        off = (j % block_size).to(tl.int64)
        k_rows = k_base + page * skb + off * skt
        s = qk_scores(q, q_rows, g_ok, k_rows, j_ok, head_dim, BLOCK_G, BLOCK_N, BLOCK_D, D_CHUNK, KV_FP8, DOT_PREC)
        s = softcap_log2(s, softcap, scale_log2, HAS_SOFTCAP)
        s = tl.where(j_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_base + (page * svb + off * svt)[:, None] + dv[None, :],
            mask=j_ok[:, None] & (dv < head_dim_v)[None, :], other=0.0,
        )
        if KV_FP8:
            v = v.to(q_ptr.dtype.element_ty)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new

    if NUM_SPLITS == 1:
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        if KV_FP8:
            o = acc * (tl.load(vs_ptr) / l_safe)[:, None]
        else:
            o = acc / l_safe[:, None]
        tl.store(
            out_ptr + b64 * sob + heads.to(tl.int64)[:, None] * soh + dv[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=g_ok[:, None] & (dv < head_dim_v)[None, :],
        )
    else:
        # partials: o [B, Hq, S, Dv] and (max, sum) [B, Hq, S, 2], contiguous
        n_q_heads = tl.num_programs(1) * group
        row = (b64 * n_q_heads + heads.to(tl.int64)) * NUM_SPLITS + sp
        if KV_FP8:
            acc = acc * tl.load(vs_ptr)  # the reduce merges the partials linearly
        tl.store(part_o_ptr + row[:, None] * BLOCK_DV + dv[None, :], acc, mask=g_ok[:, None])
        tl.store(part_ml_ptr + row * 2, m_i, mask=g_ok)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=g_ok)




def decode_config(batch: int, n_q_heads: int, n_kv_heads: int, head_dim: int, head_dim_v: int,
                  num_sms: int, dtype: torch.dtype = torch.bfloat16, invariant: bool | None = None) -> dict:
    """Launch configuration of paged decode attention (also used by the compile test).

    The number of splits depends only on the batch size, the kv heads and the device, never
    on the context lengths, so one CUDA graph per batch size serves every step.

    ``invariant`` (None: ``kernels.batch_invariant``'s current mode): the split count is the one
    a lone sequence gets, whatever the batch size, so a row's splits (its keys cut into
    ``NUM_SPLITS`` shares by its own context length) and their merge are the same in any batch;
    the verify rows of a speculative step, run as decode rows, then equal the decode step's rows.
    Bigger batches pay more partial-softmax traffic for it (kernels/README.md).
    """
    if invariant if invariant is not None else batch_invariant():
        batch = 1
    group = n_q_heads // n_kv_heads
    block_d = max(16, next_pow2(head_dim))
    block_dv = max(16, next_pow2(head_dim_v))
    splits = 1
    while batch * n_kv_heads * splits < 4 * num_sms and splits < MAX_DECODE_SPLITS:
        splits *= 2
    return dict(
        NUM_SPLITS=splits,
        BLOCK_G=max(16, next_pow2(group)),
        BLOCK_N=64 if max(block_d, block_dv) <= 128 else 32,
        BLOCK_D=block_d,
        BLOCK_DV=block_dv,
        D_CHUNK=min(32, block_d) if dtype == torch.float32 else block_d,
        num_warps=4,
        num_stages=2,
    )



def _paged_decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    max_context_len: int,
    scale: float,
    sliding_window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """q [B, Hq, D] -> [B, Hq, Dv]; ``max_context_len`` is not needed (read on the device).

    An fp8 cache (``torch.float8_e4m3fn``) needs ``k_scale``/``v_scale`` (float32 [1]); the kernel
    then computes in ``q``'s dtype (configuration and product precision follow q).

    ``num_splits`` (a power of two) overrides the configured split count (tests use it to
    exercise the split/reduce paths cheaply in the interpreter); ``config`` overrides entries
    of ``decode_config`` (the kernel benchmark's sweep).
    """
    b, hq, d = q.shape
    dv = v_cache.shape[-1]
    out = q.new_empty(b, hq, dv)
    if b == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    check_paged(q, k_cache, v_cache)
    kv_fp8 = check_kv_dtypes("paged_attention", q, k_cache, v_cache, k_scale, v_scale)
    op_dtype = q.dtype if kv_fp8 else k_cache.dtype
    hkv = k_cache.shape[2]
    cfg = decode_config(b, hq, hkv, d, dv, num_sms(q.device), op_dtype)
    cfg.update(config or {})
    if num_splits is not None:
        check_num_splits(num_splits)
        cfg["NUM_SPLITS"] = num_splits
    s = cfg["NUM_SPLITS"]
    if s > 1:
        part_o = torch.empty(b, hq, s, cfg["BLOCK_DV"], dtype=torch.float32, device=q.device)
        part_ml = torch.empty(b, hq, s, 2, dtype=torch.float32, device=q.device)
    else:
        part_o = part_ml = out
    sink_arg = sinks if sinks is not None else q
    _decode_split_kernel[(b, hkv, s)](
        q, k_cache, v_cache, block_tables, context_lens, sink_arg,
        k_scale if kv_fp8 else q, v_scale if kv_fp8 else q, out, part_o, part_ml,
        scale * LOG2E, float(softcap), int(sliding_window), hq // hkv, d, dv, k_cache.shape[1],
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1),
        HAS_SOFTCAP=softcap > 0.0, HAS_SINKS=sinks is not None, HAS_WINDOW=sliding_window > 0,
        DOT_PREC=dot_precision(op_dtype), KV_FP8=kv_fp8, **cfg,
    )
    if s > 1:
        decode_reduce_kernel[(b, hq)](
            part_o, part_ml, sink_arg, out, hq, dv, out.stride(0), out.stride(1),
            NUM_SPLITS=s, BLOCK_DV=cfg["BLOCK_DV"], HAS_SINKS=sinks is not None, num_warps=4,
        )
    return out

