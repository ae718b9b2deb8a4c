"""Qwen3-Next / Qwen3.5 through the real engine (the hybrid cache: paged KV blocks for the attention layers, a
state slot per sequence for the Gated DeltaNet layers): greedy tokens equal transformers' (fp32, full forward
per token) for prompts alone and batched with different lengths, with a 16-token step budget so the long
prompt is prefilled in chunks beside the others' decodes; and the engine's top log-probabilities equal
transformers' on a schedule where prompts arrive mid-decode."""

from __future__ import annotations

import pytest
import torch

from tests.models.hybrid_models import FAMILIES, save_tiny_hybrid
from tests.tiny_models import assert_batch_matches_hf, hf_logits, paths_reached, run_batch
from tokenfab import LLM, SamplingParams
from tokenfab.engine.llm_engine import LLMEngine

# 70 tokens: chunked by the 16-token budget and past the prefill kernel's 64-token chunk; a one-token prompt
PROMPTS = [list(range(5, 75)), [17, 42, 99], [250], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
STEPS = 8
ENGINE = dict(block_size=4, num_kv_blocks=96, max_num_batched_tokens=16, cpu_threads=1)

@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny matrices: one thread is far faster on a shared machine (the engines run one too)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = save_tiny_hybrid(request.param, path)
    return hf, path


def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(hf_logits(hf, ids)[-1].argmax()))
    return ids[len(prompt):]


def test_llm_greedy_equals_transformers_alone_and_batched(tiny):
    hf, path = tiny
    llm = LLM(model=str(path), **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
    expected = [_hf_greedy(hf, p, STEPS) for p in PROMPTS]
    alone = [list(llm.generate([p], params)[0].outputs[0].token_ids) for p in PROMPTS]
    assert alone == expected
    batched = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params)]
    assert batched == expected


def test_engine_mixed_arrivals_match_transformers(tiny):
    """Prompts arriving while others decode (the one-token prompt in a decode step), the long one chunked;
    tokens and top-5 log-probabilities equal transformers' per request."""
    hf, path = tiny
    engine = LLMEngine(model=str(path), **ENGINE)
    prompts, arrivals = [PROMPTS[3], PROMPTS[0], PROMPTS[2], PROMPTS[1]], [0, 1, 3, 5]
    tokens, logprobs, batches = run_batch(engine, prompts, STEPS, arrivals)
    assert {"mixed", "chunked", "decodes"} <= paths_reached(batches, 16)
    assert_batch_matches_hf(hf, prompts, tokens, logprobs)


def test_decode_graph_padding_rows(tiny):
    """The decode-graph path (run eagerly on a CPU) pads a decode batch with rows on the scratch slot (their
    position 0 makes them "fresh": the sync-free reset writes only the scratch row); the real rows' tokens
    stay transformers'."""
    hf, path = tiny
    engine = LLMEngine(model=str(path), **ENGINE)
    engine.runner.capture_decode_graphs(max_batch=8, max_model_len=128)
    prompts = PROMPTS[1:]  # 3 sequences: decode batches of 3 padded to a captured size
    tokens, logprobs, _ = run_batch(engine, prompts, STEPS)
    assert_batch_matches_hf(hf, prompts, tokens, logprobs)
