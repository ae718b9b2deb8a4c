"""RMSNorm and fused residual-add + RMSNorm."""

from __future__ import annotations

import torch

from tokenfab.kernels._dispatch import use_triton


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


def _rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    raise NotImplementedError("Triton rms_norm not written yet")


def _add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    raise NotImplementedError("Triton add_rms_norm not written yet")


@torch.library.custom_op("tokenfab::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if use_triton(x):
        return _rms_norm_triton(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


@rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


@torch.library.custom_op("tokenfab::add_rms_norm", mutates_args=("residual",))
def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    if use_triton(x):
        return _add_rms_norm_triton(x, residual, weight, eps)
    return add_rms_norm_ref(x, residual, weight, eps)


@add_rms_norm.register_fake
def _(x, residual, weight, eps):
    return torch.empty_like(x)
