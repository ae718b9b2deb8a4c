"""The host staging memory of a prefill/decode transfer: slots of one KV block's bytes each.

The transport registers one ``uint8`` tensor ``[num_slots, block_nbytes]`` (rows in ``block_io.BlockIO``'s
layout) and moves rows between two instances' buffers. A slot is, at any time, exactly one of:

- free;
- pinned until a deadline: a producer's staged block waiting for its consumer to read it (released early by the
  consumer's "read done" notice), or a consumer's slot that a read is filling;
- held under a digest (consumer): a block that arrived and waits for the scheduler's ``lookup``/``load``; the
  least recently held is given up first when slots run short.

Nothing here talks to the network; ``pd_connector.py`` drives it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence

import torch


class StagingSlots:
    def __init__(self, num_slots: int, block_nbytes: int) -> None:
        if num_slots < 1:
            raise ValueError(f"the KV transfer buffer holds no block: {num_slots} slots of {block_nbytes} bytes "
                             "(raise kv_buffer_size)")
        self.buffer = torch.empty(num_slots, block_nbytes, dtype=torch.uint8)
        self.num_slots = num_slots
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() gives the lowest first
        self._pins: dict[int, float] = {}  # slot -> monotonic deadline
        self._held: OrderedDict[bytes, int] = OrderedDict()  # digest -> slot, least recently used first
        self._unsafe: list[int] = []  # slots a failed read may still write into: never handed out again

    # ---- bookkeeping --------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_pinned(self) -> int:
        return len(self._pins)

    @property
    def num_held(self) -> int:
        return len(self._held)

    def _expire(self, now: float) -> None:
        for slot in [s for s, deadline in self._pins.items() if deadline <= now]:
            del self._pins[slot]
            self._free.append(slot)

    def take(self, n: int, pin_seconds: float, evict_held: bool = False) -> list[int] | None:
        """``n`` slots pinned for ``pin_seconds`` (expired pins are freed first; ``evict_held``: then the least
        recently held digests are given up); None, nothing taken, when there are not enough."""
        now = time.monotonic()
        if len(self._free) < n:
            self._expire(now)
        while evict_held and len(self._free) < n and self._held:
            _, slot = self._held.popitem(last=False)
            self._free.append(slot)
        if len(self._free) < n:
            return None
        slots = sorted(self._free.pop() for _ in range(n))  # ascending: usually one run (pd_connector.load)
        for s in slots:
            self._pins[s] = now + pin_seconds
        return slots

    def release(self, slots: Sequence[int]) -> None:
        """Unpin ``slots`` (a read finished, or failed): they are free again. Slots not pinned are left alone."""
        for s in slots:
            if self._pins.pop(s, None) is not None:
                self._free.append(s)

    # ---- consumer: blocks held by digest ---------------------------------------------------------------
    def hold(self, digests: Sequence[bytes], slots: Sequence[int]) -> None:
        """Pinned ``slots`` now hold ``digests`` (a read into them finished)."""
        for d, s in zip(digests, slots, strict=True):
            if self._pins.pop(s, None) is None:
                raise ValueError(f"slot {s} was not taken for a read")
            old = self._held.pop(d, None)
            if old is not None:
                self._free.append(old)
            self._held[d] = s

    def lookup(self, digests: Sequence[bytes]) -> int:
        """How many leading ``digests`` are held (they count as recently used)."""
        n = 0
        for d in digests:
            if d not in self._held:
                break
            self._held.move_to_end(d)
            n += 1
        return n

    def pop(self, digests: Sequence[bytes]) -> list[int]:
        """The slots of the leading held ``digests``, no longer held: the caller copies them out, then calls
        ``free``."""
        out = []
        for d in digests:
            s = self._held.pop(d, None)
            if s is None:
                break
            out.append(s)
        return out

    def free(self, slots: Sequence[int]) -> None:
        self._free.extend(slots)

    def retire(self, slots: Sequence[int]) -> None:
        """Pinned slots of a read that failed while its transfer may still be writing: out of use for good."""
        for s in slots:
            self._pins.pop(s, None)
        self._unsafe.extend(slots)

    @property
    def num_retired(self) -> int:
        return len(self._unsafe)

    def clear(self) -> None:
        """Forget every held digest (pins stay: reads in flight still own their slots)."""
        self._free.extend(self._held.values())
        self._held.clear()

    def check_invariants(self) -> None:
        every = self._free + list(self._pins) + list(self._held.values()) + self._unsafe
        assert sorted(every) == list(range(self.num_slots)), "a slot is lost or in two states"
