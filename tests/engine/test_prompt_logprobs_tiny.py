"""Prompt logprobs on the tiny random Llama against transformers' float32 log-softmax, under
chunked prefill and preemption (fast companion of test_prompt_logprobs.py)."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_models import finished_outputs
from tokenfab.engine.llm_engine import LLMEngine
from tokenfab.engine.requests.sampling_params import SamplingParams

PROMPTS = [list(range(7, 7 + 23)), [5, 17, 42, 99, 3, 3, 3, 250, 1], list(range(300, 260, -1))]


@pytest.fixture(scope="module")
def hf_logprobs(tiny_llama_dir):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [torch.log_softmax(hf(torch.tensor([p])).logits[0].float(), -1) for p in PROMPTS]


def run(engine: LLMEngine, params: SamplingParams):
    return finished_outputs(engine, PROMPTS, params, "r")


@pytest.mark.parametrize("budget, blocks", [(4096, 200), (5, 200), (8, 14)])
def test_prompt_logprobs_match_transformers(tiny_llama_dir, hf_logprobs, budget, blocks):
    engine = LLMEngine(model=tiny_llama_dir, num_kv_blocks=blocks, block_size=4, max_num_batched_tokens=budget)
    outs = run(engine, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=4))
    if blocks == 14:
        assert engine.scheduler.num_preemptions_total > 0
    for out, ids, ref in zip(outs, PROMPTS, hf_logprobs):
        plp = out.prompt_logprobs
        assert len(plp) == len(ids) and plp[0] is None
        for pos in range(1, len(ids)):
            assert abs(plp[pos][ids[pos]].logprob - float(ref[pos - 1, ids[pos]])) < 1e-4
            top = ref[pos - 1].topk(4)
            got = sorted((e.logprob for e in plp[pos].values() if e.rank <= 4), reverse=True)
            assert torch.allclose(torch.tensor(got[:4]), top.values, atol=1e-4)
    assert engine.block_manager.num_used_blocks == 0
