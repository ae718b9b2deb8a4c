"""Mixtral, and the CausalLM variant the MoE models share (expert checkpoint loading).

    h = x + Attn(RMSNorm(x));   out = h + MoE(RMSNorm(h))
    Attn: Mistral's (GQA, RoPE, optional sliding window)
    MoE:  p = softmax(x Wr^T); the top-k experts, weights renormalized to sum 1;
          sum_j p_j * w2_j(silu(w1_j x) * w3_j x)

Checkpoint names: ``model.layers.{i}.block_sparse_moe.gate.weight`` (router) and
``...block_sparse_moe.experts.{e}.{w1,w2,w3}.weight``, loaded into the stacked FusedMoE weights
(w1 = gate, w3 = up, w2 = down); transformers v5's stacked ``experts.gate_up_proj`` too.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenfab.layers.moe import FusedMoE, load_expert_checkpoint_tensor
from tokenfab.models.llama import CausalLM, DecoderLayer, LlamaAttention


class MoECausalLM(CausalLM):
    """A CausalLM whose checkpoint also holds expert tensors (per expert, stacked or MXFP4)."""

    def load_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> list[str] | None:
        return load_expert_checkpoint_tensor(self, name, tensor)


class MixtralForCausalLM(MoECausalLM):
    def __init__(self, config: Any, max_position: int | None = None) -> None:
        max_position = max_position or config.max_position_embeddings

        def make_layer(i: int) -> nn.Module:
            moe = FusedMoE(
                config.hidden_size, config.intermediate_size, config.num_local_experts,
                config.num_experts_per_tok, renormalize=True,
            )
            return DecoderLayer(config, LlamaAttention(config, i, max_position), moe)

        super().__init__(config, make_layer)

    def remap_checkpoint_name(self, name: str) -> str | None:
        return name.replace(".block_sparse_moe.", ".mlp.")
