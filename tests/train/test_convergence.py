"""Convergence: twin models trained with our kernels and with plain PyTorch (kernels off), same seed
and data, give the same per-step losses and close final parameters (Liger's convergence suite).

Default tier: tiny random Llama / Qwen3 / Qwen3-MoE (kernels on the CPU default path, and forced through the
Triton interpreter). Slow tier: the bundled SmolLM2-135M for 30 steps (the issue's ask), and the
bundled GGUF as transformers dequantizes it vs tokenfab's own GGUF loader.
"""

from __future__ import annotations

import pytest
import torch

from tests.train.tiny_train import tiny_model, toy_examples
from tokenfab.train.trainer import TrainConfig, Trainer

# fp32: the kernels reorder sums (chunked loss, fused residual), so losses agree to rounding, which
# grows slowly over steps of an optimizer (Liger's convergence tests use atol 1e-5 on fp32 losses).
LOSS_RTOL, LOSS_ATOL = 1e-5, 1e-5
PARAM_RTOL, PARAM_ATOL = 1e-4, 1e-5
# The bundled model (30 layers, vocab 49k): rounding differences grow with depth and over 30 AdamW
# steps; measured max |loss diff| 1.5e-5 (relative 2.8e-5) at step 15-18, params 2.4e-6.
BUNDLED_LOSS_RTOL, BUNDLED_LOSS_ATOL = 1e-4, 1e-4


def _train(model, data, tmp_path, kernels: bool, steps: int, batch_size: int = 4, lr: float = 3e-3) -> list[float]:
    config = TrainConfig(full=True, lr=lr, max_steps=steps, batch_size=batch_size, warmup_steps=2,
                         kernels=kernels, output_dir=str(tmp_path / f"k{int(kernels)}"), progress=False,
                         plot=False, seed=3)
    return Trainer(model, None, data, None, config).train().losses


def _assert_twins(m_on, m_off, losses_on, losses_off, rtol: float = LOSS_RTOL, atol: float = LOSS_ATOL) -> None:
    assert losses_on == pytest.approx(losses_off, rel=rtol, abs=atol)
    for (name, p_on), (_, p_off) in zip(m_on.named_parameters(), m_off.named_parameters(), strict=True):
        torch.testing.assert_close(p_on, p_off, rtol=PARAM_RTOL, atol=PARAM_ATOL, msg=name)


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "qwen3_moe"])
def test_kernels_vs_plain_pytorch_tiny(tmp_path, model_type):
    data = toy_examples(24, seed=5)
    m_on, m_off = tiny_model(model_type), tiny_model(model_type)
    on = _train(m_on, data, tmp_path, True, 10)
    off = _train(m_off, data, tmp_path, False, 10)
    assert m_on._tokenfab_kernels and not hasattr(m_off, "_tokenfab_kernels")
    assert ("moe_experts" in m_on._tokenfab_kernels) == (model_type == "qwen3_moe")
    assert off[-1] < off[0]  # it trains
    _assert_twins(m_on, m_off, on, off)


def test_kernels_through_the_triton_interpreter(tmp_path, monkeypatch):
    """TOKENFAB_KERNELS=triton: every patched op runs its Triton kernels (interpreter)."""
    monkeypatch.setenv("TOKENFAB_KERNELS", "triton")
    data = toy_examples(6, seed=6, max_len=10)
    m_on, m_off = tiny_model(), tiny_model()
    on = _train(m_on, data, tmp_path, True, 2, batch_size=3)
    off = _train(m_off, data, tmp_path, False, 2, batch_size=3)
    assert set(m_on._tokenfab_kernels) == {"fused_linear_cross_entropy", "rms_norm", "rms_norm+residual", "rope",
                                           "silu_and_mul"}
    _assert_twins(m_on, m_off, on, off)


def _task_records(n: int) -> list[dict]:
    """A fixed-format task: add two numbers, answer 'ANSWER: <sum>' (prompt/completion records: short,
    no chat template system prompt, so 30 full fine-tuning steps of the 135M model fit the slow tier)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        a, b = (int(x) for x in torch.randint(0, 50, (2,), generator=g))
        out.append({"prompt": f"What is {a} plus {b}?", "completion": f" ANSWER: {a + b}"})
    return out


@pytest.fixture(scope="module")
def bundled():
    from tokenfab.train.model import load_training_model

    return load_training_model(None, torch.float32, "cpu")


@pytest.mark.slow
def test_bundled_gguf_matches_our_loader(bundled):
    from tokenfab.loader.bundled import bundled_model_path
    from tokenfab.loader.gguf import load_gguf

    model, tokenizer = bundled
    assert tokenizer.chat_template
    ours = dict(model.named_parameters())
    wanted = {"model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
              "model.layers.0.self_attn.k_proj.weight", "model.layers.7.mlp.down_proj.weight",
              "model.norm.weight"}
    seen = set()
    for name, tensor in load_gguf(bundled_model_path()).tensors():
        if name in wanted:
            torch.testing.assert_close(ours[name].detach(), tensor, rtol=0, atol=0, msg=name)
            seen.add(name)
    assert seen == wanted
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_bundled_model_30_steps_kernels_vs_plain(tmp_path, bundled):
    """The issue's convergence run: 30 full fine-tuning steps of SmolLM2-135M, kernels vs none."""
    import copy

    from tokenfab.train.data import tokenize_record

    base, tokenizer = bundled
    data = [tokenize_record(tokenizer, r, 64) for r in _task_records(60)]
    m_on, m_off = copy.deepcopy(base), copy.deepcopy(base)
    on = _train(m_on, data, tmp_path, True, 30, batch_size=2, lr=1e-5)
    off = _train(m_off, data, tmp_path, False, 30, batch_size=2, lr=1e-5)
    diffs = [abs(a - b) for a, b in zip(on, off, strict=True)]
    pairs = zip(m_on.parameters(), m_off.parameters(), strict=True)
    max_param = max(float((a - b).detach().abs().max()) for a, b in pairs)
    print(f"\nbundled 30 steps: first loss {off[0]:.4f} -> last {off[-1]:.4f}; max |loss diff| {max(diffs):.2e}; "
          f"max |param diff| {max_param:.2e}; patched {m_on._tokenfab_kernels}")
    assert off[-1] < off[0]
    _assert_twins(m_on, m_off, on, off, BUNDLED_LOSS_RTOL, BUNDLED_LOSS_ATOL)
