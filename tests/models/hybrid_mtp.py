"""Tiny Qwen3-Next / Qwen3.5 checkpoints with their multi-token-prediction layer (``mtp.*``) in the official
layout, and the plain re-statement of what that layer computes (transformers has no MTP layer for these
models: it ignores ``^mtp.*``; vLLM's ``qwen3_next_mtp.py`` / ``qwen3_5_mtp.py`` define it).

Layout written (``save_tiny_hybrid_mtp``): the family's own checkpoint (``tests/models/hybrid_models.py``)
plus ``mtp.safetensors`` holding ``mtp.fc.weight`` [H, 2H], ``mtp.pre_fc_norm_embedding.weight``,
``mtp.pre_fc_norm_hidden.weight``, ``mtp.norm.weight`` (zero-centred: scale 1 + w) and ``mtp.layers.0.*``, the
weights of transformers' full-attention decoder layer of the family: Qwen3-Next with one tensor per expert
(its release), Qwen3.5-MoE with stacked experts (``mlp.experts.gate_up_proj`` [E, 2I, H], its release),
Qwen3.5 dense with a SwiGLU MLP.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.models.hybrid_models import save_tiny_hybrid
from tests.tiny_models import randomize_

_LAYER_CLASSES = {
    "qwen3_next": ("qwen3_next", "Qwen3NextDecoderLayer", "Qwen3NextRotaryEmbedding"),
    "qwen3_5_text": ("qwen3_5", "Qwen3_5DecoderLayer", "Qwen3_5TextRotaryEmbedding"),
    "qwen3_5": ("qwen3_5", "Qwen3_5DecoderLayer", "Qwen3_5TextRotaryEmbedding"),
    "qwen3_5_moe": ("qwen3_5_moe", "Qwen3_5MoeDecoderLayer", "Qwen3_5MoeTextRotaryEmbedding"),
    "qwen3_5_moe_text": ("qwen3_5_moe", "Qwen3_5MoeDecoderLayer", "Qwen3_5MoeTextRotaryEmbedding"),
}
FULL_LAYER = 3  # the tiny configs' full-attention layer index (linear, linear, linear, full)


def _module(family: str):
    import importlib

    pkg, _, _ = _LAYER_CLASSES[family]
    return importlib.import_module(f"transformers.models.{pkg}.modeling_{pkg}")


class MTPReference:
    """transformers' decoder layer + the MTP extras, computing the layer's formula directly."""

    def __init__(self, family: str, hf_target: Any, layer: torch.nn.Module, extras: dict[str, torch.Tensor]) -> None:
        self.family, self.hf, self.layer, self.extras = family, hf_target, layer, extras
        self.config = getattr(hf_target.config, "text_config", None) or hf_target.config

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps) * (1.0 + w)

    def hidden(self, ids: list[int], prev: torch.Tensor) -> torch.Tensor:
        """The MTP layer's output for every position of one sequence: ``ids`` the following tokens, ``prev``
        the target's final hidden states [T, H] (or the layer's own output, for later draft steps)."""
        x = self.extras
        embed = self.hf.get_input_embeddings().weight
        e = self._rms(embed[torch.tensor(ids)], x["pre_fc_norm_embedding.weight"])
        g = torch.cat([e, self._rms(prev, x["pre_fc_norm_hidden.weight"])], -1) @ x["fc.weight"].T
        t = len(ids)
        pos = torch.arange(t)[None]
        rotary = getattr(_module(self.family), _LAYER_CLASSES[self.family][2])(self.config)
        cos_sin = rotary(g[None], pos)
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        self.layer.self_attn.config._attn_implementation = "eager"
        n = self.layer(g[None], position_embeddings=cos_sin, attention_mask=mask, position_ids=pos)
        n = n[0] if isinstance(n, tuple) else n
        return self._rms(n[0], x["norm.weight"])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.hf.get_output_embeddings().weight.T


def write_qwen_mtp(path: Path, family: str, hf_target: Any, seed: int = 1, scale: float = 0.2) -> MTPReference:
    """Add ``mtp.safetensors`` (module docstring) to the checkpoint in ``path``; returns its reference."""
    from safetensors.torch import save_file

    config = getattr(hf_target.config, "text_config", None) or hf_target.config
    torch.manual_seed(seed)
    layer_cls = getattr(_module(family), _LAYER_CLASSES[family][1])
    layer = randomize_(layer_cls(config, FULL_LAYER)).eval()
    h = config.hidden_size
    extras = {
        "fc.weight": scale * torch.randn(h, 2 * h),
        "pre_fc_norm_embedding.weight": scale * torch.randn(h),
        "pre_fc_norm_hidden.weight": scale * torch.randn(h),
        "norm.weight": scale * torch.randn(h),
    }
    tensors = dict(extras)
    per_expert = family == "qwen3_next"
    for k, t in layer.state_dict().items():
        if per_expert and k == "mlp.experts.gate_up_proj":
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                tensors[f"layers.0.mlp.experts.{e}.gate_proj.weight"] = t[e, :inter]
                tensors[f"layers.0.mlp.experts.{e}.up_proj.weight"] = t[e, inter:]
        elif per_expert and k == "mlp.experts.down_proj":
            for e in range(t.shape[0]):
                tensors[f"layers.0.mlp.experts.{e}.down_proj.weight"] = t[e]
        else:
            tensors[f"layers.0.{k}"] = t
    save_file(
        {f"mtp.{k}": t.contiguous() for k, t in tensors.items()},
        str(Path(path) / "mtp.safetensors"),
        metadata={"format": "pt"},
    )
    return MTPReference(family, hf_target, layer, extras)


def save_tiny_hybrid_mtp(family: str, path: Path, seed: int = 0, **overrides: Any) -> tuple[Any, MTPReference]:
    """The family's tiny checkpoint with a full MTP layer: (transformers target, MTP reference)."""
    hf = save_tiny_hybrid(family, path, seed, mtp_placeholder=False, **overrides)
    return hf, write_qwen_mtp(path, family, hf)
