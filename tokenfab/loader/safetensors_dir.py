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
        raw = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(cfg_path, f"config.json is not valid JSON ({e})") from e
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(model_dir))
    except (ValueError, KeyError, OSError) as e:
        raise ModelLoadError(cfg_path, f"cannot read the model config: {e}") from e
    # a multimodal wrapper (Kimi K2.5's kimi_k25) without its text_config would silently get transformers'
    # default text model (full-size DeepSeek-V3 for Kimi), not the checkpoint's
    if "text_config" in (getattr(config, "sub_configs", None) or {}) and not isinstance(raw.get("text_config"), dict):
        raise ModelLoadError(cfg_path, f"model_type {raw.get('model_type')!r} is a multimodal wrapper whose "
                                       "`text_config` (the language model's config) is missing from config.json")
    return config


def _allowed_roots(model_dir: Path) -> list[Path]:
    """Where a weight file may really live: the model folder, and for a Hugging Face hub cache
    snapshot (``models--org--name/snapshots/<rev>/``, whose files are links to ``../../blobs/``)
    that repository's blobs folder."""
    roots = [model_dir.resolve()]
    if model_dir.parent.name == "snapshots":
        roots.append((model_dir.parent.parent / "blobs").resolve())
    return roots


def _inside(path: Path, roots: list[Path]) -> bool:
    real = path.resolve()
    return any(real == r or r in real.parents for r in roots)


def _check_shard_name(index: Path, model_dir: Path, name: Any, roots: list[Path]) -> Path:
    """A shard named by the index, refused unless it is a relative path that stays in the folder."""
    if not isinstance(name, str) or not name:
        raise ModelLoadError(index, f"bad safetensors index: shard name {name!r} is not a file name")
    rel = Path(name)
    if rel.is_absolute() or ".." in rel.parts or "\\" in name or "\x00" in name:
        raise ModelLoadError(index, f"bad safetensors index: shard {name!r} points outside the model folder")
    f = model_dir / rel
    if f.exists() and not _inside(f, roots):
        raise ModelLoadError(index, f"bad safetensors index: shard {name!r} is a link leading outside the model folder")
    return f


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files of a directory (from the index when there is one), each inside the folder."""
    roots = _allowed_roots(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = set(weight_map.values())
        except (json.JSONDecodeError, KeyError, UnicodeDecodeError, TypeError, AttributeError) as e:
            raise ModelLoadError(index, f"bad safetensors index ({e})") from e
        files = [_check_shard_name(index, model_dir, n, roots) for n in sorted(names, key=str)]
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f, "shard listed in model.safetensors.index.json is missing")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    # Mistral's repositories ship their native-format copy (consolidated.safetensors, other tensor
    # names) beside the Hugging Face files: the same weights twice, of which we read the HF ones.
    hf_files = [f for f in files if not f.name.startswith("consolidated")]
    files = hf_files or files
    if not files:
        raise ModelLoadError(model_dir, "no *.safetensors weight files in the model directory")
    for f in files:
        if not _inside(f, roots):
            raise ModelLoadError(f, "weight file is a link leading outside the model folder")
    return files


class SafetensorsWeights:
    """(name, tensor) for every tensor of every shard, one at a time; ``current_file`` is the
    shard the last tensor came from, so errors about a tensor can name its file, and
    ``all_names()`` every tensor name of the checkpoint (a float8 weight's ``weight_scale_inv``
    beside it tells its format)."""

    def __init__(self, model_dir: Path) -> None:
        self.files = safetensors_files(model_dir)
        self.current_file: Path | None = None

    def all_names(self) -> frozenset[str]:
        """Every tensor name in every shard (reads the headers only)."""
        from safetensors import SafetensorError, safe_open

        names: set[str] = set()
        for f in self.files:
            try:
                with safe_open(str(f), framework="pt") as fh:
                    names.update(fh.keys())
            except (SafetensorError, OSError, RuntimeError) as e:
                raise ModelLoadError(f, f"corrupt or truncated safetensors file ({e})") from e
        return frozenset(names)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import SafetensorError, safe_open

        for f in self.files:
            self.current_file = f
            try:
                with safe_open(str(f), framework="pt") as fh:
                    for name in fh.keys():
                        yield name, fh.get_tensor(name)
            except (SafetensorError, OSError, RuntimeError) as e:
                raise ModelLoadError(f, f"corrupt or truncated safetensors file ({e})") from e


def iter_safetensors(model_dir: Path) -> SafetensorsWeights:
    """Every tensor of every shard, one at a time (see :class:`SafetensorsWeights`)."""
    return SafetensorsWeights(model_dir)
