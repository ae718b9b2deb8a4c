"""Which checkpoint formats we can load, and a clear refusal for those we cannot yet.

A quantized checkpoint must never load as silent garbage. Official FP8 DeepSeek checkpoints store
float8_e4m3fn weights beside ``weight_scale_inv`` block scales: copying the float8 values into
bfloat16 parameters and dropping the scales runs, and answers nonsense. So a checkpoint is
refused, with the file and the format named, when

* its ``config.json`` carries a ``quantization_config`` whose ``quant_method`` no format module of
  tokenfab.quant loads (:func:`check_quantization_config`; the message lists the formats that load), or
* a tensor's dtype is one no parameter takes as is: a float8 type, or an integer type that the
  model's own ``load_checkpoint_tensor`` does not consume (:func:`unsupported_tensor_problem`).

What does load: unquantized float32 / float16 / bfloat16 tensors for every architecture, the
formats registered in :mod:`tokenfab.quant.config` (kept packed), and MXFP4 experts
(``*_blocks`` / ``*_scales`` uint8 pairs) for GPT-OSS through the model's own hook.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch

from tokenfab.loader.errors import ModelLoadError
from tokenfab.quant.base import QuantMethod
from tokenfab.quant.config import (
    QUANT_METHODS,
    UnsupportedQuantization,
    load_providers,
    registry_key,
    supported_formats,
)

# quant_method -> the architectures whose models dequantize it at load
SUPPORTED_QUANT_METHODS: dict[str, tuple[str, ...]] = {"mxfp4": ("GptOssForCausalLM",)}

# Integer tensors a model's load_checkpoint_tensor may consume: MXFP4 blocks and scales (GPT-OSS).
# Any other integer tensor (or one that no model hook takes) is refused.
_PACKED_SUFFIXES = ("_blocks", "_scales")

_PLAIN_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

# Tensor-name endings that identify a format, most specific first: (ending, format description).
_FORMAT_BY_SUFFIX = (
    ("weight_scale_inv", "FP8 block-quantized (float8 weights with weight_scale_inv block scales, "
                         "e.g. the official DeepSeek-V3/R1 checkpoints)"),
    ("weight_packed", "compressed-tensors pack-quantized (int32-packed low-bit weights)"),
    ("weight_scale", "compressed-tensors / FP8 (per-channel or per-tensor weight_scale)"),
    ("weight_zero_point", "compressed-tensors (quantized weights with zero points)"),
    ("_blocks", "MXFP4 (uint8 _blocks with _scales)"),
    ("_scales", "MXFP4 (uint8 _blocks with _scales)"),
    ("qweight", "GPTQ/AWQ (int32-packed qweight)"),
    ("qzeros", "GPTQ/AWQ (int32-packed qzeros)"),
    ("g_idx", "GPTQ (g_idx)"),
    ("absmax", "bitsandbytes"),
    ("quant_map", "bitsandbytes"),
    ("weight_scale_2", "NVFP4 (ModelOpt)"),
    ("input_scale", "FP8 / NVFP4 (static activation input_scale)"),
)

_METHOD_NAMES = {
    "fp8": "FP8",
    "compressed-tensors": "compressed-tensors",
    "mxfp4": "MXFP4",
    "gptq": "GPTQ",
    "awq": "AWQ",
    "bitsandbytes": "bitsandbytes",
    "modelopt": "ModelOpt (NVFP4/FP8)",
    "fbgemm_fp8": "FBGEMM FP8",
    "hqq": "HQQ",
    "eetq": "EETQ",
    "aqlm": "AQLM",
    "torchao": "torchao",
}


def describe_quantization(qc: dict[str, Any]) -> str:
    """A human name for a ``quantization_config``: the method plus the details that tell formats apart."""
    method = str(qc.get("quant_method", "unknown"))
    name = _METHOD_NAMES.get(method, method)
    details = []
    if method == "fp8":
        if qc.get("weight_block_size"):
            details.append(f"block-quantized, weight_block_size {list(qc['weight_block_size'])}, "
                           "weight_scale_inv scales")
        if qc.get("fmt"):
            details.append(f"fmt {qc['fmt']}")
    elif method == "compressed-tensors":
        if qc.get("format"):
            details.append(f"format {qc['format']!r}")
        for group in (qc.get("config_groups") or {}).values():
            w = (group or {}).get("weights") or {}
            if w:
                details.append(f"weights {w.get('type', '?')}{w.get('num_bits', '')} {w.get('strategy', '')}".rstrip())
                break
    elif method in ("gptq", "awq") and qc.get("bits"):
        details.append(f"{qc['bits']}-bit")
    return name + (f" ({', '.join(details)})" if details else "")


def quantization_config(raw: dict[str, Any]) -> dict[str, Any] | None:
    """The ``quantization_config`` of a raw config.json (top level, or a multimodal model's text_config).
    DeepSeek-V4 declares its experts' format beside it (top-level ``expert_dtype``; V4.1 moved it inside):
    folded in, as transformers' ``DeepseekV4Config`` does."""
    qc = raw.get("quantization_config")
    if qc is None and isinstance(raw.get("text_config"), dict):
        qc = raw["text_config"].get("quantization_config")
    if isinstance(qc, dict) and raw.get("expert_dtype") is not None and "expert_dtype" not in qc:
        qc = {**qc, "expert_dtype": raw["expert_dtype"]}
    return qc if isinstance(qc, dict) else None


def check_quantization_config(config_path: Path, arch: str) -> QuantMethod | None:
    """The checkpoint's QuantMethod (tokenfab.quant), None for an unquantized checkpoint or one whose
    model dequantizes its format at load (:data:`SUPPORTED_QUANT_METHODS`); a format we cannot load
    is a ModelLoadError naming config.json (or hf_quant_config.json), the format, and what loads."""
    config_path = Path(config_path)
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, ValueError):
        return None  # load_hf_config reports unreadable configs
    if not isinstance(raw, dict):
        return None
    qc = quantization_config(raw)
    if qc is not None:
        load_providers()
        key = registry_key(qc)
        if key not in QUANT_METHODS and arch in SUPPORTED_QUANT_METHODS.get(key, ()):
            return None  # the model's own loader hook dequantizes it
    return resolve_quant_method(config_path.parent, raw)


