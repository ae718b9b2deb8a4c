"""Property-based test of the block manager: random allocate / append / fork-by-prefix /
free / evict sequences keep reference counts, the free list and cached contents right."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule

from tests.engine.block_holders import LiveSequences, check_holders
from tokenfab.engine.requests.block_manager import BlockManager
from tokenfab.engine.requests.sequence import Sequence

BLOCK = 4
tokens = st.lists(st.integers(0, 3), min_size=1, max_size=14)  # small alphabet: many shared prefixes


class BlockManagerMachine(LiveSequences):
    def __init__(self) -> None:
        super().__init__(BlockManager(num_blocks=12, block_size=BLOCK))
        self.content: dict[int, list[int]] = {}  # what each block's slots hold (the "KV")

    def _compute(self, seq: Sequence, n: int) -> bool:
        """Schedule n more tokens of seq like the scheduler does, 'writing' their KV."""
        if not self.bm.allocate(seq, n):
            return False
        for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
            block = seq.block_table[pos // BLOCK]
            slots = self.content.setdefault(block, [None] * BLOCK)
            slots[pos % BLOCK] = seq.token_ids[pos]
        seq.num_computed_tokens += n
        self.bm.commit_full_blocks(seq)
        return True

    def _check_hit(self, seq: Sequence, hit: int) -> None:
        # every cached block handed out holds exactly this prefix's tokens
        for pos in range(hit):
            assert self.content[seq.block_table[pos // BLOCK]][pos % BLOCK] == seq.token_ids[pos]
        assert hit < seq.num_tokens

    @rule(toks=tokens)
    def allocate(self, toks):
        self._admit(toks)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100), extra=tokens)
    def append(self, i, extra):
        self._grow(i, extra)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100), cut=st.integers(1, 20), extra=tokens)
    def fork_by_prefix(self, i, cut, extra):
        self._admit_sharing(i, cut, extra)

    @rule(n=st.integers(1, 12))
    def evict_by_pressure(self, n):
        """A request that needs n fresh blocks forces eviction of cached free blocks."""
        self._admit([9] * (n * BLOCK - 1) + [8])

    @invariant()
    def bookkeeping(self):
        check_holders(self.bm, self.live)

BlockManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestBlockManager = BlockManagerMachine.TestCase
