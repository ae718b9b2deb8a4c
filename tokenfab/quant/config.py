"""Choosing a checkpoint's low-precision format from its config, never from the model family.

``quantization_config.quant_method`` (config.json, or a multimodal config's ``text_config``) names
the method; ModelOpt checkpoints may instead ship ``hf_quant_config.json``. compressed-tensors
holds several formats under one method, told apart by its ``config_groups`` weights:

    registry key                          format                                       module
    "fp8"                                 block FP8 (weight_scale_inv 128x128)         quant/fp8_block.py
    "fp8/expert_dtype"                    block FP8, experts per expert_dtype fp4/fp8  quant/fp4_experts.py
                                          (DeepSeek-V4's layout: ``.scale`` grids)
    "compressed-tensors/float-quantized"  FP8 weights, per-channel/tensor scales       quant/fp8_channel.py
    "compressed-tensors/pack-quantized"   INT4 W4A16 (weight_packed, group 32)         (task G)
    "mxfp4"                               GPT-OSS MXFP4 experts                        (task G)
    "modelopt"                            NVFP4 (hf_quant_config.json)                 (task G)

Format modules register a factory (``quantization_config`` dict -> QuantMethod) with
:func:`register_quant_method`; :data:`_PROVIDERS` lists the modules imported to fill the registry.
Which method a checkpoint directory declares (and the refusal of one no factory takes) is the
loader's business: :func:`tokenfab.loader.formats.resolve_quant_method`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from tokenfab.quant.base import QuantMethod

QUANT_METHODS: dict[str, Callable[[dict], QuantMethod]] = {}

# modules whose import registers format factories (a module not written yet is skipped)
_PROVIDERS = (
    "tokenfab.quant.fp8_block",
    "tokenfab.quant.fp4_experts",
    "tokenfab.quant.fp8_channel",
    "tokenfab.quant.int4_ct",
    "tokenfab.quant.mxfp4",
    "tokenfab.quant.nvfp4",
)


class UnsupportedQuantization(ValueError):
    """A factory's refusal of a variant of its method (the message says what is supported)."""


def skipped_modules(qc: dict, *keys: str) -> list:
    """The modules a config leaves unquantized: the first of ``keys`` it sets (a list), else none."""
    value = next((qc[k] for k in keys if qc.get(k)), None) or []
    if not isinstance(value, list):
        raise UnsupportedQuantization(f"{keys[0]} must be a list")
    return value


def register_quant_method(key: str, factory: Callable[[dict], QuantMethod]) -> None:
    QUANT_METHODS[key] = factory


_loaded = False


def load_providers() -> None:
    global _loaded
    if _loaded:
        return
    for mod in _PROVIDERS:
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name != mod:
                raise
    _loaded = True


def registry_key(qc: dict[str, Any]) -> str:
    """The registry key of a ``quantization_config``."""
    method = str(qc.get("quant_method", "")).lower()
    if method == "fp8" and qc.get("expert_dtype") is not None:
        return "fp8/expert_dtype"  # DeepSeek-V4: block FP8 linears, FP4 (or FP8) routed experts
    if method != "compressed-tensors":
        return method
    for group in (qc.get("config_groups") or {}).values():
        w = (group or {}).get("weights") or {}
        if w.get("type") == "float":
            return "compressed-tensors/float-quantized"
        if w.get("type") == "int":
            return "compressed-tensors/pack-quantized"
    return f"compressed-tensors/{qc.get('format', 'unknown')}"


def supported_formats() -> list[str]:
    load_providers()
    return sorted(QUANT_METHODS)
