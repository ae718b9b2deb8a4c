"""A GGUF file's metadata as a ``transformers`` config: HF field names, eos ids, RoPE scaling (Llama 3
frequency factors recovered from ``rope_freqs``) (split from ``gguf.py``)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tokenfab.loader.errors import ModelLoadError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

from tokenfab.loader.gguf_quants import dequantize
from tokenfab.loader.gguf_reader import _Meta, _torch_shape

# GGUF `general.architecture` -> (HF `architectures` name, transformers config class name).
# Mistral files say "llama": llama.cpp runs them with the same graph, and so does LlamaConfig.
_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "LlamaConfig"),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config"),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config"),
}

# A tensor llama.cpp adds that has no HF counterpart: Llama 3's RoPE frequency factors, which
# stand in for the `rope_scaling` dict of the HF config (read back into the config here).
_ROPE_FREQS = "rope_freqs.weight"

def _build_config(
    path: Path, arch: str, meta: _Meta, by_name: dict[str, Any], groups: dict[str, bool]
) -> PretrainedConfig:
    import transformers

    p = f"{arch}."
    hidden = meta.int(p + "embedding_length")
    n_head = meta.int(p + "attention.head_count")
    n_kv = meta.int(p + "attention.head_count_kv", n_head)
    if n_head <= 0 or n_kv <= 0 or n_head % n_kv:
        raise ModelLoadError(path, f"metadata gives {n_head} attention heads and {n_kv} key/value heads")
    # head_dim: llama.cpp writes attention.key_length when the HF config names a head_dim, and for
    # Llama also rope.dimension_count (the rotary width, which for these models is the head dim).
    head_dim = meta.optional_int(p + "attention.key_length")
    if head_dim is None and arch == "llama":
        head_dim = meta.optional_int(p + "rope.dimension_count")
    if head_dim is None:
        head_dim = hidden // n_head
    rope_theta = meta.float(p + "rope.freq_base", 10000.0)
    vocab = _torch_shape(by_name["token_embd.weight"])[0]
    kwargs: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[arch][0]],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": meta.int(p + "feed_forward_length"),
        "num_hidden_layers": meta.int(p + "block_count"),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": meta.int(p + "context_length"),
        "rms_norm_eps": meta.float(p + "attention.layer_norm_rms_epsilon"),
        "rope_theta": rope_theta,
        "tie_word_embeddings": "output.weight" not in by_name,
        "bos_token_id": meta.optional_int("tokenizer.ggml.bos_token_id"),
        "eos_token_id": _eos_ids(meta),
        "pad_token_id": meta.optional_int("tokenizer.ggml.padding_token_id"),
        **groups,
    }
    if arch in ("qwen2", "qwen3"):
        kwargs["use_sliding_window"] = False
    scaling = _rope_scaling(path, arch, meta, by_name, head_dim, rope_theta)
    if scaling is not None:
        kwargs["rope_scaling"] = scaling
    config_cls = getattr(transformers, _ARCHITECTURES[arch][1])
    try:
        return config_cls(**kwargs)
    except (ValueError, TypeError, KeyError) as e:
        raise ModelLoadError(path, f"the metadata does not make a valid {config_cls.__name__}: {e}") from None


def _eos_ids(meta: _Meta) -> int | list[int] | None:
    """EOS id, plus end-of-turn / end-of-message ids when the file names distinct ones (Llama 3
    files do): generation should stop at any of them, as llama.cpp does."""
    ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        v = meta.optional_int(key)
        if v is not None and v not in ids:
            ids.append(v)
    if not ids:
        return None
    return ids[0] if len(ids) == 1 else ids


def _rope_scaling(
    path: Path, arch: str, meta: _Meta, by_name: dict[str, Any], head_dim: int, rope_theta: float
) -> dict[str, Any] | None:
    """The HF `rope_scaling` dict (without rope_theta) the file implies, or None for plain RoPE."""
    p = f"{arch}.rope.scaling."
    kind = meta.get(p + "type")
    factor = meta.get(p + "factor")
    if _ROPE_FREQS in by_name:
        if kind not in (None, "none"):
            raise ModelLoadError(path, f"the file has both {_ROPE_FREQS} and rope scaling type {kind!r}")
        return _llama3_scaling(path, by_name[_ROPE_FREQS], head_dim, rope_theta)
    if kind in (None, "none"):
        return None
    if kind not in ("linear", "yarn"):
        raise ModelLoadError(path, f"unsupported rope scaling type {kind!r} (linear and yarn are supported)")
    if not isinstance(factor, int | float):
        raise ModelLoadError(path, f"rope scaling type {kind!r} without a numeric {p}factor")
    out: dict[str, Any] = {"rope_type": kind, "factor": float(factor)}
    if kind == "yarn":
        orig = meta.optional_int(p + "original_context_length")
        if orig is not None:
            out["original_max_position_embeddings"] = orig
        for gguf_key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            v = meta.get(p + gguf_key)
            if v is not None:
                out[hf_key] = float(v)
        # llama.cpp's `attn_factor` is not written for these architectures by its converter, and
        # its meaning differs from HF's `attention_factor`, so it is not carried over.
    return out


# Llama 3.x rope_scaling values other than `factor`; llama.cpp bakes them into rope_freqs.
_LLAMA3_CANDIDATES = ({"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},)


def _llama3_factors(head_dim: int, theta: float, factor: float, params: dict[str, Any]) -> np.ndarray:
    """The per-frequency divisors llama.cpp's converter computes for HF's "llama3" rope type."""
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < old_len / high:
            out.append(1.0)
        elif wavelen > old_len / low:
            out.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out)


def _llama3_scaling(path: Path, tensor: Any, head_dim: int, theta: float) -> dict[str, Any] | None:
    """Recover HF's llama3 `rope_scaling` from the rope_freqs tensor llama.cpp stores instead.

    The tensor holds one divisor per rotary frequency. Its maximum is `factor`; the remaining
    parameters are not recoverable in general, so known ones are tried and checked against it.
    """
    freqs = dequantize(tensor.data, tensor.tensor_type, _torch_shape(tensor)).reshape(-1).astype(np.float64)
    if freqs.shape[0] != head_dim // 2:
        raise ModelLoadError(path, f"{_ROPE_FREQS} has {freqs.shape[0]} entries, expected {head_dim // 2}")
    if np.all(freqs == 1.0):
        return None
    factor = float(np.float32(freqs.max()))
    for params in _LLAMA3_CANDIDATES:
        if np.allclose(_llama3_factors(head_dim, theta, factor, params), freqs, rtol=1e-5, atol=0):
            return {"rope_type": "llama3", "factor": factor, **params}
    raise ModelLoadError(path, f"{_ROPE_FREQS} does not match the Llama 3 rope scaling this loader recognises")


