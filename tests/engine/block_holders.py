"""The bookkeeping checks shared by the block manager's state machines (test_block_manager.py,
test_block_manager_invariants.py): who holds which block, against the manager's own counts."""

from __future__ import annotations

from tokenfab.engine.requests.block_manager import BlockManager
from tokenfab.engine.requests.sequence import Sequence


def check_holders(bm: BlockManager, live: list[Sequence]) -> dict[int, list[tuple[Sequence, int]]]:
    """The manager's own invariants; no table holds a block twice, each block's reference count is its
    number of holders, free + held = all blocks. Returns each held block's (sequence, position)s."""
    bm.check_invariants()
    holders: dict[int, list[tuple[Sequence, int]]] = {}
    for seq in live:
        assert len(set(seq.block_table)) == len(seq.block_table)
        for j, b in enumerate(seq.block_table):
            holders.setdefault(b, []).append((seq, j))
    for b in range(bm.num_blocks):
        assert bm.ref_counts[b] == len(holders.get(b, []))
    assert bm.num_free_blocks + len(holders) == bm.num_blocks
    return holders


def free_all(bm: BlockManager, live: list[Sequence]) -> None:
    """Frees every live sequence: nothing stays referenced, every block is free again."""
    for seq in live:
        bm.free(seq)
    assert all(r == 0 for r in bm.ref_counts)
    assert bm.num_free_blocks == bm.num_blocks
