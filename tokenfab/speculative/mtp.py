"""DeepSeek-V3-style multi-token prediction (MTP) as a draft module.

The checkpoint's layer at index ``num_hidden_layers`` (and the following ones when
``num_nextn_predict_layers`` > 1) predicts the token after next. For position t, given the token
x_{t+1} that follows it and the target's hidden state h_t:

    e = enorm(embed(x_{t+1}))          (zero at position 0, as vLLM does)
    g = eh_proj([e ; hnorm(h_t)])      2H -> H
    n = DecoderLayer(g)                one full decoder layer of the target's kind (MLA + MoE
                                       for DeepSeek-V3), over its own paged latent cache
    logits = shared_head.head(shared_head.norm(n))

``h_t`` is the target's final hidden state (after its final norm: what vLLM and SGLang hand the MTP
layer); for a second draft step the MTP layer's own ``n`` takes its place. The same layout covers
GLM-5, Kimi K2.5 and GigaChat3; the index comes from the config (GigaChat3's MTP sits at 64), never
a constant.

Checkpoint names (under ``model.layers.{n}.``): ``enorm``, ``hnorm``, ``eh_proj``, ``embed_tokens``,
``shared_head.norm``, ``shared_head.head``, and the decoder layer's own names (``input_layernorm``,
``self_attn.*``, ``post_attention_layernorm``, ``mlp.*``). The DeepSeek target model keeps these aside
at load time (``DeepseekV3ForCausalLM.mtp_weights``); ``load_mtp`` builds the layer from them.
``embed_tokens`` / ``shared_head.head`` absent from the checkpoint are shared with the target.

Engine wiring (draft loop, its cache, feeding ``spec.accept``) is not done here.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from tokenfab.forward_batch import ForwardBatch
from tokenfab.layers.dsa import LightningIndexer, SparseLatentAttention
from tokenfab.layers.embedding import LMHead, VocabEmbedding
from tokenfab.layers.linear import Linear
from tokenfab.layers.moe import GatedMLP, load_expert_checkpoint_tensor
from tokenfab.layers.norm import RMSNorm
from tokenfab.layers.rotary import RotaryEmbedding, rope_parameters
from tokenfab.loader.errors import ModelLoadError
from tokenfab.loader.weights import load_weights
from tokenfab.models.deepseek_v3 import make_deepseek_moe, make_mla, mla_softmax_scale
from tokenfab.models.llama import DecoderLayer


class SharedHead(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = LMHead(config.vocab_size, config.hidden_size)


class DeepseekMTPLayer(DecoderLayer):
    """The decoder layer at ``layer_index`` plus MTP's input fusion and shared head."""

    packed_modules = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, config: Any, layer_index: int | None = None, max_position: int | None = None) -> None:
        config = getattr(config, "text_config", None) or config
        max_position = max_position or config.max_position_embeddings
        self.layer_index = config.num_hidden_layers if layer_index is None else layer_index
        if self.layer_index >= (config.first_k_dense_replace or 0):
            mlp: nn.Module = make_deepseek_moe(config)
        else:
            mlp = GatedMLP(config.hidden_size, config.intermediate_size)
        super().__init__(config, _attention(config, max_position), mlp)
        self.config = config
        h = config.hidden_size
        self.embed_tokens = VocabEmbedding(config.vocab_size, h)
        self.enorm = RMSNorm(h, config.rms_norm_eps)
        self.hnorm = RMSNorm(h, config.rms_norm_eps)
        self.eh_proj = Linear(2 * h, h)
        self.shared_head = SharedHead(config)

    def forward(self, input_ids: torch.Tensor, previous_hidden: torch.Tensor,  # type: ignore[override]
                batch: ForwardBatch) -> torch.Tensor:
        """input_ids [T] (the token after each position), previous_hidden [T, H] -> [T, H], the
        layer's output (the next draft step's previous_hidden; ``compute_logits`` turns it into logits)."""
        e = self.embed_tokens.forward(input_ids)
        e = torch.where((batch.positions == 0)[:, None], torch.zeros_like(e), e)
        g = self.eh_proj.forward(torch.cat([self.enorm.forward(e), self.hnorm.forward(previous_hidden)], dim=-1))
        x, residual = super().forward(g, None, batch)
        return x + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.shared_head.head.forward(self.shared_head.norm.forward(hidden))

    # ---- loading (tokenfab.loader.weights.load_weights hooks)
    def remap_checkpoint_name(self, name: str) -> str | None:
        m = re.match(r"(?:model\.)?layers\.(\d+)\.(.*)", name)
        if m is None or int(m[1]) != self.layer_index:
            return None  # another MTP layer's tensors
        return m[2].replace("mlp.gate.e_score_correction_bias", "mlp.e_score_correction_bias")

    def load_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> list[str] | None:
        return load_expert_checkpoint_tensor(self, name, tensor)


