"""The native CPU kernels (kernels/cpu, C compiled on first use) against their PyTorch references.

These are the engine's default CPU path, so they get the same cases as the Triton kernels:
ragged lengths, block boundaries, GQA/MQA, windows, softcap, sinks, strided inputs, bf16.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

import tokenfab.kernels.cpu as native_lib
from tests.kernels.native_builds import PORTABLE, cache_dir, run_python
from tests.kernels.test_attention import DECODE_CASES, PREFILL_CASES, _batch, _sinks
from tests.kernels.tolerances import assert_close
from tokenfab import kernels
from tokenfab.kernels import activation, attention, norm, rope
from tokenfab.kernels.cpu import attention as native_attention
from tokenfab.kernels.cpu import elementwise as native

DTYPES = [torch.float32, torch.bfloat16]


def test_library_builds_here():
    """This machine has a C compiler: the native path must be what the engine runs, not a silent fallback."""
    assert native_lib.native_library() is not None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", DECODE_CASES)
def test_decode_attention(case, dtype, gen):
    ctx_lens, hq, hkv, d, bs, window, softcap, use_sinks, _ = case
    q, kc, vc, bt, _, ctx = _batch([1] * len(ctx_lens), ctx_lens, hq, hkv, d, bs, dtype, gen, "cpu")
    sinks = _sinks(use_sinks, hq, gen, "cpu")
    assert native_attention.supports(q, kc, vc)
    out = native_attention.paged_decode_attention_native(q, kc, vc, bt, ctx, d**-0.5, window, softcap, sinks)
    ref = attention.paged_decode_attention_ref(q, kc, vc, bt, ctx, max(ctx_lens), d**-0.5, window, softcap, sinks)
    assert_close(out, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d,dv", [(16, 1, 576, 512), (8, 8, 128, 128), (7, 7, 20, 20)])
def test_decode_attention_head_shapes(hq, hkv, d, dv, dtype, gen):
    """MLA's absorbed shape (one latent kv head, value narrower than key), MHA, a head dim
    that is not a multiple of 16 (the scalar dot-product path)."""
    ctx_lens = [1, 15, 16, 17, 70]
    q, kc, vc, bt, _, ctx = _batch([1] * 5, ctx_lens, hq, hkv, d, 16, dtype, gen, "cpu", dv=dv)
    out = native_attention.paged_decode_attention_native(q, kc, vc, bt, ctx, 0.1)
    ref = attention.paged_decode_attention_ref(q, kc, vc, bt, ctx, max(ctx_lens), 0.1)
    assert_close(out, ref)


def test_decode_attention_strided_q_latent_views_and_many_sequences(gen):
    """q as a view into a fused qkv; K and V as views of one latent cache (MLA stores V as the
    first columns of K); more sequences than threads, and a batch of one (kv heads split)."""
    hq, hkv, d = 4, 2, 32
    for ctx_lens in ([9, 40, 1, 77, 16, 5, 33, 64, 2, 100], [300]):
        q, kc, _, bt, _, ctx = _batch([1] * len(ctx_lens), ctx_lens, hq, hkv, d, 16, torch.float32, gen, "cpu")
        vc = kc[..., :24]  # strided view, Dv = 24
        qkv = torch.randn(q.shape[0], (hq + 2 * hkv) * d, generator=gen)
        qkv[:, : hq * d] = q.reshape(q.shape[0], -1)
        q_view = qkv[:, : hq * d].view(q.shape[0], hq, d)
        out = native_attention.paged_decode_attention_native(q_view, kc, vc, bt.long(), ctx.long(), 0.3)
        ref = attention.paged_decode_attention_ref(q, kc, vc, bt, ctx, max(ctx_lens), 0.3)
        assert_close(out, ref)


def test_decode_attention_empty_batch():
    q, kc, vc, bt, _, ctx = _batch([], [], 4, 2, 32, 16, torch.float32, torch.Generator(), "cpu")
    assert native_attention.paged_decode_attention_native(q, kc, vc, bt, ctx, 0.1).shape == (0, 4, 32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", PREFILL_CASES)
def test_cpu_path_on_mixed_batches(case, dtype, gen):
    """paged_attention_cpu (one native call for decode rows and prefill chunks) equals the
    reference, with the case's prefill chunks mixed with decodes."""
    q_lens, ctx_lens, hq, hkv, d, bs, window, softcap, use_sinks = case
    q_lens, ctx_lens = q_lens + [1, 1], ctx_lens + [1, 50]
    q, kc, vc, bt, cu, ctx = _batch(q_lens, ctx_lens, hq, hkv, d, bs, dtype, gen, "cpu")
    sinks = _sinks(use_sinks, hq, gen, "cpu")
    args = (q, kc, vc, bt, cu, ctx, max(q_lens), max(ctx_lens), d**-0.5, window, softcap, sinks)
    assert_close(attention.paged_attention_cpu(*args), attention.paged_attention_ref(*args))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", PREFILL_CASES)
