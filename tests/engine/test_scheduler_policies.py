"""The scheduler's policies, step by step, on a real BlockManager with the model left out.

The promises (scheduler.py and the README): decodes first, then prompt chunks, within a token
budget (chunked prefill); at most max_num_seqs running; admission in (priority, arrival) order,
FCFS among equals; when a block is short, the lowest-priority request, newest among equals, is
preempted and re-queued with its tokens; a step that preempted admits nobody.
"""

from __future__ import annotations

import pytest

from tokenfab.engine.requests.block_manager import BlockManager
from tokenfab.engine.requests.sampling_params import SamplingParams
from tokenfab.engine.requests.scheduler import Scheduler
from tokenfab.engine.requests.sequence import Sequence, SequenceStatus

BS = 4  # block size
SAMPLED = 7  # the token "the model" appends


def make(num_blocks: int = 64, max_num_seqs: int = 8, budget: int = 1000, block_size: int = BS) -> Scheduler:
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
    return Scheduler(bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)


def req(i: int, prompt_len: int, priority: int = 0) -> Sequence:
    prompt = [1 + (i * 37 + j) % 300 for j in range(prompt_len)]
    return Sequence(f"r{i}", None, prompt, SamplingParams(), 0, priority=priority, arrival_index=i)


def step(s: Scheduler) -> dict[str, int]:
    """One engine step without a model: computes what was scheduled, appends a token to every
    sequence whose known tokens are all computed; returns {request id: tokens scheduled}."""
    batch = s.schedule()
    assert len(batch.seqs) == len(set(map(id, batch.seqs)))
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        assert seq.status == SequenceStatus.RUNNING and n > 0
        seq.num_computed_tokens += n
        assert len(seq.block_table) * s.bm.block_size >= seq.num_computed_tokens  # its KV has slots
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(SAMPLED)
    step.last = batch
    return {seq.request_id: n for seq, n in zip(batch.seqs, batch.num_new_tokens)}


def crowded(priorities: tuple[int, ...] = (0, 0, 0), steps: int = 2) -> tuple[Scheduler, list[Sequence]]:
    """Three 7-token prompts (r0, r1, r2; these priorities) in 6 blocks, after ``steps`` steps: after 2,
    each has 8 tokens in its 2 blocks, and the next decode needs a 7th block (a preemption)."""
    s = make(num_blocks=6)
    seqs = [req(i, 7, priority=p) for i, p in enumerate(priorities)]
    for q in seqs:
        s.add(q)
    for _ in range(steps):
        step(s)
    return s, seqs


def test_preemption_takes_the_newest_request_first():
    """Three 7-token prompts fill 6 blocks; the first decode past 8 tokens needs a 7th block.
    The newest (r2) must go, not the oldest, and not the one asking."""
    s, seqs = crowded(steps=0)
    assert step(s) == {"r0": 7, "r1": 7, "r2": 7}
    assert step(s) == {"r0": 1, "r1": 1, "r2": 1}  # 8 tokens each: still 2 blocks
    assert step(s) == {"r0": 1, "r1": 1}
    assert step.last.preempted == [seqs[2]]
    assert seqs[2].status == SequenceStatus.WAITING and seqs[2].block_table == []
    assert seqs[2].num_tokens == 9 and seqs[2].num_preemptions == 1  # its generated tokens are kept
    assert s.num_preemptions_total == 1


def test_preemption_takes_the_lowest_priority_first_even_if_oldest():
    s, seqs = crowded(priorities=(5, 0, 0))
    assert step(s) == {"r1": 1, "r2": 1}
    assert step.last.preempted == [seqs[0]]


def test_preempted_request_keeps_its_place_in_line_and_resumes():
    s, seqs = crowded(steps=3)  # r2 preempted
    late = req(3, 2)
    s.add(late)
    assert s.waiting == [seqs[2], late]  # re-queued by arrival, ahead of the later request
    # finish r0 and r1: r2 comes back first and recomputes its 9 tokens (prompt + 2 generated)
    s.finish(seqs[0])
    s.finish(seqs[1])
    assert step(s) == {"r2": 9, "r3": 2}
    assert step.last.seqs == [seqs[2], late]
    assert seqs[2].status == SequenceStatus.RUNNING and seqs[2].num_tokens == 10


