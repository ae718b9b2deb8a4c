"""Hybrid cache (issue 29): paged KV plus per-sequence recurrent-state slots, through the real engine.

The toy model (tests/engine/hybrid_toy.py) is a tiny Llama whose first layer also keeps a decayed running
sum in state slots; its reference is transformers recomputing that sum from scratch at every token. The
engine's greedy tokens must equal the reference alone, batched, chunked, under preemption and slot
shortage; every block and slot must come back; prefix caching must be off for such a model.
"""

from __future__ import annotations

import logging
import random

import pytest
import torch

from tests.engine import hybrid_toy
from tokenfab.engine.llm_engine import LLMEngine
from tokenfab.engine.requests.sampling_params import SamplingParams
from tokenfab.engine.runner.state_cache import state_bytes_per_slot, state_cache_bytes

N_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=N_TOKENS, ignore_eos=True)


def make_prompts(n: int, seed: int, lo: int = 3, hi: int = 50) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 320) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("toy-hybrid")
    hybrid_toy.save_toy_hybrid(path)
    return path


@pytest.fixture(scope="module")
def flood(toy_dir):
    """30 prompts (3..50 tokens) and transformers' greedy tokens for each, recomputed from scratch."""
    prompts = make_prompts(30, seed=1)
    return prompts, hybrid_toy.reference_greedy(toy_dir, prompts, N_TOKENS)


def engine(toy_dir, **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 400)
    kw.setdefault("cpu_threads", 1)  # tiny matrices: one thread is far faster on a shared machine
    return LLMEngine(model=str(toy_dir), **kw)


def run_all(eng: LLMEngine, prompts: list[list[int]], watch=None) -> list[list[int]]:
    """Run every prompt to its end; ``watch(eng)`` after each step. Checks every block and slot came back."""
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, GREEDY)
    done: dict[str, list[int]] = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        if watch is not None:
            watch(eng)
    bm = eng.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks
    assert bm.state_slots.num_free == bm.state_slots.num_slots
    return [done[f"r{i}"] for i in range(len(prompts))]


def slot_watcher():
    """Asserts a running sequence keeps its slot from admission to its end or preemption (all its chunks)."""
    seen: dict[tuple[str, int], int] = {}

    def watch(eng: LLMEngine) -> None:
        slots = [s.state_slot for s in eng.scheduler.running]
        assert len(set(slots)) == len(slots) and min(slots, default=0) >= 0
        for s in eng.scheduler.running:
            assert seen.setdefault((s.request_id, s.num_preemptions), s.state_slot) == s.state_slot
        for s in eng.scheduler.waiting:
            assert s.state_slot == -1
    watch.seen = seen
    return watch


def test_the_mixer_changes_greedy_tokens(toy_dir, flood):
    """The recurrent term matters: without it transformers gives other tokens, so a state bug shows."""
    prompts, expected = flood
    plain = hybrid_toy.reference_greedy(toy_dir, prompts[:6], N_TOKENS, with_mixer=False)
    assert sum(a != b for a, b in zip(plain, expected[:6])) >= 3


def test_alone_equals_reference(toy_dir, flood):
    prompts, expected = flood
    eng = engine(toy_dir)
    assert eng.num_state_slots == 256 and eng.runner.state_caches
    for p, e in zip(prompts[:4], expected[:4]):
        assert run_all(eng, [p]) == [e]  # one at a time: each reuses slot 0, left dirty by the one before


def test_batched_equals_reference(toy_dir, flood):
    prompts, expected = flood
    assert run_all(engine(toy_dir, max_num_batched_tokens=100_000), prompts, slot_watcher()) == expected


@pytest.mark.parametrize("budget", [7, 32])
def test_chunked_prefill_equals_reference(toy_dir, flood, budget):
    """Prompts split over several steps: each chunk continues from the state the previous one left."""
    prompts, expected = flood
    eng = engine(toy_dir, max_num_batched_tokens=budget)
    assert run_all(eng, prompts[:12], slot_watcher()) == expected[:12]
    assert eng.num_steps >= sum(map(len, prompts[:12])) / budget


def test_preemption_flood_equals_reference(toy_dir, flood):
    """KV for about 3 sequences (60 + 10 tokens need 5 blocks of 16), 30 requests at once: sequences are
    preempted, lose their slot, and recompute from position 0 (a zero state) later."""
    prompts, expected = flood
    watch = slot_watcher()
    eng = engine(toy_dir, num_kv_blocks=15, max_num_batched_tokens=64)
    assert run_all(eng, prompts, watch) == expected
    assert eng.get_stats().num_preemptions_total > 5
    assert any(k[1] > 0 for k in watch.seen)  # some sequence ran again after a preemption


