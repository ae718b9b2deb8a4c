"""The launch helpers, and the interpreter's bf16 fixes that the kernel tests rely on."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from tokenfab.kernels._launch import interpreting, next_pow2


@triton.jit
def _cast_and_dot_kernel(x_ptr, a_ptr, b_ptr, y_ptr, c_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    x = tl.load(x_ptr + i)
    tl.store(y_ptr + i, x.to(tl.bfloat16))
    a = tl.load(a_ptr + i[:, None] * N + i[None, :])
    b = tl.load(b_ptr + i[:, None] * N + i[None, :])
    tl.store(c_ptr + i[:, None] * N + i[None, :], tl.dot(a, b))


def test_bf16_cast_rounds_and_dot_multiplies_values(device):
    n = 16
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=g).to(device)
    a = torch.randn(n, n, generator=g).bfloat16().to(device)
    b = torch.randn(n, n, generator=g).bfloat16().to(device)
    y = torch.empty(n, dtype=torch.bfloat16, device=device)
    c = torch.empty(n, n, device=device)
    _cast_and_dot_kernel[(1,)](x, a, b, y, c, N=n)
    assert torch.equal(y, x.bfloat16())  # round to nearest even, as torch and the GPU
    torch.testing.assert_close(c, a.float() @ b.float(), atol=1e-5, rtol=1e-5)


def test_interpreting_matches_device(device):
    assert interpreting() == (device.type == "cpu")


@pytest.mark.parametrize("n,expected", [(0, 1), (1, 1), (3, 4), (64, 64), (65, 128)])
def test_next_pow2(n, expected):
    assert next_pow2(n) == expected
