"""A batch-invariant matmul (``y = x @ w.T + bias``), Triton: the linear layers' GEMM in
batch-invariant mode on CUDA (``layers.linear.linear``; ``kernels.batch_invariant``).

cuBLAS picks its kernel (tile shape, split-K, stream-K) from M as well as N and K, so row r of
``x @ w.T`` rounds differently in a 1-row decode step, a 5-row speculative verify and a 64-row
batch, and a verify row is then not the decode row of the same token. Here the tile configuration
depends only on (N, K, dtype) and the device (``invariant_config``), never on M, and there is no
split-K: row r's output element n is one fp32 accumulator summed over K in ``BLOCK_K`` steps, in
order, by the same MMA instruction shape in every tile, whatever rows share its tile and wherever
row r sits. Rows past M in the last tile are masked loads (zeros) that touch no other row's sums.

Persistent: ``min(tiles, SMs)`` programs each walk tiles ``pid, pid + P, ...`` in grouped order
(``GROUP_M`` row tiles sweep the column tiles together, so a weight tile stays in L2 while they
use it). The schedule changes only which program computes a tile, not how.

Cost: ``BLOCK_M`` is fixed (64 for 16-bit: Hopper's warp-group MMA height), so a decode step's
single row pays a 64-row MMA; decode is bound by reading the weights, so that costs little.
``BLOCK_N`` shrinks for narrow layers so that even one row tile spreads over the SMs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# isort: off
# _launch picks Triton's interpreter on machines without a GPU; it must run before triton loads
from tokenfab.kernels._launch import check_device, dot_precision, num_sms
import triton
import triton.language as tl
# isort: on

from tokenfab.kernels._dispatch import use_triton
from tokenfab.kernels.moe_common import grouped_tile

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _matmul_invariant_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr,
    M, N, K, sxm, swn, som,
    NUM_PROGS,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Program p: output tiles p, p + NUM_PROGS, ... of out [M, N] = x [M, K] @ w [N, K]^T (+ bias)."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    for tile in range(pid, num_pid_m * num_pid_n, NUM_PROGS):
        pm, pn = grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
        rm = pm * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = rm < M
        n_ok = rn < N
        x_rows = x_ptr + rm.to(tl.int64)[:, None] * sxm
        w_cols = w_ptr + rn.to(tl.int64)[None, :] * swn
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            if EVEN_K:
                x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None], other=0.0)
                w = tl.load(w_cols + kk[:, None], mask=n_ok[None, :], other=0.0)
            else:
                k_ok = kk < K
                x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(w_cols + kk[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc = tl.dot(x, w, acc, input_precision=DOT_PREC)
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rm.to(tl.int64)[:, None] * som + rn[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])


def invariant_config(n: int, k: int, dtype: torch.dtype, sms: int) -> dict:
    """The tile configuration for a [*, K] x [N, K]^T product: a function of (N, K, dtype) and the
    device's SM count only, never of M (the point of the kernel; the compile test uses it too)."""
    if dtype == torch.float32:  # exact fp32 FMAs ("ieee"), no tensor cores
        block_m, block_k, widths, warps, stages = 32, 32, (64, 32, 16), 4, 2
    else:
        block_m, block_k, widths, warps, stages = 64, 64, (128, 64, 32), 4, 4
    # the widest column tile that still gives every SM a tile at one row tile (decode)
    block_n = next((w for w in widths if triton.cdiv(n, w) >= sms), widths[-1])
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8, EVEN_K=k % block_k == 0,
                num_warps=warps, num_stages=stages)


def matmul_invariant_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: ``F.linear`` (the same product, not batch-invariant)."""
    return F.linear(x, w, bias)


def _matmul_invariant_triton(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                             *, config: dict | None = None) -> torch.Tensor:
    """x [..., K] @ w [N, K]^T (+ bias [N]) -> [..., N] in x's dtype; ``config`` overrides
    ``invariant_config`` entries (tests, the kernel benchmark)."""
    check_device(x)
    if x.dtype not in SUPPORTED_DTYPES or w.dtype != x.dtype:
        raise ValueError(f"matmul_invariant: x and w must share a float dtype ({SUPPORTED_DTYPES}), got "
                         f"{x.dtype} and {w.dtype}")
    if w.dim() != 2 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"matmul_invariant: x {tuple(x.shape)} does not match w {tuple(w.shape)}")
    if bias is not None and bias.shape != (w.shape[0],):
        raise ValueError(f"matmul_invariant: bias must be [{w.shape[0]}], got {tuple(bias.shape)}")
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if w.stride(-1) != 1:
        w = w.contiguous()
    (m, k), n = x2.shape, w.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.view(*shape[:-1], n)
    if k == 0:
        out.zero_()
        if bias is not None:
            out += bias
        return out.view(*shape[:-1], n)
    sms = num_sms(x.device)
    cfg = invariant_config(n, k, x.dtype, sms)
    cfg.update(config or {})
    tiles = triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"])
    progs = min(tiles, sms)
    _matmul_invariant_kernel[(progs,)](
        x2, w, bias if bias is not None else w, out, m, n, k, x2.stride(0), w.stride(0), out.stride(0), progs,
        HAS_BIAS=bias is not None, DOT_PREC=dot_precision(x.dtype), **cfg,
    )
    return out.view(*shape[:-1], n)


@torch.library.custom_op("tokenfab::matmul_invariant", mutates_args=())
def matmul_invariant(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T + bias`` with row r's bits independent of the other rows (Triton), or the reference."""
    if use_triton(x):
        return _matmul_invariant_triton(x, w, bias)
    return matmul_invariant_ref(x, w, bias)


@matmul_invariant.register_fake
def _(x, w, bias=None):
    return x.new_empty(*x.shape[:-1], w.shape[0])
