"""rms_norm / add_rms_norm: Triton vs reference."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.tolerances import assert_close
from tokenfab.kernels import norm

DTYPES = [torch.float32, torch.bfloat16]
SHAPES = [(1, 1), (5, 64), (3, 7, 128), (4, 576), (2, 3, 5, 48), (2, 16896)]  # last: chunked path


def _rand(shape, dtype, gen, device, scale=1.0):
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm(shape, dtype, gen, device):
    x = _rand(shape, dtype, gen, device, 3.0)
    w = _rand(shape[-1], torch.float32, gen, device)
    assert_close(norm._rms_norm_triton(x, w, 1e-6), norm.rms_norm_ref(x, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_add_rms_norm(shape, dtype, gen, device):
    x = _rand(shape, dtype, gen, device)
    res = _rand(shape, dtype, gen, device)
    w = _rand(shape[-1], dtype, gen, device)
    res_ref = res.clone()
    out = norm._add_rms_norm_triton(x, res, w, 1e-5)
    ref = norm.add_rms_norm_ref(x, res_ref, w, 1e-5)
    assert_close(out, ref)
    assert_close(res, res_ref)


def test_rms_norm_strided_heads(gen, device):
    """Per-head norm (QK-norm) of q sliced out of a fused qkv projection: no copy needed."""
    t, hq, hk, d = 6, 5, 1, 32
    qkv = _rand((t, (hq + 2 * hk) * d), torch.bfloat16, gen, device)
    q = qkv[:, : hq * d].view(t, hq, d)
    w = _rand(d, torch.bfloat16, gen, device)
    assert_close(norm._rms_norm_triton(q, w, 1e-6), norm.rms_norm_ref(q, w, 1e-6))


def test_add_rms_norm_residual_without_row_view(gen, device):
    """A residual whose last dim is strided still gets updated in place."""
    x = _rand((4, 24), torch.float32, gen, device)
    base = _rand((4, 48), torch.float32, gen, device)
    res = base[:, ::2]
    res_ref = res.clone()
    w = _rand(24, torch.float32, gen, device)
    out = norm._add_rms_norm_triton(x, res, w, 1e-6)
    assert_close(out, norm.add_rms_norm_ref(x, res_ref, w, 1e-6))
    assert_close(base[:, ::2], res_ref)


@pytest.mark.parametrize("op", ["rms_norm", "add_rms_norm"])
def test_empty(op, device):
    x = torch.empty(0, 64, device=device)
    w = torch.ones(64, device=device)
    if op == "rms_norm":
        assert norm._rms_norm_triton(x, w, 1e-6).shape == (0, 64)
    else:
        assert norm._add_rms_norm_triton(x, x.clone(), w, 1e-6).shape == (0, 64)


def test_custom_op_dispatches_to_triton(monkeypatch, gen, device):
    monkeypatch.setenv("TOKENFAB_KERNELS", "triton")
    x = _rand((3, 40), torch.float32, gen, device)
    res = _rand((3, 40), torch.float32, gen, device)
    w = _rand(40, torch.float32, gen, device)
    res_ref = res.clone()
    out = torch.ops.tokenfab.add_rms_norm(x, res, w, 1e-6)
    assert_close(out, norm.add_rms_norm_ref(x, res_ref, w, 1e-6))
    assert_close(res, res_ref)
    assert_close(torch.ops.tokenfab.rms_norm(x, w, 1e-6), norm.rms_norm_ref(x, w, 1e-6))
