"""The int8-activation decode kernel over the row16 weight layout (``kernels/cpu/ggml_q8_decode.c``):
the weight repacked once at load, 16 rows interleaved per block, one VNNI lane per row.

- it equals the torch reference bit for bit (so every other q8 path) for Q8_0, Q4_0 and Q4_1, at
  every M up to 2 x its 4-row register tile plus a tail, at N below, at and past a 16-row panel
  (a zero-padded last panel), with zero and extreme blocks;
- GGMLLinear (act="q8") runs it below the many-row tiles' switch (at every M in a build without
  them), rebuilds the copy when its packed weight is replaced, and gives the same logits as the row path;
- the AVX2 build (x86-64-v3, no VNNI: vpmaddubsw, Q8_0 by sign) gives the same bits, in a subprocess;
- builds without AVX2 have no such kernel: the layer keeps the row path there (said by skip).
"""

from __future__ import annotations

import pytest
import torch

from tokenfab.kernels.cpu import ggml_matmul as gm
from tokenfab.kernels.cpu import native_library
from tokenfab.layers.ggml_linear import GGMLLinear

QTYPES = ("Q8_0", "Q4_0", "Q4_1")
LIB = native_library()
needs_row16 = pytest.mark.skipif(
    LIB is None or not LIB.ggml_q8_row16_built(),
    reason="this build has no row16 decode kernel (it needs AVX2); it runs the q8 row path for every M "
           "(tests/kernels/test_ggml_q8_tiles.py)" if LIB is not None else "no C compiler: no native kernels")


def _pack(w: torch.Tensor, qtype: str, k: int) -> torch.Tensor:
    n, qid = w.shape[0], gm._QTYPE_ID[qtype]
    out = torch.empty(LIB.ggml_q8_row16_bytes(n, k, qid), dtype=torch.uint8)
    LIB.ggml_q8_row16_pack(w.data_ptr(), n, k, qid, out.data_ptr())
    return out


def _row16(x: torch.Tensor, packed: torch.Tensor, n: int, k: int, qtype: str) -> torch.Tensor:
    out = torch.full((x.shape[0], n), float("nan"))
    rc = LIB.ggml_matmul_q8_row16(x.data_ptr(), packed.data_ptr(), x.shape[0], n, k, gm._QTYPE_ID[qtype],
                                  out.data_ptr())
    assert rc == 0
    return out


