"""The gated delta rule (Gated DeltaNet, issue 29): the reference against transformers' Qwen3-Next functions, the
Triton prefill (chunked, varlen, state slots) and decode kernels against the reference, decode continuing a
prefill, a split prefill equal to a whole one, the registered ops, and the sm_90 compile.

Tolerances: float32 inputs use TOLERANCES[float32] (1e-5) on outputs and states (measured: outputs 3e-7,
states 1.7e-6 at dims 32; 1e-7 at dims 128). 16-bit inputs: the kernels multiply bf16 tiles (q, k, the state,
the intra-chunk inverse, V', as fla does) into float32 accumulators while the reference stays in float32, so
outputs get TOLERANCES[bfloat16] (1.6e-2; measured 1e-3 on outputs of size 0.3) and the float32 states
BF16_STATE (2e-2; measured 4e-3 on states of size 2).
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from tests.kernels.hopper_harness import assert_fits_hopper
from tests.kernels.tiers import tiered
from tests.kernels.tolerances import assert_close
from tokenfab.kernels import gated_delta as gd
from tokenfab.kernels import gated_delta_ref as ref

# bf16 inputs, float32 state: the state sums products of bf16-rounded tiles over the whole sequence
BF16_STATE = dict(atol=2e-2, rtol=2e-2)
LENGTHS = (1, 63, 64, 65, 130)


def _inputs(gen, lens, hk, hv, dk, dv, dtype=torch.float32, slots=8):
    t = sum(lens)
    q, k = (torch.randn(t, hk, dk, generator=gen).to(dtype) for _ in range(2))
    v = torch.randn(t, hv, dv, generator=gen).to(dtype)
    a, b = torch.randn(t, hv, generator=gen), torch.randn(t, hv, generator=gen)
    g, beta = ref.gdn_gating_ref(a, b.to(dtype), torch.rand(hv, generator=gen) * 2 - 1,
                                 torch.randn(hv, generator=gen))
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lens).cumsum(0)
    state = torch.randn(slots, hv, dk, dv, generator=gen) * 0.5
    return q, k, v, g, beta, cu, state


@pytest.mark.parametrize("length", tiered([(n,) for n in LENGTHS], slow=lambda n: n not in (1, 65)))
def test_reference_matches_transformers(length, gen):
    """Our chunk and token references equal transformers' torch_chunk_gated_delta_rule and
    torch_recurrent_gated_delta_rule (grouped heads, a nonzero initial state, l2-normalised q/k)."""
    q, k, v, g, beta, _, state = _inputs(gen, [length], 2, 4, 32, 16)
    s0 = state[3]
    args = (q[None], k[None], v[None], g[None], beta[None])
    o_hf, s_hf = hf.torch_chunk_gated_delta_rule(*args, initial_state=s0[None], output_final_state=True,
                                                 use_qk_l2norm_in_kernel=True)
    o_hr, s_hr = hf.torch_recurrent_gated_delta_rule(*args, initial_state=s0[None], output_final_state=True,
                                                     use_qk_l2norm_in_kernel=True)
    for fn in (ref.chunk_ref, ref.recurrent_ref):
        o, s = fn(q, k, v, g, beta, s0, 32**-0.5, True)
        for expected_o, expected_s in ((o_hf, s_hf), (o_hr, s_hr)):
            assert_close(o, expected_o[0])
            assert_close(s, expected_s[0])


def test_gating_matches_the_model(gen):
    """g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b): the lines of Qwen3NextGatedDeltaNet.forward."""
    a, b = torch.randn(5, 4, generator=gen), torch.randn(5, 4, generator=gen).bfloat16()
    a_log, dt_bias = torch.randn(4, generator=gen), torch.randn(4, generator=gen)
    g, beta = ref.gdn_gating_ref(a, b, a_log, dt_bias)
    assert torch.equal(g, -a_log.float().exp() * torch.nn.functional.softplus(a.float() + dt_bias))
    assert torch.equal(beta, b.sigmoid())


def _prefill_case(gen, lens, hk, hv, dk, dv, dtype, device):
    q, k, v, g, beta, cu, state = _inputs(gen, lens, hk, hv, dk, dv, dtype)
    n = len(lens)
    slots = torch.tensor([(3 * i + 2) % 8 for i in range(n)], dtype=torch.int32)
    if n > 2:
        slots[1] = -1  # a padding sequence: no state read or written
    has = torch.tensor([i % 3 != 2 for i in range(n)])  # every third sequence starts fresh (its slot holds junk)
    dev = [x.to(device) for x in (q, k, v, g, beta, cu, state, slots, has)]
    s_tri = dev[6].clone()
    o_tri = gd._gated_delta_prefill_triton(*dev[:6], s_tri, dev[7], dev[8], dk**-0.5, True)
    s_ref = state.clone()
    o_ref = ref.gated_delta_prefill_ref(q, k, v, g, beta, cu, s_ref, slots, has, dk**-0.5, True)
    return o_tri.cpu(), s_tri.cpu(), o_ref, s_ref, state, slots


PREFILL = tiered([
    # lengths, key heads, value heads, dk, dv, dtype
    (LENGTHS + (0,), 1, 2, 32, 16, torch.float32),  # and an empty sequence (fresh: its slot is zeroed)
    ((65, 7, 130), 2, 4, 32, 32, torch.bfloat16),
    ((200, 64, 1), 2, 2, 128, 128, torch.float32),
    ((130, 3, 64), 16 // 8, 32 // 8, 128, 128, torch.bfloat16),
    ((5, 129, 1), 1, 3, 48, 40, torch.float32),  # dims not powers of two, 3 value heads per key head
], slow=lambda lens, hk, hv, dk, dv, dtype: dk > 32 or (dtype == torch.bfloat16 and 7 not in lens))


@pytest.mark.parametrize("lens, hk, hv, dk, dv, dtype", PREFILL)
def test_prefill_varlen(lens, hk, hv, dk, dv, dtype, gen, device):
    """One varlen batch: lengths across chunk boundaries, nonzero initial states in scattered slots, sequences
    without state (their slot's contents ignored), a padding sequence; outputs and every slot's final state."""
    o_tri, s_tri, o_ref, s_ref, s_before, slots = _prefill_case(gen, lens, hk, hv, dk, dv, dtype, device)
    assert_close(o_tri, o_ref)
    if dtype == torch.float32:
        assert_close(s_tri, s_ref)
    else:
        torch.testing.assert_close(s_tri, s_ref, **BF16_STATE)
    untouched = [i for i in range(8) if i not in slots.tolist()]
    assert torch.equal(s_tri[untouched], s_before[untouched])
    if -1 in slots.tolist():
        pad = slots.tolist().index(-1)
        lo, hi = sum(lens[:pad]), sum(lens[:pad + 1])
        assert not o_tri[lo:hi].any()


def test_prefill_split_equals_whole(gen, device):
    """Chunked prefill: 130 tokens prefilled as 70 + 60 (the second part continuing the slot's state) equal one
    prefill of 130."""
    q, k, v, g, beta, _, state = _inputs(gen, [130], 2, 4, 32, 16)
    slot = torch.tensor([5], dtype=torch.int32, device=device)
    d = [x.to(device) for x in (q, k, v, g, beta)]
    whole = state.to(device).clone()
    o_whole = gd._gated_delta_prefill_triton(*d, torch.tensor([0, 130], dtype=torch.int32, device=device), whole,
                                             slot, None, 32**-0.5, True)
    split = state.to(device).clone()
    outs = [gd._gated_delta_prefill_triton(*(x[lo:hi] for x in d), torch.tensor([0, hi - lo], dtype=torch.int32,
                                           device=device), split, slot, None, 32**-0.5, True)
            for lo, hi in ((0, 70), (70, 130))]
    assert_close(torch.cat(outs), o_whole)
    assert_close(split, whole)


def test_strided_views_of_the_conv_output(gen, device):
    """q, k, v as column views of one [T, 2 * Hk * Dk + Hv * Dv] tensor (the conv output the model splits), g and
    beta as views of a wider projection: the same results as contiguous copies, prefill and decode."""
    lens, hk, hv, dk, dv = (5, 70), 2, 4, 16, 16
    q, k, v, g, beta, cu, state = _inputs(gen, lens, hk, hv, dk, dv)
    t = sum(lens)
    mixed = torch.cat((q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)), dim=1).to(device)
    qs = mixed[:, : hk * dk].view(t, hk, dk)
    ks = mixed[:, hk * dk: 2 * hk * dk].view(t, hk, dk)
    vs = mixed[:, 2 * hk * dk:].view(t, hv, dv)
    gb = torch.cat((g, beta), dim=1).to(device)
    slots = torch.tensor([4, 0], dtype=torch.int32, device=device)
    s1, s2 = state.clone().to(device), state.clone().to(device)
    o1 = gd._gated_delta_prefill_triton(qs, ks, vs, gb[:, :hv], gb[:, hv:], cu.to(device), s1, slots, None, 0.25, True)
    d = [x.to(device) for x in (q, k, v, g, beta)]
    o2 = gd._gated_delta_prefill_triton(*d, cu.to(device), s2, slots, None, 0.25, True)
    assert_close(o1, o2)
    assert_close(s1, s2)
    every6 = slice(0, 12, 6)  # rows 0 and 6 as views (a token stride 6 times the row's)
    od1 = gd._gated_delta_decode_triton(qs[every6], ks[every6], vs[every6], gb[every6, :hv], gb[every6, hv:], s1,
                                        slots, 0.25, True)
    od2 = gd._gated_delta_decode_triton(*(x[every6].contiguous() for x in d), s2, slots, 0.25, True)
    assert_close(od1, od2)
    assert_close(s1, s2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_continues_prefill(dtype, gen, device):
    """Prefill 63 and 5 tokens, then 3 decode steps of both (a padding row in the batch): outputs and states equal
    one prefill of 66 and 8 tokens (the first crosses a chunk boundary during decode)."""
    lens, steps, hk, hv, dk, dv = (63, 5), 3, 2, 4, 32, 16
    full = [n + steps for n in lens]
    q, k, v, g, beta, cu_full, state = _inputs(gen, full, hk, hv, dk, dv, dtype)
    slots = torch.tensor([6, 1], dtype=torch.int32)
    s_ref = state.clone()
    o_ref = ref.gated_delta_prefill_ref(q, k, v, g, beta, cu_full, s_ref, slots, None, dk**-0.5, True)
    starts = cu_full[:-1].tolist()
    pre = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)])
    cu = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32)
    dev = lambda x: x.to(device)  # noqa: E731
    s_tri = dev(state.clone())
    o_pre = gd._gated_delta_prefill_triton(*(dev(x[pre]) for x in (q, k, v, g, beta)), dev(cu), s_tri, dev(slots),
                                           None, dk**-0.5, True).cpu()
    outs = [o_pre]
    for step in range(steps):
        rows = torch.tensor([starts[0] + lens[0] + step, 0, starts[1] + lens[1] + step])  # row 1: padding
        o = gd._gated_delta_decode_triton(*(dev(x[rows]) for x in (q, k, v, g, beta)), s_tri,
                                          dev(torch.tensor([slots[0], -1, slots[1]], dtype=torch.int32)),
                                          dk**-0.5, True).cpu()
        assert not o[1].any()
        outs.append(o[[0, 2]])
    got = torch.cat([outs[0][: lens[0]], *(o[:1] for o in outs[1:]), outs[0][lens[0]:], *(o[1:] for o in outs[1:])])
    assert_close(got, o_ref)
    if dtype == torch.float32:
        assert_close(s_tri.cpu(), s_ref)
    else:
        torch.testing.assert_close(s_tri.cpu(), s_ref, **BF16_STATE)


def test_decode_matches_transformers_recurrent(gen, device):
    """One decode step over a batch of slots equals transformers' torch_recurrent_gated_delta_rule."""
    q, k, v, g, beta, _, state = _inputs(gen, [4], 2, 4, 32, 16)
    slots = torch.tensor([7, 0, 3, 2], dtype=torch.int32)
    s = state.clone().to(device)
    o = gd._gated_delta_decode_triton(*(x.to(device) for x in (q, k, v, g, beta)), s, slots.to(device), 32**-0.5,
                                      True).cpu()
    o_hf, s_hf = hf.torch_recurrent_gated_delta_rule(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None],
                                                     initial_state=state[slots.long()], output_final_state=True,
                                                     use_qk_l2norm_in_kernel=True)
    assert_close(o, o_hf[:, 0])
    assert_close(s.cpu()[slots.long()], s_hf)


def test_registered_ops_and_checks(gen, monkeypatch):
    """torch.ops.tokenfab.gated_delta_{prefill,decode}: the reference on CPU by default, the Triton kernels under
    TOKENFAB_KERNELS=triton, both updating the state in place; bad shapes raise ValueError on both paths."""
    q, k, v, g, beta, cu, state = _inputs(gen, [9, 3], 1, 2, 16, 16)
    slots = torch.tensor([2, 4], dtype=torch.int32)
    results = []
    for mode in ("auto", "triton"):
        monkeypatch.setenv("TOKENFAB_KERNELS", mode)
        s = state.clone()
        o = torch.ops.tokenfab.gated_delta_prefill(q, k, v, g, beta, cu, s, slots, None, 16**-0.5, True)
        od = torch.ops.tokenfab.gated_delta_decode(q[:2], k[:2], v[:2], g[:2], beta[:2], s, slots, 16**-0.5, True)
        results.append((o, od, s))
        with pytest.raises(ValueError, match="state must be float32"):
            torch.ops.tokenfab.gated_delta_decode(q[:2], k[:2], v[:2], g[:2], beta[:2], s.double(), slots, 1.0, True)
    for a, b in zip(*results):
        assert_close(a, b)
    assert not torch.equal(results[0][2], state)


def test_opcheck_and_eager_entry_points(gen):
    """torch.library.opcheck (schema, fake, declared mutation of the state) on both ops; the eager entry points
    layers will call (tokenfab.kernels.gated_delta_*) give the reference's results."""
    import tokenfab.kernels as kernels

    q, k, v, g, beta, cu, state = _inputs(gen, [5, 2], 1, 2, 16, 16)
    slots = torch.tensor([3, 1], dtype=torch.int32)
    torch.library.opcheck(torch.ops.tokenfab.gated_delta_prefill.default,
                          (q, k, v, g, beta, cu, state.clone(), slots, torch.tensor([True, False]), 0.25, True))
    torch.library.opcheck(torch.ops.tokenfab.gated_delta_decode.default,
                          (q[:2], k[:2], v[:2], g[:2], beta[:2], state.clone(), slots, 0.25, True))
    s1, s2 = state.clone(), state.clone()
    assert_close(kernels.gated_delta_prefill(q, k, v, g, beta, cu, s1, slots, None, 0.25, True),
                 ref.gated_delta_prefill_ref(q, k, v, g, beta, cu, s2, slots, None, 0.25, True))
    assert torch.equal(s1, s2)


@pytest.fixture(scope="module", params=[
    pytest.param([("gated_delta_hopper_compile.py", ("--quick",))], id="quick"),
    pytest.param([("gated_delta_hopper_compile.py", ())], id="full", marks=pytest.mark.slow)])
def hopper_runs(request) -> list:
    return request.param


PREFILL_KERNELS = ("_gdn_chunk_state_kernel", "_gdn_chunk_output_kernel")
FP32_PREFILL_KERNELS = ("_gdn_fp32_state_kernel", "_gdn_fp32_output_kernel")


def test_hopper_compile(hopper_batch, hopper_runs):
    """Every kernel of gated_delta.py, gated_delta_fp32.py and causal_conv1d.py compiles for sm_90 at Qwen3-Next
    sizes; the prefill's 16-bit products are warp-group MMAs, float32 inputs take the float32 passes (exact FMA
    products); no spills, registers and shared memory within budget."""
    from triton.runtime.jit import JITFunction

    from tests.kernels.gated_delta_hopper_compile import kernel_modules

    records = hopper_batch(hopper_runs)
    defined = {name for mod in kernel_modules() for name, obj in vars(mod).items()
               if isinstance(obj, JITFunction) and name.endswith("_kernel")}
    assert defined <= {r["kernel"] for r in records}
    bf16_prefill = [r for r in records if r["kernel"] in PREFILL_KERNELS and "bf16" in r["workload"]]
    assert {r["kernel"] for r in bf16_prefill} == set(PREFILL_KERNELS)
    assert all(r["hgmma"] > 0 for r in bf16_prefill)
    fp32_prefill = {r["kernel"] for r in records if "gdn prefill fp32" in r["workload"]}
    assert fp32_prefill == set(FP32_PREFILL_KERNELS)
    assert_fits_hopper(records)
