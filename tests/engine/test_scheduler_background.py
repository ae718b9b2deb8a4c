"""Background work (priority BACKGROUND_PRIORITY, what /v1/batches submits) yields to online requests, under
any scheduling policy (issue 27): waiting online prompts go before background prefill chunks; an online request
short of a sequence slot or KV blocks preempts running background sequences, newest first; while online work
waits or prefills, background prefill gets at most a share of the step's tokens (decodes go on unless paused);
alone, background work uses the whole budget; preempted background requests finish with unchanged tokens.

Step by step on a real BlockManager with the model left out (as test_scheduler_policies.py), then through a
real tiny engine.
"""

from __future__ import annotations

import pytest

from tokenfab.engine.intake import RequestIntake, RequestLimits
from tokenfab.engine.llm_engine import LLMEngine
from tokenfab.engine.requests.block_manager import BlockManager
from tokenfab.engine.requests.sampling_params import SamplingParams
from tokenfab.engine.requests.scheduler import Scheduler
from tokenfab.engine.requests.sequence import BACKGROUND_PRIORITY, Sequence, SequenceStatus

BG = BACKGROUND_PRIORITY
BS = 4  # block size
SAMPLED = 7  # the token "the model" appends


def make(num_blocks: int = 64, max_num_seqs: int = 8, budget: int = 16, **kw) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BS, enable_prefix_caching=False), max_num_seqs, budget, **kw)


def req(i: int, prompt_len: int, priority: int = 0) -> Sequence:
    prompt = [1 + (i * 37 + j) % 300 for j in range(prompt_len)]
    return Sequence(f"r{i}", None, prompt, SamplingParams(), 0, priority=priority, arrival_index=i)


def step(s: Scheduler) -> dict[str, int]:
    """One engine step without a model (as in test_scheduler_policies.py): {request id: tokens scheduled}."""
    batch = s.schedule()
    assert len(batch.seqs) == len(set(map(id, batch.seqs)))
    assert 0 <= batch.num_prefill_tokens + batch.num_decode_tokens == sum(batch.num_new_tokens)
    assert sum(batch.num_new_tokens) <= s.max_num_batched_tokens and len(s.running) <= s.max_num_seqs
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        assert seq.status == SequenceStatus.RUNNING and n > 0
        seq.num_computed_tokens += n
        assert len(seq.block_table) * s.bm.block_size >= seq.num_computed_tokens
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(SAMPLED)
    for seq in batch.preempted:
        assert seq.status == SequenceStatus.WAITING and seq.block_table == [] and seq not in batch.seqs
    s.bm.check_invariants()
    step.last = batch
    return {seq.request_id: n for seq, n in zip(batch.seqs, batch.num_new_tokens)}


def ids(seqs: list[Sequence]) -> list[str]:
    return [q.request_id for q in seqs]


def test_the_background_threshold_is_the_largest_priority():
    assert BACKGROUND_PRIORITY == 2**31 - 1
    assert req(0, 1, BG).is_background and not req(0, 1, BG - 1).is_background and not req(0, 1).is_background


def test_an_online_arrival_is_admitted_the_next_step_before_a_running_background_prefill():
    s = make()
    bg = req(0, 40, BG)
    s.add(bg)
    assert step(s) == {"r0": 16}  # alone: the whole budget
    s.add(req(1, 10))
    assert s.online_pending()
    assert step(s) == {"r1": 10}  # the background prompt gets nothing while an online prompt is in
    assert not s.online_pending()  # r1 decodes now
    assert step(s) == {"r1": 1, "r0": 15}  # and the background takes what the decode leaves
    assert step.last.seqs[0].request_id == "r1" and not step.last.preempted


def test_background_alone_uses_the_whole_budget_and_the_old_order():
    s = make(budget=16, background_prefill_share=0.0)
    for i, n in enumerate([3, 20, 9]):
        s.add(req(i, n, BG))
    assert not s.online_pending()
    assert step(s) == {"r0": 3, "r1": 13}
    assert step(s) == {"r0": 1, "r1": 7, "r2": 8}
    assert step(s) == {"r0": 1, "r1": 1, "r2": 1}
    assert (step.last.num_decode_tokens, step.last.num_prefill_tokens) == (2, 1)


def test_online_decodes_do_not_hold_the_background_back():
    s = make(budget=16)
    s.add(req(0, 2))
    assert step(s) == {"r0": 2}
    s.add(req(1, 30, BG))
    assert step(s) == {"r0": 1, "r1": 15}


