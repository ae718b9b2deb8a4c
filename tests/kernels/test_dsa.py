"""DeepSeek Sparse Attention: the lightning indexer's scores and top-k, and sparse MLA over the selected
keys; Triton (interpreter on CPU) against the references, the references against brute force."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_mla import _batch
from tests.kernels.tolerances import assert_close
from tokenfab.kernels import dsa, mla

R, ROPE, DI = 32, 16, 32  # latent, rope key, index key: cache rows of 80


def _dsa_batch(q_lens, ctx_lens, h, hi, bs, dtype, gen, device):
    q, cache, bt, cu, ctx = _batch(q_lens, ctx_lens, h, R, ROPE + DI, bs, dtype, gen, device)
    q = q[..., : R + ROPE].contiguous()
    q_idx = torch.randn(q.shape[0], hi, DI, generator=gen).to(dtype).to(device)
    w = torch.randn(q.shape[0], hi, generator=gen).to(device)
    return q, q_idx, w, cache, bt, cu, ctx


def _brute_scores(q_idx, w, cache, bt, cu, ctx, bs):
    """Per token, loop over its visible keys: sum_h w_h relu(q_h . k_j)."""
    t = q_idx.shape[0]
    out = torch.full((t, int(ctx.max())), float("-inf"))
    for s in range(ctx.shape[0]):
        q_len = int(cu[s + 1] - cu[s])
        for i in range(q_len):
            tok = int(cu[s]) + i
            pos = int(ctx[s]) - q_len + i
            for j in range(pos + 1):
                k = cache[bt[s, j // bs], j % bs, 0, R + ROPE :].float()
                out[tok, j] = (w[tok] * torch.relu(q_idx[tok].float() @ k)).sum()
    return out


INDEX_CASES = [
    # query lengths, context lengths, indexer heads, block size
    ([1, 1, 1], [1, 16, 37], 4, 16),  # decodes: one key, a block boundary, odd length
    ([7, 1, 20], [7, 33, 52], 8, 16),  # prefill chunks (one with a cached prefix) mixed with a decode
    ([5], [130], 3, 8, ),  # odd heads, several key blocks
]


@pytest.mark.parametrize("case", INDEX_CASES)
def test_index_scores_reference_is_brute_force(case, gen):
    q_lens, ctx_lens, hi, bs = case
    _, q_idx, w, cache, bt, cu, ctx = _dsa_batch(q_lens, ctx_lens, 2, hi, bs, torch.float32, gen, "cpu")
    ref = dsa.dsa_index_scores_ref(q_idx, w, cache, bt, cu, ctx, max(q_lens), max(ctx_lens), R + ROPE)
    torch.testing.assert_close(ref, _brute_scores(q_idx, w, cache, bt, cu, ctx, bs), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", INDEX_CASES)
def test_index_scores_triton(case, dtype, gen, device):
    q_lens, ctx_lens, hi, bs = case
    _, q_idx, w, cache, bt, cu, ctx = _dsa_batch(q_lens, ctx_lens, 2, hi, bs, dtype, gen, device)
    args = (q_idx, w, cache, bt, cu, ctx, max(q_lens), max(ctx_lens), R + ROPE)
    out = dsa._dsa_index_scores_triton(*args)
    ref = dsa.dsa_index_scores_ref(*args)
    assert torch.equal(torch.isinf(out), torch.isinf(ref))
    finite = torch.isfinite(ref)
    # scores are fp32 sums over heads of bf16-input products: compare at the fp32 tolerance, scaled
    scale = ref[finite].abs().max().clamp(min=1.0)
    assert_close(out[finite] / scale, ref[finite] / scale, dtype=torch.float32 if dtype == torch.float32
                 else torch.bfloat16)


def test_topk_selection(gen):
    """The top-k of each row's visible keys; all visible keys (then -1) when there are fewer than k."""
    scores = torch.randn(3, 10, generator=gen)
    scores[0, 4:] = float("-inf")  # 4 visible keys, k = 6
    sel = dsa.select_topk(scores, 6)
    assert sel.shape == (3, 6) and sel.dtype == torch.int32
    assert sorted(sel[0, :4].tolist()) == [0, 1, 2, 3] and sel[0, 4:].tolist() == [-1, -1]
    for row in (1, 2):
        assert set(sel[row].tolist()) == set(scores[row].topk(6).indices.tolist())
    wide = dsa.select_topk(scores[:, :3], 5)  # k larger than the score rows
    assert (wide[:, 3:] == -1).all() and sorted(wide[1, :3].tolist()) == [0, 1, 2]


