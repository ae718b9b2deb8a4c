"""The multi-token-prediction (MTP) layer of Qwen3-Next and Qwen3.5 (dense and MoE), as a draft module.

For position t, given the token x_{t+1} that follows it and the target's final hidden state h_t (after the
target's final norm):

    e = pre_fc_norm_embedding(embed(x_{t+1}))      the target's embedding (shared, no own copy)
    h = pre_fc_norm_hidden(h_t)
    g = fc([e ; h])                                2H -> H, no bias (embedding half first)
    n = DecoderLayer(g)                            one gated full-attention decoder layer of the target's kind
                                                   (Qwen3-Next / Qwen3.5-MoE: routed experts + gated shared
                                                   expert; Qwen3.5 dense: SwiGLU), over its own paged KV cache
    out = norm(n)                                  the next draft step's h (MTP reused recursively)
    logits = lm_head(out)                          the target's head (shared)

There is no position-0 masking of e (unlike DeepSeek's MTP). Every RMSNorm here is zero-centred (scale 1 + w,
the 1 folded in at load, as for the target: ``models/qwen3_next.py``). This is vLLM's ``Qwen3NextMTP`` /
``Qwen3_5MTP`` (``vllm/model_executor/models/qwen3_next_mtp.py``, ``qwen3_5_mtp.py``), the reference we
follow: transformers does not implement the MTP layer (its Qwen3-Next / Qwen3.5 models list ``^mtp.*`` under
``_keys_to_ignore_on_load_unexpected``), so our tests check it against a plain re-statement of the formula
above built from transformers' decoder layer.

Checkpoint names (top level in every layout, also beside ``model.language_model.*`` in the Qwen3.5 wrappers):
``mtp.fc.weight``, ``mtp.pre_fc_norm_embedding.weight``, ``mtp.pre_fc_norm_hidden.weight``, ``mtp.norm.weight``,
``mtp.layers.0.{input_layernorm,post_attention_layernorm}.weight``, ``mtp.layers.0.self_attn.{q,k,v,o}_proj``
(q doubled: query and gate rows per head), ``q_norm``, ``k_norm``, and the MLP: ``mlp.{gate,up,down}_proj`` or
``mlp.gate``, ``mlp.experts.{e}.*`` (or stacked ``mlp.experts.gate_up_proj`` / ``down_proj``),
``mlp.shared_expert.*``, ``mlp.shared_expert_gate``. The count is ``num_nextn_predict_layers`` (Qwen3-Next)
or ``mtp_num_hidden_layers`` (Qwen3.5), 1 in every release; more than one layer is refused.
The target keeps these tensors aside at load (``HybridCausalLM.mtp_weights``).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from tokenfab.forward_batch import ForwardBatch
from tokenfab.layers.linear import Linear
from tokenfab.layers.moe import load_expert_checkpoint_tensor
from tokenfab.layers.norm import RMSNorm
from tokenfab.loader.errors import ModelLoadError
from tokenfab.loader.weights import load_weights
from tokenfab.models.llama import LlamaMLP
from tokenfab.models.qwen3_moe import is_moe_layer
from tokenfab.models.qwen3_next import GatedAttention, HybridCausalLM, HybridDecoderLayer, make_shared_expert_moe

_LAYER = re.compile(r"mtp\.layers\.(\d+)\.")


def _mlp(config: Any) -> nn.Module:
    """The MTP layer's MLP, as the target's layer 0 would have it (vLLM builds it with layer index 0)."""
    if getattr(config, "model_type", "") == "qwen3_next":
        if is_moe_layer(config, 0):
            return make_shared_expert_moe(config, renormalize=bool(getattr(config, "norm_topk_prob", True)))
        return LlamaMLP(config)
    if getattr(config, "num_experts", 0):  # Qwen3.5-MoE: experts on every layer, always renormalised
        return make_shared_expert_moe(config, renormalize=True)
    return LlamaMLP(config)


class QwenMTPLayer(nn.Module):
    """``mtp.*`` of Qwen3-Next / Qwen3.5 (module docstring); the embedding and head are the target's."""

    packed_modules = HybridCausalLM.packed_modules

    def __init__(self, config: Any, max_position: int, target: nn.Module) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.config = config
        self.fc = Linear(2 * h, h)
        self.pre_fc_norm_embedding = RMSNorm(h, eps)
        self.pre_fc_norm_hidden = RMSNorm(h, eps)
        self.layers = nn.ModuleList(
            [HybridDecoderLayer(config, GatedAttention(config, max_position), _mlp(config), linear=False)]
        )
        self.norm = RMSNorm(h, eps)
        # the target's modules, held outside the module tree (not parameters of this one: shared, not copied)
        self.__dict__["target"] = target

    def forward(self, input_ids: torch.Tensor, previous_hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """input_ids [T] (the token after each position), previous_hidden [T, H] -> the normed output [T, H]
        (the next draft step's previous_hidden; ``compute_logits`` turns it into logits)."""
        target = self.__dict__["target"]
        e = self.pre_fc_norm_embedding.forward(target.model.embed_tokens.forward(input_ids))
        g = self.fc.forward(torch.cat([e, self.pre_fc_norm_hidden.forward(previous_hidden)], dim=-1))
        x, residual = self.layers[0].forward(g, None, batch)
        return self.norm.forward(x + residual)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.__dict__["target"].lm_head.forward(hidden)

    # ---- loading (tokenfab.loader.weights.load_weights hooks)
    def remap_checkpoint_name(self, name: str) -> str | None:
        if not name.startswith("mtp."):
            return None
        return name[len("mtp.") :].replace(".mlp.shared_expert.", ".mlp.shared_experts.")

    def load_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> list[str] | None:
        if "norm" in name.rsplit(".", 2)[-2]:  # every norm here is zero-centred (1 + w): pre_fc_norm_*, q_norm...
            param = self.get_parameter(name)
            if param.shape != tensor.shape:
                raise ValueError(f"tensor mtp.{name} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
            param.data.copy_(tensor.float() + 1.0)
            return [name]
        return load_expert_checkpoint_tensor(self, name, tensor)


def qwen_mtp_layers(config: Any, weights: dict[str, torch.Tensor]) -> int:
    """How many MTP layers the checkpoint has: the config's count, else the layers its tensors name."""
    n = getattr(config, "mtp_num_hidden_layers", None) or getattr(config, "num_nextn_predict_layers", None)
    if n is None:
        n = len({m[1] for k in weights if (m := _LAYER.match(k))})
    return int(n)


def load_qwen_mtp(
    target: nn.Module,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    max_position: int | None = None,
) -> QwenMTPLayer:
    """The MTP layer from a loaded Qwen3-Next / Qwen3.5 target's ``mtp_weights``."""
    weights: dict[str, torch.Tensor] = getattr(target, "mtp_weights", None) or {}
    config = target.config
    if not weights:
        raise ModelLoadError("mtp.*", "the checkpoint has no MTP layer (no mtp.* tensors)")
    n = qwen_mtp_layers(config, weights)
    if n != 1:
        raise ModelLoadError("mtp.layers", f"{n} MTP layers: only checkpoints with one MTP layer are supported")
    layer = QwenMTPLayer(config, max_position or config.max_position_embeddings, target)
    load_weights(layer, list(weights.items()), "the MTP layer (mtp.*)")
    return layer.to(device=device, dtype=dtype)