def test_no_admission_in_a_step_that_preempted():
    s, _ = crowded()
    s.add(req(3, 1))  # would fit in the block r2's preemption frees
    assert step(s) == {"r0": 1, "r1": 1}
    assert step.last.preempted and [q.request_id for q in s.waiting] == ["r2", "r3"]


def test_fcfs_admission_in_arrival_order_whatever_the_add_order():
    s = make(max_num_seqs=1)
    for i in [2, 0, 3, 1]:
        s.add(req(i, 3))
    order = []
    while s.has_unfinished():
        ran = step(s)
        assert len(ran) == 1
        (rid,) = ran
        if not order or order[-1] != rid:
            order.append(rid)
        seq = s.running[0]
        if seq.num_output_tokens == 2:
            s.finish(seq)
    assert order == ["r0", "r1", "r2", "r3"]


def test_priority_admission_lower_value_first_then_fcfs():
    s = make(max_num_seqs=1)
    for i, prio in [(0, 3), (1, -2), (2, 3), (3, 0), (4, -2)]:
        s.add(req(i, 3, priority=prio))
    assert [q.request_id for q in s.waiting] == ["r1", "r4", "r3", "r0", "r2"]
    admitted = []
    while s.has_unfinished():
        step(s)
        seq = s.running[0]
        if seq.request_id not in admitted:
            admitted.append(seq.request_id)
        s.finish(seq)
    assert admitted == ["r1", "r4", "r3", "r0", "r2"]


def test_max_num_seqs_bounds_the_running_set():
    s = make(max_num_seqs=2)
    for i in range(5):
        s.add(req(i, 3))
    assert step(s) == {"r0": 3, "r1": 3}
    assert len(s.running) == 2 and len(s.waiting) == 3
    assert step(s) == {"r0": 1, "r1": 1}
    s.finish(s.running[0])
    assert step(s) == {"r1": 1, "r2": 3}


def test_chunked_prefill_fills_the_budget_exactly():
    s = make(budget=10)
    s.add(req(0, 25))
    s.add(req(1, 3))
    assert step(s) == {"r0": 10}
    assert step(s) == {"r0": 10}
    assert step(s) == {"r0": 5, "r1": 3}  # the rest of r0, then r1 within what is left
    assert step(s) == {"r0": 1, "r1": 1}
    b = step.last
    assert (b.num_prefill_tokens, b.num_decode_tokens) == (0, 2)


def test_every_step_within_the_budget_and_every_token_scheduled_once():
    budget = 7
    s = make(num_blocks=200, budget=budget, max_num_seqs=4)
    seqs = [req(i, 3 + 5 * i) for i in range(6)]
    for q in seqs:
        s.add(q)
    scheduled = {q.request_id: 0 for q in seqs}
    for _ in range(200):
        if not s.has_unfinished():
            break
        ran = step(s)
        assert 0 < sum(ran.values()) <= budget
        b = step.last
        assert b.num_prefill_tokens + b.num_decode_tokens == sum(ran.values())
        for rid, n in ran.items():
            scheduled[rid] += n
        for q in list(s.running):
            if q.num_output_tokens == 3:
                s.finish(q)
    assert not s.has_unfinished()
    # no preemption here (ample blocks): each prompt token and each fed-back token exactly once
    assert scheduled == {q.request_id: q.num_prompt_tokens + 2 for q in seqs}


def test_decodes_go_before_prompt_chunks_whatever_the_priority():
    s = make(budget=4)
    low = req(0, 2, priority=5)
    s.add(low)
    assert step(s) == {"r0": 2}  # now decoding
    s.add(req(1, 20, priority=0))
    assert step(s) == {"r0": 1, "r1": 3}
    # r1 is a higher-priority prefill in progress; the low-priority decode still goes first
    ran = step(s)
    assert ran == {"r0": 1, "r1": 3}
    assert step.last.seqs[0] is low
    b = step.last
    assert (b.num_decode_tokens, b.num_prefill_tokens) == (1, 3)


def test_request_larger_than_the_cache_waits_at_the_head():
    s = make(num_blocks=2)
    s.add(req(0, 9))  # needs 3 blocks
    s.add(req(1, 2))
    assert step(s) == {}
    assert [q.request_id for q in s.waiting] == ["r0", "r1"]  # FCFS: nobody jumps the line
    assert s.bm.num_free_blocks == 2


