"""Manifold-constrained hyper-connections (mHC, DeepSeek-V4): the mixing weights and both mixes, fused.

``mhc_pre(streams, fn, base, scale, iters, hc_eps, norm_eps)`` -> (collapsed [T, D], post [T, n], comb [T, n, n]):
one program per block of tokens reads the n streams twice, once for the projection
``a = RMSNorm_unweighted(flatten(h)) fn^T`` (the norm is a per-row scalar, so it is applied to the product:
``a = (h fn^T) / rms(h)``), then turns ``a`` into pre / post / Sinkhorn-projected comb in registers and
collapses the streams with ``pre``. ``mhc_post(streams, out, post, comb)`` -> ``post_k out + sum_j comb[j, k]
h_j`` [T, n, D]. The references (``*_ref``) are transformers' math op for op (``tokenfab.layers.hyper_connections``
describes it); ``mhc_pre`` / ``mhc_post`` are the eager entry points, dispatched by ``_dispatch.backend``.

Everything is float32 inside; the streams may be bf16/fp16/fp32 (outputs in their dtype, post and comb float32).
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


def mhc_pre_ref(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int,
                hc_eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [T, n, D] -> (collapsed [T, D] in the streams' dtype, post [T, n], comb [T, n, n] float32)."""
    t, n, _ = streams.shape
    a = torch.nn.functional.linear(
        streams.reshape(t, -1).float() * torch.rsqrt(streams.reshape(t, -1).float().square().mean(-1, keepdim=True)
                                                     + norm_eps), fn.float())
    pre_w, post_w, comb_w = a.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.float().split([n, n, n * n])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.view(t, n, n) * scale[2] + comb_b.view(n, n), dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
    return collapsed, post, comb


def mhc_post_ref(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """h'_k = post_k out + sum_j comb[j, k] h_j -> [T, n, D] in the streams' dtype."""
    mixed = post.unsqueeze(-1) * out.float().unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), streams.float())
    return mixed.to(streams.dtype)


