"""Train tests: without a GPU, Triton kernels run in the interpreter, which triton picks when it is
first imported, so TRITON_INTERPRET=1 is set here before any test imports tokenfab.kernels
(TOKENFAB_KERNELS=triton tests need it; the default dispatch on CPU uses the torch paths anyway)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from tokenfab.kernels._launch import interpreting, patch_interpreter_bf16

    if interpreting():
        patch_interpreter_bf16()
