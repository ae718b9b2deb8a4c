"""Multi-LoRA in the engine: which adapters are loaded (host LRU), which sit in the model's device
slots (LRU too), and each step's per-token slot index.

- ``admit(lora_request)`` (when a request arrives): reads the adapter into host memory if it is not
  there (``loader.lora_adapter``; a bad path, a bad file or a rank above ``max_lora_rank`` is a
  ValueError, so the request is refused before it is queued). At most ``max_cpu_loras`` adapters
  stay in host memory, least recently used dropped first; a dropped one is read again when a
  request needs it.
- ``limit_batch(batch)``: a step holds at most ``max_loras`` distinct adapters (the device slots);
  sequences of further adapters wait for a later step (their blocks stay allocated: the scheduler's
  allocation is idempotent).
- ``execute``: copies the step's adapters into device slots (least recently used slot first, never
  one this step uses), sets the per-token slot index and runs the Python layers' forward (not the
  C-driven packed-GGUF step, not a CUDA graph: both know nothing of adapters). A step without any
  adapter runs exactly as without LoRA.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
from torch import nn

from tokenfab.engine.requests.lora_request import LoRARequest
from tokenfab.engine.requests.scheduler import ScheduledBatch
from tokenfab.engine.requests.sequence import Sequence
from tokenfab.forward_batch import ForwardBatch
from tokenfab.kernels.batch_invariant import batch_invariant_mode
from tokenfab.layers.lora import LORA_TARGETS, attach_lora
from tokenfab.layers.moe_lora import attach_moe_lora, moe_lora_targets
from tokenfab.loader.lora_adapter import LoRAWeights, load_lora_weights, lora_targets_of, shard_sizes_of
from tokenfab.models.llama import CausalLM


class LoRAManager:
    def __init__(self, model: nn.Module, device: torch.device, dtype: torch.dtype, max_loras: int,
                 max_lora_rank: int, max_cpu_loras: int | None) -> None:
        if not isinstance(model, CausalLM):
            raise ValueError(f"LoRA serving supports the Llama family of models, not {type(model).__name__}")
        if max_loras < 1 or max_lora_rank < 1:
            raise ValueError("--max-loras and --max-lora-rank must be at least 1")
        max_cpu_loras = max_loras if max_cpu_loras is None else max_cpu_loras
        if max_cpu_loras < max_loras:
            raise ValueError(f"--max-cpu-loras ({max_cpu_loras}) must be at least --max-loras ({max_loras})")
        self.model, self.device, self.dtype = model, device, dtype
        self.max_loras, self.max_lora_rank, self.max_cpu_loras = max_loras, max_lora_rank, max_cpu_loras
        self.state, self.pools = attach_lora(model, shard_sizes_of, max_loras, max_lora_rank, dtype, device)
        # MoE experts (layers.moe_lora): pools on the layers that can take LoRA, the others' reasons
        self.moe_pools, moe_refused = attach_moe_lora(model, self.state, max_loras, max_lora_rank, dtype, device)
        #: what adapters may target, as plain data (an API server checks adapter files against it)
        self.targets = {**lora_targets_of(model, LORA_TARGETS), **moe_lora_targets(self.moe_pools, moe_refused)}
        self.host: OrderedDict[int, tuple[LoRARequest, LoRAWeights]] = OrderedDict()  # LRU, newest last
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> device slot, LRU newest last
        self.num_loads = 0  # adapters read from disk (tests: LRU eviction reloads)

    # ---- host memory ----------------------------------------------------------------
    def admit(self, req: LoRARequest) -> LoRAWeights:
        """The adapter's weights in host memory (read now if needed); ValueError if unusable."""
        held = self.host.get(req.lora_int_id)
        if held is not None:
            if held[0].lora_path != req.lora_path:
                raise ValueError(f"LoRA id {req.lora_int_id} is already loaded from another path")
            self.host.move_to_end(req.lora_int_id)
            return held[1]
        try:
            weights = load_lora_weights(req.lora_path, self.targets, self.dtype, self.max_lora_rank)
        except FileNotFoundError as e:
            raise ValueError(f"lora_path: {e}") from None
        self.num_loads += 1
        self.host[req.lora_int_id] = (req, weights)
        while len(self.host) > self.max_cpu_loras:
            old, _ = self.host.popitem(last=False)
            self._drop_slot(old)
        return weights

    def remove(self, lora_int_id: int) -> None:
        """Forget an adapter (unloaded by its name): host copy and device slot."""
        self.host.pop(lora_int_id, None)
        self._drop_slot(lora_int_id)

    def loaded_ids(self) -> list[int]:
        return list(self.host)

    # ---- scheduling -----------------------------------------------------------------
    #: the adapters (lora_int_id) of the latest step: a running sequence of another adapter is held back (stats)
    last_step_ids: frozenset[int] = frozenset()

    def limit_batch(self, batch: ScheduledBatch) -> None:
        """Keep at most ``max_loras`` distinct adapters in the step; the others' sequences wait."""
        keep: set[int] = set()
        for seq in batch.seqs:
            lid = _lora_id(seq)
            if lid and lid not in keep and len(keep) < self.max_loras:
                keep.add(lid)
        for i in reversed(range(len(batch.seqs))):
            lid = _lora_id(batch.seqs[i])
            if lid and lid not in keep:
                batch.remove(i)
        self.last_step_ids = frozenset(keep)

    # ---- the step -------------------------------------------------------------------
    def token_slots(self, seqs: list[Sequence], counts: list[int]) -> list[int] | None:
        """Per token of the flat batch, its adapter's device slot (-1: base); None without adapters."""
        if not any(_lora_id(s) for s in seqs):
            return None
        ids = {_lora_id(s) for s in seqs} - {0}
        if len(ids) > self.max_loras:
            raise ValueError(f"a step holds {len(ids)} adapters, more than --max-loras {self.max_loras}")
        slots: list[int] = []
        for seq, n in zip(seqs, counts):
            lid = _lora_id(seq)
            slots += [self._slot(seq.lora_request, ids) if lid else -1] * n
        return slots

    def _slot(self, req: LoRARequest, in_step: set[int]) -> int:
        lid = req.lora_int_id
        slot = self.slot_of.get(lid)
        if slot is not None:
            self.slot_of.move_to_end(lid)
            return slot
        weights = self.admit(req)  # (read again if it left host memory)
        used = set(self.slot_of.values())
        free = [s for s in range(self.max_loras) if s not in used]
        if free:
            slot = free[0]
        else:
            victim = next(v for v in self.slot_of if v not in in_step)
            slot = self.slot_of.pop(victim)
        for path, pool in self.pools.items():
            pool.set_slot(slot, weights.modules.get(path))
        for path, moe_pool in self.moe_pools.items():
            moe_pool.set_slot(slot, weights.moe.get(path))
        self.slot_of[lid] = slot
        return slot

    def _drop_slot(self, lora_int_id: int) -> None:
        self.slot_of.pop(lora_int_id, None)

    def execute(self, runner: Any, fb: ForwardBatch, seqs: list[Sequence], counts: list[int],
                plain: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step's forward: ``plain(fb, seqs, counts)`` without adapters, else the Python layers'
        forward with the per-token slots set."""
        slots = self.token_slots(seqs, counts)
        if slots is None:
            return plain(fb, seqs, counts)
        self.state.token_slots = torch.tensor(slots, dtype=torch.int32).to(self.device, non_blocking=True)
        try:
            with torch.inference_mode(), batch_invariant_mode(runner.batch_invariant):
                hidden = CausalLM.forward(self.model, fb)  # the Python layers (never the C-driven step)
                logits = self.model.compute_logits(hidden.index_select(0, fb.logits_indices))
                prompt = None if fb.prompt_indices is None else hidden.index_select(0, fb.prompt_indices)
        finally:
            self.state.token_slots = None
        return logits, prompt


def _lora_id(seq: Sequence) -> int:
    req = seq.lora_request
    return 0 if req is None else req.lora_int_id


def lora_manager_for(args: Any, model: nn.Module, device: torch.device, dtype: torch.dtype) -> LoRAManager | None:
    """The engine's manager under ``--enable-lora`` (None without it); ValueError for the options it
    cannot combine with yet."""
    if not args.enable_lora:
        return None
    for flag, on in (("--speculative-config", args.speculative_config is not None),
                     ("--async-scheduling", args.async_scheduling),
                     ("--tensor-parallel-size > 1", args.tensor_parallel_size != 1),
                     ("--data-parallel-size > 1", args.data_parallel_size != 1)):
        if on:
            raise ValueError(f"--enable-lora cannot be combined with {flag} yet")
    return LoRAManager(model, device, dtype, args.max_loras, args.max_lora_rank, args.max_cpu_loras)
