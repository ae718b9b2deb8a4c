"""silu_and_mul / gelu_and_mul: Triton vs reference."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.tolerances import assert_close
from tokenfab.kernels import activation

SHAPES = [(1, 2), (5, 128), (3, 4, 6), (2, 3000), (0, 8)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh"])
def test_gated_activation(act, shape, dtype, gen, device):
    x = (torch.randn(shape, generator=gen) * 4).to(dtype).to(device)
    if act == "silu":
        out, ref = activation._silu_and_mul_triton(x), activation.silu_and_mul_ref(x)
    else:
        approx = "tanh" if act == "gelu_tanh" else "none"
        out, ref = activation._gelu_and_mul_triton(x, approx), activation.gelu_and_mul_ref(x, approx)
    assert_close(out, ref)


def test_strided_rows(gen, device):
    big = torch.randn(6, 100, generator=gen).to(device)
    x = big[:, :64]  # rows with a stride, last dim contiguous
    assert_close(activation._silu_and_mul_triton(x), activation.silu_and_mul_ref(x))


def test_custom_ops_dispatch_to_triton(monkeypatch, gen, device):
    monkeypatch.setenv("TOKENFAB_KERNELS", "triton")
    x = torch.randn(3, 40, generator=gen).to(device)
    assert_close(torch.ops.tokenfab.silu_and_mul(x), activation.silu_and_mul_ref(x))
    assert_close(torch.ops.tokenfab.gelu_and_mul(x, "tanh"), activation.gelu_and_mul_ref(x, "tanh"))
