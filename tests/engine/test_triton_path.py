"""The whole engine through the Triton kernels (the interpreter on CPU) gives the tokens of
the reference path: greedy and seeded sampling, prefill and decode. Fast tier: the tiny random
Llama (2 layers: the interpreter's cost is per kernel launch, and the bundled model has 30);
slow tier: the bundled model."""

from __future__ import annotations

import pytest

from tokenfab import LLM, SamplingParams
from tokenfab.kernels import attention

PROMPTS = ["The capital of France is", "def add(a, b):"]
TINY_PROMPTS = [[5, 17, 42, 99, 3, 250, 1], list(range(300, 280, -1))]  # 7 and 20 tokens: 2 and 2 blocks
PARAMS = [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
          SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=4, ignore_eos=True)]


def check_triton_matches_reference(llm: LLM, prompts: list, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENFAB_KERNELS", "torch")
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS)]
    monkeypatch.setenv("TOKENFAB_KERNELS", "triton")
    calls = []
    orig = attention._prefill_attention_triton
    monkeypatch.setattr(attention, "_prefill_attention_triton",
                        lambda *a, **k: calls.append("prefill") or orig(*a, **k))
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS)]
    assert calls, "the Triton prefill kernel did not run"
    assert all(len(t) == 4 for t in got)
    assert got == expected


def test_triton_kernels_match_reference_path_tiny(tiny_llama_dir, monkeypatch):
    check_triton_matches_reference(LLM(model=tiny_llama_dir, block_size=16), TINY_PROMPTS, monkeypatch)


@pytest.mark.slow
def test_triton_kernels_match_reference_path(monkeypatch):
    check_triton_matches_reference(LLM(block_size=16), PROMPTS, monkeypatch)
