"""A tiny random-weight DeepSeek-V4 in the official checkpoint layout (transformers' ``save_pretrained``),
shared by the DeepSeek-V4 tests: every attention type (sliding, CSA, HCA), both routings (hash, top-k),
mHC with three streams, a clamped SwiGLU that clamps, YaRN on the compressed layers' RoPE; a window of 6,
compression ratios 4 and 8 and an indexer top-2, so prompts of a few dozen tokens exceed all of them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.tiny_models import randomize_

DSV4_TINY = dict(
    vocab_size=320, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
    head_dim=32, q_lora_rank=24, partial_rotary_factor=0.25, num_experts_per_tok=2, n_routed_experts=8,
    n_shared_experts=1, routed_scaling_factor=1.5, swiglu_limit=1.0,
    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                 "compressed_sparse_attention"],
    mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    sliding_window=6, o_groups=2, o_lora_rank=16, index_n_heads=8, index_head_dim=16, index_topk=2, hc_mult=3,
    hc_sinkhorn_iters=20, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                     "beta_fast": 32.0, "beta_slow": 1.0},
)


def save_tiny_dsv4(path: Path, seed: int = 0, **overrides: Any):
    """Build transformers' DeepseekV4ForCausalLM with random weights (fp32; every parameter ~N(0, 0.2), a
    random routing correction bias and a random hash table of distinct experts per token), save it, return it."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.DeepseekV4Config(**{**DSV4_TINY, **overrides})
    model = randomize_(transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32))
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("tid2eid"):
                picks = torch.rand(buf.shape[0], config.n_routed_experts).argsort(dim=-1)
                buf.copy_(picks[:, : buf.shape[1]])
    model.save_pretrained(path, safe_serialization=True)
    return model
