"""Edge cases of the float32-activation GGML tiles (``ggml_f32_gemv.h``, ``ggml_f32_panel.h``): every
output is one accumulator summed in one order (``ggml_f32_vec.h``), so the GEMV tiles (GR weight rows x
up to 4 activation rows) and the panel's register tiles (4 x 6 on AVX-512, 3 x 4 on AVX2) must give the
same bits wherever a row or column falls: M and N that are not multiples of any tile, a weight-row count
that leaves a partial panel (24 rows on AVX-512), rows longer than a scale chunk (64 blocks in the GEMV
tiles, 256 in the panel), and float32 weights (``matmul_f32_rowinv``) whose K is not a multiple of the
vector width (a zero-padded last slice)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_ggml_matmul import QTYPES, _oracle, _weights, _x
from tests.kernels.tolerances import assert_close
from tokenfab.kernels.cpu import crossover, native_library
from tokenfab.kernels.cpu import ggml_matmul as gm
from tokenfab.kernels.cpu.matmul_f32 import matmul_f32_rowinv

lib = native_library()
pytestmark = pytest.mark.skipif(lib is None, reason="no C compiler: the native kernels are not built")


@pytest.fixture
def restore_setting():
    before = int(lib.ggml_panel_min_rows())
    yield
    lib.ggml_set_panel_min_rows(before)


def _kernel(x, packed, qtype, k, min_rows):
    lib.ggml_set_panel_min_rows(min_rows)
    return gm.ggml_matmul(x, packed, qtype, k)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize(
    "n,k", [(1, 32), (5, 64), (7, 96), (23, 576), (25, 576), (49, 1536), (11, 32 * 65), (13, 32 * 257)]
)
def test_gemv_and_panel_tiles_equal_bitwise(qtype, n, k, restore_setting):
    """Each row alone through the GEMV tiles equals that row of any M through the panel, for M tails 1..13
    (partial 4-row tiles), N tails of every tile width, and K across the scale chunks."""
    packed, deq = _weights(qtype, n, k)
    x = _x(13, k, seed=n)
    full = _kernel(x, packed, qtype, k, 1)  # the panel
    assert_close(full, _oracle(x, deq, "f32"))
    for i in range(13):
        assert torch.equal(_kernel(x[i : i + 1], packed, qtype, k, crossover.NEVER), full[i : i + 1]), i
    for m in (2, 3, 4, 5, 6, 7, 9):
        assert torch.equal(_kernel(x[:m], packed, qtype, k, crossover.NEVER), full[:m]), m  # GEMV tiles
        assert torch.equal(_kernel(x[13 - m :], packed, qtype, k, 1), full[13 - m :]), m  # panel tiles


@pytest.mark.parametrize("k", [1, 5, 15, 16, 17, 31, 33, 100, 577])
@pytest.mark.parametrize("n", [1, 6, 7, 25])
def test_rowinv_float32_tails(n, k):
    """Float32 weights of any K (a last partial slice, zero-padded): close to the float64 product, and
    every row of a 10-row product equal to the row alone and inside other row counts."""
    gen = torch.Generator().manual_seed(n * 1000 + k)
    x, w = torch.randn(10, k, generator=gen), torch.randn(n, k, generator=gen)
    full = matmul_f32_rowinv(x, w)
    assert_close(full, (x.double() @ w.double().T).float())
    for i in range(10):
        assert torch.equal(matmul_f32_rowinv(x[i : i + 1], w), full[i : i + 1]), i
    for m in (2, 3, 5, 7):
        assert torch.equal(matmul_f32_rowinv(x[10 - m :], w), full[10 - m :]), m


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("k", [576, 1536])
def test_panel_passes_over_many_rows_keep_the_bits(qtype, k, restore_setting):
    """Past a pass of activation rows (their x rows sized to stay in L2: 112 rows at K=576, 64 at
    K=1536 on AVX-512), the panel runs the rows in several passes: every row of a 3-pass product
    equals that row alone through the GEMV tiles, whatever tile a pass boundary cuts."""
    packed, deq = _weights(qtype, 29, k)
    m = {576: 231, 1536: 135}[k]  # 2 full passes and a ragged third (AVX2: 111 / 63-row passes)
    x = _x(m, k, seed=k)
    full = _kernel(x, packed, qtype, k, 1)
    assert_close(full, _oracle(x, deq, "f32"))
    for i in (0, 62, 63, 64, 65, 110, 111, 112, 113, m - 1):
        if i < m:
            assert torch.equal(_kernel(x[i : i + 1], packed, qtype, k, crossover.NEVER), full[i : i + 1]), i
    assert torch.equal(_kernel(x[1:], packed, qtype, k, 1), full[1:])  # the boundaries shifted by a row


def test_rowinv_float32_over_several_passes():
    gen = torch.Generator().manual_seed(7)
    x, w = torch.randn(300, 600, generator=gen), torch.randn(13, 600, generator=gen)
    full = matmul_f32_rowinv(x, w)
    assert_close(full, (x.double() @ w.double().T).float())
    for i in (0, 108, 109, 111, 112, 299):
        assert torch.equal(matmul_f32_rowinv(x[i : i + 1], w), full[i : i + 1]), i
