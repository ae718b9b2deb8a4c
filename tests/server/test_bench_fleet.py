"""`tokenfab bench fleet`'s workload and counters through a real router over three fake-engine workers (fast tier;
the command itself starts real replicas, run for ``benchmarks/results/fleet_cpu_bundled.md``)."""

from __future__ import annotations

import argparse
import json

import pytest

from tests.server.router_harness import router, router_binary, workers
from tokenfab.bench.fleet import _prefix_counters, _workload, add_arguments


def test_fleet_workload_through_a_router():
    if router_binary("vllm-router") is None:
        pytest.skip("vllm-router is not installed (pip install vllm-router)")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--conversations", "5", "--turns", "3", "--system-words", "10", "--max-tokens", "3"])
    with workers() as ws, router("vllm-router", "round_robin", [w.url for w in ws]) as base:
        assert _prefix_counters([w.url for w in ws]) == (0.0, 0.0)  # the fake engine reports no prefix cache
        ttfts = _workload(base, "fake-model", args, tag="t1")
        assert len(ttfts) == 15 and all(t > 0 for t in ttfts)
        bodies = [json.loads(b) for w in ws for b in w.bodies]
        assert len(bodies) == 15 and [len(w.bodies) for w in ws] == [5, 5, 5]
        for k in range(5):  # every turn carries the conversation so far, answers included
            turns = sorted((b for b in bodies if f"You are assistant {k}." in b["messages"][0]["content"]),
                           key=lambda b: len(b["messages"]))
            assert [len(b["messages"]) for b in turns] == [2, 4, 6]
            assert all(b["messages"][0]["content"].startswith("[t1]") for b in turns)
            assert turns[2]["messages"][2]["role"] == "assistant" and turns[2]["messages"][2]["content"]
            # round_robin over 3 replicas with 5 conversations: a conversation's turns land on different replicas
            assert len({i for i, w in enumerate(ws) for b in w.bodies
                        if json.loads(b)["messages"][0]["content"] == turns[0]["messages"][0]["content"]}) > 1
