"""FP8 (e4m3) KV cache in the Triton kernels: store_kv, paged decode/prefill/mixed attention, MLA and DSA.

The definition (ARCHITECTURE contract, issue 13): a stored value is ``clamp(x / scale, -448, 448)`` cast to
``float8_e4m3fn`` (round to nearest even), a read is ``fp8.float() * scale``, one float32 [1] scale per
tensor. Each attention kernel is checked twice:

- against the plain reference run on the *dequantized* cache (an fp32 cache holding exactly the values
  the kernel reads): tight, ``TOLERANCES`` of the query dtype;
- against the reference on the bf16/fp32 cache the fp8 one was quantized from: looser,
  ``FP8_KV_VS_UNQUANTIZED`` (one e4m3 step, 0.125, absolute and relative; the quantization error).

Interpreter, small shapes (fast tier). The Hopper compile of the fp8 variants is the slow test at the end.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_attention import _batch
from tests.kernels.test_dsa import DI, ROPE, R, _dsa_batch, _indices
from tests.kernels.test_mla import _batch as _mla_batch
from tests.kernels.tiers import fast_dtypes
from tests.kernels.tolerances import FP8_KV_VS_UNQUANTIZED, assert_close
from tokenfab.kernels import attention, dsa, kv_cache, mla

FP8 = torch.float8_e4m3fn
F32, BF16 = torch.float32, torch.bfloat16
DTYPES = [F32, BF16]


def _quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The definition, written out here independently of the code under test."""
    return torch.clamp(x.float() / scale, -448.0, 448.0).to(FP8)


