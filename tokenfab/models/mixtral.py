"""Mixtral, and the decoder skeleton the MoE models share.

    h = x + Attn(RMSNorm(x));   out = h + MoE(RMSNorm(h))
    Attn: Mistral's (GQA, RoPE, optional sliding window)
    MoE:  p = softmax(x Wr^T); the top-k experts, weights renormalized to sum 1;
          sum_j p_j * w2_j(silu(w1_j x) * w3_j x)

Checkpoint names: ``model.layers.{i}.block_sparse_moe.gate.weight`` (router) and
``...block_sparse_moe.experts.{e}.{w1,w2,w3}.weight``, loaded into the stacked FusedMoE weights
(w1 = gate, w3 = up, w2 = down); transformers v5's stacked ``experts.gate_up_proj`` too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tokenfab.forward_batch import ForwardBatch
from tokenfab.layers.embedding import LMHead, VocabEmbedding
from tokenfab.layers.moe import FusedMoE, load_expert_checkpoint_tensor
from tokenfab.layers.norm import RMSNorm
from tokenfab.models.llama import LlamaAttention


class MoEDecoderLayer(nn.Module):
    """Pre-norm residual block: h = x + attn(norm(x)); out = h + mlp(norm(h)) (mlp: MoE or dense)."""

    def __init__(self, config: Any, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = x.clone()
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, batch)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class MoEModel(nn.Module):
    def __init__(self, config: Any, make_layer: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(make_layer(i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x, residual = self.embed_tokens(batch.input_ids), None
        for layer in self.layers:
            x, residual = layer(x, residual, batch)
        x, _ = self.norm(x, residual)
        return x


class MoECausalLM(nn.Module):
    """Embeddings, decoder layers from ``make_layer(i)``, final norm, LM head; loads expert tensors."""

    packed_modules = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: Any, make_layer: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.config = config
        self.model = MoEModel(config, make_layer)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states [T, H] of every token of the batch."""
        return self.model(batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

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
            return MoEDecoderLayer(config, LlamaAttention(config, i, max_position), moe)

        super().__init__(config, make_layer)

    def remap_checkpoint_name(self, name: str) -> str | None:
        return name.replace(".block_sparse_moe.", ".mlp.")