def test_topk_indices_op_dispatch(gen):
    q_lens, ctx_lens = [3, 1], [9, 20]
    _, q_idx, w, cache, bt, cu, ctx = _dsa_batch(q_lens, ctx_lens, 2, 4, 8, torch.float32, gen, "cpu")
    args = (q_idx, w, cache, bt, cu, ctx, 3, 20, R + ROPE, 6)
    ref = dsa.dsa_topk_indices_ref(*args)
    assert torch.equal(torch.ops.tokenfab.dsa_topk_indices(*args), ref)
    tri = dsa.select_topk(dsa._dsa_index_scores_triton(*args[:-1]), 6)
    assert [sorted(r) for r in tri.tolist()] == [sorted(r) for r in ref.tolist()]
    assert (ref[0] == -1).sum() == 0 and (ref[:3] >= 0).sum(1).tolist() == [6, 6, 6]


def _indices(cu, ctx, topk, gen, dense: bool = False):
    """Per token a random subset of its visible keys (always its own), -1 padded; or all of them."""
    rows = []
    for s in range(ctx.shape[0]):
        q_len = int(cu[s + 1] - cu[s])
        for i in range(q_len):
            pos = int(ctx[s]) - q_len + i
            if dense:
                keys = list(range(pos + 1))
            else:
                perm = torch.randperm(pos, generator=gen)[: topk - 1].tolist()
                keys = perm + [pos]
                keys = [keys[k] for k in torch.randperm(len(keys), generator=gen).tolist()]
            rows.append(keys + [-1] * (topk - len(keys)))
    return torch.tensor(rows, dtype=torch.int32)