def test_slot_shortage_makes_admission_wait(toy_dir, flood):
    """3 slots, ample KV and max_num_seqs: at most 3 sequences run at once, the rest wait, all equal."""
    prompts, expected = flood
    peak = []

    def watch(eng: LLMEngine) -> None:
        peak.append(len(eng.scheduler.running))
        assert eng.block_manager.state_slots.num_used == len(eng.scheduler.running) <= 3

    eng = engine(toy_dir, num_state_slots=3, max_num_seqs=30, max_num_batched_tokens=256)
    assert run_all(eng, prompts, watch) == expected
    assert max(peak) == 3


def test_cpu_decode_graph_padding_uses_the_scratch_slot(toy_dir, flood):
    """The decode-graph path (run eagerly on CPU) pads batches with rows pointing at the scratch slot."""
    prompts, expected = flood
    eng = engine(toy_dir, num_state_slots=8, max_num_seqs=8)
    eng.runner.capture_decode_graphs(max_batch=8, max_model_len=128)
    scratch = eng.runner.num_state_slots
    assert eng.runner.graphs.state_slots.tolist() == [scratch] * 8
    assert run_all(eng, prompts[:7]) == expected[:7]  # 7 decodes pad to 8


def test_prefix_caching_off_without_snapshots(toy_dir, flood, caplog):
    """--num-state-snapshots 0: a recurrent state cannot be rebuilt from cached KV blocks alone, so the
    engine turns prefix caching off (and says so); shared prefixes still give the reference's tokens."""
    prompts, _ = flood
    shared = list(range(10, 10 + 48))  # 3 full blocks
    batch = [shared + p[:5] for p in prompts[:3]]
    expected = hybrid_toy.reference_greedy(toy_dir, batch, N_TOKENS)
    with caplog.at_level(logging.INFO, logger="tokenfab"):
        eng = engine(toy_dir, enable_prefix_caching=True, num_state_snapshots=0)
    assert "prefix caching is off" in caplog.text
    assert not eng.block_manager.enable_prefix_caching and eng.block_manager.state_snapshots is None
    assert run_all(eng, batch[:1]) == expected[:1]
    assert run_all(eng, batch[1:]) == expected[1:]
    assert eng.block_manager.prefix_hits == 0


def shared_prefix_prompts(prompts: list[list[int]]) -> list[list[int]]:
    """Prompts built to hit: the same prompt again, a longer one over it, a shared 3-block system prompt
    with different tails, a repeat of a prompt plus its generated tokens (a second turn)."""
    system = list(range(10, 10 + 48))
    return [system + prompts[0][:5], system + prompts[0][:5], system + prompts[0][:5] + prompts[1][:30],
            system + prompts[2][:9], prompts[3] + prompts[4], prompts[3] + prompts[4] + prompts[5]]


@pytest.mark.parametrize("budget", [24, 4096])
def test_prefix_hits_with_state_snapshots_equal_reference(toy_dir, flood, budget):
    """Prefix caching on (the default): hits are cut back to the last block with a state snapshot, the snapshot
    restored into the new slot; every request one after another must still equal the from-scratch reference,
    and hits must happen."""
    prompts, _ = flood
    batch = shared_prefix_prompts(prompts)
    expected = hybrid_toy.reference_greedy(toy_dir, batch, N_TOKENS)
    eng = engine(toy_dir, max_num_batched_tokens=budget)
    bm = eng.block_manager
    assert bm.enable_prefix_caching and bm.state_snapshots is not None and eng.runner.state_snapshots.caches
    got = [run_all(eng, [p])[0] for p in batch]
    assert got == expected
    assert bm.state_snapshots.restored >= 4 and bm.prefix_hits >= 3 * 48 + 16  # the system prompt x3, the 2nd turn
    assert eng.post is not None and eng.get_stats().prefix_cache_hits_total == bm.prefix_hits


@pytest.mark.parametrize("snapshots", [1, 4])
def test_prefix_hits_under_preemption_equal_reference(toy_dir, flood, snapshots):
    """The flood with prefix caching and few snapshot rows (reused LRU, one row reserved twice in a step
    with 1) into KV for about 3 sequences."""
    prompts, expected = flood
    batch = prompts + [list(p) for p in prompts[:10]]  # the first ten twice: hits
    eng = engine(toy_dir, num_kv_blocks=15, max_num_batched_tokens=64, num_state_snapshots=snapshots)
    assert run_all(eng, batch, slot_watcher()) == expected + expected[:10]
    assert eng.get_stats().num_preemptions_total > 5


