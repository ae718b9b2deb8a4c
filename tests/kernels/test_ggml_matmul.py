"""Packed GGUF matmuls (``tokenfab/kernels/cpu/ggml_matmul``) against independent references.

- The torch dequantizer equals ``gguf.quants.dequantize`` (the gguf package's own code) bit for bit.
- The C kernel equals ``x @ dequant(w).T`` computed in float64 within the float32 tolerance, for
  every type x activation mode, M in {0, 1, 2, 3, 7, 64, 130} (the decode tiles and the prefill
  panels), K in {32, 576, 1536} and odd N.
- The q8 mode's activation quantization is exact: through an identity weight the kernel returns
  the quantize-dequantized activations bit for bit, ties included; and the q8 kernel equals its
  reference bit for bit (both add the block terms in float32 in block order), on random and
  adversarial inputs (tests/kernels/test_ggml_q8_tiles.py: row invariance and both native kernels).
- The portable builds (no AVX: the scalar C; x86-64-v3: AVX2 without VNNI) agree with the
  native build, and ``TOKENFAB_CPU_NATIVE=0`` runs the reference.
"""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from tests.kernels.native_builds import AVX2, PORTABLE, finish, start_python
from tests.kernels.tolerances import assert_close
from tokenfab.kernels.cpu import ggml_matmul as gm
from tokenfab.kernels.cpu import native_library

QTYPES = ("Q8_0", "Q4_0", "Q4_1")
ACTS = ("f32", "q8")

needs_native = pytest.mark.skipif(native_library() is None, reason="no C compiler: the native kernel is not built")


@functools.cache
def _weights(qtype: str, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8 [N, row_bytes] from the gguf package's quantizer, gguf's float32 dequantization)."""
    rng = np.random.default_rng(seed + 1000 * n + k)
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    w[0, :32] = 0.0  # an all-zero block (scale 0)
    packed = gguf_quantize(w, GGMLQuantizationType[qtype])
    deq = gguf_dequantize(packed, GGMLQuantizationType[qtype])
    return torch.from_numpy(np.ascontiguousarray(packed)), torch.from_numpy(np.ascontiguousarray(deq))


def _x(m: int, k: int, seed: int = 0) -> torch.Tensor:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    if m:
        x[0, :32] = 0.0  # an all-zero activation block (q8 scale 0)
    return x


def _oracle(x: torch.Tensor, deq: torch.Tensor, act: str) -> torch.Tensor:
    """float64 product of the (q8: quantize-dequantized) activations with gguf's dequantized weights."""
    if act == "q8" and x.shape[0]:
        q, d = gm.quantize_act_q8(x)
        x = q.double().reshape(x.shape[0], -1, 32).mul(d.double()[..., None]).reshape(x.shape)
    return (x.double() @ deq.double().T).float()


