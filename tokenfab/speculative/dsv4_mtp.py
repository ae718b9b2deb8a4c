"""DeepSeek-V4's multi-token-prediction (MTP) layer as a draft module.

transformers 5.24 does not instantiate it (``DeepseekV4Config.num_nextn_predict_layers``: "not instantiated
here"; its loader ignores ``mtp.*``), so this follows DeepSeek's own inference code (``MTPBlock`` in the V4
release's ``inference/model.py``; vLLM's ``deepseek_v4_mtp.py`` reads the same). For position t, given the
token x_{t+1} after it and the target's residual streams h_t [n, D] after its last layer (before the
hyper-connection head collapses them):

    e  = enorm(embed(x_{t+1}))                   the target's embedding (shared)
    g  = e_proj(e) + h_proj(hnorm(h_t))          [n, D]: e_proj(e) added to every stream, hnorm per stream
    g' = Block_{L}(g)                            one V4 block (mHC around attention and MoE) at layer index
                                                 L = num_hidden_layers, over its own caches
    logits = head(norm(HyperHead_mtp(g')))       its own hc_head_{fn,base,scale} and norm; the target's head

The next draft step reads g' as its h (the streams, flattened to [n D]), as vLLM does for k > 1. V3's MTP
zeroes the embedding at position 0 (vLLM's habit); DeepSeek's V4 code does not, and neither do we.

The block's attention kind is the one DeepSeek's code gives layer L (``compress_ratios[L]``); transformers'
config keeps only ``num_hidden_layers`` layer types, so it is read from the weights: ``attn.indexer.*`` ->
CSA, ``attn.compressor.*`` -> HCA, neither -> sliding window (V4-Flash's MTP has neither). Its MoE routes by
top-k (layer L is past the hash layers), or by ``ffn.gate.tid2eid`` when the checkpoint has one.

Checkpoint names (official layout, ``mtp.{j}.`` with an optional ``model.`` prefix): ``e_proj``, ``h_proj``,
``enorm``, ``hnorm``, ``norm``, ``hc_head_{fn,base,scale}``, and the block's own names as a target layer has
them (``attn.*``, ``attn_norm``, ``ffn.*``, ``ffn_norm``, ``hc_{attn,ffn}_{fn,base,scale}``). Its attention
keeps a ring per sequence in the target's state slots (``batch.state_slots``) and, when compressed, entries
in the paged cache under the target's block tables. A quantized release's MTP tensors (block FP8, FP4 experts)
load in the target's format, kept packed, in the modules the checkpoint stores quantized.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from tokenfab.forward_batch import ForwardBatch
from tokenfab.layers.dsv4_attention import CSA, HCA, SLIDING
from tokenfab.layers.hyper_connections import HyperHead
from tokenfab.layers.linear import Linear
from tokenfab.layers.norm import RMSNorm
from tokenfab.loader.errors import ModelLoadError
from tokenfab.loader.formats import is_plain_float
from tokenfab.loader.quant_apply import apply_quant_method, materialize, weights_on_meta
from tokenfab.loader.weights import load_weights
from tokenfab.models.deepseek_v4 import (
    DeepseekV4Block,
    load_v4_tensor,
    sequence_of_token,
    v4_parameter_name,
)
from tokenfab.quant.base import QuantMethod

_MTP_NAME = re.compile(r"^(?:model\.)?mtp\.(\d+)\.(.+)$")
_EXPERT_PROJ = re.compile(r"\.experts\.\d+\.\w+$")


class _LayerConfig:
    """The target's config seen by the block at index L: the layer types extended to L."""

    def __init__(self, base: Any, index: int, layer_type: str, mlp_type: str) -> None:
        self._base = base
        self.layer_types = list(base.layer_types[:index]) + [layer_type]
        self.mlp_layer_types = list(base.mlp_layer_types[:index]) + [mlp_type]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._base, name)


