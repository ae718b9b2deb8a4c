"""The native CPU FP8 kernel (kernels/cpu/fp8_matmul.c) against the reference: every e4m3 code decodes
exactly, and products equal dequantize-then-matmul up to float32 summation order."""

from __future__ import annotations

import pytest
import torch

from tokenfab.kernels import quant
from tokenfab.kernels.cpu import native_library
from tokenfab.kernels.cpu.fp8_matmul import GEMV_MAX_ROWS, fp8_dequant_native, fp8_linear_native

pytestmark = pytest.mark.skipif(native_library() is None, reason="no C compiler: the native kernels do not build")
FP8 = torch.float8_e4m3fn


def test_every_code_decodes_exactly():
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F].view(FP8)  # all but the two NaNs: normals, subnormals, +-0
    got = fp8_dequant_native(codes.view(1, -1), torch.ones(1, 1), 128)
    assert torch.equal(got[0], codes.float())


@pytest.mark.parametrize("m", [0, 1, 5, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1, 40])
@pytest.mark.parametrize("n,k,group_n", [(150, 200, 128), (130, 300, 1), (64, 96, 128), (257, 129, 128)])
def test_matches_reference(m, n, k, group_n):
    g = torch.Generator().manual_seed(m * 1000 + n)
    w = (torch.randn(n, k, generator=g) * 50).clamp(-448, 448).to(FP8)
    s = torch.rand(-(-n // 128) if group_n == 128 else n, -(-k // 128), generator=g) * 0.01
    x, b = torch.randn(2, max(m, 1), k, generator=g)[:, :m], torch.randn(n, generator=g)
    ref = torch.nn.functional.linear(x, quant.dequantize_fp8(w, s, group_n, torch.float32), b)
    got = fp8_linear_native(x, w, s, group_n, b)
    assert got.shape == ref.shape == (2, m, n)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    # one scale column (per-channel scales [N, 1]) read with a zero K stride
    s1 = s[:, :1].contiguous()
    torch.testing.assert_close(fp8_linear_native(x, w, s1, group_n, None),
                               torch.nn.functional.linear(x, quant.dequantize_fp8(w, s1, group_n, torch.float32)),
                               rtol=1e-5, atol=1e-5)


def test_declines_what_it_does_not_take():
    w = torch.zeros(4, 8, dtype=FP8)
    assert fp8_linear_native(torch.zeros(2, 8, dtype=torch.bfloat16), w, torch.ones(1, 1), 128, None) is None
    assert fp8_linear_native(torch.zeros(2, 8), w.float(), torch.ones(1, 1), 128, None) is None
