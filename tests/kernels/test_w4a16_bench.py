"""`tokenfab bench kernels` W4A16 rows (tiny sizes, Triton interpreter): decode rows are measured in
GB/s against the copy bandwidth, every row agrees with bf16 F.linear on the dequantized weights and
names it as the peer. Speed is never asserted."""

from __future__ import annotations

import json

from tokenfab.cli import main


def test_w4a16_rows(tmp_path):
    out = tmp_path / "k.json"
    ops = "w4a16_int4_llama8b_down_1,w4a16_nvfp4_llama8b_down_1,w4a16_int4_deepseek_expert_gate_up_16"
    rc = main(["bench", "kernels", "--size", "tiny", "--rep-ms", "2", "--json", str(out), "--ops", ops,
               "--compile-peers", "off"])
    assert rc == 0
    report = json.loads(out.read_text())
    rows = [r for r in report["results"] if r["op"].startswith("w4a16")]
    assert len(rows) == 3
    for r in rows:
        assert r["metric"] == "GB/s" and r["ceiling"] == report["ceilings"]["copy_GBps"]
        assert "F.linear" in r["peer"]
        assert r["max_abs_err"] < 0.02  # relative to the output's largest value (bf16 rounding)
