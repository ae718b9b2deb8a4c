"""Swapping a built model's layers for their quantized versions (before weights load).

It walks the model's layers (Linear, MergedLinear, FusedMoE) and asks a :class:`QuantMethod` for their
replacements, so it lives above both layers and quant: the loader runs it between build and load."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from tokenfab.layers.linear import Linear, MergedLinear
from tokenfab.layers.moe import FusedMoE
from tokenfab.quant.base import QuantMethod


def checkpoint_names(model: nn.Module, module_name: str) -> list[str]:
    """The checkpoint module names a module of ours stands for: a merged projection (``qkv_proj``)
    stands for its shards (``q_proj``, ``k_proj``, ``v_proj``), per the model's ``packed_modules``."""
    packed = getattr(model, "packed_modules", {}) or {}
    head, _, last = module_name.rpartition(".")
    shards = sorted((i, src) for src, (merged, i) in packed.items() if merged == last)
    if not shards:
        return [module_name]
    return [f"{head}.{src}" if head else src for _, src in shards]


def _is_router(parent: nn.Module, child_name: str) -> bool:
    # MoE routers (mlp.gate) and shared-expert gates stay in full precision in every official release
    return isinstance(parent, FusedMoE) and child_name in ("gate", "shared_expert_gate")


def apply_quant_method(model: nn.Module, method: QuantMethod) -> int:
    """Replace every Linear / MergedLinear that ``method`` quantizes and give every FusedMoE its
    quantized experts (``method.make_experts``). Returns the number of modules swapped.

    A merged projection whose shards disagree (some quantized, some not) is a ValueError: it cannot
    be one product."""
    swapped = 0
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            full = f"{parent_name}.{child_name}" if parent_name else child_name
            if isinstance(child, Linear) and type(child) in (Linear, MergedLinear):
                if _is_router(parent, child_name):
                    continue
                names = checkpoint_names(model, full)
                flags = {method.is_quantized(n) for n in names}
                if len(flags) > 1:
                    raise ValueError(f"{method.name}: the projections {names} merged into {full} are not all "
                                     "quantized alike")
                if flags.pop():
                    new = method.make_linear(child, full)
                    if child.tp_split is not None:  # tensor parallel: the same split, kept by the quantized layer
                        new.tp_split, new.reduce_output = child.tp_split, child.reduce_output
                    setattr(parent, child_name, new)
                    swapped += 1
            elif isinstance(child, FusedMoE) and method.is_quantized(f"{full}.experts"):
                experts = method.make_experts(child, full)
                if experts is not None:
                    child.set_quant_experts(experts)
                    swapped += 1
    return swapped


class _EmptyOnMeta(TorchFunctionMode):
    """``torch.empty`` without an explicit device allocates on "meta" (no memory)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.empty and kwargs.get("device") is None:
            kwargs["device"] = "meta"
        return func(*args, **kwargs)


@contextlib.contextmanager
def weights_on_meta() -> Iterator[None]:
    """Build a model whose layers' weights (``torch.empty`` parameters: linears, stacked experts,
    embeddings) take no memory yet, so that a quantized checkpoint never needs the float model's
    memory: the layers the format quantizes are swapped before any weight is allocated, and
    :func:`materialize` allocates the rest. Enter it inside the ``torch.device`` context of the build."""
    with _EmptyOnMeta():
        yield


def materialize(model: nn.Module, device: torch.device) -> None:
    """Allocate (uninitialised, on ``device``) every parameter still on "meta" after the swap; the
    weight loader fills them. Tied parameters stay tied. A meta buffer would be one a layer computed
    at build time from an empty tensor: a ValueError (the model cannot be built this way)."""
    fresh: dict[int, nn.Parameter] = {}
    for mod_name, mod in model.named_modules():
        for name, p in list(mod._parameters.items()):
            if p is not None and p.is_meta:
                if id(p) not in fresh:
                    fresh[id(p)] = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
                mod._parameters[name] = fresh[id(p)]
        for name, b in mod._buffers.items():
            if b is not None and b.is_meta:
                raise ValueError(f"{mod_name}.{name} was computed from an uninitialised tensor while building")
