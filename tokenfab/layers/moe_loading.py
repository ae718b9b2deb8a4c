"""How checkpoint tensors land in a ``FusedMoE``'s stacked expert weights.

Checkpoints store experts one by one (``experts.{e}.gate_proj.weight``...) or stacked;
``ExpertLoading.load_expert_weight`` copies either into place (this rank's EP slots, its TP slice
of the intermediate dimension), ``load_moe_tensor`` routes a tensor to the layer (or to its
quantized experts) and ``load_expert_checkpoint_tensor`` maps the common Hugging Face names to it.
"""

from __future__ import annotations

import re

import torch
from torch import nn


class ExpertLoading:
    """``FusedMoE``'s loading half: it reads the layer's placement (``placement``, ``_local_logical``),
    sizes, TP rank and stacked parameters, and records completed units in ``_loaded``."""

    def local_slots(self, expert: int) -> list[int]:
        """This rank's slots holding logical ``expert`` (empty: another rank's expert)."""
        if self.placement is None:
            return [expert]
        return [s for s, lg in enumerate(self._local_logical) if lg == expert]

    def local_stack(self, tensor: torch.Tensor) -> torch.Tensor:
        """A stacked checkpoint tensor [E, ...] -> this rank's slots [L, ...]."""
        if self.placement is None:
            return tensor
        if tensor.shape[0] != self.num_experts:
            raise ValueError(f"stacked expert tensor has {tensor.shape[0]} experts, expected {self.num_experts}")
        return tensor[torch.tensor(self._local_logical, device=tensor.device)]

    def _tp_shard(self, kind: str, tensor: torch.Tensor) -> torch.Tensor:
        """The TP rank's part of a full-size checkpoint tensor (intermediate dim split)."""
        i, r = self.intermediate_size, self.tp_rank
        full = self.full_intermediate_size
        if kind in ("gate", "up", "gate_bias", "up_bias"):
            return tensor.narrow(0, r * i, i) if tensor.shape[0] == full else tensor
        if kind == "down":
            return tensor.narrow(1, r * i, i) if tensor.dim() == 2 and tensor.shape[1] == full else tensor
        if kind in ("w13", "w13_bias"):
            if tensor.dim() < 2 or tensor.shape[1] != 2 * full:
                return tensor
            return torch.cat((tensor.narrow(1, r * i, i), tensor.narrow(1, full + r * i, i)), dim=1)
        if kind == "w2":
            return tensor.narrow(2, r * i, i) if tensor.dim() == 3 and tensor.shape[2] == full else tensor
        if kind in ("down_bias", "w2_bias"):
            return tensor if r == 0 else torch.zeros_like(tensor)  # added once, before the all-reduce
        return tensor

    def _slot(self, kind: str, expert: int | None) -> tuple[str, list[torch.Tensor], list[tuple[int, int]]]:
        """(parameter name, destination views, units they fill) for a checkpoint tensor."""
        i = self.intermediate_size
        per_expert = {
            "gate": ("w13_weight", slice(0, i), 0),
            "up": ("w13_weight", slice(i, 2 * i), 1),
            "down": ("w2_weight", slice(None), 0),
            "gate_bias": ("w13_bias", slice(0, i), 0),
            "up_bias": ("w13_bias", slice(i, 2 * i), 1),
            "down_bias": ("w2_bias", slice(None), 0),
        }
        stacked = {"w13": "w13_weight", "w2": "w2_weight", "w13_bias": "w13_bias", "w2_bias": "w2_bias"}
        if kind in per_expert:
            name, rows, half = per_expert[kind]
            param = getattr(self, name)
            if param is None:
                raise ValueError(f"checkpoint has expert {kind} but the layer has no {name}")
            if expert is None or not 0 <= expert < self.num_experts:
                raise ValueError(f"expert index {expert} out of range 0..{self.num_experts - 1}")
            slots = self.local_slots(expert)
            return name, [param.data[s, rows] for s in slots], [(s, half) for s in slots]
        if kind in stacked:
            name = stacked[kind]
            param = getattr(self, name)
            if param is None:
                raise ValueError(f"checkpoint has expert {kind} but the layer has no {name}")
            halves = (0, 1) if kind.startswith("w13") else (0,)
            return name, [param.data], [(e, h) for e in range(self.num_local_experts) for h in halves]
        raise ValueError(f"unknown expert tensor kind {kind!r}")

    def load_expert_weight(self, kind: str, tensor: torch.Tensor, expert: int | None = None) -> list[str]:
        """Copy a checkpoint tensor into the stacked weights; returns the parameters (names
        relative to this module) that are complete after it.

        Per expert (``expert`` = e, the logical id): "gate", "up" [I, H], "down" [H, I], "gate_bias",
        "up_bias" [I], "down_bias" [H]. All experts at once: "w13" [E, 2I, H] (gate rows then up
        rows), "w2" [E, H, I], "w13_bias" [E, 2I], "w2_bias" [E, H]. Full-size tensors: under EP an
        expert this rank does not hold is skipped (copied to every local replica otherwise), under
        TP each rank takes its intermediate slice. A wrong shape is a ValueError.
        """
        name, dsts, units = self._slot(kind, expert)
        if self.tp_sharded:
            tensor = self._tp_shard(kind, tensor)
        if expert is None and kind in ("w13", "w2", "w13_bias", "w2_bias"):
            tensor = self.local_stack(tensor)
        for dst in dsts:
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(f"expert tensor {kind} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
            dst.copy_(tensor)
        done = self._loaded.setdefault(name, set())
        if len(done) == self._units(name):
            return []  # already reported complete (a tensor given twice)
        done.update(units)
        return [name] if len(done) == self._units(name) else []

    def _units(self, name: str) -> int:
        return self.num_local_experts * (2 if name.startswith("w13") else 1)


# Per-expert checkpoint projections -> FusedMoE tensor kinds (Qwen/DeepSeek and Mixtral names).
EXPERT_PROJECTIONS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up",
                      "w2": "down"}