def _modelopt_config(model_dir: Path) -> dict[str, Any] | None:
    path = model_dir / "hf_quant_config.json"
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(path, f"cannot read hf_quant_config.json: {e}") from e
    quant = raw.get("quantization") if isinstance(raw, dict) else None
    if not isinstance(quant, dict):
        raise ModelLoadError(path, "hf_quant_config.json has no `quantization` object")
    return {"quant_method": "modelopt", **quant}


def resolve_quant_method(model_dir: Path, raw_config: dict) -> QuantMethod | None:
    """The QuantMethod of a checkpoint directory, or None for an unquantized one.

    An unknown method, or a variant its factory refuses, is a ModelLoadError naming config.json
    (or hf_quant_config.json) and the format, and listing what is supported."""
    model_dir = Path(model_dir)
    qc = quantization_config(raw_config) if isinstance(raw_config, dict) else None
    source = model_dir / "config.json"
    if qc is None:
        qc = _modelopt_config(model_dir)
        source = model_dir / "hf_quant_config.json"
        if qc is None:
            return None
    load_providers()
    key = registry_key(qc)
    factory = QUANT_METHODS.get(key)
    if factory is None:
        raise ModelLoadError(source, f"unsupported quantized checkpoint: quantization_config is "
                             f"{describe_quantization(qc)}, which tokenfab cannot load (it loads float32/float16/"
                             f"bfloat16 weights and these formats: {', '.join(supported_formats()) or 'none'})")
    try:
        return factory(qc)
    except UnsupportedQuantization as e:
        raise ModelLoadError(source, f"unsupported quantized checkpoint: {describe_quantization(qc)}: {e}") from e


def format_of_tensor(name: str, tensor: torch.Tensor, siblings: Collection[str] = ()) -> str:
    """The on-disk format a tensor's name, its dtype or its neighbours in the file (``siblings``)
    point to."""
    for suffix, fmt in _FORMAT_BY_SUFFIX:
        if name.endswith(suffix):
            return fmt
    if "float8" in str(tensor.dtype):
        for suffix, fmt in _FORMAT_BY_SUFFIX[:3]:  # weight_scale_inv, weight_packed, weight_scale
            if name + suffix.removeprefix("weight") in siblings:
                return fmt
        return "FP8 (float8 weights)"
    return f"quantized or packed ({str(tensor.dtype).removeprefix('torch.')} tensors)"


def may_be_taken_packed(name: str, tensor: torch.Tensor) -> bool:
    """Whether a non-float tensor may be offered to the model's own loader hook (MXFP4 pairs)."""
    return tensor.dtype == torch.uint8 and name.endswith(_PACKED_SUFFIXES)


def is_plain_float(tensor: torch.Tensor) -> bool:
    return tensor.dtype in _PLAIN_FLOATS


def unsupported_tensor_problem(name: str, tensor: torch.Tensor, siblings: Collection[str] = ()) -> str:
    """The error text for a tensor no parameter can take as is."""
    dtype = str(tensor.dtype).removeprefix("torch.")
    return (f"unsupported quantized checkpoint: tensor {name} is stored as {dtype}; format: "
            f"{format_of_tensor(name, tensor, siblings)}, which tokenfab cannot load yet")
