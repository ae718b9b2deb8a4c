"""rms_norm_train (kernels/norm_train.py): output and every gradient vs autograd on the reference and
on Hugging Face's LlamaRMSNorm / GemmaRMSNorm, through the Triton kernels (interpreter) and the
torch twins, fp32 and bf16."""

from __future__ import annotations

import pytest
import torch

from tests.kernels import train_helpers
from tests.kernels.tiers import tiered_product
from tests.kernels.tolerances import assert_train_close_scaled
from tests.kernels.train_helpers import DEVICE, check_against, forward_backward, opcheck, saved_tensors
from tokenfab.kernels import norm_train
from tokenfab.kernels.norm_train import rms_norm_train, rms_norm_train_ref

DTYPES = [torch.float32, torch.bfloat16]
kernel_path = train_helpers.kernel_path  # the fixture: every test below runs on both paths
# one row, odd / non-power-of-2 hidden sizes; 2100: the backward's one-row-at-a-time branch (BLOCK_R 1)
SHAPES = [(1, 64), (5, 1000), (3, 7, 576), (2, 3, 96), (3, 2100)]


def _rand(shape, dtype, gen, scale=1.0):
    return (torch.randn(shape, generator=gen) * scale).to(dtype)


def _slow_norm(kernel_path, shape, dtype, residual, offset) -> bool:
    """Slow tier (Triton path only): past the one-row shape, which runs every dtype x residual x offset,
    each shape keeps both dtypes for one residual/offset choice (a different one per shape; 2100, the
    one-row-at-a-time backward, keeps two)."""
    n = SHAPES.index(shape)
    keep = {1: [(True, 0.0)], 2: [(False, 0.0)], 3: [(True, 1.0)], 4: [(False, 1.0), (True, 0.0)]}
    return kernel_path == "triton" and n > 0 and (residual, offset) not in keep[n]


@pytest.mark.parametrize("kernel_path,shape,dtype,residual,offset", tiered_product(
    train_helpers.PATHS, SHAPES, DTYPES, [False, True], [0.0, 1.0], slow=_slow_norm), indirect=["kernel_path"])
def test_rms_norm_train(shape, dtype, residual, offset, kernel_path, gen):
    x = _rand(shape, dtype, gen, 2.0)
    w = 1.0 + 0.3 * _rand(shape[-1], dtype, gen)
    r = _rand(shape, dtype, gen) if residual else None
    upstream = [_rand(shape, dtype, gen)] + ([_rand(shape, dtype, gen)] if residual else [])
    check_against(lambda x, w, r: rms_norm_train(x, w, 1e-6, r, offset),
                  lambda x, w, r: rms_norm_train_ref(x, w, 1e-6, r, offset), [x, w, r], upstream)


@pytest.mark.parametrize("hidden", [200, 2100])
def test_weight_gradient_reduced_across_programs(hidden, monkeypatch, gen):
    """Several programs (as on a GPU) each sum their rows into a partial dw; the partials add up
    (a program's last row block cut by the next program's range: 37 rows, 4 to 12 programs)."""
    monkeypatch.setenv("TOKENFAB_KERNELS", "triton")
    monkeypatch.setattr(norm_train, "num_sms", lambda device: 3)
    x, r = _rand((37, hidden), torch.float32, gen), _rand((37, hidden), torch.float32, gen)
    w = _rand(hidden, torch.float32, gen)
    up = [_rand((37, hidden), torch.float32, gen), _rand((37, hidden), torch.float32, gen)]
    check_against(lambda x, w, r: rms_norm_train(x, w, 1e-5, r), lambda x, w, r: rms_norm_train_ref(x, w, 1e-5, r),
                  [x, w, r], up)