def _dequantize(x8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x8.float() * scale


def _scale_for(x: torch.Tensor, headroom: float = 1.0) -> torch.Tensor:
    """amax / 448 (times headroom): the calibration rule, as a float32 [1] tensor on x's device."""
    return (x.float().abs().amax() / 448.0 * headroom).reshape(1).to(torch.float32)


def _bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _wide_range(shape, gen, device) -> torch.Tensor:
    """Values spread over 2^-14 .. 2^12 in magnitude: e4m3 subnormals, normals and saturation."""
    mag = torch.pow(2.0, torch.randint(-14, 13, shape, generator=gen).float())
    return (torch.randn(shape, generator=gen) * mag).to(device)


# ----------------------------------------------------------------------------- store_kv


STORE_CASES = {"case0": (7, 3, 40, 24, 3, 4), "case1": (5, 2, 64, 64, 4, 16), "case2": (1, 8, 128, 128, 2, 16)}


@pytest.mark.parametrize("case,dtype", fast_dtypes(DTYPES, {"case0": DTYPES, "case1": [F32], "case2": [BF16]}))
def test_store_kv_fp8_is_the_definition(case, dtype, gen, device):
    """Triton and reference write exactly the definition's bytes; slot -1 is skipped, other slots untouched."""
    t, h, dk, dv, nb, bs = STORE_CASES[case]
    k = _wide_range((t, h, dk), gen, device).to(dtype)
    v = torch.randn(t, h, dv, generator=gen).to(dtype).to(device)
    slots = torch.randperm(nb * bs, generator=gen)[:t]
    slots[t // 2] = -1
    slots = slots.to(device)
    ks = torch.tensor([0.75], device=device)
    vs = _scale_for(v)
    # the caches start from arbitrary finite fp8 bytes (0x7f / 0xff are NaN in e4m3: avoided)
    kc0 = torch.randint(0, 0x7F, (nb, bs, h, dk), generator=gen, dtype=torch.uint8).view(FP8).to(device)
    vc0 = torch.randint(0, 0x7F, (nb, bs, h, dv), generator=gen, dtype=torch.uint8).view(FP8).to(device)
    for store in (kv_cache._store_kv_triton, kv_cache.store_kv_ref):
        kc, vc = kc0.clone(), vc0.clone()
        store(k, v, kc, vc, slots, ks, vs)
        kflat, vflat = kc.view(nb * bs, h, dk), vc.view(nb * bs, h, dv)
        written = torch.zeros(nb * bs, dtype=torch.bool, device=device)
        for i, s in enumerate(slots.tolist()):
            if s >= 0:
                written[s] = True
                assert _bytes_equal(kflat[s], _quantize(k[i], ks)), (store.__name__, i)
                assert _bytes_equal(vflat[s], _quantize(v[i], vs)), (store.__name__, i)
                # read back: the dequantized value is within half an e4m3 step of the input (in range)
                back = _dequantize(vflat[s], vs)
                assert torch.all((back - v[i].float()).abs() <= v[i].float().abs() * 2.0**-4 + vs * 2.0**-10)
        assert _bytes_equal(kflat[~written], kc0.view(nb * bs, h, dk)[~written])
        assert _bytes_equal(vflat[~written], vc0.view(nb * bs, h, dv)[~written])


def test_store_kv_fp8_saturates(gen, device):
    """A scale far too small: values clamp to +-448 (also +-inf inputs), never inf or nan."""
    k = torch.randn(6, 2, 32, generator=gen).to(device)
    k[0, 0, :2] = torch.tensor([float("inf"), float("-inf")])
    v = torch.randn(6, 2, 32, generator=gen).to(device) * 1e4
    tiny = torch.tensor([1e-4], device=device)
    slots = torch.arange(6, device=device)
    for store in (kv_cache._store_kv_triton, kv_cache.store_kv_ref):
        kc = torch.zeros(2, 4, 2, 32, dtype=FP8, device=device)
        vc = torch.zeros_like(kc)
        store(k, v, kc, vc, slots, tiny, tiny)
        for c, x in ((kc, k), (vc, v)):
            vals = c.view(8, 2, 32)[:6].float()
            assert torch.isfinite(vals).all() and vals.abs().max() == 448.0
            assert torch.equal(vals.sign(), torch.where(x == 0, 0.0, x.float().sign()))
            # 432 = halfway between e4m3's two largest values (416, 448): a tie rounds to even, 448
            assert ((vals.abs() == 448.0) == (x.float().abs() / tiny >= 432.0)).all()


def test_store_kv_fp8_needs_scales(device):
    k = torch.ones(2, 1, 16, device=device)
    kc = torch.zeros(2, 4, 1, 16, dtype=FP8, device=device)
    ok = torch.ones(1, device=device)
    for store in (kv_cache._store_kv_triton, kv_cache.store_kv_ref):
        with pytest.raises(ValueError, match="needs k_scale"):
            store(k, k, kc, kc.clone(), torch.tensor([0, 1], device=device), None, ok)
        with pytest.raises(ValueError, match="v_scale must be a float32 tensor of one element"):
            store(k, k, kc, kc.clone(), torch.tensor([0, 1], device=device), ok, torch.ones(2, device=device))
    assert not kc.float().any()  # nothing written


def test_store_kv_fp8_entry_points(monkeypatch, gen, device):
    """The custom op (Triton under TOKENFAB_KERNELS=triton) and the eager entry point (auto: the reference
    on CPU, the C kernel being skipped for fp8) both take the scales as optional last arguments."""
    from tokenfab import kernels

    k = torch.randn(3, 2, 16, generator=gen).to(device)
    v = torch.randn(3, 2, 16, generator=gen).to(device)
    slots = torch.tensor([5, -1, 0], device=device)
    ks, vs = torch.tensor([0.01], device=device), torch.tensor([0.02], device=device)
    expect = torch.zeros(2, 4, 2, 16, dtype=FP8, device=device)
    expect_v = expect.clone()
    kv_cache.store_kv_ref(k, v, expect, expect_v, slots, ks, vs)
    for mode in ("triton", "auto"):
        monkeypatch.setenv("TOKENFAB_KERNELS", mode)
        kc, vc = torch.zeros_like(expect), torch.zeros_like(expect)
        if mode == "triton":
            torch.ops.tokenfab.store_kv(k, v, kc, vc, slots, ks, vs)
        else:
            kernels.store_kv(k, v, kc, vc, slots, k_scale=ks, v_scale=vs)
        assert _bytes_equal(kc, expect) and _bytes_equal(vc, expect_v), mode


# ----------------------------------------------------------------------------- paged attention


def _fp8_batch(q_lens, ctx_lens, hq, hkv, d, bs, dtype, gen, device, headroom=1.0):
    q, kc, vc, bt, cu, ctx = _batch(q_lens, ctx_lens, hq, hkv, d, bs, dtype, gen, device)
    ks, vs = _scale_for(kc, headroom), _scale_for(vc, headroom) * 1.5
    k8, v8 = _quantize(kc, ks), _quantize(vc, vs)
    return q, kc, vc, k8, v8, ks, vs, bt, cu, ctx


def _check_attention(out, q, kc, vc, k8, v8, ks, vs, rest):
    """out vs the reference on the dequantized cache (tight) and on the unquantized cache (looser)."""
    dq = attention.paged_attention_ref(q, _dequantize(k8, ks), _dequantize(v8, vs), *rest)
    assert_close(out, dq)
    assert_close(attention.paged_attention_ref(q, k8, v8, *rest, k_scale=ks, v_scale=vs), dq)
    hi = attention.paged_attention_ref(q, kc, vc, *rest)
    torch.testing.assert_close(out.float(), hi.float(), **FP8_KV_VS_UNQUANTIZED)


DECODE_CASES = [
    # context lengths, Hq, Hkv, D, block size, window, softcap, sinks, splits
    ([1, 16, 37], 6, 2, 32, 16, 0, 0.0, False, 4),
    ([17, 200], 4, 4, 40, 16, 64, 30.0, True, 2),  # head dim 40, window + softcap + sinks
    ([7, 33], 8, 2, 64, 16, 0, 0.0, True, None),  # the dispatcher's split count (1 on the interpreter)
]


@pytest.mark.parametrize("case,dtype", fast_dtypes(DTYPES, {"case0": [F32], "case1": [BF16], "case2": DTYPES}))
def test_decode_fp8(case, dtype, gen, device):
    ctx_lens, hq, hkv, d, bs, window, softcap, use_sinks, splits = DECODE_CASES[int(case[4:])]
    q, kc, vc, k8, v8, ks, vs, bt, cu, ctx = _fp8_batch([1] * len(ctx_lens), ctx_lens, hq, hkv, d, bs, dtype, gen,
                                                        device)
    sinks = (torch.randn(hq, generator=gen) * 2).to(device) if use_sinks else None
    scale = d**-0.5
    out = attention._paged_decode_attention_triton(q, k8, v8, bt, ctx, max(ctx_lens), scale, window, softcap,
                                                   sinks, ks, vs, num_splits=splits)
    _check_attention(out, q, kc, vc, k8, v8, ks, vs, (bt, cu, ctx, 1, max(ctx_lens), scale, window, softcap, sinks))


MIXED_CASES = [
    # query lengths, context lengths, Hq, Hkv, D, block size, window, softcap, sinks
    ([1, 70, 1, 9, 0], [33, 100, 1, 40, 5], 4, 2, 32, 16, 0, 0.0, False),  # decodes + a long chunk + cached
    ([1, 48, 2], [60, 80, 2], 6, 2, 32, 16, 24, 25.0, True),  # sliding window + softcap + sinks
]


@pytest.mark.parametrize("case,dtype", fast_dtypes(DTYPES, {"case0": [F32], "case1": [BF16]}))
def test_prefill_and_mixed_fp8(case, dtype, gen, device):
    q_lens, ctx_lens, hq, hkv, d, bs, window, softcap, use_sinks = MIXED_CASES[int(case[4:])]
    q, kc, vc, k8, v8, ks, vs, bt, cu, ctx = _fp8_batch(q_lens, ctx_lens, hq, hkv, d, bs, dtype, gen, device)
    sinks = (torch.randn(hq, generator=gen) * 2).to(device) if use_sinks else None
    rest = (bt, cu, ctx, max(q_lens), max(ctx_lens), d**-0.5, window, softcap, sinks)
    out = attention._prefill_attention_triton(q, k8, v8, *rest, ks, vs)
    _check_attention(out, q, kc, vc, k8, v8, ks, vs, rest)


def test_paged_attention_op_fp8(monkeypatch, gen, device):
    """The op's new last arguments: Triton under TOKENFAB_KERNELS=triton (decode and mixed steps), and on
    CPU under auto the native kernel where it takes fp8, else the reference; the fake takes them too."""
    for q_lens, ctx_lens in (([1, 1, 1], [3, 16, 21]), ([1, 12, 1], [4, 30, 19])):
        q, kc, vc, k8, v8, ks, vs, bt, cu, ctx = _fp8_batch(q_lens, ctx_lens, 4, 2, 32, 16, torch.float32, gen,
                                                            device)
        args = (q, k8, v8, bt, cu, ctx, max(q_lens), max(ctx_lens), 0.2, 0, 0.0, None)
        dq = attention.paged_attention_ref(q, _dequantize(k8, ks), _dequantize(v8, vs), *args[3:])
        for mode in ("triton", "auto"):
            monkeypatch.setenv("TOKENFAB_KERNELS", mode)
            assert_close(torch.ops.tokenfab.paged_attention(*args, ks, vs), dq)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in args]
        out = torch.ops.tokenfab.paged_attention(*fake, mode.from_tensor(ks), mode.from_tensor(vs))
        assert out.shape == q.shape


def test_attention_fp8_edge_cases(gen, device):
    """Zero tokens; a scale that saturates the cache (outputs stay finite and match the clamped cache);
    missing scales are a clear error."""
    q, kc, vc, k8, v8, ks, vs, bt, cu, ctx = _fp8_batch([], [], 4, 2, 32, 16, torch.float32, gen, device)
    assert attention._prefill_attention_triton(q, k8, v8, bt, cu, ctx, 0, 0, 0.1, k_scale=ks, v_scale=vs).shape == (
        0, 4, 32)
    assert attention._paged_decode_attention_triton(q, k8, v8, bt, ctx, 0, 0.1, k_scale=ks, v_scale=vs).shape == (
        0, 4, 32)
    # a scale 16x too small: most values clamp to +-448
    q, kc, vc, k8, v8, ks, vs, bt, cu, ctx = _fp8_batch([1, 5], [9, 20], 4, 2, 32, 16, torch.bfloat16, gen, device,
                                                        headroom=1 / 16)
    assert (k8.float().abs() == 448).float().mean() > 0.3
    rest = (bt, cu, ctx, 5, 20, 32**-0.5)
    out = attention._prefill_attention_triton(q, k8, v8, *rest, k_scale=ks, v_scale=vs)
    assert torch.isfinite(out.float()).all()
    assert_close(out, attention.paged_attention_ref(q, _dequantize(k8, ks), _dequantize(v8, vs), *rest))
    for fn in (attention._prefill_attention_triton, attention.paged_attention_ref):
        with pytest.raises(ValueError, match="needs v_scale"):
            fn(q, k8, v8, *rest, k_scale=ks)
    with pytest.raises(ValueError, match="both be fp8"):
        attention._prefill_attention_triton(q, k8, vc, *rest, k_scale=ks, v_scale=vs)


# ----------------------------------------------------------------------------- MLA and DSA


def _mla_fp8(q_lens, ctx_lens, h, r, rope, bs, dtype, gen, device):
    q, cache, bt, cu, ctx = _mla_batch(q_lens, ctx_lens, h, r, rope, bs, dtype, gen, device)
    s = _scale_for(cache)
    return q, cache, _quantize(cache, s), s, bt, cu, ctx


MLA_CASES = [
    # query lengths, context lengths, heads, rank, rope, block size, splits
    ([1, 1, 1], [1, 16, 37], 4, 32, 16, 16, 4),  # decode, one key, a block boundary, splits
    ([1, 7, 1, 20, 0], [9, 7, 33, 52, 4], 5, 48, 8, 16, 1),  # mixed (a zero-length row), odd heads, rank 48
]


@pytest.mark.parametrize("case,dtype", fast_dtypes(DTYPES, {"case0": [F32], "case1": [BF16]}))
def test_mla_fp8(case, dtype, gen, device):
    q_lens, ctx_lens, h, r, rope, bs, splits = MLA_CASES[int(case[4:])]
    q, cache, c8, s, bt, cu, ctx = _mla_fp8(q_lens, ctx_lens, h, r, rope, bs, dtype, gen, device)
    rest = (bt, cu, ctx, max(q_lens), max(ctx_lens), (r + rope) ** -0.5, r)
    out = mla._mla_attention_triton(q, c8, *rest, s, num_splits=splits)
    dq = mla.mla_attention_ref(q, _dequantize(c8, s), *rest)
    assert_close(out, dq)
    assert_close(mla.mla_attention_ref(q, c8, *rest, kv_scale=s), dq)
    torch.testing.assert_close(out.float(), mla.mla_attention_ref(q, cache, *rest).float(), **FP8_KV_VS_UNQUANTIZED)
    with pytest.raises(ValueError, match="needs kv_scale"):
        mla._mla_attention_triton(q, c8, *rest)


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_latent_fp8(dtype, gen, device):
    """One fp8 row per token ([latent ; rope key]) with one scale, the definition's bytes; padding skipped;
    values past the row (another layer kind's index key) untouched."""
    nb, bs, r, n, extra, t = 5, 4, 32, 16, 8, 6
    cache0 = _quantize(torch.randn(nb, bs, 1, r + n + extra, generator=gen), torch.ones(1)).to(device)
    latent = _wide_range((t, r), gen, device).to(dtype)
    rest = torch.randn(t, n, generator=gen).to(dtype).to(device)
    slots = torch.tensor([3, 7, -1, 8, 19, 0], device=device)
    s = torch.tensor([0.5], device=device)
    for store in (mla._store_latent_triton, mla.store_latent_ref):
        cache = cache0.clone()
        store(latent, rest.view(t, 1, n), cache, slots, s)
        flat, flat0 = cache.view(-1, r + n + extra), cache0.view(-1, r + n + extra)
        for i, slot in enumerate(slots.tolist()):
            if slot >= 0:
                assert _bytes_equal(flat[slot, : r + n], _quantize(torch.cat((latent[i], rest[i])), s))
        assert _bytes_equal(flat[:, r + n :], flat0[:, r + n :])
        untouched = [1, 2, 4, 5, 6, 9]
        assert torch.equal(flat.view(torch.uint8)[untouched], flat0.view(torch.uint8)[untouched])
    with pytest.raises(ValueError, match="needs scale"):
        mla.store_latent_ref(latent, rest, cache0.clone(), slots)


@pytest.mark.parametrize("dtype", [pytest.param(F32, marks=pytest.mark.slow), BF16])  # fast: bf16 (~6 s each)
def test_dsa_fp8(dtype, gen, device):
    """Sparse MLA over an fp8 row cache; the indexer on the same cache picks the keys it picks on the
    dequantized cache (the scale is a power of two, so dequantizing scales every score exactly)."""
    q_lens, ctx_lens, topk = [7, 1, 20], [7, 33, 52], 12
    q, q_idx, w, cache, bt, cu, ctx = _dsa_batch(q_lens, ctx_lens, 5, 2, 16, dtype, gen, device)
    s = torch.tensor([2.0**-5], device=device)
    c8 = _quantize(cache, s)
    cd = _dequantize(c8, s)
    idx = _indices(cu.cpu(), ctx.cpu(), topk, gen).to(device)
    rest = (bt, cu, ctx, idx, 0.15, R)
    out = dsa._dsa_sparse_attention_triton(q, c8, *rest, s, num_splits=2)
    dq = dsa.dsa_sparse_attention_ref(q, cd, *rest)
    assert_close(out, dq)
    assert_close(dsa.dsa_sparse_attention_ref(q, c8, *rest, kv_scale=s), dq)
    torch.testing.assert_close(out.float(), dsa.dsa_sparse_attention_ref(q, cache, *rest).float(),
                               **FP8_KV_VS_UNQUANTIZED)
    # the indexer: Triton and reference on the fp8 cache, and the reference on the dequantized one
    sel = (q_idx, w, c8, bt, cu, ctx, max(q_lens), max(ctx_lens), R + ROPE)
    tri = dsa.select_topk(dsa._dsa_index_scores_triton(*sel), 6)
    ref = dsa.dsa_topk_indices_ref(*sel, 6)
    ref_dq = dsa.dsa_topk_indices_ref(q_idx, w, cd, *sel[3:], 6)
    assert [sorted(x) for x in tri.tolist()] == [sorted(x) for x in ref.tolist()] == [
        sorted(x) for x in ref_dq.tolist()]
    assert c8.shape[-1] == R + ROPE + DI


def test_mla_dsa_fp8_ops_and_fakes(monkeypatch, gen):
    """The custom ops take the scales as optional last arguments, under Triton and the reference."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, cache, c8, s, bt, cu, ctx = _mla_fp8([1, 3], [5, 9], 2, 32, 16, 16, torch.float32, gen, "cpu")
    args = (q, c8, bt, cu, ctx, 3, 9, 0.2, 32)
    dq = mla.mla_attention_ref(q, _dequantize(c8, s), *args[2:])
    idx = _indices(cu, ctx, 4, gen)
    sargs = (q, c8, bt, cu, ctx, idx, 0.2, 32)
    sdq = dsa.dsa_sparse_attention_ref(q, _dequantize(c8, s), *sargs[2:])
    for mode in ("triton", "torch"):
        monkeypatch.setenv("TOKENFAB_KERNELS", mode)
        assert_close(torch.ops.tokenfab.mla_attention(*args, s), dq)
        assert_close(torch.ops.tokenfab.dsa_sparse_attention(*sargs, s), sdq)
        c = c8.clone()
        torch.ops.tokenfab.store_latent(torch.randn(2, 32), torch.randn(2, 16), c, torch.tensor([0, 1]), s)
    with FakeTensorMode() as mode:
        f = [mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in args]
        assert torch.ops.tokenfab.mla_attention(*f, mode.from_tensor(s)).shape == (4, 2, 32)
        fs = [mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in sargs]
        assert torch.ops.tokenfab.dsa_sparse_attention(*fs, mode.from_tensor(s)).shape == (4, 2, 32)


# ----------------------------------------------------------------------------- Hopper compile (slow)


@pytest.mark.slow
def test_fp8_kv_kernels_compile_for_hopper(tmp_path_factory):
    """Kernel rule 5: the fp8-cache variants of store_kv, decode, prefill, MLA and sparse MLA compile for
    sm_90 at the dispatcher's configs, without spills, the 16-bit products on tensor cores (prefill:
    HGMMA; decode and MLA: at least HMMA). Subprocess: this process imported triton for the interpreter."""
    from tests.kernels.hopper_harness import script_records

    records = [r for script in ("hopper_compile.py", "mla_hopper_compile.py")
               for r in script_records(tmp_path_factory, script, ["--only", "fp8-kv"], timeout=900)]
    kernels = {r["kernel"] for r in records}
    assert {"_store_kv_kernel", "_decode_split_kernel", "_prefill_kernel", "_mla_split_kernel",
            "_dsa_sparse_split_kernel"} <= kernels, kernels
    for r in records:
        assert r["local"] == 0 and r["stack"] == 0, r
        assert r["shared"] <= 227 * 1024, r
        if r["config"].get("KV_FP8"):
            assert r["config"]["DOT_PREC"] != "ieee", r
            if r["kernel"] == "_prefill_kernel":
                assert r["hgmma"] > 0, r
            elif r["kernel"] in ("_decode_split_kernel", "_mla_split_kernel", "_dsa_sparse_split_kernel"):
                assert r["hmma"] + r["hgmma"] > 0, r


@pytest.mark.slow
def test_fp8_ops_opcheck(gen):
    """torch.library.opcheck of the ops with fp8 caches and scales: fake impls and AOT dispatch (what
    torch.compile traces). Not its schema check: that compares fp8 tensors with allclose, which torch does
    not implement for fp8. Slow tier (~15 s, mostly opcheck's own imports and AOT tracing); the fast tests
    above run the fakes under FakeTensorMode."""
    utils = ("test_faketensor", "test_aot_dispatch_dynamic")
    q, kc, vc, k8, v8, ks, vs, bt, cu, ctx = _fp8_batch([1, 5], [9, 20], 4, 2, 32, 16, torch.float32, gen, "cpu")
    torch.library.opcheck(torch.ops.tokenfab.paged_attention.default,
                          (q, k8, v8, bt, cu, ctx, 5, 20, 0.2, 0, 0.0, None, ks, vs), test_utils=utils)
    k = torch.randn(3, 2, 32, generator=gen)
    torch.library.opcheck(torch.ops.tokenfab.store_kv.default,
                          (k, k, k8.clone(), v8.clone(), torch.tensor([0, -1, 7]), ks, vs), test_utils=utils)
    q, cache, c8, s, bt, cu, ctx = _mla_fp8([1, 3], [5, 9], 2, 32, 16, 16, torch.float32, gen, "cpu")
    torch.library.opcheck(torch.ops.tokenfab.mla_attention.default, (q, c8, bt, cu, ctx, 3, 9, 0.2, 32, s),
                          test_utils=utils)
    torch.library.opcheck(torch.ops.tokenfab.dsa_sparse_attention.default,
                          (q, c8, bt, cu, ctx, _indices(cu, ctx, 4, gen), 0.2, 32, s), test_utils=utils)
    torch.library.opcheck(torch.ops.tokenfab.store_latent.default,
                          (torch.randn(2, 32), torch.randn(2, 16), c8.clone(), torch.tensor([0, 1]), s),
                          test_utils=utils)
