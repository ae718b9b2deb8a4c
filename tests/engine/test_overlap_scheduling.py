"""Overlap scheduling (``async_scheduling=True``, engine/overlap.py) against the synchronous engine.

The reference is the plain engine on the same model: every request must get the same stream of
outputs (each delta's token ids and text, in order, and the finish reason), under greedy and seeded
sampling, stop strings / stop_token_ids / EOS / max_tokens / min_tokens, n > 1, aborts, prefix-cache
hits, chunked prefill, preemption and requests arriving while others run. Then the overlap's own
properties: step N+1 is launched before step N's tokens are read, placeholders never reach the
model, a finished request keeps no extra token, no block and no prefix-cache digest of a token it
did not keep.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from tokenfab.engine.llm_engine import LLMEngine
from tokenfab.engine.overlap import PLACEHOLDER, OverlapScheduler
from tokenfab.engine.requests.sampling_params import SamplingParams


def make_prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 320) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def drive(engine: LLMEngine, requests, arrive_at=None, abort_after=None, max_calls: int = 20_000,
          logprobs: dict | None = None):
    """Run ``requests`` [(id, prompt, params)] to the end; ``arrive_at``: id -> the call before
    which it is added (others at the start); ``abort_after``: id -> abort once it has emitted that
    many tokens. Returns id -> [(delta ids, delta text, finished, finish_reason, stop_reason)];
    ``logprobs`` (a dict) gets id -> the finished output's logprobs."""
    arrive_at = arrive_at or {}
    abort_after = abort_after or {}
    streams: dict[str, list] = {rid: [] for rid, _, _ in requests}
    emitted = dict.fromkeys(streams, 0)
    requests = [(rid, prompt, fresh(params)) for rid, prompt, params in requests]
    later = [r for r in requests if r[0] in arrive_at]
    for rid, prompt, params in requests:
        if rid not in arrive_at:
            engine.add_request(rid, prompt, params)
    calls = 0
    while engine.has_unfinished_requests() or later:
        for r in [r for r in later if arrive_at[r[0]] <= calls]:
            engine.add_request(*r)
            later.remove(r)
        for out in engine.step():
            c = out.outputs[0]
            streams[out.request_id].append(
                (list(c.delta_token_ids), c.delta_text, out.finished, c.finish_reason, c.stop_reason))
            emitted[out.request_id] += len(c.delta_token_ids)
            if out.finished and logprobs is not None:
                logprobs[out.request_id] = c.logprobs
            if not out.finished and emitted[out.request_id] >= abort_after.get(out.request_id, 1 << 30):
                engine.abort_request(out.request_id)
                streams[out.request_id].append("aborted")
        calls += 1
        assert calls < max_calls
    bm = engine.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks and all(r == 0 for r in bm.ref_counts)
    return streams


def fresh(params: SamplingParams) -> SamplingParams:
    """Each engine gets its own constraint state."""
    if params.constraint is None:
        return params
    return dataclasses.replace(params, constraint=EvenTokens(params.constraint.length))


class EvenTokens:
    """A toy grammar for the tiny model: even token ids only; complete after ``length`` tokens."""

    def __init__(self, length: int) -> None:
        self.length = length
        self.accepted: list[int] = []

    def mask_logits(self, row: torch.Tensor) -> None:
        row[1::2] = float("-inf")

    def accept_token(self, token: int) -> None:
        assert token % 2 == 0
        self.accepted.append(token)

    def is_terminated(self) -> bool:
        return len(self.accepted) >= self.length


