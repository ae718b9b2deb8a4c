"""MoE kernels (routing, align, fused experts, sum) against their references, in Triton's interpreter
on CPU (or compiled on a GPU); the FusedMoE layer through both paths; the Hopper compile check."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.hopper_harness import assert_fits_hopper
from tests.kernels.tolerances import assert_close
from tokenfab.kernels import moe
from tokenfab.layers.moe import FusedMoE, GatedMLP

F32, BF16 = torch.float32, torch.bfloat16


def _distinct_logits(t: int, e: int, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """Rows of distinct values, exact in bf16 (multiples of 1/16 below 16): no ties in top-k."""
    rows = [torch.randperm(e, generator=gen) for _ in range(t)]
    x = torch.stack(rows).float() if t else torch.empty(0, e)
    return ((x - e // 2) / 16).to(dtype)


# ----------------------------------------------------------------------------- routing


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("t,e,k", [(1, 8, 1), (7, 8, 8), (64, 60, 4), (300, 128, 8), (33, 128, 2)])
def test_topk_softmax(t, e, k, renormalize, dtype, device, gen):
    if dtype == F32:
        logits = torch.randn(t, e, generator=gen)
    else:
        logits = _distinct_logits(t, e, gen, dtype)
    logits = logits.to(device)
    w, ids = moe._topk_softmax_triton(logits, k, renormalize)
    w_ref, ids_ref = moe.topk_softmax_ref(logits, k, renormalize)
    assert ids.dtype == torch.int32 and w.dtype == F32
    assert torch.equal(ids.cpu(), ids_ref.cpu())
    assert_close(w, w_ref, F32)


def test_topk_softmax_empty_and_strided(device, gen):
    w, ids = moe._topk_softmax_triton(torch.empty(0, 16, device=device), 2, True)
    assert w.shape == (0, 2) and ids.shape == (0, 2)
    big = torch.randn(9, 40, generator=gen).to(device)
    logits = big[:, 4:36]  # a row stride of 40
    w, ids = moe._topk_softmax_triton(logits, 3, False)
    w_ref, ids_ref = moe.topk_softmax_ref(logits, 3, False)
    assert torch.equal(ids.cpu(), ids_ref.cpu())
    assert_close(w, w_ref, F32)


GROUPED = [
    # t, e, groups, topk_groups, k
    (1, 8, 1, 1, 2),
    (37, 64, 8, 3, 6),
    (300, 128, 8, 4, 8),
    (16, 256, 8, 4, 8),  # DeepSeek-V3's routing
    (9, 72, 8, 3, 5),  # groups of 9 experts (padded tiles)
    (20, 48, 6, 2, 1),
]


@pytest.mark.parametrize("scoring,bias", [("sigmoid", True), ("softmax", False), ("sigmoid", False)])
@pytest.mark.parametrize("t,e,g,tg,k", GROUPED)
def test_grouped_topk(t, e, g, tg, k, scoring, bias, device, gen):
    logits = torch.randn(t, e, generator=gen).to(device)
    corr = (0.1 * torch.randn(e, generator=gen)).to(device) if bias else None
    renorm, scale = (t % 2 == 1), 2.5
    w, ids = moe._grouped_topk_triton(logits, corr, k, g, tg, renorm, scale, scoring)
    w_ref, ids_ref = moe.grouped_topk_ref(logits, corr, k, g, tg, renorm, scale, scoring)
    assert torch.equal(ids.cpu(), ids_ref.cpu())
    assert_close(w, w_ref, F32)
    # every chosen expert lies in one of the topk_groups kept groups
    assert all(len(set((row // (e // g)).tolist())) <= tg for row in ids.cpu())


def test_grouped_topk_bf16_logits(device, gen):
    logits = _distinct_logits(40, 64, gen, BF16).to(device)
    corr = (0.1 * torch.randn(64, generator=gen)).to(device)
    w, ids = moe._grouped_topk_triton(logits, corr, 6, 8, 3, True, 1.0)
    w_ref, ids_ref = moe.grouped_topk_ref(logits, corr, 6, 8, 3, True, 1.0)
    assert torch.equal(ids.cpu(), ids_ref.cpu())
    assert_close(w, w_ref, F32)


def test_grouped_topk_rejects_bad_groups(device):
    logits = torch.zeros(2, 12, device=device)
    with pytest.raises(ValueError):
        moe.grouped_topk(logits, None, 2, 5, 1, True)  # 12 experts in 5 groups
    with pytest.raises(ValueError):
        moe.grouped_topk(logits, None, 8, 4, 2, True)  # 2 groups of 3 hold only 6 experts


# ----------------------------------------------------------------------------- align


def _ids(t: int, k: int, e: int, gen: torch.Generator, skew: bool = False) -> torch.Tensor:
    """Distinct experts per token (as routing gives); ``skew``: most tokens on a few experts."""
    if t == 0:
        return torch.empty(0, k, dtype=torch.int32)
    if skew:
        scores = torch.rand(t, e, generator=gen) + torch.linspace(2, 0, e) ** 4
    else:
        scores = torch.rand(t, e, generator=gen)
    return scores.topk(k, dim=1).indices.to(torch.int32)


@pytest.mark.parametrize("t,k,e,bm,skew", [
    (1, 1, 8, 16, False),
    (1, 8, 128, 16, False),  # 120 experts without pairs
    (37, 4, 16, 32, True),
    (300, 8, 128, 64, False),
    (300, 2, 8, 128, True),
    (513, 6, 60, 16, False),  # several chunks, non-power-of-two experts
])
def test_moe_align_block_size(t, k, e, bm, skew, device, gen):
    ids = _ids(t, k, e, gen, skew).to(device)
    got = moe._moe_align_block_size_triton(ids, e, bm)
    ref = moe.moe_align_block_size_ref(ids, e, bm)
    for a, b in zip(got, ref):
        assert a.dtype == torch.int32
        assert torch.equal(a.cpu(), b.cpu())
    # the reference's contract: every pair once, runs aligned, tiles of one expert
    sorted_ids, expert_ids, npost = (x.cpu() for x in ref)
    n = t * k
    total = int(npost)
    assert total % bm == 0 and sorted(sorted_ids[sorted_ids < n].tolist()) == list(range(n))
    assert (sorted_ids[total:] == n).all() and (expert_ids[total // bm :] == -1).all()
    flat = ids.cpu().reshape(-1).long()
    for tile in range(total // bm):
        pairs = sorted_ids[tile * bm : (tile + 1) * bm]
        pairs = pairs[pairs < n].long()
        assert len(pairs) > 0 and (flat[pairs] == expert_ids[tile]).all()


def test_moe_align_block_size_empty(device):
    ids = torch.empty(0, 4, dtype=torch.int32, device=device)
    sorted_ids, expert_ids, npost = moe._moe_align_block_size_triton(ids, 16, 16)
    assert sorted_ids.numel() == 0 and expert_ids.numel() == 0 and int(npost) == 0


# ----------------------------------------------------------------------------- fused experts


def _experts(e, h, i, dtype, bias, gen, device):
    w13 = (torch.randn(e, 2 * i, h, generator=gen) * h**-0.5).to(dtype).to(device)
    w2 = (torch.randn(e, h, i, generator=gen) * i**-0.5).to(dtype).to(device)
    b13 = torch.randn(e, 2 * i, generator=gen).to(dtype).to(device) if bias else None
    b2 = torch.randn(e, h, generator=gen).to(dtype).to(device) if bias else None
    return w13, w2, b13, b2


FUSED = [
    # t, e, k, h, i, activation, bias
    (1, 8, 1, 64, 32, "silu", False),
    (5, 8, 8, 64, 32, "swiglu_oai", True),  # every token on every expert
    (37, 16, 4, 80, 48, "swiglu_oai", True),  # K not a multiple of the K tile, N tiles masked
    (64, 128, 8, 64, 32, "silu", False),  # many experts without tokens
    (300, 8, 4, 64, 32, "silu", True),  # 150 rows per expert: the 128-row tiles
    (300, 128, 8, 32, 16, "silu", False),
]


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("t,e,k,h,i,act,bias", FUSED)
def test_fused_experts(t, e, k, h, i, act, bias, dtype, device, gen):
    x = torch.randn(t, h, generator=gen).to(dtype).to(device)
    w13, w2, b13, b2 = _experts(e, h, i, dtype, bias, gen, device)
    w, ids = moe.topk_softmax_ref(torch.randn(t, e, generator=gen), k, True)
    w, ids = w.to(device), ids.to(device)
    out = moe._fused_experts_triton(x, w13, w2, w, ids, b13, b2, act, 1.702, 7.0)
    ref = moe.fused_experts_ref(x, w13, w2, w, ids, b13, b2, act, 1.702, 7.0)
    assert_close(out, ref, dtype)


def test_fused_experts_skewed_and_clamped(device, gen):
    """All tokens on two experts (the rest idle), gate/up large enough that the SwiGLU clamp bites."""
    t, e, k, h, i = 40, 16, 2, 64, 32
    x = (4 * torch.randn(t, h, generator=gen)).to(device)
    w13, w2, b13, b2 = _experts(e, h, i, F32, True, gen, device)
    ids = torch.tensor([[3, 11]] * t, dtype=torch.int32, device=device)
    w = torch.rand(t, k, generator=gen).to(device)
    out = moe._fused_experts_triton(x, w13, w2, w, ids, b13, b2, "swiglu_oai", 1.702, 1.5)
    ref = moe.fused_experts_ref(x, w13, w2, w, ids, b13, b2, "swiglu_oai", 1.702, 1.5)
    assert_close(out, ref, F32)


def test_fused_experts_forced_large_tiles_fp32(device, gen):
    """The 128-row / 8-warp tiles, on fp32 inputs (normally picked for bf16 prefill only)."""
    t, e, k, h, i = 50, 4, 2, 64, 32
    x = torch.randn(t, h, generator=gen).to(device)
    w13, w2, b13, b2 = _experts(e, h, i, F32, False, gen, device)
    w, ids = moe.topk_softmax_ref(torch.randn(t, e, generator=gen), k, False)
    cfg = dict(BLOCK_M=128, gate_up=dict(BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=4),
               down=dict(BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4))
    out = moe._fused_experts_triton(x, w13, w2, w.to(device), ids.to(device), config=cfg)
    assert_close(out, moe.fused_experts_ref(x, w13, w2, w.to(device), ids.to(device)), F32)


def test_fused_experts_empty(device):
    w13 = torch.zeros(4, 64, 32, device=device)
    w2 = torch.zeros(4, 32, 32, device=device)
    out = moe._fused_experts_triton(torch.empty(0, 32, device=device), w13, w2,
                                    torch.empty(0, 2, device=device),
                                    torch.empty(0, 2, dtype=torch.int32, device=device))
    assert out.shape == (0, 32)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_moe_sum(dtype, device, gen):
    x = torch.randn(13, 3, 1100, generator=gen).to(dtype).to(device)
    assert_close(moe._moe_sum_triton(x), moe.moe_sum_ref(x), dtype)


def test_fused_experts_rejects_bad_shapes(device):
    x = torch.zeros(3, 32, device=device)
    ids = torch.zeros(3, 2, dtype=torch.int32, device=device)
    w = torch.zeros(3, 2, device=device)
    with pytest.raises(ValueError):
        moe.fused_experts(x, torch.zeros(4, 64, 32, device=device), torch.zeros(4, 32, 16, device=device), w, ids)
    with pytest.raises(ValueError):
        moe.fused_experts(x, torch.zeros(4, 64, 32, device=device), torch.zeros(4, 32, 32, device=device), w, ids,
                          activation="gelu")


# ----------------------------------------------------------------------------- the layer


def _layer(grouped: bool, shared: bool, gen: torch.Generator, device) -> FusedMoE:
    h, i, e = 64, 32, 16
    kw = dict(scoring="sigmoid", num_expert_groups=4, topk_groups=2, routed_scaling_factor=2.5,
              correction_bias=True) if grouped else {}
    with torch.device(device):
        layer = FusedMoE(h, i, e, 4, renormalize=True, router_bias=not grouped, expert_bias=not grouped,
                         shared_experts=GatedMLP(h, 48) if shared else None, shared_expert_gate=shared, **kw)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return layer


@pytest.mark.parametrize("grouped,shared", [(False, True), (True, False)])
def test_fused_moe_layer_triton_equals_torch(grouped, shared, device, gen, monkeypatch):
    layer = _layer(grouped, shared, gen, device)
    x = torch.randn(45, 64, generator=gen).to(device)
    monkeypatch.setenv("TOKENFAB_KERNELS", "triton")
    out_triton = layer(x)
    monkeypatch.setenv("TOKENFAB_KERNELS", "torch")
    out_torch = layer(x)
    assert_close(out_triton, out_torch, F32)
    # the layer's definition, spelled out: route, run each chosen expert, weight, sum, add shared
    w, ids = layer.route(x)
    expected = torch.zeros_like(x)
    i = layer.intermediate_size
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = layer.w13_weight[e] @ x[t] + (layer.w13_bias[e] if layer.w13_bias is not None else 0)
            y = layer.w2_weight[e] @ (torch.nn.functional.silu(gu[:i]) * gu[i:])
            expected[t] += w[t, j] * (y + (layer.w2_bias[e] if layer.w2_bias is not None else 0))
    if shared:
        expected += torch.sigmoid(layer.shared_expert_gate(x)) * layer.shared_experts(x)
    torch.testing.assert_close(out_torch, expected, atol=1e-4, rtol=1e-4)


def test_load_expert_weight_tracks_completeness():
    layer = FusedMoE(8, 4, 2, 1, expert_bias=True)
    assert layer.load_expert_weight("gate", torch.ones(4, 8), 0) == []
    assert layer.load_expert_weight("up", torch.ones(4, 8), 0) == []
    assert layer.load_expert_weight("w2", torch.ones(2, 8, 4)) == ["w2_weight"]
    assert layer.load_expert_weight("gate", torch.ones(4, 8), 1) == []
    assert layer.load_expert_weight("up", 2 * torch.ones(4, 8), 1) == ["w13_weight"]
    assert torch.equal(layer.w13_weight[1, 4:], 2 * torch.ones(4, 8))
    with pytest.raises(ValueError):
        layer.load_expert_weight("down", torch.ones(4, 8), 0)  # [H, I] is [8, 4]
    with pytest.raises(ValueError):
        layer.load_expert_weight("gate", torch.ones(4, 8), 2)  # no expert 2


# ----------------------------------------------------------------------------- Hopper compile


@pytest.fixture(scope="module", params=[
    pytest.param([("moe_hopper_compile.py", ("--quick",))], id="quick"),
    pytest.param([("moe_hopper_compile.py", ())], id="full", marks=pytest.mark.slow)])
def hopper_runs(request) -> list:
    """The fast tier compiles the script's --quick subset (routing, decode, the 8192-token tiles); the
    slow twin every workload (every tile bucket, Mixtral, fp32), with the same checks."""
    return request.param


@pytest.fixture(scope="module")
def hopper_records(hopper_batch, hopper_runs) -> list[dict]:
    return hopper_batch(hopper_runs)


def test_moe_kernels_compile_for_hopper(hopper_records):
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    defined = {n for n, o in vars(moe).items() if isinstance(o, (JITFunction, InterpretedFunction))
               and n.endswith("_kernel")}
    assert defined <= {r["kernel"] for r in hopper_records}
    assert_fits_hopper(hopper_records)


def test_fused_moe_large_tiles_use_hgmma(hopper_records):
    """At 8192 tokens (Qwen3-30B-A3B and GPT-OSS shapes) both grouped GEMMs run 128-row tiles on
    Hopper's warp-group MMA."""
    big = [r for r in hopper_records if "T=8192" in r["workload"]
           and r["kernel"] in ("_moe_gate_up_kernel", "_moe_down_kernel")]
    assert len(big) == 4
    for r in big:
        assert r["config"]["BLOCK_M"] == 128 and r["num_warps"] == 8, r
        assert r["hgmma"] > 0, f"{r['workload']} {r['kernel']}: no HGMMA in the SASS"
