"""Speculative decoding in the engine (tokenfab/speculative/step.py) on the bundled model.

The reference is the same engine without speculation: greedy outputs (token ids, text, finish
reason) must be identical, alone and batched, with prefix caching, chunked prefill, preemption and
overlap scheduling. Two proposers: the n-gram proposer, and an oracle that proposes the target's own
greedy continuation (recorded from a plain run), where acceptance must be 1.0 and every verify step
must emit k + 1 tokens. An oracle whose drafts all go wrong after the first token (a corrupting
proposer) exercises rejection and the KV rollback. Stops inside an accepted run (stop strings,
stop ids, max_tokens) must cut exactly where plain decoding cuts.

If a greedy comparison fails on a near-tie, the verify rows (k + 1 query tokens) did not get the
logits a plain decode step gives: that is the batch-invariance property of the CPU kernels.
"""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from tokenfab import LLM, SamplingParams
from tokenfab.engine.args import EngineArgs
from tokenfab.engine.llm_engine import LLMEngine
from tokenfab.engine.requests.sequence import Sequence
from tokenfab.speculative.config import SpeculativeConfig
from tokenfab.speculative.ngram import NgramProposer
from tokenfab.speculative.step import make_proposer

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PASSAGES = [
    "The river rose slowly through the night, and by morning the low fields were under water.",
    "Copy this list: apples, pears, plums, cherries, apples, pears, plums, cherries.",
    "Tokenfab runs language models on a paged cache; each block holds sixteen tokens.",
    "In 1887 the bridge was finished. It was the longest bridge in the country for forty years.",
]


def prompts_mixed(llm: LLM) -> list[list[int]]:
    """8 prompts of mixed lengths: 4 chat requests that ask to repeat a passage (n-gram hits) and 4
    random token prompts (3 .. 90 tokens)."""
    out = [llm.apply_chat_template([{"role": "user", "content": f"Repeat exactly: {p}"}]) for p in PASSAGES]
    rng = random.Random(7)
    out += [[rng.randrange(100, 20000) for _ in range(n)] for n in (3, 17, 45, 90)]
    return out


def run(llm: LLM, prompts, params) -> list[tuple]:
    outs = llm.generate(prompts, params)
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]


class OracleProposer:
    """Proposes the target's own greedy continuation, recorded from a plain run (a same-model
    self-draft); ``corrupt``: every draft but the first is shifted, so it is rejected."""

    def __init__(self, prompts, outputs, corrupt: bool = False) -> None:
        self.refs = {tuple(p): list(o[0]) for p, o in zip(prompts, outputs)}
        self.corrupt = corrupt
        self.released: list[str] = []

    def propose(self, seq: Sequence, k: int) -> list[int]:
        ref = self.refs.get(tuple(seq.prompt_token_ids))
        n = seq.num_output_tokens
        if ref is None or ref[:n] != seq.output_token_ids:
            return []
        draft = ref[n : n + k]
        if self.corrupt:
            draft = draft[:1] + [(t + 1) % 49152 for t in draft[1:]]
        return draft

    def release(self, request_id: str) -> None:
        self.released.append(request_id)


@pytest.fixture(scope="module")
def plain():
    return LLM(num_kv_blocks=400)


@pytest.fixture(scope="module")
def spec():
    return LLM(num_kv_blocks=400, speculative_config=NGRAM)


# tokens per request of the shared reference run: 16 in the fast tier (1 from prefill + 3 verify steps of k + 1),
# 24 in its slow twin (every test that uses the reference runs again with it)
@pytest.fixture(scope="module", params=[16, pytest.param(24, marks=pytest.mark.slow)])
def reference(plain, request):
    prompts = prompts_mixed(plain)
    params = SamplingParams(temperature=0, max_tokens=request.param)
    return prompts, params, run(plain, prompts, params)


