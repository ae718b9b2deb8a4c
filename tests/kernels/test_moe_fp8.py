"""The block-FP8 fused MoE (kernels/moe_fp8.py) in the interpreter against its reference, and the
reference against the plain bf16/fp32 MoE on the dequantized experts."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.tolerances import assert_close
from tokenfab.kernels import moe, moe_fp8, quant

FP8 = torch.float8_e4m3fn


def _experts(gen, e, h, i, block_rows):
    """float8 experts and scale grids as FP8Experts holds them (block_rows 128: stacked block grids; 1: per row)."""
    w13 = (torch.randn(e, 2 * i, h, generator=gen) * 4).clamp(-448, 448).to(FP8)
    w2 = (torch.randn(e, h, i, generator=gen) * 4).clamp(-448, 448).to(FP8)
    kb_h, kb_i = -(-h // 128), -(-i // 128)
    rows13 = 2 * i // 128 if block_rows == 128 else 2 * i
    s13 = torch.rand(e, rows13, kb_h, generator=gen) * 0.02 + 0.005
    s2 = torch.rand(e, -(-h // 128), kb_i, generator=gen) * 0.02 + 0.005
    return w13, s13, w2, s2


def _route(gen, t, e, k):
    logits = torch.randn(t, e, generator=gen)
    return moe.topk_softmax_ref(logits, k, True)


@pytest.mark.parametrize("t,e,k,h,i,block_rows", [
    (0, 4, 2, 128, 128, 128),   # no tokens
    (1, 4, 2, 96, 64, 1),       # one token; H and I off the 128 grid (per-row gate/up scales)
    (5, 8, 2, 200, 128, 128),   # experts with zero tokens; K of gate_up 200 (second block zero-padded)
    (40, 4, 3, 256, 256, 128),  # 64-row tiles
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_experts_fp8(device, gen, t, e, k, h, i, block_rows, dtype):
    x = torch.randn(t, h, generator=gen).to(dtype)
    w13, s13, w2, s2 = _experts(gen, e, h, i, block_rows)
    weights, ids = _route(gen, t, e, k)
    args = (w13, s13, w2, s2, block_rows, 128)
    got = moe_fp8._fused_experts_fp8_triton(x.to(device), *(a.to(device) if torch.is_tensor(a) else a for a in args),
                                            weights.to(device), ids.to(device))
    ref = moe_fp8.fused_experts_fp8_ref(x, *args, weights, ids)
    assert got.shape == (t, h)
    assert_close(got, ref)
    if t:  # the reference is the plain MoE on dequantized experts and float8-rounded activations
        deq13 = torch.stack([quant.dequantize_fp8(w13[j], s13[j], block_rows, torch.float32) for j in range(e)])
        deq2 = torch.stack([quant.dequantize_fp8(w2[j], s2[j], 128, torch.float32) for j in range(e)])
        plain = moe.fused_experts_ref(x.float(), deq13, deq2, weights, ids)
        rel = float((ref.float() - plain).norm() / plain.norm())
        assert rel < 0.08, rel  # e4m3 activations (3 mantissa bits), twice