class DeepseekV4MTPLayer(nn.Module):
    def __init__(
        self, config: Any, layer_type: str, mlp_type: str, embed: nn.Module, head: nn.Module, mtp_index: int = 0
    ) -> None:
        super().__init__()
        self.config = config
        self.index = config.num_hidden_layers + mtp_index
        self.mtp_index = mtp_index
        d, eps = config.hidden_size, config.rms_norm_eps
        self.hc_mult, self.hidden_size = config.hc_mult, d
        self.block = DeepseekV4Block(_LayerConfig(config, self.index, layer_type, mlp_type), self.index)
        self.e_proj = Linear(d, d)
        self.h_proj = Linear(d, d)
        self.enorm = RMSNorm(d, eps)
        self.hnorm = RMSNorm(d, eps)
        self.norm = RMSNorm(d, eps)
        self.hc_head = HyperHead(d, config.hc_mult, config.hc_eps, eps)
        self._shared = (embed, head)  # the target's embedding and head: not submodules (loaded with the target)

    def forward(self, input_ids: torch.Tensor, previous: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """input_ids [T] (the token after each position), previous [T, n D] (the target's streams, or this
        layer's own output for a later draft step) -> this layer's output streams [T, n D]."""
        t, n, d = input_ids.shape[0], self.hc_mult, self.hidden_size
        embed, _ = self._shared
        e = self.e_proj(self.enorm(embed(input_ids)))
        h = self.h_proj(self.hnorm(previous.reshape(t * n, d))).view(t, n, d)
        g = h + e.unsqueeze(1)
        return self.block(g, batch, sequence_of_token(batch)).reshape(t, n * d)

    def compute_logits(self, streams: torch.Tensor) -> torch.Tensor:
        _, head = self._shared
        return head(self.norm(self.hc_head(streams.view(-1, self.hc_mult, self.hidden_size))))

    @staticmethod
    def target_forward(model: nn.Module, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's forward for the proposer: (its final hidden states [T, D], the streams [T, n D])."""
        streams = model.forward_streams(batch)
        return model.final_hidden(streams), streams.flatten(1)

    # ---- loading (tokenfab.loader.weights.load_weights hooks)
    def remap_checkpoint_name(self, name: str) -> str | None:
        m = _MTP_NAME.match(name)
        if m is None or int(m[1]) != self.mtp_index:
            return None  # another MTP layer's tensors
        rest = m[2]
        if rest.startswith("hc_head_"):
            return "hc_head." + rest.removeprefix("hc_head_")
        if rest.split(".")[0] in ("e_proj", "h_proj", "enorm", "hnorm", "norm"):
            return rest
        return v4_parameter_name("block." + rest)

    def load_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> list[str] | None:
        return load_v4_tensor(self, self.config, name, tensor)

    integer_checkpoint_tensors = ("tid2eid",)


def mtp_layer_kinds(weights: dict[str, torch.Tensor], mtp_index: int = 0) -> tuple[str, str]:
    """(attention layer type, MoE type) of MTP layer ``mtp_index`` from the names of its tensors."""
    names = [m[2] for m in map(_MTP_NAME.match, weights) if m is not None and int(m[1]) == mtp_index]
    if any(n.startswith("attn.indexer.") for n in names):
        kind = CSA
    elif any(n.startswith("attn.compressor.") for n in names):
        kind = HCA
    else:
        kind = SLIDING
    return kind, ("hash_moe" if "ffn.gate.tid2eid" in names else "moe")


def load_dsv4_mtp(
    target: nn.Module,
    source: str,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    mtp_index: int = 0,
) -> DeepseekV4MTPLayer:
    """MTP layer ``mtp_index`` from a loaded DeepSeek-V4 target's ``mtp_weights``; ``source`` (the checkpoint
    folder) names where a missing or bad tensor should have been."""
    weights: dict[str, torch.Tensor] = getattr(target, "mtp_weights", None) or {}
    mine = {k: v for k, v in weights.items() if (m := _MTP_NAME.match(k)) is not None and int(m[1]) == mtp_index}
    config = target.config
    if not mine:
        raise ModelLoadError(
            source,
            f"the checkpoint has no DeepSeek-V4 MTP layer {mtp_index} (no mtp.{mtp_index}.* "
            f"tensors; num_nextn_predict_layers = {getattr(config, 'num_nextn_predict_layers', 0)})",
        )
    layer_type, mlp_type = mtp_layer_kinds(mine, mtp_index)
    method = getattr(target, "quant_method", None)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # as the target was built: the float32 parameters (mHC, sinks) stay float32
    try:
        with torch.device(device):
            if method is None:
                layer = DeepseekV4MTPLayer(config, layer_type, mlp_type, target.embed, target.head, mtp_index)
            else:  # a quantized release: the layers its tensors store quantized, in the target's format
                with weights_on_meta():
                    layer = DeepseekV4MTPLayer(config, layer_type, mlp_type, target.embed, target.head, mtp_index)
                layer.quant_method = StoredQuantization(method, stored_quantized_modules(layer, mine))
                apply_quant_method(layer, layer.quant_method)
                materialize(layer, torch.device(device))
    finally:
        torch.set_default_dtype(old)
    load_weights(layer, mine.items(), source)
    return layer


class StoredQuantization(QuantMethod):
    """The target's format limited to ``modules`` (those whose weights the checkpoint stores quantized): which of
    the MTP layer's projections a release quantizes (``e_proj``/``h_proj`` among them) is read from its tensors."""

    def __init__(self, method: QuantMethod, modules: set[str]) -> None:
        super().__init__()
        self.method, self.modules, self.name = method, modules, method.name

    def is_quantized(self, module_name: str) -> bool:
        return module_name in self.modules and self.method.is_quantized(module_name)

    def make_linear(self, linear: nn.Module, module_name: str) -> nn.Module:
        return self.method.make_linear(linear, module_name)

    def make_experts(self, moe: nn.Module, module_name: str) -> nn.Module | None:
        return self.method.make_experts(moe, module_name)

    def checkpoint_name(self, name: str) -> str:
        return self.method.checkpoint_name(name)

    def describe(self) -> str:
        return self.method.describe()


def stored_quantized_modules(layer: DeepseekV4MTPLayer, weights: dict[str, torch.Tensor]) -> set[str]:
    """The layer's modules (its names; a MoE's experts as ``{moe}.experts``) whose ``weight`` is not a float."""
    found = set()
    for name, tensor in weights.items():
        ours = layer.remap_checkpoint_name(name) if name.endswith(".weight") else None
        if ours is not None and not is_plain_float(tensor):
            found.add(_EXPERT_PROJ.sub(".experts", ours.removesuffix(".weight")))
    return found