def with_proposer(llm: LLM, proposer):
    """Swap the engine's proposer (and reset its counters) for one test."""
    eng = llm.engine
    old = eng.spec.proposer
    eng.spec.proposer = proposer
    for name in ("num_draft_tokens", "num_accepted_tokens", "num_verified", "num_spec_steps"):
        setattr(eng.spec, name, 0)
    return old


# ---- greedy identity ---------------------------------------------------------------------------
def test_ngram_greedy_identical_alone_and_batched(spec, reference):
    prompts, params, ref = reference
    before = spec.engine.get_stats()
    for i in (0, 4):  # alone
        assert run(spec, [prompts[i]], params) == [ref[i]], i
    assert run(spec, prompts, params) == ref  # batched, mixed lengths
    st = spec.engine.get_stats()
    assert st.spec_verified_total > before.spec_verified_total
    assert st.spec_accepted_tokens_total > before.spec_accepted_tokens_total  # the n-gram path was reached
    assert 0 < st.spec_acceptance_rate <= 1 and st.spec_mean_accepted_length > 1
    bm = spec.engine.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks


def test_suffix_greedy_identical_batched(spec, reference):
    prompts, params, ref = reference
    cfg = SpeculativeConfig.parse({"method": "suffix", "num_speculative_tokens": 4})
    old = with_proposer(spec, make_proposer(cfg))
    try:
        assert run(spec, prompts, params) == ref
        assert run(spec, prompts[:4], params) == ref[:4]  # again: the global tree now holds these outputs
        assert spec.engine.spec.num_verified > 0 and spec.engine.spec.num_accepted_tokens > 0
    finally:
        spec.engine.spec.proposer = old


def test_oracle_self_draft_accepts_everything(spec, plain):
    prompt = prompts_mixed(plain)[0]
    params = SamplingParams(temperature=0, max_tokens=21, ignore_eos=True)  # 1 from prefill + 4 x (k+1)
    ref = run(plain, [prompt], params)
    old = with_proposer(spec, OracleProposer([prompt], ref))
    try:
        assert run(spec, [prompt], params) == ref
        s = spec.engine.spec
        assert s.num_verified == 4 and s.num_draft_tokens == 16
        st = spec.engine.get_stats()
        assert st.spec_acceptance_rate == 1.0
        assert st.spec_mean_accepted_length == 5.0  # k + 1
    finally:
        spec.engine.spec.proposer = old


def test_oracle_batched_and_rejections_roll_back(spec, reference):
    prompts, params, ref = reference
    for corrupt in (False, True):
        oracle = OracleProposer(prompts, ref, corrupt)
        old = with_proposer(spec, oracle)
        try:
            assert run(spec, prompts, params) == ref, corrupt
            s = spec.engine.spec
            assert s.num_verified > 0
            if corrupt:  # the first draft stands, the rest is rolled back
                assert 0 < s.num_accepted_tokens < s.num_draft_tokens
            else:
                assert s.num_accepted_tokens == s.num_draft_tokens
            assert len(oracle.released) == len(prompts)  # every finished request released its state
        finally:
            spec.engine.spec.proposer = old
        bm = spec.engine.block_manager
        bm.check_invariants()
        assert bm.num_free_blocks == bm.num_blocks


