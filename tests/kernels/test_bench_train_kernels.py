"""`tokenfab bench train-kernels` runs (a tiny size on CPU) and writes its report; the backward of
our kernels keeps less than HF's autograd (no timing is asserted)."""

from __future__ import annotations

import json

from tokenfab.cli import main


def test_train_kernels_command(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENFAB_KERNELS", "torch")
    out, md = tmp_path / "tk.json", tmp_path / "tk.md"
    rc = main(["bench", "train-kernels", "--device", "cpu", "--tokens", "64", "--hidden", "96", "--intermediate",
               "160", "--heads", "4/2", "--head-dim", "16", "--repeats", "2", "--warmup", "1", "--json", str(out),
               "--markdown", str(md)])
    assert rc == 0
    report = json.loads(out.read_text())
    ops = [r["op"].split()[0] for r in report["results"]]
    assert ops == ["rms_norm+residual", "rope", "silu_and_mul"]
    for r in report["results"]:
        assert r["ours"]["ms"] > 0 and r["hf"]["ms"] > 0
        assert r["ours"]["saved_mib"] < r["hf"]["saved_mib"], r
    assert "silu_and_mul" in md.read_text()
