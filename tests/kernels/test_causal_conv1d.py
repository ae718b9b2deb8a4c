"""The short causal conv1d of Gated DeltaNet layers (issue 29): Triton prefill (varlen, rolling state per slot)
and one-step update against the reference and transformers' Qwen3-Next functions; updates continuing a prefill;
the registered ops. The compile check is in test_gated_delta.py (one script for both kernel files).

Tolerances: TOLERANCES of the input dtype (float32 1e-5; bf16 two bf16 steps: transformers rounds the conv
output to bf16 before the SiLU, the kernels and our reference round once).
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from tests.kernels.tiers import tiered
from tests.kernels.tolerances import assert_close
from tokenfab.kernels import causal_conv1d as cc

W = 4


def _batch(lens):
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lens).cumsum(0)
    return cu


CASES = tiered([
    # lengths, channels, dtype, bias, silu
    ((1, 2, 3, 5, 40, 0), 48, torch.float32, False, True),  # an empty sequence too
    ((1, 17, 3), 40, torch.bfloat16, True, True),
    ((7, 1), 24, torch.float32, True, False),
    ((300, 2, 129), 520, torch.float32, False, True),
    ((300, 2, 129), 520, torch.bfloat16, True, True),
], slow=lambda lens, d, dtype, bias, silu: d > 100)


@pytest.mark.parametrize("lens, d, dtype, bias, silu", CASES)
def test_prefill_varlen(lens, d, dtype, bias, silu, gen, device):
    """Odd lengths (shorter than the state, across token blocks), nonzero states in scattered slots, sequences
    without state, a padding sequence: outputs and every slot's new state against the reference."""
    n = len(lens)
    x = torch.randn(sum(lens), d, generator=gen).to(dtype)
    w = torch.randn(d, W, generator=gen).to(dtype)
    b = torch.randn(d, generator=gen).to(dtype) if bias else None
    state = torch.randn(9, d, W - 1, generator=gen).to(dtype)
    slots = torch.tensor([(2 * i + 3) % 9 for i in range(n)], dtype=torch.int32)
    if n > 2:
        slots[2] = -1
    has = torch.tensor([i % 2 == 0 for i in range(n)])
    cu = _batch(lens)
    s_ref = state.clone()
    o_ref = cc.causal_conv1d_prefill_ref(x, w, b, cu, s_ref, slots, has, silu)
    dev = lambda t: None if t is None else t.to(device)  # noqa: E731
    s_tri = dev(state.clone())
    o_tri = cc._causal_conv1d_prefill_triton(dev(x), dev(w), dev(b), dev(cu), s_tri, dev(slots), dev(has), silu)
    assert_close(o_tri.cpu(), o_ref)
    assert torch.equal(s_tri.cpu(), s_ref)  # the state is copied inputs: exact
    if n > 2:
        assert not o_tri[sum(lens[:2]): sum(lens[:3])].any()
        assert torch.equal(s_tri.cpu()[[i for i in range(9) if i not in slots.tolist()]],
                           state[[i for i in range(9) if i not in slots.tolist()]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_then_updates_match_transformers(dtype, gen, device):
    """A fresh prefill of 6 tokens, then 4 one-token updates, equal transformers' causal_conv1d_fn over all 10
    and its causal_conv1d_update step by step (its state keeps W columns: ours is that less the oldest)."""
    d = 40
    x = torch.randn(10, d, generator=gen).to(dtype)
    w = torch.randn(d, W, generator=gen).to(dtype)
    b = torch.randn(d, generator=gen).to(dtype)
    full = hf.causal_conv1d_fn(x.t()[None], w, b, activation="silu")[0].t()
    state = torch.randn(3, d, W - 1, generator=gen).to(dtype).to(device)
    slot = torch.tensor([1], dtype=torch.int32, device=device)
    o_pre = cc._causal_conv1d_prefill_triton(x[:6].to(device), w.to(device), b.to(device),
                                             torch.tensor([0, 6], dtype=torch.int32, device=device), state, slot,
                                             torch.tensor([False], device=device), True)
    assert_close(o_pre.cpu(), full[:6])
    hf_state = x[2:6].t()[None].contiguous()  # transformers' cache after the prefill: the last W inputs
    for t in range(6, 10):
        o = cc._causal_conv1d_update_triton(x[t:t + 1].to(device), w.to(device), b.to(device), state, slot, True)
        o_hf = hf.causal_conv1d_update(x[t:t + 1].t()[None], hf_state, w, b, "silu")[0].t()
        assert_close(o.cpu(), o_hf)
        assert_close(o.cpu(), full[t:t + 1])
        assert torch.equal(state[1].cpu(), hf_state[0, :, 1:])


def test_update_batch_with_padding(gen, device):
    """One update over a batch of slots (a padding row: output zero, no state written) equals the reference."""
    d = 33
    x = torch.randn(4, d, generator=gen)
    w = torch.randn(d, W, generator=gen)
    state = torch.randn(6, d, W - 1, generator=gen)
    slots = torch.tensor([5, -1, 0, 2], dtype=torch.int32)
    s_ref = state.clone()
    o_ref = cc.causal_conv1d_update_ref(x, w, None, s_ref, slots, True)
    s_tri = state.clone().to(device)
    o_tri = cc._causal_conv1d_update_triton(x.to(device), w.to(device), None, s_tri, slots.to(device), True)
    assert_close(o_tri.cpu(), o_ref)
    assert not o_tri[1].any()
    assert torch.equal(s_tri.cpu(), s_ref)


def test_strided_state_and_input(gen, device):
    """A state pool stored [slots, W - 1, D] (channels contiguous, passed as a transposed view) and x a column
    slice of a wider projection: the same results as contiguous tensors."""
    d, lens = 24, (5, 2)
    wide = torch.randn(sum(lens), 3 * d, generator=gen)
    x = wide[:, d: 2 * d]
    w = torch.randn(d, W, generator=gen)
    pool = torch.randn(4, W - 1, d, generator=gen)
    slots = torch.tensor([3, 0], dtype=torch.int32)
    cu = _batch(lens)
    s_ref = pool.transpose(1, 2).contiguous()
    o_ref = cc.causal_conv1d_prefill_ref(x.contiguous(), w, None, cu, s_ref, slots, None, True)
    s_tri = pool.clone().to(device)
    o_tri = cc._causal_conv1d_prefill_triton(x.to(device), w.to(device), None, cu.to(device),
                                             s_tri.transpose(1, 2), slots.to(device), None, True)
    assert_close(o_tri.cpu(), o_ref)
    assert torch.equal(s_tri.transpose(1, 2).cpu(), s_ref)
    o_upd = cc._causal_conv1d_update_triton(wide[:2, d:2 * d].to(device), w.to(device), None,
                                            s_tri.transpose(1, 2), slots.to(device), True)
    assert_close(o_upd.cpu(), cc.causal_conv1d_update_ref(x[:2].contiguous(), w, None, s_ref, slots, True))
    assert torch.equal(s_tri.transpose(1, 2).cpu(), s_ref)


def test_registered_ops_and_checks(gen, monkeypatch):
    """torch.ops.tokenfab.causal_conv1d_{prefill,update}: reference by default on CPU, Triton under
    TOKENFAB_KERNELS=triton, the same results and states; a state of the wrong width raises ValueError."""
    d = 16
    x, w = torch.randn(7, d, generator=gen), torch.randn(d, W, generator=gen)
    state = torch.randn(3, d, W - 1, generator=gen)
    cu, slots = _batch([4, 3]), torch.tensor([2, 0], dtype=torch.int32)
    results = []
    for mode in ("auto", "triton"):
        monkeypatch.setenv("TOKENFAB_KERNELS", mode)
        s = state.clone()
        o = torch.ops.tokenfab.causal_conv1d_prefill(x, w, None, cu, s, slots, None, True)
        ou = torch.ops.tokenfab.causal_conv1d_update(x[:2], w, None, s, slots, True)
        results.append((o, ou, s))
        with pytest.raises(ValueError, match="conv_state must be"):
            torch.ops.tokenfab.causal_conv1d_update(x[:2], w, None, torch.zeros(3, d, W), slots, True)
    for a, b in zip(*results):
        assert_close(a, b)
    assert not torch.equal(results[0][2], state)


def test_opcheck_and_eager_entry_points(gen):
    """torch.library.opcheck (schema, fake, declared mutation of the state) on both ops; the eager entry points
    (tokenfab.kernels.causal_conv1d_*) give the reference's results."""
    import tokenfab.kernels as kernels

    d = 8
    x, w, b = torch.randn(5, d, generator=gen), torch.randn(d, W, generator=gen), torch.randn(d, generator=gen)
    state = torch.randn(3, d, W - 1, generator=gen)
    cu, slots = _batch([3, 2]), torch.tensor([2, 0], dtype=torch.int32)
    torch.library.opcheck(torch.ops.tokenfab.causal_conv1d_prefill.default,
                          (x, w, b, cu, state.clone(), slots, torch.tensor([True, False]), True))
    torch.library.opcheck(torch.ops.tokenfab.causal_conv1d_update.default, (x[:2], w, None, state.clone(), slots,
                                                                            False))
    s1, s2 = state.clone(), state.clone()
    assert_close(kernels.causal_conv1d_update(x[:2], w, b, s1, slots, True),
                 cc.causal_conv1d_update_ref(x[:2], w, b, s2, slots, True))
    assert torch.equal(s1, s2)
