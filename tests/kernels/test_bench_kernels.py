"""`tokenfab bench kernels` (tiny sizes, Triton interpreter): each row's peer is the fastest
plain-PyTorch version tried (not the eager multi-pass reference), and each row gives its own and
its peer's fraction of the roofline measured in the same run. Speed is never asserted."""

from __future__ import annotations

import json

import torch

from tokenfab.cli import main


def _run(tmp_path, *extra):
    out, md = tmp_path / "k.json", tmp_path / "k.md"
    rc = main(["bench", "kernels", "--size", "tiny", "--rep-ms", "5", "--json", str(out), "--markdown", str(md),
               *extra])
    return rc, json.loads(out.read_text()), md.read_text()


def test_peers_are_plain_pytorch_and_rows_show_the_roofline(tmp_path):
    rc, report, md = _run(tmp_path, "--ops", "rms_norm,silu_and_mul,store_kv,decode_attention",
                          "--compile-peers", "off")
    assert rc == 0
    assert report["ceilings"]["copy_GBps"] > 0 and report["ceilings"]["matmul_TFLOPs"] > 0
    rows = {r["op"]: r for r in report["results"]}
    expected = {"rms_norm": "F.rms_norm", "silu_and_mul": "F.silu(gate) * up", "store_kv": "index_copy_",
                "paged_decode_attention": "torch SDPA, dense K/V (no page gather)"}
    for op, peer in expected.items():
        r = rows[op]
        assert peer in r["extra"]["peers_us"]
        assert "reference" not in r["peer"] or "torch.compile" in r["peer"]  # never the eager reference
        assert r["peer_time_us"] == min(v for v in r["extra"]["peers_us"].values() if isinstance(v, float))
        assert r["fraction_of_ceiling"] > 0 and r["peer_fraction_of_ceiling"] > 0
        assert r["ceiling"] == report["ceilings"]["copy_GBps"]
    assert "of roofline" in md and "peer of roofline" in md and "F.rms_norm" in md


def test_compiled_reference_is_a_peer_and_the_budget_skips_it(tmp_path, monkeypatch):
    compiled = []

    def fake_compile(fn, **kw):  # stands in for inductor (minutes on 2 cores); the wiring is what is tested
        compiled.append(fn.__name__)
        return fn

    monkeypatch.setattr(torch, "compile", fake_compile)
    rc, report, _ = _run(tmp_path, "--ops", "rms_norm,gelu_and_mul", "--compile-peers", "on")
    assert rc == 0
    assert compiled == ["rms_norm_ref", "gelu_and_mul_ref"]
    for r in report["results"]:
        assert isinstance(r["extra"]["peers_us"]["torch.compile(reference)"], float)
    rc, report, _ = _run(tmp_path, "--ops", "rms_norm", "--compile-peers", "on", "--budget-s", "0")
    assert report["results"][0]["extra"]["peers_us"]["torch.compile(reference)"] == "skipped: time budget spent"
    assert report["results"][0]["peer"] == "F.rms_norm"
