"""`tokenfab bench serve` against the live server (tiny workload: it is a command, not a benchmark here)."""

from __future__ import annotations

import json

from tokenfab.bench.serve import markdown_table
from tokenfab.cli import main


def test_bench_serve_reports_table_json_and_plot(served, tmp_path, capsys):
    out_json, out_png = tmp_path / "serve.json", tmp_path / "serve.png"
    rc = main(["bench", "serve", "--base-url", f"{served.url}/v1", "--concurrency", "1,2", "--num-requests", "2",
               "--input-len", "16", "--output-len", "3", "--json", str(out_json), "--plot", str(out_png)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "| concurrency |" in printed and "TTFT p50 / p90 / p99 (ms)" in printed
    report = json.loads(out_json.read_text())
    assert report["model"] == served.model
    assert [r["concurrency"] for r in report["results"]] == [1, 2]
    for r in report["results"]:
        assert r["completed"] == 2 and r["failed"] == 0
        assert r["mean_output_tokens"] == 3  # ignore_eos: exactly max_tokens
        assert r["output_throughput"] > 0 and r["request_throughput"] > 0
        for key in ("ttft_ms", "tpot_ms", "itl_ms"):
            assert 0 < r[key]["p50"] <= r[key]["p90"] <= r[key]["p99"]
    assert out_png.stat().st_size > 1000
    assert markdown_table(report["results"]).count("\n") == 3


def test_bench_serve_chat_endpoint(served, capsys):
    rc = main(["bench", "serve", "--base-url", served.url, "--endpoint", "chat", "--concurrency", "2",
               "--num-requests", "2", "--input-len", "8", "--output-len", "2", "--warmup", "0"])
    assert rc == 0
    assert "| 2 | 2/2 |" in capsys.readouterr().out