@pytest.mark.parametrize("share, online_len, expected", [
    (0.25, 10, {"r1": 10, "r0": 4}),  # the share: 4 of 16 tokens
    (0.25, 14, {"r1": 14, "r0": 2}),  # what the online prompt leaves, below the share
    (0.5, 16, {"r1": 16}),  # the online prompt takes the whole budget first
    (1.0, 4, {"r1": 4, "r0": 12}),
    (0.0, 4, {"r1": 4}),
], ids=["share", "leftover", "online_first", "all", "none"])
def test_background_prefill_is_capped_while_an_online_prompt_prefills(share, online_len, expected):
    s = make(budget=16, background_prefill_share=share)
    s.add(req(0, 100, BG))
    step(s)
    s.add(req(1, online_len))
    assert step(s) == expected


def test_the_share_caps_background_admissions_too_and_counts_running_chunks_first():
    s = make(budget=16, background_prefill_share=0.5)  # 8 tokens
    s.add(req(0, 20, BG))
    step(s)  # r0: 16 of 20
    s.add(req(1, 30))
    s.add(req(2, 9, BG))
    assert ids(s.waiting) == ["r1", "r2"]
    assert step(s) == {"r1": 16}
    s.add(req(3, 2))
    assert step(s) == {"r1": 14, "r3": 2}  # online first; the background gets no room left
    s.add(req(4, 6))
    assert step(s) == {"r1": 1, "r3": 1, "r4": 6, "r0": 4, "r2": 4}  # running chunk 4, then admission 4 (= 8)
    assert step(s) == {"r1": 1, "r3": 1, "r4": 1, "r0": 1, "r2": 5}  # online decodes only: no cap


def test_background_decodes_go_on_while_online_prompts_prefill_if_the_budget_allows():
    s = make(budget=16)
    s.add(req(0, 3, BG))
    step(s)  # r0 decodes from now on
    s.add(req(1, 10))
    assert step(s) == {"r1": 10, "r0": 1}
    assert [q.request_id for q in step.last.seqs] == ["r1", "r0"]  # after the online prompt
    s.add(req(2, 15))
    assert step(s) == {"r1": 1, "r2": 15}  # the online work fills the budget: the decode waits
    assert bg_waits(s) == ["r0"]


def bg_waits(s: Scheduler) -> list[str]:
    return [q.request_id for q in s.running if q.is_background and q not in step.last.seqs]


@pytest.mark.parametrize("share, expected", [(0.0, {"r1": 10}), (0.1, {"r1": 10, "r0": 1})])
def test_background_decodes_paused_while_online_count_in_the_share(share, expected):
    s = make(budget=16, background_prefill_share=share, background_decodes_while_online=False)
    s.add(req(0, 3, BG))
    step(s)
    s.add(req(1, 10))
    assert step(s) == expected
    assert step(s) == {"r1": 1, "r0": 1}  # online decoding only: the background decodes again


def test_a_full_slot_count_preempts_the_newest_background_sequence():
    s = make(max_num_seqs=2)
    b0, b1 = req(0, 3, BG), req(1, 3, BG)
    s.add(b0)
    s.add(b1)
    assert step(s) == {"r0": 3, "r1": 3}
    s.add(req(2, 5))
    assert step(s) == {"r2": 5, "r0": 1}
    assert step.last.preempted == [b1] and b1.num_preemptions == 1 and s.num_preemptions_total == 1
    assert b1.num_tokens == 4 and s.waiting == [b1]  # its sampled token is kept
    assert step(s) == {"r0": 1, "r2": 1}  # slots full again: b1 waits, the online request is untouched
    s.finish(b0)
    assert step(s) == {"r2": 1, "r1": 4}  # b1 recomputes its 4 tokens and goes on
    assert b1.status == SequenceStatus.RUNNING


def test_slots_full_of_online_requests_preempt_nobody():
    s = make(max_num_seqs=2)
    for i in range(3):
        s.add(req(i, 3))
    assert step(s) == {"r0": 3, "r1": 3}
    assert step(s) == {"r0": 1, "r1": 1}
    assert not step.last.preempted and ids(s.waiting) == ["r2"]


@pytest.mark.parametrize("online_len, preempted, expected", [
    (8, ["r1"], {"r2": 8, "r0": 1}),  # 2 blocks: the newest background frees them
    (12, ["r1", "r0"], {"r2": 12}),  # 3 blocks: both go, newest first
], ids=["one", "newest_first"])
def test_short_blocks_preempt_background_sequences_for_an_online_prompt(online_len, preempted, expected):
    s = make(num_blocks=4, budget=32)
    s.add(req(0, 6, BG))
    s.add(req(1, 6, BG))
    assert step(s) == {"r0": 6, "r1": 6}
    assert s.bm.num_free_blocks == 0
    s.add(req(2, online_len))
    assert step(s) == expected
    assert ids(step.last.preempted) == preempted and ids(s.waiting) == preempted[::-1]


