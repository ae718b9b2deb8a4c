"""DeepSeek-V3.2 and GLM-MoE-DSA (GLM-5): DeepSeek-V3 with DeepSeek Sparse Attention.

    h = x + DSA(RMSNorm(x));   out = h + MLP(RMSNorm(h))
    DSA:  MLA (``tokenfab/layers/mla.py``, interleaved RoPE, low-rank q) whose queries attend only to
          the ``index_topk`` keys a lightning indexer selects (``tokenfab/layers/dsa.py``); the
          indexer's rope is NeoX-style in DeepSeek-V3.2 and interleaved in GLM-MoE-DSA, whose
          "shared" layers (``indexer_types``) reuse the previous full layer's selection.
    MLP:  dense on ``mlp_layer_types[i] == "dense"`` layers, else DeepSeek-V3's grouped sigmoid MoE
          with shared experts.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from tokenfab.layers.dsa import LightningIndexer, SparseLatentAttention
from tokenfab.layers.moe import GatedMLP
from tokenfab.layers.rotary import RotaryEmbedding, rope_parameters
from tokenfab.models.deepseek_v3 import DeepseekV3ForCausalLM, make_deepseek_moe, mla_softmax_scale
from tokenfab.models.llama import DecoderLayer
from tokenfab.models.mixtral import MoECausalLM


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    indexer_interleaved = False  # DeepSeek-V3.2's indexer rotates half-split (NeoX) pairs

    def __init__(self, config: Any, max_position: int | None = None) -> None:
        max_position = max_position or config.max_position_embeddings
        mlp_types = getattr(config, "mlp_layer_types", None) or [
            "dense" if i < (config.first_k_dense_replace or 0) else "sparse" for i in range(config.num_hidden_layers)
        ]
        indexer_types = getattr(config, "indexer_types", None) or ["full"] * config.num_hidden_layers
        params = rope_parameters(config)
        rope_dim = config.qk_rope_head_dim
        last_full: list[SparseLatentAttention] = []

        def make_layer(i: int) -> nn.Module:
            indexer = None
            if indexer_types[i] == "full":
                rotary = RotaryEmbedding(rope_dim, max_position, params, config.max_position_embeddings,
                                         is_neox=not self.indexer_interleaved)
                indexer = LightningIndexer(config.hidden_size, config.q_lora_rank, config.index_n_heads,
                                           config.index_head_dim, rotary, config.index_topk)
            mla_rotary = RotaryEmbedding(rope_dim, max_position, params, config.max_position_embeddings,
                                         is_neox=False)
            attn = SparseLatentAttention(
                config.hidden_size, config.num_attention_heads, config.q_lora_rank, config.kv_lora_rank,
                config.qk_nope_head_dim, rope_dim, config.v_head_dim, mla_softmax_scale(config), mla_rotary,
                bias=bool(getattr(config, "attention_bias", False)), indexer=indexer,
                index_head_dim=config.index_head_dim, topk_source=last_full[-1] if last_full else None,
            )
            if indexer is not None:
                last_full.append(attn)
            if mlp_types[i] == "sparse":
                mlp: nn.Module = make_deepseek_moe(config)
            else:
                mlp = GatedMLP(config.hidden_size, config.intermediate_size)
            return DecoderLayer(config, attn, mlp)

        MoECausalLM.__init__(self, config, make_layer)
        self.mtp_weights: dict = {}  # MTP layers kept aside at load (DeepseekV3ForCausalLM; speculative/mtp.py)


class GlmMoeDsaForCausalLM(DeepseekV32ForCausalLM):
    indexer_interleaved = True
