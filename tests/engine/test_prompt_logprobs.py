"""Prompt logprobs (vLLM's ``prompt_logprobs``, the server's ``echo`` + ``logprobs``) come from the
prefill's own positions and match transformers' float32 log-softmax on the bundled model, with
chunked prefill, next to other requests, after a prefix-cache hit, and with ``max_tokens`` 0."""

from __future__ import annotations

import pytest
import torch

from tokenfab import LLM, SamplingParams

TEXTS = ["The capital of France is Paris, and the capital of Italy is", "def add(a, b):\n    return a + b\n" * 3]
K = 3
TOL = 5e-5


@pytest.fixture(scope="module")
def llm():
    return LLM(max_num_batched_tokens=512, block_size=16)


@pytest.fixture(scope="module")
def prompts(llm):
    return [llm.tokenizer.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def hf_logprobs(prompts, hf_bundled):
    """transformers' float32 log-softmax of every position of each prompt (the session's shared
    transformers copy of the bundled model, tests/conftest.py)."""
    hf = hf_bundled
    with torch.no_grad():
        return [torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1) for ids in prompts]


def check(prompt_logprobs, ids, ref: torch.Tensor, k: int = K) -> None:
    assert len(prompt_logprobs) == len(ids)
    assert prompt_logprobs[0] is None
    for pos in range(1, len(ids)):
        entry, row, tok = prompt_logprobs[pos], ref[pos - 1], ids[pos]
        assert abs(entry[tok].logprob - float(row[tok])) < TOL, pos
        # rank: 1 + the tokens more likely (ties within the tolerance may go either way)
        assert int((row > row[tok] + TOL).sum()) + 1 <= entry[tok].rank <= int((row > row[tok] - TOL).sum()) + 1
        top = row.topk(k)
        alts = sorted((e for t, e in entry.items() if e.rank <= k), key=lambda e: e.rank)
        assert len(alts) >= k
        for alt, v in zip(alts, top.values):
            assert abs(alt.logprob - float(v)) < TOL
        assert len(entry) in (k, k + 1) if k else len(entry) == 1


def test_prompt_logprobs_match_transformers(llm, prompts, hf_logprobs):
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=K))
    for out, ids, ref in zip(outs, prompts, hf_logprobs):
        check(out.prompt_logprobs, ids, ref)
        assert len(out.outputs[0].token_ids) == 2


def test_chunked_prefill_and_mixed_batch(prompts, hf_logprobs):
    small = LLM(max_num_batched_tokens=7, block_size=8)  # every prompt is prefilled over several steps
    plain = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    scored = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=K)
    alone = [o.outputs[0].token_ids for o in small.generate(prompts, plain)]
    outs = small.generate([prompts[0], prompts[1], prompts[0]], [scored, plain, plain])
    check(outs[0].prompt_logprobs, prompts[0], hf_logprobs[0])
    assert outs[1].prompt_logprobs is None
    assert [o.outputs[0].token_ids for o in outs] == [alone[0], alone[1], alone[0]]


def test_prefix_cache_hit_does_not_drop_them(llm, prompts, hf_logprobs):
    ids = prompts[1]
    warm = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1))[0]
    again = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1))[0]
    assert again.num_cached_tokens > 0 and warm.prompt_logprobs is None  # the prefix is cached
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
    assert out.num_cached_tokens == 0
    check(out.prompt_logprobs, ids, hf_logprobs[1], k=0)
    assert all(len(e) == 1 for e in out.prompt_logprobs[1:])  # k=0: the prompt token alone


def test_max_tokens_zero_scores_the_prompt_and_generates_nothing(llm, prompts, hf_logprobs):
    outs = llm.generate(prompts, SamplingParams(max_tokens=0, prompt_logprobs=K))
    for out, ids, ref in zip(outs, prompts, hf_logprobs):
        assert out.finished and out.outputs[0].finish_reason == "length"
        assert out.outputs[0].token_ids == [] and out.outputs[0].text == ""
        check(out.prompt_logprobs, ids, ref)
    assert llm.engine.block_manager.num_used_blocks == 0
