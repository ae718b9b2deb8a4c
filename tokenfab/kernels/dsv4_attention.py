"""DeepSeek-V4's attention core: each query token's heads over its own list of gathered key rows, with sinks.

``dsv4_sparse_attention(q, rows_a, idx_a, rows_b, idx_b, rows_c, idx_c, sinks, scale)``: q [T, H, D]; the keys
of token t are rows ``idx_a[t]`` of ``rows_a``, ``idx_b[t]`` of ``rows_b`` and ``idx_c[t]`` of ``rows_c``, -1 for
none (the model: its window's earlier rows in the sequence's ring, its window's rows of this step, its
compressed entries: all visible ones for HCA, the indexer's picks for CSA); the first D values of a row are
both key and value (shared-KV MQA). With a learned sink logit per head:

    o_h = sum_j softmax([q_h . k_j * scale ; sink_h])_j k_j        (the sink's share goes nowhere)

The Triton kernel streams the rows (online softmax, a program per token and block of heads), so the gathered
keys never exist as a [T, L, D] tensor, as they do in the reference.

``dsv4_index_topk(q, w, rows, idx, col, topk)``: the lightning indexer over compressed entries. Token t scores
the entry rows ``idx[t]`` (-1: not visible), whose index key sits at columns ``col:col + d_I``:

    score[t, n] = sum_h w[t, h] * relu(q[t, h] . k_n) / sqrt(d_I)

and keeps the ``topk`` best (``dsa_indexer``'s selection: ties to the lowest n, -1 past the visible ones),
returning positions into ``idx[t]``. The Triton scores read each entry's key once per token block of heads,
never a [T, N, d_I] gather.
"""

from __future__ import annotations

import torch

# isort: off
# _launch picks Triton's interpreter on machines without a GPU; it must run before triton loads
from tokenfab.kernels._launch import check_device, next_pow2
import triton
import triton.language as tl
# isort: on

from tokenfab.kernels._dispatch import eager_op, kernel_op
from tokenfab.kernels.dsa_indexer import _dsa_topk_triton, select_topk


def dsv4_sparse_attention_ref(q: torch.Tensor, rows_a: torch.Tensor, idx_a: torch.Tensor, rows_b: torch.Tensor,
                              idx_b: torch.Tensor, rows_c: torch.Tensor, idx_c: torch.Tensor, sinks: torch.Tensor,
                              scale: float) -> torch.Tensor:
    """q [T, H, D]; rows_* [R, >= D]; idx_* [T, L] int64 (-1: no key); sinks [H] -> [T, H, D] in q's dtype."""
    t, h, d = q.shape
    sources = ((rows_a, idx_a), (rows_b, idx_b), (rows_c, idx_c))
    keys = torch.cat([rows[idx.clamp(min=0)][..., :d] for rows, idx in sources], dim=1).to(q.dtype)
    ok = torch.cat([idx >= 0 for _, idx in sources], dim=1)
    logits = torch.einsum("thd,tld->thl", q, keys).float() * scale
    logits = logits.masked_fill(~ok.unsqueeze(1), float("-inf"))
    sink = sinks.float().view(1, h, 1).expand(t, h, 1)
    probs = torch.cat((logits, sink), dim=-1).softmax(dim=-1)[..., :-1]
    return torch.einsum("thl,tld->thd", probs.to(keys.dtype), keys)


