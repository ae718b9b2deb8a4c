"""LoRA adapters on disk in PEFT's format, and the merged model as a Hugging Face folder.

An adapter directory holds ``adapter_config.json`` (``peft_type: LORA``, r, lora_alpha, ...) and
``adapter_model.safetensors`` with tensors named ``base_model.model.<module path>.lora_A.weight`` /
``.lora_B.weight``: what ``peft.PeftModel.from_pretrained`` and vLLM's LoRA loader read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from tokenfab.train.lora import inject_lora, lora_modules, lora_state_dict, merge_lora

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PREFIX = "base_model.model."


def save_adapter(model: nn.Module, out_dir: str | Path, base_model_name: str | None) -> Path:
    """Write the LoRA adapter of ``model`` to ``out_dir`` in PEFT's format; returns ``out_dir``."""
    cfg = getattr(model, "lora_config", None)
    if cfg is None:
        raise ValueError("the model has no LoRA layers (call inject_lora first)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {PREFIX + k: v.detach().contiguous().cpu() for k, v in lora_state_dict(model).items()}
    save_file(tensors, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name,
        "r": cfg.r,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "target_modules": list(cfg.target_modules),
        "use_rslora": cfg.use_rslora,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "use_dora": False,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    (out / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    return out


def read_adapter_config(adapter_dir: str | Path) -> dict:
    path = Path(adapter_dir) / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no adapter config")
    cfg = json.loads(path.read_text())
    if cfg.get("peft_type") != "LORA":
        raise ValueError(f"{path}: peft_type is {cfg.get('peft_type')!r}, only LORA is supported")
    for key in ("use_dora", "rank_pattern", "alpha_pattern", "modules_to_save"):
        if cfg.get(key):
            raise ValueError(f"{path}: '{key}' is not supported")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"{path}: bias {cfg['bias']!r} is not supported (only 'none')")
    return cfg


@torch.no_grad()
def load_adapter(model: nn.Module, adapter_dir: str | Path) -> nn.Module:
    """Apply a PEFT LoRA adapter to ``model`` (injecting LoRA layers with the adapter's settings if the model
    has none yet); every adapter tensor must find its module and shape, and every LoRA layer its tensors."""
    adapter_dir = Path(adapter_dir)
    cfg = read_adapter_config(adapter_dir)
    if not any(True for _ in lora_modules(model)):
        inject_lora(model, r=cfg["r"], alpha=cfg["lora_alpha"], dropout=cfg.get("lora_dropout", 0.0),
                    target_modules=cfg["target_modules"], use_rslora=cfg.get("use_rslora", False))
    tensors = load_file(str(adapter_dir / WEIGHTS_NAME))
    ours = lora_state_dict(model)
    loaded = set()
    for key, value in tensors.items():
        name = key.removeprefix(PREFIX).replace(".default.weight", ".weight")
        if name not in ours:
            raise ValueError(f"{adapter_dir / WEIGHTS_NAME}: tensor {key} has no LoRA layer in this model")
        if ours[name].shape != value.shape:
            raise ValueError(f"{adapter_dir / WEIGHTS_NAME}: {key} has shape {tuple(value.shape)}, "
                             f"the model expects {tuple(ours[name].shape)}")
        ours[name].copy_(value)
        loaded.add(name)
    missing = sorted(set(ours) - loaded)
    if missing:
        raise ValueError(f"{adapter_dir / WEIGHTS_NAME}: no tensor for {missing[0]} (and {len(missing) - 1} more)")
    return model


def _forget_gguf_quantizer(model: nn.Module) -> None:
    """A GGUF base loaded by transformers is dequantized to plain tensors, but keeps a GGUF "quantizer" mark that
    makes ``save_pretrained`` refuse; the merged weights are plain, so drop the mark (other quantizers: refuse)."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is None:
        return
    method = getattr(quantizer.quantization_config, "quant_method", None)
    if getattr(method, "value", method) != "gguf":
        raise ValueError(f"cannot save a merged model over quantized base weights ({method}); "
                         "load the base model in full precision")
    model.hf_quantizer = None
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config


def save_merged(model: nn.Module, tokenizer: Any, out_dir: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Merge LoRA into the base weights (in place: ``model`` is left merged) and write a Hugging Face folder:
    config.json (with ``architectures``), model.safetensors (tied embeddings stored once), generation config
    and the tokenizer files with its chat template, loadable by ``transformers`` and ``tokenfab serve``."""
    merge_lora(model)
    _forget_gguf_quantizer(model)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if dtype is not None:
        model.to(dtype)
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(str(out), safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    return out
