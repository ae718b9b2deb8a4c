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
