"""The batch-invariant Triton matmul (kernels/matmul_invariant.py) and the per-row Triton norm.

Row r of ``x @ w.T (+ bias)`` must be the same bits for M = 1 (decode), k + 1 (a verify), 17, 64
rows and wherever row r sits among them (``torch.equal``: no tolerance); the values must also be
the product (against a float64 reference, per-dtype tolerance). The interpreter runs the kernel on
CPU; the persistent schedule (several programs sharing the tiles) is exercised by pretending the
device has 3 SMs. The interpreter's ``tl.dot`` is numpy's BLAS matmul, whose micro-kernel rounds a
row differently by its position in the tile (edge code); the GPU's MMA computes every row of a tile
alike, so here the interpreter's dot runs one row at a time (``_row_wise_interpreter_dot``); on a
GPU the same tests run the compiled kernel. ``layers.linear.linear`` must take this kernel where Triton runs, in
batch-invariant mode only. The Hopper compile check (kernel rule 5) runs
``matmul_invariant_hopper_compile.py`` in a subprocess.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.conftest import HAS_CUDA
from tests.kernels.hopper_harness import assert_fits_hopper, script_records
from tests.kernels.invariance import assert_rows_invariant
from tests.kernels.tolerances import assert_close
from tokenfab.kernels import matmul_invariant as mi
from tokenfab.kernels import norm
from tokenfab.kernels.batch_invariant import batch_invariant_mode
from tokenfab.layers import linear as linear_mod


@pytest.fixture(autouse=True)
def _row_wise_interpreter_dot(monkeypatch):
    row_wise_interpreter_dot(monkeypatch)


def row_wise_interpreter_dot(monkeypatch) -> None:
    """In the interpreter, ``tl.dot`` computes each row by the same (1-row) numpy call, as the GPU's
    MMA computes each row of a tile by the same datapath (see the module docstring)."""
    if HAS_CUDA:
        return
    import numpy as np
    from triton.runtime import interpreter

    builder = type(interpreter.interpreter_builder)
    dot = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        rows = [dot(self, interpreter.TensorHandle(a.data[i:i + 1], a.dtype), b,
                    interpreter.TensorHandle(d.data[i:i + 1], d.dtype), input_precision, max_num_imprecise_acc)
                for i in range(a.data.shape[0])]
        return interpreter.TensorHandle(np.concatenate([r.data for r in rows]), rows[0].dtype)

    monkeypatch.setattr(builder, "create_dot", create_dot)

ROW_COUNTS = (1, 2, 5, 17, 33, 64)  # decode, a verify of k = 1 and k = 4, ragged tails of 32/64-row tiles
PROBE_ROWS = (0, 4, 16, 31, 32, 63)


def _rows_invariant(fn, x: torch.Tensor) -> None:
    """Row r of fn(x[:m]) and of fn(x[r:r+1]) equal row r of fn(x), bit for bit."""
    full = assert_rows_invariant(fn, x, ROW_COUNTS, PROBE_ROWS)
    # and a row moved to another position (another tile, another slot in its tile)
    perm = torch.roll(torch.arange(x.shape[0]), 7)
    assert torch.equal(fn(x[perm]), full[perm])


CASES = [
    # K, N, bias, dtype
    (96, 80, False, torch.float32),  # K a multiple of BLOCK_K (32), N past one 64-column tile
    (100, 37, True, torch.float32),  # ragged K and N
    (192, 200, True, torch.bfloat16),  # 3 K steps of 64, N past one 128-column tile
    (72, 24, False, torch.bfloat16),  # ragged K (EVEN_K off), narrow N
    (64, 48, True, torch.float16),
]


# the interpreter's own count (1: one program walks every tile) on one case, 3 persistent programs on all
RUNS = [(CASES[0], 1)] + [(c, 3) for c in CASES]


# slow: 3 K steps past two 128-column tiles in bf16 (~10 s interpreted); the fast runs cover EVEN_K, several
# column tiles (fp32), the ragged and the narrow bf16 tiles and fp16
SLOW_RUNS = {(CASES[2], 3)}


@pytest.mark.parametrize("case,sms", [
    pytest.param(c, m, id=f"k{c[0]}-n{c[1]}-{'b' if c[2] else 'nb'}-{str(c[3])[6:]}-sm{m}",
                 marks=[pytest.mark.slow] if (c, m) in SLOW_RUNS else []) for c, m in RUNS])
def test_rows_do_not_depend_on_m(case, sms, gen, device, monkeypatch):
    k, n, use_bias, dtype = case
    if device.type == "cpu":
        monkeypatch.setattr(mi, "num_sms", lambda dev: sms)  # several persistent programs share the tiles
    w = (torch.randn(n, k, generator=gen) * 0.1).to(dtype).to(device)
    b = torch.randn(n, generator=gen).to(dtype).to(device) if use_bias else None
    x = torch.randn(64, k, generator=gen).to(dtype).to(device)
    _rows_invariant(lambda xs: mi._matmul_invariant_triton(xs, w, b), x)
    out = mi._matmul_invariant_triton(x, w, b)
    ref = x.double() @ w.double().T + (b.double() if b is not None else 0)
    assert_close(out, ref.to(dtype))


def test_shapes_and_edge_cases(gen, device):
    w = torch.randn(24, 40, generator=gen).to(device)
    b = torch.randn(24, generator=gen).to(device)
    x3 = torch.randn(2, 3, 40, generator=gen).to(device)
    out = mi._matmul_invariant_triton(x3, w, b)
    assert out.shape == (2, 3, 24)
    assert torch.equal(out.view(6, 24), mi._matmul_invariant_triton(x3.view(6, 40), w, b))
    assert mi._matmul_invariant_triton(x3[:0].reshape(0, 40), w).shape == (0, 24)  # empty batch
    strided = torch.randn(5, 80, generator=gen).to(device)[:, ::2]  # a non-contiguous row layout
    assert_close(mi._matmul_invariant_triton(strided, w), strided @ w.T)
    with pytest.raises(ValueError, match="dtype"):
        mi._matmul_invariant_triton(x3, w.double())
    with pytest.raises(ValueError, match="does not match"):
        mi._matmul_invariant_triton(x3, w[:, :30])


def test_config_depends_on_n_k_dtype_only():
    """The configuration is a function of (N, K, dtype, SMs): M is not even an argument, and the
    launcher passes no M-dependent override. Narrow layers take narrower column tiles."""
    wide = mi.invariant_config(28672, 4096, torch.bfloat16, 132)  # Llama-8B gate_up: 224 column tiles
    narrow = mi.invariant_config(4096, 14336, torch.bfloat16, 132)  # its down projection
    assert (wide["BLOCK_M"], wide["BLOCK_N"], narrow["BLOCK_M"], narrow["BLOCK_N"]) == (64, 128, 64, 32)
    assert mi.invariant_config(4096, 4096, torch.float32, 132)["BLOCK_M"] == 32
    assert not mi.invariant_config(4096, 100, torch.bfloat16, 132)["EVEN_K"]


def test_linear_takes_the_kernel_in_batch_invariant_mode_only(gen, monkeypatch):
    """layers.linear.linear: the Triton kernel where Triton runs (here forced) in the mode, F.linear
    outside it; the mode is the caller's (a ContextVar), restored after the block."""
    monkeypatch.setenv("TOKENFAB_KERNELS", "triton")
    calls = []
    orig = mi._matmul_invariant_triton
    monkeypatch.setattr(mi, "_matmul_invariant_triton", lambda *a, **k: calls.append(1) or orig(*a, **k))
    w, x = torch.randn(24, 40, generator=gen), torch.randn(5, 40, generator=gen)
    plain = linear_mod.linear(x, w, None, None)
    assert not calls
    with batch_invariant_mode(True):
        inv = linear_mod.linear(x, w, None, None)
    assert calls and not linear_mod.batch_invariant()
    assert_close(inv, plain)