@pytest.mark.parametrize("qtype", QTYPES)
def test_dequantize_equals_gguf(qtype):
    packed, deq = _weights(qtype, 45, 576)
    assert torch.equal(gm.dequantize(packed, qtype, 576), deq)
    # every byte value in the quant bytes, and random float16 scales
    raw = torch.randint(0, 256, packed.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    blocks = raw.view(45, 576 // 32, -1)
    scales = (torch.rand(45, 576 // 32, 2, generator=torch.Generator().manual_seed(2)) - 0.5).half()
    blocks[..., 0:2] = scales[..., 0:1].contiguous().view(torch.uint8)
    if qtype == "Q4_1":
        blocks[..., 2:4] = scales[..., 1:2].contiguous().view(torch.uint8)
    ref = torch.from_numpy(gguf_dequantize(raw.numpy(), GGMLQuantizationType[qtype]))
    assert torch.equal(gm.dequantize(raw, qtype, 576), ref)


@pytest.mark.parametrize("qtype", QTYPES)
def test_dequantize_rows(qtype):
    packed, deq = _weights(qtype, 45, 576)
    rows = torch.tensor([44, 0, 7, 7, 13])
    assert_close(gm.ggml_dequantize_rows(packed, qtype, 576, rows), deq[rows])
    assert_close(gm.ggml_dequantize_rows(packed, qtype, 576, rows.int()), deq[rows])
    assert gm.ggml_dequantize_rows(packed, qtype, 576, torch.tensor([], dtype=torch.long)).shape == (0, 576)
    if qtype != "Q4_1":  # d * (q - 8) and d * q are one rounding either way: bit-exact
        assert torch.equal(gm.ggml_dequantize_rows(packed, qtype, 576, rows), deq[rows])


@pytest.mark.parametrize("k", [32, 576, 1536])
@pytest.mark.parametrize("m", [0, 1, 2, 3, 7, 64, 130])
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("qtype", QTYPES)
def test_matmul_matches_reference(qtype, act, m, k):
    n = 37 if k == 1536 else 67
    packed, deq = _weights(qtype, n, k)
    x = _x(m, k)
    out = gm.ggml_matmul(x, packed, qtype, k, act=act)
    expected = _oracle(x, deq, act)
    assert out.shape == (m, n) and out.dtype == torch.float32
    assert_close(out, expected)
    assert_close(gm.ggml_matmul_reference(x, packed, qtype, k, act=act), expected)


@pytest.mark.parametrize("qtype", QTYPES)
def test_f32_rows_longer_than_a_scale_chunk(qtype):
    """Rows of 259 blocks: the f32 kernel converts a row's scales 256 blocks at a time (SCALE_CHUNK),
    so the second chunk and the odd last block must read their own scales."""
    k = 32 * 259
    packed, deq = _weights(qtype, 19, k)
    x = _x(3, k)
    assert_close(gm.ggml_matmul(x, packed, qtype, k, act="f32"), _oracle(x, deq, "f32"))


def _random_packed(qtype: str, n: int, k: int, seed: int) -> torch.Tensor:
    """Adversarial packed weights: every quant byte value (Q8_0's -128 included), float16 scales
    (and Q4_1 minimums) of both signs over eight decades, a few zero scales."""
    gen = torch.Generator().manual_seed(seed)
    bb = gm.BLOCK_BYTES[qtype]
    blocks = torch.randint(0, 256, (n, k // 32, bb), dtype=torch.uint8, generator=gen)
    for off in (0, 2) if qtype == "Q4_1" else (0,):
        mag = 10.0 ** torch.randint(-6, 2, (n, k // 32), generator=gen).float()
        sc = (torch.rand(n, k // 32, generator=gen) - 0.5) * mag
        sc[torch.rand(n, k // 32, generator=gen) < 0.05] = 0.0
        blocks[..., off:off + 2] = sc.half()[..., None].view(torch.uint8)
    return blocks.reshape(n, -1)


def _adversarial_x(m: int, k: int, seed: int) -> torch.Tensor:
    """Rows over forty decades, zero blocks, outliers, and exact rounding ties (x = (j + 1/2) * d)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * 10.0 ** torch.randint(-20, 20, (m, 1), generator=gen).float()
    x[:, :32] = 0.0
    if k >= 96:
        x[:, 32:64] = torch.randn(m, 32, generator=gen) * 1e-3
        x[:, 40] = 50.0  # one outlier: every other q rounds to 0 or +-1
        ties = torch.arange(-32, 32, 2, dtype=torch.float32) + 0.5  # (j + 1/2) with amax/127 = 1 below
        x[:, 64:96] = ties
        x[:, 95] = 127.0
    return x


@needs_native
@pytest.mark.parametrize("qtype", QTYPES)
def test_q8_kernel_equals_reference_bitwise(qtype):
    """act="q8" adds the block terms in float32 in block order (ggml_q8.c), as the reference
    does: the two agree bit for bit (not just to float32 summation order) on random and
    adversarial weights and activations, every tile size and every K/32 % 8 tail. That is what
    keeps greedy decoding in q8 mode on the reference's tokens (tests/models/test_packed_gguf.py)."""
    for i, (m, k, n) in enumerate([(1, 576, 67), (2, 32, 33), (3, 96, 17), (4, 1536, 37), (5, 288, 16),
                                   (7, 256, 65), (130, 576, 19)]):
        for w in (_weights(qtype, n, k)[0], _random_packed(qtype, n, k, seed=i)):
            for x in (_x(m, k, seed=i), _adversarial_x(m, k, seed=i)):
                got = gm.ggml_matmul(x, w, qtype, k, act="q8")
                ref = gm.ggml_matmul_reference(x, w, qtype, k, act="q8")
                assert torch.equal(got, ref), (m, k, n, float((got - ref).abs().max()))


@pytest.mark.parametrize("n", [1, 31, 32, 33, 65])
@pytest.mark.parametrize("m", [1, 9])
def test_matmul_edge_columns(n, m):
    """N around the 16-row chunks a thread takes at a time, and a lone row."""
    for qtype in QTYPES:
        packed, deq = _weights(qtype, n, 64)
        x = _x(m, 64, seed=3)
        for act in ACTS:
            assert_close(gm.ggml_matmul(x, packed, qtype, 64, act=act), _oracle(x, deq, act))


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("qtype", QTYPES)
def test_rows_do_not_depend_on_the_batch(qtype, act):
    """A row's result is bit-identical alone, in a partial tile and in a large batch, whatever the
    thread count (the engine's batch-invariance contract)."""
    packed, _ = _weights(qtype, 67, 576)
    x = _x(130, 576, seed=5)
    full = gm.ggml_matmul(x, packed, qtype, 576, act=act)
    for rows in (slice(0, 1), slice(5, 7), slice(9, 12), slice(64, 130)):
        assert torch.equal(gm.ggml_matmul(x[rows], packed, qtype, 576, act=act), full[rows])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(gm.ggml_matmul(x, packed, qtype, 576, act=act), full)
    finally:
        torch.set_num_threads(threads)


def _identity(qtype: str, k: int) -> torch.Tensor:
    """A packed K x K identity: scale 1 (float16 1.0 = 0x3c00), weight 1 on the diagonal, 0 elsewhere."""
    bb = gm.BLOCK_BYTES[qtype]
    blocks = torch.zeros(k, k // 32, bb, dtype=torch.uint8)
    blocks[..., 0], blocks[..., 1] = 0x00, 0x3C
    start = {"Q8_0": 2, "Q4_0": 2, "Q4_1": 4}[qtype]
    if qtype == "Q4_0":
        blocks[..., start:] = 0x88  # q = 8 -> 0
    for i in range(k):
        b, j = divmod(i, 32)
        if qtype == "Q8_0":
            blocks[i, b, start + j] = 1
        else:
            q0 = 9 if qtype == "Q4_0" else 1
            byte = int(blocks[i, b, start + j % 16])
            byte = (byte & 0xF0) | q0 if j < 16 else (byte & 0x0F) | (q0 << 4)
            blocks[i, b, start + j % 16] = byte
    return blocks.reshape(k, -1)


@pytest.mark.parametrize("qtype", QTYPES)
def test_identity_exact(qtype):
    """Through an identity weight, f32 mode returns x and q8 mode its quantize-dequantized self,
    bit for bit: the activation quantization is exactly the reference's, ties to even included."""
    k = 96
    ident = _identity(qtype, k)
    assert torch.equal(gm.dequantize(ident, qtype, k), torch.eye(k))
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(4)) * 3
    x[1, :32] = 0.0
    x[2, :32] = torch.tensor([127.0, 2.5, 3.5, -2.5, -3.5, 0.5, -0.5, 1.5] + [0.25] * 24)  # d = 1: ties at .5
    x[3, 32:64] = 1e-30  # tiny scale
    x[4, 64:] *= 1e6
    assert torch.equal(gm.ggml_matmul(x, ident, qtype, k), x)
    q, d = gm.quantize_act_q8(x)
    assert q[2, :8].tolist() == [127, 2, 4, -2, -4, 0, 0, 2]
    xq = (q.float().reshape(5, -1, 32) * d[..., None]).reshape(5, k)
    assert torch.equal(gm.ggml_matmul(x, ident, qtype, k, act="q8"), xq)
    assert torch.equal(gm.ggml_matmul_reference(x, ident, qtype, k, act="q8"), xq)


def test_bad_inputs_raise():
    packed, _ = _weights("Q4_1", 5, 64)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="multiple of 32"):
        gm.ggml_matmul(torch.randn(2, 60), packed, "Q4_1", 60)
    with pytest.raises(ValueError, match="multiple of 32"):
        gm.dequantize(packed, "Q4_1", 48)
    with pytest.raises(ValueError, match="unsupported GGML type"):
        gm.ggml_matmul(x, packed, "Q5_K", 64)
    with pytest.raises(ValueError, match="float32"):
        gm.ggml_matmul(x.double(), packed, "Q4_1", 64)
    with pytest.raises(ValueError, match="float32"):
        gm.ggml_matmul(x.bfloat16(), packed, "Q4_1", 64)
    with pytest.raises(ValueError, match="2-D"):
        gm.ggml_matmul(x[0], packed, "Q4_1", 64)
    with pytest.raises(ValueError, match="uint8"):
        gm.ggml_matmul(x, packed.view(torch.int8), "Q4_1", 64)
    with pytest.raises(ValueError, match="holds 68 bytes, the weight has 40"):
        gm.ggml_matmul(x, packed, "Q8_0", 64)  # Q4_1 rows read as Q8_0
    with pytest.raises(ValueError, match="columns"):
        gm.ggml_matmul(torch.randn(2, 32), packed, "Q4_1", 64)
    with pytest.raises(ValueError, match="act"):
        gm.ggml_matmul(x, packed, "Q4_1", 64, act="int4")
    with pytest.raises(ValueError, match="outside"):
        gm.ggml_dequantize_rows(packed, "Q4_1", 64, torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="outside"):
        gm.ggml_dequantize_rows(packed, "Q4_1", 64, torch.tensor([-1]))
    with pytest.raises(ValueError, match="int64"):
        gm.ggml_dequantize_rows(packed, "Q4_1", 64, torch.tensor([0.0]))
    # no rows: an empty result, not an error
    assert gm.ggml_matmul(x, packed[:0], "Q4_1", 64).shape == (2, 0)


def test_strided_input():
    packed, deq = _weights("Q4_0", 33, 64)
    x = torch.randn(3, 128)[:, ::2]
    assert_close(gm.ggml_matmul(x, packed, "Q4_0", 64), _oracle(x, deq, "f32"))


def test_disabled_native_runs_reference(monkeypatch):
    packed, deq = _weights("Q4_1", 37, 576)
    x = _x(3, 576)
    monkeypatch.setenv("TOKENFAB_CPU_NATIVE", "0")
    assert native_library() is None
    assert gm.ggml_kernel_info()["native"] is False
    for act in ACTS:
        assert torch.equal(gm.ggml_matmul(x, packed, "Q4_1", 576, act=act),
                           gm.ggml_matmul_reference(x, packed, "Q4_1", 576, act=act))
    rows = torch.tensor([3, 1])
    assert torch.equal(gm.ggml_dequantize_rows(packed, "Q4_1", 576, rows), deq[rows])


@needs_native
def test_kernel_info_and_amx_probe(monkeypatch):
    info = gm.ggml_kernel_info()
    assert info["native"] and info["isa"] in ("avx512", "avx2", "scalar") and info["threads"] >= 1
    assert isinstance(info["amx"], bool) and info["amx_reason"]
    if "amx_int8" not in gm._cpu_flags():
        assert native_library().ggml_amx_probe() == 1  # cpuid agrees; no tile instruction ran
        assert info["amx"] is False
    # the probe's verdicts, including a child that dies on its first tile instruction
    monkeypatch.setattr(gm, "_cpu_flags", lambda: {"amx_tile", "amx_int8"})
    for script, usable, why in [
        ("import os, signal; os.kill(os.getpid(), signal.SIGILL)", False, "probe faulted (signal 4)"),
        ("import sys; sys.exit(3)", False, "arch_prctl"),
        ("import sys; sys.exit(0)", True, "AMX tiles work"),
    ]:
        monkeypatch.setattr(gm, "_PROBE", script)
        gm.amx_status.cache_clear()
        ok, reason = gm.amx_status()
        assert ok is usable and why in reason
    gm.amx_status.cache_clear()


PORTABLE_CHECK = r"""
import json, sys, torch
from tokenfab.kernels.cpu import ggml_matmul as gm


def run(cases):
    out = {"info": gm.ggml_kernel_info(), "results": []}
    for qtype, act, m, n, k, seed in cases:
        g = torch.Generator().manual_seed(seed)
        w = torch.randint(0, 256, (n, k // 32, gm.BLOCK_BYTES[qtype]), dtype=torch.uint8, generator=g)
        w[..., 0:2] = (torch.rand(n, k // 32, 1, generator=g) * 0.01).half().view(torch.uint8)
        if qtype == "Q4_1":
            w[..., 2:4] = (-torch.rand(n, k // 32, 1, generator=g) * 0.05).half().view(torch.uint8)
        x = torch.randn(m, k, generator=g)
        w = w.reshape(n, -1)
        out["results"].append(gm.ggml_matmul(x, w, qtype, k, act=act).tolist())
        out["results"].append(gm.ggml_dequantize_rows(w, qtype, k, torch.tensor([0, n - 1])).tolist())
    return out


if __name__ == "__main__":
    print(json.dumps(run(json.loads(sys.argv[1]))))
"""

_CASES = [[qt, act, m, 45, 576, i] for i, (qt, act, m) in enumerate(
    (qt, act, m) for qt in QTYPES for act in ACTS for m in (1, 3, 9))]  # M=3, 9: the AVX2 path's 2-row tiles


@needs_native
def test_portable_builds_equal_native():
    """The scalar C (no AVX: x86-64-v2) and the AVX2 path without VNNI (x86-64-v3, Haswell's level) give the
    native build's results within the float32 tolerance (q8: bit for bit, its float32 sum has one fixed
    order on every path); the builds do report those paths. The builds are the session's shared ones
    (tests/kernels/native_builds.py)."""
    builds = ((PORTABLE, "scalar"), (AVX2, "avx2"))
    procs = [start_python(cflags, ["-c", PORTABLE_CHECK, json.dumps(_CASES)]) for cflags, _ in builds]  # side by side
    try:
        namespace = {"__name__": "portable_check"}
        exec(PORTABLE_CHECK, namespace)
        native = namespace["run"](_CASES)  # this process's -march=native build
        for (cflags, isa), proc in zip(builds, procs, strict=True):
            other = json.loads(finish(proc, timeout=300).strip().splitlines()[-1])
            assert other["info"]["isa"] == isa and other["info"]["vnni"] is False, other["info"]
            for a, b in zip(other["results"], native["results"], strict=True):
                assert_close(torch.tensor(a), torch.tensor(b))
            for case, a, b in zip(_CASES, other["results"][::2], native["results"][::2], strict=True):  # products
                if case[1] == "q8":
                    assert torch.equal(torch.tensor(a), torch.tensor(b)), (cflags, case)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


def test_bench_shape_runs():
    """``tokenfab bench ggml``'s measurement on a tiny shape: every figure present and positive."""
    from tokenfab.bench.ggml import bench_shape, random_packed

    row = bench_shape(40, 64, "Q4_1", 2, cache_bytes=1 << 14, min_s=0.01)
    for key in ("f32_us", "q8_us", "torch_f32_us", "f32_GBps", "speedup_f32", "speedup_q8"):
        assert row[key] > 0, key
    w = random_packed(8, 64, "Q4_1", torch.Generator().manual_seed(0))
    deq = gm.dequantize(w, "Q4_1", 64)
    assert torch.isfinite(deq).all() and deq.abs().max() < 1.0
