"""RMSNorm and fused residual-add + RMSNorm."""

from __future__ import annotations

import torch

# isort: off
# _launch picks Triton's interpreter on machines without a GPU; it must run before triton loads
from tokenfab.kernels._launch import check_device, next_pow2
import triton
import triton.language as tl
# isort: on

from tokenfab.kernels._dispatch import kernel_op


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = x / sqrt(mean(x^2) + eps) * weight over the last dim, computed in fp32."""
    xf = x.float()
    var = xf.pow(2).mean(-1, keepdim=True)
    y = (xf * torch.rsqrt(var + eps)).to(x.dtype)
    return y * weight.to(x.dtype)


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """residual += x (in place); return rms_norm(residual)."""
    residual.add_(x)
    return rms_norm_ref(residual, weight, eps)


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr,
    n_rows, n_inner, H, eps,
    sx0, sx1, sr0, sr1, so0, so1,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
):
    """Rows of a [n_rows // n_inner, n_inner, H] view (strides s*0, s*1; last dim contiguous).

    With HAS_RESIDUAL: s = residual + x is written back to residual, then normalised.
    Rounding follows the reference: s is rounded to the residual dtype before the norm, the
    normalised value is rounded to the output dtype, then multiplied by the weight (also
    rounded to the output dtype first) and rounded again.
    """
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    r0 = (rows // n_inner).to(tl.int64)
    r1 = (rows % n_inner).to(tl.int64)
    x_row = x_ptr + r0 * sx0 + r1 * sx1
    o_row = out_ptr + r0 * so0 + r1 * so1
    if HAS_RESIDUAL:
        r_row = res_ptr + r0 * sr0 + r1 * sr1
    else:
        r_row = x_row
    cols = tl.arange(0, BLOCK_H)
    if NUM_CHUNKS == 1:
        m = row_ok[:, None] & (cols[None, :] < H)
        s = tl.load(x_row[:, None] + cols[None, :], mask=m, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(r_row[:, None] + cols[None, :], mask=m, other=0.0)
            s = (s.to(tl.float32) + r.to(tl.float32)).to(r.dtype)
            tl.store(r_row[:, None] + cols[None, :], s, mask=m)
        sf = s.to(tl.float32)
        var = tl.sum(sf * sf, axis=1) / H
        rstd = 1.0 / tl.sqrt(var + eps)
        w = tl.load(w_ptr + cols, mask=cols < H, other=0.0).to(out_ptr.dtype.element_ty)
        y = (sf * rstd[:, None]).to(out_ptr.dtype.element_ty)
        y = (y.to(tl.float32) * w.to(tl.float32)[None, :]).to(out_ptr.dtype.element_ty)
        tl.store(o_row[:, None] + cols[None, :], y, mask=m)
    else:
        acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for c in range(NUM_CHUNKS):
            cc = c * BLOCK_H + cols
            m = row_ok[:, None] & (cc[None, :] < H)
            s = tl.load(x_row[:, None] + cc[None, :], mask=m, other=0.0)
            if HAS_RESIDUAL:
                r = tl.load(r_row[:, None] + cc[None, :], mask=m, other=0.0)
                s = (s.to(tl.float32) + r.to(tl.float32)).to(r.dtype)
                tl.store(r_row[:, None] + cc[None, :], s, mask=m)
            sf = s.to(tl.float32)
            acc += tl.sum(sf * sf, axis=1)
        rstd = 1.0 / tl.sqrt(acc / H + eps)
        tl.debug_barrier()
        for c in range(NUM_CHUNKS):
            cc = c * BLOCK_H + cols
            m = row_ok[:, None] & (cc[None, :] < H)
            sf = tl.load(r_row[:, None] + cc[None, :], mask=m, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + cc, mask=cc < H, other=0.0).to(out_ptr.dtype.element_ty)
            y = (sf * rstd[:, None]).to(out_ptr.dtype.element_ty)
            y = (y.to(tl.float32) * w.to(tl.float32)[None, :]).to(out_ptr.dtype.element_ty)
            tl.store(o_row[:, None] + cc[None, :], y, mask=m)


MAX_BLOCK_H = 8192


def norm_config(hidden: int) -> dict:
    """Launch configuration for rows of ``hidden`` elements (also used by the compile test)."""
    block_h = min(next_pow2(hidden), MAX_BLOCK_H)
    num_chunks = (hidden + block_h - 1) // block_h
    block_r = max(1, min(64, 2048 // block_h))
    num_warps = max(1, min(16, block_r * block_h // 512))
    return dict(BLOCK_R=block_r, BLOCK_H=block_h, NUM_CHUNKS=num_chunks, num_warps=num_warps)


def _rows3(t: torch.Tensor) -> torch.Tensor:
    """A [R0, R1, H] view of ``t`` (a copy only if no such view exists), last dim contiguous."""
    h = t.shape[-1]
    if t.dim() == 1:
        t = t.view(1, 1, h)
    elif t.dim() == 2:
        t = t.unsqueeze(1)
    elif t.dim() > 3:
        try:
            t = t.view(-1, t.shape[-2], h)
        except RuntimeError:
            t = t.reshape(-1, t.shape[-2], h)
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t


def _launch_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 out_dtype: torch.dtype) -> torch.Tensor:
    check_device(x)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    h = x.shape[-1]
    n_rows = x.numel() // h if h else 0
    if n_rows == 0 or h == 0:
        return out
    x3 = _rows3(x)
    o3 = out.view(x3.shape)
    r3 = _rows3(residual) if residual is not None else x3
    w = weight.contiguous()
    cfg = norm_config(h)
    grid = (triton.cdiv(n_rows, cfg["BLOCK_R"]),)
    _rms_norm_kernel[grid](
        x3, r3, w, o3, n_rows, x3.shape[1], h, eps,
        x3.stride(0), x3.stride(1), r3.stride(0), r3.stride(1), o3.stride(0), o3.stride(1),
        HAS_RESIDUAL=residual is not None, **cfg,
    )
    if residual is not None and not _is_view_of(r3, residual):
        residual.copy_(r3.view(residual.shape))  # residual had no [R0, R1, H] view: write back
    return out


def _is_view_of(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and a.data_ptr() == b.data_ptr()


def _rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch_norm(x, None, weight, eps, x.dtype)


def _add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    if x.shape != residual.shape:
        raise ValueError(f"add_rms_norm: x {tuple(x.shape)} and residual {tuple(residual.shape)} differ")
    return _launch_norm(x, residual, weight, eps, residual.dtype)


rms_norm = kernel_op("rms_norm", _rms_norm_triton, rms_norm_ref, lambda x, *_: torch.empty_like(x))


add_rms_norm = kernel_op("add_rms_norm", _add_rms_norm_triton, add_rms_norm_ref, lambda x, *_: torch.empty_like(x),
                         mutates_args=("residual",))
