"""Choosing between a kernel's Triton implementation and its PyTorch reference.

Rule (ARCHITECTURE.md, kernel rule 3): CUDA tensors run Triton; CPU tensors run the
reference, which is the fast CPU path. ``TOKENFAB_KERNELS=triton`` forces Triton (the
interpreter on CPU, with ``TRITON_INTERPRET=1``); ``TOKENFAB_KERNELS=torch`` forces the
reference everywhere.
"""

from __future__ import annotations

import os

import torch


def kernel_mode() -> str:
    mode = os.environ.get("TOKENFAB_KERNELS", "auto").lower()
    if mode not in ("auto", "triton", "torch"):
        raise ValueError(f"TOKENFAB_KERNELS must be auto, triton or torch, not {mode!r}")
    return mode


def use_triton(t: torch.Tensor) -> bool:
    """True when the op on tensor ``t`` should run its Triton kernel."""
    mode = kernel_mode()
    if mode == "triton":
        return True
    if mode == "torch":
        return False
    return t.is_cuda
