"""Gated activations over the concatenated [gate | up] halves of one tensor."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenfab.kernels._dispatch import use_triton


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2*I] -> silu(x[..., :I]) * x[..., I:]."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def gelu_and_mul_ref(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """x: [..., 2*I] -> gelu(x[..., :I]) * x[..., I:]; approximate is "none" or "tanh"."""
    d = x.shape[-1] // 2
    return F.gelu(x[..., :d], approximate=approximate) * x[..., d:]


def _silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    raise NotImplementedError("Triton silu_and_mul not written yet")


def _gelu_and_mul_triton(x: torch.Tensor, approximate: str) -> torch.Tensor:
    raise NotImplementedError("Triton gelu_and_mul not written yet")


@torch.library.custom_op("tokenfab::silu_and_mul", mutates_args=())
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if use_triton(x):
        return _silu_and_mul_triton(x)
    return silu_and_mul_ref(x)


@silu_and_mul.register_fake
def _(x):
    return x.new_empty(*x.shape[:-1], x.shape[-1] // 2)


@torch.library.custom_op("tokenfab::gelu_and_mul", mutates_args=())
def gelu_and_mul(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    if use_triton(x):
        return _gelu_and_mul_triton(x, approximate)
    return gelu_and_mul_ref(x, approximate)


@gelu_and_mul.register_fake
def _(x, approximate="none"):
    return x.new_empty(*x.shape[:-1], x.shape[-1] // 2)
