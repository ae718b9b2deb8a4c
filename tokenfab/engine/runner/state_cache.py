"""The recurrent-state half of the hybrid cache: per-sequence state tensors bound to the layers that keep them.

A module that keeps state per sequence (a Gated DeltaNet layer: a conv state and an SSM state) declares
``recurrent_state_spec() -> {name: (shape, dtype)}``. For each (module, name) the runner allocates one
tensor [num_slots + 1, *shape] of that dtype on the device and binds it with ``setattr(module, name, t)``;
row ``s`` is the state of the sequence holding slot ``s`` (``ForwardBatch.state_slots``, handed out by
``requests/state_slots.py``). The extra last row is a scratch slot: CUDA-graph padding rows of a decode
batch point at it, so they never write a real sequence's state. The paged KV cache of the model's
attention layers is allocated beside it as before (a model may have both).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tokenfab.engine.requests.sequence import Sequence
from tokenfab.engine.requests.state_snapshots import StateSnapshots

StateSpec = dict[str, tuple[tuple[int, ...], torch.dtype]]


def recurrent_state_layers(model: nn.Module) -> list[nn.Module]:
    """Modules that declare ``recurrent_state_spec()``, in module order."""
    return [m for m in model.modules() if callable(getattr(m, "recurrent_state_spec", None))]


def has_recurrent_state(model: nn.Module) -> bool:
    return bool(recurrent_state_layers(model))


def state_bytes_per_slot(model: nn.Module) -> int:
    """Bytes one sequence's recurrent state takes across all layers (0 without recurrent layers)."""
    total = 0
    for m in recurrent_state_layers(model):
        spec: StateSpec = m.recurrent_state_spec()
        total += sum(math.prod(shape) * dtype.itemsize for shape, dtype in spec.values())
    return total


def state_cache_bytes(model: nn.Module, num_slots: int) -> int:
    """Device bytes of the state tensors for ``num_slots`` slots (the scratch row included)."""
    per_slot = state_bytes_per_slot(model)
    return per_slot * (num_slots + 1) if per_slot else 0


def bind_state_caches(model: nn.Module, num_slots: int, device: torch.device) -> dict[tuple[str, str], torch.Tensor]:
    """Allocate (zeroed) and bind the state tensors; returns them by (module path, state name)."""
    names = {id(m): path for path, m in model.named_modules()}
    caches: dict[tuple[str, str], torch.Tensor] = {}
    for m in recurrent_state_layers(model):
        spec: StateSpec = m.recurrent_state_spec()
        for name, (shape, dtype) in spec.items():
            t = torch.zeros(num_slots + 1, *shape, dtype=dtype, device=device)
            setattr(m, name, t)
            caches[(names[id(m)], name)] = t
    return caches


def num_state_slots_for(model: nn.Module, num_state_slots: int | None, max_num_seqs: int,
                        tensor_parallel_size: int, speculative: int) -> int:
    """The state slots an engine allocates for ``model``: 0 without recurrent state, else
    ``num_state_slots`` (default ``max_num_seqs``). Refuses what the hybrid cache does not support yet:
    tensor parallelism (the workers would need the same slots bound) and speculative decoding over
    recurrent layers that cannot be tapped and replayed (a rejected draft token would stay folded into
    their state; Gated DeltaNet layers can: ``speculative/state_rollback.py``)."""
    if not has_recurrent_state(model):
        return 0
    if tensor_parallel_size != 1:
        raise ValueError("models with recurrent-state layers (hybrid cache) run with tensor_parallel_size 1 only")
    layers = recurrent_state_layers(model)
    if speculative and not all(hasattr(m, "input_tap") or hasattr(m, "reserve_speculative_rows") for m in layers):
        raise ValueError("speculative decoding is not supported for this model's recurrent-state layers: a "
                         "rejected draft token cannot be taken back out of their state (only Gated DeltaNet "
                         "layers are replayed after a rejection)")
    for m in layers if speculative else ():  # positional state (DeepSeek-V4's rings): room for the drafts' rows
        if hasattr(m, "reserve_speculative_rows"):
            m.reserve_speculative_rows(int(speculative))
    return num_state_slots or max_num_seqs


class SnapshotRows:
    """Hybrid prefix caching's device side: one tensor [capacity, *shape] beside each state tensor, and the
    copies between slots and rows before each forward (the index is ``requests/state_snapshots.py``)."""

    def __init__(self, index: StateSnapshots, state_caches: dict[tuple[str, str], torch.Tensor]) -> None:
        self.index = index
        self.state_caches = state_caches
        self.caches = {key: t.new_zeros(index.capacity, *t.shape[1:]) for key, t in state_caches.items()}

    def before_forward(self, seqs: list[Sequence], block_size: int) -> None:
        """Restore the snapshot of each sequence starting on a prefix hit into its slot; save the slot of
        each sequence whose computed tokens end on a block boundary (it holds exactly that state)."""
        restores: list[tuple[int, int]] = []
        saves: dict[int, int] = {}  # row -> slot: a row reserved twice in one step (tiny capacity) keeps the last
        for seq in seqs:
            start = seq.num_computed_tokens
            if seq.state_restore_row >= 0:
                restores.append((seq.state_restore_row, seq.state_slot))
                seq.state_restore_row = -1
            elif start and start % block_size == 0 and len(seq.block_hashes) >= start // block_size:
                row = self.index.reserve(seq.block_hashes[start // block_size - 1])
                if row is not None:
                    saves[row] = seq.state_slot
        copy_state_rows(self.state_caches, self.caches, restores, [(slot, row) for row, slot in saves.items()])


def copy_state_rows(state_caches: dict[tuple[str, str], torch.Tensor],
                    snapshot_caches: dict[tuple[str, str], torch.Tensor],
                    restores: list[tuple[int, int]], saves: list[tuple[int, int]]) -> None:
    """Before a forward: ``restores`` (snapshot row, slot) into the slots of sequences that start on a
    prefix hit, then ``saves`` (slot, snapshot row) out of the slots of sequences sitting on a block
    boundary. Restores first: a save may reuse a row a restore of the same step reads."""
    if not restores and not saves:
        return
    device = next(iter(state_caches.values())).device
    pairs = []
    for src_is_slot, ops in ((False, restores), (True, saves)):
        if ops:
            src = torch.tensor([a for a, _ in ops], dtype=torch.long).to(device, non_blocking=True)
            dst = torch.tensor([b for _, b in ops], dtype=torch.long).to(device, non_blocking=True)
            pairs.append((src_is_slot, src, dst))
    for key, states in state_caches.items():
        snaps = snapshot_caches[key]
        for src_is_slot, src, dst in pairs:
            if src_is_slot:
                snaps.index_copy_(0, dst, states.index_select(0, src))
            else:
                states.index_copy_(0, dst, snaps.index_select(0, src))
