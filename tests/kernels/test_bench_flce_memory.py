"""`tokenfab bench flce-memory` runs (a small size) and writes its report: the same loss for both
methods, and FLCE's peak below the full-logits peak once the logits dominate (32 MiB of them here)."""

from __future__ import annotations

import json

from tokenfab.cli import main


def test_flce_memory_command(tmp_path):
    out = tmp_path / "flce.json"
    md = tmp_path / "flce.md"
    rc = main(["bench", "flce-memory", "--tokens", "512", "--vocab", "16384", "--hidden", "64", "--device", "cpu",
               "--json", str(out), "--markdown", str(md)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["workload"]["full_logits_mib"] == 32.0
    rows = report["rows"]
    assert len(rows) == 4 and {r["method"] for r in rows} == {"hf", "flce"}
    assert len({round(r["loss"], 4) for r in rows}) == 1
    for head in ("trainable", "frozen"):
        s = report["saving"][head]
        assert 0 < s["flce_mib"] < s["hf_mib"], s
    assert "flce" in md.read_text()
