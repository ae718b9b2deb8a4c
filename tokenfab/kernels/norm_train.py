"""RMSNorm for training: Triton forward and backward, with the residual add fused in (Liger-Kernel's
algorithm; issue 18).

``rms_norm_train(x, weight, eps, residual=None, offset=0.0)`` returns ``y`` or, with a residual,
``(y, residual_sum)`` where ``residual_sum = x + residual`` (rounded to the promoted dtype of the two,
as the HF decoder layer's ``residual + hidden_states``; under autocast a bf16 sublayer output meets an
fp32 residual stream) and ``y = norm(residual_sum)``. Numerics follow the Hugging Face modules
("input dtype" below: residual_sum's):

- ``offset == 0`` (Llama casting, ``LlamaRMSNorm``): ``weight * (s * rstd).to(input dtype)``, the
  normalised value rounded to the input dtype before the weight multiply, output in the promoted
  dtype of input and weight;
- ``offset != 0`` (Gemma casting, ``GemmaRMSNorm``'s ``1 + w``): ``(s * rstd * (offset + w))`` all in
  fp32, cast once to the input dtype.

rstd = 1 / sqrt(mean(s^2) + eps) is computed in fp32 and kept for the backward (one float a row).
With xh = s * rstd and g = dy * (offset + w) (fp32), the backward is
    ds = rstd * (g - xh * mean(g * xh))  (+ the upstream gradient of residual_sum)
    dw = sum over rows of dy * xh         (xh rounded as in the forward)
and x and residual get the same gradient ``ds``. dw is reduced across row blocks as Liger does:
each program sums its rows into an fp32 partial ``[programs, H]``, then one ``sum(0)``.

Paths: ``_rms_norm_train_*_triton`` (CUDA, or ``TOKENFAB_KERNELS=triton``: the interpreter on CPU)
and ``_rms_norm_train_*_torch`` (the same formulas in torch: CPU default and ``TOKENFAB_KERNELS=
torch``; also rows longer than ``MAX_HIDDEN``), chosen inside the registered custom ops
``tokenfab::rms_norm_train_fwd`` / ``_bwd`` that the ``autograd.Function`` calls (so it traces under
``torch.compile``). ``rms_norm_train_ref`` is the autograd oracle (the HF module's operations).
"""

from __future__ import annotations

import torch

# isort: off
# _launch picks Triton's interpreter on machines without a GPU; it must run before triton loads
from tokenfab.kernels._launch import check_device, next_pow2, num_sms
import triton
import triton.language as tl
# isort: on

from tokenfab.kernels._dispatch import use_triton

MAX_HIDDEN = 16384  # a whole row in one block; longer rows take the torch path


def rms_norm_train_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                       offset: float = 0.0):
    """The oracle, differentiable by autograd: HF ``LlamaRMSNorm`` (offset 0) / ``GemmaRMSNorm``."""
    s = x if residual is None else x + residual
    sf = s.float()
    xh = sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + eps)
    if offset == 0.0:
        y = weight * xh.to(s.dtype)
    else:
        y = (xh * (offset + weight.float())).to(s.dtype)
    return y if residual is None else (y, s)


def _sum_dtype(x: torch.Tensor, residual: torch.Tensor | None) -> torch.dtype:
    """The dtype of x + residual (promoted: under autocast a bf16 sublayer output meets an fp32 stream)."""
    return x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)


def _out_dtype(s_dtype: torch.dtype, weight: torch.Tensor, offset: float) -> torch.dtype:
    return torch.promote_types(s_dtype, weight.dtype) if offset == 0.0 else s_dtype


# ----------------------------------------------------------------------------- Triton kernels


