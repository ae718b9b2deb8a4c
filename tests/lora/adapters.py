"""Tiny PEFT LoRA adapters for the multi-LoRA serving tests, made by ``peft`` itself, and transformers'
greedy reference with an adapter merged (``PeftModel.from_pretrained(...).merge_and_unload()``)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_peft_adapter(base, path: Path, r: int, targets: list[str], seed: int, alpha: float | None = None,
                      use_rslora: bool = False, scale: float = 0.3) -> Path:
    """A PEFT adapter of ``base`` (a transformers model) with random A and B (B nonzero), saved to ``path``."""
    import peft

    cfg = peft.LoraConfig(r=r, lora_alpha=alpha if alpha is not None else 2 * r, target_modules=targets,
                          lora_dropout=0.0, use_rslora=use_rslora, init_lora_weights=False, task_type="CAUSAL_LM")
    model = peft.get_peft_model(copy.deepcopy(base), cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    model.save_pretrained(str(path))
    return path


def merged_greedy(base, adapter: Path | None, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy tokens with the adapter merged through PEFT (None: the base model)."""
    import peft

    model = copy.deepcopy(base)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    model.eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            gen = model.generate(x, max_new_tokens=max_new_tokens, do_sample=False, min_new_tokens=max_new_tokens,
                                 pad_token_id=0, eos_token_id=None)
            out.append(gen[0, len(ids):].tolist())
    return out


def run_greedy(engine, jobs: list, max_tokens: int) -> list[list[int]]:
    """Greedy tokens of each (prompt ids, LoRARequest or None) job, all added to ``engine`` before its first step
    (so they share batches), in the jobs' order."""
    from tokenfab.engine.requests.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, (ids, lora) in enumerate(jobs):
        engine.add_request(f"r{i}", ids, params, lora_request=lora)
    out: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = list(o.outputs[0].token_ids)
    return [out[f"r{i}"] for i in range(len(jobs))]


def assert_prompt_logprobs_equal_peft_merged(engine, base, prompt: list[int], jobs: dict) -> None:
    """``jobs``: request id -> LoRARequest or None, all on ``prompt`` in one engine run; each request's prompt
    logprobs within 1e-4 of transformers with that adapter merged by PEFT (fp32)."""
    import peft
    import pytest

    from tokenfab.engine.requests.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    for rid, lora in jobs.items():
        engine.add_request(rid, prompt, params, lora_request=lora)
    got = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                got[o.request_id] = o.prompt_logprobs
    for rid, lora in jobs.items():
        model = base if lora is None else peft.PeftModel.from_pretrained(
            copy.deepcopy(base), lora.lora_path).merge_and_unload()
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)
        want = [logp[i - 1, prompt[i]].item() for i in range(1, len(prompt))]
        mine = [got[rid][i][prompt[i]].logprob for i in range(1, len(prompt))]
        assert mine == pytest.approx(want, abs=1e-4), rid
