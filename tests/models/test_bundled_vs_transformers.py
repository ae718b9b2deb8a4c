"""The bundled SmolLM2-135M-Instruct (GGUF, Q4_1) generates exactly transformers' greedy
tokens (fp32, same GGUF), for varied prompts, alone and all in one batch.

Fast tier: four prompts of different lengths (short text, code, Japanese, a chat with a system
turn), FAST_TOKENS tokens in one batch (the drift check), the first SHORT_TOKENS of them alone and
under chunked prefill. Slow tier: the same three checks on every prompt of the shared set, NEW_TOKENS
in one batch. transformers' reference decode steps (one forward per token per prompt) were most of
this file's time (8 x 64 steps); the fast tier runs 4 x FAST_TOKENS of them."""

from __future__ import annotations

import pytest
import torch

from tokenfab import LLM, SamplingParams
from tokenfab.bench.prompts import CHATS, TEXT_PROMPTS

NEW_TOKENS = 64
FAST_TOKENS = 32
SHORT_TOKENS = 16
FAST_SHORT_TOKENS = 8
# different lengths and scripts: 5-token text, code, Japanese (multi-byte tokens), a two-turn chat
FAST_TEXTS = [TEXT_PROMPTS[0], TEXT_PROMPTS[1], TEXT_PROMPTS[5]]
FAST_CHATS = [CHATS[1]]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def transformers_greedy(hf, prompts: list[list[int]], n: int) -> list[list[int]]:
    """transformers' ``n`` greedy tokens after each prompt, one sequence at a time (KV cache, fp32)."""
    out = []
    with torch.no_grad():
        for ids in prompts:
            res = hf(torch.tensor([ids]), use_cache=True)
            past, toks = res.past_key_values, [int(res.logits[0, -1].argmax())]
            for _ in range(n - 1):
                res = hf(torch.tensor([[toks[-1]]]), past_key_values=past, use_cache=True)
                past = res.past_key_values
                toks.append(int(res.logits[0, -1].argmax()))
            out.append(toks)
    return out


@pytest.fixture(scope="module")
def llm():
    return LLM(max_num_batched_tokens=512)


@pytest.fixture(scope="module")
def chunked_llm():
    return LLM(max_num_batched_tokens=16, block_size=8)  # prompts longer than 16 tokens prefill over steps


def encode(llm, texts, chats) -> list[list[int]]:
    return [llm.tokenizer.encode(p) for p in texts] + [llm.apply_chat_template(c) for c in chats]


@pytest.fixture(scope="module")
def fast_prompts(llm):
    prompts = encode(llm, FAST_TEXTS, FAST_CHATS)
    assert len({len(p) for p in prompts}) == len(prompts)  # all of different lengths
    assert max(len(p) for p in prompts) > 16  # at least one is chunked by chunked_llm
    return prompts


@pytest.fixture(scope="module")
def fast_greedy(fast_prompts, hf_bundled):
    # the session's shared transformers copy of the bundled model (tests/conftest.py)
    return transformers_greedy(hf_bundled, fast_prompts, FAST_TOKENS)


def test_all_prompts_in_one_batch_match_transformers(llm, fast_prompts, fast_greedy):
    outs = llm.generate(fast_prompts, greedy(FAST_TOKENS))
    assert [o.outputs[0].token_ids for o in outs] == fast_greedy


def test_each_prompt_alone_matches_transformers(llm, fast_prompts, fast_greedy):
    for ids, expected in zip(fast_prompts, fast_greedy):
        got = llm.generate([ids], greedy(FAST_SHORT_TOKENS))[0].outputs[0].token_ids
        assert got == expected[:FAST_SHORT_TOKENS]


def test_batch_with_chunked_prefill_matches(chunked_llm, fast_prompts, fast_greedy):
    outs = chunked_llm.generate(fast_prompts, greedy(FAST_SHORT_TOKENS))
    assert [o.outputs[0].token_ids for o in outs] == [e[:FAST_SHORT_TOKENS] for e in fast_greedy]


# The slow tier: every prompt of the shared set, NEW_TOKENS tokens in one batch (the full drift check).


@pytest.fixture(scope="module")
def prompts(llm):
    return encode(llm, TEXT_PROMPTS, CHATS)


@pytest.fixture(scope="module")
def hf_greedy(prompts, hf_bundled):
    return transformers_greedy(hf_bundled, prompts, NEW_TOKENS)


@pytest.mark.slow
def test_all_prompts_in_one_batch_match_transformers_full(llm, prompts, hf_greedy):
    outs = llm.generate(prompts, greedy(NEW_TOKENS))
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy


@pytest.mark.slow
def test_each_prompt_alone_matches_transformers_full(llm, prompts, hf_greedy):
    for ids, expected in zip(prompts, hf_greedy):
        got = llm.generate([ids], greedy(SHORT_TOKENS))[0].outputs[0].token_ids
        assert got == expected[:SHORT_TOKENS]


@pytest.mark.slow
def test_batch_with_chunked_prefill_matches_full(chunked_llm, prompts, hf_greedy):
    outs = chunked_llm.generate(prompts, greedy(SHORT_TOKENS))
    assert [o.outputs[0].token_ids for o in outs] == [e[:SHORT_TOKENS] for e in hf_greedy]
