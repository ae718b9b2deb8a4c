"""The native CPU paged attention (kernels/cpu/paged_attention.c) over float8 e4m3 KV caches.

A stored byte reads as ``float(e4m3) * scale`` (k_scale folded into the softmax scale, v_scale into
the output). References, independent of the kernel: torch's own float8 -> float32 conversion, and the
plain paged attention (``paged_attention_ref``) over the dequantized cache.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.kernels.test_attention import _batch
from tests.kernels.tolerances import assert_close
from tokenfab.kernels.attention_ref import paged_attention_ref
from tokenfab.kernels.cpu import attention as na
from tokenfab.kernels.cpu import native_library

pytestmark = pytest.mark.skipif(native_library() is None, reason="no C compiler: the native kernels are not built")

FP8 = torch.float8_e4m3fn
ROOT = Path(__file__).resolve().parents[2]


def quantize(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float cache as e4m3 with a per-tensor scale amax / 448 (the engine's calibration)."""
    scale = (cache.float().abs().amax() / 448).reshape(1)
    return (cache.float() / scale).clamp(-448, 448).to(FP8), scale


def dequantize(cache: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return cache.float() * scale


def test_every_e4m3_code_reads_exactly():
    """One key per sequence: the output is the value row itself times v_scale, so each of the 254
    finite codes (0x7f / 0xff are NaN and never stored) must read as torch's float8 value exactly,
    through the full 16-column vectors (16 columns) and the masked tail (19 columns) of the build's path."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # NaN codes: never written
    for dv in (16, 19):
        n = -(-256 // dv)
        rows = torch.zeros(n * dv, dtype=torch.uint8)
        rows[:256] = codes
        vc = rows.view(n, 1, 1, dv).view(FP8)
        kc = torch.zeros(n, 1, 1, 8, dtype=torch.uint8).view(FP8)
        q = torch.randn(n, 2, 8)
        tables = torch.arange(n, dtype=torch.int32).view(n, 1)
        ctx = torch.ones(n, dtype=torch.int32)
        vs = torch.tensor([0.75])
        out = na.paged_decode_attention_native(q, kc, vc, tables, ctx, 0.1, k_scale=torch.tensor([2.0]), v_scale=vs)
        expected = (vc.float() * vs).view(n, 1, dv).expand(n, 2, dv)
        assert torch.equal(out, expected)


CASES = [  # (query lengths, context lengths): decodes, a 40-row chunk (block path), short extends
    ([1, 1, 1], [1, 17, 90]),
    ([1, 40, 3, 1], [9, 40, 70, 33]),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d", [(8, 2, 64), (6, 3, 20), (4, 4, 128)])
@pytest.mark.parametrize("window,softcap,sinks", [(0, 0.0, False), (30, 0.0, False), (0, 20.0, True)])
def test_native_fp8_equals_reference_on_dequantized_cache(dtype, hq, hkv, d, window, softcap, sinks):
    """Tight: the same attention as the plain definition over the dequantized cache (float32; a
    bfloat16 query/output is rounded once, so the bf16 tolerance of tests/kernels/tolerances.py)."""
    gen = torch.Generator().manual_seed(hq * 100 + d + window)
    for q_lens, ctx_lens in CASES:
        q, kc, vc, bt, cu, ctx = _batch(q_lens, ctx_lens, hq, hkv, d, 16, torch.float32, gen, "cpu")
        q = (q * 2).to(dtype)
        kq, ks = quantize(kc * 3)
        vq, vs = quantize(vc)
        sk = (torch.randn(hq, generator=gen) * 2) if sinks else None
        out = na.paged_attention_native(q, kq, vq, bt, cu, ctx, d**-0.5, window, softcap, sk, k_scale=ks, v_scale=vs)
        ref = paged_attention_ref(q.float(), dequantize(kq, ks), dequantize(vq, vs), bt, cu, ctx, max(q_lens),
                                  max(ctx_lens), d**-0.5, window, softcap, sk)
        assert out.dtype == dtype
        assert_close(out, ref.to(dtype))
        if max(q_lens) == 1:  # the decode entry point
            dec = na.paged_decode_attention_native(q, kq, vq, bt, ctx, d**-0.5, window, softcap, sk,
                                                   k_scale=ks, v_scale=vs)
            assert torch.equal(dec, out)


def test_native_fp8_close_to_the_float_cache():
    """Looser, the cost of FP8 itself: against attention over the unquantized float32 cache. Rounding
    to e4m3 (3 mantissa bits) moves a value by up to 2^-4 of itself (~3.6% RMS), in the values and, through
    the logits, in the weights: each output element is off by ~2.7% of its row's RMS on average (measured
    over 4 seeds: 2.6-2.8%), rarely past a third of it (max 24-33%). Bounds: mean < 4%, max < 50%."""
    gen = torch.Generator().manual_seed(3)
    q, kc, vc, bt, cu, ctx = _batch([1, 40, 3], [50, 40, 70], 8, 2, 64, 16, torch.float32, gen, "cpu")
    kq, ks = quantize(kc)
    vq, vs = quantize(vc)
    out = na.paged_attention_native(q, kq, vq, bt, cu, ctx, 0.125, k_scale=ks, v_scale=vs)
    exact = na.paged_attention_native(q, kc, vc, bt, cu, ctx, 0.125)
    rel = (out - exact).abs() / exact.pow(2).mean(-1, keepdim=True).sqrt()
    assert rel.mean() < 0.04 and rel.max() < 0.5, (float(rel.mean()), float(rel.max()))


def test_fp8_cache_needs_its_scales():
    gen = torch.Generator().manual_seed(1)
    q, kc, vc, bt, cu, ctx = _batch([1, 1], [5, 9], 4, 2, 16, 16, torch.float32, gen, "cpu")
    kq, ks = quantize(kc)
    vq, vs = quantize(vc)
    assert na.supports(q, kq, vq) and not na.supports(q, kq, vc)
    with pytest.raises(ValueError, match="v_scale"):
        na.paged_decode_attention_native(q, kq, vq, bt, ctx, 0.25, k_scale=ks)
    with pytest.raises(ValueError, match="k_scale must be one float32 value"):
        na.paged_decode_attention_native(q, kq, vq, bt, ctx, 0.25, k_scale=torch.ones(2), v_scale=vs)


PORTABLE = """
import torch
from tests.quant.test_kv_fp8_native import test_every_e4m3_code_reads_exactly, \\
    test_native_fp8_equals_reference_on_dequantized_cache
from tokenfab.kernels.cpu import native_library
assert native_library() is not None
test_every_e4m3_code_reads_exactly()
for dtype in (torch.float32, torch.bfloat16):
    test_native_fp8_equals_reference_on_dequantized_cache(dtype, 6, 3, 20, 30, 0.0, False)
    test_native_fp8_equals_reference_on_dequantized_cache(dtype, 8, 2, 64, 0, 20.0, True)
print("portable fp8 ok")
"""


@pytest.mark.slow
def test_portable_build_reads_fp8(tmp_path):
    """Without AVX-512 (a plain x86-64-v2 build into a fresh cache): the scalar e4m3 decode."""
    env = dict(os.environ, TOKENFAB_CPU_CFLAGS="-march=x86-64-v2", TOKENFAB_CACHE_DIR=str(tmp_path))
    env.pop("TOKENFAB_CPU_NATIVE", None)
    proc = subprocess.run([sys.executable, "-c", PORTABLE], env=env, capture_output=True, text=True, timeout=600,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "portable fp8 ok" in proc.stdout
