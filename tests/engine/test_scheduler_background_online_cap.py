"""The background step cap while online traffic is present (``background_max_tokens_while_online``, issue 27): an
online request arriving waits for the step in flight, and on a CPU a step costs about what its rows cost, so while
online requests are in the engine (or left it under ``ONLINE_LINGER_S`` ago) background decode rows and prefill
tokens together get at most N tokens a step, oldest decodes first; with no online traffic, or no cap, scheduling is
unchanged; background work still advances every step and finishes with unchanged greedy tokens.

Step by step on a real BlockManager with the model left out (helpers of test_scheduler_background.py), then through
a real tiny engine.
"""

from __future__ import annotations

import pytest

from tests.engine.test_scheduler_background import BG, GREEDY, drain, make, req, step
from tokenfab.engine.llm_engine import LLMEngine
from tokenfab.engine.requests.scheduler import ONLINE_LINGER_S, Scheduler


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def capped(n: int | None, **kw) -> tuple[Scheduler, Clock]:
    """A scheduler as on a CPU (background decodes paused while online work is pending), budget 32."""
    s = make(budget=32, background_max_tokens_while_online=n, background_decodes_while_online=False, **kw)
    s.clock = clock = Clock()
    return s, clock


def background_decoding(s: Scheduler, k: int, first: int = 0) -> None:
    """k background requests of 3-token prompts, run until all decode (no online traffic yet)."""
    for i in range(first, first + k):
        s.add(req(i, 3, BG))
    while s.waiting or not all(q.is_decoding for q in s.running):
        step(s)


def test_no_online_traffic_no_cap():
    s, _ = capped(2)
    for i in range(3):
        s.add(req(i, 9, BG))
    assert step(s) == {"r0": 9, "r1": 9, "r2": 9}  # alone: the whole budget
    assert step(s) == {"r0": 1, "r1": 1, "r2": 1}


def test_while_an_online_request_decodes_background_rows_are_capped_oldest_first():
    s, _ = capped(3)
    background_decoding(s, 5)
    s.add(req(9, 4))
    assert step(s) == {"r9": 4}  # online prefill: background paused as before (share 0)
    assert step(s) == {"r9": 1, "r0": 1, "r1": 1, "r2": 1}  # online decoding: 3 background rows, the oldest
    assert step(s) == {"r9": 1, "r0": 1, "r1": 1, "r2": 1}


def test_decodes_and_prefill_share_the_cap_decodes_first():
    s, _ = capped(4)
    background_decoding(s, 2)
    s.add(req(9, 4))
    step(s)  # the online prefill
    s.add(req(5, 10, BG))
    assert step(s) == {"r9": 1, "r0": 1, "r1": 1, "r5": 2}  # 2 decode rows, then 2 prefill tokens
    assert step(s) == {"r9": 1, "r0": 1, "r1": 1, "r5": 2}
    assert step.last.num_prefill_tokens == 2


def test_the_cap_lingers_after_online_traffic_then_lifts():
    s, clock = capped(2)
    s.add(req(9, 2))
    step(s)
    for i in range(4):
        s.add(req(i, 3, BG))
    assert step(s) == {"r9": 1, "r0": 2}  # online decoding: 2 background tokens
    s.finish(s.running[0])  # the online request ends
    clock.now += ONLINE_LINGER_S / 2
    assert step(s) == {"r0": 1, "r1": 1}  # still capped: the next online request is likely near
    clock.now += ONLINE_LINGER_S
    assert step(s) == {"r0": 1, "r1": 2, "r2": 3, "r3": 3}  # quiet for longer than the linger: uncapped


def test_a_waiting_online_request_counts_as_present():
    s, _ = capped(1, max_num_seqs=3)
    background_decoding(s, 3)
    s.add(req(9, 4))  # no slot: it preempts the newest background request and prefills alone
    assert step(s) == {"r9": 4} and len(step.last.preempted) == 1
    assert step(s) == {"r9": 1, "r0": 1}


@pytest.mark.parametrize("cap", [1, 3])
def test_background_advances_every_step_under_endless_online_traffic(cap):
    s, _ = capped(cap)
    s.add(req(9, 2))
    step(s)
    s.add(req(0, 7, BG))
    s.add(req(1, 5, BG))
    bg_tokens = []
    for _ in range(12):
        got = step(s)
        assert got["r9"] == 1  # the online request keeps decoding
        bg_tokens.append(sum(n for rid, n in got.items() if rid != "r9"))
    assert bg_tokens[:2] == [cap, cap] and all(1 <= t <= cap for t in bg_tokens)  # (2 decode rows at most)
    assert all(q.num_computed_tokens > 0 for q in s.running if q.is_background)


def test_no_cap_schedules_as_before():
    def run(s: Scheduler) -> list[dict[str, int]]:
        background_decoding(s, 3)
        s.add(req(9, 5))
        s.add(req(5, 20, BG))
        return [step(s) for _ in range(6)]

    assert run(capped(None)[0]) == run(make(budget=32, background_decodes_while_online=False))


def test_the_cap_must_be_at_least_one():
    for bad in (0, -1):
        with pytest.raises(ValueError, match="background_max_tokens_while_online"):
            make(background_max_tokens_while_online=bad)
    make(background_max_tokens_while_online=1)


ONLINE = [[(13 * i + 7 * j) % 250 + 1 for j in range(9 + 4 * i)] for i in range(2)]
BACKGROUND = [[(5 * i + 11 * j) % 250 + 1 for j in range(5 + 3 * i)] for i in range(4)]


def test_capped_background_and_online_requests_keep_their_greedy_tokens(tiny_llama_dir):
    """Background requests running beside online ones under a 1-token cap give the greedy tokens each request
    gives alone."""
    alone = LLMEngine(model=tiny_llama_dir, num_kv_blocks=400, block_size=4, enable_prefix_caching=False)
    expected: dict[str, list[int]] = {}
    for tag, prompts in (("b", BACKGROUND), ("o", ONLINE)):
        for i, p in enumerate(prompts):
            alone.add_request(f"{tag}{i}", p, GREEDY)
            while alone.has_unfinished_requests():
                drain(alone, expected)
    eng = LLMEngine(
        model=tiny_llama_dir,
        num_kv_blocks=400,
        block_size=4,
        enable_prefix_caching=False,
        background_max_tokens_while_online=1,
    )
    assert eng.scheduler.background_max_tokens_while_online == 1
    done: dict[str, list[int]] = {}
    eng.add_request("o0", ONLINE[0], GREEDY)
    drain(eng, done)
    for i, p in enumerate(BACKGROUND):
        eng.add_request(f"b{i}", p, GREEDY, priority=BG)
    drain(eng, done, steps=3)
    eng.add_request("o1", ONLINE[1], GREEDY)
    while eng.has_unfinished_requests():
        drain(eng, done)
    assert done == expected
