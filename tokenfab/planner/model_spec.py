"""A model's shape from its ``config.json`` alone (no weights, no transformers): every weight tensor with
its size and how tensor/expert parallelism shards it, and the per-token cache of its attention.

The tensor list mirrors the Hugging Face modules exactly (tests compare the counts with transformers'
models built on the meta device), one entry per tensor per layer, named as in the checkpoints so that
a quantization config's ignore lists can be applied to the names. The shapes and sharding kinds live in
``spec_types``, the per-family inventories in ``model_layers``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenfab.planner.hardware import PlanInputError
from tokenfab.planner.model_layers import build
from tokenfab.planner.spec_types import ConfigReader, ModelSpec

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral", "gpt_oss",
             "deepseek_v3", "kimi_k2", "deepseek_v32", "glm_moe_dsa")


def load_config(model: str | Path) -> dict[str, Any]:
    """``config.json`` of a folder (or the file itself) as a dict; weights are not needed."""
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise PlanInputError(f"{model}: no config.json (MODEL must be a folder holding one, or the file)")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PlanInputError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise PlanInputError(f"{path}: expected a JSON object")
    quant = path.parent / "hf_quant_config.json"  # ModelOpt's NVFP4/FP8 exports
    if "quantization_config" not in config and quant.is_file():
        try:
            q = json.loads(quant.read_text())
        except json.JSONDecodeError as e:
            raise PlanInputError(f"{quant}: not valid JSON ({e})") from None
        config["quantization_config"] = {"quant_method": "modelopt", **q.get("quantization", q)}
    return config


def build_spec(config: dict[str, Any]) -> ModelSpec:
    """The weight inventory and attention shape of a config dict (a text model, or a multimodal
    wrapper's ``text_config`` such as Kimi K2.5's)."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    model_type = str(text.get("model_type") or config.get("model_type") or "")
    if model_type not in SUPPORTED:
        raise PlanInputError(f"config.json: model_type {model_type!r} is not supported by tokenfab plan; "
                             f"supported: {', '.join(SUPPORTED)}")
    c = ConfigReader(text, model_type)
    arch = (config.get("architectures") or text.get("architectures") or [model_type])[0]
    spec = build(model_type, c)
    spec.architecture = str(arch)
    dtype = text.get("torch_dtype") or text.get("dtype") or config.get("torch_dtype") or "bfloat16"
    spec.dtype = "bfloat16" if dtype == "float32" else str(dtype)  # serving never runs fp32 on a GPU
    q = config.get("quantization_config") or text.get("quantization_config")
    if q is not None and not isinstance(q, dict):
        raise PlanInputError("config.json: quantization_config must be an object")
    spec.quantization_config = q
    return spec
