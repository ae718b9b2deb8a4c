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

# FP8 KV cache (issue 13): a kernel over an fp8 (e4m3) cache against the same attention over the
# bf16/fp32 cache the fp8 one was quantized from. e4m3 keeps 3 mantissa bits, so every cached value
# moves by up to 2^-4 of itself (round to nearest); logits and the averaged values move by a few
# percent of unit-scale data. One e4m3 step at 1 (2^-3) absolute and relative bounds that. (Against
# the reference on the dequantized cache, the kernels use TOLERANCES of the query dtype.)
FP8_KV_VS_UNQUANTIZED = dict(atol=0.125, rtol=0.125)


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


# Elementwise training kernels (issue 18: RMSNorm, RoPE, gated activations) compute in fp32 and round
# once; the reference runs the Hugging Face module's operations, which in bf16 round intermediate
# values (d(weight * x) in bf16, autograd's bf16 gradient sums). Where a gradient is a small
# difference or a sum of larger terms (RMSNorm's dx = rstd * (g - xh * mean(g * xh)), its dw summed
# over rows, dx + the residual's gradient), both sides carry rounding errors the size of a term,
# not of the result, so an element near zero can differ by more than an elementwise tolerance while
# the kernel is the more exact of the two. Liger's RMSNorm test allows atol 0.2 in bf16 for this; we
# scale instead: bf16 absolute tolerance = 2 eps (1.6e-2) times the RMS of the expected tensor (a
# gradient of typical size 1 is then allowed 1.6e-2 anywhere). fp32: the plain TRAIN_TOLERANCES plus
# 1e-5 times the RMS (fp32 sums of many terms).
TRAIN_SCALED_ATOL: dict[torch.dtype, float] = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}


def assert_train_close_scaled(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    """``assert_train_close`` with the absolute tolerance widened by TRAIN_SCALED_ATOL x RMS(expected)."""
    dtype = dtype or expected.dtype
    tol = dict(TRAIN_TOLERANCES[dtype])
    e = expected.detach().cpu().float()
    if e.numel():
        tol["atol"] += TRAIN_SCALED_ATOL[dtype] * float(e.pow(2).mean().sqrt())
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    torch.testing.assert_close(actual.detach().cpu().float(), e, equal_nan=False, **tol)