@pytest.mark.parametrize("dtype,h,residual", [
    (torch.float32, 576, False), (torch.bfloat16, 1000, True),
    # slow: the other residual choice of each dtype (the fast two run each dtype and each choice once)
    pytest.param(torch.float32, 576, True, marks=pytest.mark.slow),
    pytest.param(torch.bfloat16, 1000, False, marks=pytest.mark.slow)])
def test_triton_rms_norm_rows_do_not_depend_on_m(dtype, h, residual, gen, device):
    """RMSNorm is per row: its configuration depends on the hidden size only (norm_config)."""
    w = torch.randn(h, generator=gen).to(dtype).to(device)
    x = torch.randn(64, h, generator=gen).to(dtype).to(device)
    r = torch.randn(64, h, generator=gen).to(dtype).to(device)
    if residual:
        def fn(xs):
            return norm._add_rms_norm_triton(xs, r[: xs.shape[0]].clone(), w, 1e-6)
    else:
        def fn(xs):
            return norm._rms_norm_triton(xs, w, 1e-6)
    full = fn(x)
    for m in ROW_COUNTS:
        assert torch.equal(fn(x[:m]), full[:m]), m
    for row in PROBE_ROWS:
        xs = x[row:row + 1]
        got = norm._add_rms_norm_triton(xs, r[row:row + 1].clone(), w, 1e-6) if residual else fn(xs)
        assert torch.equal(got[0], full[row]), row


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> list[dict]:
    return script_records(tmp_path_factory, "matmul_invariant_hopper_compile.py")


@pytest.mark.slow  # ~15 s: a subprocess compiling 11 launches for sm_90
def test_hopper_compile(records):
    """Kernel rule 5: compiles for sm_90 at the dispatcher's configs, no spills, within the register
    and shared-memory budgets; 16-bit tiles multiply on warp-group tensor cores (HGMMA)."""
    assert {r["kernel"] for r in records} == {"_matmul_invariant_kernel"}
    assert len(records) >= 10
    assert_fits_hopper(records)
    for r in records:
        if "bf16" in r["workload"]:
            assert r["hgmma"] > 0, f"{r['workload']}: no HGMMA in the SASS"
