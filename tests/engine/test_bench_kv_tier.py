"""`tokenfab bench kv-tier` runs end to end on a tiny model and writes its JSON and Markdown reports, with the
tier's hits counted and the greedy outputs of every mode identical (the figures themselves are not asserted)."""

from __future__ import annotations

import json

from tokenfab.cli import main


def test_bench_kv_tier_writes_its_reports(tiny_llama_dir, tmp_path):
    out_json, out_md = tmp_path / "kv_tier.json", tmp_path / "kv_tier.md"
    rc = main(["bench", "kv-tier", "--model", tiny_llama_dir, "--num-conversations", "6", "--first-len", "40",
               "--new-len", "8", "--output-len", "3", "--block-size", "4", "--json", str(out_json),
               "--md", str(out_md)])
    assert rc == 0
    report = json.loads(out_json.read_text())
    runs = {r["mode"]: r for r in report["runs"]}
    assert set(runs) == {"recompute", "host", "disk"} and report["outputs_identical"]
    assert runs["recompute"]["tier_hit_tokens"] == 0
    for mode in ("host", "disk"):
        assert runs[mode]["tier_hit_tokens"] > 0
        assert runs[mode]["computed_prompt_tokens"] < runs["recompute"]["computed_prompt_tokens"]
    assert runs["disk"]["tier_host_bytes"] == 0 and runs["disk"]["tier_disk_bytes"] > 0
    assert set(report["ttft_speedup_vs_recompute"]) == {"host", "disk"}
    assert "| host |" in out_md.read_text()
