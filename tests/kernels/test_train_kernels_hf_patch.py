"""A tiny HF Llama / Qwen3 with our training kernels patched in (``train.model.apply_kernels``: RMSNorm
with the fused residual, RoPE, SiLU/GELU-and-mul, the fused linear cross-entropy) gives the loss and
every parameter's gradient of the unpatched HF model (fp32), through the torch twins and through
the Triton kernels (interpreter)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from tests.kernels import train_helpers
from tests.kernels.tolerances import assert_train_close_scaled
from tests.kernels.train_helpers import DEVICE

kernel_path = train_helpers.kernel_path  # the fixture: every test taking it runs on both paths


def _tiny(model_type: str, hidden_act: str):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    cls = {"llama": LlamaConfig, "qwen3": Qwen3Config}[model_type]
    config = cls(vocab_size=80, hidden_size=48, intermediate_size=72, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=12, max_position_embeddings=64, rms_norm_eps=1e-6,
                 hidden_act=hidden_act, tie_word_embeddings=False, attn_implementation="eager")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # HF initialises norm weights to 1: make them matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    return model.to(DEVICE)


@pytest.mark.parametrize(("model_type", "hidden_act"), [("llama", "silu"), ("llama", "gelu_pytorch_tanh"),
                                                        ("qwen3", "silu")])
def test_patched_model_matches_hf(model_type, hidden_act, kernel_path):
    from tokenfab.train.model import apply_kernels

    plain = _tiny(model_type, hidden_act)
    patched = copy.deepcopy(plain)
    ops = apply_kernels(patched)
    act = "silu_and_mul" if hidden_act == "silu" else "gelu_and_mul"
    assert {"rms_norm", "rms_norm+residual", "rope", act} <= set(ops), ops

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 80, (2, 11), generator=g)
    pos = torch.arange(11).expand(2, 11)
    labels = torch.cat((ids[:, 1:], torch.full((2, 1), -100)), 1)
    labels[0, :3] = -100  # a prompt without loss
    ids, pos, labels = ids.to(DEVICE), pos.to(DEVICE), labels.to(DEVICE)

    plain.zero_grad()
    logits = plain(input_ids=ids, position_ids=pos, use_cache=False).logits
    loss_ref = F.cross_entropy(logits.reshape(-1, 80).float(), labels.reshape(-1), ignore_index=-100,
                               reduction="sum")
    loss_ref.backward()
    patched.zero_grad()
    loss = patched(input_ids=ids, position_ids=pos, shift_labels=labels)
    loss.backward()

    assert_train_close_scaled(loss.detach().reshape(()), loss_ref.detach())
    ref_params = dict(plain.named_parameters())
    for name, p in patched.named_parameters():
        assert p.grad is not None, name
        try:
            assert_train_close_scaled(p.grad, ref_params[name].grad)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None