@triton.jit
def _stream_rows(acc, m_i, l_i, q, rows_ptr, stride_r, idx_ptr, L, t, offs_d, d_ok, scale,
                 BLOCK_L: tl.constexpr, DOT_PREC: tl.constexpr):
    """Fold the rows idx[t, :L] into the running (acc, max, sum) of the online softmax."""
    offs_l = tl.arange(0, BLOCK_L)
    for l0 in range(0, L, BLOCK_L):
        ll = l0 + offs_l
        idx = tl.load(idx_ptr + t.to(tl.int64) * L + ll, mask=ll < L, other=-1)
        ok = idx >= 0
        k = tl.load(rows_ptr + tl.where(ok, idx, 0)[:, None] * stride_r + offs_d[None, :],
                    mask=ok[:, None] & d_ok[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k).to(q.dtype), input_precision=DOT_PREC) * scale
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), k.to(q.dtype), input_precision=DOT_PREC)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _dsv4_attention_kernel(q_ptr, rows_a_ptr, idx_a_ptr, rows_b_ptr, idx_b_ptr, rows_c_ptr, idx_c_ptr, sinks_ptr,
                           out_ptr, H, D, La, Lb, Lc, stride_a, stride_b, stride_c, scale,
                           BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr,
                           DOT_PREC: tl.constexpr):
    """A program per (token, block of heads): q [T, H, D] contiguous, out likewise."""
    t = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_ok, d_ok = offs_h < H, offs_d < D
    base = t.to(tl.int64) * H * D
    q = tl.load(q_ptr + base + offs_h[:, None] * D + offs_d[None, :], mask=h_ok[:, None] & d_ok[None, :], other=0.0)
    acc = tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32)
    m_i = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc, m_i, l_i = _stream_rows(acc, m_i, l_i, q, rows_a_ptr, stride_a, idx_a_ptr, La, t, offs_d, d_ok, scale,
                                 BLOCK_L, DOT_PREC)
    acc, m_i, l_i = _stream_rows(acc, m_i, l_i, q, rows_b_ptr, stride_b, idx_b_ptr, Lb, t, offs_d, d_ok, scale,
                                 BLOCK_L, DOT_PREC)
    acc, m_i, l_i = _stream_rows(acc, m_i, l_i, q, rows_c_ptr, stride_c, idx_c_ptr, Lc, t, offs_d, d_ok, scale,
                                 BLOCK_L, DOT_PREC)
    sink = tl.load(sinks_ptr + offs_h, mask=h_ok, other=0.0).to(tl.float32)
    m_fin = tl.maximum(m_i, sink)
    denom = l_i * tl.exp(m_i - m_fin) + tl.exp(sink - m_fin)
    o = acc * (tl.exp(m_i - m_fin) / denom)[:, None]
    tl.store(out_ptr + base + offs_h[:, None] * D + offs_d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=h_ok[:, None] & d_ok[None, :])


def dsv4_attention_config(h: int, d: int) -> dict:
    """Launch configuration (also used by the compile check): 16 heads a program, keys in tiles of 16 rows."""
    block_d = max(16, next_pow2(d))
    return dict(BLOCK_H=16, BLOCK_D=block_d, BLOCK_L=16, num_warps=4 if block_d <= 128 else 8)


def _dsv4_sparse_attention_triton(q: torch.Tensor, rows_a: torch.Tensor, idx_a: torch.Tensor, rows_b: torch.Tensor,
                                  idx_b: torch.Tensor, rows_c: torch.Tensor, idx_c: torch.Tensor, sinks: torch.Tensor,
                                  scale: float) -> torch.Tensor:
    check_device(q)
    t, h, d = q.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if t == 0:
        return out
    if any(r.stride(-1) != 1 for r in (rows_a, rows_b, rows_c)):
        raise ValueError("dsv4_sparse_attention: key rows must be contiguous along the last dimension")
    cfg = dsv4_attention_config(h, d)
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    grid = (t, triton.cdiv(h, cfg["BLOCK_H"]))
    _dsv4_attention_kernel[grid](q.contiguous(), rows_a, idx_a.contiguous(), rows_b, idx_b.contiguous(), rows_c,
                                 idx_c.contiguous(), sinks.float().contiguous(), out, h, d, idx_a.shape[1],
                                 idx_b.shape[1], idx_c.shape[1], rows_a.stride(0), rows_b.stride(0), rows_c.stride(0),
                                 scale, DOT_PREC=prec, **cfg)
    return out


dsv4_sparse_attention_op = kernel_op("dsv4_sparse_attention", _dsv4_sparse_attention_triton, dsv4_sparse_attention_ref,
                                     lambda q, *_: torch.empty_like(q))
dsv4_sparse_attention = eager_op(dsv4_sparse_attention_op, dsv4_sparse_attention_ref,
                                 triton_fn=_dsv4_sparse_attention_triton)


# ============================================================================ the indexer over entries


def dsv4_index_scores_ref(q: torch.Tensor, w: torch.Tensor, rows: torch.Tensor, idx: torch.Tensor,
                          col: int) -> torch.Tensor:
    """q [T, Hi, di], w [T, Hi] (float32, 1/sqrt(Hi) folded in), rows [R, >= col + di], idx [T, N] -> [T, N]
    float32 scores, -inf where idx < 0."""
    di = q.shape[-1]
    keys = rows[idx.clamp(min=0)][..., col:col + di].float()
    scores = torch.relu(torch.einsum("thd,tnd->thn", q.float(), keys)) * di**-0.5
    scores = (scores * w.float().unsqueeze(-1)).sum(dim=1)
    return scores.masked_fill(idx < 0, float("-inf"))


