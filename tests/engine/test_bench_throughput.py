"""`tokenfab bench throughput` runs end to end (tiny model): both engines warm up on prompts the
measured set does not hold, the peer's batch sizes are swept, both processes share the allocator
setting, and the report gives every round plus the conservative ratios. Speed is never asserted."""

from __future__ import annotations

import json
import os
import statistics

import pytest
import torch

from tokenfab.bench import throughput
from tokenfab.cli import main
from tokenfab.engine.llm import LLM


def test_peer_batch_sizes():
    assert throughput.peer_batch_sizes("8,16,32,64,all", 64) == [8, 16, 32, 64]
    assert throughput.peer_batch_sizes("8, 16, all", 10) == [8, 10]  # capped at the request count
    assert throughput.peer_batch_sizes("all,2", 3) == [3, 2]
    assert throughput.peer_batch_sizes("", 3) == []
    with pytest.raises(ValueError):
        throughput.peer_batch_sizes("0", 3)


def test_check_peer_dtype():
    model = torch.nn.Linear(2, 2).to(torch.bfloat16)
    assert throughput.check_peer_dtype(model, torch.bfloat16) == ["torch.bfloat16"]
    model.bias.data = model.bias.data.float()  # one parameter left in float32
    with pytest.raises(RuntimeError, match="float32"):
        throughput.check_peer_dtype(model, torch.bfloat16)

    class PackedLinear(torch.nn.Module):  # a quantized layer: packed bytes and its own kernel
        def __init__(self):
            super().__init__()
            self.register_buffer("qweight", torch.zeros(4, dtype=torch.uint8))
            self.scale = torch.nn.Parameter(torch.ones(1))

    with pytest.raises(RuntimeError, match="PackedLinear"):
        throughput.check_peer_dtype(torch.nn.Sequential(torch.nn.Linear(2, 2), PackedLinear()), torch.float32)


def test_summarize_conservative_ratios():
    def rnd(ours, *peers):
        res = [{"output_tok_s": ours}] + [{"output_tok_s": p} for p in peers]
        return {"results": res, "ratio": ours / max(peers)}

    s = throughput.summarize([rnd(200, 100, 50), rnd(180, 120), rnd(210, 90)])
    assert s["ratios"] == [2.0, 1.5, 210 / 90]
    assert s["ratio_median"] == 2.0 and s["ratio_min"] == 1.5
    assert s["ratio_vs_peer_best_run"] == 200 / 120  # our median against the peer's best single run
    assert s["conservative_ratio"] == 1.5