def test_background_is_not_preempted_when_the_online_prompt_fits():
    s = make(num_blocks=5, budget=32)
    s.add(req(0, 6, BG))
    s.add(req(1, 6, BG))
    step(s)
    s.add(req(2, 4))  # 1 block: the free one
    assert step(s) == {"r2": 4, "r0": 1, "r1": 1}
    assert not step.last.preempted and s.num_preemptions_total == 0


def test_an_online_prompt_too_big_for_the_cache_left_waits_after_preempting_the_background():
    s = make(num_blocks=4, budget=32)
    s.add(req(1, 3, BG))
    assert step(s) == {"r1": 3}
    s.add(req(0, 6))
    assert step(s) == {"r0": 6, "r1": 1}  # online r0: 2 blocks, background r1: 1 block, 1 free
    s.add(req(2, 16))  # 4 blocks: never fits beside r0
    assert step(s) == {"r0": 1}
    assert ids(step.last.preempted) == ["r1"] and ids(s.waiting) == ["r2", "r1"]
    assert s.bm.num_free_blocks == 2  # r2 gave its blocks back: it stays first in line


def both_decoding(num_blocks: int, **kw) -> tuple[Scheduler, Sequence, Sequence]:
    """Background r1 (6-token prompt) then online r0 (7): after three steps both have 9 tokens in 2 blocks
    each, and each one's next decode needs a third block; ``num_blocks - 4`` blocks are free."""
    s = make(num_blocks=num_blocks, budget=100, **kw)
    r0, r1 = req(0, 7), req(1, 6, BG)
    s.add(r1)
    assert step(s) == {"r1": 6}
    s.add(r0)
    assert step(s) == {"r0": 7, "r1": 1}
    assert step(s) == {"r0": 1, "r1": 1}
    assert r0.num_tokens == r1.num_tokens == 9 and s.bm.num_free_blocks == num_blocks - 4
    return s, r0, r1


def test_an_online_decode_short_of_a_block_preempts_background_and_online_admission_goes_on():
    s, r0, r1 = both_decoding(num_blocks=4)
    s.add(req(2, 3))
    # r0's decode needs a third block: the background r1 goes; r2 is still admitted (only background work
    # was preempted), into the other block r1 left
    assert step(s) == {"r0": 1, "r2": 3}
    assert step.last.preempted == [r1] and s.waiting == [r1] and s.bm.num_free_blocks == 0


def test_no_background_admission_in_a_step_that_preempted():
    s, r0, r1 = both_decoding(num_blocks=5, background_prefill_share=0.02)  # the share: 2 tokens
    s.add(req(2, 3))
    # r0 takes the free block; r2 needs one: r1 is preempted (2 free), r2 takes one; r1 would fit a
    # 2-token chunk in the other, but a step that preempted admits no background work
    assert step(s) == {"r0": 1, "r2": 3}
    assert step.last.preempted == [r1] and s.bm.num_free_blocks == 1
    s.finish(r0)
    assert step(s) == {"r2": 1, "r1": 9}  # online decodes only: r1 back, all of it


def test_an_online_preemption_still_stops_online_admission():
    s = make(num_blocks=6, budget=100)
    for i in range(3):
        s.add(req(i, 7))
    step(s)
    step(s)
    s.add(req(3, 1))
    assert step(s) == {"r0": 1, "r1": 1}
    assert ids(step.last.preempted) == ["r2"] and ids(s.waiting) == ["r2", "r3"]


def test_waiting_online_requests_keep_arrival_order_and_background_goes_last():
    s = make(max_num_seqs=1)
    s.add(req(0, 3, BG))
    for i in [3, 1, 2]:
        s.add(req(i, 3))
    assert ids(s.waiting) == ["r1", "r2", "r3", "r0"]
    order = []
    while s.has_unfinished():
        step(s)
        seq = s.running[0]
        order.append(seq.request_id)
        s.finish(seq)
    assert order == ["r1", "r2", "r3", "r0"]


