"""MLA attention (absorbed form over the paged latent cache): the Triton split-KV kernel vs the
reference, and the reference vs attention over the expanded per-head keys and values."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.hopper_harness import assert_fits_hopper
from tests.kernels.paged_batch import seq_lens, shuffled_block_tables
from tests.kernels.tolerances import assert_close
from tokenfab.kernels import mla, mla_ref


def _batch(q_lens, ctx_lens, h, r, rope, bs, dtype, gen, device):
    """Random paged latent cache [blocks, bs, 1, r + rope] (pages in shuffled order, spare pages,
    block table rows padded with a spare page id) and queries [T, H, r + rope]."""
    bt, total = shuffled_block_tables(ctx_lens, bs, gen)
    cache = torch.randn(total, bs, 1, r + rope, generator=gen).to(dtype)
    q = (torch.randn(sum(q_lens), h, r + rope, generator=gen) * 0.5).to(dtype)
    cu, ctx = seq_lens(q_lens, ctx_lens)
    return [x.to(device) for x in (q, cache, bt, cu, ctx)]


DECODE_CASES = [
    # context lengths, heads, kv_lora_rank, rope dim, block size, splits
    ([1, 16, 37], 4, 32, 16, 16, 1),  # one key; 16 ends exactly on a block boundary
    ([5, 64, 100], 5, 48, 8, 16, 4),  # odd heads, rank 48 and rope 8 (padded tiles), splits
    ([33, 129, 7, 64], 16, 64, 16, 32, 2),  # a full head block, ragged batch
    ([300], 20, 32, 16, 16, 8),  # two head blocks (the second partial), many splits
    ([3, 100], 4, 32, 16, 16, 32),  # most splits empty
    ([17, 45], 3, 32, 16, 8, None),  # the dispatcher's split count
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", DECODE_CASES)
def test_mla_decode(case, dtype, gen, device):
    ctx_lens, h, r, rope, bs, splits = case
    n = len(ctx_lens)
    q, cache, bt, cu, ctx = _batch([1] * n, ctx_lens, h, r, rope, bs, dtype, gen, device)
    scale = (r + rope) ** -0.5
    out = mla._mla_attention_triton(q, cache, bt, cu, ctx, 1, max(ctx_lens), scale, r, num_splits=splits)
    ref = mla.mla_attention_ref(q, cache, bt, cu, ctx, 1, max(ctx_lens), scale, r)
    assert out.shape == (n, h, r)
    assert_close(out, ref)


MIXED_CASES = [
    # query lengths, context lengths, heads, rank, rope, block size, splits
    ([1, 7, 1, 20], [9, 7, 33, 52], 4, 32, 16, 16, 1),  # decodes and prefill chunks (one with a cached prefix)
    ([5, 1], [21, 1], 3, 48, 8, 8, 2),  # a prefill chunk past a block boundary, a first token
    ([16], [16], 2, 32, 16, 16, None),  # one whole-block prefill
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", MIXED_CASES)
def test_mla_mixed_batch(case, dtype, gen, device):
    """Prefill chunks and decodes in one flat batch: every query attends causally to its prefix."""
    q_lens, ctx_lens, h, r, rope, bs, splits = case
    q, cache, bt, cu, ctx = _batch(q_lens, ctx_lens, h, r, rope, bs, dtype, gen, device)
    scale = 0.1
    args = (q, cache, bt, cu, ctx, max(q_lens), max(ctx_lens), scale, r)
    out = mla._mla_attention_triton(*args, num_splits=splits)
    assert_close(out, mla.mla_attention_ref(*args))


def test_mla_empty_batch(device):
    q, cache, bt, cu, ctx = _batch([], [], 4, 32, 16, 16, torch.float32, torch.Generator(), device)
    assert mla._mla_attention_triton(q, cache, bt, cu, ctx, 1, 0, 0.1, 32).shape == (0, 4, 32)
    assert mla.mla_attention_ref(q, cache, bt, cu, ctx, 1, 0, 0.1, 32).shape == (0, 4, 32)


def test_reference_equals_expanded_attention(gen):
    """The absorbed form is MLA: expanding keys/values per head (k = [W_UK c ; k_pe], v = W_UV c)
    and running plain causal attention gives the same output after W_UV."""
    h, r, rope, nope, dv, bs = 3, 32, 16, 24, 20, 8
    q_lens, ctx_lens = [4, 1], [11, 6]
    _, cache, bt, cu, ctx = _batch(q_lens, ctx_lens, h, r, rope, bs, torch.float32, gen, "cpu")
    w_uk = torch.randn(h, nope, r, generator=gen) * 0.2
    w_uv = torch.randn(h, dv, r, generator=gen) * 0.2
    q_nope = torch.randn(sum(q_lens), h, nope, generator=gen)
    q_pe = torch.randn(sum(q_lens), h, rope, generator=gen)
    scale = (nope + rope) ** -0.5
    q_abs = torch.cat((torch.einsum("thn,hnr->thr", q_nope, w_uk), q_pe), dim=-1)
    o_lat = mla.mla_attention_ref(q_abs, cache, bt, cu, ctx, max(q_lens), max(ctx_lens), scale, r)
    out = torch.einsum("thr,hvr->thv", o_lat, w_uv)
    for s in range(len(q_lens)):
        rows = torch.stack([cache[bt[s, j // bs], j % bs, 0] for j in range(ctx_lens[s])])  # [L, r + rope]
        c, k_pe = rows[:, :r], rows[:, r:]
        k = torch.cat((torch.einsum("hnr,lr->hln", w_uk, c), k_pe.expand(h, -1, -1)), dim=-1)
        v = torch.einsum("hvr,lr->hlv", w_uv, c)
        qs = torch.cat((q_nope, q_pe), dim=-1)[cu[s] : cu[s + 1]].transpose(0, 1)  # [H, Q, D]
        logits = qs @ k.transpose(1, 2) * scale
        pos = ctx_lens[s] - q_lens[s] + torch.arange(q_lens[s])
        logits = logits.masked_fill(torch.arange(ctx_lens[s])[None, :] > pos[:, None], float("-inf"))
        expect = (torch.softmax(logits, -1) @ v).transpose(0, 1)
        torch.testing.assert_close(out[cu[s] : cu[s + 1]], expect, atol=1e-5, rtol=1e-5)


def test_custom_op_dispatch_and_fake(gen):
    q, cache, bt, cu, ctx = _batch([1, 1], [5, 9], 2, 32, 16, 16, torch.float32, gen, "cpu")
    out = torch.ops.tokenfab.mla_attention(q, cache, bt, cu, ctx, 1, 9, 0.2, 32)
    assert_close(out, mla.mla_attention_ref(q, cache, bt, cu, ctx, 1, 9, 0.2, 32))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fq, fc, fbt, fcu, fctx = (mode.from_tensor(x) for x in (q, cache, bt, cu, ctx))
        assert torch.ops.tokenfab.mla_attention(fq, fc, fbt, fcu, fctx, 1, 9, 0.2, 32).shape == (2, 2, 32)


@pytest.mark.parametrize("hopper_runs", [
    pytest.param([("mla_hopper_compile.py", ("--quick",))], id="quick"),
    pytest.param([("mla_hopper_compile.py", ())], id="full", marks=pytest.mark.slow)])
def test_hopper_compile(hopper_batch, hopper_runs):
    """The MLA and DSA kernels compile for sm_90 at the dispatcher's DeepSeek-V3 / V3.2 configs: no
    spills, registers within budget, tensor-core MMAs for bf16 MLA (tests/kernels/mla_hopper_compile.py,
    in a subprocess: this process imported triton for the interpreter). The fast tier compiles the
    script's --quick subset (every kernel); the slow twin (``[full]``) every workload."""
    records = hopper_batch(hopper_runs)
    kernels = {r["kernel"] for r in records}
    assert {"_mla_split_kernel", "decode_reduce_kernel", "_dsa_index_kernel", "_dsa_topk_kernel",
            "_dsa_sparse_split_kernel"} <= kernels
    assert_fits_hopper(records)
    for r in records:
        if r["kernel"] == "_mla_split_kernel" and r["config"]["DOT_PREC"] != "ieee":
            assert r["hmma"] + r["hgmma"] > 0, r


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_latent(dtype, gen, device):
    """One row per token: [latent ; rope key], padding slots (-1) skipped, values past them untouched."""
    nb, bs, r, n, extra = 5, 4, 32, 16, 8
    cache = torch.randn(nb, bs, 1, r + n + extra, generator=gen).to(dtype).to(device)
    latent = torch.randn(6, r, generator=gen).to(device)
    rest = torch.randn(6, n, generator=gen).to(device)
    slots = torch.tensor([3, 7, -1, 8, 19, 0], device=device)
    expect = cache.clone()
    mla.store_latent_ref(latent, rest, expect, slots)
    flat = expect.view(-1, r + n + extra)
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(flat[s, :r], latent[i].to(dtype)) and torch.equal(flat[s, r : r + n], rest[i].to(dtype))
    assert torch.equal(flat[:, r + n :], cache.view(-1, r + n + extra)[:, r + n :])
    out = cache.clone()
    mla._store_latent_triton(latent, rest.view(6, 1, n), out, slots)
    assert torch.equal(out, expect)


def test_reference_query_chunks(gen, monkeypatch):
    """Long prefills run the reference in query chunks (bounded memory): same result as one piece."""
    q_lens, ctx_lens = [9, 1, 14], [12, 30, 14]
    q, cache, bt, cu, ctx = _batch(q_lens, ctx_lens, 3, 32, 16, 8, torch.float32, gen, "cpu")
    args = (q, cache, bt, cu, ctx, 14, 30, 0.2, 32)
    whole = mla.mla_attention_ref(*args)
    monkeypatch.setattr(mla_ref, "REF_CHUNK_ELEMENTS", 3 * 3 * 30 * 4)  # 4 query positions a chunk
    torch.testing.assert_close(mla.mla_attention_ref(*args), whole, atol=1e-6, rtol=1e-6)