@triton.jit
def _mhc_pre_kernel(h_ptr, fn_ptr, base_ptr, scale_ptr, x_ptr, post_ptr, comb_ptr, T, D, iters, hc_eps, norm_eps,
                    N: tl.constexpr, NP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                    BLOCK_D: tl.constexpr):
    """h [T, N, D] contiguous; fn [(2 + N) N, N D]; x [T, D]; post [T, N]; comb [T, N, N]."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    nd = N * D
    # projections: pre / post columns (NP of 16, the dot's minimum width) and comb cells (NP x NP, i * NP + j)
    c16 = tl.arange(0, 16)
    cells = tl.arange(0, NP * NP)
    ci, cj = cells // NP, cells % NP
    cell_ok = (ci < N) & (cj < N)
    pre_row = tl.where(c16 < N, c16, 0)
    post_row = tl.where(c16 < N, N + c16, 0)
    comb_row = tl.where(cell_ok, 2 * N + ci * N + cj, 0)
    acc_pre = tl.zeros((BLOCK_T, 16), dtype=tl.float32)
    acc_post = tl.zeros((BLOCK_T, 16), dtype=tl.float32)
    acc_comb = tl.zeros((BLOCK_T, NP * NP), dtype=tl.float32)
    sumsq = tl.zeros((BLOCK_T,), dtype=tl.float32)
    ks = tl.arange(0, BLOCK_K)
    for k0 in range(0, nd, BLOCK_K):
        kk = k0 + ks
        k_ok = kk < nd
        h = tl.load(h_ptr + rows[:, None].to(tl.int64) * nd + kk[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)
        sumsq += tl.sum(h * h, axis=1)
        w_pre = tl.load(fn_ptr + pre_row[None, :].to(tl.int64) * nd + kk[:, None],
                        mask=k_ok[:, None] & (c16 < N)[None, :], other=0.0)
        w_post = tl.load(fn_ptr + post_row[None, :].to(tl.int64) * nd + kk[:, None],
                         mask=k_ok[:, None] & (c16 < N)[None, :], other=0.0)
        w_comb = tl.load(fn_ptr + comb_row[None, :].to(tl.int64) * nd + kk[:, None],
                         mask=k_ok[:, None] & cell_ok[None, :], other=0.0)
        acc_pre += tl.dot(h, w_pre, input_precision="ieee")
        acc_post += tl.dot(h, w_post, input_precision="ieee")
        acc_comb += tl.dot(h, w_comb, input_precision="ieee")
    rstd = 1.0 / tl.sqrt(sumsq / nd + norm_eps)
    s_pre = tl.load(scale_ptr)
    s_post = tl.load(scale_ptr + 1)
    s_comb = tl.load(scale_ptr + 2)
    b_pre = tl.load(base_ptr + c16, mask=c16 < N, other=0.0)
    b_post = tl.load(base_ptr + N + c16, mask=c16 < N, other=0.0)
    b_comb = tl.load(base_ptr + comb_row, mask=cell_ok, other=0.0)
    pre = tl.sigmoid(acc_pre * rstd[:, None] * s_pre + b_pre[None, :]) + hc_eps
    post = 2.0 * tl.sigmoid(acc_post * rstd[:, None] * s_post + b_post[None, :])
    tl.store(post_ptr + rows[:, None] * N + c16[None, :], post, mask=row_ok[:, None] & (c16 < N)[None, :])
    # comb: softmax over j per row i, + eps, then Sinkhorn (columns, then rows and columns iters - 1 times)
    z = acc_comb * rstd[:, None] * s_comb + b_comb[None, :]
    z = tl.reshape(tl.where(cell_ok[None, :], z, -1.0e30), (BLOCK_T, NP, NP))
    ok3 = tl.reshape(cell_ok, (1, NP, NP))
    e = tl.exp(z - tl.max(z, axis=2)[:, :, None])
    e = tl.where(ok3, e, 0.0)
    c = tl.where(ok3, e / tl.maximum(tl.sum(e, axis=2), 1e-30)[:, :, None] + hc_eps, 0.0)
    c = c / (tl.sum(c, axis=1)[:, None, :] + hc_eps)
    for _ in range(iters - 1):
        c = c / (tl.sum(c, axis=2)[:, :, None] + hc_eps)
        c = c / (tl.sum(c, axis=1)[:, None, :] + hc_eps)
    c2 = tl.reshape(c, (BLOCK_T, NP * NP))
    tl.store(comb_ptr + rows[:, None] * (N * N) + (ci * N + cj)[None, :], c2,
             mask=row_ok[:, None] & cell_ok[None, :])
    # collapse: x = sum_j pre_j h_j
    ds = tl.arange(0, BLOCK_D)
    for d0 in range(0, D, BLOCK_D):
        dd = d0 + ds
        m = row_ok[:, None] & (dd < D)[None, :]
        x = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
        for j in tl.static_range(N):
            pj = tl.sum(tl.where(c16[None, :] == j, pre, 0.0), axis=1)
            hj = tl.load(h_ptr + rows[:, None].to(tl.int64) * nd + j * D + dd[None, :], mask=m, other=0.0)
            x += pj[:, None] * hj.to(tl.float32)
        tl.store(x_ptr + rows[:, None].to(tl.int64) * D + dd[None, :], x.to(x_ptr.dtype.element_ty), mask=m)


@triton.jit
def _mhc_post_kernel(h_ptr, o_ptr, post_ptr, comb_ptr, y_ptr, T, D, N: tl.constexpr, BLOCK_T: tl.constexpr,
                     BLOCK_D: tl.constexpr):
    """y[t, k] = post[t, k] o[t] + sum_j comb[t, j, k] h[t, j]; h, y [T, N, D], o [T, D] contiguous."""
    pid_t = tl.program_id(0)
    pid_d = tl.program_id(1)
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    dd = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    m = (rows < T)[:, None] & (dd < D)[None, :]
    r64 = rows[:, None].to(tl.int64)
    o = tl.load(o_ptr + r64 * D + dd[None, :], mask=m, other=0.0).to(tl.float32)
    for k in tl.static_range(N):
        pk = tl.load(post_ptr + rows * N + k, mask=rows < T, other=0.0)
        y = pk[:, None] * o
        for j in tl.static_range(N):
            cjk = tl.load(comb_ptr + rows * (N * N) + j * N + k, mask=rows < T, other=0.0)
            hj = tl.load(h_ptr + r64 * (N * D) + j * D + dd[None, :], mask=m, other=0.0).to(tl.float32)
            y += cjk[:, None] * hj
        tl.store(y_ptr + r64 * (N * D) + k * D + dd[None, :], y.to(y_ptr.dtype.element_ty), mask=m)


MHC_BLOCK_T, MHC_BLOCK_K, MHC_BLOCK_D = 16, 64, 128


def mhc_pre_config(n: int) -> dict:
    """Launch configuration (also used by the compile check)."""
    return dict(NP=max(2, next_pow2(n)), BLOCK_T=MHC_BLOCK_T, BLOCK_K=MHC_BLOCK_K, BLOCK_D=MHC_BLOCK_D, num_warps=4)


def _mhc_pre_triton(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int,
                    hc_eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_device(streams)
    t, n, d = streams.shape
    if next_pow2(n) ** 2 < 16:
        return mhc_pre_ref(streams, fn, base, scale, iters, hc_eps, norm_eps)  # n < 3: dot tiles too small
    h = streams.contiguous()
    x = torch.empty(t, d, dtype=streams.dtype, device=streams.device)
    post = torch.empty(t, n, dtype=torch.float32, device=streams.device)
    comb = torch.empty(t, n, n, dtype=torch.float32, device=streams.device)
    if t == 0:
        return x, post, comb
    cfg = mhc_pre_config(n)
    _mhc_pre_kernel[(triton.cdiv(t, cfg["BLOCK_T"]),)](
        h, fn.float().contiguous(), base.float().contiguous(), scale.float().contiguous(), x, post, comb, t, d,
        iters, hc_eps, norm_eps, N=n, **cfg)
    return x, post, comb


def _mhc_post_triton(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    check_device(streams)
    t, n, d = streams.shape
    y = torch.empty_like(streams, memory_format=torch.contiguous_format)
    if t == 0:
        return y
    grid = (triton.cdiv(t, MHC_BLOCK_T), triton.cdiv(d, MHC_BLOCK_D))
    _mhc_post_kernel[grid](streams.contiguous(), out.contiguous(), post.float().contiguous(),
                           comb.float().contiguous(), y, t, d, N=n, BLOCK_T=MHC_BLOCK_T, BLOCK_D=MHC_BLOCK_D,
                           num_warps=4)
    return y


def _pre_fake(streams, fn, base, scale, iters, hc_eps, norm_eps):
    t, n, d = streams.shape
    return (streams.new_empty(t, d), streams.new_empty(t, n, dtype=torch.float32),
            streams.new_empty(t, n, n, dtype=torch.float32))


mhc_pre_op = kernel_op("mhc_pre", _mhc_pre_triton, mhc_pre_ref, _pre_fake)
mhc_post_op = kernel_op("mhc_post", _mhc_post_triton, mhc_post_ref, lambda streams, *_: torch.empty_like(streams))
mhc_pre = eager_op(mhc_pre_op, mhc_pre_ref, triton_fn=_mhc_pre_triton)
mhc_post = eager_op(mhc_post_op, mhc_post_ref, triton_fn=_mhc_post_triton)