def both(make_engine, requests, **kw):
    """The streams of the synchronous and the overlapped engine, and the overlapped engine. The
    returned logprobs agree too: same tokens and ranks, values within float noise (the two engines'
    batches differ: a step can hold a finished request's extra row)."""
    lp_sync: dict = {}
    lp_over: dict = {}
    sync = drive(make_engine(False), requests, logprobs=lp_sync, **kw)
    eng = make_engine(True)
    assert isinstance(eng._overlap, OverlapScheduler) and eng.async_scheduling
    over = drive(eng, requests, logprobs=lp_over, **kw)
    assert lp_over.keys() == lp_sync.keys()
    for rid, a in lp_sync.items():
        b = lp_over[rid]
        assert (a is None) == (b is None), rid
        if a is not None:
            assert len(a) == len(b) and all(x.keys() == y.keys() for x, y in zip(a, b)), rid
            for x, y in zip(a, b):
                for tok in x:
                    assert x[tok].rank == y[tok].rank
                    assert x[tok].logprob == pytest.approx(y[tok].logprob, abs=1e-4)
    eng.test_logprobs = lp_over  # for the caller's own checks
    return sync, over, eng


def tokens_of(stream) -> list[int]:
    return [t for item in stream if item != "aborted" for t in item[0]]


# ---- the tiny random Llama (no tokenizer: token-level stops) ---------------------------------------
@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    def make(async_scheduling: bool, **kw) -> LLMEngine:
        kw.setdefault("num_kv_blocks", 400)
        return LLMEngine(model=tiny_llama_dir, async_scheduling=async_scheduling, **kw)

    return make