_QUANT_SUFFIXES = ("weight_scale_inv", "weight_scale_2", "weight_scale", "weight_packed", "weight_shape",
                   "weight_zero_point", "input_scale")
_PER_EXPERT = re.compile(r"^(?P<mod>.+)\.experts\.(?P<e>\d+)\.(?P<proj>\w+)\.(?P<what>weight|bias|"
                         + "|".join(_QUANT_SUFFIXES) + r")$")
_STACKED = re.compile(r"^(?P<mod>.+)\.experts\.(?P<proj>gate_up_proj|down_proj)(?P<bias>_bias)?$")


def load_moe_tensor(model: nn.Module, module: str, kind: str, tensor: torch.Tensor,
                    expert: int | None = None, suffix: str = "weight") -> list[str] | None:
    """Load into the FusedMoE at ``module`` (None when there is none: the tensor is not ours);
    returns the completed parameters' full names. With quantized experts the tensor goes to
    ``quant_experts.load_expert(kind, suffix, tensor, expert)`` (kind "gate"/"up"/"down"/"gate_up"/"w13"/"w2";
    the quantized module reports its own missing tensors)."""
    try:
        moe = model.get_submodule(module)
    except AttributeError:
        return None
    if not isinstance(moe, ExpertLoading):
        return None
    if moe.quant_experts is not None:
        if kind.endswith("_bias"):
            kind, suffix = kind.removesuffix("_bias"), "bias"
        if expert is None:  # stacked [E, ...]: this rank's slots under EP
            moe.quant_experts.load_expert(kind, suffix, moe.local_stack(tensor), None)
        else:
            if not 0 <= expert < moe.num_experts:
                raise ValueError(f"{module}: expert index {expert} out of range 0..{moe.num_experts - 1}")
            for slot in moe.local_slots(expert):  # none: another EP rank's expert
                moe.quant_experts.load_expert(kind, suffix, tensor, slot)
        return []
    if suffix != "weight":
        raise ValueError(f"{module}: expert tensor {kind}.{suffix} is quantized but the layer's experts are not")
    return [f"{module}.{n}" for n in moe.load_expert_weight(kind, tensor, expert)]


def load_expert_checkpoint_tensor(model: nn.Module, name: str, tensor: torch.Tensor) -> list[str] | None:
    """The ``load_checkpoint_tensor`` hook for Hugging Face MoE checkpoints: per-expert tensors
    ``{moe}.experts.{e}.{gate_proj|up_proj|down_proj|w1|w3|w2}.{weight|bias}``, or stacked
    ``{moe}.experts.gate_up_proj`` [E, 2I, H] / ``{moe}.experts.down_proj`` [E, H, I] (+ ``_bias``),
    transformers v5's layout. None for every other tensor."""
    m = _PER_EXPERT.match(name)
    if m is not None and m["proj"] in EXPERT_PROJECTIONS:
        kind = EXPERT_PROJECTIONS[m["proj"]] + ("_bias" if m["what"] == "bias" else "")
        suffix = m["what"] if m["what"] not in ("weight", "bias") else "weight"
        return load_moe_tensor(model, m["mod"], kind, tensor, int(m["e"]), suffix)
    m = _STACKED.match(name)
    if m is not None:
        kind = ("w13" if m["proj"] == "gate_up_proj" else "w2") + ("_bias" if m["bias"] else "")
        return load_moe_tensor(model, m["mod"], kind, tensor)
    return None
