"""silu_and_mul_train / gelu_and_mul_train (kernels/activation_train.py): output and both inputs'
gradients vs autograd on the reference and on Hugging Face's LlamaMLP / GemmaMLP activation, through
the Triton kernels (interpreter) and the torch twins, fp32 and bf16."""

from __future__ import annotations

import pytest
import torch

from tests.kernels import train_helpers
from tests.kernels.tiers import tiered_product
from tests.kernels.tolerances import assert_train_close_scaled
from tests.kernels.train_helpers import (
    DEVICE,
    assert_compiled_matches_eager,
    check_against,
    forward_backward,
    opcheck,
    saved_tensors,
)
from tokenfab.kernels.activation_train import (
    gelu_and_mul_train,
    gelu_and_mul_train_ref,
    silu_and_mul_train,
    silu_and_mul_train_ref,
)

kernel_path = train_helpers.kernel_path  # the fixture: tests taking it run on both paths
DTYPES = [torch.float32, torch.bfloat16]
SHAPES = [(1, 64), (3, 1000), (2, 5, 1536), (7, 2049)]  # one row, odd sizes, several blocks with a tail
ACTS = {
    "silu": (silu_and_mul_train, silu_and_mul_train_ref),
    "gelu_tanh": (lambda g, u: gelu_and_mul_train(g, u, "tanh"), lambda g, u: gelu_and_mul_train_ref(g, u, "tanh")),
    "gelu": (lambda g, u: gelu_and_mul_train(g, u, "none"), lambda g, u: gelu_and_mul_train_ref(g, u, "none")),
}


def _rand(shape, dtype, gen, scale=1.0):
    return (torch.randn(shape, generator=gen) * scale).to(dtype)


def _slow_act(kernel_path, shape, dtype, act) -> bool:
    """Slow tier (Triton path only): past the one-row shape, which runs every dtype x activation, each
    shape runs each activation in one dtype, alternating (both dtypes run every shape fast)."""
    n = SHAPES.index(shape)
    return kernel_path == "triton" and n > 0 and (n + list(ACTS).index(act)) % 2 != DTYPES.index(dtype)


@pytest.mark.parametrize("kernel_path,shape,dtype,act", tiered_product(
    train_helpers.PATHS, SHAPES, DTYPES, list(ACTS), slow=_slow_act), indirect=["kernel_path"])
def test_act_and_mul_train(shape, dtype, act, kernel_path, gen):
    fn, ref = ACTS[act]
    gate, up = _rand(shape, dtype, gen, 3.0), _rand(shape, dtype, gen)
    check_against(fn, ref, [gate, up], [_rand(shape, dtype, gen)])


def test_extreme_gates(kernel_path):
    """Saturated gates (|g| up to 100): no overflow or NaN in the exp/tanh of the derivatives."""
    gate = torch.linspace(-100, 100, 401)
    up, dout = torch.ones(401), torch.ones(401)
    for fn, ref in ACTS.values():
        check_against(fn, ref, [gate, up], [dout])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden_act", ["silu", "gelu_pytorch_tanh"])
def test_matches_hf_mlp_activation(hidden_act, dtype, kernel_path, gen):
    """HF's MLP computes ``act_fn(gate_proj(x)) * up_proj(x)``: the same values and gradients."""
    from transformers.activations import ACT2FN

    act_fn = ACT2FN[hidden_act]
    ours = silu_and_mul_train if hidden_act == "silu" else gelu_and_mul_train
    gate, up, dout = (_rand((4, 9, 576), dtype, gen, 2.0) for _ in range(3))
    hf_out, hf_grads = forward_backward(lambda g, u: act_fn(g) * u, [gate, up], [dout])
    outs, grads = forward_backward(ours, [gate, up], [dout])
    for a, b in zip(outs + grads, hf_out + hf_grads):
        assert_train_close_scaled(a, b)


def test_bad_input(kernel_path):
    with pytest.raises(ValueError, match="must match"):
        silu_and_mul_train(torch.ones(2, 4), torch.ones(2, 5))
    with pytest.raises(ValueError, match="approximate"):
        gelu_and_mul_train(torch.ones(2, 4), torch.ones(2, 4), "sigmoid")
    empty = torch.empty(0, 8, device=DEVICE, requires_grad=True)
    assert silu_and_mul_train(empty, empty).shape == (0, 8)


def test_torch_compile_module(kernel_path, gen):
    """An MLP using the ops traces under torch.compile (fullgraph) with the eager values and grads."""
    torch.manual_seed(0)
    gate_up, down = torch.nn.Linear(16, 64).to(DEVICE), torch.nn.Linear(32, 16).to(DEVICE)

    def mlp(x):
        g, u = gate_up(x).chunk(2, dim=-1)
        return down(silu_and_mul_train(g, u) + gelu_and_mul_train(g, u))

    assert_compiled_matches_eager(mlp, _rand((3, 16), torch.float32, gen).to(DEVICE), gate_up)


def test_backward_keeps_only_gate_and_up(kernel_path, gen):
    gate, up = (_rand((8, 96), torch.float32, gen).to(DEVICE).requires_grad_() for _ in range(2))
    saved = saved_tensors(lambda: silu_and_mul_train(gate, up))
    assert len(saved) == 2 and saved[0] is gate and saved[1] is up


def test_custom_ops_opcheck(kernel_path, gen):
    g, u = _rand((6, 24), torch.float32, gen).to(DEVICE), _rand((6, 24), torch.float32, gen).to(DEVICE)
    opcheck(torch.ops.tokenfab.act_and_mul_train_fwd, (g, u, "silu"))
    opcheck(torch.ops.tokenfab.act_and_mul_train_bwd, (g, g, u, "gelu_tanh"))
