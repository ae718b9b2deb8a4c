"""DeepSeek-V4's clamped SiLU expert activation (``silu_clamp``: silu(min(g, limit)) * clamp(u, -limit, limit))
in the fused MoE kernels, in the interpreter against their references: the bf16/fp32 grouped-GEMM MoE and the
W4A16 MoE with MXFP4 experts (the FP4 experts' kernel); inputs large enough that both clamps bite."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.test_w4a16_moe import make_experts, routing
from tests.kernels.tolerances import assert_close
from tokenfab.kernels import moe, moe_w4a16
from tokenfab.kernels.moe_gemm import moe_activation_ref


def test_reference_is_the_clamped_silu():
    gu = torch.tensor([[-3.0, 0.5, 4.0, -4.0, 0.2, 2.5]])  # gate | up, limit 1
    g, u = gu[:, :3].clamp(max=1.0), gu[:, 3:].clamp(-1.0, 1.0)
    torch.testing.assert_close(moe_activation_ref(gu, "silu_clamp", limit=1.0), F.silu(g) * u)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,e,k,h,i", [(1, 4, 2, 64, 32), (37, 8, 3, 80, 48)])
def test_fused_experts_silu_clamp(t, e, k, h, i, dtype):
    gen = torch.Generator().manual_seed(t * 100 + e)
    x = (2 * torch.randn(t, h, generator=gen)).to(dtype)
    w13 = (torch.randn(e, 2 * i, h, generator=gen) * 0.2).to(dtype)
    w2 = (torch.randn(e, h, i, generator=gen) * 0.2).to(dtype)
    w, ids = routing(t, e, k, gen)
    gate_up = torch.einsum("th,eih->tei", x.float(), w13.float())
    assert (gate_up.abs() > 1.0).float().mean() > 0.2  # the clamp at 1.0 bites
    out = moe._fused_experts_triton(x, w13, w2, w, ids, None, None, "silu_clamp", 1.702, 1.0)
    ref = moe.fused_experts_ref(x, w13, w2, w, ids, None, None, "silu_clamp", 1.702, 1.0)
    assert_close(out, ref, dtype)
    assert (ref - moe.fused_experts_ref(x, w13, w2, w, ids, None, None, "silu")).abs().max() > 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_experts_silu_clamp(dtype):
    gen = torch.Generator().manual_seed(7)
    t, e, k, h, i = 9, 4, 2, 64, 32
    (q13, s13, _), (q2, s2, _) = make_experts("mxfp4", e, h, i, gen)
    x = (torch.randn(t, h, generator=gen) * 2).to(dtype)
    tw, ids = routing(t, e, k, gen)
    args = (x, q13, s13, q2, s2, tw, ids, None, None, None, None, "mxfp4", "silu_clamp", 1.702, 1.0)
    assert_close(moe_w4a16._fused_experts_w4a16_triton(*args), moe_w4a16.fused_experts_w4a16_ref(*args))