def test_prefill_attention(case, dtype, gen):
    """The native kernel on prefill chunks alone (cached prefixes, windows, softcap, sinks)."""
    q_lens, ctx_lens, hq, hkv, d, bs, window, softcap, use_sinks = case
    q, kc, vc, bt, cu, ctx = _batch(q_lens, ctx_lens, hq, hkv, d, bs, dtype, gen, "cpu")
    sinks = _sinks(use_sinks, hq, gen, "cpu")
    out = native_attention.paged_attention_native(q, kc, vc, bt, cu, ctx, d**-0.5, window, softcap, sinks)
    ref = attention.paged_attention_ref(q, kc, vc, bt, cu, ctx, max(q_lens), max(ctx_lens), d**-0.5, window,
                                        softcap, sinks)
    assert_close(out, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d,dv,bs", [(16, 1, 576, 512, 16), (8, 8, 128, 128, 8), (96, 1, 32, 32, 16),
                                            (7, 7, 20, 20, 4)])
def test_prefill_attention_head_shapes(hq, hkv, d, dv, bs, dtype, gen):
    """MLA's absorbed shape, MHA with pages smaller than a 16-key tile, a group wider than 64
    query heads (one token per block), a head dim that is not a multiple of 16."""
    q_lens, ctx_lens = [23, 1, 70, 2], [23, 40, 90, 2]
    q, kc, vc, bt, cu, ctx = _batch(q_lens, ctx_lens, hq, hkv, d, bs, dtype, gen, "cpu", dv=dv)
    out = native_attention.paged_attention_native(q, kc, vc, bt, cu, ctx, 0.1)
    ref = attention.paged_attention_ref(q, kc, vc, bt, cu, ctx, max(q_lens), max(ctx_lens), 0.1)
    assert_close(out, ref)


def test_prefill_attention_strided_q_and_bad_offsets(gen):
    """q as a view into a fused qkv; offsets that do not match q, or more queries than keys, are
    refused rather than read past."""
    q_lens, ctx_lens, hq, hkv, d = [30, 1, 5], [40, 12, 5], 4, 2, 32
    q, kc, vc, bt, cu, ctx = _batch(q_lens, ctx_lens, hq, hkv, d, 16, torch.float32, gen, "cpu")
    qkv = torch.randn(q.shape[0], (hq + 2 * hkv) * d, generator=gen)
    qkv[:, : hq * d] = q.reshape(q.shape[0], -1)
    q_view = qkv[:, : hq * d].view(q.shape[0], hq, d)
    out = native_attention.paged_attention_native(q_view, kc, vc, bt.long(), cu.long(), ctx.long(), 0.3)
    assert_close(out, attention.paged_attention_ref(q, kc, vc, bt, cu, ctx, 30, 40, 0.3))
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        native_attention.paged_attention_native(q[:-1], kc, vc, bt, cu, ctx, 0.3)
    with pytest.raises(ValueError, match="context length"):
        native_attention.paged_attention_native(q, kc, vc, bt, cu, torch.tensor([29, 12, 5]), 0.3)
    with pytest.raises(ValueError, match="one query per sequence"):
        native_attention.paged_decode_attention_native(q, kc, vc, bt, ctx, 0.3)


def test_fresh_prefill_shortcut_equals_masked_path(gen):
    """Prompts with nothing cached take SDPA's is_causal path; it must equal the masked path."""
    q_lens = [5, 33, 1, 16]
    q, kc, vc, bt, cu, ctx = _batch(q_lens, q_lens, 6, 2, 32, 16, torch.float32, gen, "cpu")
    args = (q, kc, vc, bt, cu, ctx, max(q_lens), max(q_lens), 0.2)
    fast = attention.paged_attention_ref(*args)
    # a window longer than every sequence changes nothing but takes the masked path
    masked = attention.paged_attention_ref(*args[:-1], 0.2, 1000)
    assert_close(fast, masked)


def _rows_view(x: torch.Tensor, width: int) -> torch.Tensor:
    """x's rows as a column slice of a wider tensor (a strided view, like a fused projection's)."""
    wide = torch.zeros(x.shape[0], width + 7, dtype=x.dtype)
    wide[:, 3 : 3 + width] = x
    return wide[:, 3 : 3 + width]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,h", [(1, 8), (5, 576), (300, 96), (0, 16)])
