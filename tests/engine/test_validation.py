"""Requests are validated against the loaded model before anything is queued; a bad request is a
ValueError naming the parameter and leaves the engine exactly as it was."""

from __future__ import annotations

import pytest

from tokenfab.engine.llm import LLM
from tokenfab.engine.llm_engine import LLMEngine
from tokenfab.engine.requests.sampling_params import SamplingParams

VOCAB = 320  # tests/tiny_models.py
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 17, 42, 99], [1, 2, 3, 4, 5, 6, 7, 8, 9], [7, 300, 12]]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, num_kv_blocks=200, max_model_len=256)


def greedy(llm, prompts=PROMPTS, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    return greedy(LLM(tiny_llama_dir, num_kv_blocks=200, max_model_len=256))


@pytest.mark.parametrize("prompt, params, name", [
    ([1, 2, VOCAB], GREEDY, "prompt"),
    ([1, -1, 2], GREEDY, "prompt"),
    ([], GREEDY, "prompt"),
    ([1, 2], SamplingParams(stop_token_ids=[VOCAB], min_tokens=2, max_tokens=4), "stop_token_ids"),
    ([1, 2], SamplingParams(stop_token_ids=[2**31 - 1]), "stop_token_ids"),
    ([1, 2], SamplingParams(logit_bias={VOCAB + 5: 1.0}), "logit_bias"),
    ([1] * 256, GREEDY, "prompt"),  # no room for a generated token in a 256-token context
])
def test_check_request_names_the_parameter(llm, prompt, params, name):
    with pytest.raises(ValueError, match=f"^{name}"):
        llm.engine.check_request(prompt, params)


def test_max_tokens_zero_may_fill_the_whole_context(llm):
    llm.engine.check_request([1] * 256, SamplingParams(max_tokens=0))


@pytest.mark.parametrize("kw, name", [
    (dict(top_k=2**63), "top_k"), (dict(seed=-1), "seed"), (dict(seed=2**63), "seed"), (dict(n=129), "n"),
    (dict(max_tokens=2**31), "max_tokens"), (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    (dict(logprobs=21), "logprobs"), (dict(prompt_logprobs=-1), "prompt_logprobs"),
    (dict(temperature=float("nan")), "temperature"), (dict(top_p=float("inf")), "top_p"),
    (dict(logit_bias={1: 101.0}), "logit_bias"), (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={"x": 1.0}), "logit_bias"), (dict(stop_token_ids=[-3]), "stop_token_ids"),
    (dict(stop=[""]), "stop"), (dict(n=1.5), "n"), (dict(max_tokens=True), "max_tokens"),
])
def test_sampling_params_bounds(kw, name):
    with pytest.raises(ValueError, match=f"^{name}"):
        SamplingParams(**kw)


def test_logit_bias_string_keys_and_top_k_over_vocab_are_accepted(llm, reference):
    assert SamplingParams(logit_bias={"7": 2.5}).logit_bias == {7: 2.5}
    # top_k above the vocabulary is "off": greedy rows are unaffected and sampled rows run
    assert greedy(llm, params=SamplingParams(temperature=0, top_k=2**31 - 1, max_tokens=8, ignore_eos=True)) \
        == reference
    outs = llm.generate(PROMPTS, SamplingParams(temperature=1.0, top_k=2**31 - 1, max_tokens=4, seed=3))
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)


def test_out_of_vocab_stop_token_with_min_tokens_cannot_poison_the_batch(llm, reference):
    """Before: an out-of-vocabulary stop_token_ids with min_tokens was queued, raised inside
    engine.step() (indexing the logits) and aborted every request in flight."""
    eng = llm.engine
    good = [f"good-{i}" for i in range(len(PROMPTS))]
    for rid, p in zip(good, PROMPTS):
        eng.add_request(rid, p, GREEDY)
    with pytest.raises(ValueError, match="^stop_token_ids"):
        eng.add_request("bad", [1, 2, 3], SamplingParams(stop_token_ids=[VOCAB + 1], min_tokens=3, max_tokens=6))
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    assert set(done) == set(good)
    assert [done[r].token_ids for r in good] == reference
    assert all(done[r].finish_reason == "length" for r in good)


def test_rejected_batch_leaves_llm_as_it_was(llm, reference):
    bad_batch = [PROMPTS[0], PROMPTS[1], [1, 2, VOCAB + 7]]  # the last prompt is out of vocabulary
    with pytest.raises(ValueError, match="^prompt"):
        llm.generate(bad_batch, GREEDY)
    assert not llm.engine.has_unfinished_requests()
    assert not llm.engine._seqs
    with pytest.raises(ValueError, match="^stop_token_ids"):
        llm.generate(PROMPTS, [GREEDY, GREEDY, SamplingParams(max_tokens=3, stop_token_ids=[VOCAB])])
    assert not llm.engine.has_unfinished_requests()
    assert greedy(llm) == reference


def test_priority_and_cache_salt_are_checked(llm):
    with pytest.raises(ValueError, match="^priority"):
        llm.engine.add_request("p", [1, 2], GREEDY, priority=2**40)
    with pytest.raises(ValueError, match="^cache_salt"):
        llm.engine.add_request("s", [1, 2], GREEDY, cache_salt=b"x")  # type: ignore[arg-type]
    assert not llm.engine.has_unfinished_requests()


def test_kv_budget_too_small_for_one_sequence_is_a_clear_error(tiny_llama_dir):
    with pytest.raises(ValueError, match="--kv-cache-memory.*--max-model-len"):
        LLMEngine(model=tiny_llama_dir, kv_cache_memory=4096, max_model_len=512)


def test_float16_is_refused_on_cuda_only():
    import torch

    from tokenfab.engine.llm_engine import resolve_dtype

    with pytest.raises(ValueError, match="float16.*bfloat16"):
        resolve_dtype("float16", torch.device("cuda"))
    assert resolve_dtype("float16", torch.device("cpu")) == torch.float16
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
