"""Reading a Hugging Face model directory: config.json, *.safetensors (sharded or not)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from tokenfab.loader.errors import ModelLoadError


def load_hf_config(model_dir: Path) -> Any:
    """The transformers config of a directory, with a clear error when it is missing or bad."""
    cfg_path = model_dir / "config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(model_dir, "no config.json in the model directory")
    try:
        json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(cfg_path, f"config.json is not valid JSON ({e})") from e
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(model_dir))
    except (ValueError, KeyError, OSError) as e:
        raise ModelLoadError(cfg_path, f"cannot read the model config: {e}") from e


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, UnicodeDecodeError) as e:
            raise ModelLoadError(index, f"bad safetensors index ({e})") from e
        files = [model_dir / f for f in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f, "shard listed in model.safetensors.index.json is missing")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(model_dir, "no *.safetensors weight files in the model directory")
    return files


def iter_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every shard, one at a time."""
    from safetensors import SafetensorError, safe_open

    for f in safetensors_files(model_dir):
        try:
            with safe_open(str(f), framework="pt") as fh:
                for name in fh.keys():
                    yield name, fh.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise ModelLoadError(f, f"corrupt or truncated safetensors file ({e})") from e
