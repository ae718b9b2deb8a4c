"""The whole engine through the Triton kernels (the interpreter on CPU) gives the tokens of
the reference path, on the bundled model: greedy and seeded sampling, prefill and decode."""

from __future__ import annotations

import pytest

from tokenfab import LLM, SamplingParams

PROMPTS = ["The capital of France is", "def add(a, b):"]
PARAMS = [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
          SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=4, ignore_eos=True)]


@pytest.fixture(scope="module")
def llm():
    return LLM(block_size=16)


def test_triton_kernels_match_reference_path(llm, monkeypatch):
    monkeypatch.setenv("TOKENFAB_KERNELS", "torch")
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
    monkeypatch.setenv("TOKENFAB_KERNELS", "triton")
    calls = []
    from tokenfab.kernels import attention

    orig = attention._prefill_attention_triton
    monkeypatch.setattr(attention, "_prefill_attention_triton",
                        lambda *a, **k: calls.append("prefill") or orig(*a, **k))
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
    assert calls, "the Triton prefill kernel did not run"
    assert got == expected
