"""logit_bias (added to the raw logits first), OS-entropy seeds for unseeded requests, and stop
strings held back until min_tokens are generated (vLLM's semantics)."""

from __future__ import annotations

import pytest
import torch

from tokenfab import LLM
from tokenfab.engine.llm_engine import LLMEngine
from tokenfab.engine.requests.sampling_params import SamplingParams
from tokenfab.engine.requests.sequence import Sequence
from tokenfab.engine.runner.sampler import apply_logit_bias, sample_next

PROMPT = [5, 17, 42, 99]


def seq(params: SamplingParams, prompt=PROMPT, base_seed: int = 0) -> Sequence:
    return Sequence("s", None, prompt, params, base_seed)


def test_logit_bias_is_added_per_row():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    seqs = [seq(SamplingParams(logit_bias={3: 5.0, 49: -100.0})), seq(SamplingParams()),
            seq(SamplingParams(logit_bias={0: 1.5}))]
    expected = logits.clone()
    expected[0, 3] += 5.0
    expected[0, 49] -= 100.0
    expected[2, 0] += 1.5
    assert torch.equal(apply_logit_bias(logits.clone(), seqs), expected)


def test_sample_next_leaves_its_input_untouched_and_applies_bias_before_the_draw():
    torch.manual_seed(1)
    logits = torch.randn(2, 128)
    before = logits.clone()
    greedy_top = int(logits[0].argmax())
    seqs = [seq(SamplingParams(temperature=0, logit_bias={greedy_top: -100.0, 7: 0.0}, repetition_penalty=1.3)),
            seq(SamplingParams(temperature=0.8, seed=3, logit_bias={11: 100.0}, top_k=2**31 - 1))]
    out = sample_next(logits, seqs, eos_ids=[])
    assert torch.equal(logits, before)
    assert out.token_ids[0] != greedy_top and out.token_ids[1] == 11


def test_logit_bias_through_the_engine(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, num_kv_blocks=100)
    plain = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    forced = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                   logit_bias={123: 100.0}))[0]
    assert forced.outputs[0].token_ids == [123] * 6
    banned = set(plain.outputs[0].token_ids)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                logit_bias={t: -100.0 for t in banned}))[0]
    assert not banned & set(out.outputs[0].token_ids)


def test_unseeded_requests_draw_from_os_entropy(tiny_llama_dir):
    """Two engines built with the same args.seed must not hand out the same "random" seeds."""
    seeds = []
    for _ in range(2):
        eng = LLMEngine(model=tiny_llama_dir, num_kv_blocks=20, seed=0)
        eng.add_request("a", PROMPT, SamplingParams())
        eng.add_request("b", PROMPT, SamplingParams(seed=77))
        seeds.append((eng._seqs["a"].base_seed, eng._seqs["b"].base_seed))
    assert seeds[0][0] != seeds[1][0]
    assert seeds[0][1] == seeds[1][1] == 77


@pytest.fixture(scope="module")
def bundled():
    return LLM(max_num_batched_tokens=256)


def test_stop_strings_are_not_checked_before_min_tokens(bundled):
    prompt = "Count: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14,"
    base = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    free = bundled.generate([prompt], base)[0].outputs[0]
    assert "," in free.text[:6]  # the continuation has an early comma
    stopped = bundled.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                        stop=[","]))[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == "," and "," not in stopped.text
    held = bundled.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                     stop=[","], min_tokens=6))[0].outputs[0]
    assert len(held.token_ids) >= 6
    assert held.token_ids == free.token_ids[: len(held.token_ids)]
    assert held.finish_reason == "stop"
    # the stop matched in text generated after min_tokens; what came before keeps its commas
    assert held.text == free.text[: len(held.text)] and held.text.count(",") >= 1


def test_untokenizable_prompt_is_a_value_error(bundled):
    with pytest.raises(ValueError, match="^prompt"):
        bundled.generate(["fine", "lone surrogate \ud800"], SamplingParams(max_tokens=2))
    assert not bundled.engine.has_unfinished_requests()
