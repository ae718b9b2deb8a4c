"""Attention over the paged KV cache, for a flat batch mixing prefill chunks and decodes.

Every op reads keys/values from the paged cache ``[num_blocks, block_size, Hkv, D]``;
the step's new keys/values were written there first (``store_kv``). Sequence ``b`` owns
the query tokens ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` and has ``context_lens[b]`` keys
in total (cached + new), so its i-th query sits at absolute position
``context_lens[b] - q_len[b] + i`` and attends causally to keys ``0..that position``.

Options shared by all variants:
- ``sliding_window`` > 0: a query at position p sees keys p - window + 1 .. p only.
- ``softcap`` > 0: logits become softcap * tanh(logits / softcap) before masking.
- ``sinks`` [Hq]: one extra learned logit per head that joins the softmax denominator
  but has no value (GPT-OSS).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# isort: off
# _launch picks Triton's interpreter on machines without a GPU; it must run before triton loads
from tokenfab.kernels._launch import check_device, dot_precision, next_pow2, num_sms
import triton
import triton.language as tl
# isort: on

from tokenfab.kernels._dispatch import use_triton
from tokenfab.kernels.cpu import attention as native_attention


def _gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, max_context_len: int) -> torch.Tensor:
    """[B, max_context_len, Hkv, D] gathered from the pages of each sequence."""
    bs = cache.shape[1]
    nblk = (max_context_len + bs - 1) // bs
    b = block_tables.shape[0]
    # index_select on the flat block index is several times faster on CPU than advanced indexing
    pages = cache.index_select(0, block_tables[:, :nblk].reshape(-1).long())  # [B * nblk, bs, Hkv, D]
    return pages.view(b, nblk * bs, *cache.shape[2:])[:, :max_context_len]


def paged_attention_ref(
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
) -> torch.Tensor:
    """q: [T, Hq, D] -> out [T, Hq, D]. Batched over all sequences, no loop.

    The pages are gathered into one padded [B, L, Hkv, D] block; queries are scattered
    into [B, max_query_len, Hq, D]; one masked attention runs over the whole batch. In a
    mixed step the decodes (one query each) run as their own batch, so that they are not
    padded to the length of the step's longest prefill chunk.
    """
    t, hq, d = q.shape
    b = context_lens.shape[0]
    dv = v_cache.shape[-1]
    if t == 0 or b == 0:
        return q.new_empty(t, hq, dv)
    hkv = k_cache.shape[2]
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    ctx = context_lens.long()
    dev = q.device
    plain = softcap <= 0.0 and sinks is None and sliding_window <= 0 and q.dtype == k_cache.dtype
    if max_query_len > 1:
        # decodes, fresh prompts (nothing cached: the is_causal path) and the rest each run as
        # their own batch, so that none is padded to another's longest row
        groups = [q_lens == 1]
        if plain:
            fresh = (q_lens == ctx) & (q_lens > 1)
            groups += [fresh, ~groups[0] & ~fresh]
        else:
            groups.append(~groups[0])
        present = [g for g in groups if bool(g.any())]
        if len(present) > 1:
            return _split_rows(paged_attention_ref, q, k_cache, v_cache, block_tables, cu_seqlens_q,
                               context_lens, q_lens, present, scale, sliding_window, softcap, sinks)
        if plain and bool(groups[1].any()):
            return _fresh_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, q_lens, scale)
    k = _gather_kv(k_cache, block_tables, max_context_len)
    v = _gather_kv(v_cache, block_tables, max_context_len)
    if max_query_len == 1:
        q_pad = q.view(b, 1, hq, d)
        seq_idx = tok_idx = None
    else:
        seq_idx = torch.repeat_interleave(torch.arange(b, device=dev), q_lens, output_size=t)
        tok_idx = torch.arange(t, device=dev) - cu_seqlens_q[:-1].long()[seq_idx]
        q_pad = q.new_zeros(b, max_query_len, hq, d)
        q_pad[seq_idx, tok_idx] = q
    i = torch.arange(max_query_len, device=dev)
    j = torch.arange(max_context_len, device=dev)
    qpos = (ctx - q_lens)[:, None] + i[None, :]  # [B, Q]
    mask = (j[None, None, :] <= qpos[:, :, None]) & (j[None, None, :] < ctx[:, None, None])
    if sliding_window > 0:
        mask &= j[None, None, :] > qpos[:, :, None] - sliding_window
    # Padded query rows (i >= q_len) see key 0 so the softmax stays finite; they are dropped.
    mask |= (i[None, :, None] >= q_lens[:, None, None]) & (j[None, None, :] == 0)
    qh = q_pad.transpose(1, 2)  # [B, Hq, Q, D]
    kh = k.transpose(1, 2)  # [B, Hkv, L, D]
    vh = v.transpose(1, 2)
    if softcap <= 0.0 and sinks is None and q.dtype == k.dtype:
        out = F.scaled_dot_product_attention(
            qh, kh, vh, attn_mask=mask[:, None], scale=scale, enable_gqa=hq != hkv
        )
    else:
        g = hq // hkv
        kf = kh.float().repeat_interleave(g, dim=1)
        vf = vh.float().repeat_interleave(g, dim=1)
        logits = torch.matmul(qh.float(), kf.transpose(-1, -2)) * scale
        if softcap > 0.0:
            logits = softcap * torch.tanh(logits / softcap)
        logits = logits.masked_fill(~mask[:, None], float("-inf"))
        if sinks is not None:
            sink = sinks.float().view(1, hq, 1, 1).expand(b, hq, max_query_len, 1)
            probs = torch.softmax(torch.cat((logits, sink), dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(logits, dim=-1)
        out = torch.matmul(probs, vf).to(q.dtype)
    out = out.transpose(1, 2)  # [B, Q, Hq, Dv]
    if max_query_len == 1:
        return out.reshape(b, hq, dv)
    return out[seq_idx, tok_idx]


# prompts of a fresh prefill are attended in this many groups of similar length
FRESH_PREFILL_GROUPS = 4


def _fresh_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, q_lens, scale) -> torch.Tensor:
    """Prompts with nothing cached: causal attention over right-padded rows, no mask tensor.

    With right padding, query i of a sequence sees keys 0..i, all of them its own (i < q_len),
    so SDPA's is_causal is exact for the real rows and skips the blocks above the diagonal;
    padded rows compute on finite cache contents and are dropped. The prompts are sorted by
    length and attended in a few groups, each padded only to its own longest prompt (for
    lengths spread evenly, 4 groups do about half the work of one padded batch).
    """
    t, hq, d = q.shape
    b = q_lens.shape[0]
    hkv = k_cache.shape[2]
    out = q.new_empty(t, hq, v_cache.shape[-1])
    order = torch.argsort(q_lens, descending=True, stable=True)
    starts = cu_seqlens_q[:-1].long()
    n_groups = min(FRESH_PREFILL_GROUPS, b)
    for g in range(n_groups):
        seqs = order[g * b // n_groups : (g + 1) * b // n_groups]
        lens = q_lens[seqs]
        longest = int(lens[0])
        seq_idx = torch.repeat_interleave(torch.arange(seqs.numel(), device=q.device), lens)
        first = torch.cumsum(lens, 0) - lens
        tok_idx = torch.arange(seq_idx.numel(), device=q.device) - first[seq_idx]
        rows = starts[seqs][seq_idx] + tok_idx  # the group's tokens in q
        q_pad = q.new_zeros(seqs.numel(), longest, hq, d)
        q_pad[seq_idx, tok_idx] = q[rows]
        k = _gather_kv(k_cache, block_tables[seqs], longest)
        v = _gather_kv(v_cache, block_tables[seqs], longest)
        o = F.scaled_dot_product_attention(
            q_pad.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale,
            enable_gqa=hq != hkv,
        )
        out[rows] = o.transpose(1, 2)[seq_idx, tok_idx]
    return out


def _split_rows(attend, q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, q_lens, groups, scale,
                sliding_window, softcap, sinks) -> torch.Tensor:
    """``attend`` (a paged_attention variant) over each group of sequences (boolean masks over
    the batch) separately."""
    out = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])
    for rows in (g.nonzero().squeeze(1) for g in groups):
        lens = q_lens[rows]
        cu = torch.zeros(rows.numel() + 1, dtype=cu_seqlens_q.dtype, device=q.device)
        cu[1:] = lens.cumsum(0)
        # the tokens of the chosen sequences, in order
        seq_of_token = torch.repeat_interleave(torch.arange(rows.numel(), device=q.device), lens)
        tokens = cu_seqlens_q[:-1].long()[rows][seq_of_token] + (
            torch.arange(seq_of_token.numel(), device=q.device) - cu[:-1].long()[seq_of_token])
        ctx = context_lens[rows]
        out[tokens] = attend(
            q[tokens], k_cache, v_cache, block_tables[rows], cu, ctx, int(lens.max()), int(ctx.max()), scale,
            sliding_window, softcap, sinks,
        )
    return out


def paged_decode_attention_ref(
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
) -> torch.Tensor:
    """One query token per sequence: q [B, Hq, D] -> [B, Hq, D]."""
    b = q.shape[0]
    cu = torch.arange(b + 1, device=q.device, dtype=torch.int32)
    return paged_attention_ref(
        q, k_cache, v_cache, block_tables, cu, context_lens, 1, max_context_len, scale,
        sliding_window, softcap, sinks,
    )


def paged_attention_cpu(
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
) -> torch.Tensor:
    """The CPU fast path of ``paged_attention``: the native C kernel (``kernels/cpu``), which reads
    the pages in place for decode rows and prefill chunks alike, in one call per layer. Falls back
    to the reference where the native kernel is unavailable."""
    if not native_attention.supports(q, k_cache, v_cache) or q.shape[0] == 0:
        return paged_attention_ref(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, max_query_len,
                                   max_context_len, scale, sliding_window, softcap, sinks)
    if max_query_len == 1:
        return native_attention.paged_decode_attention_native(
            q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window, softcap, sinks)
    return native_attention.paged_attention_native(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens,
                                                   scale, sliding_window, softcap, sinks)


def prefill_attention_ref(
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
) -> torch.Tensor:
    """Variable-length causal attention of new query chunks against cached + new keys."""
    return paged_attention_ref(
        q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, max_query_len,
        max_context_len, scale, sliding_window, softcap, sinks,
    )


LOG2E = 1.4426950408889634


@triton.jit
def _softcap_log2(s, softcap, scale_log2, HAS_SOFTCAP: tl.constexpr):
    """Raw q.k products -> logits in log2 units (scale, optional softcap * tanh(x / softcap))."""
    if HAS_SOFTCAP:
        x = s * (scale_log2 / 1.4426950408889634) / softcap
        # tanh(x) = 1 - 2 / (exp(2x) + 1); exp(2x) = exp2(2x log2 e), clamped against overflow
        e = tl.exp2(tl.minimum(x * 2.8853900817779268, 126.0))
        return (softcap * 1.4426950408889634) * (1.0 - 2.0 / (e + 1.0))
    else:
        return s * scale_log2


@triton.jit
def _decode_split_kernel(
    q_ptr, kc_ptr, vc_ptr, bt_ptr, ctx_ptr, sink_ptr,
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
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(ctx - window, 0)
    per = tl.cdiv(tl.cdiv(ctx - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = lo + sp * per
    end = tl.minimum(start + per, ctx)

    g = tl.arange(0, BLOCK_G)
    heads = kvh * group + g
    g_ok = g < group
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q_rows = q_ptr + b64 * sqb + heads.to(tl.int64) * sqh
    if D_CHUNK == BLOCK_D:
        q = tl.load(q_rows[:, None] + d[None, :], mask=g_ok[:, None] & (d < head_dim)[None, :], other=0.0)
    else:
        q = 0.0
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
        if D_CHUNK == BLOCK_D:
            k = tl.load(k_rows[:, None] + d[None, :], mask=j_ok[:, None] & (d < head_dim)[None, :], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
        else:
            s = tl.zeros((BLOCK_G, BLOCK_N), tl.float32)
            for dc in tl.static_range(0, BLOCK_D, D_CHUNK):
                dd = dc + tl.arange(0, D_CHUNK)
                qd = tl.load(q_rows[:, None] + dd[None, :], mask=g_ok[:, None] & (dd < head_dim)[None, :],
                             other=0.0)
                kd = tl.load(k_rows[:, None] + dd[None, :], mask=j_ok[:, None] & (dd < head_dim)[None, :],
                             other=0.0)
                s += tl.dot(qd, tl.trans(kd), input_precision=DOT_PREC)
        s = _softcap_log2(s, softcap, scale_log2, HAS_SOFTCAP)
        s = tl.where(j_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_base + (page * svb + off * svt)[:, None] + dv[None, :],
            mask=j_ok[:, None] & (dv < head_dim_v)[None, :], other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new

    if NUM_SPLITS == 1:
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
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
        tl.store(part_o_ptr + row[:, None] * BLOCK_DV + dv[None, :], acc, mask=g_ok[:, None])
        tl.store(part_ml_ptr + row * 2, m_i, mask=g_ok)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=g_ok)


@triton.jit
def _decode_reduce_kernel(
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


MAX_DECODE_SPLITS = 32


def decode_config(batch: int, n_q_heads: int, n_kv_heads: int, head_dim: int, head_dim_v: int,
                  num_sms: int, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Launch configuration of paged decode attention (also used by the compile test).

    The number of splits depends only on the batch size, the kv heads and the device, never
    on the context lengths, so one CUDA graph per batch size serves every step.
    """
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


