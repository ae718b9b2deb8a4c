"""Paged attention: the Triton decode (split-KV + reduce) and prefill kernels vs the reference."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.paged_batch import seq_lens, shuffled_block_tables
from tests.kernels.tiers import tiered
from tests.kernels.tolerances import assert_close
from tokenfab.kernels import attention


def _batch(q_lens, ctx_lens, hq, hkv, d, bs, dtype, gen, device, dv=None):
    """Random paged K/V for sequences with the given query / context lengths.

    Pages are handed out in a shuffled order (plus spare pages nobody owns), and each block
    table row is padded with the id of a spare page past the sequence's last page.
    """
    dv = dv or d
    bt, total = shuffled_block_tables(ctx_lens, bs, gen)
    kc = torch.randn(total, bs, hkv, d, generator=gen).to(dtype)
    vc = torch.randn(total, bs, hkv, dv, generator=gen).to(dtype)
    t = sum(q_lens)
    q = torch.randn(t, hq, d, generator=gen).to(dtype)
    cu, ctx = seq_lens(q_lens, ctx_lens)
    return [x.to(device) for x in (q, kc, vc, bt, cu, ctx)]


def _sinks(use: bool, hq: int, gen, device):
    return (torch.randn(hq, generator=gen) * 2).to(device) if use else None


DECODE_CASES = [
    # context lengths, Hq, Hkv, D, block size, window, softcap, sinks, splits
    ([1, 16, 37], 6, 2, 32, 16, 0, 0.0, False, 4),  # 16: ends exactly on a block boundary
    ([5, 64, 100], 9, 3, 40, 16, 0, 0.0, False, 1),  # odd heads, head dim 40, one split
    ([300, 32], 5, 1, 32, 32, 0, 0.0, True, 8),  # MQA (group 5), sinks
    ([50, 129], 4, 2, 32, 16, 40, 0.0, False, 4),  # sliding window
    ([17, 200], 4, 4, 32, 16, 64, 30.0, True, 2),  # window + softcap + sinks
    ([7, 33], 8, 2, 64, 16, 0, 20.0, False, None),  # the dispatcher's split count
    ([3, 100], 4, 2, 32, 16, 0, 0.0, True, 32),  # the H200's count for this batch: most splits empty
]


F32, BF16 = torch.float32, torch.bfloat16


@pytest.mark.parametrize("n,dtype", tiered(
    [(f"case{n}", dtype) for n in range(len(DECODE_CASES)) for dtype in (F32, BF16)],
    # slow: the other dtype of each case but the first (both dtypes run fast on the first case)
    lambda n, dtype: n != "case0" and dtype == (BF16 if int(n[4:]) % 2 == 0 else F32)))
def test_paged_decode(n, dtype, gen, device):
    case = DECODE_CASES[int(n[4:])]
    ctx_lens, hq, hkv, d, bs, window, softcap, use_sinks, splits = case
    q, kc, vc, bt, _, ctx = _batch([1] * len(ctx_lens), ctx_lens, hq, hkv, d, bs, dtype, gen, device)
    sinks = _sinks(use_sinks, hq, gen, device)
    scale = d**-0.5
    out = attention._paged_decode_attention_triton(
        q, kc, vc, bt, ctx, max(ctx_lens), scale, window, softcap, sinks, num_splits=splits
    )
    ref = attention.paged_decode_attention_ref(q, kc, vc, bt, ctx, max(ctx_lens), scale, window, softcap,
                                               sinks)
    assert_close(out, ref)


def test_paged_decode_empty_batch(device):
    q, kc, vc, bt, _, ctx = _batch([], [], 4, 2, 32, 16, torch.float32, torch.Generator(), device)
    out = attention._paged_decode_attention_triton(q, kc, vc, bt, ctx, 0, 0.1)
    assert out.shape == (0, 4, 32)


PREFILL_CASES = [
    # query lengths, context lengths, Hq, Hkv, D, block size, window, softcap, sinks
    ([1, 300, 17, 64, 5], [1, 300, 57, 80, 128], 4, 2, 32, 16, 0, 0.0, False),  # lengths 1..300, cached
    ([40, 3, 1], [40, 3, 9], 9, 3, 40, 16, 0, 0.0, False),  # odd heads, head dim 40
    ([33, 70], [33, 96], 6, 6, 32, 32, 24, 0.0, True),  # MHA, window + sinks, boundary 96
    ([100, 2], [150, 2], 8, 1, 32, 16, 37, 25.0, True),  # MQA group 8, window + softcap + sinks
    ([16, 0, 20], [32, 5, 20], 4, 2, 32, 16, 0, 0.0, False),  # a sequence with no queries
]


@pytest.mark.parametrize("n,dtype", tiered(
    [(f"case{n}", dtype) for n in range(len(PREFILL_CASES)) for dtype in (F32, BF16)],
    # slow: the other dtype of each case but the last, cheap one (both dtypes run fast on it)
    lambda n, dtype: n != "case4" and dtype == (F32 if int(n[4:]) % 2 == 0 else BF16)))
def test_prefill(n, dtype, gen, device):
    case = PREFILL_CASES[int(n[4:])]
    q_lens, ctx_lens, hq, hkv, d, bs, window, softcap, use_sinks = case
    q, kc, vc, bt, cu, ctx = _batch(q_lens, ctx_lens, hq, hkv, d, bs, dtype, gen, device)
    sinks = _sinks(use_sinks, hq, gen, device)
    args = (q, kc, vc, bt, cu, ctx, max(q_lens), max(ctx_lens), d**-0.5, window, softcap, sinks)
    assert_close(attention._prefill_attention_triton(*args), attention.prefill_attention_ref(*args))


def test_prefill_empty_batch(device):
    q, kc, vc, bt, cu, ctx = _batch([], [], 4, 2, 32, 16, torch.float32, torch.Generator(), device)
    out = attention._prefill_attention_triton(q, kc, vc, bt, cu, ctx, 0, 0, 0.1)
    assert out.shape == (0, 4, 32)


def test_paged_attention_op_dispatch(monkeypatch, gen, device):
    """The public op sends max_query_len == 1 to decode and anything else to prefill."""
    monkeypatch.setenv("TOKENFAB_KERNELS", "triton")
    for q_lens, ctx_lens in (([1, 1, 1], [3, 16, 21]), ([1, 12, 1], [4, 30, 19])):
        q, kc, vc, bt, cu, ctx = _batch(q_lens, ctx_lens, 4, 2, 32, 16, torch.float32, gen, device)
        args = (q, kc, vc, bt, cu, ctx, max(q_lens), max(ctx_lens), 0.2)
        assert_close(torch.ops.tokenfab.paged_attention(*args), attention.paged_attention_ref(*args))


@pytest.mark.parametrize("decode", [True, False])
def test_int64_metadata_and_strided_q(decode, gen, device):
    """int64 block tables / cu_seqlens / context lengths, and q as a view into a fused qkv."""
    q_lens = [1, 1] if decode else [9, 1]
    ctx_lens = [20, 33]
    hq, hkv, d = 4, 2, 32
    q, kc, vc, bt, cu, ctx = _batch(q_lens, ctx_lens, hq, hkv, d, 16, torch.float32, gen, device)
    qkv = torch.randn(q.shape[0], (hq + 2 * hkv) * d, generator=gen).to(device)
    qkv[:, : hq * d] = q.reshape(q.shape[0], -1)
    q_view = qkv[:, : hq * d].view(q.shape[0], hq, d)
    bt, cu, ctx = bt.long(), cu.long(), ctx.long()
    args = (q_view, kc, vc, bt, cu, ctx, max(q_lens), max(ctx_lens), 0.3)
    ref = attention.paged_attention_ref(q, kc, vc, bt, cu, ctx, max(q_lens), max(ctx_lens), 0.3)
    if decode:
        out = attention._paged_decode_attention_triton(q_view, kc, vc, bt, ctx, max(ctx_lens), 0.3, num_splits=2)
    else:
        out = attention._prefill_attention_triton(*args)
    assert_close(out, ref)


def _dense_attention(q, k, v, scale, window, softcap, sinks):
    """One sequence, dense K/V, causal with the queries at the end: the plainest definition."""
    tq, hq, _ = q.shape
    tk, hkv, _ = k.shape
    g = hq // hkv
    kk, vv = k.float().repeat_interleave(g, dim=1), v.float().repeat_interleave(g, dim=1)
    logits = torch.einsum("qhd,khd->hqk", q.float(), kk) * scale
    if softcap > 0:
        logits = softcap * torch.tanh(logits / softcap)
    qpos = torch.arange(tk - tq, tk)[:, None]
    kpos = torch.arange(tk)[None, :]
    allowed = kpos <= qpos
    if window > 0:
        allowed &= kpos > qpos - window
    logits = logits.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        logits = torch.cat((logits, sinks.float().view(hq, 1, 1).expand(hq, tq, 1)), dim=-1)
        probs = torch.softmax(logits, -1)[..., :-1]
    else:
        probs = torch.softmax(logits, -1)
    return torch.einsum("hqk,khd->qhd", probs, vv)


@pytest.mark.parametrize("window,softcap,use_sinks", [(0, 0.0, False), (9, 0.0, True), (0, 25.0, False)])
def test_reference_on_mixed_batch_equals_dense_per_sequence(window, softcap, use_sinks):
    """The batched reference (decodes split from prefill chunks, pages gathered, padded
    queries) equals plain dense attention computed one sequence at a time."""
    gen = torch.Generator().manual_seed(3)
    q_lens, ctx_lens = [1, 7, 1, 1, 20, 1], [33, 7, 1, 16, 45, 64]
    hq, hkv, d, bs = 6, 2, 16, 8
    q, kc, vc, bt, cu, ctx = _batch(q_lens, ctx_lens, hq, hkv, d, bs, torch.float32, gen, "cpu")
    sinks = _sinks(use_sinks, hq, gen, "cpu")
    out = attention.paged_attention_ref(q, kc, vc, bt, cu, ctx, max(q_lens), max(ctx_lens), 0.25, window,
                                        softcap, sinks)
    for s, cl in enumerate(ctx_lens):
        pages = bt[s, : (cl + bs - 1) // bs].long()
        k = kc[pages].reshape(-1, hkv, d)[:cl]
        v = vc[pages].reshape(-1, hkv, d)[:cl]
        expected = _dense_attention(q[cu[s] : cu[s + 1]], k, v, 0.25, window, softcap, sinks)
        torch.testing.assert_close(out[cu[s] : cu[s + 1]], expected, atol=1e-5, rtol=1e-5)
