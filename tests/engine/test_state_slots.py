"""The hybrid cache's state-slot allocator and its place in the block manager (issue 29): a slot comes with a
sequence's first blocks, stays across its chunks, goes back with its blocks; no slot, no admission."""

from __future__ import annotations

import argparse

import pytest

from tokenfab.engine.args import EngineArgs
from tokenfab.engine.requests.block_manager import BlockManager
from tokenfab.engine.requests.sampling_params import SamplingParams
from tokenfab.engine.requests.sequence import Sequence
from tokenfab.engine.requests.state_slots import StateSlots
from tokenfab.engine.requests.state_snapshots import StateSnapshots


def seq(i: int, n: int = 20) -> Sequence:
    return Sequence(f"s{i}", None, list(range(1, n + 1)), SamplingParams(max_tokens=4), 0)


def test_lowest_free_slot_first_and_back():
    slots = StateSlots(3)
    a, b, c = seq(0), seq(1), seq(2)
    assert all(slots.allocate(s) for s in (a, b, c))
    assert [a.state_slot, b.state_slot, c.state_slot] == [0, 1, 2]
    assert not slots.allocate(seq(3)) and slots.num_free == 0
    slots.free(b)
    assert b.state_slot == -1 and slots.num_free == 1
    d = seq(4)
    assert slots.allocate(d) and d.state_slot == 1
    assert slots.allocate(d) and d.state_slot == 1  # already has one: unchanged
    slots.check_invariants()


def test_free_is_checked():
    slots = StateSlots(2)
    a = seq(0)
    slots.allocate(a)
    impostor = seq(1)
    impostor.state_slot = a.state_slot
    with pytest.raises(AssertionError):
        slots.free(impostor)
    slots.free(a)
    slots.free(a)  # no slot any more: a no-op
    slots.check_invariants()
    with pytest.raises(ValueError):
        StateSlots(0)


def test_block_manager_hands_out_slot_and_blocks_together():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False, state_slots=StateSlots(2))
    a, b, c = seq(0), seq(1), seq(2)
    assert bm.allocate(a, 8) and bm.allocate(b, 8)
    assert (a.state_slot, b.state_slot) == (0, 1) and bm.num_free_blocks == 4
    # blocks are free but no slot: nothing is taken
    assert not bm.can_allocate(c, 4) and not bm.allocate(c, 4)
    assert c.state_slot == -1 and c.block_table == [] and bm.num_free_blocks == 4
    # the next chunk of a running sequence keeps its slot
    a.num_computed_tokens = 8
    assert bm.allocate(a, 8) and a.state_slot == 0 and len(a.block_table) == 4
    # blocks short: nothing is taken either (a new sequence gets no slot)
    bm.free(b)
    assert bm.num_free_blocks == 4 - 2 + 2 and bm.state_slots.num_free == 1
    assert not bm.allocate(c, 40) and c.state_slot == -1 and bm.state_slots.num_free == 1
    assert bm.allocate(c, 4) and c.state_slot == 1
    bm.free(a)  # finish or preemption: blocks and slot back
    bm.free(c)
    assert a.state_slot == c.state_slot == -1 and bm.state_slots.num_free == 2 and bm.num_free_blocks == 8
    bm.check_invariants()


def test_without_state_slots_nothing_changes():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq(0)
    assert bm.allocate(a, 8) and a.state_slot == -1
    bm.free(a)
    bm.check_invariants()


def test_num_state_slots_flag():
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser, with_model=False)
    args = EngineArgs.from_cli_args(parser.parse_args(["--num-state-slots", "6"]))
    assert args.num_state_slots == 6
    assert EngineArgs.from_cli_args(parser.parse_args([])).num_state_slots is None
    with pytest.raises(ValueError, match="num_state_slots"):
        EngineArgs(num_state_slots=0)


def test_snapshot_index_lru():
    snaps = StateSnapshots(2)
    assert snaps.reserve(b"a") == 0 and snaps.reserve(b"b") == 1
    assert snaps.reserve(b"a") is None  # already saved (and now most recently used)
    assert snaps.reserve(b"c") == 1  # "b" was the least recently used
    assert snaps.lookup(b"b") is None and snaps.lookup(b"a") == 0 and snaps.lookup(b"c") == 1
    assert snaps.reserve(b"d") == 0  # "a" was looked up before "c": "a" is older
    snaps.clear()
    assert len(snaps) == 0 and snaps.lookup(b"c") is None and snaps.reserve(b"e") == 0


@pytest.mark.parametrize("start,n,num_tokens,want", [
    (0, 24, 53, 16),  # stops short of the end: cut to the boundary it crosses
    (0, 10, 53, 10),  # crosses none: unchanged
    (16, 37, 53, 32),  # reaches the end: first stops at the last boundary before the last token (48)
    (48, 5, 53, 5),  # the tail
    (0, 48, 48, 32),  # 48 tokens: the last boundary before token 47 is 32
    (0, 10, 10, 10),  # under one block: nothing to align
    (52, 1, 53, 1),  # a decode
])
def test_align_chunk(start, n, num_tokens, want):
    assert StateSnapshots.align_chunk(start, n, num_tokens, 16) == want


def test_align_chunk_stops_at_the_end_of_an_unsnapshotted_prefix():
    assert StateSnapshots.align_chunk(0, 70, 70, 16, cut_at=48) == 48
    assert StateSnapshots.align_chunk(16, 54, 70, 16, cut_at=48) == 32
    assert StateSnapshots.align_chunk(48, 22, 70, 16, cut_at=48) == 16  # past it: the usual rule (last block)