def test_bench_throughput_rounds_warmup_and_report(tiny_llama_dir, tmp_path, monkeypatch):
    ours_calls, peer_calls = [], []
    real_generate, real_hf = LLM.generate, throughput._hf_generate

    def spy_generate(self, prompts, *a, **kw):
        ours_calls.append([list(p) for p in prompts])
        return real_generate(self, prompts, *a, **kw)

    def spy_hf(hf, prompts, batch_size, new_tokens, device):
        peer_calls.append(([list(p) for p in prompts], batch_size, new_tokens))
        return real_hf(hf, prompts, batch_size, new_tokens, device)

    monkeypatch.setattr(LLM, "generate", spy_generate)
    monkeypatch.setattr(throughput, "_hf_generate", spy_hf)
    out = tmp_path / "report.json"
    rc = main(["bench", "throughput", "--model", tiny_llama_dir, "--num-requests", "3", "--min-prompt-len", "4",
               "--max-prompt-len", "9", "--output-len", "5", "--hf-batch-sizes", "2,all", "--repeats", "2",
               "--warmup-requests", "2", "--warmup-tokens", "3", "--same-process", "--json", str(out),
               "--markdown", str(tmp_path / "report.md")])
    assert rc == 0
    # each engine ran: warm-up (2 fresh prompts, 3 tokens), then the 3 measured prompts
    assert len(ours_calls) == 4 and len(peer_calls) == 8
    warm, measured = ours_calls[0], ours_calls[1]
    assert len(warm) == 2 and len(measured) == 3
    assert not any(p in measured for p in warm)  # the warm-up never saw a measured prompt
    for i in range(0, 8, 2):
        (pw, bs_w, nw), (pm, bs_m, nm) = peer_calls[i], peer_calls[i + 1]
        assert sorted(pw) == sorted(warm) and nw == 3 and sorted(pm) == sorted(measured) and nm == 5
        assert bs_w == bs_m in (2, 3)

    report = json.loads(out.read_text())
    assert report["workload"]["peer_batch_sizes"] == [2, 3]
    assert len(report["rounds"]) == 2
    for rnd in report["rounds"]:
        engines = [r["engine"] for r in rnd["results"]]
        assert engines == ["tokenfab", "transformers (batch 2)", "transformers (batch 3)"]
        assert all(r["output_tokens"] == 15 for r in rnd["results"])  # every engine made every token
        best = max(rnd["results"][1:], key=lambda r: r["output_tok_s"])
        assert rnd["best_peer"] == best["engine"]
        assert abs(rnd["ratio"] - rnd["results"][0]["output_tok_s"] / best["output_tok_s"]) < 1e-9
        for r in rnd["results"]:
            assert r["settings"]["torch_threads"] == torch.get_num_threads()
            assert "2 fresh prompts x 3 tokens" in r["settings"]["warmup"]
        for r in rnd["results"][1:]:
            assert r["settings"]["param_dtypes"] == [rnd["results"][0]["settings"]["dtype"]]
    s = report["summary"]["tuned"]
    assert report["ratio_vs_best_peer"] == statistics.median(report["ratios"]) == s["ratio_median"]
    assert s["ratio_min"] == min(report["ratios"]) and report["conservative_ratio"] <= s["ratio_min"]
    assert report["isolation"] == "one process for everything"
    md = (tmp_path / "report.md").read_text()
    assert "worst round" in md and "- transformers (batch 3): " in md and "param_dtypes=" in md


@pytest.mark.slow
def test_bench_throughput_fresh_processes_both_allocator_settings(tiny_llama_dir, tmp_path):
    """The default: each engine run is spawned in its own process; --allocator both runs every
    round with glibc tuned in both processes and in neither.

    Slow (four spawned interpreters, each importing torch and transformers). Fast twins: the
    spawning helper (throughput.in_fresh_process) runs in
    tests/engine/test_bench_engine.py::test_bench_engine_runs_each_engine_in_a_fresh_process, the
    rounds and report in test_bench_throughput_rounds_warmup_and_report (--same-process), glibc
    tuning in tests/engine/test_cpu_setup.py::test_allocator_tuning."""
    out = tmp_path / "report.json"
    rc = main(["bench", "throughput", "--model", tiny_llama_dir, "--num-requests", "2", "--min-prompt-len", "4",
               "--max-prompt-len", "6", "--output-len", "3", "--hf-batch-sizes", "2", "--warmup-requests", "1",
               "--warmup-tokens", "2", "--allocator", "both", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["isolation"] == "a fresh process per engine run"
    assert [r["allocator"] for r in report["rounds"]] == ["tuned", "default"]
    pids = set()
    for rnd in report["rounds"]:
        assert [r["engine"] for r in rnd["results"]] == ["tokenfab", "transformers (batch 2)"]
        assert all(r["output_tokens"] == 6 for r in rnd["results"])
        tuned = rnd["allocator"] == "tuned" and os.environ.get("TOKENFAB_CPU_MALLOC_TUNING", "1") != "0"
        assert [r["settings"]["allocator_tuned"] for r in rnd["results"]] == [tuned, tuned]
        pids |= {r["pid"] for r in rnd["results"]}
    assert len(pids) == 4 and os.getpid() not in pids
    assert set(report["summary"]) == {"tuned", "default"}
