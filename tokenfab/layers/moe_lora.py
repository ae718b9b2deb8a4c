"""Multi-LoRA on MoE experts: one adapter pool per MoE layer, and the experts' forward that adds each
token's own adapter deltas to the gate, up and down outputs of the experts it is routed to
(``kernels.moe_lora``).

``attach_moe_lora`` gives every ``FusedMoE`` of a model whose experts can take LoRA an
``MoELoRAExperts``: per projection ("gate", "up": H -> I; "down": I -> H) A [E, max_loras, max_rank, in]
and B [E, max_loras, out, max_rank] (expert-major: one expert's slots are contiguous), zeros in unused
slots, ranks and projections. The layer's ``experts`` method becomes base-or-LoRA: with no adapter in
the step (the shared ``LoRABatchState``'s ``token_slots`` is None) it is the plain ``fused_experts``
call, unchanged; otherwise one ``fused_experts_lora`` call serves the adapters' tokens and the base's
together. The layer keeps its type, weights, router and shared experts (those take LoRA as ordinary
projections, ``layers.lora``).

Not every MoE layer can: quantized experts (their product is another kernel's), expert parallelism
(tokens leave the rank), TP-split experts, a subclass with its own experts (DeepSeek-V4's hash routing), and
GPT-OSS's clamped SwiGLU (its checkpoints interleave gate and up columns, a layout PEFT's adapters follow
and this pool does not) are left without a pool,
with the reason recorded so an adapter targeting them is refused by name.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenfab.kernels import moe_lora as moe_lora_kernels
from tokenfab.kernels._dispatch import eager_op
from tokenfab.layers.lora import LoRABatchState
from tokenfab.layers.moe import FusedMoE

PROJECTIONS = ("gate", "up", "down")
fused_experts_lora = eager_op(moe_lora_kernels.fused_experts_lora, moe_lora_kernels.fused_experts_lora_ref,
                              moe_lora_kernels.fused_experts_lora_cpu)


def moe_lora_refusal(module: FusedMoE) -> str | None:
    """Why this MoE layer's experts cannot take LoRA, or None when they can."""
    if type(module).experts is not FusedMoE.experts:
        return f"{type(module).__name__}'s own experts"
    if module.quant_experts is not None:
        return "quantized experts"
    if module.ep_size > 1:
        return "expert parallelism"
    if module.tp_sharded:
        return "tensor-parallel experts"
    if module.activation != "silu":
        return f"{module.activation} experts (GPT-OSS's interleaved gate/up layout)"
    return None


class MoELoRAExperts:
    """The adapter pool of one MoE layer's experts, and its LoRA-aware ``experts``."""

    def __init__(self, module: FusedMoE, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device,
                 state: LoRABatchState) -> None:
        self.module, self.state = module, state
        self.base_experts = module.experts
        e, h, i = module.num_local_experts, module.hidden_size, module.intermediate_size
        self.shape = (e, h, i)
        dims = {"gate": (h, i), "up": (h, i), "down": (i, h)}
        self.a = {p: torch.zeros(e, max_loras, max_rank, k, dtype=dtype, device=device) for p, (k, _) in dims.items()}
        self.b = {p: torch.zeros(e, max_loras, n, max_rank, dtype=dtype, device=device) for p, (_, n) in dims.items()}

    def set_slot(self, slot: int, projections: dict[str, tuple[torch.Tensor, torch.Tensor]] | None) -> None:
        """Write an adapter's expert factors (per projection: A [E, r, in], B*scale [E, out, r]) into
        ``slot``; None or a missing projection: zeros."""
        for p in PROJECTIONS:
            self.a[p][:, slot].zero_()
            self.b[p][:, slot].zero_()
            pair = (projections or {}).get(p)
            if pair is not None:
                r = pair[0].shape[1]
                self.a[p][:, slot, :r].copy_(pair[0])
                self.b[p][:, slot, :, :r].copy_(pair[1])

    def experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        slots = self.state.token_slots
        if slots is None:
            return self.base_experts(x, weights, ids)
        m = self.module
        return fused_experts_lora(x, m.w13_weight, m.w2_weight, weights, ids, slots, self.a["gate"], self.b["gate"],
                                  self.a["up"], self.b["up"], self.a["down"], self.b["down"], m.w13_bias, m.w2_bias,
                                  m.activation, m.swiglu_alpha, m.swiglu_limit)


def attach_moe_lora(model: nn.Module, state: LoRABatchState, max_loras: int, max_rank: int, dtype: torch.dtype,
                    device: torch.device) -> tuple[dict[str, MoELoRAExperts], dict[str, str]]:
    """Pools for every MoE layer of ``model`` that can take LoRA, by module path, and the reasons of those
    that cannot."""
    pools: dict[str, MoELoRAExperts] = {}
    refused: dict[str, str] = {}
    for path, module in model.named_modules():
        if not isinstance(module, FusedMoE):
            continue
        reason = moe_lora_refusal(module)
        if reason is not None:
            refused[path] = reason
            continue
        pool = MoELoRAExperts(module, max_loras, max_rank, dtype, device, state)
        module.experts = pool.experts  # the module keeps its type and weights; its experts add the deltas
        pools[path] = pool
    return pools, refused


def moe_lora_targets(pools: dict[str, MoELoRAExperts], refused: dict[str, str]) -> dict[str, Any]:
    """The MoE part of the engine's LoRA targets, as plain data: ``moe``, module path -> [E, H, I];
    ``moe_refused``, module path -> why its experts take no LoRA."""
    return {"moe": {path: list(pool.shape) for path, pool in pools.items()}, "moe_refused": dict(refused)}
