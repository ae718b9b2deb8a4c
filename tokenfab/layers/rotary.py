"""Rotary embeddings: the cos/sin cache for plain, linear, Llama-3 and YaRN scaled RoPE."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from tokenfab.kernels import rotary_embedding


def rope_parameters(config: Any) -> dict:
    """The config's RoPE settings as one dict with rope_type and rope_theta (HF v4 or v5 config)."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_type", params.get("type", "default"))
    if params.get("rope_theta") is None:
        params["rope_theta"] = getattr(config, "rope_theta", None) or 10000.0
    if getattr(config, "partial_rotary_factor", None) is not None:
        params.setdefault("partial_rotary_factor", config.partial_rotary_factor)
    return params


def _llama3_inv_freq(inv_freq: torch.Tensor, p: dict, max_pos: int) -> torch.Tensor:
    factor = p["factor"]
    low, high = p.get("low_freq_factor", 1.0), p.get("high_freq_factor", 4.0)
    old_len = p.get("original_max_position_embeddings", max_pos)
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(mid, blended, out)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(dim: int, base: float, p: dict, max_pos: int) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071): interpolate low frequencies, keep high ones, ramp between."""
    old_len = p.get("original_max_position_embeddings") or max_pos
    factor = p.get("factor") or max_pos / old_len
    attn = p.get("attention_factor")
    if attn is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attn = _yarn_mscale(factor, p["mscale"]) / _yarn_mscale(factor, p["mscale_all_dim"])
        else:
            attn = _yarn_mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolate = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attn)


def build_cos_sin_cache(
    rotary_dim: int, max_position: int, params: dict, max_position_embeddings: int
) -> torch.Tensor:
    """[max_position, rotary_dim] fp32: cos in the first half of the columns, sin in the second."""
    base = float(params["rope_theta"])
    rope_type = params.get("rope_type", "default")
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    scale = 1.0
    if rope_type in ("default", None):
        pass
    elif rope_type == "linear":
        inv_freq = inv_freq / params["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, params, max_position_embeddings)
    elif rope_type == "yarn":
        inv_freq, scale = _yarn_inv_freq(rotary_dim, base, params, max_position_embeddings)
    else:
        raise ValueError(f"unsupported rope_type {rope_type!r}")
    t = torch.arange(max_position, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    return torch.cat((freqs.cos() * scale, freqs.sin() * scale), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        max_position: int,
        params: dict,
        max_position_embeddings: int | None = None,
        is_neox: bool = True,
    ) -> None:
        super().__init__()
        self.rotary_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        self.is_neox = is_neox
        cache = build_cos_sin_cache(self.rotary_dim, max_position, params, max_position_embeddings or max_position)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary_embedding(positions, q, k, self.cos_sin_cache, self.is_neox)
