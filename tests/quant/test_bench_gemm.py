"""`tokenfab bench kernels` FP8 GEMM rows (tiny shapes, Triton interpreter on CPU): every token count
and shape has a row against torch's F.linear in the run's dtype, as a FLOP row with its roofline
fraction, and the FP8 result is within FP8's error of it. Speed is never asserted (and means nothing
in the interpreter)."""

from __future__ import annotations

import json

from tokenfab.bench.gemm_workloads import SHAPES
from tokenfab.cli import main


def test_fp8_gemm_rows(tmp_path):
    out = tmp_path / "k.json"
    ops = [f"gemm_fp8_{label}_{m}" for label in SHAPES for m in (1, 16)]
    rc = main(["bench", "kernels", "--size", "tiny", "--rep-ms", "1", "--json", str(out), "--ops", ",".join(ops),
               "--compile-peers", "off"])
    assert rc == 0
    report = json.loads(out.read_text())
    rows = report["results"]
    assert len(rows) == len(ops) and all("error" not in r for r in rows)
    for r in rows:
        assert r["op"].startswith("gemm fp8 M=") and r["metric"] == "TFLOP/s"
        assert r["peer"] == "torch float32 F.linear" and r["ceiling"] == report["ceilings"]["matmul_TFLOPs"]
        assert 0 < r["max_abs_err"] < 0.1  # relative to the output's largest value: e4m3 has 3 mantissa bits