def test_rms_norm(rows, h, dtype, gen):
    x = torch.randn(rows, h, generator=gen).to(dtype)
    w = torch.randn(h, generator=gen).to(dtype)
    assert_close(native.rms_norm(x, w, 1e-6), norm.rms_norm_ref(x, w, 1e-6))
    strided = _rows_view(x, h)
    assert_close(native.rms_norm(strided, w, 1e-6), norm.rms_norm_ref(x, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_over_heads(dtype, gen):
    """Qwen3's q/k norm: [T, heads, D] normalized over D, the heads a view into a fused qkv."""
    qkv = torch.randn(7, 12 * 16, generator=gen).to(dtype)
    q = qkv[:, : 8 * 16].view(7, 8, 16)
    w = torch.randn(16, generator=gen).to(dtype)
    assert_close(native.rms_norm(q, w, 1e-6), norm.rms_norm_ref(q, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,h", [(1, 8), (9, 576), (300, 96)])
def test_add_rms_norm(rows, h, dtype, gen):
    x = torch.randn(rows, h, generator=gen).to(dtype)
    res = torch.randn(rows, h, generator=gen).to(dtype)
    w = torch.randn(h, generator=gen).to(dtype)
    res_native, res_ref = res.clone(), res.clone()
    out = native.add_rms_norm(x, res_native, w, 1e-5)
    ref = norm.add_rms_norm_ref(x, res_ref, w, 1e-5)
    assert_close(out, ref)
    assert_close(res_native, res_ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,i", [(1, 8), (7, 1536), (260, 40), (0, 8)])
def test_silu_and_mul(rows, i, dtype, gen):
    x = (torch.randn(rows, 2 * i, generator=gen) * 4).to(dtype)
    assert_close(native.silu_and_mul(x), activation.silu_and_mul_ref(x))
    assert_close(native.silu_and_mul(_rows_view(x, 2 * i)), activation.silu_and_mul_ref(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("d,rot", [(64, 64), (32, 16), (40, 40)])
def test_rotary(d, rot, is_neox, dtype, gen):
    """Full and partial rotation, both layouts, q and k as views into a fused qkv."""
    t, hq, hk = 11, 6, 2
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=gen).to(dtype)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
    cos_sin = torch.randn(100, rot, generator=gen)
    pos = torch.randint(0, 100, (t,), generator=gen)
    out_q, out_k = native.rotary_embedding(pos, q, k, cos_sin, is_neox)
    ref_q, ref_k = rope.rotary_embedding_ref(pos, q, k, cos_sin, is_neox)
    assert_close(out_q, ref_q)
    assert_close(out_k, ref_k)


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv(dtype, gen):
    """Strided k/v (views of a fused qkv), slot -1 skipped, int32 and int64 slot mappings."""
    from tokenfab.kernels import kv_cache

    t, h, d = 6, 2, 24
    qkv = torch.randn(t, 4 * h * d, generator=gen).to(dtype)
    k = qkv[:, 2 * h * d : 3 * h * d].view(t, h, d)
    v = qkv[:, 3 * h * d :].view(t, h, d)
    slots = torch.tensor([5, -1, 0, 17, 31, 8])
    for slot_mapping in (slots, slots.int()):
        caches = [torch.randn(4, 8, h, d, generator=gen).to(dtype) for _ in range(2)]
        expected = [c.clone() for c in caches]
        assert native.store_kv(k, v, caches[0], caches[1], slot_mapping)
        kv_cache.store_kv_ref(k, v, expected[0], expected[1], slot_mapping)
        assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])


def test_argmax_first_maximum_and_nan(gen):
    x = torch.randn(9, 1000, generator=gen)
    x[2, 10] = x[2, 500] = 50.0  # a tie: the first wins
    x[4, 0] = 60.0  # at index 0
    x[5, 999] = 70.0  # at the end
    x[6, 300] = float("nan")  # NaN counts as the maximum, as in torch.argmax
    x[7] = float("-inf")
    assert torch.equal(native.argmax(x), x.argmax(-1))
    assert native.argmax(x)[2] == 10 and native.argmax(x)[6] == 300


def test_unsupported_inputs_fall_back(gen):
    """float16 and odd layouts are declined (None), and the public ops still give the reference."""
    x = torch.randn(4, 16, generator=gen).half()
    w = torch.randn(16, generator=gen).half()
    assert native.rms_norm(x, w, 1e-6) is None
    assert_close(kernels.rms_norm(x, w, 1e-6), norm.rms_norm_ref(x, w, 1e-6))
    assert native.argmax(torch.randn(3, 4, 5)) is None
    xt = torch.randn(16, 4, generator=gen).t()  # last dim not contiguous
    assert native.silu_and_mul(xt) is None
    assert_close(kernels.silu_and_mul(xt), activation.silu_and_mul_ref(xt))


def test_disabled_by_environment(monkeypatch, gen):
    monkeypatch.setenv("TOKENFAB_CPU_NATIVE", "0")
    assert native_lib.native_library() is None
    x = torch.randn(3, 8, generator=gen)
    w = torch.randn(8, generator=gen)
    assert native.rms_norm(x, w, 1e-6) is None
    assert_close(kernels.rms_norm(x, w, 1e-6), norm.rms_norm_ref(x, w, 1e-6))


def test_failed_build_falls_back_with_a_warning(monkeypatch, tmp_path, caplog):
    """A compiler that fails leaves the engine on the reference path, with the reason logged; with a
    real compiler again the next call loads a library (the session's portable build: its compile is
    ``native_builds.cache_dir``'s, through the same ``_build``)."""
    monkeypatch.setattr(native_lib, "_library", None)
    monkeypatch.setattr(native_lib, "_tried", False)
    monkeypatch.setenv("TOKENFAB_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # exists, always fails
    with caplog.at_level("WARNING"):
        assert native_lib.native_library() is None
    assert "building the CPU kernels failed" in caplog.text
    assert not list((tmp_path / "cpu_kernels").glob("tokenfab_cpu_*.so"))
    # and a real compiler gives a library from the cache directory
    monkeypatch.setattr(native_lib, "_tried", False)
    monkeypatch.delenv("CC")
    shared = cache_dir(PORTABLE)
    monkeypatch.setenv("TOKENFAB_CPU_CFLAGS", PORTABLE)
    monkeypatch.setenv("TOKENFAB_CACHE_DIR", str(shared))
    lib = native_lib.native_library()
    assert lib is not None
    assert Path(lib._name).parent == shared / "cpu_kernels"


def test_build_errors_are_reported(monkeypatch, tmp_path):
    monkeypatch.setenv("TOKENFAB_CACHE_DIR", str(tmp_path))
    with pytest.raises(subprocess.CalledProcessError):
        native_lib._build("false")


PORTABLE_CHECK = """
import torch
from tests.kernels.test_attention import _batch
from tests.kernels.tolerances import assert_close
from tokenfab.kernels import activation, attention, norm, rope
from tokenfab.kernels.cpu import attention as na, elementwise as ne, native_library
assert native_library() is not None
gen = torch.Generator().manual_seed(5)
for dtype in (torch.float32, torch.bfloat16):
    for hq, hkv, d in ((8, 2, 64), (6, 3, 20)):
        ctx_lens = [1, 16, 17, 90]
        q, kc, vc, bt, _, ctx = _batch([1] * 4, ctx_lens, hq, hkv, d, 16, dtype, gen, "cpu")
        assert_close(na.paged_decode_attention_native(q, kc, vc, bt, ctx, 0.2, 0, 20.0),
                     attention.paged_decode_attention_ref(q, kc, vc, bt, ctx, 90, 0.2, 0, 20.0))
        q, kc, vc, bt, cu, ctx = _batch([1, 40, 3], [9, 40, 70], hq, hkv, d, 16, dtype, gen, "cpu")
        assert_close(na.paged_attention_native(q, kc, vc, bt, cu, ctx, 0.2, 30),
                     attention.paged_attention_ref(q, kc, vc, bt, cu, ctx, 40, 70, 0.2, 30))
    x = torch.randn(33, 96, generator=gen).to(dtype)
    w = torch.randn(96, generator=gen).to(dtype)
    assert_close(ne.rms_norm(x, w, 1e-6), norm.rms_norm_ref(x, w, 1e-6))
    assert_close(ne.silu_and_mul(x), activation.silu_and_mul_ref(x))
    qk = torch.randn(5, 4, 32, generator=gen).to(dtype)
    pos = torch.arange(5)
    cs = torch.randn(10, 32, generator=gen)
    assert_close(ne.rotary_embedding(pos, qk, qk, cs, True)[0], rope.rotary_embedding_ref(pos, qk, qk, cs, True)[0])
logits = torch.randn(4, 333, generator=gen)
assert torch.equal(ne.argmax(logits), logits.argmax(-1))
print("portable ok")
"""


def test_portable_build_without_avx512():
    """Machines without AVX-512 (or AVX512-BF16) run the kernels' portable loops: the library built for
    plain x86-64-v2 (the session's shared build) against the references."""
    assert "portable ok" in run_python(PORTABLE, ["-c", PORTABLE_CHECK], timeout=300)
    assert list((cache_dir(PORTABLE) / "cpu_kernels").glob("tokenfab_cpu_*.so"))
