"""`tokenfab bench throughput` runs end to end (tiny model, two interleaved rounds) and writes
a report whose ratio is the median of the rounds' ratios. Speed itself is never asserted."""

from __future__ import annotations

import json
import os
import statistics

from tokenfab.cli import main


def test_bench_throughput_rounds_and_report(tiny_llama_dir, tmp_path):
    out = tmp_path / "report.json"
    rc = main(["bench", "throughput", "--model", tiny_llama_dir, "--num-requests", "3", "--min-prompt-len", "4",
               "--max-prompt-len", "9", "--output-len", "5", "--hf-batch-sizes", "2,3", "--repeats", "2",
               "--same-process", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert len(report["rounds"]) == 2
    for rnd in report["rounds"]:
        engines = [r["engine"] for r in rnd["results"]]
        assert engines == ["tokenfab", "transformers (batch 2)", "transformers (batch 3)"]
        assert all(r["output_tokens"] == 15 for r in rnd["results"])  # every engine made every token
        best = max(rnd["results"][1:], key=lambda r: r["output_tok_s"])
        assert rnd["best_peer"] == best["engine"]
        assert abs(rnd["ratio"] - rnd["results"][0]["output_tok_s"] / best["output_tok_s"]) < 1e-9
    assert report["ratio_vs_best_peer"] == statistics.median(report["ratios"])
    assert report["isolation"] == "one process for everything"


def test_bench_throughput_engines_in_fresh_processes(tiny_llama_dir, tmp_path):
    """The default: each engine run is spawned in its own process and reports back from there."""
    out = tmp_path / "report.json"
    rc = main(["bench", "throughput", "--model", tiny_llama_dir, "--num-requests", "2", "--min-prompt-len", "4",
               "--max-prompt-len", "6", "--output-len", "3", "--hf-batch-sizes", "2", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["isolation"] == "a fresh process per engine run"
    (rnd,) = report["rounds"]
    assert [r["engine"] for r in rnd["results"]] == ["tokenfab", "transformers (batch 2)"]
    assert all(r["output_tokens"] == 6 for r in rnd["results"])
    pids = {r["pid"] for r in rnd["results"]}
    assert len(pids) == 2 and os.getpid() not in pids
