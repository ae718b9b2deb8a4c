"""Paged prefill attention (query chunks of a mixed batch, decodes included), Triton.

Program (query tile, kv head group): a tile of one sequence's query rows (packing the kv group's
query heads) over that sequence's keys, online softmax, causal and window masks applied only on
the tiles that need them. The contract is ``attention_ref.paged_attention_ref``'s.

FP8 cache (``KV_FP8``): as in decode, K/V tiles are widened from e4m3 to the query's dtype in
registers; k_scale is folded into the softmax scale and v_scale into the output's row factor.
"""

from __future__ import annotations

import torch

# isort: off
# _launch picks Triton's interpreter on machines without a GPU; it must run before triton loads
from tokenfab.kernels._launch import dot_precision, next_pow2
import triton
import triton.language as tl
# isort: on

from tokenfab.kernels.kv_cache import check_kv_dtypes
from tokenfab.kernels.paged import LOG2E, check_paged, load_q_tile, qk_scores, softcap_log2


@triton.jit
def _prefill_tiles(
    acc, m_i, l_i, q, q_rows, row_ok, pos, k_base, v_base, bt_row, n_lo, n_hi, kv_end,
    scale_log2, softcap, window, block_size: tl.constexpr, skb, skt, svb, svt, head_dim, head_dim_v,
    MASKED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    D_CHUNK: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_PREC: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """Online softmax over key tiles n_lo, n_lo + BLOCK_N, ... < n_hi.

    MASKED tiles apply the causal / window / end-of-context masks per (row, key); unmasked
    tiles are known to be fully visible to every valid row and skip them. With
    D_CHUNK == BLOCK_D the query tile ``q`` stays in registers; with a smaller D_CHUNK (fp32
    operands, whose FMA products hold whole rows per thread) q.k is summed over head-dim
    chunks, re-reading the query rows ``q_rows`` (cached) instead.
    """
    dv = tl.arange(0, BLOCK_DV)
    for n0 in range(n_lo, n_hi, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)
        if MASKED:
            j_ok = j < kv_end
            page = tl.load(bt_row + j // block_size, mask=j_ok, other=0).to(tl.int64)
        else:
            page = tl.load(bt_row + j // block_size).to(tl.int64)
        off = (j % block_size).to(tl.int64)
        k_rows = k_base + page * skb + off * skt
        if MASKED:
            k_ok = j_ok
        else:
            k_ok = j >= 0
        s = qk_scores(q, q_rows, row_ok, k_rows, k_ok, head_dim, BLOCK_M, BLOCK_N, BLOCK_D, D_CHUNK, KV_FP8, DOT_PREC)
        s = softcap_log2(s, softcap, scale_log2, HAS_SOFTCAP)
        if MASKED:
            vis = (j[None, :] <= pos[:, None]) & (j[None, :] < kv_end)
            if HAS_WINDOW:
                vis = vis & (j[None, :] > pos[:, None] - window)
            s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_ref = m_new
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:
            v = tl.load(
                v_base + (page * svb + off * svt)[:, None] + dv[None, :],
                mask=j_ok[:, None] & (dv < head_dim_v)[None, :], other=0.0,
            )
        else:
            v = tl.load(v_base + (page * svb + off * svt)[:, None] + dv[None, :],
                        mask=(dv < head_dim_v)[None, :], other=0.0)
        if KV_FP8:
            v = v.to(q_rows.dtype.element_ty)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _prefill_kernel(
    q_ptr, kc_ptr, vc_ptr, bt_ptr, cu_ptr, ctx_ptr, sink_ptr, ks_ptr, vs_ptr, out_ptr,
    num_seqs, scale_log2, softcap, window, group, head_dim, head_dim_v, block_size: tl.constexpr,
    sqt, sqh, skb, skt, skh, svb, svt, svh, sbt, sot, soh,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEADS_PER_TILE: tl.constexpr,
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
    """Program (query tile, kv head x head chunk) of varlen causal attention over the paged cache.

    A tile packs BLOCK_Q consecutive query tokens of one sequence times HEADS_PER_TILE query
    heads of one kv group (row r: token r // HEADS_PER_TILE, head r % HEADS_PER_TILE), so the
    group shares each K/V tile. Tiles are numbered so that sequence b's tiles start at
    cu_seqlens_q[b] // BLOCK_Q + b; a binary search over cu_seqlens_q finds the sequence, and
    the grid (T // BLOCK_Q + B) depends on the token and sequence counts only.
    """
    pid = tl.program_id(0)
    kvh_all = tl.program_id(1)
    n_chunks = tl.cdiv(group, HEADS_PER_TILE)
    kvh = kvh_all // n_chunks
    chunk = kvh_all % n_chunks

    lo_s = 0
    hi_s = num_seqs - 1
    while lo_s < hi_s:
        mid = (lo_s + hi_s + 1) // 2
        first = tl.load(cu_ptr + mid) // BLOCK_Q + mid
        go_up = first <= pid
        lo_s = tl.where(go_up, mid, lo_s)
        hi_s = tl.where(go_up, hi_s, mid - 1)
    b = lo_s
    q_start = tl.load(cu_ptr + b)
    q_len = tl.load(cu_ptr + b + 1) - q_start
    q0 = (pid - (q_start // BLOCK_Q + b)) * BLOCK_Q
    if q0 < q_len:
        ctx = tl.load(ctx_ptr + b)
        if KV_FP8:
            scale_log2 = scale_log2 * tl.load(ks_ptr)
        r = tl.arange(0, BLOCK_M)
        tok = q0 + r // HEADS_PER_TILE
        gi = chunk * HEADS_PER_TILE + r % HEADS_PER_TILE
        row_ok = (r < BLOCK_Q * HEADS_PER_TILE) & (tok < q_len) & (gi < group)
        head = kvh * group + gi
        pos = ctx - q_len + tok
        dv = tl.arange(0, BLOCK_DV)
        t64 = (q_start + tok).to(tl.int64)
        q_rows = q_ptr + t64 * sqt + head.to(tl.int64) * sqh
        q = load_q_tile(q_rows, row_ok, head_dim, BLOCK_D, D_CHUNK)
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        if HAS_SINKS:
            m_i = tl.load(sink_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
            l_i += 1.0
        acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)

        p_first = ctx - q_len + q0  # position of the tile's first token
        p_last = ctx - q_len + tl.minimum(q0 + BLOCK_Q, q_len) - 1
        kv_end = p_last + 1
        kv_lo = 0
        full_lo = 0
        if HAS_WINDOW:
            kv_lo = tl.maximum(p_first - window + 1, 0)
            full_lo = tl.maximum(p_last - window + 1, 0)
        t_lo = (kv_lo // BLOCK_N) * BLOCK_N
        t_full_lo = tl.cdiv(full_lo, BLOCK_N) * BLOCK_N
        t_full_hi = ((p_first + 1) // BLOCK_N) * BLOCK_N
        t_full_hi = tl.maximum(t_full_hi, t_full_lo)

        k_base = kc_ptr + kvh.to(tl.int64) * skh
        v_base = vc_ptr + kvh.to(tl.int64) * svh
        bt_row = bt_ptr + b.to(tl.int64) * sbt
        acc, m_i, l_i = _prefill_tiles(
            acc, m_i, l_i, q, q_rows, row_ok, pos, k_base, v_base, bt_row, t_lo, tl.minimum(t_full_lo, kv_end), kv_end,
            scale_log2, softcap, window, block_size, skb, skt, svb, svt, head_dim, head_dim_v,
            True, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, D_CHUNK, HAS_SOFTCAP, HAS_WINDOW, DOT_PREC,
            KV_FP8,
        )
        acc, m_i, l_i = _prefill_tiles(
            acc, m_i, l_i, q, q_rows, row_ok, pos, k_base, v_base, bt_row, t_full_lo, t_full_hi, kv_end,
            scale_log2, softcap, window, block_size, skb, skt, svb, svt, head_dim, head_dim_v,
            False, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, D_CHUNK, HAS_SOFTCAP, HAS_WINDOW, DOT_PREC,
            KV_FP8,
        )
        acc, m_i, l_i = _prefill_tiles(
            acc, m_i, l_i, q, q_rows, row_ok, pos, k_base, v_base, bt_row, t_full_hi, kv_end, kv_end,
            scale_log2, softcap, window, block_size, skb, skt, svb, svt, head_dim, head_dim_v,
            True, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, D_CHUNK, HAS_SOFTCAP, HAS_WINDOW, DOT_PREC,
            KV_FP8,
        )
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        if KV_FP8:
            o = acc * (tl.load(vs_ptr) / l_safe)[:, None]
        else:
            o = acc / l_safe[:, None]
        tl.store(
            out_ptr + t64[:, None] * sot + head.to(tl.int64)[:, None] * soh + dv[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & (dv < head_dim_v)[None, :],
        )


PREFILL_TILES = {
    # (fp32 operands, head dim > 128) -> (BLOCK_M, BLOCK_N, D_CHUNK or 0 for all, warps, stages)
    (False, False): (128, 64, 0, 8, 2),
    (False, True): (64, 32, 0, 8, 2),
    (True, False): (64, 32, 32, 8, 2),
    (True, True): (64, 32, 32, 8, 2),
}


def prefill_config(n_q_heads: int, n_kv_heads: int, head_dim: int, head_dim_v: int,
                   dtype: torch.dtype = torch.bfloat16) -> dict:
    """Launch configuration of prefill attention (also used by the compile test).

    16-bit operands get 128-row query tiles (64 for head dims above 128), so that Hopper runs
    the products on warp-group MMA (HGMMA); fp32 operands (exact "ieee" products, used by the
    fp32 test and CPU paths) get smaller tiles that fit the registers. A tile's rows pack the
    kv group's query heads (up to BLOCK_M / 16 of them) so the group shares each K/V tile.
    """
    group = n_q_heads // n_kv_heads
    block_d = max(16, next_pow2(head_dim))
    block_dv = max(16, next_pow2(head_dim_v))
    block_m, block_n, d_chunk, warps, stages = PREFILL_TILES[dtype == torch.float32,
                                                             max(block_d, block_dv) > 128]
    heads = min(group, block_m // 16)
    return dict(
        BLOCK_M=block_m,
        BLOCK_Q=block_m // heads,
        HEADS_PER_TILE=heads,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        BLOCK_DV=block_dv,
        D_CHUNK=min(d_chunk or block_d, block_d),
        num_warps=warps,
        num_stages=stages,
    )


def _prefill_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    max_query_len: int,
    max_context_len: int,
    scale: float,
    sliding_window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    config: dict | None = None,
) -> torch.Tensor:
    """q [T, Hq, D] -> [T, Hq, Dv]; the sizes ``max_*_len`` are not needed (read on the device).

    An fp8 cache needs ``k_scale``/``v_scale``; the kernel then computes in ``q``'s dtype.

    ``config`` overrides entries of ``prefill_config`` (the kernel benchmark's sweep).
    """
    t, hq, d = q.shape
    nseq = context_lens.shape[0]
    dv = v_cache.shape[-1]
    out = q.new_empty(t, hq, dv)
    if t == 0 or nseq == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    check_paged(q, k_cache, v_cache)
    kv_fp8 = check_kv_dtypes("paged_attention", q, k_cache, v_cache, k_scale, v_scale)
    op_dtype = q.dtype if kv_fp8 else k_cache.dtype
    hkv = k_cache.shape[2]
    cfg = prefill_config(hq, hkv, d, dv, op_dtype)
    if config:
        cfg.update(config)
        if "BLOCK_M" in config and "BLOCK_Q" not in config:
            cfg["HEADS_PER_TILE"] = min(hq // hkv, cfg["BLOCK_M"] // 16)
            cfg["BLOCK_Q"] = cfg["BLOCK_M"] // cfg["HEADS_PER_TILE"]
    group = hq // hkv
    grid = (t // cfg["BLOCK_Q"] + nseq, hkv * triton.cdiv(group, cfg["HEADS_PER_TILE"]))
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens,
        sinks if sinks is not None else q, k_scale if kv_fp8 else q, v_scale if kv_fp8 else q, out,
        nseq, scale * LOG2E, float(softcap), int(sliding_window), group, d, dv, k_cache.shape[1],
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1),
        HAS_SOFTCAP=softcap > 0.0, HAS_SINKS=sinks is not None, HAS_WINDOW=sliding_window > 0,
        DOT_PREC=dot_precision(op_dtype), KV_FP8=kv_fp8, **cfg,
    )
    return out