@pytest.fixture(scope="module")
def greedy_runs(tiny):
    """Greedy continuations of 12 prompts (ignore_eos), to pick stop tokens that really occur."""
    prompts = make_prompts(12, seed=1)
    requests = [(f"g{i}", p, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
                for i, p in enumerate(prompts)]
    streams = drive(tiny(False), requests)
    return prompts, [tokens_of(streams[f"g{i}"]) for i in range(len(prompts))]


def mixed_requests(prompts, outs):
    """One request per kind of ending and sampling the engine has."""
    P = SamplingParams
    reqs = [
        ("greedy", prompts[0], P(temperature=0, max_tokens=9, ignore_eos=True)),
        ("max1", prompts[1], P(temperature=0, max_tokens=1, ignore_eos=True)),
        ("max2", prompts[2], P(temperature=0, max_tokens=2, ignore_eos=True)),
        ("max0", prompts[3], P(temperature=0, max_tokens=0)),
        ("seeded", prompts[4], P(temperature=1.0, top_k=50, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)),
        ("seeded-minp", prompts[5], P(temperature=0.7, min_p=0.05, seed=11, max_tokens=8, ignore_eos=True)),
        # stop_token_ids: the 4th greedy token, so it stops at 4 tokens (or earlier at a repeat)
        ("stop-id", prompts[6], P(temperature=0, max_tokens=10, ignore_eos=True, stop_token_ids=[outs[6][3]])),
        # min_tokens bans that stop token until 6 tokens are out
        ("min-tokens", prompts[6], P(temperature=0, max_tokens=10, ignore_eos=True, min_tokens=6,
                                     stop_token_ids=[outs[6][3]])),
        # EOS (the engine's EOS list is set to {2} below): logit_bias makes token 2 win at once...
        ("eos", prompts[7], P(temperature=0, max_tokens=10, logit_bias={2: 100.0})),
        # ...unless min_tokens holds it back for 3 tokens
        ("eos-min", prompts[8], P(temperature=0, max_tokens=10, min_tokens=3, logit_bias={2: 100.0})),
        ("seeded-stop", prompts[9], P(temperature=0.5, seed=3, max_tokens=12, ignore_eos=True,
                                      stop_token_ids=[outs[9][2], outs[9][5]])),
        # penalties count step N's token from the device tensor (overlapped)
        ("penalty", prompts[10], P(temperature=0, max_tokens=8, ignore_eos=True, repetition_penalty=1.3,
                                   presence_penalty=0.5, frequency_penalty=0.7)),
        ("penalty-seeded", prompts[1], P(temperature=1.0, seed=4, max_tokens=8, ignore_eos=True,
                                         repetition_penalty=2.0, frequency_penalty=1.5)),
        # a grammar's matcher needs step N's token on the host: its steps run synchronously
        ("grammar", prompts[2], P(temperature=0, max_tokens=10, ignore_eos=True, constraint=EvenTokens(4))),
        # logprobs are read back with the tokens (overlapped)
        ("logprobs", prompts[11], P(temperature=0, max_tokens=5, ignore_eos=True, logprobs=3)),
        ("logprobs-seeded", prompts[0], P(temperature=1.0, seed=9, max_tokens=6, ignore_eos=True, logprobs=0)),
    ]
    for j in range(3):  # n > 1 as the LLM API makes it: one request per choice, seeds seed + j
        reqs.append((f"n{j}", prompts[5], P(temperature=1.0, seed=20 + j, max_tokens=6, ignore_eos=True)))
    return reqs


def with_eos(make, eos: int = 2):
    def make_eos(async_scheduling: bool, **kw):
        eng = make(async_scheduling, **kw)
        eng.eos_token_ids = [eos]
        return eng

    return make_eos


@pytest.mark.parametrize("config", [
    dict(),  # ample KV, large budget
    dict(max_num_batched_tokens=16),  # chunked prefill
    dict(num_kv_blocks=9, max_num_batched_tokens=64),  # preemption
    dict(max_num_seqs=3),  # requests wait for a free seat
])
def test_same_streams_as_synchronous_engine(tiny, greedy_runs, config):
    prompts, outs = greedy_runs
    requests = mixed_requests(prompts, outs)
    make = with_eos(lambda a, **kw: tiny(a, **config, **kw))
    sync, over, eng = both(make, requests)
    assert over == sync
    ends = {rid: s[-1][3] for rid, s in sync.items()}
    # the endings were really reached (the test exercises what it names)
    assert ends["stop-id"] == "stop" and sync["stop-id"][-1][4] == outs[6][3]
    assert ends["min-tokens"] in ("stop", "length") and len(tokens_of(sync["min-tokens"])) >= 6
    assert ends["eos"] == "stop" and tokens_of(sync["eos"]) == [2]
    assert ends["eos-min"] == "stop" and len(tokens_of(sync["eos-min"])) == 4
    assert [len(tokens_of(sync[r])) for r in ("max0", "max1", "max2")] == [0, 1, 2]
    assert len({tuple(tokens_of(sync[f"n{j}"])) for j in range(3)}) > 1  # different seeds, different draws
    assert ends["grammar"] == "stop" and len(tokens_of(sync["grammar"])) == 4
    assert all(t % 2 == 0 for t in tokens_of(sync["grammar"]))
    # only the grammar request's steps ran synchronously
    assert 0 < eng._overlap.num_sync_steps < eng.num_steps
    if "num_kv_blocks" in config:
        assert eng.get_stats().num_preemptions_total > 0


def test_bias_penalties_min_tokens_logprobs_never_fall_back(tiny, greedy_runs):
    prompts, outs = greedy_runs
    requests = [(f"r{i}", p, SamplingParams(temperature=0 if i % 2 else 0.8, seed=i, max_tokens=5, ignore_eos=True,
                                            min_tokens=2, logit_bias={5: 1.0}, logprobs=i % 3 or None,
                                            repetition_penalty=1.0 + 0.2 * (i % 4), presence_penalty=0.3 * (i % 3),
                                            frequency_penalty=0.4 * (i % 2)))
                for i, p in enumerate(prompts)]
    sync, over, eng = both(tiny, requests)
    assert over == sync
    assert eng._overlap.num_sync_steps == 0
    lps = eng.test_logprobs
    for i in range(len(prompts)):
        k = i % 3 or None
        if k is None:
            assert lps[f"r{i}"] is None
        else:  # the chosen token always, and the top k
            toks = tokens_of(sync[f"r{i}"])
            assert len(lps[f"r{i}"]) == 5 and all(t in e and len(e) in (k, k + 1)
                                                  for t, e in zip(toks, lps[f"r{i}"]))


def test_arrivals_and_aborts_mid_generation(tiny):
    prompts = make_prompts(10, seed=4)
    P = SamplingParams
    requests = [(f"r{i}", p, P(temperature=0 if i % 2 else 0.9, seed=i, max_tokens=15, ignore_eos=True))
                for i, p in enumerate(prompts)]
    arrive_at = {"r3": 2, "r4": 5, "r5": 5, "r6": 9, "r7": 14}
    abort_after = {"r1": 3, "r4": 1, "r6": 7}
    sync, over, eng = both(tiny, requests, arrive_at=arrive_at, abort_after=abort_after)
    assert over == sync
    for rid, k in abort_after.items():
        assert sync[rid][-1] == "aborted" and len(tokens_of(sync[rid])) == k
    assert eng._overlap.pending is None or all(not s.is_finished for s in eng._overlap.pending.rows)


def test_prefix_cache_hits_same_outputs_and_digests(tiny):
    system = list(range(10, 10 + 48))  # 3 full blocks of 16
    requests = [(f"r{i}", system + [100 + i] * (i + 1), SamplingParams(temperature=0, max_tokens=20,
                                                                       ignore_eos=True)) for i in range(4)]
    # r0 fills the cache first; the others arrive later and hit its blocks
    arrive_at = {"r1": 30, "r2": 30, "r3": 31}
    engines = {}

    def make(a):
        engines[a] = tiny(a)
        return engines[a]

    sync, over, _ = both(make, requests, arrive_at=arrive_at)
    assert over == sync
    for a in (False, True):
        assert engines[a].block_manager.prefix_hits >= 3 * 48
    # the same blocks are registered: no digest covers a token computed for a finished request
    assert set(engines[True].block_manager.cached) == set(engines[False].block_manager.cached)


def test_finished_request_keeps_no_extra_token_nor_block(tiny):
    from tokenfab.engine.requests.block_manager import _ROOT, hash_block

    prompt = [5, 6, 7, 8, 9, 10]  # blocks of 4: [5 6 7 8] [9 10 t1 t2]
    engines = {}
    for a in (False, True):
        eng = engines[a] = tiny(a, num_kv_blocks=20, block_size=4)
        eng.eos_token_ids = [2]
        eng.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        seq = eng._seqs["a"]
        outs = []
        while eng.has_unfinished_requests():
            outs += eng.step()
        assert [o.finished for o in outs] == [False, True]
        assert outs[-1].outputs[0].finish_reason == "length"
        out_tokens = outs[-1].outputs[0].token_ids
        assert len(out_tokens) == 2 and PLACEHOLDER not in seq.token_ids
        assert seq.token_ids == prompt + out_tokens
        assert seq.block_table == [] and eng.block_manager.num_free_blocks == 20
    over = engines[True]
    # the 2nd token was its last by count: no step was scheduled after the one that sampled it
    assert over._overlap.num_dropped_tokens == 0 and over.num_steps == engines[False].num_steps == 2
    # an EOS ends the request on the EOS token itself, nothing after it
    for eng in engines.values():
        eng.add_request("b", prompt, SamplingParams(temperature=0, max_tokens=10, min_tokens=1,
                                                    logit_bias={2: 100.0}))
        seq_b = eng._seqs["b"]
        while eng.has_unfinished_requests():
            last = eng.step()
        toks_b = last[-1].outputs[0].token_ids  # min_tokens=1 holds the EOS back for one token
        assert len(toks_b) == 2 and toks_b[-1] == 2 and seq_b.token_ids == prompt + toks_b
        assert seq_b.block_table == [] and eng.block_manager.num_free_blocks == 20
        eng.block_manager.check_invariants()
    # the EOS was known one step late: the step after it ran for b (writing the EOS's K/V, which
    # fills block [9 10 t1 EOS]) and its token was dropped; that block was freed unregistered, so
    # the prefix cache holds what the synchronous engine's does: [5 6 7 8] only
    assert over._overlap.num_dropped_tokens == 1
    assert set(over.block_manager.cached) == set(engines[False].block_manager.cached) \
        == {hash_block(_ROOT, prompt[:4])}


def test_context_end_same_as_synchronous_and_not_scheduled_past_it(tiny):
    prompts = make_prompts(4, seed=8, lo=10, hi=28)
    requests = [(f"r{i}", p, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
                for i, p in enumerate(prompts)]
    sync, over, eng = both(lambda a: tiny(a, max_model_len=32), requests)
    assert over == sync
    assert all(len(p) + len(tokens_of(sync[f"r{i}"])) == 32 for i, p in enumerate(prompts))
    assert all(s[-1][3] == "length" for s in sync.values())
    assert eng._overlap.num_dropped_tokens == 0


def test_next_step_launches_before_tokens_are_read_and_inputs_never_hold_placeholders(tiny):
    eng = tiny(True)
    events: list[str] = []
    orig_execute, orig_resolve = eng.runner.execute, eng._overlap.resolve

    def execute(batch):
        assert bool((batch.input_ids >= 0).all()), "a placeholder reached the model"
        events.append("launch")
        return orig_execute(batch)

    def resolve():
        events.append("read" if eng._overlap.pending is not None else "nothing")
        return orig_resolve()

    eng.runner.execute = execute
    eng._overlap.resolve = resolve
    for i, p in enumerate(make_prompts(3, seed=9)):
        eng.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    # call 1: prefill launched, nothing pending; calls 2..4: step N+1 launched, then step N read;
    # call 5: the 4th tokens end every request by count, so nothing is launched, step 4 is read
    assert events == ["launch", "nothing"] + ["launch", "read"] * 3 + ["read"]


def test_a_failed_overlapped_launch_runs_synchronously(tiny, greedy_runs):
    prompts, _ = greedy_runs
    requests = [(f"r{i}", p, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
                for i, p in enumerate(prompts[:4])]
    sync = drive(tiny(False), requests)
    eng = tiny(True)
    orig = eng.runner.execute
    calls = {"n": 0}

    def flaky(batch):
        calls["n"] += 1
        if calls["n"] == 3:  # the overlapped launch of the 3rd step fails once
            raise RuntimeError("transient")
        return orig(batch)

    eng.runner.execute = flaky
    assert drive(eng, requests) == sync
    assert eng._overlap.num_sync_steps == 1


# ---- the bundled model (tokenizer: stop strings, EOS, text) ----------------------------------------
@pytest.fixture(scope="module")
def bundled():
    engines = {a: LLMEngine(async_scheduling=a, num_kv_blocks=300) for a in (False, True)}
    return lambda a: engines[a]


def test_bundled_model_text_stops_and_eos(bundled):
    eos = bundled(False).eos_token_ids[0]
    P = SamplingParams
    requests = [
        # the model's own EOS id, made likely by logit_bias, held back 2 tokens by min_tokens
        ("eos", "Hello", P(temperature=0, max_tokens=12, min_tokens=2, logit_bias={eos: 100.0})),
        ("stop-str", "The capital of France is", P(temperature=0, max_tokens=12, stop=[" the", "."])),
        ("stop-str-incl", "The capital of France is", P(temperature=0, max_tokens=12, stop=["."],
                                                        include_stop_str_in_output=True)),
        # " Paris" "." ...: min_tokens=3 lets the early "." pass, a later stop string ends it
        ("min-stop", "The capital of France is", P(temperature=0, max_tokens=12, stop=[".", "The"],
                                                   min_tokens=3)),
        ("seeded", "Once upon a time", P(temperature=0.8, seed=5, max_tokens=8)),
        ("max1", "Hello", P(temperature=0, max_tokens=1)),
        ("max2", "Hello", P(temperature=0, max_tokens=2)),
    ]
    sync, over = drive(bundled(False), requests), drive(bundled(True), requests)
    assert over == sync
    assert sync["eos"][-1][3:] == ("stop", eos) and tokens_of(sync["eos"])[-1] == eos
    assert len(tokens_of(sync["eos"])) == 3
    assert sync["stop-str"][-1][3] == "stop" and sync["stop-str"][-1][4] in (" the", ".")
    assert "".join(d[1] for d in sync["stop-str-incl"]).endswith(".")
    assert sync["min-stop"][-1][3] == "stop" and len(tokens_of(sync["min-stop"])) >= 3
    assert "." in "".join(d[1] for d in sync["min-stop"])  # the early "." did not stop it


def test_llm_generate_n_choices(tiny_llama_dir):
    from tokenfab import LLM

    params = SamplingParams(n=3, temperature=1.0, seed=42, max_tokens=7, ignore_eos=True)
    prompts = make_prompts(3, seed=6)
    outs = {}
    for a in (False, True):
        llm = LLM(model=tiny_llama_dir, num_kv_blocks=200, async_scheduling=a)
        outs[a] = [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in llm.generate(prompts, params)]
    assert outs[True] == outs[False]
    assert all(len(o) == 3 for o in outs[True])


def test_flag_off_by_default_and_on_the_cli():
    import argparse

    from tokenfab.engine.args import EngineArgs

    assert EngineArgs().async_scheduling is False
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    assert EngineArgs.from_cli_args(parser.parse_args(["--async-scheduling"])).async_scheduling is True


def test_sample_tokens_stays_on_device_and_matches_sample_next(tiny):
    from tokenfab.engine.requests.sequence import Sequence
    from tokenfab.engine.runner.sampler import sample_next, sample_tokens

    seqs = [Sequence(f"s{i}", None, [1, 2, 3], SamplingParams(temperature=t, seed=i), i)
            for i, t in enumerate((0.0, 1.0, 0.5))]
    logits = torch.randn(3, 320, generator=torch.Generator().manual_seed(0))
    toks = sample_tokens(logits, seqs, [2])
    assert isinstance(toks, torch.Tensor) and toks.dtype == torch.int64
    assert toks.tolist() == sample_next(logits, seqs, [2]).token_ids


def test_bench_engine_compares_async_scheduling_on_and_off(tmp_path):
    import json

    from tokenfab.cli import main

    out = tmp_path / "e.json"
    rc = main(["bench", "engine", "--shape", "tiny", "--device", "cpu", "--num-requests", "3", "--input-len", "6",
               "--output-len", "3", "--decode-tokens", "4", "--skip-hf", "--warmup-requests", "1",
               "--same-process", "--async-scheduling", "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())["results"]
    assert [r["engine"] for r in res] == ["tokenfab eager", "tokenfab eager + async scheduling"]
    assert [r["settings"].get("async_scheduling") for r in res[:2]] == [False, True]
    assert all(r["output_tokens"] == 9 for r in res)


def test_async_engine_streams_match_with_overlap(tiny):
    """The server's front (AsyncEngine, engine thread) over an overlapped engine: 8 concurrent
    streamed requests, one dropped by its consumer after 2 chunks, give the synchronous tokens."""
    import asyncio

    from tokenfab.engine.core.async_engine import AsyncEngine

    prompts = make_prompts(8, seed=12)
    params = [SamplingParams(temperature=0 if i % 2 else 1.0, seed=i, max_tokens=6 + i, ignore_eos=True)
              for i in range(8)]

    def serve(engine):
        front = AsyncEngine(engine)

        async def one(i):
            chunks = []
            async for c in front.generate(prompts[i], params[i], request_id=f"r{i}"):
                chunks.append(c)
                if i == 3 and len(chunks) == 2:
                    break  # the consumer goes away: the request is aborted
            return [t for c in chunks for t in c.delta_token_ids], chunks[-1].finish_reason

        async def main():
            return await asyncio.gather(*(one(i) for i in range(8)))

        try:
            return asyncio.run(asyncio.wait_for(main(), 120))
        finally:
            front.shutdown()

    engines = [tiny(False), tiny(True)]
    sync, over = serve(engines[0]), serve(engines[1])
    assert over == sync
    for eng in engines:
        assert not eng.has_unfinished_requests()
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    assert len(sync[3][0]) == 2 and all(len(t) == 6 + i for i, (t, _) in enumerate(sync) if i != 3)