def test_mixed_dtypes_follow_hf(kernel_path, gen):
    """bf16 activations with an fp32 weight: HF's ``weight * x.to(bf16)`` promotes to fp32."""
    x, w = _rand((4, 160), torch.bfloat16, gen), _rand(160, torch.float32, gen)
    up = [_rand((4, 160), torch.float32, gen)]
    outs, _ = forward_backward(lambda x, w: rms_norm_train(x, w, 1e-6), [x, w], up)
    assert outs[0].dtype == torch.float32
    check_against(lambda x, w: rms_norm_train(x, w, 1e-6), lambda x, w: rms_norm_train_ref(x, w, 1e-6), [x, w],
                  up, torch.bfloat16)


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_autocast_mixed_residual(offset, kernel_path, gen):
    """A bf16 sublayer output added to an fp32 residual stream (autocast with fp32 weights): the sum
    and the norm in fp32 as torch's promotion gives, each input's gradient in its own dtype."""
    x, r = _rand((6, 200), torch.bfloat16, gen), _rand((6, 200), torch.float32, gen)
    w = _rand(200, torch.float32, gen)
    up = [_rand((6, 200), torch.float32, gen), _rand((6, 200), torch.float32, gen)]
    outs, grads = forward_backward(lambda x, w, r: rms_norm_train(x, w, 1e-6, r, offset), [x, w, r], up)
    assert [o.dtype for o in outs] == [torch.float32, torch.float32]
    assert [g.dtype for g in grads] == [torch.bfloat16, torch.float32, torch.float32]
    check_against(lambda x, w, r: rms_norm_train(x, w, 1e-6, r, offset),
                  lambda x, w, r: rms_norm_train_ref(x, w, 1e-6, r, offset), [x, w, r], up)


def _hf_norm(kind: str, hidden: int, weight: torch.Tensor, eps: float):
    if kind == "llama":
        from transformers.models.llama.modeling_llama import LlamaRMSNorm as cls
    else:
        from transformers.models.gemma.modeling_gemma import GemmaRMSNorm as cls
    mod = cls(hidden, eps=eps)
    with torch.no_grad():
        mod.weight.copy_(weight)
    return mod.to(DEVICE, weight.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["llama", "gemma"])
def test_matches_hf_module(kind, dtype, kernel_path, gen):
    """The reference is HF's module exactly; the kernels equal it within tolerance, grads included."""
    shape = (2, 5, 576)
    x = _rand(shape, dtype, gen, 3.0)
    w = _rand(576, dtype, gen) * (0.2 if kind == "gemma" else 1.0)
    dy = _rand(shape, dtype, gen)
    offset = 1.0 if kind == "gemma" else 0.0
    mod = _hf_norm(kind, 576, w, 1e-6)
    xl = x.to(DEVICE).requires_grad_()
    y_hf = mod(xl)
    y_hf.backward(dy.to(DEVICE))
    ref_out, ref_grads = forward_backward(lambda x, w: rms_norm_train_ref(x, w, 1e-6, None, offset), [x, w], [dy])
    assert torch.equal(ref_out[0], y_hf.detach())
    assert torch.equal(ref_grads[0], xl.grad) and torch.equal(ref_grads[1], mod.weight.grad)
    outs, grads = forward_backward(lambda x, w: rms_norm_train(x, w, 1e-6, None, offset), [x, w], [dy])
    assert_train_close_scaled(outs[0], y_hf.detach())
    assert_train_close_scaled(grads[0], xl.grad)
    assert_train_close_scaled(grads[1], mod.weight.grad)


def test_fused_residual_matches_hf_decoder_add(kernel_path, gen):
    """(y, s) = norm(x + residual), s = x + residual: the decoder layer's add + post-attention norm."""
    x, res = _rand((3, 96), torch.float32, gen).to(DEVICE), _rand((3, 96), torch.float32, gen).to(DEVICE)
    w = _rand(96, torch.float32, gen).to(DEVICE)
    mod = _hf_norm("llama", 96, w, 1e-5)
    y, s = rms_norm_train(x, w, 1e-5, res)
    assert torch.equal(s, x + res)
    assert_train_close_scaled(y, mod(x + res).detach())