@pytest.mark.parametrize("r0, r1, r2, steps", [
    # r0 (decode) needs a block; the victim r1 comes later in the step's order and is skipped there
    (7, 1, 8, [{"r0": 7, "r1": 1}, {"r0": 1, "r1": 1, "r2": 6}, {"r0": 1, "r2": 2}]),
    # r1 (decoding) needs a block and is itself the lowest priority: it goes back to the queue
    (1, 7, 20, [{"r0": 1, "r1": 7}, {"r0": 1, "r1": 1, "r2": 6}, {"r0": 1, "r2": 7}]),
], ids=["victim_after_the_asker_is_skipped", "request_preempts_itself"])
def test_a_preempted_decode_leaves_the_rest_of_the_step_alone(r0, r1, r2, steps):
    """r1 (priority 5) is preempted for a block in the third step; r2's prompt chunk after it in the
    step's order still runs."""
    s = make(num_blocks=3, budget=8, block_size=8)
    s.add(req(0, r0))
    s.add(req(1, r1, priority=5))
    assert step(s) == steps[0]
    s.add(req(2, r2))
    assert [step(s) for _ in steps[1:]] == steps[1:]
    assert [q.request_id for q in step.last.preempted] == ["r1"]


def test_a_victim_already_scheduled_in_the_step_is_taken_back_out():
    """r2's prompt chunk needs a block; the victim r1 (priority 5) already had its decode in the
    batch: it leaves the batch (and its token counts) and is re-queued."""
    s = make(num_blocks=3, budget=8, block_size=8)
    s.add(req(0, 2))
    r1 = req(1, 1, priority=5)
    s.add(r1)
    assert step(s) == {"r0": 2, "r1": 1}
    s.add(req(2, 14))
    assert step(s) == {"r0": 1, "r1": 1, "r2": 6}
    assert step(s) == {"r0": 1, "r2": 6}
    b = step.last
    assert b.preempted == [r1] and r1 not in b.seqs
    assert (b.num_decode_tokens, b.num_prefill_tokens) == (1, 6)
    assert r1.status == SequenceStatus.WAITING and s.waiting == [r1]


def test_added_requests_wait_and_finish_removes_them_from_any_queue():
    s = make()
    a, b = req(0, 3), req(1, 3)
    s.add(a)
    s.add(b)
    assert a.status == SequenceStatus.WAITING and s.has_unfinished()
    s.finish(b)  # aborted while waiting
    assert s.waiting == [a] and b.status == SequenceStatus.FINISHED
    step(s)
    s.finish(a)  # finished while running
    assert s.running == [] and not s.has_unfinished()
    assert s.bm.num_free_blocks == s.bm.num_blocks and s.bm.usage() == 0.0


def test_decodes_beyond_the_budget_wait_and_a_prompt_of_one_token_is_a_prefill():
    s = make(budget=2)
    for i in range(3):
        s.add(req(i, 1))
    assert step(s) == {"r0": 1, "r1": 1}
    b = step.last
    assert (b.num_prefill_tokens, b.num_decode_tokens) == (2, 0)  # one-token prompts are prefills
    assert step(s) == {"r0": 1, "r1": 1}  # the budget ends the step: r2 is not scheduled with 0 tokens
    assert (step.last.num_prefill_tokens, step.last.num_decode_tokens) == (0, 2)


def test_preemptions_are_counted_per_request():
    s, seqs = crowded(steps=3)  # r2 preempted once
    s.finish(seqs[0])
    step(s)  # r2 back (9 tokens: 3 blocks), r1 decoding
    while seqs[2].num_preemptions < 2:
        step(s)
    assert seqs[2].num_preemptions == 2 and s.num_preemptions_total == 2


def test_a_spent_budget_ends_the_step_with_requests_left_over():
    s = make(budget=100)
    for i, n in enumerate([1, 1, 50, 50]):
        s.add(req(i, n))
    assert step(s) == {"r0": 1, "r1": 1, "r2": 50, "r3": 48}
    s.max_num_batched_tokens = 2
    assert step(s) == {"r0": 1, "r1": 1}  # r2 and r3 get nothing this step (not a zero-token entry)
    assert step(s) == {"r0": 1, "r1": 1}
