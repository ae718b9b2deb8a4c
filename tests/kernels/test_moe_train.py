"""MoE training kernels (kernels/moe_train.py): the grouped GEMM's forward and backward (d input,
d weight) and the SwiGLU experts built on it, values and every gradient against autograd through
per-expert-loop references (ours and Hugging Face's ``Qwen3MoeExperts``), on the Triton path (the
interpreter on CPU) and the default path, fp32 and bf16."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.tiers import tiered
from tests.kernels.tolerances import assert_train_close
from tokenfab.kernels import moe_train as M

F32, BF16 = torch.float32, torch.bfloat16


PATHS = ["triton", "torch"]


@pytest.fixture(params=PATHS)
def path(request, monkeypatch) -> str:
    monkeypatch.setenv("TOKENFAB_KERNELS", request.param)
    return request.param


def _grads(fn, inputs, upstream):
    for x in inputs:
        x.grad = None
    out = fn()
    out.backward(upstream)
    return out.detach(), [x.grad.clone() for x in inputs]


GROUPED = [
    # K, N, counts per expert
    (32, 48, [5, 0, 1, 7]),  # a zero-row expert in the middle
    (40, 24, [0, 0, 3]),  # leading empty experts, K not a multiple of the block
    (64, 130, [150, 2]),  # several row tiles for one expert, N over one column tile
    (16, 16, [1]),  # one row
    (24, 40, [0, 9, 0, 0, 70, 0]),
]


def _slow_grouped(path, k, n, counts, dtype) -> bool:
    """Slow tier: the Triton path's fp32 runs of the many-tile case (bf16 tiles it too) and of the
    six-expert case (the same path as the first case's)."""
    return path == "triton" and dtype == F32 and GROUPED.index((k, n, counts)) in (2, 4)


@pytest.mark.parametrize("path,k,n,counts,dtype", tiered(
    [(p, *case, dtype) for p in PATHS for case in GROUPED for dtype in (F32, BF16)], _slow_grouped), indirect=["path"])
def test_grouped_gemm(k, n, counts, dtype, path, device, gen):
    t, e = sum(counts), len(counts)
    x = torch.randn(t, k, generator=gen).to(device, dtype).requires_grad_()
    w = (0.3 * torch.randn(e, n, k, generator=gen)).to(device, dtype).requires_grad_()
    c = torch.tensor(counts).to(device)
    dy = torch.randn(t, n, generator=gen).to(device, dtype)
    y, (dx, dw) = _grads(lambda: M.grouped_gemm_train(x, w, c), [x, w], dy)
    y_ref, (dx_ref, dw_ref) = _grads(lambda: M.grouped_gemm_train_ref(x, w, c), [x, w], dy)
    assert_train_close(y, y_ref)
    assert_train_close(dx, dx_ref)
    assert_train_close(dw, dw_ref)
    for ex, cnt in enumerate(counts):
        if cnt == 0:
            assert torch.count_nonzero(dw[ex]) == 0


def test_grouped_kernels_direct(device, gen):
    """The launchers themselves (no autograd): the d-input GEMM reads w untransposed, dw of an empty expert is 0."""
    counts = torch.tensor([3, 0, 4]).to(device)
    x = torch.randn(7, 20, generator=gen).to(device)
    w = torch.randn(3, 12, 20, generator=gen).to(device)
    dy = torch.randn(7, 12, generator=gen).to(device)
    starts = [0, 3, 3]
    y = M._grouped_mm_triton(x, w, counts, transpose_w=True)
    dx = M._grouped_mm_triton(dy, w, counts, transpose_w=False)
    dw = M._grouped_wgrad_triton(dy, x, counts, 3)
    for ex, (s, cnt) in enumerate(zip(starts, counts.tolist())):
        assert_train_close(y[s:s + cnt], x[s:s + cnt] @ w[ex].T)
        assert_train_close(dx[s:s + cnt], dy[s:s + cnt] @ w[ex])
        assert_train_close(dw[ex], dy[s:s + cnt].T @ x[s:s + cnt])
    assert M._grouped_mm_triton(x[:0], w, torch.zeros(3, dtype=torch.long, device=device), True).shape == (0, 12)


EXPERTS = [
    # t, h, inter, e, k, act
    (19, 40, 24, 6, 2, "silu"),
    (1, 32, 16, 4, 1, "silu"),  # one token, top-1
    (33, 24, 20, 8, 1, "gelu"),
    (70, 64, 48, 5, 2, "silu"),  # > one row tile per expert
]


def _experts_inputs(t, h, inter, e, k, dtype, device, gen):
    hid = torch.randn(t, h, generator=gen).to(device, dtype).requires_grad_()
    wgu = (0.2 * torch.randn(e, 2 * inter, h, generator=gen)).to(device, dtype).requires_grad_()
    wd = (0.2 * torch.randn(e, h, inter, generator=gen)).to(device, dtype).requires_grad_()
    # distinct experts per token, the last expert never chosen (zero rows)
    ids = torch.stack([torch.randperm(e - 1, generator=gen)[:k] for _ in range(t)]).to(device)
    tw = torch.rand(t, k, generator=gen).to(device).requires_grad_()
    return hid, ids, tw, wgu, wd


def _slow_experts(path, t, h, inter, e, k, act, dtype) -> bool:
    """Slow tier: the 70-token case (its several row tiles are test_grouped_gemm's fast many-tile
    case); on the Triton path the 19-token silu top-2 case (the fast HF-oracle test runs top-2 silu in
    fp32, the autocast test in bf16) and the gelu case's fp32 run (both dtypes stay on the one-token case)."""
    n = EXPERTS.index((t, h, inter, e, k, act))
    return n == 3 or (path == "triton" and (n == 0 or (n, dtype) == (2, F32)))


@pytest.mark.parametrize("path,t,h,inter,e,k,act,dtype", tiered(
    [(p, *case, dtype) for p in PATHS for case in EXPERTS for dtype in (F32, BF16)], _slow_experts),
    indirect=["path"])
def test_moe_experts(t, h, inter, e, k, act, dtype, path, device, gen):
    hid, ids, tw, wgu, wd = _experts_inputs(t, h, inter, e, k, dtype, device, gen)
    dy = torch.randn(t, h, generator=gen).to(device, dtype)
    leaves = [hid, tw, wgu, wd]
    out, grads = _grads(lambda: M.moe_experts_train(hid, ids, tw, wgu, wd, act), leaves, dy)
    out_ref, grads_ref = _grads(lambda: M.moe_experts_train_ref(hid, ids, tw, wgu, wd, act), leaves, dy)
    assert_train_close(out, out_ref)
    for g, g_ref in zip(grads, grads_ref):
        assert_train_close(g, g_ref)
    assert torch.count_nonzero(grads[2][-1]) == 0 and torch.count_nonzero(grads[3][-1]) == 0
    # deterministic: a second run gives the same bits
    out2, grads2 = _grads(lambda: M.moe_experts_train(hid, ids, tw, wgu, wd, act), leaves, dy)
    assert torch.equal(out, out2) and all(torch.equal(a, b) for a, b in zip(grads, grads2))


def test_matches_hf_qwen3_moe_experts(path, device, gen):
    """An independent oracle: Hugging Face's per-expert loop, with its weights and routing."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=24, num_experts=6, num_experts_per_tok=2)
    hf = Qwen3MoeExperts(cfg).to(device)
    with torch.no_grad():
        hf.gate_up_proj.copy_(0.2 * torch.randn(hf.gate_up_proj.shape, generator=gen))
        hf.down_proj.copy_(0.2 * torch.randn(hf.down_proj.shape, generator=gen))
    hid, ids, tw, _, _ = _experts_inputs(23, 32, 24, 6, 2, F32, device, gen)
    dy = torch.randn(23, 32, generator=gen).to(device)
    leaves = [hid, tw, hf.gate_up_proj, hf.down_proj]
    out, grads = _grads(lambda: M.moe_experts_train(hid, ids, tw, hf.gate_up_proj, hf.down_proj), leaves, dy)
    out_ref, grads_ref = _grads(lambda: hf(hid, ids, tw), leaves, dy)
    assert_train_close(out, out_ref)
    for g, g_ref in zip(grads, grads_ref):
        assert_train_close(g, g_ref)


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(act="relu"), "act must be"),
        (dict(topk_ids=torch.tensor([[0, 4], [1, 2], [3, 3]])), "topk_ids must lie"),
        (dict(topk_ids=torch.tensor([[0], [1], [2]])), "topk ids"),
        (dict(w_down=torch.randn(4, 8, 5)), "do not fit"),
        (dict(hidden=torch.randn(3, 8, 1)), "expected hidden"),
        (dict(hidden=torch.randn(3, 8, dtype=BF16)), "share a dtype"),
    ],
)
def test_bad_input(change, match):
    args = dict(hidden=torch.randn(3, 8), topk_ids=torch.tensor([[0, 1], [1, 2], [3, 0]]),
                topk_weights=torch.rand(3, 2), w_gate_up=torch.randn(4, 12, 8), w_down=torch.randn(4, 8, 6))
    args.update(change)
    with pytest.raises(ValueError, match=match):
        M.moe_experts_train(**args)


def test_grouped_bad_counts():
    with pytest.raises(ValueError, match="sum to"):
        M.grouped_gemm_train(torch.randn(5, 4), torch.randn(2, 3, 4), torch.tensor([2, 2]))
    with pytest.raises(ValueError, match="counts must be"):
        M.grouped_gemm_train(torch.randn(5, 4), torch.randn(2, 3, 4), torch.tensor([2.0, 3.0]))


def test_hf_qwen3_moe_model_patched(path, device, gen, monkeypatch):
    """A tiny Qwen3-MoE causal LM with its experts' forward replaced by ``hf_experts_forward``: the
    same loss and the same gradient for every parameter as the unpatched model."""
    import types

    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         num_experts=6, num_experts_per_tok=2, norm_topk_prob=True)
    model = Qwen3MoeForCausalLM(cfg).float().to(device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "experts" in name or "gate.weight" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    ids = torch.randint(0, 97, (2, 13), generator=gen).to(device)

    def loss_and_grads():
        model.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    loss_ref, grads_ref = loss_and_grads()
    for layer in model.model.layers:
        layer.mlp.experts.forward = types.MethodType(M.hf_experts_forward, layer.mlp.experts)
    calls = []
    real = M.moe_experts_train
    monkeypatch.setattr(M, "moe_experts_train", lambda *a: calls.append(a[-1]) or real(*a))
    loss, grads = loss_and_grads()
    assert calls == ["silu", "silu"]  # both layers ran our experts
    assert_train_close(loss, loss_ref)
    assert grads.keys() == grads_ref.keys()
    for name in grads_ref:
        assert_train_close(grads[name], grads_ref[name])


def test_no_tokens(path, device):
    hid = torch.zeros(0, 8, device=device, requires_grad=True)
    wgu = torch.randn(3, 10, 8, device=device, requires_grad=True)
    wd = torch.randn(3, 8, 5, device=device, requires_grad=True)
    out = M.moe_experts_train(hid, torch.zeros(0, 2, dtype=torch.long, device=device),
                              torch.zeros(0, 2, device=device), wgu, wd)
    assert out.shape == (0, 8)
    out.sum().backward()
    assert wgu.grad is None or torch.count_nonzero(wgu.grad) == 0


def test_autocast_master_weights(path, device, gen):
    """fp32 weights under bf16 autocast: the experts run in bf16 (as autocast's F.linear in HF's loop)
    and the gradients reach the fp32 leaves."""
    hid, ids, tw, wgu, wd = _experts_inputs(17, 32, 24, 5, 2, F32, device, gen)
    dy = torch.randn(17, 32, generator=gen).to(device, BF16)
    leaves = [hid, tw, wgu, wd]
    with torch.autocast(device.type, dtype=BF16):
        out, grads = _grads(lambda: M.moe_experts_train(hid, ids, tw, wgu, wd), leaves, dy)
    bf = [x.detach().to(BF16).requires_grad_() for x in (hid, wgu, wd)]
    tw_ref = tw.detach().clone().requires_grad_()
    out_ref, grads_ref = _grads(lambda: M.moe_experts_train_ref(bf[0], ids, tw_ref, bf[1], bf[2]),
                                [bf[0], tw_ref, bf[1], bf[2]], dy)
    assert out.dtype == BF16
    assert_train_close(out, out_ref)
    for g, g_ref in zip(grads, grads_ref):
        assert g.dtype == F32
        assert_train_close(g, g_ref.float(), BF16)
