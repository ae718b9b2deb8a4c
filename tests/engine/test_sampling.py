"""Sampling behaviour through the engine on a tiny model (token level)."""

from __future__ import annotations

import math

import pytest
import torch

from tokenfab.engine.llm import LLM
from tokenfab.engine.requests.sampling_params import SamplingParams
from tokenfab.engine.requests.sequence import Sequence
from tokenfab.engine.runner.sampler import apply_penalties

PROMPTS = [[5, 17, 42, 99], [1, 2, 3, 4, 5, 6, 7, 8, 9], [200] * 13, [7, 300, 12]]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, num_kv_blocks=400)


def ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_seeded_sampling_is_reproducible(llm):
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    a, b = ids(llm.generate(PROMPTS, p)), ids(llm.generate(PROMPTS, p))
    assert a == b
    c = ids(llm.generate(PROMPTS, SamplingParams(temperature=1.0, seed=99, max_tokens=16, ignore_eos=True)))
    assert c != a


def test_seed_result_independent_of_batch(llm):
    p = SamplingParams(temperature=0.8, seed=7, max_tokens=10, ignore_eos=True)
    alone = ids(llm.generate([PROMPTS[1]], p))[0]
    together = ids(llm.generate(PROMPTS, p))[1]
    assert alone == together


def test_mixed_greedy_and_sampled_batch_keeps_greedy_identical(llm):
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    sampled = SamplingParams(temperature=1.5, top_k=20, max_tokens=12, ignore_eos=True)
    alone = ids(llm.generate(PROMPTS, greedy))
    mixed = ids(llm.generate(PROMPTS + PROMPTS, [greedy] * 4 + [sampled] * 4))
    assert mixed[:4] == alone
    assert mixed[4:] != alone  # sampling at T=1.5 really sampled


def test_top_k_one_equals_greedy(llm):
    greedy = ids(llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)))
    k1 = ids(llm.generate(PROMPTS, SamplingParams(temperature=1.0, top_k=1, max_tokens=8, ignore_eos=True)))
    assert k1 == greedy


def test_sampled_distribution_follows_probabilities():
    """The exponential race with the hash RNG draws from softmax(logits / T)."""
    from tokenfab.kernels.sampling import sample_ref

    n, logits = 4000, torch.tensor([2.0, 1.0, 0.0, -1.0, -30.0])
    rows = logits.repeat(n, 1)
    out = sample_ref(rows, torch.full((n,), 1.0), torch.zeros(n, dtype=torch.int64), torch.ones(n),
                     torch.zeros(n), torch.arange(n, dtype=torch.int64) * 7919 + 1)
    freq = torch.bincount(out, minlength=5).float() / n
    expect = torch.softmax(logits, -1)
    assert torch.allclose(freq, expect, atol=0.03)


def test_stop_token_ids_max_tokens_and_min_tokens(llm):
    greedy = ids(llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)))[0]
    stop_tok = greedy[3]
    first = greedy.index(stop_tok)
    out = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_tok]))[0]
    c = out.outputs[0]
    assert c.token_ids == greedy[: first + 1] and c.finish_reason == "stop" and c.stop_reason == stop_tok
    out = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=10, min_tokens=first + 2,
                                                   stop_token_ids=[stop_tok]))[0]
    assert len(out.outputs[0].token_ids) >= first + 2
    assert stop_tok not in out.outputs[0].token_ids[: first + 2]
    out = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 3


def test_logprobs_with_top_alternatives(llm):
    out = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True))[0]
    c = out.outputs[0]
    assert len(c.logprobs) == 4
    for tok, entry in zip(c.token_ids, c.logprobs):
        assert tok in entry and entry[tok].rank == 1  # greedy picks the most likely
        assert len(entry) == 3
        assert all(lp.logprob <= 0 for lp in entry.values())
        assert sum(math.exp(lp.logprob) for lp in entry.values()) <= 1.0 + 1e-5


def test_n_completions_and_token_id_prompt(llm):
    out = llm.generate([PROMPTS[0]], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert out.prompt_token_ids == PROMPTS[0]


def _seq(prompt, outputs, **params):
    s = Sequence("x", None, prompt, SamplingParams(**params), 0)
    s.token_ids += outputs
    return s


def test_penalties():
    logits = torch.tensor([[1.0, 2.0, -1.0, 0.5], [1.0, 2.0, -1.0, 0.5]])
    seqs = [_seq([0], [1, 1, 2], presence_penalty=0.5, frequency_penalty=0.25), _seq([3], [2], repetition_penalty=2.0)]
    out = apply_penalties(logits.clone(), seqs)
    assert torch.allclose(out[0], torch.tensor([1.0, 2.0 - 0.5 - 0.5, -1.0 - 0.5 - 0.25, 0.5]))
    assert torch.allclose(out[1], torch.tensor([1.0, 2.0, -2.0, 0.25]))


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(max_tokens=-1), dict(n=0), dict(top_p=0.0),
                                 dict(min_tokens=5, max_tokens=2), dict(logprobs=50)])
def test_invalid_params_are_rejected(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)
