"""DeepSeek-V3 (and Kimi K2 / K2.5's text model, the same architecture).

    h = x + MLA(RMSNorm(x));   out = h + MLP(RMSNorm(h))
    MLA:  multi-head latent attention (``tokenfab/layers/mla.py``): low-rank q (q_lora_rank, or a
          plain q_proj) and kv (kv_lora_rank) projections, a decoupled RoPE part of q/k (one rope key
          for all heads, interleaved pairs when ``rope_interleave``), a paged cache of latent + rope
          key per token; scale = (nope + rope)^-0.5 * mscale(factor, mscale_all_dim)^2 under YaRN.
    MLP:  dense SwiGLU (intermediate_size) on the first ``first_k_dense_replace`` layers, else MoE:
          s = sigmoid(x Wr^T); choice = s + correction bias; experts in ``n_group`` groups, the
          ``topk_group`` best groups (by the sum of their two best choices) kept, the top-k experts
          among them; weights s (renormalized iff norm_topk_prob) * routed_scaling_factor;
          plus ``n_shared_experts`` always-on shared experts (one SwiGLU of n_shared * moe_intermediate).

Checkpoint names: ``model.layers.{i}.self_attn.{q_a_proj,q_a_layernorm,q_b_proj|q_proj,kv_a_proj_with_mqa,
kv_a_layernorm,kv_b_proj,o_proj}``, ``mlp.gate.weight`` (router), ``mlp.gate.e_score_correction_bias``,
``mlp.experts.{e}.{gate,up,down}_proj.weight`` (or transformers v5's stacked ``mlp.experts.gate_up_proj``),
``mlp.shared_experts.*``. Multi-token-prediction layers (``model.layers.{n}`` for n >= num_hidden_layers)
are not used for generation: they are kept aside in ``mtp_weights`` (CPU) for speculative decoding.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from tokenfab.layers.mla import MultiHeadLatentAttention
from tokenfab.layers.moe import FusedMoE, GatedMLP
from tokenfab.layers.rotary import RotaryEmbedding, rope_parameters
from tokenfab.models.llama import DecoderLayer
from tokenfab.models.mixtral import MoECausalLM


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def mla_softmax_scale(config: Any) -> float:
    """(nope + rope)^-0.5, times mscale(factor, mscale_all_dim)^2 when RoPE is scaled (YaRN)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = rope_parameters(config)
    if params.get("rope_type", "default") not in ("default", None):
        mscale_all_dim = params.get("mscale_all_dim") or 0
        if mscale_all_dim:
            m = yarn_mscale(params["factor"], mscale_all_dim)
            scale *= m * m
    return scale


def make_mla(config: Any, max_position: int) -> MultiHeadLatentAttention:
    rope_dim = config.qk_rope_head_dim
    rotary = RotaryEmbedding(rope_dim, max_position, rope_parameters(config), config.max_position_embeddings,
                             is_neox=not getattr(config, "rope_interleave", True))
    return MultiHeadLatentAttention(
        config.hidden_size, config.num_attention_heads, config.q_lora_rank, config.kv_lora_rank,
        config.qk_nope_head_dim, rope_dim, config.v_head_dim, mla_softmax_scale(config), rotary,
        bias=bool(getattr(config, "attention_bias", False)),
    )


def make_deepseek_moe(config: Any) -> FusedMoE:
    shared = None
    if getattr(config, "n_shared_experts", 0):
        shared = GatedMLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts)
    return FusedMoE(
        config.hidden_size, config.moe_intermediate_size, config.n_routed_experts, config.num_experts_per_tok,
        renormalize=bool(config.norm_topk_prob), scoring="sigmoid", num_expert_groups=config.n_group or 1,
        topk_groups=config.topk_group or 1, routed_scaling_factor=config.routed_scaling_factor,
        correction_bias=True, shared_experts=shared,
    )


class DeepseekV3ForCausalLM(MoECausalLM):
    # q_proj stays a plain Linear (no fused qkv in MLA): only the SwiGLU projections are merged
    packed_modules = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, config: Any, max_position: int | None = None) -> None:
        config = getattr(config, "text_config", None) or config  # Kimi K2.5: the text part
        max_position = max_position or config.max_position_embeddings
        first_dense = config.first_k_dense_replace or 0

        def make_layer(i: int) -> nn.Module:
            if i >= first_dense:
                mlp: nn.Module = make_deepseek_moe(config)
            else:
                mlp = GatedMLP(config.hidden_size, config.intermediate_size)
            return DecoderLayer(config, make_mla(config, max_position), mlp)

        super().__init__(config, make_layer)
        # Multi-token-prediction layers (checkpoint layers past num_hidden_layers), kept as loaded
        # (on the CPU, off the forward path) for speculative decoding; generation does not use them.
        self.mtp_weights: dict[str, torch.Tensor] = {}

    def _is_mtp(self, name: str) -> bool:
        parts = name.split(".")
        return len(parts) > 2 and parts[:2] == ["model", "layers"] and int(parts[2]) >= self.config.num_hidden_layers

    def load_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> list[str] | None:
        if self._is_mtp(name):
            self.mtp_weights[name] = tensor.detach().to("cpu")
            return []
        return super().load_checkpoint_tensor(name, tensor)

    def remap_checkpoint_name(self, name: str) -> str | None:
        # Kimi K2.5 (multimodal wrapper): keep the language model, drop the vision tower / projector
        if name.startswith(("language_model.", "model.language_model.")):
            name = name.split("language_model.", 1)[1]
            if not name.startswith(("model.", "lm_head.")):
                name = "model." + name
        elif name.startswith(("vision_tower.", "mm_projector.", "model.vision_tower.", "model.mm_projector.",
                              "model.multi_modal_projector.", "multi_modal_projector.")):
            return None
        if self._is_mtp(name):
            return name  # kept by load_checkpoint_tensor
        return name.replace(".mlp.gate.e_score_correction_bias", ".mlp.e_score_correction_bias")
