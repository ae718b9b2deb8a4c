"""Copying checkpoint tensors (Hugging Face names) into a model's parameters."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from tokenfab.layers.linear import MergedLinear
from tokenfab.loader.errors import ModelLoadError

# Checkpoint entries that carry no weights we need.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _target(model: nn.Module, name: str) -> tuple[str, int | None]:
    """Our parameter name for a checkpoint name, and the shard index for merged layers."""
    packed = getattr(model, "packed_modules", {})
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in packed:
            merged, shard = packed[part]
            return ".".join(parts[:i] + [merged] + parts[i + 1 :]), shard
    return name, None


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], source: str | Path) -> None:
    """Load every parameter of ``model`` from ``weights``; a missing or misshapen tensor is a
    ModelLoadError naming ``source``. Models may rename checkpoint entries first with a
    ``remap_checkpoint_name(name) -> str | None`` method (None: skip the entry), and take
    entries themselves with ``load_checkpoint_tensor(name, tensor) -> list[str] | None`` (None:
    not taken; else the parameters that are now complete; ValueError: a bad tensor)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    modules = dict(model.named_modules())
    remap = getattr(model, "remap_checkpoint_name", None)
    take = getattr(model, "load_checkpoint_tensor", None)
    loaded: set[str] = set()
    for ckpt_name, tensor in weights:
        if ckpt_name.endswith(_IGNORED_SUFFIXES):
            continue
        if remap is not None:
            ckpt_name = remap(ckpt_name)
            if ckpt_name is None:
                continue
        if take is not None:
            try:
                done = take(ckpt_name, tensor)
            except ValueError as e:
                raise ModelLoadError(source, str(e)) from e
            if done is not None:
                loaded.update(done)
                continue
        name, shard = _target(model, ckpt_name)
        if name not in params:
            continue  # e.g. lm_head.weight present although embeddings are tied
        param = params[name]
        if shard is not None:
            mod = modules[name.rsplit(".", 1)[0]]
            assert isinstance(mod, MergedLinear)
            lo, hi = mod.shard_range(shard)
            dst = param.data[lo:hi]
            loaded.add(f"{name}#{shard}")
        else:
            dst = param.data
            loaded.add(name)
        if dst.shape != tensor.shape:
            raise ModelLoadError(
                source, f"tensor {ckpt_name} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}"
            )
        dst.copy_(tensor)
    missing = []
    for name in dict(model.named_parameters()):  # tied parameters listed once
        mod = modules.get(name.rsplit(".", 1)[0])
        if isinstance(mod, MergedLinear):
            missing += [f"{name} (shard {i})" for i in range(len(mod.shard_sizes)) if f"{name}#{i}" not in loaded]
        elif name not in loaded:
            missing.append(name)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelLoadError(source, f"missing tensors: {shown}")
