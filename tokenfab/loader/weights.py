"""Copying checkpoint tensors (Hugging Face names) into a model's parameters."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from tokenfab.layers.linear import MergedLinear
from tokenfab.loader.errors import ModelLoadError
from tokenfab.loader.formats import is_plain_float, may_be_taken_packed, unsupported_tensor_problem
from tokenfab.quant.base import QuantizedModule
from tokenfab.quant.kv_fp8 import take_kv_scale

# Checkpoint entries that carry no weights we need: the rotary frequencies some Llama exports
# save (we compute them from the config). Models skip their own known extras themselves
# (remap_checkpoint_name -> None, e.g. Kimi's vision tower; DeepSeek keeps its MTP layer aside).
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


def _shown(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], source: str | Path) -> None:
    """Load every parameter of ``model`` from ``weights``; a missing or misshapen tensor is a
    ModelLoadError naming ``source``. Models may rename checkpoint entries first with a
    ``remap_checkpoint_name(name) -> str | None`` method (None: skip the entry), and take
    entries themselves with ``load_checkpoint_tensor(name, tensor) -> list[str] | None`` (None:
    not taken; else the parameters that are now complete; ValueError: a bad tensor).

    Quantized layers (``model.quant_method`` set, layers swapped by tokenfab.loader.quant_apply) take their
    tensors through ``load_quantized(suffix, tensor, shard)`` and list what they still lack in
    ``missing()``; with a quant method, non-float tensors are offered to the model's hook (quantized experts).

    Tensor parallelism: a layer built for TP > 1 carries ``tp_split`` (layers.tp_split); it is
    handed the full checkpoint tensor and keeps its rank's part (plain layers here, quantized ones
    in ``load_quantized``).

    Nothing is dropped silently: a tensor in a dtype no parameter takes as is (float8, packed
    integers: a quantized format we do not load yet) is an error naming the format, and a
    tensor that nothing consumed is an error naming it (``_IGNORED_SUFFIXES`` and the entries a
    model's remap skips excepted). When ``weights`` has a ``current_file`` attribute (the
    safetensors reader), errors name the shard the tensor came from.
    """

    def where() -> str | Path:
        return getattr(weights, "current_file", None) or source

    params = dict(model.named_parameters(remove_duplicate=False))
    modules = dict(model.named_modules())
    remap = getattr(model, "remap_checkpoint_name", None)
    take = getattr(model, "load_checkpoint_tensor", None)
    loaded: set[str] = set()
    quantized = getattr(model, "quant_method", None)
    unused: dict[str, str | Path] = {}  # checkpoint name -> its file
    for ckpt_name, tensor in weights:
        if ckpt_name.endswith(_IGNORED_SUFFIXES):
            continue
        stored_name = ckpt_name  # as the file names it, for errors
        if remap is not None:
            ckpt_name = remap(ckpt_name)
            if ckpt_name is None:
                continue
        try:  # FP8 KV-cache scales (k_scale / v_scale): kept on their attention layer (quant/kv_fp8.py)
            if take_kv_scale(ckpt_name, tensor, modules):
                continue
        except ValueError as e:
            raise ModelLoadError(where(), str(e)) from e
        plain = is_plain_float(tensor)
        if quantized is not None and ckpt_name not in params:  # the format's own tensor names (quant/base.py)
            ckpt_name = quantized.checkpoint_name(ckpt_name)
        if quantized is not None:  # a quantized layer (tokenfab/quant) takes its checkpoint tensors itself
            qname, qshard = _target(model, ckpt_name)
            qmod_name, _, suffix = qname.rpartition(".")
            qmod = modules.get(qmod_name)
            if qmod is not None and hasattr(qmod, "load_quantized"):
                try:
                    took = qmod.load_quantized(suffix, tensor, qshard)
                except ValueError as e:
                    raise ModelLoadError(where(), f"tensor {stored_name}: {e}") from e
                if took:
                    continue
        # integer tensors a model takes itself (DeepSeek-V4's hash-routing table ``tid2eid``)
        own_int = ckpt_name.endswith(tuple(getattr(model, "integer_checkpoint_tensors", ())))
        if not plain and quantized is None and not own_int and not may_be_taken_packed(ckpt_name, tensor):
            all_names = getattr(weights, "all_names", None)
            siblings = all_names() if callable(all_names) else ()
            raise ModelLoadError(where(), unsupported_tensor_problem(ckpt_name, tensor, siblings))
        if take is not None:
            try:
                done = take(ckpt_name, tensor)
            except ValueError as e:
                named = stored_name in str(e) or ckpt_name in str(e)
                raise ModelLoadError(where(), str(e) if named else f"tensor {stored_name}: {e}") from e
            if done is not None:
                loaded.update(done)
                continue
        if not plain:  # packed blocks that no model hook took
            raise ModelLoadError(where(), unsupported_tensor_problem(ckpt_name, tensor))
        name, shard = _target(model, ckpt_name)
        if name not in params:
            unused[ckpt_name] = where()
            continue
        param = params[name]
        mod_name, _, suffix = name.rpartition(".")
        split = getattr(modules.get(mod_name), "tp_split", None)
        if split is not None:  # tensor parallel: this rank keeps its part of the full tensor
            try:
                tensor = split.take_param(suffix, tensor, shard)
            except ValueError as e:
                raise ModelLoadError(where(), f"tensor {ckpt_name}: {e}") from e
        if shard is not None:
            mod = modules[mod_name]
            assert isinstance(mod, MergedLinear)
            lo, hi = mod.shard_range(shard)
            dst = param.data[lo:hi]
            loaded.add(f"{name}#{shard}")
        else:
            dst = param.data
            loaded.add(name)
        if dst.shape != tensor.shape:
            raise ModelLoadError(
                where(), f"tensor {ckpt_name} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}"
            )
        dst.copy_(tensor)
    missing = []
    for name in dict(model.named_parameters()):  # tied parameters listed once
        mod = modules.get(name.rsplit(".", 1)[0])
        if isinstance(mod, MergedLinear):
            missing += [f"{name} (shard {i})" for i in range(len(mod.shard_sizes)) if f"{name}#{i}" not in loaded]
        elif name not in loaded:
            missing.append(name)
    for mod_name, mod in modules.items():  # quantized layers and experts report their own missing tensors
        if isinstance(mod, QuantizedModule):
            missing += [f"{mod_name}.{m}" for m in mod.missing()]
    if unused:
        files = sorted({str(f) for f in unused.values()})
        also = f"; and {len(missing)} parameters are missing: {_shown(missing)}" if missing else ""
        raise ModelLoadError(
            files[0] if len(files) == 1 else source,
            f"checkpoint tensors that no parameter of {type(model).__name__} takes: {_shown(sorted(unused))} "
            f"(a format or architecture variant tokenfab does not load yet; nothing is dropped silently){also}",
        )
    if missing:
        raise ModelLoadError(source, f"missing tensors: {_shown(missing)}")