def test_prefix_cache_over_speculated_tokens(spec, plain, reference):
    """A follow-up whose prompt is an earlier request's prompt + output hits blocks that were filled
    by speculative steps: their digests must cover the accepted tokens only, or the output changes."""
    prompts, params, ref = reference
    spec.engine.block_manager.reset_prefix_cache()  # only this run's blocks can hit
    old = with_proposer(spec, OracleProposer(prompts, ref, corrupt=True))
    try:
        assert run(spec, prompts[:2], params) == ref[:2]
    finally:
        spec.engine.spec.proposer = old
    follow = [prompts[i] + list(ref[i][0]) for i in range(2)]
    hits = spec.engine.block_manager.prefix_hits
    assert run(spec, follow, params) == run(plain, follow, params)
    # blocks full of generated tokens hit too (the last step's drafts aside: at most k)
    want = sum((len(f) - 1 - 4) // 16 for f in follow)  # full blocks, but the last step's drafts
    assert spec.engine.block_manager.prefix_hits - hits >= 16 * want


def test_chunked_prefill_preemption_and_prefix_caching(reference):
    prompts, params, ref = reference
    llm = LLM(num_kv_blocks=16, max_num_batched_tokens=32, enable_prefix_caching=True,
              speculative_config=NGRAM)
    assert run(llm, prompts, params) == ref
    st = llm.engine.get_stats()
    assert st.num_preemptions_total > 0  # the tiny cache made it preempt
    assert st.spec_verified_total > 0
    oracle = OracleProposer(prompts, ref)
    llm.engine.spec.proposer = oracle
    assert run(llm, prompts + prompts[:2], params) == ref + ref[:2]  # again: prefix hits, drafts of 4
    bm = llm.engine.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks


def test_async_scheduling_with_speculation(reference):
    prompts, params, ref = reference
    llm = LLM(num_kv_blocks=400, async_scheduling=True, speculative_config=NGRAM)
    assert run(llm, prompts, params) == ref
    assert llm.engine.get_stats().spec_verified_total > 0


# ---- stops inside an accepted run --------------------------------------------------------------
def test_stops_cut_inside_accepted_runs(spec, plain):
    prompts = prompts_mixed(plain)[:2]
    base = run(plain, prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    P = SamplingParams
    cases = []
    for i, (toks, text, _) in enumerate(base):
        words = text.split()
        stop_word = words[min(5, len(words) - 1)] if words else "the"
        cases += [
            (prompts[i], P(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop_word])),
            (prompts[i], P(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop_word],
                           include_stop_str_in_output=True)),
            (prompts[i], P(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[toks[7]])),
            (prompts[i], P(temperature=0, max_tokens=3 + i)),  # max_tokens inside a run of k + 1
            (prompts[i], P(temperature=0, max_tokens=20)),  # the model's EOS
        ]
    ps, params = [c[0] for c in cases], [c[1] for c in cases]
    ref = run(plain, ps, params)
    old = with_proposer(spec, OracleProposer(prompts, base))
    try:
        assert run(spec, ps, params) == ref
        assert spec.engine.spec.num_verified > 0
    finally:
        spec.engine.spec.proposer = old
    assert run(spec, ps, params) == ref  # n-gram


# ---- opt-out, sampling, config -----------------------------------------------------------------
def test_per_request_opt_out(spec, reference):
    prompts, params, ref = reference
    opted = [dataclasses.replace(params, speculative=False)] * len(prompts)
    old = with_proposer(spec, OracleProposer(prompts, ref))
    try:
        assert run(spec, prompts, opted) == ref
        assert spec.engine.spec.num_verified == 0
        # requests that return logprobs or edit logits are decoded plainly, beside speculated ones
        mixed = [params, dataclasses.replace(params, logprobs=2), dataclasses.replace(params, logit_bias={5: 0.0}),
                 params]
        outs = spec.generate(prompts[:4], mixed)
        assert [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs] == ref[:4]
        assert len(outs[1].outputs[0].logprobs) == len(ref[1][0])
        assert spec.engine.spec.num_verified > 0
    finally:
        spec.engine.spec.proposer = old


def test_seeded_sampling_is_reproducible(spec, plain):
    """Point-mass drafts use the coupled form of the rule (speculative/accept.py): a seeded sampled request
    emits exactly the tokens it emits without speculation."""
    prompts = prompts_mixed(spec)[:2]
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=123, max_tokens=24)
    verified = spec.engine.spec.num_verified
    a, b = run(spec, [prompts[1]] * 2, params)
    assert a == b and len(a[0]) > 0
    assert run(spec, prompts, params) == run(plain, prompts, params)
    assert spec.engine.spec.num_verified > verified


