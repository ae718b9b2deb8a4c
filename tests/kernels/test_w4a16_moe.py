"""Fused-MoE W4A16 (tokenfab/kernels/moe_w4a16.py): the Triton kernels (interpreter on CPU) against
the reference, and the reference against the bf16 fused-experts reference on the dequantized
weights (an independent path: moe_gemm's reference with full-precision stacked experts)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_w4a16 import make_weight
from tests.kernels.tiers import tiered
from tests.kernels.tolerances import assert_close
from tokenfab.kernels import moe_w4a16
from tokenfab.kernels.moe import fused_experts_ref
from tokenfab.kernels.w4a16 import as_bytes, dequantize_w4


def make_experts(codec: str, e: int, h: int, i: int, gen: torch.Generator):
    def stack(rows, cols):
        parts = [make_weight(codec, rows, cols, gen) for _ in range(e)]
        q = torch.stack([as_bytes(p[0]) for p in parts])
        s = torch.stack([p[1] for p in parts])
        g = torch.rand(e, generator=gen) * 0.02 + 0.01 if codec == "nvfp4" else None
        return q, s, g

    return stack(2 * i, h), stack(h, i)


def routing(t: int, e: int, k: int, gen: torch.Generator, skip: int | None = None):
    """Random distinct top-k ids (expert ``skip`` never chosen: it gets zero tokens) and weights."""
    choices = [x for x in range(e) if x != skip]
    ids = torch.stack([torch.tensor(choices)[torch.randperm(len(choices), generator=gen)[:k]] for _ in range(t)])
    w = torch.rand(t, k, generator=gen)
    return (w / w.sum(-1, keepdim=True)), ids.to(torch.int32)


CASES = [
    # (T, E, k, H, I, activation, bias)
    (1, 4, 2, 64, 32, "silu", False),
    (5, 6, 2, 96, 64, "silu", False),  # H not a multiple of the 64-wide K tile
    (33, 8, 3, 64, 96, "swiglu_oai", True),
    (4, 5, 2, 80, 48, "silu", False),  # H and I divisible by no K tile: the masked-K path
]


def _slow_case(t, e, k, h, i, act, bias, dtype, codec) -> bool:
    """Fast tier: every codec x dtype on the one-token case; one run of the unaligned-H and of the
    swiglu/bias case; the masked-K case for every codec (each its own scale group) in bf16."""
    n = CASES.index((t, e, k, h, i, act, bias))
    if n == 0:
        return False
    if n == 3:
        return dtype != torch.bfloat16
    return (codec, dtype) != (("int4", torch.float32) if n == 1 else ("int4", torch.bfloat16))


@pytest.mark.parametrize("t,e,k,h,i,act,bias,dtype,codec", tiered(
    [(*case, dtype, codec) for case in CASES for dtype in (torch.float32, torch.bfloat16)
     for codec in ("int4", "mxfp4", "nvfp4")], _slow_case))
def test_triton_matches_reference(codec, dtype, t, e, k, h, i, act, bias, device, gen):
    (q13, s13, g13), (q2, s2, g2) = make_experts(codec, e, h, i, gen)
    x = (torch.randn(t, h, generator=gen) * 0.5).to(dtype)
    tw, ids = routing(t, e, k, gen, skip=e - 1)
    b13 = torch.randn(e, 2 * i, generator=gen).to(dtype) if bias else None
    b2 = torch.randn(e, h, generator=gen).to(dtype) if bias else None
    args = (x, q13, s13, q2, s2, tw, ids, b13, b2, g13, g2, codec, act)
    want = moe_w4a16.fused_experts_w4a16_ref(*args)
    got = moe_w4a16._fused_experts_w4a16_triton(*[a.to(device) if isinstance(a, torch.Tensor) else a for a in args])
    assert_close(got, want.to(device))


@pytest.mark.parametrize("codec", ["int4", "mxfp4"])
def test_reference_equals_dequantized_bf16_experts(codec, gen):
    e, h, i = 4, 64, 32
    (q13, s13, _), (q2, s2, _) = make_experts(codec, e, h, i, gen)
    x = torch.randn(7, h, generator=gen)
    tw, ids = routing(7, e, 2, gen)
    w13 = torch.stack([dequantize_w4(q13[j], s13[j], codec, h) for j in range(e)])
    w2 = torch.stack([dequantize_w4(q2[j], s2[j], codec, i) for j in range(e)])
    want = fused_experts_ref(x, w13, w2, tw, ids)
    got = moe_w4a16.fused_experts_w4a16_ref(x, q13, s13, q2, s2, tw, ids, codec=codec)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_zero_tokens_and_custom_op(device, gen):
    (q13, s13, _), (q2, s2, _) = make_experts("int4", 4, 64, 32, gen)
    x = torch.randn(0, 64)
    tw, ids = torch.empty(0, 2), torch.empty(0, 2, dtype=torch.int32)
    args = [a.to(device) for a in (x, q13, s13, q2, s2, tw, ids)]
    assert moe_w4a16._fused_experts_w4a16_triton(*args).shape == (0, 64)
    x = torch.randn(3, 64, generator=gen)
    tw, ids = routing(3, 4, 2, gen)
    out = torch.ops.tokenfab.fused_experts_w4a16(x, q13, s13, q2, s2, tw, ids)
    assert_close(out, moe_w4a16.fused_experts_w4a16_ref(x, q13, s13, q2, s2, tw, ids))


def test_bad_arguments(gen):
    (q13, s13, _), (q2, s2, _) = make_experts("int4", 4, 64, 32, gen)
    x = torch.randn(2, 64)
    tw, ids = routing(2, 4, 2, gen)
    with pytest.raises(ValueError, match="global scales"):
        moe_w4a16.fused_experts_w4a16_ref(x, q13, s13, q2, s2, tw, ids, w13_g=torch.ones(4), w2_g=torch.ones(4))
    with pytest.raises(ValueError, match="do not fit"):
        moe_w4a16.fused_experts_w4a16_ref(torch.randn(2, 32), q13, s13, q2, s2, tw, ids)


def test_opcheck_fake_impls(gen):
    """Both custom ops' schemas and fake (meta) impls agree with the real ones (torch.compile tracing)."""
    from tests.kernels.test_w4a16 import make_weight as mw

    q, s, gs = mw("nvfp4", 32, 64, gen)
    x = torch.randn(3, 64, generator=gen)
    s = s.view(torch.uint8)  # E4M3 bits (the op takes either; opcheck's harness cannot compare float8 tensors)
    torch.library.opcheck(torch.ops.tokenfab.w4a16_gemm, (x, q, s, gs, None, "nvfp4", 64),
                          test_utils=("test_schema", "test_faketensor"))
    (q13, s13, _), (q2, s2, _) = make_experts("mxfp4", 4, 64, 32, gen)
    tw, ids = routing(3, 4, 2, gen)
    torch.library.opcheck(torch.ops.tokenfab.fused_experts_w4a16, (x, q13, s13, q2, s2, tw, ids),
                          {"codec": "mxfp4"}, test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("codec", ["int4", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_path_matches_reference(codec, dtype, gen):
    from tokenfab.kernels.cpu import native_library

    if native_library() is None:
        pytest.skip("no C compiler: the reference is the CPU path")
    t, e, k, h, i = 9, 6, 2, 96, 64
    (q13, s13, g13), (q2, s2, g2) = make_experts(codec, e, h, i, gen)
    x = (torch.randn(t, h, generator=gen) * 0.5).to(dtype)
    tw, ids = routing(t, e, k, gen, skip=0)
    b13, b2 = torch.randn(e, 2 * i, generator=gen).to(dtype), torch.randn(e, h, generator=gen).to(dtype)
    args = (x, q13, s13, q2, s2, tw, ids, b13, b2, g13, g2, codec, "swiglu_oai")
    assert_close(moe_w4a16.fused_experts_w4a16_native(*args), moe_w4a16.fused_experts_w4a16_ref(*args))


def test_nvfp4_gate_and_up_global_scales(device, gen):
    """NVFP4 checkpoints scale gate and up apart (w13_g [E, 2]): the reference equals fused_experts_ref
    on the dequantized experts, and the Triton and C paths equal the reference."""
    from tests.kernels.tolerances import TOLERANCES

    e, h, i = 4, 64, 32
    (q13, s13, _), (q2, s2, g2) = make_experts("nvfp4", e, h, i, gen)
    g13 = torch.rand(e, 2, generator=gen) * 0.02 + 0.01
    x = torch.randn(6, h, generator=gen)
    tw, ids = routing(6, e, 2, gen)
    w13 = torch.stack([dequantize_w4(q13[j], s13[j], "nvfp4", h) * g13[j].repeat_interleave(i)[:, None]
                       for j in range(e)])
    w2 = torch.stack([dequantize_w4(q2[j], s2[j], "nvfp4", i) * g2[j] for j in range(e)])
    args = (x, q13, s13, q2, s2, tw, ids, None, None, g13, g2, "nvfp4")
    want = moe_w4a16.fused_experts_w4a16_ref(*args)
    torch.testing.assert_close(want, fused_experts_ref(x, w13, w2, tw, ids), **TOLERANCES[torch.float32])
    got = moe_w4a16._fused_experts_w4a16_triton(*[a.to(device) if isinstance(a, torch.Tensor) else a for a in args])
    assert_close(got, want.to(device))
    assert_close(moe_w4a16.fused_experts_w4a16_native(*args), want)