@triton.jit
def _rms_norm_train_fwd_kernel(
    x_ptr, r_ptr, w_ptr, y_ptr, s_ptr, rstd_ptr,
    n_rows, H, eps, offset,
    HAS_RESIDUAL: tl.constexpr,
    LLAMA_CAST: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Program p: rows p*BLOCK_R.. of a contiguous [n_rows, H]; writes y, rstd (and s = x + r)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_H)
    row_ok = rows < n_rows
    m = row_ok[:, None] & (cols < H)[None, :]
    offs = rows.to(tl.int64)[:, None] * H + cols[None, :]
    s = tl.load(x_ptr + offs, mask=m, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + offs, mask=m, other=0.0)
        s = (s.to(tl.float32) + r.to(tl.float32)).to(s_ptr.dtype.element_ty)
        tl.store(s_ptr + offs, s, mask=m)
    sf = s.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(sf * sf, axis=1) / H + eps)
    tl.store(rstd_ptr + rows, rstd, mask=row_ok)
    w = tl.load(w_ptr + cols, mask=cols < H, other=0.0).to(tl.float32) + offset
    xh = sf * rstd[:, None]
    if LLAMA_CAST:
        xh = xh.to(s_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptr + offs, (xh * w[None, :]).to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _rms_norm_train_bwd_kernel(
    dy_ptr, ds_ptr, s_ptr, w_ptr, rstd_ptr, dx_ptr, dw_ptr,
    n_rows, H, rows_per_program, offset,
    HAS_DS: tl.constexpr,
    LLAMA_CAST: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Program p: rows [p*rows_per_program, ...); dx per row, dw summed into dw[p, :].

    Short rows (BLOCK_R > 1, e.g. a QK-norm's head dim) go BLOCK_R at a time as a 2D tile; long rows
    one at a time as 1D vectors (the 2D form spills at 16384 in 32 warps, the 1D one does not). The
    weight is re-read each step (from cache): one row-long array fewer held in registers.
    """
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    cm = cols < H
    dw = tl.zeros((BLOCK_H,), dtype=tl.float32)
    row_start = pid.to(tl.int64) * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    if BLOCK_R == 1:
        for i in range(0, row_end - row_start):
            row = row_start + i
            off = row * H + cols
            sf = tl.load(s_ptr + off, mask=cm, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + off, mask=cm, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + row)
            xh = sf * rstd
            if LLAMA_CAST:
                dw += dy * xh.to(s_ptr.dtype.element_ty).to(tl.float32)
            else:
                dw += dy * xh
            g = dy * (tl.load(w_ptr + cols, mask=cm, other=0.0).to(tl.float32) + offset)
            dx = rstd * (g - xh * (tl.sum(g * xh, axis=0) / H))
            if HAS_DS:
                dx += tl.load(ds_ptr + off, mask=cm, other=0.0).to(tl.float32)
            tl.store(dx_ptr + off, dx.to(dx_ptr.dtype.element_ty), mask=cm)
    else:
        for r0 in range(0, row_end - row_start, BLOCK_R):
            rows = row_start + r0 + tl.arange(0, BLOCK_R)
            rm = rows < row_end
            m = rm[:, None] & cm[None, :]
            off = rows[:, None] * H + cols[None, :]
            sf = tl.load(s_ptr + off, mask=m, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + off, mask=m, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + rows, mask=rm, other=0.0)
            xh = sf * rstd[:, None]
            if LLAMA_CAST:
                dw += tl.sum(dy * xh.to(s_ptr.dtype.element_ty).to(tl.float32), axis=0)
            else:
                dw += tl.sum(dy * xh, axis=0)
            g = dy * (tl.load(w_ptr + cols, mask=cm, other=0.0).to(tl.float32) + offset)[None, :]
            dx = rstd[:, None] * (g - xh * (tl.sum(g * xh, axis=1) / H)[:, None])
            if HAS_DS:
                dx += tl.load(ds_ptr + off, mask=m, other=0.0).to(tl.float32)
            tl.store(dx_ptr + off, dx.to(dx_ptr.dtype.element_ty), mask=m)
    tl.store(dw_ptr + pid.to(tl.int64) * H + cols, dw, mask=cm)


def _warps(block: int) -> int:
    """Liger's rule of thumb for a row of ``block`` elements."""
    return 32 if block >= 32768 else 16 if block >= 8192 else 8 if block >= 2048 else 4


def fwd_config(hidden: int) -> dict:
    block_h = next_pow2(hidden)
    block_r = max(1, min(16, 2048 // block_h))
    return dict(BLOCK_R=block_r, BLOCK_H=block_h, num_warps=_warps(block_r * block_h))


def bwd_config(hidden: int) -> dict:
    block_h = next_pow2(hidden)
    block_r = max(1, min(16, 2048 // block_h))
    # twice the forward's warps for a tile: no spills at 16384
    return dict(BLOCK_R=block_r, BLOCK_H=block_h, num_warps=_warps(2 * block_r * block_h))


def bwd_programs(device: torch.device, hidden: int) -> int:
    """Programs of the backward: a few per multiprocessor for short rows (each holds one dw partial)."""
    return num_sms(device) * (4 if hidden <= 1024 else 2 if hidden <= 4096 else 1)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1]).contiguous()


def _rms_norm_train_fwd_triton(x, weight, residual, eps, offset):
    check_device(x)
    h = x.shape[-1]
    x2 = _rows(x)
    n = x2.shape[0]
    sdt = _sum_dtype(x, residual)
    y = torch.empty(x.shape, dtype=_out_dtype(sdt, weight, offset), device=x.device)
    s = torch.empty(x.shape, dtype=sdt, device=x.device) if residual is not None else x.new_empty(0)
    rstd = torch.empty(n, dtype=torch.float32, device=x.device)
    if n == 0 or h == 0:
        return y, s, rstd
    r2 = _rows(residual) if residual is not None else x2
    cfg = fwd_config(h)
    _rms_norm_train_fwd_kernel[(triton.cdiv(n, cfg["BLOCK_R"]),)](
        x2, r2, weight.contiguous(), y, s if residual is not None else x2, rstd, n, h, eps, offset,
        HAS_RESIDUAL=residual is not None, LLAMA_CAST=offset == 0.0, **cfg,
    )
    return y, s, rstd


def _rms_norm_train_bwd_triton(dy, ds, s, weight, rstd, offset):
    check_device(dy)
    h = s.shape[-1]
    s2 = _rows(s)
    n = s2.shape[0]
    dx = torch.empty(s.shape, dtype=s.dtype, device=s.device)
    if n == 0 or h == 0:
        return dx, torch.zeros_like(weight)
    programs = min(bwd_programs(s.device, h), n)
    per = triton.cdiv(n, programs)
    programs = triton.cdiv(n, per)
    dw = torch.empty(programs, h, dtype=torch.float32, device=s.device)
    dy2 = _rows(dy)
    _rms_norm_train_bwd_kernel[(programs,)](
        dy2, _rows(ds) if ds is not None else dy2, s2, weight.contiguous(), rstd, dx, dw, n, h, per, offset,
        HAS_DS=ds is not None, LLAMA_CAST=offset == 0.0, **bwd_config(h),
    )
    return dx, dw.sum(0).to(weight.dtype)


# ----------------------------------------------------------------------------- torch twins


def _rms_norm_train_fwd_torch(x, weight, residual, eps, offset):
    s = x if residual is None else x + residual
    sf = s.float()
    rstd = torch.rsqrt(sf.pow(2).mean(-1) + eps)
    xh = sf * rstd[..., None]
    if offset == 0.0:
        y = (xh.to(s.dtype).float() * weight.float()).to(_out_dtype(s.dtype, weight, offset))
    else:
        y = (xh * (offset + weight.float())).to(s.dtype)
    return y, (s if residual is not None else x.new_empty(0)), rstd.reshape(-1)


def _rms_norm_train_bwd_torch(dy, ds, s, weight, rstd, offset):
    h = s.shape[-1]
    sf = s.reshape(-1, h).float()
    dyf = dy.reshape(-1, h).float()
    xh = sf * rstd[:, None]
    g = dyf * (weight.float() + offset)
    dx = rstd[:, None] * (g - xh * ((g * xh).sum(-1, keepdim=True) / h))
    if ds is not None:
        dx = dx + ds.reshape(-1, h).float()
    xw = xh.to(s.dtype).float() if offset == 0.0 else xh
    dw = (dyf * xw).sum(0)
    return dx.to(s.dtype).reshape(s.shape), dw.to(weight.dtype)


def _triton_fits(t: torch.Tensor) -> bool:
    return use_triton(t) and t.shape[-1] <= MAX_HIDDEN


# ----------------------------------------------------------------------------- custom ops + autograd


@torch.library.custom_op("tokenfab::rms_norm_train_fwd", mutates_args=())
def rms_norm_train_fwd(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None, eps: float,
                       offset: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, residual_sum or an empty tensor, rstd [rows] fp32)."""
    impl = _rms_norm_train_fwd_triton if _triton_fits(x) else _rms_norm_train_fwd_torch
    return impl(x, weight, residual, eps, offset)


@rms_norm_train_fwd.register_fake
def _(x, weight, residual, eps, offset):
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    sdt = _sum_dtype(x, residual)
    s = x.new_empty(x.shape, dtype=sdt) if residual is not None else x.new_empty(0)
    y = x.new_empty(x.shape, dtype=_out_dtype(sdt, weight, offset))
    return y, s, x.new_empty(rows, dtype=torch.float32)


@torch.library.custom_op("tokenfab::rms_norm_train_bwd", mutates_args=())
def rms_norm_train_bwd(dy: torch.Tensor, ds: torch.Tensor | None, s: torch.Tensor, weight: torch.Tensor,
                       rstd: torch.Tensor, offset: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(d residual_sum including ``ds``, d weight); ``s`` is the normalised input (x or x + residual)."""
    impl = _rms_norm_train_bwd_triton if _triton_fits(s) else _rms_norm_train_bwd_torch
    return impl(dy, ds, s, weight, rstd, offset)


@rms_norm_train_bwd.register_fake
def _(dy, ds, s, weight, rstd, offset):
    return torch.empty_like(s), torch.empty_like(weight)


class RMSNormTrainFunction(torch.autograd.Function):
    """Saves the normalised input and rstd; the backward is one kernel plus the dw partial sum."""

    @staticmethod
    def forward(ctx, x, weight, residual, eps, offset):
        y, s, rstd = torch.ops.tokenfab.rms_norm_train_fwd(x, weight, residual, eps, offset)
        has_res = residual is not None
        ctx.save_for_backward(s if has_res else x, weight, rstd)
        ctx.has_residual = has_res
        ctx.offset = offset
        ctx.dtypes = (x.dtype, residual.dtype if has_res else None)
        if has_res:
            return y, s
        return y

    @staticmethod
    def backward(ctx, dy, *rest):
        s, weight, rstd = ctx.saved_tensors
        ds = rest[0] if ctx.has_residual else None
        if dy is None:
            dy = torch.zeros(s.shape, dtype=_out_dtype(s.dtype, weight, ctx.offset), device=s.device)
        ds_total, dw = torch.ops.tokenfab.rms_norm_train_bwd(dy, ds, s, weight, rstd, ctx.offset)
        x_dtype, r_dtype = ctx.dtypes
        dres = ds_total.to(r_dtype) if ctx.has_residual else None
        return ds_total.to(x_dtype), (dw if ctx.needs_input_grad[1] else None), dres, None, None


def rms_norm_train(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                   offset: float = 0.0):
    """RMSNorm over the last dim with gradients for x, weight (and residual); see the module doc."""
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"rms_norm_train: weight {tuple(weight.shape)} does not match hidden {x.shape[-1]}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"rms_norm_train: residual {tuple(residual.shape)} must match x "
                         f"{tuple(x.shape)}")
    return RMSNormTrainFunction.apply(x, weight, residual, float(eps), float(offset))
