"""What the block manager's state machines share (test_block_manager.py, test_block_manager_invariants.py):
the live sequences and the rules that grow and free them, and the bookkeeping checks: who holds which
block, against the manager's own counts."""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from tokenfab.engine.requests.block_manager import BlockManager
from tokenfab.engine.requests.sampling_params import SamplingParams
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


class LiveSequences(RuleBasedStateMachine):
    """A block manager and the ``live`` sequences holding blocks in it. Subclasses admit sequences and
    record what scheduling tokens writes (``_compute``); this frees one at random (a rule) and all at
    the end, checking that every block came back."""

    def __init__(self, bm: BlockManager) -> None:
        super().__init__()
        self.bm = bm
        self.live: list[Sequence] = []
        self.n = 0  # sequences admitted so far (their names)

    def _compute(self, seq: Sequence, n: int) -> bool:
        """Schedule ``n`` more tokens of ``seq``; False when its blocks do not fit."""
        raise NotImplementedError

    def _check_hit(self, seq: Sequence, hit: int) -> None:
        """What the ``hit`` tokens the prefix cache gave ``seq`` must hold."""
        raise NotImplementedError

    def _admit(self, toks: list[int], salt: str | None = None) -> None:
        """A new sequence takes what the prefix cache has and computes the rest; kept if it fits."""
        seq = Sequence(f"s{self.n}", None, list(toks), SamplingParams(), 0, cache_salt=salt)
        self.n += 1
        hit = self.bm.allocate_cached_prefix(seq)
        self._check_hit(seq, hit)
        if self._compute(seq, len(toks) - hit):
            self.live.append(seq)
        else:
            self.bm.free(seq)

    def _admit_sharing(self, i: int, cut: int, extra: list[int]) -> None:
        """A new sequence: up to ``cut`` tokens of a live one (its salt too), then ``extra``."""
        parent = self.live[i % len(self.live)]
        self._admit(parent.token_ids[: min(cut, parent.num_tokens)] + extra, parent.cache_salt)

    def _grow(self, i: int, extra: list[int]) -> None:
        """A live sequence gets ``extra`` tokens and schedules them; preempted (freed) if they do not fit."""
        seq = self.live[i % len(self.live)]
        seq.token_ids += extra
        if not self._compute(seq, len(extra)):
            self.bm.free(seq)
            self.live.remove(seq)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99))
    def free(self, i: int) -> None:
        self.bm.free(self.live.pop(i % len(self.live)))

    def teardown(self) -> None:
        free_all(self.bm, self.live)
