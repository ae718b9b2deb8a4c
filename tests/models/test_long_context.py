"""Long context: RoPE scaling as each family configures it (Llama 3's frequency bands, Qwen3's YaRN,
DeepSeek's YaRN with mscale on MLA, GPT-OSS's untruncated YaRN with a sliding window), checked at
positions far past the checkpoint's original context, prefilled in chunks, batched with a short prompt.

Each case: a long prompt (past ``original_max_position_embeddings`` x ``factor``, so the scaled range is
exceeded too) prefilled in chunks while a short one decodes, 4 greedy tokens each; per request the
tokens and top log-probabilities equal transformers' (fp32, the request alone).

The fast tier runs ~1.2k-token contexts over a 64/128-token original context; the slow tier runs a
40k-token context over a 4k original context (the issue's "e.g. 40k on a tiny model"), and DeepSeek at 12k
over 1k (its transformers reference holds every attention score in memory).
"""

from __future__ import annotations

import pytest

from tests.moe_tiny_models import tiny_moe_config
from tests.tiny_models import assert_batch_matches_hf, paths_reached, run_batch, save_tiny_model, tiny_config
from tokenfab.engine.llm_engine import LLMEngine


def _llama3(orig: int) -> dict:
    return {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": orig}


def _yarn(orig: int, **extra) -> dict:
    return {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": orig,
            **extra}


def _config(case: str, orig: int, max_pos: int):
    """The transformers config of one case, its original context ``orig``, positions up to ``max_pos``."""
    import transformers

    from tests.models.test_deepseek import DEEPSEEK_COMMON

    if case == "llama3":
        return tiny_config("llama", rope_parameters=_llama3(orig), max_position_embeddings=max_pos)
    if case == "qwen3-yarn":
        return tiny_config("qwen3", rope_parameters=_yarn(orig), max_position_embeddings=max_pos)
    if case == "deepseek-yarn":
        rope = _yarn(orig, mscale=1.0, mscale_all_dim=0.8, beta_fast=32.0, beta_slow=1.0)
        return transformers.DeepseekV3Config(**{**DEEPSEEK_COMMON, "num_hidden_layers": 2,
                                                "rope_parameters": rope, "max_position_embeddings": max_pos})
    if case == "gpt_oss-yarn":
        rope = _yarn(orig, factor=8.0, beta_fast=32.0, beta_slow=1.0, truncate=False)
        return tiny_moe_config("gpt_oss", rope_parameters=rope, max_position_embeddings=max_pos)
    raise KeyError(case)


CASES = ["llama3", "qwen3-yarn", "deepseek-yarn", "gpt_oss-yarn"]


def _check(tmp_path, case: str, orig: int, long_len: int, chunk: int) -> None:
    factor = 8 if case in ("llama3", "gpt_oss-yarn") else 4
    assert long_len > orig * factor  # past the scaled range as well as the original one
    max_pos = long_len + 64
    hf = save_tiny_model(_config(case, orig, max_pos), tmp_path)
    block = 16
    engine = LLMEngine(model=str(tmp_path), block_size=block, num_kv_blocks=max_pos // block + 16,
                       max_num_batched_tokens=chunk, max_model_len=max_pos)
    assert engine.max_model_len == max_pos
    long_prompt = [(i * 7919 + 13) % 300 + 5 for i in range(long_len)]
    short = [5, 17, 42, 99, 3]
    # the long prompt arrives at step 1: its chunks run beside the short one's decodes
    tokens, logprobs, batches = run_batch(engine, [long_prompt, short], 4, [1, 0])
    reached = paths_reached(batches, orig)
    assert {"chunked", "mixed", "long+short"} <= reached, reached
    assert max(int(b.positions.max()) for b in batches) >= long_len  # positions past both ranges ran
    assert_batch_matches_hf(hf, [long_prompt, short], tokens, logprobs, atol=2e-3)
    assert engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("case", CASES)
def test_positions_past_the_original_context(tmp_path, case):
    orig = 64 if case in ("llama3", "gpt_oss-yarn") else 128
    _check(tmp_path, case, orig, long_len=1100, chunk=256)


@pytest.mark.slow
@pytest.mark.parametrize(("case", "orig", "long_len"), [
    ("llama3", 4096, 40_000), ("qwen3-yarn", 4096, 40_000),
    # transformers' DeepSeek attention materialises [heads, T, T] fp32 scores: 12k keeps its reference in memory
    ("deepseek-yarn", 1024, 12_000),
])
def test_long_context_past_a_4k_original(tmp_path, case, orig, long_len):
    _check(tmp_path, case, orig, long_len=long_len, chunk=4096)