SPARSE_CASES = [
    # query lengths, context lengths, heads, block size, top-k, splits
    ([1, 1, 1], [1, 16, 37], 4, 16, 8, 1),  # top-k larger than short contexts
    ([7, 1, 20], [7, 33, 52], 5, 16, 12, 2),  # mixed batch, odd heads
    ([1, 1], [100, 64], 20, 8, 40, 4),  # two head blocks, many keys, splits
    ([3], [90], 4, 16, 64, 32),  # most splits without keys
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", SPARSE_CASES)
def test_sparse_attention_triton(case, dtype, gen, device):
    q_lens, ctx_lens, h, bs, topk, splits = case
    q, _, _, cache, bt, cu, ctx = _dsa_batch(q_lens, ctx_lens, h, 2, bs, dtype, gen, device)
    idx = _indices(cu.cpu(), ctx.cpu(), topk, gen).to(device)
    args = (q, cache, bt, cu, ctx, idx, 0.15, R)
    assert_close(dsa._dsa_sparse_attention_triton(*args, num_splits=splits), dsa.dsa_sparse_attention_ref(*args))


def test_sparse_with_all_keys_is_dense_mla(gen):
    """Selecting every visible key is plain MLA; a subset equals MLA over a cache holding only it."""
    q_lens, ctx_lens = [4, 1], [11, 20]
    q, _, _, cache, bt, cu, ctx = _dsa_batch(q_lens, ctx_lens, 3, 2, 8, torch.float32, gen, "cpu")
    dense_idx = _indices(cu, ctx, 20, gen, dense=True)
    sparse = dsa.dsa_sparse_attention_ref(q, cache, bt, cu, ctx, dense_idx, 0.2, R)
    dense = mla.mla_attention_ref(q, cache, bt, cu, ctx, 4, 20, 0.2, R)
    torch.testing.assert_close(sparse, dense, atol=1e-5, rtol=1e-5)
    idx = _indices(cu, ctx, 5, gen)
    out = dsa.dsa_sparse_attention_ref(q, cache, bt, cu, ctx, idx, 0.2, R)
    for tok in range(q.shape[0]):
        s = 0 if tok < 4 else 1
        keys = [j for j in idx[tok].tolist() if j >= 0]
        rows = torch.stack([cache[bt[s, j // 8], j % 8, 0, : R + ROPE] for j in keys])
        p = torch.softmax(q[tok] @ rows.T * 0.2, dim=-1)
        torch.testing.assert_close(out[tok], p @ rows[:, :R], atol=1e-5, rtol=1e-5)


def test_fake_impls():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(5, 4, R + ROPE)
        cache = torch.empty(8, 16, 1, R + ROPE + DI)
        bt = torch.zeros(2, 4, dtype=torch.int32)
        cu = torch.tensor([0, 4, 5], dtype=torch.int32)
        ctx = torch.tensor([4, 9], dtype=torch.int32)
        idx = torch.ops.tokenfab.dsa_topk_indices(torch.empty(5, 2, DI), torch.empty(5, 2), cache, bt, cu, ctx, 4, 9,
                                                  R + ROPE, 7)
        assert idx.shape == (5, 7) and idx.dtype == torch.int32
        assert torch.ops.tokenfab.dsa_sparse_attention(q, cache, bt, cu, ctx, idx, 0.1, R).shape == (5, 4, R)


TOPK_CASES = [
    # rows, columns, k, visible keys per row (None: all)
    (3, 10, 4, None),
    (4, 37, 6, [37, 5, 6, 1]),  # fewer visible keys than k, exactly k, one
    (2, 300, 64, [300, 200]),  # several column chunks of the interpreter's block
    (2, 20, 32, None),  # k larger than the row
]


@pytest.mark.parametrize("case", TOPK_CASES)
def test_topk_triton(case, gen, device):
    rows, cols, k, visible = case
    scores = torch.randn(rows, cols, generator=gen)
    if visible is not None:
        for i, v in enumerate(visible):
            scores[i, v:] = float("-inf")
    scores = scores.to(device)
    got = dsa._dsa_topk_triton(scores, k)
    ref = dsa.select_topk(scores, k)
    assert got.shape == ref.shape == (rows, k) and got.dtype == torch.int32
    assert [sorted(r) for r in got.tolist()] == [sorted(r) for r in ref.tolist()]


def test_topk_triton_ties(device):
    """Ties at the k-th value are filled lowest position first; negative and zero scores order right."""
    scores = torch.tensor([[0.0, -1.0, 2.0, 0.0, 0.0, -3.0, 5.0, 0.0]], device=device)
    got = dsa._dsa_topk_triton(scores, 4)
    assert sorted(got[0].tolist()) == [0, 2, 3, 6]
    neg = torch.tensor([[-5.0, -0.5, -2.0, -7.0, float("-inf")]], device=device)
    assert sorted(dsa._dsa_topk_triton(neg, 2)[0].tolist()) == [1, 2]


def test_references_in_token_chunks(gen, monkeypatch):
    q_lens, ctx_lens = [7, 1, 20], [7, 33, 52]
    q, q_idx, w, cache, bt, cu, ctx = _dsa_batch(q_lens, ctx_lens, 3, 4, 16, torch.float32, gen, "cpu")
    idx = _indices(cu, ctx, 12, gen)
    scores = dsa.dsa_index_scores_ref(q_idx, w, cache, bt, cu, ctx, 20, 52, R + ROPE)
    sparse = dsa.dsa_sparse_attention_ref(q, cache, bt, cu, ctx, idx, 0.2, R)
    from tokenfab.kernels import dsa_indexer

    for mod in (dsa, dsa_indexer):
        monkeypatch.setattr(mod, "REF_CHUNK_ELEMENTS", 1000)  # a few tokens a chunk
    torch.testing.assert_close(dsa.dsa_index_scores_ref(q_idx, w, cache, bt, cu, ctx, 20, 52, R + ROPE), scores)
    torch.testing.assert_close(dsa.dsa_sparse_attention_ref(q, cache, bt, cu, ctx, idx, 0.2, R), sparse)


def test_topk_reference_ties_do_not_depend_on_the_row_width(gen):
    """Ties at the k-th score go to the lowest positions in the reference too (0.0 == -0.0), and a row
    padded with invisible keys (a short sequence batched beside a long one) selects what it selects alone."""
    scores = torch.tensor([[0.0, -1.0, 2.0, -0.0, 0.0, -3.0, 5.0, 0.0]])
    assert sorted(dsa.select_topk(scores, 4)[0].tolist()) == [0, 2, 3, 6]
    ties = torch.zeros(4, 13)
    ties[:, 6] = torch.randn(4, generator=gen).abs() + 1
    ties[1, 2::3] = -0.0
    for width in (13, 20, 64, 200):
        padded = torch.cat([ties, torch.full((4, width - 13), float("-inf"))], dim=1)
        for k in (3, 6):
            got = [sorted(r) for r in dsa.select_topk(padded, k).tolist()]
            assert got == [[0, 1, 6][:k] if k == 3 else [0, 1, 2, 3, 4, 6]] * 4, (width, k, got)


def test_topk_triton_signed_zero_ties(device):
    scores = torch.tensor([[-0.0, 0.0, -0.0, 1.0, 0.0]], device=device)
    assert sorted(dsa._dsa_topk_triton(scores, 3)[0].tolist()) == [0, 1, 3]
    assert sorted(dsa.select_topk(scores, 3)[0].tolist()) == [0, 1, 3]
