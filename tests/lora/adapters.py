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
