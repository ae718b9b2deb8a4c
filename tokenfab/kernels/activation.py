"""Gated activations over the concatenated [gate | up] halves of one tensor."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# isort: off
# _launch picks Triton's interpreter on machines without a GPU; it must run before triton loads
from tokenfab.kernels._launch import check_device, next_pow2
import triton
import triton.language as tl
# isort: on

from tokenfab.kernels._dispatch import kernel_op


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2*I] -> silu(x[..., :I]) * x[..., I:]."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def gelu_and_mul_ref(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """x: [..., 2*I] -> gelu(x[..., :I]) * x[..., I:]; approximate is "none" or "tanh"."""
    d = x.shape[-1] // 2
    return F.gelu(x[..., :d], approximate=approximate) * x[..., d:]


@triton.jit
def _act_and_mul_kernel(
    x_ptr, o_ptr, inter, sxr, sor,
    ACT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program (row, column block): o = act(gate) * up with gate = x[:inter], up = x[inter:].

    ACT: 0 silu, 1 exact gelu (erf), 2 tanh-approximated gelu. The activation is rounded to
    the output dtype before the product, as the eager reference does.
    """
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < inter
    g = tl.load(x_ptr + row * sxr + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * sxr + inter + cols, mask=m, other=0.0)
    if ACT == 0:
        a = g / (1.0 + tl.exp(-g))
    elif ACT == 1:
        a = 0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476))
    else:
        y = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        a = 0.5 * g * (2.0 - 2.0 / (tl.exp(tl.minimum(2.0 * y, 80.0)) + 1.0))  # 1 + tanh(y)
    a = a.to(o_ptr.dtype.element_ty).to(tl.float32)
    o = a * u.to(tl.float32)
    tl.store(o_ptr + row * sor + cols, o.to(o_ptr.dtype.element_ty), mask=m)


def act_config(inter: int) -> dict:
    """Launch configuration (also used by the compile test)."""
    block = min(next_pow2(inter), 1024)
    return dict(BLOCK=block, num_warps=4 if block >= 512 else 1)


def _act_and_mul(x: torch.Tensor, act: int) -> torch.Tensor:
    check_device(x)
    two_i = x.shape[-1]
    if two_i % 2:
        raise ValueError(f"gated activation needs an even last dim, got {two_i}")
    inter = two_i // 2
    out = torch.empty(*x.shape[:-1], inter, dtype=x.dtype, device=x.device)
    rows = x.numel() // two_i if two_i else 0
    if rows == 0 or inter == 0:
        return out
    x2 = x.reshape(rows, two_i)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    o2 = out.view(rows, inter)
    cfg = act_config(inter)
    grid = (rows, triton.cdiv(inter, cfg["BLOCK"]))
    _act_and_mul_kernel[grid](x2, o2, inter, x2.stride(0), o2.stride(0), ACT=act, **cfg)
    return out


def _silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    return _act_and_mul(x, 0)


def _gelu_and_mul_triton(x: torch.Tensor, approximate: str) -> torch.Tensor:
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu approximate must be 'none' or 'tanh', not {approximate!r}")
    return _act_and_mul(x, 1 if approximate == "none" else 2)


def _gated_fake(x: torch.Tensor, *_) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], x.shape[-1] // 2)


silu_and_mul = kernel_op("silu_and_mul", _silu_and_mul_triton, silu_and_mul_ref, _gated_fake)


gelu_and_mul = kernel_op("gelu_and_mul", _gelu_and_mul_triton, gelu_and_mul_ref, _gated_fake)