def test_the_background_step_cap_holds_alone_and_under_the_share():
    s = make(budget=16, background_max_prefill_tokens=5, background_prefill_share=0.5)
    s.add(req(0, 3, BG))
    s.add(req(1, 9, BG))
    assert step(s) == {"r0": 3, "r1": 2}  # alone: 5 background prefill tokens a step, admissions included
    assert step(s) == {"r0": 1, "r1": 5}  # decodes are not capped
    s.add(req(2, 4))
    assert step(s) == {"r2": 4, "r0": 1, "r1": 2}  # the smaller of the cap and the share (8) applies
    s.max_num_batched_tokens = 6
    s.add(req(3, 4))
    assert step(s) == {"r2": 1, "r3": 4, "r0": 1}  # the budget binds before either
    assert step(s) == {"r2": 1, "r3": 1, "r0": 1, "r1": 1}  # r1 (its prompt done last step) decodes again


def test_the_background_share_must_be_a_fraction():
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="background_prefill_share"):
            make(background_prefill_share=bad)
    make(background_prefill_share=1.0)
    with pytest.raises(ValueError, match="background_max_prefill_tokens"):
        make(background_max_prefill_tokens=0)
    make(background_max_prefill_tokens=1)


@pytest.mark.parametrize("policy, given, kept", [
    ("fcfs", 5, 0), ("fcfs", BG, BG), ("fcfs", -3, 0), ("priority", 5, 5), ("priority", BG, BG), ("priority", -3, -3),
])
def test_intake_keeps_the_background_priority_under_any_policy(policy, given, kept):
    intake = RequestIntake(None, RequestLimits(vocab_size=100, max_model_len=64, kv_cache_tokens=256), policy)
    seq = intake.new_sequence("a", [1, 2, 3], SamplingParams(), given, None, None, None)
    assert seq.priority == kept and seq.is_background == (kept == BG)


# ---- through a real engine -----------------------------------------------------------------------------------
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
BG_PROMPTS = [[(7 * i + 3 * j) % 250 + 1 for j in range(6 + 5 * i)] for i in range(4)]
ONLINE_PROMPTS = [[(11 * i + 5 * j) % 250 + 1 for j in range(20 + 3 * i)] for i in range(3)]


def drain(engine: LLMEngine, done: dict[str, list[int]], steps: int = 1) -> None:
    for _ in range(steps):
        for out in engine.step():
            if out.finished:
                assert out.outputs[0].finish_reason == "length"
                done[out.request_id] = list(out.outputs[0].token_ids)


@pytest.mark.parametrize("kw", [
    {}, {"async_scheduling": True},
    {"background_max_prefill_tokens": 16, "background_decodes_while_online": False, "background_prefill_share": 0.1},
], ids=["sync", "overlap", "capped"])
def test_preempted_background_requests_finish_with_unchanged_greedy_tokens(tiny_llama_dir, kw):
    """Under fcfs: 4 background requests fill the 4 sequence slots; 3 online requests arrive, each preempting the
    newest background one; every request's greedy tokens equal those of the request run alone (capped: background
    prompts prefilled 16 tokens a step, decodes paused while online work is pending)."""
    alone = LLMEngine(model=tiny_llama_dir, num_kv_blocks=400, block_size=4, enable_prefix_caching=False)
    expected: dict[str, list[int]] = {}
    for tag, prompts in (("b", BG_PROMPTS), ("o", ONLINE_PROMPTS)):
        for i, p in enumerate(prompts):
            alone.add_request(f"{tag}{i}", p, GREEDY)
            while alone.has_unfinished_requests():
                drain(alone, expected)

    eng = LLMEngine(model=tiny_llama_dir, num_kv_blocks=400, block_size=4, max_num_seqs=4,
                    max_num_batched_tokens=64, enable_prefix_caching=False, **kw)
    assert eng.scheduling_policy == "fcfs"
    done: dict[str, list[int]] = {}
    for i, p in enumerate(BG_PROMPTS):
        eng.add_request(f"b{i}", p, GREEDY, priority=BG)
    while not all(q.is_decoding for q in eng.scheduler.running) or eng.scheduler.waiting:
        drain(eng, done)  # until all four decode
    assert len(eng.scheduler.running) == 4 and not done
    for i, p in enumerate(ONLINE_PROMPTS):
        eng.add_request(f"o{i}", p, GREEDY)
    drain(eng, done, steps=2)
    online = [q for q in eng.scheduler.running if not q.is_background]
    assert len(online) == 3  # admitted at once, by preemption
    assert sorted(q.request_id for q in eng.scheduler.waiting) == ["b1", "b2", "b3"]
    while eng.has_unfinished_requests():
        drain(eng, done)
    assert done == expected
    assert eng.scheduler.num_preemptions_total >= 3
    bm = eng.block_manager
    assert bm.num_free_blocks == bm.num_blocks
