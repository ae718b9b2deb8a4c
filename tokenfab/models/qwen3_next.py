"""Qwen3-Next, and the hybrid decoder Qwen3.5 shares with it (``models/qwen3_5.py``).

    h = x + Mixer(RMSNorm(x));   out = h + MLP(RMSNorm(h))
    Mixer, by ``config.layer_types``: "linear_attention" = Gated DeltaNet (``layers/gated_deltanet.py``:
          a per-sequence recurrent state, no KV cache); "full_attention" = gated attention:
          [q | gate] = x Wq (per head, 2 x head_dim rows); q, k = RMSNorm per head, then RoPE on the first
          ``partial_rotary_factor`` of each head's dims; o = softmax(q k^T / sqrt(d)) v over the paged KV
          cache; out = (o * sigmoid(gate)) Wo
    MLP:  Qwen3-Next: MoE on layer i unless i is in ``mlp_only_layers`` or (i + 1) % decoder_sparse_step
          != 0 (then a dense SwiGLU of ``intermediate_size``); MoE = softmax top-k routed experts
          (renormalised iff ``norm_topk_prob``) + sigmoid(x Wg^T) * shared_expert(x)

The RMSNorms of the residual stream, the final norm and q/k norms scale by (1 + w) (zero-centred
weights, transformers' ``Qwen3NextRMSNorm``); we fold the 1 in when loading, so our RMSNorm's weight holds
1 + w. The Gated DeltaNet's own output norm is a plain ``w``.

Checkpoint names: ``model.layers.{i}.linear_attn.{in_proj_qkvz,in_proj_ba,conv1d,dt_bias,A_log,norm,
out_proj}`` (Qwen3-Next's qkvz/ba rows grouped per key head, reordered at load) or
``self_attn.{q,k,v,o}_proj`` + ``q_norm``/``k_norm``; experts per expert (``mlp.experts.{e}.*``) or stacked
(``mlp.experts.gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]); ``mlp.shared_expert.*``,
``mlp.shared_expert_gate``. The multi-token-prediction layer (``mtp.*``) is kept aside at load
(``mtp_weights``, on the CPU, off the forward path) for MTP speculative decoding (``speculative/qwen_mtp.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tokenfab.forward_batch import ForwardBatch
from tokenfab.layers.attention import Attention
from tokenfab.layers.gated_deltanet import GDN_PACKED_MODULES, GatedDeltaNet, qwen3_next_projection_rows
from tokenfab.layers.linear import Linear, MergedLinear, qkv_linear
from tokenfab.layers.moe import FusedMoE, GatedMLP
from tokenfab.layers.norm import RMSNorm
from tokenfab.layers.rotary import RotaryEmbedding, rope_parameters
from tokenfab.models.llama import CausalLM, DecoderLayer, LlamaMLP, head_dim_of
from tokenfab.models.mixtral import MoECausalLM
from tokenfab.models.qwen3_moe import is_moe_layer

# our parameters whose checkpoint weight w means a scale of (1 + w)
_ZERO_CENTRED_SUFFIXES = (".input_layernorm.weight", ".post_attention_layernorm.weight", ".self_attn.q_norm.weight",
                          ".self_attn.k_norm.weight")
_QWEN3_NEXT_PROJECTIONS = (".linear_attn.in_proj_qkvz.weight", ".linear_attn.in_proj_ba.weight")


def is_zero_centred_norm(name: str) -> bool:
    return name == "model.norm.weight" or name.endswith(_ZERO_CENTRED_SUFFIXES)


class GatedAttention(nn.Module):
    """Full attention with an output gate (q_proj doubled: each head's query rows, then its gate rows),
    per-head q/k RMSNorm and partial RoPE, over the paged KV cache."""

    def __init__(self, config: Any, max_position: int) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = head_dim_of(config)
        bias = bool(getattr(config, "attention_bias", False))
        # the q shard holds 2 x num_heads "heads" of head_dim rows: query and gate of head 0, of head 1, ...
        self.qkv_proj = qkv_linear(config.hidden_size, self.head_dim, 2 * self.num_heads, self.num_kv_heads, bias=bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(self.head_dim, max_position, rope_parameters(config),
                                          config.max_position_embeddings)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)
        self.splits = list(self.qkv_proj.shard_sizes)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        qg, k, v = self.qkv_proj.forward(x).split(self.splits, dim=-1)
        qg = qg.view(t, self.num_heads, 2 * d)
        q, gate = qg[..., :d].contiguous(), qg[..., d:]
        k = k.view(t, self.num_kv_heads, d)
        v = v.view(t, self.num_kv_heads, d)
        q, k = self.q_norm.forward(q), self.k_norm.forward(k)
        q, k = self.rotary_emb.forward(batch.positions, q, k)
        o = self.attn.forward(q, k, v, batch).reshape(t, -1)
        return self.o_proj.forward(o * torch.sigmoid(gate.reshape(t, -1)))


class HybridDecoderLayer(DecoderLayer):
    """The pre-norm residual block with either token mixer, under its checkpoint name: ``linear_attn``
    (Gated DeltaNet) or ``self_attn`` (gated attention)."""

    def __init__(self, config: Any, mixer: nn.Module, mlp: nn.Module, linear: bool) -> None:
        super().__init__(config, mixer, mlp)
        self.is_linear = linear
        if linear:
            self.linear_attn = self._modules.pop("self_attn")

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self._attn_input(x, residual)
        mixer = self.linear_attn if self.is_linear else self.self_attn
        h, residual = self.post_attention_layernorm.forward(mixer.forward(h, batch), residual)
        return self.mlp.forward(h), residual


def make_shared_expert_moe(config: Any, renormalize: bool) -> FusedMoE:
    """Routed experts plus a sigmoid-gated shared expert (Qwen3-Next, Qwen3.5-MoE)."""
    shared_size = getattr(config, "shared_expert_intermediate_size", 0) or 0
    shared = GatedMLP(config.hidden_size, shared_size) if shared_size else None
    return FusedMoE(
        config.hidden_size, config.moe_intermediate_size, config.num_experts, config.num_experts_per_tok,
        renormalize=renormalize, shared_experts=shared, shared_expert_gate=shared is not None,
    )


class HybridCausalLM(MoECausalLM):
    """Gated DeltaNet and gated-attention layers (by ``layer_types``) over the MLPs ``make_mlp(i)`` builds;
    the checkpoint hooks of the Qwen3-Next / Qwen3.5 layouts."""

    packed_modules = {**CausalLM.packed_modules, **GDN_PACKED_MODULES}

    def __init__(self, config: Any, max_position: int, make_mlp: Callable[[int], nn.Module]) -> None:
        kinds = set(config.layer_types)
        if not kinds <= {"linear_attention", "full_attention"}:
            raise ValueError(f"unsupported layer types {sorted(kinds)} (linear_attention, full_attention)")

        def make_layer(i: int) -> nn.Module:
            linear = config.layer_types[i] == "linear_attention"
            mixer = GatedDeltaNet(config) if linear else GatedAttention(config, max_position)
            return HybridDecoderLayer(config, mixer, make_mlp(i), linear)

        super().__init__(config, make_layer)
        self.mtp_weights: dict[str, torch.Tensor] = {}  # mtp.* as loaded (speculative/qwen_mtp.py)

    def remap_checkpoint_name(self, name: str) -> str | None:
        if name.startswith("mtp."):  # the multi-token-prediction layer: kept by load_checkpoint_tensor
            return name
        for key in (".linear_attn.in_proj_qkvz.", ".linear_attn.in_proj_ba."):
            if key in name:
                self._check_plain_projection(name, name[: name.index(key) + len(key) - 1])
        return name.replace(".mlp.shared_expert.", ".mlp.shared_experts.")

    def _check_plain_projection(self, name: str, module_path: str) -> None:
        """Qwen3-Next's fused projections are reordered row by row at load (``load_checkpoint_tensor``); a
        quantized layer would take them (and their scales) in the checkpoint's grouped order: refused."""
        try:
            module = self.get_submodule(module_path)
        except AttributeError:  # no such layer: the loader reports the tensor as unused
            return
        if type(module) is not MergedLinear:
            raise ValueError(f"{name}: quantized Qwen3-Next Gated DeltaNet projections (in_proj_qkvz / in_proj_ba, "
                             "rows grouped per key head) are not supported yet; use the unquantized checkpoint")

    def load_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> list[str] | None:
        if name.startswith("mtp."):
            self.mtp_weights[name] = tensor.detach().to("cpu")
            return []
        if is_zero_centred_norm(name):
            param = self._param(name, tensor.shape)
            param.copy_(tensor.float() + 1.0)
            return [name]
        if name.endswith(_QWEN3_NEXT_PROJECTIONS):
            layer = self.get_submodule(name.rsplit(".", 2)[0])
            rows = qwen3_next_projection_rows(name, tensor, layer)
            param = self._param(name, rows.shape)
            param.copy_(rows)
            merged = self.get_submodule(name.rsplit(".", 1)[0])
            assert isinstance(merged, MergedLinear)
            return [f"{name}#{i}" for i in range(len(merged.shard_sizes))]
        return super().load_checkpoint_tensor(name, tensor)

    def _param(self, name: str, shape: torch.Size) -> torch.Tensor:
        param = self.get_parameter(name)
        if param.shape != shape:
            raise ValueError(f"tensor {name} has shape {tuple(shape)}, expected {tuple(param.shape)}")
        return param.data


class Qwen3NextForCausalLM(HybridCausalLM):
    def __init__(self, config: Any, max_position: int | None = None) -> None:
        max_position = max_position or config.max_position_embeddings

        def make_mlp(i: int) -> nn.Module:
            if is_moe_layer(config, i):
                return make_shared_expert_moe(config, renormalize=bool(getattr(config, "norm_topk_prob", True)))
            return LlamaMLP(config)

        super().__init__(config, max_position, make_mlp)
