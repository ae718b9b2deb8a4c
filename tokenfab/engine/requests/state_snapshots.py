"""Prefix caching for hybrid models: recurrent-state snapshots at block boundaries, keyed by block digest.

A prefix-cache hit skips computing the cached tokens, which is enough for attention (its state is the
cached K/V) but not for a recurrent layer, whose state after the prefix no block holds. So the engine keeps
snapshots: the state of every recurrent layer after exactly ``k * block_size`` tokens of a sequence, copied
out of its slot and keyed by the chained digest of its k-th block (``block_manager.hash_block``: the digest
fixes every token of the prefix, the LoRA adapter and the cache salt, so a snapshot never goes stale). A hit
is cut back to the longest run of cached blocks whose last block has a snapshot, and that snapshot is copied
into the new sequence's slot before its first chunk runs.

A step ends on a block boundary only if its chunk does, so for these models prefill chunks are cut at block
boundaries (``align_chunk``): every chunk but the last ends on one, the last full block of a prompt ends a
chunk of its own, and so does the end of a cached prefix that had no snapshot (where this prompt parts from
an earlier one: a shared system prompt), so the next prompt that shares it hits. The copy is made when the
sequence's next chunk is prepared (the slot then holds exactly the state after the boundary); decodes reach
a boundary every ``block_size`` tokens the same way.

This class is the host-side index: ``capacity`` snapshot rows, least recently used reused first. The device
tensors and the copies belong to the model runner (``runner/state_cache.py``).
"""

from __future__ import annotations

from collections import OrderedDict


class StateSnapshots:
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"state snapshots need at least one row, got {capacity}")
        self.capacity = capacity
        self._rows: OrderedDict[bytes, int] = OrderedDict()  # digest -> row, least recently used first
        self._free = list(range(capacity - 1, -1, -1))
        self.saved = 0  # snapshots taken
        self.restored = 0  # snapshots handed to a sequence on a prefix hit

    def __len__(self) -> int:
        return len(self._rows)

    def lookup(self, digest: bytes) -> int | None:
        """The row holding the state after the block with this digest (now most recently used), or None."""
        row = self._rows.get(digest)
        if row is not None:
            self._rows.move_to_end(digest)
        return row

    def reserve(self, digest: bytes) -> int | None:
        """A row to save the state after this block into (the least recently used one when full), or None
        when this digest already has one."""
        if digest in self._rows:
            self._rows.move_to_end(digest)
            return None
        if self._free:
            row = self._free.pop()
        else:
            _, row = self._rows.popitem(last=False)
        self._rows[digest] = row
        self.saved += 1
        return row

    def clear(self) -> None:
        self._rows.clear()
        self._free = list(range(self.capacity - 1, -1, -1))

    @staticmethod
    def align_chunk(start: int, n: int, num_tokens: int, block_size: int, cut_at: int = 0) -> int:
        """The chunk length to schedule instead of ``n`` for a sequence with ``start`` computed tokens out
        of ``num_tokens``: a chunk that crosses ``cut_at`` (the end of a cached prefix that had no snapshot)
        stops there; a chunk that stops short of the last token ends on a block boundary when it crosses
        one; a chunk that reaches the last token first stops at the last boundary before it (its snapshot
        serves the longest hit a repeat of this prompt can have). Never below 1."""
        end = start + n
        if start < cut_at < end:
            return cut_at - start
        if end >= num_tokens:
            last = (num_tokens - 1) // block_size * block_size
            if start < last < end:
                end = last
        else:
            aligned = end // block_size * block_size
            if aligned > start:
                end = aligned
        return end - start