@needs_row16
def test_layout_costs_only_the_padding_of_a_last_panel():
    for qtype in QTYPES:
        bb = gm.BLOCK_BYTES[qtype]
        for n in (1, 16, 17, 50):
            padded = -(-n // 16) * 16
            assert LIB.ggml_q8_row16_bytes(n, 96, gm._QTYPE_ID[qtype]) == padded * 3 * bb


@needs_row16
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("m,n,k", [(1, 1, 32), (1, 16, 64), (2, 17, 96), (3, 50, 576), (4, 33, 160),
                                   (5, 48, 320), (9, 40, 1536), (1, 3072, 576)])
def test_row16_equals_the_reference_bit_for_bit(qtype, m, n, k):
    x, w = gm.random_q8_case(m, n, k, qtype, seed=m * 1000 + n + k)
    got = _row16(x, _pack(w, qtype, k), n, k, qtype)
    want = gm.ggml_matmul_reference(x, w, qtype, k, act="q8")
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@needs_row16
@pytest.mark.parametrize("qtype", QTYPES)
def test_row16_zero_and_extreme_blocks(qtype):
    k, n = 128, 20
    x, w = gm.random_q8_case(3, n, k, qtype, seed=7)
    x[0, :32] = 0.0                       # an all-zero activation block (d_x = 0)
    x[1, 32:64] = 3.0e4                   # a large one: q_x = 127 everywhere
    x[2, 64:96] = -1.0e-30                # a tiny one
    bb = gm.BLOCK_BYTES[qtype]
    w[3, :bb] = 0                         # a zero weight block (d_w = 0)
    w[5, bb:2 * bb] = 0xFF                # every byte set: q = 15 / -1, d and m = float16 NaN
    w[5, bb:bb + 2] = torch.tensor([0x00, 0x3C], dtype=torch.uint8)  # d = 1.0
    if qtype == "Q4_1":
        w[5, bb + 2:bb + 4] = torch.tensor([0x00, 0xBC], dtype=torch.uint8)  # m = -1.0
    got = _row16(x, _pack(w, qtype, k), n, k, qtype)
    want = gm.ggml_matmul_reference(x, w, qtype, k, act="q8")
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@needs_row16
@pytest.mark.parametrize("qtype", ("Q8_0", "Q4_1"))
def test_linear_runs_row16_below_the_tile_switch_and_rebuilds_it(qtype):
    k, n = 192, 40
    _, w = gm.random_q8_case(1, n, k, qtype, seed=3)
    lin = GGMLLinear(w, qtype, k, act="q8")
    below = int(LIB.ggml_q8_tile_min_rows()) or 6  # 0: a build without the tiles runs row16 at every M
    for m in range(1, below + 3):
        x = torch.randn(m, k)
        want = gm.ggml_matmul_reference(x, w, qtype, k, act="q8")
        assert torch.equal(lin(x).view(torch.int32), want.view(torch.int32)), m
    assert lin.row16 is not None and lin._row16_of is lin.qweight
    first = lin.row16
    _, w2 = gm.random_q8_case(1, n, k, qtype, seed=4)
    lin.qweight = w2                       # a new packed weight: the copy follows it
    x = torch.randn(1, k)
    assert torch.equal(lin(x), gm.ggml_matmul_reference(x, w2, qtype, k, act="q8"))
    assert lin.row16 is not first and lin._row16_of is w2


@needs_row16
def test_float32_activations_keep_no_row16_copy():
    _, w = gm.random_q8_case(1, 32, 64, "Q4_1", seed=1)
    lin = GGMLLinear(w, "Q4_1", 64, act="f32")
    lin(torch.randn(1, 64))
    assert lin.row16_weight() is None and lin.row16 is None


_AVX2_CHECK = """
import torch
from tokenfab.kernels.cpu import native_library
from tokenfab.kernels.cpu import ggml_matmul as gm
lib = native_library()
assert lib.ggml_q8_row16_built() == 1 and lib.ggml_q8_tile_min_rows() == 0
for qt in ("Q8_0", "Q4_0", "Q4_1"):
    for m, n, k in ((1, 37, 96), (4, 16, 32), (6, 50, 576)):
        x, w = gm.random_q8_case(m, n, k, qt, seed=m + n)
        p = torch.empty(lib.ggml_q8_row16_bytes(n, k, gm._QTYPE_ID[qt]), dtype=torch.uint8)
        lib.ggml_q8_row16_pack(w.data_ptr(), n, k, gm._QTYPE_ID[qt], p.data_ptr())
        out = torch.empty(m, n)
        assert lib.ggml_matmul_q8_row16(x.data_ptr(), p.data_ptr(), m, n, k, gm._QTYPE_ID[qt], out.data_ptr()) == 0
        ref = gm.ggml_matmul_reference(x, w, qt, k, act="q8")
        assert torch.equal(out.view(torch.int32), ref.view(torch.int32)), (qt, m, n, k)
print("ok")
"""


def test_avx2_build_row16_equals_the_reference():
    """x86-64-v3 (AVX2, FMA, F16C, no VNNI): vpmaddubsw, and Q8_0 as |w| times sign(w) * q_x."""
    from tests.kernels.native_builds import AVX2, run_python

    if LIB is None:
        pytest.skip("no C compiler: no native kernels")
    assert run_python(AVX2, ["-c", _AVX2_CHECK]).strip().endswith("ok")
