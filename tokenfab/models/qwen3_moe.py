"""Qwen3-MoE (and Qwen2-MoE, its predecessor with a gated shared expert).

    h = x + Attn(RMSNorm(x));   out = h + MLP(RMSNorm(h))
    Attn: Qwen3's (per-head RMSNorm on q and k before RoPE); Qwen2-MoE: q/k/v biases, no norm
    MLP:  MoE on layer i when i is not in ``mlp_only_layers`` and (i + 1) % decoder_sparse_step == 0,
          else a dense SwiGLU MLP of ``intermediate_size``.
    MoE:  p = softmax(x Wr^T) (fp32); the top-k experts (weights renormalized iff norm_topk_prob);
          sum_j p_j * down_j(silu(gate_j x) * up_j x)
          Qwen2-MoE adds sigmoid(x Wg^T) * shared_expert(x).

Checkpoint names: ``model.layers.{i}.mlp.gate.weight`` (router), ``...mlp.experts.{e}.{gate,up,down}_proj.weight``
(or transformers v5's stacked ``mlp.experts.gate_up_proj``), Qwen2-MoE's ``mlp.shared_expert.*`` and
``mlp.shared_expert_gate.weight``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from tokenfab.layers.linear import qkv_linear
from tokenfab.layers.moe import FusedMoE, GatedMLP
from tokenfab.layers.norm import RMSNorm
from tokenfab.models.llama import DecoderLayer, LlamaAttention, LlamaMLP
from tokenfab.models.mixtral import MoECausalLM


def is_moe_layer(config: Any, layer_idx: int) -> bool:
    """Qwen's dense/MoE mix: ``mlp_only_layers`` stay dense; otherwise every ``decoder_sparse_step``-th layer."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (
        layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
        and config.num_experts > 0
        and (layer_idx + 1) % step == 0
    )


class Qwen3MoeAttention(LlamaAttention):
    """Llama attention with Qwen3's per-head q/k RMSNorm."""

    def __init__(self, config: Any, layer_idx: int, max_position: int) -> None:
        super().__init__(config, layer_idx, max_position)
        self.qk_norm = True
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)


class Qwen2MoeAttention(LlamaAttention):
    """Llama attention with biases on q/k/v (``qkv_bias``) only."""

    def __init__(self, config: Any, layer_idx: int, max_position: int) -> None:
        super().__init__(config, layer_idx, max_position)
        if getattr(config, "qkv_bias", True):
            num_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
            self.qkv_proj = qkv_linear(config.hidden_size, self.head_dim, config.num_attention_heads, num_kv, bias=True)


class Qwen3MoeForCausalLM(MoECausalLM):
    attention_cls: type[LlamaAttention] = Qwen3MoeAttention

    def __init__(self, config: Any, max_position: int | None = None) -> None:
        max_position = max_position or config.max_position_embeddings

        def make_layer(i: int) -> nn.Module:
            mlp = self.make_moe(config) if is_moe_layer(config, i) else LlamaMLP(config)
            return DecoderLayer(config, self.attention_cls(config, i, max_position), mlp)

        super().__init__(config, make_layer)

    @staticmethod
    def make_moe(config: Any) -> FusedMoE:
        return FusedMoE(
            config.hidden_size, config.moe_intermediate_size, config.num_experts, config.num_experts_per_tok,
            renormalize=bool(config.norm_topk_prob),
        )


class Qwen2MoeForCausalLM(Qwen3MoeForCausalLM):
    attention_cls = Qwen2MoeAttention

    @staticmethod
    def make_moe(config: Any) -> FusedMoE:
        shared = None
        if getattr(config, "shared_expert_intermediate_size", 0):
            shared = GatedMLP(config.hidden_size, config.shared_expert_intermediate_size)
        return FusedMoE(
            config.hidden_size, config.moe_intermediate_size, config.num_experts, config.num_experts_per_tok,
            renormalize=bool(config.norm_topk_prob), shared_experts=shared, shared_expert_gate=shared is not None,
        )

    def remap_checkpoint_name(self, name: str) -> str | None:
        return name.replace(".mlp.shared_expert.", ".mlp.shared_experts.")
