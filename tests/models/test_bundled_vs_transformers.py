"""The bundled SmolLM2-135M-Instruct (GGUF, Q4_1) generates exactly transformers' greedy
tokens (fp32, same GGUF), for varied prompts, alone and all in one batch.

The one-batch test compares all NEW_TOKENS tokens (the drift check); the per-prompt and the
chunked-prefill runs compare the first SHORT_TOKENS of them: the extra decode steps reach no
path the one-batch test does not (batch-1 decode is the same kernels at M = 1), and they were
most of this file's time (8 x 64 single-sequence steps)."""

from __future__ import annotations

import pytest
import torch

from tokenfab import LLM, SamplingParams
from tokenfab.bench.prompts import CHATS, TEXT_PROMPTS

NEW_TOKENS = 64
SHORT_TOKENS = 16


@pytest.fixture(scope="module")
def llm():
    return LLM(max_num_batched_tokens=512)


@pytest.fixture(scope="module")
def prompts(llm):
    tok = llm.tokenizer
    return [tok.encode(p) for p in TEXT_PROMPTS] + [llm.apply_chat_template(c) for c in CHATS]


@pytest.fixture(scope="module")
def hf_greedy(prompts, hf_bundled):
    hf = hf_bundled  # the session's shared transformers copy of the bundled model (tests/conftest.py)
    out = []
    with torch.no_grad():
        for ids in prompts:
            res = hf(torch.tensor([ids]), use_cache=True)
            past, toks = res.past_key_values, [int(res.logits[0, -1].argmax())]
            for _ in range(NEW_TOKENS - 1):
                res = hf(torch.tensor([[toks[-1]]]), past_key_values=past, use_cache=True)
                past = res.past_key_values
                toks.append(int(res.logits[0, -1].argmax()))
            out.append(toks)
    return out


PARAMS = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
SHORT = SamplingParams(temperature=0, max_tokens=SHORT_TOKENS, ignore_eos=True)


def test_each_prompt_alone_matches_transformers(llm, prompts, hf_greedy):
    for ids, expected in zip(prompts, hf_greedy):
        got = llm.generate([ids], SHORT)[0].outputs[0].token_ids
        assert got == expected[:SHORT_TOKENS]


def test_all_prompts_in_one_batch_match_transformers(llm, prompts, hf_greedy):
    outs = llm.generate(prompts, PARAMS)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy


def test_batch_with_chunked_prefill_matches(prompts, hf_greedy):
    small = LLM(max_num_batched_tokens=16, block_size=8)
    outs = small.generate(prompts, SHORT)
    assert [o.outputs[0].token_ids for o in outs] == [e[:SHORT_TOKENS] for e in hf_greedy]
