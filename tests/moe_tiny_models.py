"""Tiny random-weight MoE models (transformers config classes), and MXFP4 packing for GPT-OSS tests."""

from __future__ import annotations

from typing import Any

import torch

from tests.tiny_models import TINY_COMMON

# the dense tiny models' shape, with head_dim 16; each family sets its own layers and MLP sizes
MOE_COMMON = {k: v for k, v in TINY_COMMON.items() if k not in ("intermediate_size", "num_hidden_layers")}
MOE_COMMON["head_dim"] = 16

MOE_DEFAULTS: dict[str, dict[str, Any]] = {
    # 3 layers: MoE, dense (mlp_only_layers), MoE
    "qwen3_moe": dict(num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                      num_experts_per_tok=2, mlp_only_layers=[1], norm_topk_prob=True),
    # decoder_sparse_step 2: layer 1 is MoE, 0 and 2 dense; a gated shared expert
    "qwen2_moe": dict(num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                      num_experts_per_tok=2, decoder_sparse_step=2, shared_expert_intermediate_size=48,
                      norm_topk_prob=False),
    "mixtral": dict(num_hidden_layers=2, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                    sliding_window=7),
    # layer_types default: sliding, full; YaRN by default
    "gpt_oss": dict(num_hidden_layers=2, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                    sliding_window=4),
}


def tiny_moe_config(model_type: str, **overrides: Any):
    import transformers

    cls = {
        "qwen3_moe": transformers.Qwen3MoeConfig,
        "qwen2_moe": transformers.Qwen2MoeConfig,
        "mixtral": transformers.MixtralConfig,
        "gpt_oss": transformers.GptOssConfig,
    }[model_type]
    kwargs = {**MOE_COMMON, **MOE_DEFAULTS[model_type], **overrides}
    return cls(**kwargs)


# ---------------------------------------------------------------- MXFP4 (test-side packing)

_FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def mxfp4_pack(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., cols] (cols % 32 == 0) -> (blocks [..., cols/32, 16] uint8, scales [..., cols/32] uint8),
    rounding each value to the nearest E2M1 value after dividing by its block's power-of-two scale."""
    *lead, cols = w.shape
    g = w.float().reshape(*lead, cols // 32, 32)
    amax = g.abs().amax(dim=-1).clamp(min=2.0**-120)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)  # largest |value| / 2^exp <= 6
    q = g / torch.exp2(exp)[..., None]
    code = (q.abs()[..., None] - _FP4).abs().argmin(dim=-1)  # nearest magnitude, 0..7
    code = code | ((q < 0).long() << 3)
    code = code.to(torch.uint8)
    blocks = code[..., 0::2] | (code[..., 1::2] << 4)
    return blocks.contiguous(), (exp + 127).to(torch.uint8)


def mxfp4_unpack(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The exact values ``mxfp4_pack`` encodes (fp32), written independently of the loader's."""
    signed = torch.cat((_FP4, -_FP4))
    lo, hi = signed[(blocks & 15).long()], signed[(blocks >> 4).long()]
    vals = torch.stack((lo, hi), dim=-1).flatten(-2)
    vals = vals * torch.exp2(scales.float() - 127)[..., None]
    return vals.flatten(-2)
