"""Draft-model speculation (tokenfab/speculative/draft_model.py) in the engine.

A model that drafts for itself proposes exactly the target's greedy tokens (its rows run through
the same batch-invariant kernels): acceptance must be 1.0 and every verify step at batch 1 must
emit k + 1 tokens; outputs are identical to plain decoding alone, batched, with prefix caching,
chunked prefill and preemption (tests/speculative/spec_cases.py). On the bundled model (slow tier) and on
a tiny random Llama (fast). Seeded sampled requests are reproducible, and a draft with another
vocabulary is refused with a clear error.
"""

from __future__ import annotations

import pytest

from tests.speculative.spec_cases import check_greedy_identity, greedy, outputs, plain_llm, random_prompts
from tests.tiny_models import save_tiny_model, tiny_config
from tokenfab import LLM, SamplingParams
from tokenfab.engine.llm_engine import LLMEngine
from tokenfab.loader.bundled import bundled_model_path

K = 4


def draft_config(path, k: int = K) -> dict:
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": k}


def assert_full_acceptance(llm: LLM) -> None:
    st = llm.engine.spec.stats()
    assert st["spec_draft_tokens_total"] > 0
    assert st["spec_acceptance_rate"] == 1.0


def batch1_accepted_length(llm: LLM, prompt: list[int]) -> float:
    """max_tokens = 1 + 3 (k + 1): the prefill's token, then three verify steps of k drafts each."""
    spec = llm.engine.spec
    before = (spec.num_accepted_tokens, spec.num_verified)
    out = outputs(llm, [prompt], 1 + 3 * (K + 1))
    assert len(out[0]) == 1 + 3 * (K + 1)
    acc, ver = spec.num_accepted_tokens - before[0], spec.num_verified - before[1]
    return 1 + acc / ver


# ---------------------------------------------------------------- tiny Llama (fast)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("draft-llama")
    save_tiny_model(tiny_config("llama"), path)
    return str(path)


def test_tiny_self_draft_identical_and_fully_accepted(tiny_llama):
    kw = dict(block_size=4, max_num_batched_tokens=64)
    plain = plain_llm(tiny_llama, num_kv_blocks=128, **kw)
    spec = LLM(model=tiny_llama, num_kv_blocks=128, speculative_config=draft_config(tiny_llama), **kw)
    prompts = random_prompts(320)
    assert batch1_accepted_length(spec, prompts[1]) == K + 1
    assert outputs(spec, prompts, 20) == outputs(plain, prompts, 20)  # batched, mixed lengths
    assert_full_acceptance(spec)


@pytest.mark.slow
def test_tiny_self_draft_prefix_chunked_preempted_overlap(tiny_llama):
    plain = plain_llm(tiny_llama, block_size=4, num_kv_blocks=128)
    spec = LLM(model=tiny_llama, block_size=4, num_kv_blocks=128, speculative_config=draft_config(tiny_llama))
    tight = LLM(model=tiny_llama, block_size=4, num_kv_blocks=20, max_num_batched_tokens=16,
                speculative_config=draft_config(tiny_llama))
    check_greedy_identity(plain, spec, tight, random_prompts(320), 24)
    assert_full_acceptance(spec)
    assert_full_acceptance(tight)
    # overlap scheduling: every step with a draft module runs synchronously, same tokens
    overlap = LLM(model=tiny_llama, block_size=4, num_kv_blocks=128, async_scheduling=True,
                  speculative_config=draft_config(tiny_llama))
    assert outputs(overlap, random_prompts(320), 24) == outputs(plain, random_prompts(320), 24)
    assert_full_acceptance(overlap)


def test_draft_with_another_vocabulary_is_refused(tiny_llama, tmp_path):
    save_tiny_model(tiny_config("llama", vocab_size=256), tmp_path / "other")
    with pytest.raises(ValueError, match="vocabulary size 256 differs"):
        LLMEngine(model=tiny_llama, num_kv_blocks=32, speculative_config=draft_config(tmp_path / "other"))
    with pytest.raises(ValueError, match="cannot be loaded"):
        LLMEngine(model=tiny_llama, num_kv_blocks=32, speculative_config=draft_config(tmp_path / "missing"))


# ---------------------------------------------------------------- the bundled model (slow)


@pytest.fixture(scope="module")
def bundled():
    cfg = draft_config(bundled_model_path())
    return (LLM(num_kv_blocks=400), LLM(num_kv_blocks=400, speculative_config=cfg),
            LLM(num_kv_blocks=9, max_num_batched_tokens=16, speculative_config=cfg))


@pytest.mark.slow
def test_bundled_self_draft_identical_everywhere(bundled):
    plain, spec, tight = bundled
    chat = [plain.apply_chat_template([{"role": "user", "content": c}])
            for c in ("Name three rivers.", "Write one sentence about the sea, please, in plain words.")]
    prompts = chat + random_prompts(20000, (3, 45), seed=8)
    assert batch1_accepted_length(spec, prompts[0]) == K + 1
    check_greedy_identity(plain, spec, tight, prompts, 24)
    assert_full_acceptance(spec)
    assert_full_acceptance(tight)


@pytest.mark.slow
def test_bundled_seeded_sampling_is_reproducible(bundled):
    """Drafts drawn from q with the request's DRAFT_STREAM, q handed to the acceptance rule: the
    same seed gives the same tokens, alone (run twice) and batched (run twice; two copies of a
    request in one batch agree). Alone and batched runs may differ from each other: k follows the
    batch size, and where a step ends (bonus draw from p vs a draft row) changes which seeded
    stream decides a position; each run is exactly distributed as plain sampling (test_draft_batch.py)."""
    _, spec, _ = bundled
    prompts = random_prompts(20000, (7, 30), seed=3)
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=123, max_tokens=20, ignore_eos=True)
    verified = spec.engine.spec.num_verified
    alone = [spec.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    assert alone == [spec.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    batch = [prompts[0], prompts[1], prompts[0]]
    first = [o.outputs[0].token_ids for o in spec.generate(batch, params)]
    assert first == [o.outputs[0].token_ids for o in spec.generate(batch, params)]
    assert first[0] == first[2] and all(len(t) == 20 for t in alone + first)
    assert spec.engine.spec.num_verified > verified


@pytest.mark.slow
def test_engine_core_process_with_a_draft_model():
    """Through the engine-core process (``python -m tokenfab.engine.core.process``, as
    ``tokenfab serve`` runs it): the same greedy tokens as plain decoding, drafts verified."""
    import time

    from tokenfab.engine.args import EngineArgs
    from tokenfab.engine.core.client import EngineCoreClient

    prompts = random_prompts(20000, (5, 20), seed=11)
    ref = outputs(LLM(num_kv_blocks=200), prompts, 12)
    args = EngineArgs(num_kv_blocks=200, speculative_config=draft_config(bundled_model_path()))
    client = EngineCoreClient.spawn(args)
    try:
        for i, p in enumerate(prompts):
            client.add_request(f"r{i}", p, greedy(12))
        final = {}
        deadline = time.monotonic() + 300
        while client.has_unfinished_requests():
            assert time.monotonic() < deadline
            for out in client.step():
                if out.finished:
                    final[out.request_id] = list(out.outputs[0].token_ids)
    finally:
        client.close()
    assert [final[f"r{i}"] for i in range(len(prompts))] == ref
