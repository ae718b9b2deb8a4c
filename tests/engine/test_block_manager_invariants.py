"""The block manager's promises: reference counts equal the holders, free + used = total, a block
is shared only by requests with the same (salt, token prefix) up to it, prefix-cache hits only on
equal prefixes, and unreferenced cached blocks are evicted least recently freed first (LRU).

A hypothesis state machine drives random admissions, growth, frees and eviction pressure, and
holds every state to a plain model of who holds which block with which tokens; the LRU order
is pinned by small scenarios written out step by step.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule

from tests.engine.block_holders import LiveSequences, check_holders
from tokenfab.engine.requests.block_manager import BlockManager
from tokenfab.engine.requests.sampling_params import SamplingParams
from tokenfab.engine.requests.sequence import Sequence

BS = 4
tokens = st.lists(st.integers(0, 2), min_size=1, max_size=13)  # tiny alphabet: many equal prefixes
salts = st.sampled_from([None, None, "alice", "bob"])


def _seq(toks: list[int], salt: str | None = None, name: str = "s") -> Sequence:
    return Sequence(name, None, list(toks), SamplingParams(), 0, cache_salt=salt)


class Machine(LiveSequences):
    def __init__(self) -> None:
        super().__init__(BlockManager(num_blocks=10, block_size=BS))
        self.written: dict[int, tuple] = {}  # block -> (salt, the whole token prefix up to its end)
        self.computed: set[tuple] = set()  # every (salt, full-block prefix) ever computed

    def _compute(self, seq: Sequence, n: int) -> bool:
        if not self.bm.allocate(seq, n):
            return False
        seq.num_computed_tokens += n
        for j in range(seq.num_computed_tokens // BS):
            key = (seq.cache_salt, tuple(seq.token_ids[: (j + 1) * BS]))
            self.computed.add(key)
            self.written[seq.block_table[j]] = key
        self.bm.commit_full_blocks(seq)
        return True

    def _check_hit(self, seq: Sequence, hit: int) -> None:
        toks = seq.token_ids
        assert hit % BS == 0 and hit < len(toks) and len(seq.block_table) == hit // BS
        for j in range(hit // BS):
            key = (seq.cache_salt, tuple(toks[: (j + 1) * BS]))
            assert key in self.computed  # a hit only on a prefix (and salt) once computed...
            assert self.written[seq.block_table[j]] == key  # ...and the block still holds it

    @rule(toks=tokens, salt=salts)
    def admit(self, toks, salt):
        self._admit(toks, salt)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99), cut=st.integers(1, 16), extra=tokens)
    def admit_sharing_a_prefix(self, i, cut, extra):
        self._admit_sharing(i, cut, extra)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99), extra=tokens)
    def grow(self, i, extra):
        self._grow(i, extra)

    @rule(n=st.integers(1, 10))
    def pressure(self, n):
        self._admit([5] * (n * BS - 1) + [6], None)  # fresh tokens: n blocks from the free queue

    @invariant()
    def holders_and_counts(self):
        holders = check_holders(self.bm, self.live)
        for seq in self.live:
            assert len(seq.block_table) * BS >= seq.num_computed_tokens
        assert self.bm.num_used_blocks == len(holders)
        # a block in two tables: the same position, and the same salt and tokens up to its end
        for hs in holders.values():
            if len(hs) > 1:
                (s0, j0) = hs[0]
                for s, j in hs[1:]:
                    assert j == j0 and s.cache_salt == s0.cache_salt
                    assert s.token_ids[: (j + 1) * BS] == s0.token_ids[: (j + 1) * BS]

Machine.TestCase.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)
TestBlockManagerInvariants = Machine.TestCase


# ---- LRU eviction, step by step ----------------------------------------------------------------

A = [1, 1, 1, 1, 2, 2, 2, 2, 3]  # two full blocks and one token
B = [4, 4, 4, 4, 5, 5, 5, 5, 6]


def _run(bm: BlockManager, toks: list[int], salt=None) -> Sequence:
    """Admit and compute a whole prompt (taking what the cache has); returns the sequence."""
    seq = _seq(toks, salt)
    hit = bm.allocate_cached_prefix(seq)
    assert bm.allocate(seq, len(toks) - hit)
    seq.num_computed_tokens = len(toks)
    bm.commit_full_blocks(seq)
    return seq


def _hit(bm: BlockManager, toks: list[int], salt=None) -> int:
    """How many tokens of toks the cache serves (the probe's references are dropped again)."""
    seq = _seq(toks, salt)
    hit = bm.allocate_cached_prefix(seq)
    bm.free(seq)
    return hit


def test_least_recently_freed_cached_blocks_are_evicted_first():
    bm = BlockManager(num_blocks=6, block_size=BS)
    bm.free(_run(bm, A))  # A's 3 blocks freed first, its tail before its full blocks...
    bm.free(_run(bm, B))  # ...then B's (B took the 3 never-used blocks: A's cache survived)
    hold = [_run(bm, [7, 8, 9])]  # 1 fresh block: the least recently freed is A's (uncached) tail
    hold.append(_run(bm, [9, 8, 7]))  # the next one: A's second block, whose cache entry goes
    assert _hit(bm, A) == 4 and _hit(bm, B) == 8
    for s in hold:
        bm.free(s)
    bm.check_invariants()


def test_a_hit_makes_a_block_recently_used():
    bm = BlockManager(num_blocks=6, block_size=BS)
    bm.free(_run(bm, A))
    bm.free(_run(bm, B))
    bm.free(_run(bm, A[:8] + [0]))  # A's prefix taken again and freed: now newer than B's blocks
    hold = [_run(bm, [7, 7, 7]), _run(bm, [8, 8, 8]), _run(bm, [9, 9, 9])]  # 3 fresh blocks
    assert _hit(bm, A) == 8 and _hit(bm, B) == 0
    for s in hold:
        bm.free(s)


def test_referenced_cached_blocks_are_never_evicted():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = _run(bm, A)  # holds 3 blocks
    big = _seq(list(range(10, 18)))  # needs 2
    assert not bm.can_allocate(big, 8) and not bm.allocate(big, 8)
    assert big.block_table == [] and bm.num_free_blocks == 1
    assert _hit(bm, A) == 8  # a sharer may take them: they are still cached
    bm.free(a)
    assert bm.allocate(big, 8)


def test_hits_only_on_equal_chained_prefixes_and_equal_salts():
    bm = BlockManager(num_blocks=20, block_size=BS)
    bm.free(_run(bm, A))
    assert _hit(bm, A[:8] + [9, 9]) == 8
    assert _hit(bm, A[:4] + [0, 0, 0, 0, 0]) == 4  # the second block differs
    assert _hit(bm, [0, 0, 0, 0] + A[4:]) == 0  # the second block is equal, its prefix is not
    assert _hit(bm, A[:4]) == 0  # at least one token is left to compute (for the logits)
    assert _hit(bm, A, salt="x") == 0  # a salted request never shares an unsalted block
    bm.free(_run(bm, A, salt="x"))
    assert _hit(bm, A, salt="x") == 8 and _hit(bm, A, salt="y") == 0


def test_prefix_caching_off_never_hits():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    bm.free(_run(bm, A))
    assert _hit(bm, A) == 0


def test_prefix_counters_and_usage():
    bm = BlockManager(num_blocks=8, block_size=BS)
    assert (bm.prefix_queries, bm.prefix_hits, bm.usage()) == (0, 0, 0.0)
    a = _run(bm, A)
    assert (bm.prefix_queries, bm.prefix_hits) == (9, 0)
    assert bm.usage() == 3 / 8 and bm.num_used_blocks == 3
    _hit(bm, A[:8] + [0, 0, 0])
    assert (bm.prefix_queries, bm.prefix_hits) == (9 + 11, 8)
    bm.free(a)
    assert bm.usage() == 0.0


def test_cache_of_one_block_works_and_zero_is_refused():
    with pytest.raises(ValueError, match="at least one block"):
        BlockManager(num_blocks=0, block_size=BS)
    bm = BlockManager(num_blocks=1, block_size=BS)
    s = _run(bm, [1, 2, 3])
    assert s.block_table == [0] and bm.num_free_blocks == 0
