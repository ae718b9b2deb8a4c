"""fused_experts_lora (multi-LoRA on MoE experts): the Triton path (interpreter on CPU) and the CPU path against
the reference; the reference against a per-token loop written from the equations; a base token's row equals the
plain experts'; the Triton path compiled for Hopper (sm_90) without spills."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.hopper_harness import assert_fits_hopper
from tests.kernels.tolerances import assert_close
from tokenfab.kernels import moe, moe_lora

F32, BF16 = torch.float32, torch.bfloat16

CASES = [  # tokens, experts, top-k, hidden, intermediate, rank, pool slots, activation, bias
    (1, 8, 2, 64, 32, 4, 1, "silu", False),
    (9, 8, 2, 64, 32, 8, 3, "silu", False),
    (13, 16, 4, 80, 48, 16, 4, "silu", True),  # K not a multiple of the K tile, masked N tiles
    (23, 4, 2, 48, 24, 3, 2, "swiglu_oai", True),  # odd rank
    (0, 8, 2, 64, 32, 4, 2, "silu", False),
]


def _problem(t, e, k, h, i, r, s, bias, dtype, gen, device):
    x = torch.randn(t, h, generator=gen)
    w13 = torch.randn(e, 2 * i, h, generator=gen) * h**-0.5
    w2 = torch.randn(e, h, i, generator=gen) * i**-0.5
    b13 = torch.randn(e, 2 * i, generator=gen) if bias else None
    b2 = torch.randn(e, h, generator=gen) if bias else None
    w, ids = moe.topk_softmax_ref(torch.randn(t, e, generator=gen), k, True)
    # A ~ unit rows out, B * A of the size of a trained delta (half the base weight's scale)
    pools = [torch.randn(e, s, r, h, generator=gen) * h**-0.5, torch.randn(e, s, i, r, generator=gen) * 0.5 * r**-0.5,
             torch.randn(e, s, r, h, generator=gen) * h**-0.5, torch.randn(e, s, i, r, generator=gen) * 0.5 * r**-0.5,
             torch.randn(e, s, r, i, generator=gen) * i**-0.5, torch.randn(e, s, h, r, generator=gen) * 0.5 * r**-0.5]
    slots = torch.randint(-1, s, (t,), generator=gen, dtype=torch.int32)

    def dev(v):
        return None if v is None else v.to(device).to(dtype) if v.is_floating_point() else v.to(device)

    return dev(x), dev(w13), dev(w2), w.to(device), ids.to(device), dev(slots), [dev(p) for p in pools], dev(b13), \
        dev(b2)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("t,e,k,h,i,r,s,act,bias", CASES)
def test_triton_matches_reference(t, e, k, h, i, r, s, act, bias, dtype, gen, device):
    x, w13, w2, w, ids, slots, pools, b13, b2 = _problem(t, e, k, h, i, r, s, bias, dtype, gen, device)
    out = moe_lora._fused_experts_lora_triton(x, w13, w2, w, ids, slots, *pools, b13, b2, act)
    ref = moe_lora.fused_experts_lora_ref(x, w13, w2, w, ids, slots, *pools, b13, b2, act)
    assert_close(out, ref, dtype)
    assert out.shape == (t, h)


@pytest.mark.parametrize("t,e,k,h,i,r,s,act,bias", CASES + [(80, 8, 2, 64, 32, 8, 4, "silu", False)])
def test_cpu_path_matches_reference(t, e, k, h, i, r, s, act, bias, gen):
    x, w13, w2, w, ids, slots, pools, b13, b2 = _problem(t, e, k, h, i, r, s, bias, F32, gen, "cpu")
    out = moe_lora.fused_experts_lora_cpu(x, w13, w2, w, ids, slots, *pools, b13, b2, act)
    assert_close(out, moe_lora.fused_experts_lora_ref(x, w13, w2, w, ids, slots, *pools, b13, b2, act), F32)


def test_reference_is_the_per_token_equation(gen):
    """Each token's experts with its own adapter's B A added to gate, up and down (written per token here)."""
    t, e, k, h, i, r, s = 6, 4, 2, 16, 8, 3, 2
    x, w13, w2, w, ids, slots, pools, _, _ = _problem(t, e, k, h, i, r, s, False, F32, gen, "cpu")
    ag, bg, au, bu, ad, bd = pools
    want = torch.zeros(t, h)
    for n in range(t):
        sl = int(slots[n])
        for j in range(k):
            ex = int(ids[n, j])
            g, u = w13[ex, :i] @ x[n], w13[ex, i:] @ x[n]
            if sl >= 0:
                g, u = g + bg[ex, sl] @ (ag[ex, sl] @ x[n]), u + bu[ex, sl] @ (au[ex, sl] @ x[n])
            hh = F.silu(g) * u
            y = w2[ex] @ hh + (bd[ex, sl] @ (ad[ex, sl] @ hh) if sl >= 0 else 0)
            want[n] += w[n, j] * y
    torch.testing.assert_close(moe_lora.fused_experts_lora_ref(x, w13, w2, w, ids, slots, *pools), want)


def test_base_tokens_equal_the_plain_experts(gen, device):
    x, w13, w2, w, ids, slots, pools, _, _ = _problem(11, 8, 2, 64, 32, 4, 2, False, F32, gen, device)
    slots = torch.tensor([-1, 0, -1, 1, -1, -1, 0, 1, -1, 0, -1], dtype=torch.int32, device=device)
    out = moe_lora._fused_experts_lora_triton(x, w13, w2, w, ids, slots, *pools)
    plain = moe.fused_experts_ref(x, w13, w2, w, ids)
    base = (slots < 0).cpu()
    assert_close(out.cpu()[base], plain.cpu()[base], F32)
    assert not torch.allclose(out.cpu()[~base], plain.cpu()[~base], atol=1e-3)  # adapters change the rest


def test_custom_op_dispatches_to_triton(monkeypatch, gen, device):
    monkeypatch.setenv("TOKENFAB_KERNELS", "triton")
    x, w13, w2, w, ids, slots, pools, _, _ = _problem(5, 8, 2, 32, 16, 4, 2, False, F32, gen, device)
    got = torch.ops.tokenfab.fused_experts_lora(x, w13, w2, w, ids, slots, *pools)
    assert_close(got, moe_lora.fused_experts_lora_ref(x, w13, w2, w, ids, slots, *pools), F32)


def test_bad_pools_are_refused(gen, device):
    x, w13, w2, w, ids, slots, pools, _, _ = _problem(3, 8, 2, 32, 16, 4, 2, False, F32, gen, device)
    pools[5] = pools[5][:, :, :8]  # down's B with the wrong output size
    with pytest.raises(ValueError, match="LoRA pool of down"):
        moe_lora._fused_experts_lora_triton(x, w13, w2, w, ids, slots, *pools)
    with pytest.raises(ValueError, match="token_slots"):
        moe_lora.fused_experts_lora_ref(x, w13, w2, w, ids, slots[:2], *pools)


@pytest.fixture(scope="module", params=[
    pytest.param([("moe_lora_hopper_compile.py", ("--quick",))], id="quick"),
    pytest.param([("moe_lora_hopper_compile.py", ())], id="full", marks=pytest.mark.slow)])
def hopper_runs(request) -> list:
    """The fast tier compiles decode and 2048-token prefill at a Qwen3-30B-A3B shape; the slow twin every workload."""
    return request.param


@pytest.fixture(scope="module")
def hopper_records(hopper_batch, hopper_runs) -> list[dict]:
    return hopper_batch(hopper_runs)


def test_compiles_for_hopper(hopper_records):
    kernels = {r["kernel"] for r in hopper_records}
    assert {"_moe_gate_up_kernel", "_lora_bgmv_kernel", "_moe_down_kernel", "_moe_sum_kernel"} <= kernels
    assert_fits_hopper(hopper_records)
    prefill = [r for r in hopper_records if "T=2048" in r["workload"] and r["kernel"] == "_moe_gate_up_kernel"]
    assert prefill and all(r["hgmma"] > 0 for r in prefill)  # the prefill tiles on Hopper's warp-group MMA
