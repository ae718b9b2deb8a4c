"""rope_train (kernels/rope_train.py): outputs and the gradients of q and k vs autograd on the
reference and on Hugging Face's apply_rotary_pos_emb, through the Triton kernel (interpreter) and the
torch twin, fp32 and bf16, HF's transposed [B, H, T, D] layout."""

from __future__ import annotations

import pytest
import torch

from tests.kernels import train_helpers
from tests.kernels.tolerances import assert_train_close_scaled
from tests.kernels.train_helpers import (
    DEVICE,
    assert_compiled_matches_eager,
    check_against,
    forward_backward,
    opcheck,
    saved_tensors,
)
from tokenfab.kernels.rope_train import rope_train, rope_train_ref

kernel_path = train_helpers.kernel_path  # the fixture: tests taking it run on both paths
DTYPES = [torch.float32, torch.bfloat16]
# (B, Hq, Hk, T, D): one token, GQA, odd head counts, a head dim whose half is no power of two
SHAPES = [(1, 1, 1, 1, 64), (2, 4, 2, 7, 64), (1, 9, 3, 5, 96), (2, 3, 1, 4, 128)]


def _hf_cos_sin(bsz: int, seq: int, dim: int, dtype: torch.dtype, offset: int = 0):
    """cos/sin as LlamaRotaryEmbedding returns them (per-batch positions, so rows differ)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = LlamaConfig(hidden_size=dim * 2, num_attention_heads=2, rope_theta=10000.0, max_position_embeddings=512)
    rot = LlamaRotaryEmbedding(cfg)
    pos = torch.arange(seq)[None, :] + offset + 11 * torch.arange(bsz)[:, None]
    cos, sin = rot(torch.zeros(1, dtype=dtype), pos)
    return cos.to(DEVICE), sin.to(DEVICE)


def _qk(b, hq, hk, t, d, dtype, gen):
    # HF layout: projections viewed as [B, T, H, D] then transposed (strided, no copy)
    q = torch.randn(b, t, hq, d, generator=gen).to(dtype).transpose(1, 2)
    k = torch.randn(b, t, hk, d, generator=gen).to(dtype).transpose(1, 2)
    return q, k


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rope_train(shape, dtype, kernel_path, gen):
    b, hq, hk, t, d = shape
    q, k = _qk(b, hq, hk, t, d, dtype, gen)
    cos, sin = _hf_cos_sin(b, t, d, dtype, offset=100)
    up = [torch.randn(q.shape, generator=gen).to(dtype), torch.randn(k.shape, generator=gen).to(dtype)]
    check_against(lambda q, k: rope_train(q, k, cos, sin), lambda q, k: rope_train_ref(q, k, cos, sin), [q, k], up)


def test_arbitrary_cos_sin_halves_and_broadcast_batch(kernel_path, gen):
    """cos/sin halves that differ (not HF's cat(f, f)) and a batch-1 cos/sin for a batch of 3."""
    q, k = _qk(3, 4, 2, 5, 32, torch.float32, gen)
    cos, sin = torch.randn(1, 5, 32, generator=gen).to(DEVICE), torch.randn(1, 5, 32, generator=gen).to(DEVICE)
    up = [torch.randn(q.shape, generator=gen), torch.randn(k.shape, generator=gen)]
    check_against(lambda q, k: rope_train(q, k, cos, sin), lambda q, k: rope_train_ref(q, k, cos, sin), [q, k], up)


def test_autocast_fp32_cos_sin(kernel_path, gen):
    """Under autocast q/k are bf16 while HF's cos/sin stay fp32: q and k keep their dtype, values
    within bf16 tolerance of the fp32 computation."""
    q, k = _qk(2, 4, 2, 6, 64, torch.bfloat16, gen)
    cos, sin = _hf_cos_sin(2, 6, 64, torch.float32)
    up = [torch.randn(t.shape, generator=gen).to(torch.bfloat16) for t in (q, k)]
    outs, grads = forward_backward(lambda q, k: rope_train(q, k, cos, sin), [q, k], up)
    assert {t.dtype for t in outs + grads} == {torch.bfloat16}
    exact = lambda q, k: tuple(t.to(torch.bfloat16) for t in rope_train_ref(q.float(), k.float(), cos, sin))  # noqa: E731
    ref_outs, ref_grads = forward_backward(exact, [q, k], up)
    for a, b in zip(outs + grads, ref_outs + ref_grads):
        assert_train_close_scaled(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_hf_apply_rotary_pos_emb(dtype, kernel_path, gen):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q, k = _qk(2, 6, 2, 9, 64, dtype, gen)
    cos, sin = _hf_cos_sin(2, 9, 64, dtype)
    dq, dk = torch.randn(q.shape, generator=gen).to(dtype), torch.randn(k.shape, generator=gen).to(dtype)
    hf_out, hf_grads = forward_backward(lambda q, k: apply_rotary_pos_emb(q, k, cos, sin), [q, k], [dq, dk])
    ref_out, ref_grads = forward_backward(lambda q, k: rope_train_ref(q, k, cos, sin), [q, k], [dq, dk])
    for a, b in zip(ref_out + ref_grads, hf_out + hf_grads):
        assert torch.equal(a, b)  # the oracle is HF's function
    outs, grads = forward_backward(lambda q, k: rope_train(q, k, cos, sin), [q, k], [dq, dk])
    for a, b in zip(outs + grads, hf_out + hf_grads):
        assert_train_close_scaled(a, b)
    if kernel_path == "triton":
        assert outs[0].stride() == q.stride()  # HF's transposed layout kept, no copy


def test_bad_shapes(kernel_path):
    q, k = torch.zeros(1, 2, 3, 8), torch.zeros(1, 1, 3, 8)
    with pytest.raises(ValueError, match="cos"):
        rope_train(q, k, torch.zeros(1, 4, 8), torch.zeros(1, 3, 8))
    with pytest.raises(ValueError, match="even"):
        rope_train(torch.zeros(1, 2, 3, 7), torch.zeros(1, 1, 3, 7), torch.zeros(1, 3, 7), torch.zeros(1, 3, 7))
    with pytest.raises(ValueError, match="B, H, T, D"):
        rope_train(q[0], k, torch.zeros(1, 3, 8), torch.zeros(1, 3, 8))


def test_torch_compile_module(kernel_path, gen):
    """A module using the op traces under torch.compile (fullgraph) with the eager values and grads."""
    lin = torch.nn.Linear(32, 3 * 32).to(DEVICE)
    cos, sin = _hf_cos_sin(2, 5, 16, torch.float32)

    def attn_inputs(x):
        q, k, _ = lin(x).view(2, 5, 6, 16).transpose(1, 2).split(2, dim=1)
        q, k = rope_train(q, k, cos, sin)
        return (q * k).sum(-1)

    assert_compiled_matches_eager(attn_inputs, torch.randn(2, 5, 32, generator=gen).to(DEVICE), lin)


def test_backward_keeps_only_cos_sin(kernel_path, gen):
    q, k = _qk(2, 4, 2, 6, 64, torch.float32, gen)
    q, k = q.to(DEVICE).requires_grad_(), k.to(DEVICE).requires_grad_()
    cos, sin = _hf_cos_sin(2, 6, 64, torch.float32)
    saved = saved_tensors(lambda: rope_train(q, k, cos, sin))
    assert len(saved) == 2 and saved[0] is cos and saved[1] is sin


def test_custom_op_opcheck(kernel_path, gen):
    q, _ = _qk(2, 4, 1, 5, 8, torch.float32, gen)
    cs = torch.randn(2, 5, 8, generator=gen).to(DEVICE)
    for backward in (False, True):
        opcheck(torch.ops.tokenfab.rope_train, (q.to(DEVICE), cs, cs, backward))