def test_empty_and_bad_input(kernel_path):
    x = torch.empty(0, 64, device=DEVICE, requires_grad=True)
    w = torch.ones(64, device=DEVICE, requires_grad=True)
    y = rms_norm_train(x, w, 1e-6)
    y.sum().backward()
    assert y.shape == (0, 64) and torch.equal(w.grad.cpu(), torch.zeros(64))
    with pytest.raises(ValueError, match="weight"):
        rms_norm_train(torch.ones(2, 8), torch.ones(7), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        rms_norm_train(torch.ones(2, 8), torch.ones(8), 1e-6, torch.ones(2, 7))


def test_torch_compile_module(kernel_path, gen):
    """A module using the op traces under torch.compile (fullgraph; the custom ops' fake impls) and
    gives the eager values and gradients (the custom ops run the Triton kernels or the torch twins)."""

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(1 + 0.1 * torch.randn(48, generator=gen))
            self.lin = torch.nn.Linear(48, 48)

        def forward(self, x, res):
            y, s = rms_norm_train(self.lin(x), self.w, 1e-6, res)
            return rms_norm_train(y, self.w, 1e-6, offset=1.0) + s

    torch.manual_seed(0)
    block = Block().to(DEVICE)
    x, res = _rand((2, 6, 48), torch.float32, gen).to(DEVICE), _rand((2, 6, 48), torch.float32, gen).to(DEVICE)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    grads = []
    for fn in (block, compiled):
        block.zero_grad()
        out = fn(x, res)
        out.pow(2).sum().backward()
        grads.append((out.detach(), block.w.grad.clone(), block.lin.weight.grad.clone()))
    for a, b in zip(*grads):
        assert_train_close_scaled(a, b)


def test_frozen_weight(kernel_path, gen):
    """LoRA freezes the norms: only x gets a gradient, the same as with a trainable weight."""
    x = _rand((4, 96), torch.float32, gen).to(DEVICE).requires_grad_()
    w = _rand(96, torch.float32, gen).to(DEVICE)
    dy = _rand((4, 96), torch.float32, gen).to(DEVICE)
    rms_norm_train(x, w, 1e-6).backward(dy)
    _, ref_grads = forward_backward(lambda x, w: rms_norm_train_ref(x, w, 1e-6), [x.detach(), w], [dy])
    assert w.grad is None
    assert_train_close_scaled(x.grad, ref_grads[0])


def test_backward_keeps_only_input_and_rstd(kernel_path, gen):
    """The memory saving: the backward keeps residual_sum (or x), the weight and one fp32 a row, where
    HF's autograd keeps fp32 copies of the rows too (more than 3x the bytes in bf16)."""
    x, r = _rand((64, 576), torch.bfloat16, gen).to(DEVICE), _rand((64, 576), torch.bfloat16, gen).to(DEVICE)
    w = _rand(576, torch.bfloat16, gen).to(DEVICE).requires_grad_()
    x.requires_grad_()
    saved = saved_tensors(lambda: rms_norm_train(x, w, 1e-6, r))
    nbytes = sum(t.numel() * t.element_size() for t in saved)
    assert nbytes == 64 * 576 * 2 + 576 * 2 + 64 * 4, [(t.shape, t.dtype) for t in saved]
    ref_bytes = sum(t.numel() * t.element_size() for t in saved_tensors(lambda: rms_norm_train_ref(x, w, 1e-6, r)))
    assert nbytes < ref_bytes / 3


def test_custom_ops_opcheck(kernel_path, gen):
    x, r = _rand((4, 3, 40), torch.float32, gen).to(DEVICE), _rand((4, 3, 40), torch.float32, gen).to(DEVICE)
    w, rstd = _rand(40, torch.float32, gen).to(DEVICE), (torch.rand(12, generator=gen) + 0.5).to(DEVICE)
    ops = torch.ops.tokenfab
    opcheck(ops.rms_norm_train_fwd, (x, w, r, 1e-6, 0.0))
    opcheck(ops.rms_norm_train_fwd, (x.bfloat16(), w, None, 1e-6, 1.0))
    opcheck(ops.rms_norm_train_bwd, (x, r, x, w, rstd, 0.0))
    opcheck(ops.rms_norm_train_bwd, (x, None, x, w, rstd, 1.0))


def test_rows_longer_than_a_block_take_the_torch_path(monkeypatch, gen):
    """Rows past MAX_HIDDEN (16384 in the real config) run the torch twin even when Triton is chosen."""
    monkeypatch.setenv("TOKENFAB_KERNELS", "triton")
    monkeypatch.setattr(norm_train, "MAX_HIDDEN", 64)
    monkeypatch.setattr(norm_train, "_rms_norm_train_fwd_triton", None)  # would fail if called
    monkeypatch.setattr(norm_train, "_rms_norm_train_bwd_triton", None)
    x, w = _rand((3, 100), torch.float32, gen), _rand(100, torch.float32, gen)
    check_against(lambda x, w: rms_norm_train(x, w, 1e-6), lambda x, w: rms_norm_train_ref(x, w, 1e-6), [x, w],
                  [_rand((3, 100), torch.float32, gen)])
