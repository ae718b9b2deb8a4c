"""Multi-LoRA on the linear layers: one pool of adapter weights per projection, and a forward that
adds each token's own adapter delta to the base output (``kernels.lora``).

``attach_lora`` gives every LoRA-capable projection of a model (attention qkv/o, MLP gate_up/down)
a ``LoRAProjection``: per shard of the (merged) output, A [max_loras, max_rank, in] and
B [max_loras, shard_out, max_rank], zeros in unused slots and ranks. The projection's ``forward``
becomes base-then-delta; the module itself (its type, its weights, packed or quantized) is left as
it is. All projections share one ``LoRABatchState``: the step's per-token slot index, set by the
engine for a step that carries an adapter and None otherwise, when the forward is the base one
with a single attribute check and no LoRA work.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenfab.kernels import lora as lora_kernels
from tokenfab.kernels._dispatch import eager_op

LORA_TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
lora_delta = eager_op(lora_kernels.lora_delta, lora_kernels.lora_delta_ref, lora_kernels.lora_delta_cpu)


class LoRABatchState:
    """The step's adapters, shared by every projection of a model."""

    def __init__(self) -> None:
        #: [T] int32 on the model's device: the pool slot of each token's adapter (-1: base), or None
        #: when no token of the step has an adapter
        self.token_slots: torch.Tensor | None = None


class LoRAProjection:
    """The adapter pool of one projection, and its LoRA-aware forward."""

    def __init__(self, module: nn.Module, shard_sizes: list[int], max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device, state: LoRABatchState) -> None:
        self.base_forward = module.forward
        self.state = state
        self.in_features = int(module.in_features)
        self.ranges = []
        start = 0
        for n in shard_sizes:
            self.ranges.append((start, start + n))
            start += n
        self.a = [torch.zeros(max_loras, max_rank, self.in_features, dtype=dtype, device=device) for _ in shard_sizes]
        self.b = [torch.zeros(max_loras, n, max_rank, dtype=dtype, device=device) for n in shard_sizes]

    def set_slot(self, slot: int, shards: dict[int, tuple[torch.Tensor, torch.Tensor]] | None) -> None:
        """Write an adapter's weights of this projection into ``slot`` (None or a missing shard: zeros)."""
        for i, (a, b) in enumerate(zip(self.a, self.b)):
            a[slot].zero_()
            b[slot].zero_()
            pair = (shards or {}).get(i)
            if pair is not None:
                r = pair[0].shape[0]
                a[slot, :r].copy_(pair[0])
                b[slot, :, :r].copy_(pair[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_forward(x)
        slots = self.state.token_slots
        if slots is None:
            return y
        x2 = x.reshape(-1, self.in_features)
        y2 = y.view(-1, y.shape[-1])
        for (lo, hi), a, b in zip(self.ranges, self.a, self.b):
            y2[:, lo:hi] += lora_delta(x2, slots, a, b)
        return y


def attach_lora(model: nn.Module, shard_sizes_of, max_loras: int, max_rank: int, dtype: torch.dtype,
                device: torch.device) -> tuple[LoRABatchState, dict[str, LoRAProjection]]:
    """Give every LoRA-capable projection of ``model`` an adapter pool; returns the shared state and
    the pools by module path. ``shard_sizes_of(model, path)``: the output rows of each shard."""
    state = LoRABatchState()
    pools: dict[str, LoRAProjection] = {}
    for path, module in model.named_modules():
        if path.rpartition(".")[2] not in LORA_TARGETS or not hasattr(module, "in_features"):
            continue
        if getattr(module, "tp_split", None) is not None or getattr(module, "reduce_output", False):
            raise ValueError("LoRA serving does not support tensor-parallel layers yet")
        pool = LoRAProjection(module, shard_sizes_of(model, path), max_loras, max_rank, dtype, device, state)
        module.forward = pool.forward  # the module keeps its type and weights; its forward adds the delta
        pools[path] = pool
    if not pools:
        raise ValueError(f"this model has no projection LoRA can serve ({', '.join(LORA_TARGETS)})")
    model.lora_state = state
    return state, pools
