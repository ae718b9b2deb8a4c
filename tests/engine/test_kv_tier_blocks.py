"""The block manager's hook to a KV connector (engine/kv_transfer/connector.py): evicted blocks saved before
anything overwrites them, a prefix hit continued from the connector, a failed load cut where the chain breaks,
no sharing across cache salts or LoRA adapters. A state machine drives a fake connector over simulated KV
contents: every block a sequence is handed, local or loaded, must hold exactly its prefix's tokens."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Seq

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule

from tests.engine.test_block_manager import BLOCK, BlockManagerMachine
from tokenfab.engine.kv_transfer.connector import KVConnector
from tokenfab.engine.requests.block_manager import BlockManager
from tokenfab.engine.requests.lora_request import LoRARequest
from tokenfab.engine.requests.sampling_params import SamplingParams
from tokenfab.engine.requests.sequence import Sequence


class FakeConnector(KVConnector):
    """Holds copies of simulated block contents (``content``: block -> slot tokens), at most ``capacity``,
    least recently used dropped; ``fail`` digests are lost between lookup and load."""

    def __init__(self, content: dict[int, list], capacity: int = 10**9) -> None:
        self.content = content
        self.capacity = capacity
        self.held: OrderedDict[bytes, list] = OrderedDict()
        self.fail: set[bytes] = set()
        self.saved: list[bytes] = []
        self.loads = 0

    def lookup(self, digests: Seq[bytes]) -> int:
        n = 0
        while n < len(digests) and digests[n] in self.held:
            self.held.move_to_end(digests[n])
            n += 1
        return n

    def load(self, digests: Seq[bytes], block_ids: Seq[int]) -> int:
        for i, (d, b) in enumerate(zip(digests, block_ids)):
            if d in self.fail or d not in self.held:
                return i
            self.content[b] = list(self.held[d])
            self.loads += 1
        return len(digests)

    def save(self, digests: Seq[bytes], block_ids: Seq[int]) -> None:
        for d, b in zip(digests, block_ids):
            slots = self.content[b]
            assert None not in slots, "a saved block must be full"
            self.held[d] = list(slots)
            self.saved.append(d)
            while len(self.held) > self.capacity:
                self.held.popitem(last=False)

    def clear(self) -> None:
        self.held.clear()


class TierMachine(BlockManagerMachine):
    """The block manager's state machine (rules, simulated KV) with a fake connector behind the manager."""

    def __init__(self) -> None:
        super().__init__()
        self.bm.connector = FakeConnector(self.content, capacity=20)

    @precondition(lambda self: self.bm.connector.held)
    @rule(i=st.integers(0, 100))
    def lose_one(self, i):
        """A held block goes missing (a corrupt file): its load fails, the rest of the chain is computed."""
        held = list(self.bm.connector.held)
        self.bm.connector.fail.add(held[i % len(held)])

    @invariant()
    def nothing_left_unsaved(self):
        assert not self.bm._evicted  # every eviction handed to the connector within its call


TierMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestTierMachine = TierMachine.TestCase


def _seq(name: str, toks: list[int], salt: str | None = None, lora: int = 0) -> Sequence:
    seq = Sequence(name, None, list(toks), SamplingParams(), 0, cache_salt=salt)
    if lora:
        seq.lora_request = LoRARequest(f"a{lora}", lora, "/nonexistent")
    return seq


def _run(bm: BlockManager, content: dict, seq: Sequence) -> int:
    """Admit and compute seq whole, then free it; returns the tokens it was handed (local + connector)."""
    hit = bm.allocate_cached_prefix(seq)
    assert bm.allocate(seq, seq.num_tokens - hit)
    for pos in range(hit, seq.num_tokens):
        content.setdefault(seq.block_table[pos // BLOCK], [None] * BLOCK)[pos % BLOCK] = seq.token_ids[pos]
    seq.num_computed_tokens = seq.num_tokens
    bm.commit_full_blocks(seq)
    bm.free(seq)
    return hit


def _evicting_manager() -> tuple[BlockManager, dict, FakeConnector]:
    bm = BlockManager(num_blocks=4, block_size=BLOCK)
    content: dict = {}
    bm.connector = FakeConnector(content)
    return bm, content, bm.connector


def test_evicted_blocks_come_back_from_the_connector_and_count():
    bm, content, conn = _evicting_manager()
    prompt = list(range(1, 14))  # 3 full blocks + 1 token
    assert _run(bm, content, _seq("a", prompt)) == 0
    assert _run(bm, content, _seq("b", [50] * 16)) == 0  # 4 blocks: every cached block evicted, saved first
    assert len(conn.saved) == 3 and not bm.cached.keys() & set(conn.saved)
    assert _run(bm, content, _seq("c", prompt)) == 12  # all three from the connector
    assert conn.loads == 3
    assert bm.connector_hits == 12 and bm.prefix_hits == 0
    assert bm.connector_queries == 12 + 12 + 12  # each admission asked about its full blocks past the local hit
    bm.check_invariants()


def test_a_failed_load_cuts_the_chain_and_gives_the_blocks_back():
    bm, content, conn = _evicting_manager()
    prompt = list(range(1, 14))
    _run(bm, content, _seq("a", prompt))
    _run(bm, content, _seq("b", [50] * 16))
    conn.fail.add(conn.saved[1])  # a's second block (saved in the order the free queue evicted them)
    seq = _seq("c", prompt)
    hit = bm.allocate_cached_prefix(seq)
    order = [d for d in seq.block_hashes[:3]]
    cut = order.index(conn.saved[1])
    assert hit == cut * BLOCK and len(seq.block_table) == cut
    assert bm.num_free_blocks == bm.num_blocks - cut
    bm.free(seq)
    bm.check_invariants()


def test_no_block_is_shared_across_salts_or_adapters():
    bm, content, conn = _evicting_manager()
    prompt = list(range(1, 14))
    _run(bm, content, _seq("a", prompt, salt="alice"))
    _run(bm, content, _seq("f", [50] * 16))  # evict a's blocks into the connector
    assert _run(bm, content, _seq("b", prompt, salt="bob")) == 0
    assert _run(bm, content, _seq("c", prompt)) == 0
    assert _run(bm, content, _seq("d", prompt, salt="alice", lora=7)) == 0
    _run(bm, content, _seq("f2", [51] * 16))
    assert _run(bm, content, _seq("e", prompt, salt="alice")) == 12


def test_reset_prefix_cache_clears_the_connector():
    bm, content, conn = _evicting_manager()
    prompt = list(range(1, 14))
    _run(bm, content, _seq("a", prompt))
    _run(bm, content, _seq("b", [50] * 16))
    assert conn.held
    bm.reset_prefix_cache()
    assert not conn.held and _run(bm, content, _seq("c", prompt)) == 0
