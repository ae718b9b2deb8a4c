"""Helpers for the trainer tests: a tiny random Llama/Qwen3 from transformers' config classes and
deterministic toy examples (no tokenizer needed)."""

from __future__ import annotations

import torch


def tiny_model(model_type: str = "llama", seed: int = 0, vocab: int = 96, tie: bool = True):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config, Qwen3MoeConfig

    cls = {"llama": LlamaConfig, "qwen3": Qwen3Config, "qwen3_moe": Qwen3MoeConfig}[model_type]
    moe = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16} if model_type == "qwen3_moe" else {}
    config = cls(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
                 tie_word_embeddings=tie, rms_norm_eps=1e-6, attn_implementation="sdpa", **moe)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def toy_examples(n: int, seed: int = 0, vocab: int = 96, min_len: int = 4, max_len: int = 14) -> list:
    """``n`` (input_ids, labels) pairs: a prompt without loss, then a completion with loss."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        ids = torch.randint(0, vocab, (length,), generator=g).tolist()
        prompt = length // 3
        out.append((ids, [-100] * prompt + ids[prompt:]))
    return out
