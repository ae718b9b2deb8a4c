"""FP8 latent cache of MLA (DeepSeek-V3 / Kimi) and DSA (GLM-5 / DeepSeek-V3.2) models on CPU:
``--kv-cache-dtype fp8`` stores each token's [latent ; rope key (; index key)] row as e4m3 with one scale
per layer, calibrated on the first batch (amax / 448). Checked: the cache dtype and bytes per token, the
stored rows against the definition (layer 0 sees the same inputs in both engines), the logits against the
float32 cache's (FP8 noise only), and the expanded prefill form (latents dequantized, then expanded)
against the absorbed form over the same FP8 cache."""

from __future__ import annotations

import pytest
import torch

from tests.models.test_deepseek import CASES as V3_CASES
from tests.models.test_deepseek import save_tiny_deepseek
from tests.models.test_deepseek_dsa import save_tiny_dsa
from tests.tiny_models import run_capturing_logits, small_engine
from tokenfab.engine.llm_engine import LLMEngine
from tokenfab.layers.mla import MLAAttention

FP8 = torch.float8_e4m3fn
PROMPT = [5, 17, 42, 99, 3, 250, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 40, 41]  # longer than DSA's index_topk


def _latents(engine: LLMEngine) -> list[MLAAttention]:
    return [m for m in engine.model.modules() if isinstance(m, MLAAttention)]


@pytest.mark.slow  # 10-25 s each on 2 busy cores
@pytest.mark.parametrize("case", ["deepseek_v3", "glm_moe_dsa"])
def test_fp8_latent_cache(case, tmp_path):
    if case == "deepseek_v3":
        save_tiny_deepseek(tmp_path, **V3_CASES["v3-yarn"])
    else:
        save_tiny_dsa(case, tmp_path)
    ref, fp8 = small_engine(tmp_path), small_engine(tmp_path, kv_cache_dtype="fp8")
    assert all(m.kv_cache.dtype == FP8 and m.kv_scale is not None for m in _latents(fp8))
    assert fp8.memory["kv_bytes_per_token"] * 4 == ref.memory["kv_bytes_per_token"]
    _, ref_logits = run_capturing_logits(ref, PROMPT, 4)
    tokens, logits = run_capturing_logits(fp8, PROMPT, 4)
    assert len(tokens) == 4
    slots = torch.arange(len(PROMPT))
    m_ref, m_fp8 = _latents(ref)[0], _latents(fp8)[0]
    exact = m_ref.kv_cache.flatten(0, 1)[slots].float()
    stored = m_fp8.kv_cache.flatten(0, 1)[slots].float()
    scale = m_fp8.kv_scale
    torch.testing.assert_close(scale, (exact.abs().amax() / 448).reshape(1), rtol=1e-6, atol=0)
    assert stored.abs().max() == 448
    assert ((stored * scale - exact).abs() <= exact.abs() * 2**-4 + scale * 2**-10).all()
    diff = (torch.log_softmax(logits[0], -1) - torch.log_softmax(ref_logits[0], -1)).abs().max()
    assert diff < 0.1, float(diff)


@pytest.mark.slow  # 4-7 s
def test_expanded_form_reads_the_fp8_cache(tmp_path, monkeypatch):
    """A long prefill chunk runs the expanded form (latents gathered, dequantized, expanded per head);
    with the same FP8 cache and scale it equals the absorbed form up to float32 rounding."""
    save_tiny_deepseek(tmp_path, **V3_CASES["v3-yarn"])
    absorbed = run_capturing_logits(small_engine(tmp_path, kv_cache_dtype="fp8"), PROMPT, 3)
    monkeypatch.setattr(MLAAttention, "expand_min_query_len", 4)
    expanded = run_capturing_logits(small_engine(tmp_path, kv_cache_dtype="fp8"), PROMPT, 3)
    assert expanded[0] == absorbed[0]
    torch.testing.assert_close(expanded[1][0], absorbed[1][0], rtol=1e-4, atol=1e-4)
