"""Llama-family logits equal transformers' (fp32) at prefill and over decode steps through the paged cache."""

from __future__ import annotations

import pytest

from tests.tiny_models import (
    assert_batch_matches_hf,
    assert_batched_equals_alone,
    assert_step_logits_match_hf,
    paths_reached,
    run_batch,
    save_tiny_model,
    tiny_config,
)
from tokenfab.engine.llm_engine import LLMEngine

CASES = {
    "llama": {},
    "llama-tied-bias": dict(tie_word_embeddings=True, attention_bias=True),
    "llama3-rope": dict(rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 64}),
    "mistral": dict(sliding_window=7),
    "qwen2": {},
    "qwen3": {},
    "qwen3-yarn": dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                        "original_max_position_embeddings": 128}),
}


def _model_type(case: str) -> str:
    return case.split("-")[0].replace("llama3", "llama")


@pytest.fixture(scope="module", params=sorted(CASES))
def tiny(request, tmp_path_factory):
    case = request.param
    path = tmp_path_factory.mktemp(case)
    config = tiny_config(_model_type(case), **CASES[case])
    hf = save_tiny_model(config, path)
    engine = LLMEngine(model=str(path), block_size=4, num_kv_blocks=64, max_num_batched_tokens=64)
    return hf, engine


def test_prefill_and_decode_logits_match(tiny):
    hf, engine = tiny
    assert_step_logits_match_hf(engine, hf, [[5, 17, 42, 99, 3, 250, 7, 8, 9, 10, 11], [1, 2, 3], list(range(30, 60))])


def test_batched_equals_alone(tiny):
    _, engine = tiny
    assert_batched_equals_alone(engine)


def test_sliding_window_batched_long_and_short(tmp_path):
    """Mistral (window 7): contexts past the window batched with shorter ones, a prompt arriving
    mid-decode, chunked prefills (8-token budget); per request, equal to transformers."""
    hf = save_tiny_model(tiny_config("mistral", sliding_window=7), tmp_path)
    engine = LLMEngine(model=str(tmp_path), block_size=4, num_kv_blocks=64, max_num_batched_tokens=8)
    prompts = [[5, 17, 42], list(range(30, 45)), [1, 2, 3, 4, 5, 6], [250]]
    tokens, logprobs, batches = run_batch(engine, prompts, 8, [0, 0, 2, 4])
    assert {"mixed", "chunked", "long+short decodes"} <= paths_reached(batches, 7)
    assert_batch_matches_hf(hf, prompts, tokens, logprobs)
