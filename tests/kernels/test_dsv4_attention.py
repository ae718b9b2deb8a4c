"""DeepSeek-V4's attention core and its indexer over compressed entries (tokenfab/kernels/dsv4_attention.py) in
the interpreter against their references: one token and odd token counts, 4 and 20 heads (a partial head
block), head dims 32 and 80 (padded), window and entry lists with -1 holes and an empty second list, a token
whose only key is masked (all weight on the sink), fewer visible entries than the top-k, fp32 and bf16; and
the compile for sm_90 at V4's sizes (64 heads of 512, window 128, top-512 entries; 64 indexer heads of 128)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.tolerances import assert_close
from tokenfab.kernels import dsv4_attention as k

CASES = [(1, 4, 32, 6, 3), (7, 20, 80, 9, 0), (19, 4, 32, 17, 33)]


def _inputs(t, h, d, la, lb, dtype, seed=0):
    g = torch.Generator().manual_seed(seed + t * 31 + h)
    q = torch.randn(t, h, d, generator=g).to(dtype)
    rows_a = torch.randn(50, d + 8, generator=g).to(dtype)  # wider rows: only the first d values are the key
    rows_b = torch.randn(40, d + 3, generator=g).to(dtype)
    rows_c = torch.randn(30, d, generator=g).to(dtype)
    idx_a = torch.randint(0, 50, (t, la), generator=g)
    idx_b = torch.randint(0, 40, (t, lb), generator=g)
    idx_c = torch.randint(0, 30, (t, 5), generator=g)
    idx_a[torch.rand(t, la, generator=g) < 0.3] = -1
    idx_b[torch.rand(t, lb, generator=g) < 0.3] = -1
    idx_c[torch.rand(t, 5, generator=g) < 0.5] = -1
    sinks = torch.randn(h, generator=g)
    return q, rows_a, idx_a, rows_b, idx_b, rows_c, idx_c, sinks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,h,d,la,lb", CASES)
def test_matches_reference(t, h, d, la, lb, dtype):
    args = _inputs(t, h, d, la, lb, dtype)
    scale = d**-0.5
    assert_close(k._dsv4_sparse_attention_triton(*args, scale), k.dsv4_sparse_attention_ref(*args, scale))


def test_no_visible_key_gives_zero():
    q, rows_a, idx_a, rows_b, idx_b, rows_c, idx_c, sinks = _inputs(3, 4, 32, 5, 2, torch.float32)
    idx_a[1], idx_b[1], idx_c[1] = -1, -1, -1
    args = (q, rows_a, idx_a, rows_b, idx_b, rows_c, idx_c, sinks, 0.2)
    out = k._dsv4_sparse_attention_triton(*args)
    assert out[1].abs().max() == 0
    assert_close(out, k.dsv4_sparse_attention_ref(*args))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,hi,di,n,topk", [(1, 4, 16, 5, 2), (9, 8, 24, 70, 8), (6, 20, 16, 3, 8)])
def test_index_topk_matches_reference(t, hi, di, n, topk, dtype):
    g = torch.Generator().manual_seed(t + hi + n)
    q = torch.randn(t, hi, di, generator=g).to(dtype)
    w = torch.randn(t, hi, generator=g) * hi**-0.5
    rows = torch.randn(90, 7 + di + 5, generator=g).to(dtype)  # the index key at columns 7 .. 7 + di
    idx = torch.randint(0, 90, (t, n), generator=g)
    idx[torch.rand(t, n, generator=g) < 0.25] = -1
    scores = k._dsv4_index_scores_triton(q, w, rows, idx, 7)
    want = k.dsv4_index_scores_ref(q, w, rows, idx, 7)
    assert torch.equal(scores == float("-inf"), want == float("-inf"))
    finite = want > float("-inf")
    assert_close(scores[finite], want[finite], dtype)
    got = k._dsv4_index_topk_triton(q, w, rows, idx, 7, topk)
    ref = k.dsv4_index_topk_ref(q, w, rows, idx, 7, topk)
    assert got.shape == ref.shape == (t, topk)
    # the same sets (the Triton selection is unsorted); -1 where fewer entries are visible than topk
    assert [sorted(r) for r in got.tolist()] == [sorted(r) for r in ref.tolist()]
    assert ((ref >= 0).sum(dim=1) == finite.sum(dim=1).clamp(max=topk)).all()


@pytest.fixture(scope="module", params=[pytest.param([("dsv4_hopper_compile.py", ())], id="sm90")])
def hopper_runs(request) -> list:
    return request.param


def test_hopper_compile(hopper_batch, hopper_runs):
    """The kernels compile for sm_90 at DeepSeek-V4's sizes: no spills, registers and shared memory in budget,
    tensor-core MMAs for bf16 (the attention and the indexer; the compressor has no matrix product)."""
    from tests.kernels.hopper_harness import H100_MAX_SHARED

    records = hopper_batch(hopper_runs)
    assert {r["kernel"] for r in records} >= {"_dsv4_attention_kernel", "_dsv4_index_kernel", "_dsv4_compress_kernel"}
    for r in records:
        assert not r["local"] and not r["stack"], r
        assert r["shared"] <= H100_MAX_SHARED, r
        assert r["registers"] * 32 * r["num_warps"] <= 65536, r
        if "bf16" in r["workload"] and r["kernel"] != "_dsv4_compress_kernel":
            assert r["hmma"] + r["hgmma"] > 0, r
