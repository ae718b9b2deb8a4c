"""Per-sequence recurrent-state slots (hybrid cache): the fixed-size state of linear-attention layers.

Models whose layers keep a recurrent state per sequence (Qwen3.5 / Qwen3-Next Gated DeltaNet: a conv
state and an SSM state) need one row of every state tensor per running sequence, whatever its length.
The runner allocates those tensors with ``num_slots`` rows (``runner/state_cache.py``); this allocator
hands the row indices out. It belongs to the block manager (``BlockManager.state_slots``), so one
manager gives a sequence its KV blocks and its slot together and takes both back together: a sequence
gets a slot the first time blocks are allocated for it, keeps it while it runs (across its prefill
chunks), and loses it on finish or preemption (``BlockManager.free``).

A slot's contents are never cleared here: a layer zeroes (or ignores) a slot's state when the
sequence's chunk starts at position 0, which is also what a preempted sequence does when it is
recomputed (``ForwardBatch.state_slots``).
"""

from __future__ import annotations

import heapq

from tokenfab.engine.requests.sequence import Sequence


class StateSlots:
    """A free list of ``num_slots`` slot indices; the lowest free index first (deterministic)."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"a recurrent-state cache needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._free: list[int] = list(range(num_slots))  # a min-heap: the lowest free slot first
        self._owner: list[str | None] = [None] * num_slots  # request id holding each slot (checks only)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def needs_slot(self, seq: Sequence) -> bool:
        return seq.state_slot < 0

    def can_allocate(self, seq: Sequence) -> bool:
        """Whether seq has a slot or one is free for it."""
        return seq.state_slot >= 0 or bool(self._free)

    def allocate(self, seq: Sequence) -> bool:
        """Give seq a slot if it has none; False (nothing changed) when none is free."""
        if seq.state_slot >= 0:
            return True
        if not self._free:
            return False
        slot = heapq.heappop(self._free)
        self._owner[slot] = seq.request_id
        seq.state_slot = slot
        return True

    def free(self, seq: Sequence) -> None:
        """Take seq's slot back (no-op without one)."""
        slot = seq.state_slot
        if slot < 0:
            return
        owner = self._owner[slot]
        assert owner == seq.request_id, f"slot {slot} freed by {seq.request_id}, held by {owner}"
        self._owner[slot] = None
        heapq.heappush(self._free, slot)
        seq.state_slot = -1

    def check_invariants(self) -> None:
        """Every slot is either free or owned, never both (tests and debugging)."""
        free = set(self._free)
        assert len(free) == len(self._free), "a slot is free twice"
        for slot, owner in enumerate(self._owner):
            assert (slot in free) == (owner is None), f"slot {slot}: free={slot in free}, owner={owner}"