@triton.jit
def _dsv4_index_kernel(q_ptr, w_ptr, rows_ptr, idx_ptr, out_ptr, HI, DI, N, stride_r, col, scale,
                       BLOCK_HI: tl.constexpr, BLOCK_DI: tl.constexpr, BLOCK_N: tl.constexpr,
                       DOT_PREC: tl.constexpr):
    """A program per (token, block of N entries): the Hi x BLOCK_N products, ReLU, the weighted head sum."""
    t = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_h, offs_d = tl.arange(0, BLOCK_HI), tl.arange(0, BLOCK_DI)
    h_ok, d_ok, n_ok = offs_h < HI, offs_d < DI, offs_n < N
    q = tl.load(q_ptr + t.to(tl.int64) * HI * DI + offs_h[:, None] * DI + offs_d[None, :],
                mask=h_ok[:, None] & d_ok[None, :], other=0.0)
    w = tl.load(w_ptr + t.to(tl.int64) * HI + offs_h, mask=h_ok, other=0.0).to(tl.float32)
    idx = tl.load(idx_ptr + t.to(tl.int64) * N + offs_n, mask=n_ok, other=-1)
    ok = idx >= 0
    k = tl.load(rows_ptr + tl.where(ok, idx, 0)[:, None] * stride_r + col + offs_d[None, :],
                mask=ok[:, None] & d_ok[None, :], other=0.0)
    s = tl.dot(q, tl.trans(k).to(q.dtype), input_precision=DOT_PREC)
    score = tl.sum(tl.maximum(s, 0.0) * w[:, None], axis=0) * scale
    tl.store(out_ptr + t.to(tl.int64) * N + offs_n, tl.where(ok, score, float("-inf")), mask=n_ok)


def dsv4_index_config(n_heads: int, head_dim: int, dtype: torch.dtype = torch.bfloat16) -> dict:
    """16-bit: 32 entries a program, 4 warps; float32 (exact products, unrolled FMAs): 16 entries, 8 warps
    (fewer registers a thread, no spills at 64 heads of 128)."""
    fp32 = dtype == torch.float32
    return dict(BLOCK_HI=max(16, next_pow2(n_heads)), BLOCK_DI=max(16, next_pow2(head_dim)),
                BLOCK_N=16 if fp32 else 32, num_warps=8 if fp32 else 4)


def _dsv4_index_scores_triton(q: torch.Tensor, w: torch.Tensor, rows: torch.Tensor, idx: torch.Tensor,
                              col: int) -> torch.Tensor:
    check_device(q)
    t, hi, di = q.shape
    n = idx.shape[1]
    out = torch.empty(t, n, dtype=torch.float32, device=q.device)
    if t == 0 or n == 0:
        return out
    if rows.stride(-1) != 1:
        raise ValueError("dsv4_index_topk: entry rows must be contiguous along the last dimension")
    cfg = dsv4_index_config(hi, di, q.dtype)
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    _dsv4_index_kernel[(t, triton.cdiv(n, cfg["BLOCK_N"]))](
        q.contiguous(), w.float().contiguous(), rows, idx.contiguous(), out, hi, di, n, rows.stride(0), col,
        di**-0.5, DOT_PREC=prec, **cfg)
    return out


def dsv4_index_topk_ref(q: torch.Tensor, w: torch.Tensor, rows: torch.Tensor, idx: torch.Tensor, col: int,
                        topk: int) -> torch.Tensor:
    """[T, topk] int32 positions into each token's ``idx`` row (-1: unused), the selection of ``select_topk``."""
    return select_topk(dsv4_index_scores_ref(q, w, rows, idx, col), topk)


def _dsv4_index_topk_triton(q: torch.Tensor, w: torch.Tensor, rows: torch.Tensor, idx: torch.Tensor, col: int,
                            topk: int) -> torch.Tensor:
    return _dsa_topk_triton(_dsv4_index_scores_triton(q, w, rows, idx, col), topk)


dsv4_index_topk_op = kernel_op("dsv4_index_topk", _dsv4_index_topk_triton, dsv4_index_topk_ref,
                               lambda q, w, rows, idx, col, topk: idx.new_empty(q.shape[0], topk,
                                                                                dtype=torch.int32))
dsv4_index_topk = eager_op(dsv4_index_topk_op, dsv4_index_topk_ref, triton_fn=_dsv4_index_topk_triton)