def _check_paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    check_device(q)
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k_cache.shape[2]} kv heads")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("paged attention: the head dim of q and the caches must be contiguous")


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
    *,
    num_splits: int | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """q [B, Hq, D] -> [B, Hq, Dv]; ``max_context_len`` is not needed (read on the device).

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
    _check_paged(q, k_cache, v_cache)
    hkv = k_cache.shape[2]
    cfg = decode_config(b, hq, hkv, d, dv, num_sms(q.device), k_cache.dtype)
    cfg.update(config or {})
    if num_splits is not None:
        if num_splits < 1 or num_splits & (num_splits - 1):
            raise ValueError(f"num_splits must be a power of two, got {num_splits}")
        cfg["NUM_SPLITS"] = num_splits
    s = cfg["NUM_SPLITS"]
    if s > 1:
        part_o = torch.empty(b, hq, s, cfg["BLOCK_DV"], dtype=torch.float32, device=q.device)
        part_ml = torch.empty(b, hq, s, 2, dtype=torch.float32, device=q.device)
    else:
        part_o = part_ml = out
    sink_arg = sinks if sinks is not None else q
    _decode_split_kernel[(b, hkv, s)](
        q, k_cache, v_cache, block_tables, context_lens, sink_arg, out, part_o, part_ml,
        scale * LOG2E, float(softcap), int(sliding_window), hq // hkv, d, dv, k_cache.shape[1],
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1),
        HAS_SOFTCAP=softcap > 0.0, HAS_SINKS=sinks is not None, HAS_WINDOW=sliding_window > 0,
        DOT_PREC=dot_precision(k_cache.dtype), **cfg,
    )
    if s > 1:
        _decode_reduce_kernel[(b, hq)](
            part_o, part_ml, sink_arg, out, hq, dv, out.stride(0), out.stride(1),
            NUM_SPLITS=s, BLOCK_DV=cfg["BLOCK_DV"], HAS_SINKS=sinks is not None, num_warps=4,
        )
    return out


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
):
    """Online softmax over key tiles n_lo, n_lo + BLOCK_N, ... < n_hi.

    MASKED tiles apply the causal / window / end-of-context masks per (row, key); unmasked
    tiles are known to be fully visible to every valid row and skip them. With
    D_CHUNK == BLOCK_D the query tile ``q`` stays in registers; with a smaller D_CHUNK (fp32
    operands, whose FMA products hold whole rows per thread) q.k is summed over head-dim
    chunks, re-reading the query rows ``q_rows`` (cached) instead.
    """
    d = tl.arange(0, BLOCK_D)
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
        if D_CHUNK == BLOCK_D:
            k = tl.load(k_rows[:, None] + d[None, :], mask=k_ok[:, None] & (d < head_dim)[None, :], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
        else:
            s = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            for dc in tl.static_range(0, BLOCK_D, D_CHUNK):
                dd = dc + tl.arange(0, D_CHUNK)
                qd = tl.load(q_rows[:, None] + dd[None, :], mask=row_ok[:, None] & (dd < head_dim)[None, :],
                             other=0.0)
                kd = tl.load(k_rows[:, None] + dd[None, :], mask=k_ok[:, None] & (dd < head_dim)[None, :],
                             other=0.0)
                s += tl.dot(qd, tl.trans(kd), input_precision=DOT_PREC)
        s = _softcap_log2(s, softcap, scale_log2, HAS_SOFTCAP)
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
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _prefill_kernel(
    q_ptr, kc_ptr, vc_ptr, bt_ptr, cu_ptr, ctx_ptr, sink_ptr, out_ptr,
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
        r = tl.arange(0, BLOCK_M)
        tok = q0 + r // HEADS_PER_TILE
        gi = chunk * HEADS_PER_TILE + r % HEADS_PER_TILE
        row_ok = (r < BLOCK_Q * HEADS_PER_TILE) & (tok < q_len) & (gi < group)
        head = kvh * group + gi
        pos = ctx - q_len + tok
        d = tl.arange(0, BLOCK_D)
        dv = tl.arange(0, BLOCK_DV)
        t64 = (q_start + tok).to(tl.int64)
        q_rows = q_ptr + t64 * sqt + head.to(tl.int64) * sqh
        if D_CHUNK == BLOCK_D:
            q = tl.load(q_rows[:, None] + d[None, :], mask=row_ok[:, None] & (d < head_dim)[None, :], other=0.0)
        else:
            q = 0.0
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
        )
        acc, m_i, l_i = _prefill_tiles(
            acc, m_i, l_i, q, q_rows, row_ok, pos, k_base, v_base, bt_row, t_full_lo, t_full_hi, kv_end,
            scale_log2, softcap, window, block_size, skb, skt, svb, svt, head_dim, head_dim_v,
            False, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, D_CHUNK, HAS_SOFTCAP, HAS_WINDOW, DOT_PREC,
        )
        acc, m_i, l_i = _prefill_tiles(
            acc, m_i, l_i, q, q_rows, row_ok, pos, k_base, v_base, bt_row, t_full_hi, kv_end, kv_end,
            scale_log2, softcap, window, block_size, skb, skt, svb, svt, head_dim, head_dim_v,
            True, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, D_CHUNK, HAS_SOFTCAP, HAS_WINDOW, DOT_PREC,
        )
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
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
    *,
    config: dict | None = None,
) -> torch.Tensor:
    """q [T, Hq, D] -> [T, Hq, Dv]; the sizes ``max_*_len`` are not needed (read on the device).

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
    _check_paged(q, k_cache, v_cache)
    hkv = k_cache.shape[2]
    cfg = prefill_config(hq, hkv, d, dv, k_cache.dtype)
    if config:
        cfg.update(config)
        if "BLOCK_M" in config and "BLOCK_Q" not in config:
            cfg["HEADS_PER_TILE"] = min(hq // hkv, cfg["BLOCK_M"] // 16)
            cfg["BLOCK_Q"] = cfg["BLOCK_M"] // cfg["HEADS_PER_TILE"]
    group = hq // hkv
    grid = (t // cfg["BLOCK_Q"] + nseq, hkv * triton.cdiv(group, cfg["HEADS_PER_TILE"]))
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens,
        sinks if sinks is not None else q, out,
        nseq, scale * LOG2E, float(softcap), int(sliding_window), group, d, dv, k_cache.shape[1],
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1),
        HAS_SOFTCAP=softcap > 0.0, HAS_SINKS=sinks is not None, HAS_WINDOW=sliding_window > 0,
        DOT_PREC=dot_precision(k_cache.dtype), **cfg,
    )
    return out


@torch.library.custom_op("tokenfab::paged_attention", mutates_args=())
def paged_attention(
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
) -> torch.Tensor:
    """The model's one attention call per layer per step (mixed prefill/decode batch)."""
    if use_triton(q):
        if max_query_len == 1:
            return _paged_decode_attention_triton(
                q, k_cache, v_cache, block_tables, context_lens, max_context_len, scale,
                sliding_window, softcap, sinks,
            )
        return _prefill_attention_triton(
            q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, max_query_len,
            max_context_len, scale, sliding_window, softcap, sinks,
        )
    return paged_attention_cpu(
        q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, max_query_len,
        max_context_len, scale, sliding_window, softcap, sinks,
    )


@paged_attention.register_fake
def _(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, max_query_len, max_context_len,
      scale, sliding_window=0, softcap=0.0, sinks=None):
    return q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])
