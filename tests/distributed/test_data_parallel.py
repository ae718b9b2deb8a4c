"""Data parallelism (engine/core/dp_client.py): the routing rule on fake loads (fast), and two
engine-core replicas of the bundled model behind one client / one server (slow): the greedy
tokens of one engine, both replicas used under concurrent load, a dead replica fails only its own
requests while the other keeps serving, and all dead -> dead."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest

from tests.distributed.engine_client import drain
from tokenfab import LLM, SamplingParams
from tokenfab.engine.core.dp_client import AFFINITY_SLACK, Router, merge_stats, prefix_keys
from tokenfab.engine.requests.errors import EngineDeadError
from tokenfab.engine.requests.stats import EngineStats

BS = 4


def _keys(ids: list[int], salt: str | None = None) -> list[int]:
    return prefix_keys(ids, BS, salt)


# ---- the rule, on fake loads ------------------------------------------------------------------
def test_prefix_keys_cover_full_blocks_only_and_depend_on_salt():
    ids = list(range(10))
    assert len(_keys(ids)) == 2  # 10 tokens: two full blocks of 4
    assert _keys(ids)[:2] == _keys(ids + [99, 98])[:2]  # a longer prompt extends the chain
    assert _keys(ids)[0] != _keys([0, 1, 2, 5] + ids[4:])[0]
    assert _keys(ids, "a") != _keys(ids, "b") != _keys(ids)
    assert _keys([1, 2, 3]) == []


def test_least_loaded_wins_without_affinity_and_ties_alternate():
    r = Router(3)
    assert r.choose([], [5, 2, 7]) == 1
    picks = [r.choose([], [0, 0, 0]) for _ in range(6)]
    assert sorted(picks[:3]) == [0, 1, 2] and picks[3:] == picks[:3]


def test_affinity_holds_unless_the_owner_is_much_busier():
    r = Router(2)
    shared = _keys(list(range(16)))
    assert r.choose(shared, [0, 0]) == 0
    # the same prefix goes back to replica 0 while it is at most max(slack, least) busier
    assert r.choose(shared, [AFFINITY_SLACK, 0]) == 0
    assert r.choose(shared, [10, 6]) == 0  # 10 <= 6 + max(4, 6)
    assert r.affinity_hits == 2
    # much busier: the least-loaded replica takes it, and the prefix now points there
    assert r.choose(shared, [AFFINITY_SLACK + 1, 0]) == 1
    assert r.choose(shared, [3, 3]) == 1
    # a different prompt has no affinity: least loaded
    assert r.choose(_keys(list(range(100, 116))), [0, 2]) == 0


def test_longest_cached_prefix_wins():
    r = Router(2)
    base = list(range(8))
    assert r.choose(_keys(base), [0, 1]) == 0
    assert r.choose(_keys(base + [50, 51, 52, 53]), [2, 0]) == 0  # shares 2 blocks with replica 0
    r.record(_keys(base + [60, 61, 62, 63]), 1)  # a 3-block prefix last sent to replica 1
    assert r.choose(_keys(base + [60, 61, 62, 63, 70, 71, 72, 73]), [0, 0]) == 1


def test_dead_replicas_are_skipped_and_all_dead_raises():
    r = Router(2)
    keys = _keys(list(range(8)))
    assert r.choose(keys, [0, 0]) == 0
    assert r.choose(keys, [None, 9]) == 1  # its affinity replica is dead
    with pytest.raises(EngineDeadError):
        r.choose(keys, [None, None])


def test_merged_stats_sum_counts_and_weigh_kv_usage():
    def stats(running: int, used: int, total: int) -> EngineStats:
        return EngineStats(num_running=running, num_waiting=1, kv_cache_usage=used / total, num_used_blocks=used,
                           num_total_blocks=total, kv_cache_tokens=total * 16, prompt_tokens_total=10,
                           generation_tokens_total=5, computed_prompt_tokens_total=10, num_preemptions_total=0,
                           prefix_cache_hit_rate=0.5, num_steps=3, last_step_num_seqs=1,
                           last_step_prefill_tokens=0, last_step_decode_tokens=1)

    m = merge_stats([stats(2, 10, 100), stats(3, 30, 100)])
    assert (m.num_running, m.num_waiting, m.generation_tokens_total) == (5, 2, 10)
    assert m.kv_cache_usage == pytest.approx(0.2) and m.prefix_cache_hit_rate == pytest.approx(0.5)


# ---- two replicas of the bundled model -------------------------------------------------------
PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three colors:", "Once upon a time",
           "The best way to learn is", "2 + 2 =", "My favourite food is", "The sky is"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    llm = LLM(max_model_len=256)
    outs = llm.generate(PROMPTS, GREEDY)
    del llm
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.slow
def test_two_replicas_same_tokens_both_used_and_a_dead_replica_fails_only_its_requests(expected):
    from tokenfab.engine.args import EngineArgs
    from tokenfab.engine.core.dp_client import DPClient

    client = DPClient.spawn(EngineArgs(max_model_len=256, data_parallel_size=2))
    try:
        for i, p in enumerate(PROMPTS):  # all at once: the least-loaded rule spreads them
            client.add_request(f"r{i}", p, GREEDY)
        done = drain(client, {f"r{i}" for i in range(len(PROMPTS))})
        assert [done[f"r{i}"].outputs[0].token_ids for i in range(len(PROMPTS))] == expected
        assert min(client.router.routed) >= 2, client.router.routed
        stats = client.get_stats()
        assert stats.num_total_blocks == sum(c.get_stats().num_total_blocks for c in client.clients)
        # a replica dies with requests in flight: they fail with the reason, the others finish
        long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        for i in range(4):
            client.add_request(f"long{i}", PROMPTS[i], long)
        owners = {rid: r for rid, r in client.owner.items()}
        assert set(owners.values()) == {0, 1}
        client.step(200)
        os.kill(client.clients[1].core_pid, signal.SIGKILL)
        done = drain(client, set(owners), timeout=600)
        assert set(done) == set(owners)
        for rid, r in owners.items():
            co = done[rid].outputs[0]
            if r == 1:
                assert co.finish_reason == "error" and "replica 1" in done[rid].error
            else:
                assert co.finish_reason == "length" and len(co.token_ids) == 40
        assert not client.is_dead
        client.add_request("after", PROMPTS[0], GREEDY)  # routed around the dead replica
        assert client.owner["after"] == 0
        assert drain(client, {"after"})["after"].outputs[0].token_ids == expected[0]
        os.kill(client.clients[0].core_pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not client.is_dead and time.monotonic() < deadline:
            time.sleep(0.1)
        assert client.is_dead
        with pytest.raises(EngineDeadError):
            client.add_request("late", PROMPTS[0], GREEDY)
    finally:
        client.close()


@pytest.mark.slow
def test_serve_data_parallel_2_streams_the_one_engine_tokens(expected):
    from tests.server.test_cli_server import API_KEY, ServeProcess
    from tokenfab.engine.core.client import load_tokenizer

    tok = load_tokenizer(None)
    texts = [tok.decode(ids) for ids in expected]
    server = ServeProcess("--data-parallel-size", "2", "--max-model-len", "256", "--no-access-log")
    try:
        with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=600) as c:
            for k, (prompt, text) in enumerate(zip(PROMPTS, texts)):
                body = {"prompt": prompt, "max_tokens": 8, "temperature": 0.0, "stream": bool(k % 2)}
                if not body["stream"]:
                    r = c.post("/v1/completions", json=body)
                    assert r.status_code == 200, r.text
                    assert r.json()["choices"][0]["text"] == text
                    continue
                got = ""
                with c.stream("POST", "/v1/completions", json=body) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            got += json.loads(line[6:])["choices"][0]["text"]
                assert got == text
            metrics = c.get("/metrics").text
        assert httpx.get(f"{server.url}/health").status_code == 200
        gen = [ln for ln in metrics.splitlines() if ln.startswith("tokenfab") and "generation_tokens" in ln]
        assert gen and float(gen[0].split()[-1]) >= 8 * len(PROMPTS)  # summed over both replicas
    finally:
        server.stop()
