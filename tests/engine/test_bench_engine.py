"""`tokenfab bench engine` on CPU (the tiny shape; the command is for GPUs): the peer's batch size is
swept, each engine runs in its own fresh process after a warm-up on prompts that are never
measured, and the throughput ratio is against the peer's best batch size. Speed is never asserted."""

from __future__ import annotations

import json
import os

import pytest

from tokenfab.bench import engine
from tokenfab.cli import main


def test_bench_engine_sweeps_the_peer(tmp_path):
    out = tmp_path / "e.json"
    rc = main(["bench", "engine", "--shape", "tiny", "--device", "cpu", "--num-requests", "3", "--input-len", "6",
               "--output-len", "3", "--decode-tokens", "4", "--hf-batch-sizes", "2,all", "--warmup-requests", "2",
               "--same-process", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["workload"]["peer_batch_sizes"] == [2, 3]
    res = report["results"]
    assert [r["engine"] for r in res] == ["tokenfab eager", "transformers (batch 2)", "transformers (batch 3)"]
    assert all(r["output_tokens"] == 9 for r in res)
    assert res[1]["batch1_decode_tok_s"] > 0 and res[2]["batch1_decode_tok_s"] is None  # measured once
    assert all(r["settings"]["param_dtypes"] == ["torch.float32"] for r in res[1:])
    assert all("2 fresh prompts" in r["settings"]["warmup"] for r in res)
    best = max(res[1:], key=lambda r: r["output_tok_s"])
    ratios = report["ratios_vs_transformers"]
    assert ratios["best_peer"] == best["engine"]
    assert ratios["throughput"] == pytest.approx(res[0]["output_tok_s"] / best["output_tok_s"])


def test_bench_engine_runs_our_engine_in_a_fresh_process(tmp_path):
    """The fresh-process path with one engine (one spawned process, not two); the slow twin below runs both."""
    out = tmp_path / "e.json"
    rc = main(["bench", "engine", "--shape", "tiny", "--device", "cpu", "--num-requests", "2", "--input-len", "4",
               "--output-len", "2", "--decode-tokens", "2", "--skip-hf", "--warmup-requests", "1",
               "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["isolation"] == "each engine in a fresh process"
    assert [r["engine"] for r in report["results"]] == ["tokenfab eager"]
    assert report["results"][0]["output_tokens"] == 4
    assert report["results"][0]["pid"] != os.getpid()


@pytest.mark.slow
def test_bench_engine_runs_each_engine_in_a_fresh_process(tmp_path):
    out = tmp_path / "e.json"
    rc = main(["bench", "engine", "--shape", "tiny", "--device", "cpu", "--num-requests", "2", "--input-len", "4",
               "--output-len", "2", "--decode-tokens", "2", "--hf-batch-sizes", "all", "--warmup-requests", "1",
               "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["isolation"] == "each engine in a fresh process"
    pids = [r["pid"] for r in report["results"]]
    assert len(set(pids)) == 2 and os.getpid() not in pids


def test_warmup_prompts_are_never_measured(monkeypatch, tmp_path):
    seen = {}

    def fake_tokenfab(path, args, work, eager):
        seen.update(work)
        return {"engine": "tokenfab eager", "batch1_decode_tok_s": 1.0, "output_tok_s": 1.0, "seconds": 1.0,
                "output_tokens": 1}

    monkeypatch.setattr(engine, "_tokenfab", fake_tokenfab)
    rc = main(["bench", "engine", "--shape", "tiny", "--device", "cpu", "--num-requests", "4", "--input-len", "5",
               "--skip-hf", "--same-process", "--warmup-requests", "3"])
    assert rc == 0
    assert len(seen["prompts"]) == 4 and len(seen["warm"]) == 3
    assert not any(p in seen["prompts"] for p in seen["warm"] + [seen["batch1"]])
