"""Swapping a built model's layers for their quantized versions (before weights load)."""

from __future__ import annotations

from torch import nn

from tokenfab.layers.linear import Linear, MergedLinear
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
    from tokenfab.layers.moe import FusedMoE

    # MoE routers (mlp.gate) and shared-expert gates stay in full precision in every official release
    return isinstance(parent, FusedMoE) and child_name in ("gate", "shared_expert_gate")


def apply_quant_method(model: nn.Module, method: QuantMethod) -> int:
    """Replace every Linear / MergedLinear that ``method`` quantizes and give every FusedMoE its
    quantized experts (``method.make_experts``). Returns the number of modules swapped.

    A merged projection whose shards disagree (some quantized, some not) is a ValueError: it cannot
    be one product."""
    from tokenfab.layers.moe import FusedMoE

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
                    setattr(parent, child_name, method.make_linear(child, full))
                    swapped += 1
            elif isinstance(child, FusedMoE) and method.is_quantized(f"{full}.experts"):
                experts = method.make_experts(child, full)
                if experts is not None:
                    child.set_quant_experts(experts)
                    swapped += 1
    return swapped
