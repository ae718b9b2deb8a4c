"""The mixture-of-experts layer: router, stacked expert weights, optional shared experts.

    weights, ids = route(x Wr^T (+ br))                     softmax top-k, or grouped (DeepSeek)
    out = sum_j weights_j * E_{ids_j}(x)  (+ shared(x), gated by sigmoid(x Wg^T) if asked)

The experts' weights are stacked so one kernel launch serves all of them:
``w13_weight`` [E, 2I, H] (each expert's gate rows, then its up rows), ``w2_weight`` [E, H, I],
optional biases ``w13_bias`` [E, 2I] and ``w2_bias`` [E, H]. Checkpoints store experts one by
one (``experts.{e}.gate_proj.weight``...) or stacked; ``load_expert_weight`` copies either
into place and ``load_expert_checkpoint_tensor`` maps the common Hugging Face names to it.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from tokenfab.kernels import silu_and_mul
from tokenfab.kernels.moe import ACTIVATIONS, fused_experts, grouped_topk, topk_softmax
from tokenfab.layers.linear import Linear, MergedLinear


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)): a dense SwiGLU MLP (shared experts, dense layers)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        # tensor parallel at TP > 1: gate/up column-, down row-parallel (its all-reduce gives every rank the sum)
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size, intermediate_size], bias=bias,
                                         parallel="column")
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias, parallel="row")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class FusedMoE(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        *,
        renormalize: bool = True,
        scoring: str = "softmax",
        num_expert_groups: int = 1,
        topk_groups: int = 1,
        routed_scaling_factor: float = 1.0,
        correction_bias: bool = False,
        router_bias: bool = False,
        expert_bias: bool = False,
        activation: str = "silu",
        swiglu_alpha: float = 1.702,
        swiglu_limit: float = 7.0,
        shared_experts: nn.Module | None = None,
        shared_expert_gate: bool = False,
    ) -> None:
        """``scoring`` "softmax" with one group and no correction bias routes by softmax top-k
        (``renormalize``: the k weights sum to 1); anything else by ``grouped_topk``.
        ``activation``: "silu" (silu(g) * u) or "swiglu_oai" (GPT-OSS, with alpha and limit)."""
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, not {activation!r}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in 1..{num_experts}, got {top_k}")
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_experts, self.top_k = num_experts, top_k
        self.renormalize, self.scoring = renormalize, scoring
        self.num_expert_groups, self.topk_groups = num_expert_groups, topk_groups
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.activation, self.swiglu_alpha, self.swiglu_limit = activation, float(swiglu_alpha), float(swiglu_limit)
        self.gate = Linear(hidden_size, num_experts, bias=router_bias)
        e, i, h = num_experts, intermediate_size, hidden_size
        self.w13_weight = nn.Parameter(torch.empty(e, 2 * i, h), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(e, h, i), requires_grad=False)
        self.w13_bias = nn.Parameter(torch.empty(e, 2 * i), requires_grad=False) if expert_bias else None
        self.w2_bias = nn.Parameter(torch.empty(e, h), requires_grad=False) if expert_bias else None
        self.e_score_correction_bias = (
            nn.Parameter(torch.empty(e, dtype=torch.float32), requires_grad=False) if correction_bias else None
        )
        self.shared_experts = shared_experts
        self.shared_expert_gate = Linear(hidden_size, 1) if shared_expert_gate else None
        self._loaded: dict[str, set] = {}
        # quantized experts (tokenfab/quant): when set, they replace the stacked weights' product and
        # take the checkpoint's expert tensors (load_expert(kind, suffix, tensor, expert))
        self.quant_experts: nn.Module | None = None

    def set_quant_experts(self, experts: nn.Module) -> None:
        """Hand the experts' product and weights to a quantized module; the plain stacked weights go."""
        self.quant_experts = experts
        for name in ("w13_weight", "w2_weight", "w13_bias", "w2_bias"):
            setattr(self, name, None)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] fp32, expert ids [T, k] int32)."""
        logits = self.gate(x)
        if self.scoring == "softmax" and self.num_expert_groups == 1 and self.e_score_correction_bias is None:
            w, ids = topk_softmax(logits, self.top_k, self.renormalize)
            if self.routed_scaling_factor != 1.0:
                w = w * self.routed_scaling_factor
            return w, ids
        return grouped_topk(
            logits, self.e_score_correction_bias, self.top_k, self.num_expert_groups, self.topk_groups,
            self.renormalize, self.routed_scaling_factor, self.scoring,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        if self.quant_experts is not None:
            out = self.quant_experts(x, weights, ids)
        else:
            out = fused_experts(
                x, self.w13_weight, self.w2_weight, weights, ids, self.w13_bias, self.w2_bias, self.activation,
                self.swiglu_alpha, self.swiglu_limit,
            )
        if self.shared_experts is not None:
            shared = self.shared_experts(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out

    # ------------------------------------------------------------------ loading

    def _slot(self, kind: str, expert: int | None) -> tuple[str, torch.Tensor, list[tuple[int, int]]]:
        """(parameter name, destination view, units it fills) for a checkpoint tensor."""
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
            return name, param.data[expert, rows], [(expert, half)]
        if kind in stacked:
            name = stacked[kind]
            param = getattr(self, name)
            if param is None:
                raise ValueError(f"checkpoint has expert {kind} but the layer has no {name}")
            halves = (0, 1) if kind.startswith("w13") else (0,)
            return name, param.data, [(e, h) for e in range(self.num_experts) for h in halves]
        raise ValueError(f"unknown expert tensor kind {kind!r}")

    def load_expert_weight(self, kind: str, tensor: torch.Tensor, expert: int | None = None) -> list[str]:
        """Copy a checkpoint tensor into the stacked weights; returns the parameters (names
        relative to this module) that are complete after it.

        Per expert (``expert`` = e): "gate", "up" [I, H], "down" [H, I], "gate_bias", "up_bias"
        [I], "down_bias" [H]. All experts at once: "w13" [E, 2I, H] (gate rows then up rows),
        "w2" [E, H, I], "w13_bias" [E, 2I], "w2_bias" [E, H]. A wrong shape is a ValueError.
        """
        name, dst, units = self._slot(kind, expert)
        if tuple(dst.shape) != tuple(tensor.shape):
            raise ValueError(f"expert tensor {kind} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
        dst.copy_(tensor)
        done = self._loaded.setdefault(name, set())
        if len(done) == self._units(name):
            return []  # already reported complete (a tensor given twice)
        done.update(units)
        return [name] if len(done) == self._units(name) else []

    def _units(self, name: str) -> int:
        return self.num_experts * (2 if name.startswith("w13") else 1)


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
    if not isinstance(moe, FusedMoE):
        return None
    if moe.quant_experts is not None:
        if kind.endswith("_bias"):
            kind, suffix = kind.removesuffix("_bias"), "bias"
        moe.quant_experts.load_expert(kind, suffix, tensor, expert)
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
