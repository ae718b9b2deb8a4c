"""Tiny random-weight Hugging Face models saved as safetensors, for comparing against transformers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

TINY_COMMON = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


def tiny_config(model_type: str, **overrides: Any):
    import transformers

    cls = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }[model_type]
    kwargs = dict(TINY_COMMON)
    if model_type == "qwen3":
        kwargs["head_dim"] = 16
    kwargs.update(overrides)
    return cls(**kwargs)


def save_tiny_model(config, path: Path, seed: int = 0) -> Any:
    """Build the transformers model with random weights (fp32), save it, return it (eval)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():  # larger than the default init, so errors are visible
            p.normal_(0, 0.2)
    model.eval()
    model.save_pretrained(path, safe_serialization=True)
    return model


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    """transformers' fp32 logits for every position of one sequence."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def run_capturing_logits(engine, ids: list[int], max_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy-generate ``max_tokens`` for one prompt through the engine, returning the tokens and
    the logits the runner produced at each step (prefill chunk ends, then each decode step)."""
    from tokenfab.engine.sampling_params import SamplingParams

    engine.add_request("r", ids, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    step_logits: list[torch.Tensor] = []
    orig = engine.runner.execute

    def spy(batch):
        out = orig(batch)
        step_logits.append(out.clone())
        return out

    engine.runner.execute = spy
    try:
        outs = []
        while engine.has_unfinished_requests():
            outs += engine.step()
    finally:
        engine.runner.execute = orig
    return outs[-1].outputs[0].token_ids, step_logits