@pytest.mark.parametrize("bad, match", [
    ({"method": "medusa"}, "method must be one of"),
    ({"method": "draft_model"}, "model is required"),
    ({"method": "eagle3"}, "model is required"),
    ({"method": "mtp", "model": "x"}, "must not be set"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": "4"}, "num_speculative_tokens"),
    ({"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "ngram", "num_specualtive_tokens": 4}, "unknown key"),
    ({"num_speculative_tokens": 4}, "method is required"),
    ("{not json", "not valid JSON"),
    ("[1, 2]", "JSON object"),
])
def test_bad_config_is_a_clear_error(bad, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.parse(bad)
    with pytest.raises(ValueError, match=match):  # before the model is loaded
        LLMEngine(EngineArgs(model="/nonexistent", speculative_config=bad))


def test_config_parsing_and_cli():
    cfg = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (cfg.method, cfg.num_speculative_tokens) == ("ngram", 3)
    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse("") is None
    import argparse

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    ns = parser.parse_args(["--speculative-config", json.dumps(NGRAM)])
    args = EngineArgs.from_cli_args(ns)
    assert SpeculativeConfig.parse(args.speculative_config).prompt_lookup_max == 3
    json.dumps(dataclasses.asdict(args))  # the engine-core process gets its args as JSON
    with pytest.raises(ValueError, match="speculative must be a boolean"):
        SamplingParams(speculative="no")


# ---- the n-gram proposer -----------------------------------------------------------------------
def seq_of(tokens: list[int], rid: str = "r") -> Sequence:
    return Sequence(rid, None, tokens, SamplingParams(), 0)


def test_ngram_longest_and_latest_match():
    p = NgramProposer(1, 3)
    # suffix [1, 2, 3] occurred once (followed by 9, 9); [2, 3] later followed by 7
    s = seq_of([1, 2, 3, 9, 9, 5, 2, 3, 7, 4, 1, 2, 3])
    assert p.propose(s, 2) == [9, 9]  # the longest n wins over a later shorter match
    s2 = seq_of([4, 2, 3, 8, 6, 2, 3, 7, 5, 2, 3], "r2")
    assert p.propose(s2, 3) == [7, 5, 2]  # the latest occurrence
    assert p.propose(seq_of([1, 2, 3, 4], "r3"), 3) == []  # no earlier occurrence
    assert p.propose(s2, 0) == []


def test_ngram_incremental_index_matches_fresh():
    rng = random.Random(3)
    toks = [rng.randrange(6) for _ in range(40)]
    inc = NgramProposer(2, 4)
    s = seq_of(toks[:5])
    for t in toks[5:]:
        s.token_ids.append(t)
        assert inc.propose(s, 4) == NgramProposer(2, 4).propose(seq_of(list(s.token_ids), "fresh"), 4)
    inc.release("r")
    assert "r" not in inc._index


# ---- server: the per-request key and /metrics ---------------------------------------------------
def test_server_extra_body_and_metrics():
    from tokenfab.engine.llm_engine import EngineStats
    from tokenfab.server.metrics import ServerMetrics
    from tokenfab.server.protocol import ChatCompletionRequest, CompletionRequest

    body = CompletionRequest.model_validate({"prompt": "hi", "speculative": False})
    assert body.speculative is False
    assert ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}]}).speculative
    stats = EngineStats(*([0] * 15), spec_draft_tokens_total=40, spec_accepted_tokens_total=30,
                        spec_acceptance_rate=0.75, spec_mean_accepted_length=2.5, spec_verify_seconds_total=1.5)
    text = ServerMetrics("m", lambda: stats).render().decode()
    assert 'tokenfab_spec_decode_acceptance_rate{model_name="m"} 0.75' in text
    assert 'tokenfab_spec_decode_mean_accepted_length{model_name="m"} 2.5' in text
    assert 'tokenfab_spec_decode_num_accepted_tokens_total{model_name="m"} 30.0' in text
    assert "tokenfab_spec_decode_verify_seconds_total" in text and "tokenfab_spec_decode_draft_seconds" in text
