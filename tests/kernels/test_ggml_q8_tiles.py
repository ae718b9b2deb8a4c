"""The int8-activation matmul's two native kernels (``kernels/cpu/ggml_q8.c``): row tiles for few
activation rows, and the many-row register tiles of ``ggml_q8_tile.h`` (AVX-512 + VNNI builds).

Every path forms each block term and adds it in block order in float32 (ggml_q8.c, top), so:
- a row's result is the same whatever M is (1..300, across the switch between the two kernels and
  every tail of their tiles) and whichever kernel ran it;
- both kernels equal the torch reference bit for bit, at odd N (tails of the 32-row panels and of
  the 8-row groups) and odd K / 32 (partial groups of 8 blocks);
- the reference is the float64 product within the float32 summation bound of its block terms.
"""

from __future__ import annotations

import pytest
import torch

from tokenfab.kernels.cpu import ggml_matmul as gm
from tokenfab.kernels.cpu import native_library

QTYPES = ("Q8_0", "Q4_0", "Q4_1")
needs_native = pytest.mark.skipif(native_library() is None, reason="no C compiler: the native kernel is not built")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


class _TileRows:
    """Set the library's many-row threshold for a block of code (restored after)."""

    def __init__(self, rows: int) -> None:
        self.lib, self.rows = native_library(), rows

    def __enter__(self) -> None:
        self.saved = int(self.lib.ggml_q8_tile_min_rows())
        self.lib.ggml_q8_set_tile_min_rows(self.rows)

    def __exit__(self, *exc: object) -> None:
        if self.saved:
            self.lib.ggml_q8_set_tile_min_rows(self.saved)


@needs_native
@pytest.mark.parametrize("qtype", QTYPES)
def test_q8_rows_do_not_depend_on_m(qtype):
    """Rows of X[:M] @ W for every M in 1..300 equal the rows of the M = 300 product (and of the
    reference): K = 288 (9 blocks: a partial group), N = 45 (a partial panel and 8-row group)."""
    k, n = 288, 45
    x, w = gm.random_q8_case(300, n, k, qtype, seed=3)
    full = gm.ggml_matmul(x, w, qtype, k, act="q8")
    assert torch.equal(_bits(full), _bits(gm.ggml_matmul_reference(x, w, qtype, k, act="q8")))
    for m in range(1, 300):
        got = gm.ggml_matmul(x[:m], w, qtype, k, act="q8")
        assert torch.equal(_bits(got), _bits(full[:m])), (qtype, m)


@needs_native
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("n", [1, 7, 8, 15, 16, 17, 31, 32, 33, 65])
def test_q8_both_kernels_equal_the_reference(qtype, n):
    """The same product through the row tiles (threshold above M) and through the many-row tiles
    (threshold 1), at M in {1, 3, 4, 5, 9, 37}, K in {32, 96, 576, 1568}: all bit for bit the reference."""
    lib = native_library()
    for i, k in enumerate((32, 96, 576, 1568)):
        for m in (1, 3, 4, 5, 9, 37):
            x, w = gm.random_q8_case(m, n, k, qtype, seed=100 * i + m + n)
            ref = gm.ggml_matmul_reference(x, w, qtype, k, act="q8")
            with _TileRows(1 << 30):
                rows = gm.ggml_matmul(x, w, qtype, k, act="q8")
            assert torch.equal(_bits(rows), _bits(ref)), ("row tiles", qtype, m, n, k)
            if int(lib.ggml_q8_tile_min_rows()):
                with _TileRows(1):
                    tiles = gm.ggml_matmul(x, w, qtype, k, act="q8")
                assert torch.equal(_bits(tiles), _bits(ref)), ("many-row tiles", qtype, m, n, k)


@needs_native
def test_q8_tile_kernel_is_built_where_the_cpu_has_avx512_vnni():
    """The many-row tiles exist exactly in AVX-512 + AVX512-VNNI builds (else 0: the row tiles run)."""
    info = gm.ggml_kernel_info()
    built = int(native_library().ggml_q8_tile_min_rows())
    assert info["q8_tile_min_rows"] == built
    if info["isa"] == "avx512" and info["vnni"]:
        assert built >= 1
    else:
        assert built == 0


@pytest.mark.parametrize("qtype", QTYPES)
def test_q8_reference_is_the_float64_product(qtype):
    """The q8 reference is the float64 product of the quantize-dequantized activations with the
    dequantized weights within the float32 bound of its order: each block term two or four
    roundings, then nb sequential additions, against the sum of the terms' magnitudes."""
    k, m, n = 288, 9, 23
    x, w = gm.random_q8_case(m, n, k, qtype, seed=7)
    q, d = gm.quantize_act_q8(x)
    xq = (q.double().reshape(m, -1, 32) * d.double()[..., None]).reshape(m, k)
    exact = xq @ gm.dequantize(w, qtype, k).double().T
    got = gm.ggml_matmul_reference(x, w, qtype, k, act="q8").double()
    qw, dw, mw = gm._unpack(w, qtype, k)
    qb = q.double().reshape(m, -1, 32).transpose(0, 1)  # [nb, m, 32]
    terms = (torch.bmm(qb, qw) * dw.double()[:, None, :] * d.double().T[:, :, None]).abs().sum(0)
    if mw is not None:
        terms = terms + (
            mw.double()[:, None, :] * (d.double() * q.double().reshape(m, -1, 32).sum(-1)).T[:, :, None]
        ).abs().sum(0)
    nb = k // 32
    assert bool(((got - exact).abs() <= (nb + 4) * 2.0**-24 * terms + 1e-30).all())
