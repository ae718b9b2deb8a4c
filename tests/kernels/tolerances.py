"""Comparison tolerances per dtype, written once for every kernel test (ARCHITECTURE.md rule 2).

fp32: kernels compute in fp32 like the references; differences come from summation order and
the GPU's fast exp/log/sqrt (a few ulp), so 1e-5. bf16: inputs and outputs are bf16 (8
significant bits, eps 2^-7 = 7.8e-3); results may differ by a rounding or two of intermediate
bf16 values (attention's probabilities feed the PV product in bf16), so two eps.
"""

from __future__ import annotations

import torch

TOLERANCES: dict[torch.dtype, dict[str, float]] = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    """Compare with the tolerance of ``dtype`` (default: ``expected``'s dtype); NaN never passes."""
    tol = TOLERANCES[dtype or expected.dtype]
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    torch.testing.assert_close(actual.cpu().float(), expected.cpu().float(), equal_nan=False, **tol)


# ----------------------------------------------------------------------------- training kernels
# Training kernels (issue 18) compare values and every input's gradient with autograd on the
# reference (ARCHITECTURE.md rule 7), Liger-Kernel's tolerances as the model (its fused linear
# cross-entropy test: fp32 atol 1e-5 / rtol 5e-4, bf16 5e-3 / 5e-2). Gradients are sums over
# more terms than forward values (a vocabulary-long softmax, GEMMs over all tokens, accumulated
# chunk by chunk in another order), so fp32 allows 1e-4 relative; bf16 gradients may differ by a
# rounding of each chunk's partial sum, so two bf16 eps relative and 1e-3 absolute (gradients of
# mean losses are small numbers).
TRAIN_TOLERANCES: dict[torch.dtype, dict[str, float]] = {
    torch.float32: dict(atol=1e-5, rtol=1e-4),
    torch.bfloat16: dict(atol=1e-3, rtol=1.6e-2),
}


def assert_train_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    """Training-kernel values and gradients, with ``TRAIN_TOLERANCES`` of ``dtype`` (default: expected's)."""
    tol = TRAIN_TOLERANCES[dtype or expected.dtype]
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    torch.testing.assert_close(actual.cpu().float(), expected.cpu().float(), equal_nan=False, **tol)