def _attention(config: Any, max_position: int) -> nn.Module:
    """MLA, or for DSA targets (DeepSeek-V3.2, GLM-MoE-DSA: ``index_topk`` in the config) MLA with
    its own lightning indexer, as the target's "full" layers have (GLM's indexer rope is interleaved)."""
    if not getattr(config, "index_topk", None):
        return make_mla(config, max_position)
    params, rope_dim = rope_parameters(config), config.qk_rope_head_dim
    interleaved = getattr(config, "model_type", "") == "glm_moe_dsa"
    rotary = RotaryEmbedding(rope_dim, max_position, params, config.max_position_embeddings, is_neox=not interleaved)
    indexer = LightningIndexer(config.hidden_size, config.q_lora_rank, config.index_n_heads, config.index_head_dim,
                               rotary, config.index_topk)
    mla_rotary = RotaryEmbedding(rope_dim, max_position, params, config.max_position_embeddings, is_neox=False)
    return SparseLatentAttention(
        config.hidden_size, config.num_attention_heads, config.q_lora_rank, config.kv_lora_rank,
        config.qk_nope_head_dim, rope_dim, config.v_head_dim, mla_softmax_scale(config), mla_rotary,
        bias=bool(getattr(config, "attention_bias", False)), indexer=indexer, index_head_dim=config.index_head_dim,
    )


def num_mtp_layers(config: Any) -> int:
    config = getattr(config, "text_config", None) or config
    return int(getattr(config, "num_nextn_predict_layers", 0) or 0)


def load_mtp(target: nn.Module, layer_index: int | None = None, dtype: torch.dtype = torch.float32,
             device: torch.device | str = "cpu") -> DeepseekMTPLayer:
    """The MTP layer from a loaded DeepSeek-style target's ``mtp_weights``."""
    weights: dict[str, torch.Tensor] = getattr(target, "mtp_weights", None) or {}
    layer = DeepseekMTPLayer(target.config, layer_index)
    prefix = f"model.layers.{layer.layer_index}."
    mine = {k: v for k, v in weights.items() if k.startswith(prefix)}
    if not mine:
        raise ModelLoadError("mtp_weights", f"the checkpoint has no MTP layer {layer.layer_index} "
                             f"(num_nextn_predict_layers = {num_mtp_layers(target.config)})")
    shared = {"embed_tokens.weight": target.model.embed_tokens.weight,
              "shared_head.head.weight": target.lm_head.weight}
    absent = [k for k in shared if prefix + k not in mine]
    # absent shared tensors: loaded as copies (load_weights wants every parameter), then re-tied
    items = list(mine.items()) + [(prefix + k, shared[k].detach()) for k in absent]
    load_weights(layer, items, f"MTP layer {layer.layer_index}")
    layer = layer.to(device=device, dtype=dtype)
    for k in absent:
        mod = layer.get_submodule(k.rsplit(".", 1)[0])
        mod.weight = shared[k]
    return layer
