"""The interface every low-precision format implements (quant_interface.md).

A :class:`QuantMethod` is built from a checkpoint's ``quantization_config`` (see
:mod:`tokenfab.quant.config`). After the model is built, :func:`tokenfab.loader.quant_apply.apply_quant_method`
asks it, module by module, for a quantized replacement of each ``Linear`` / ``MergedLinear`` and for
quantized experts of each ``FusedMoE``. Quantized modules keep their checkpoint tensors packed (as
buffers, not Parameters) and take them through ``load_quantized(suffix, tensor, shard)``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

import torch
from torch import nn


def _matches(entry: str, module_name: str) -> bool:
    """compressed-tensors ``ignore`` / transformers ``modules_to_not_convert`` matching: ``re:`` entries are
    regexes matched against the module name; plain entries match the name itself, its last components
    (``lm_head`` matches ``lm_head``, ``self_attn`` matches ``model.layers.0.self_attn.q_proj``)."""
    if entry.startswith("re:"):
        return re.match(entry[3:], module_name) is not None
    if module_name == entry or module_name.endswith("." + entry):
        return True
    parts = module_name.split(".")
    sub = entry.split(".")
    return any(parts[i : i + len(sub)] == sub for i in range(len(parts) - len(sub) + 1))


class QuantMethod:
    """A checkpoint's low-precision format. Subclasses set ``name`` and implement ``make_linear``
    (and ``make_experts`` when their experts are quantized)."""

    name: str = "unquantized"

    def __init__(self, ignore: Sequence[str] = ()) -> None:
        self.ignore = [str(e) for e in ignore]

    def is_quantized(self, module_name: str) -> bool:
        """Whether the checkpoint module ``module_name`` (Hugging Face name) is stored quantized."""
        return not any(_matches(e, module_name) for e in self.ignore)

    def make_linear(self, linear: nn.Module, module_name: str) -> nn.Module:
        """A quantized replacement of ``linear`` (a Linear or MergedLinear): same forward signature,
        takes checkpoint tensors through ``load_quantized``."""
        raise NotImplementedError(f"{self.name} has no quantized linear")

    def make_experts(self, moe: nn.Module, module_name: str) -> nn.Module | None:
        """Quantized experts for a FusedMoE (``forward(x, topk_weights, topk_ids)``,
        ``load_expert(kind, suffix, tensor, expert)``), or None: the experts stay plain."""
        return None

    def checkpoint_name(self, name: str) -> str:
        """A checkpoint tensor's name as the quantized layers take it (after the model's remap; never asked
        for a name that is one of the model's parameters): formats that name their tensors differently
        (DeepSeek-V4's ``.scale`` grids) map them here."""
        return name

    def bytes_per_param(self) -> float | None:
        """Nominal weight bytes per parameter of the quantized layers (scales included), for reports."""
        return None

    def describe(self) -> str:
        return self.name


class QuantizedModule(nn.Module):
    """Bookkeeping shared by quantized linears and experts: which checkpoint tensors arrived.

    ``expected`` lists the (suffix, shard) pairs the module needs; ``missing()`` names the ones not
    loaded yet (the loader reports them as missing tensors)."""

    def __init__(self) -> None:
        super().__init__()
        self._expected: set[tuple[str, int | None]] = set()
        self._got: set[tuple[str, int | None]] = set()

    def expect(self, suffixes: Iterable[str], shards: Iterable[int | None]) -> None:
        self._expected |= {(s, sh) for s in suffixes for sh in shards}

    def mark(self, suffix: str, shard: int | None) -> None:
        self._got.add((suffix, shard))

    def missing(self) -> list[str]:
        return sorted(f"{s}" + (f" (shard {sh})" if sh is not None else "") for s, sh in self._expected - self._got)

    def weight_bytes(self) -> tuple[int, int]:
        """(bytes held by the module's buffers, parameters they stand for)."""
        held = sum(b.numel() * b.element_size() for b in self.buffers(recurse=False) if b is not None)
        return held, self.num_weight_params()

    def num_weight_params(self) -> int:
        raise NotImplementedError


def check_shape(what: str, tensor: torch.Tensor, expected: Sequence[int]) -> None:
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(f"{what} has shape {tuple(tensor.shape)}, expected {tuple(expected)}")
