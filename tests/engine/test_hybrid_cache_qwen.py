"""Hybrid cache (issue 29) with the real Gated DeltaNet models: tiny random Qwen3.5 (dense) and Qwen3-Next (MoE)
checkpoints in their official layouts (tests/models/hybrid_models.py) through the real engine, against
transformers' greedy tokens (fp32, full forward per token, no cache): a request flood into KV for about
three sequences (preemption and recompute, chunked prefill), one request at a time (each on a slot the one
before left dirty), and all at once.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.models.hybrid_models import save_tiny_hybrid
from tests.tiny_models import hf_greedy_tokens
from tokenfab.engine.llm_engine import LLMEngine
from tokenfab.engine.requests.sampling_params import SamplingParams

N_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=N_TOKENS, ignore_eos=True)
# family -> requests in the flood (the MoE one is slower on CPU: fewer)
FAMILIES = {"qwen3_5_text": 30, "qwen3_next": 16}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(checkpoint dir, prompts of 3..50 tokens, transformers' greedy tokens for each)."""
    name = request.param
    path = tmp_path_factory.mktemp(name)
    save_tiny_hybrid(name, path)
    rng = random.Random(1)
    prompts = [[rng.randrange(1, 320) for _ in range(rng.randint(3, 50))] for _ in range(FAMILIES[name])]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread is far faster on a shared machine (the engines too)
    try:
        expected = [hf_greedy_tokens(path, p, N_TOKENS) for p in prompts]
    finally:
        torch.set_num_threads(threads)
    return path, prompts, expected


def run_all(eng: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, GREEDY)
    done: dict[str, list[int]] = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    bm = eng.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks
    assert bm.state_slots.num_free == bm.state_slots.num_slots
    return [done[f"r{i}"] for i in range(len(prompts))]


def test_flood_with_preemption_equals_transformers(family):
    """KV for about 3 sequences (50 + 8 tokens: 4 blocks of 16), 8 state slots, 32-token steps: prompts are
    chunked, sequences preempted and recomputed from a zero state, slots reused."""
    path, prompts, expected = family
    eng = LLMEngine(model=str(path), dtype="float32", cpu_threads=1, num_kv_blocks=12, num_state_slots=8,
                    max_num_batched_tokens=32)
    assert eng.runner.state_caches and eng.block_manager.state_snapshots is not None
    assert run_all(eng, prompts) == expected
    assert eng.get_stats().num_preemptions_total > 0


def test_alone_and_batched_equal_transformers(family):
    path, prompts, expected = family
    eng = LLMEngine(model=str(path), dtype="float32", cpu_threads=1, num_kv_blocks=400, max_num_batched_tokens=4096)
    for p, e in zip(prompts[:3], expected[:3]):
        assert run_all(eng, [p]) == [e]
    assert run_all(eng, prompts) == expected


def test_prefix_hits_equal_transformers(family):
    """Prefix caching with state snapshots: a repeated prompt, a shared 3-block system prompt with other tails,
    a second turn over a first; hits restore the snapshot at their last block, tokens equal transformers'."""
    path, prompts, _ = family
    system = list(range(10, 10 + 48))
    batch = [system + prompts[0][:5], system + prompts[0][:5], system + prompts[1][:20],
             prompts[2] + prompts[3], prompts[2] + prompts[3] + prompts[4]]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        expected = [hf_greedy_tokens(path, p, N_TOKENS) for p in batch]
    finally:
        torch.set_num_threads(threads)
    eng = LLMEngine(model=str(path), dtype="float32", cpu_threads=1, num_kv_blocks=400, max_num_batched_tokens=24)
    assert [run_all(eng, [p])[0] for p in batch] == expected
    assert eng.block_manager.state_snapshots.restored >= 3 and eng.block_manager.prefix_hits >= 3 * 48