def test_no_prefix_hit_without_a_snapshot(toy_dir, flood):
    """Cached KV blocks alone are not a hit for a hybrid model: with the snapshots dropped, a repeat
    computes its whole prompt again (and still equals the reference)."""
    prompts, expected = flood
    eng = engine(toy_dir)
    p = prompts[5]
    assert len(p) > 32
    run_all(eng, [p])
    eng.block_manager.state_snapshots.clear()
    before = eng.block_manager.prefix_hits
    assert run_all(eng, [p]) == [expected[5]]
    assert eng.block_manager.prefix_hits == before


def test_state_bytes_come_out_of_the_kv_budget(toy_dir):
    mem = 4 << 20
    eng = engine(toy_dir, num_kv_blocks=None, kv_cache_memory=mem, max_num_seqs=16, num_state_snapshots=5)
    per_slot = state_bytes_per_slot(eng.model)
    assert per_slot == 64 * 3 * 4  # conv (64, 2) + ssm (64,), float32
    states = state_cache_bytes(eng.model, 16) + 5 * per_slot
    assert states == per_slot * (17 + 5)  # 16 slots + the scratch row, 5 snapshot rows
    tensors = [*eng.runner.state_caches.values(), *eng.runner.state_snapshots.caches.values()]
    assert sum(t.numel() * t.element_size() for t in tensors) == states
    per_block = eng.memory["kv_bytes_per_token"] * 16
    assert eng.block_manager.num_blocks == min((mem - states) // per_block, 16 * 64)


def test_negative_control_stale_state_is_caught(toy_dir, flood):
    """A mixer that ignores the fresh-start rule reads the slot's previous owner's state: the same
    comparison then fails, so the tests above can fail."""
    prompts, expected = flood
    eng = engine(toy_dir)
    mixer = eng.model.model.layers[0].self_attn.mixer
    mixer.zero_on_fresh_start = False
    try:
        got = [run_all(eng, [p])[0] for p in prompts[:4]]  # each reuses the slot the previous one dirtied
    finally:
        mixer.zero_on_fresh_start = True
    assert got[0] == expected[0]  # the first owner found a zeroed slot
    assert got[1:] != expected[1:4]


def test_async_scheduling_equals_reference(toy_dir, flood):
    """Overlap scheduling (step N+1 launched before step N's tokens are read) with chunks and preemption."""
    prompts, expected = flood
    eng = engine(toy_dir, async_scheduling=True, num_kv_blocks=15, max_num_batched_tokens=64)
    assert run_all(eng, prompts[:12], slot_watcher()) == expected[:12]


def test_abort_gives_the_slot_back(toy_dir, flood):
    prompts, expected = flood
    eng = engine(toy_dir, num_state_slots=2, max_num_seqs=4)
    for i, p in enumerate(prompts[:3]):
        eng.add_request(f"a{i}", p, GREEDY)
    eng.step()
    slots = eng.block_manager.state_slots
    assert slots.num_free == 0 and len(eng.scheduler.waiting) == 1  # the third waits for a slot
    eng.abort_request("a0")
    assert slots.num_free == 1
    eng.abort_request("a1")
    eng.abort_request("a2")
    assert slots.num_free == 2 and not eng.has_unfinished_requests()
    assert run_all(eng, prompts[3:5]) == expected[3:5]  # the slots the aborted ones dirtied


def test_gpu_budget_probe_runs_a_hybrid_forward(toy_dir, monkeypatch):
    """--gpu-memory-utilization's activation probe (a forward over the largest chunk on a throwaway runner)
    works for a hybrid model: its sequence has a state slot. The CUDA memory calls are stubbed: the probe's
    forward runs on the CPU."""
    from tokenfab.engine.runner import kv_budget

    eng = engine(toy_dir, max_num_batched_tokens=40)
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("sync"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 1000)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 1500)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (8000, 10000))
    budget = kv_budget.cuda_kv_budget(eng.args, torch.device("cpu"), 128, eng._make_runner)
    assert calls == ["sync", "sync"]
    assert budget == int(10000 * eng.args.gpu_memory_utilization - 2000 - 500)


def test_shared_system_prompt_hits_from_the_third_request(toy_dir, flood):
    """Three prompts over one 3-block system prompt, tails over a block long: the first leaves snapshots only
    inside its own tail, so the second has cached KV for the system prompt but no snapshot there (no hit); its
    chunk ends at the system prompt's end, so the third hits all 48 tokens. All equal the reference."""
    prompts, _ = flood
    system = list(range(10, 10 + 48))
    tails = [p for p in prompts if 20 <= len(p) <= 45][:3]
    batch = [system + t for t in tails]
    expected = hybrid_toy.reference_greedy(toy_dir, batch, N_TOKENS)
    eng = engine(toy_dir, max_num_batched_tokens=4096)
    bm = eng.block_manager
    got, hits = [], []
    for p in batch:
        got.extend(run_all(eng, [p]))
        hits.append(bm.prefix_hits)
    assert got == expected
    assert hits == [0, 0, 48]
