"""Property-based test of the block manager: random allocate / append / fork-by-prefix /
free / evict sequences keep reference counts, the free list and cached contents right."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tests.engine.block_holders import check_holders, free_all
from tokenfab.engine.requests.block_manager import BlockManager
from tokenfab.engine.requests.sampling_params import SamplingParams
from tokenfab.engine.requests.sequence import Sequence

BLOCK = 4
tokens = st.lists(st.integers(0, 3), min_size=1, max_size=14)  # small alphabet: many shared prefixes


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(num_blocks=12, block_size=BLOCK)
        self.live: list[Sequence] = []
        self.content: dict[int, list[int]] = {}  # what each block's slots hold (the "KV")
        self.n = 0

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

    def _admit(self, toks: list[int]) -> None:
        seq = Sequence(f"s{self.n}", None, toks, SamplingParams(), 0)
        self.n += 1
        hit = self.bm.allocate_cached_prefix(seq)
        # every cached block handed out holds exactly this prefix's tokens
        for pos in range(hit):
            assert self.content[seq.block_table[pos // BLOCK]][pos % BLOCK] == toks[pos]
        assert hit < len(toks)
        if self._compute(seq, len(toks) - hit):
            self.live.append(seq)
        else:
            self.bm.free(seq)

    @rule(toks=tokens)
    def allocate(self, toks):
        self._admit(toks)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100), extra=tokens)
    def append(self, i, extra):
        seq = self.live[i % len(self.live)]
        seq.token_ids += extra
        if not self._compute(seq, len(extra)):
            self.bm.free(seq)  # preempted
            self.live.remove(seq)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100), cut=st.integers(1, 20), extra=tokens)
    def fork_by_prefix(self, i, cut, extra):
        parent = self.live[i % len(self.live)]
        self._admit(parent.token_ids[: min(cut, parent.num_tokens)] + extra)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100))
    def free(self, i):
        self.bm.free(self.live.pop(i % len(self.live)))

    @rule(n=st.integers(1, 12))
    def evict_by_pressure(self, n):
        """A request that needs n fresh blocks forces eviction of cached free blocks."""
        self._admit([9] * (n * BLOCK - 1) + [8])

    @invariant()
    def bookkeeping(self):
        check_holders(self.bm, self.live)

    def teardown(self):
        free_all(self.bm, self.live)


BlockManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestBlockManager = BlockManagerMachine.TestCase
