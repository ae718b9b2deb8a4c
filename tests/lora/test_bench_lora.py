"""`tokenfab bench lora` on a tiny random Llama (over the bundled tokenizer): adapters written by PEFT that the
engine accepts, the command's report and tables. The fast test runs the LoRA part (one `tokenfab serve`); the slow
one the whole command, the batch part with two sets of server flags."""

from __future__ import annotations

import argparse
import json

import pytest
from safetensors.torch import load_file

from tests.tiny_models import tiny_llama_with_bundled_tokenizer
from tokenfab.bench import lora as bench_lora
from tokenfab.bench.lora_adapters import ATTENTION_AND_MLP, write_adapters
from tokenfab.loader.lora_adapter import read_adapter_config

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    model, tokenizer = tiny_llama_with_bundled_tokenizer(std=0.2)
    path = tmp_path_factory.mktemp("bench-lora") / "tiny"
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return str(path)


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_lora.add_arguments(parser)
    return parser.parse_args(argv)


def test_adapters_are_peft_folders_with_distinct_deterministic_weights(tiny_model, tmp_path):
    a = write_adapters(tiny_model, tmp_path / "a", 2, 4, seed=3)
    b = write_adapters(tiny_model, tmp_path / "b", 1, 4, seed=3)
    assert [name for name, _ in a] == ["lora0", "lora1"]
    config = json.loads((a[0][1] / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and sorted(config["target_modules"]) == sorted(
        ATTENTION_AND_MLP)
    assert read_adapter_config(str(a[0][1]), 8) is not None  # the engine's own reader takes it
    w0, w1, again = (load_file(str(p / "adapter_model.safetensors")) for p in (a[0][1], a[1][1], b[0][1]))
    assert set(w0) == set(w1) and len(w0) == 2 * 7 * 2  # A and B of 7 projections in each of 2 layers
    assert all((w0[k] == again[k]).all() for k in w0)  # same seed, same weights
    assert any((w0[k] != w1[k]).any() for k in w0)  # each adapter its own


def test_lora_part_reports_both_modes_and_their_ratio(tiny_model, tmp_path):
    args = _args(["--model", tiny_model, "--parts", "lora", "--adapters", "2", "--streams", "4", "--num-requests",
                  "4", "--input-len", "8", "--output-len", "4", "--json", str(tmp_path / "r.json"), "--markdown",
                  str(tmp_path / "r.md")])
    assert bench_lora.run(args) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    rows = report["lora"]["rows"]
    assert [r["server"] for r in rows] == ["base", "2 adapters"]
    assert all(r["completed"] == 4 and r["failed"] == 0 and r["mean_output_tokens"] == 4 for r in rows)
    ratio = rows[1]["output_throughput"] / rows[0]["output_throughput"]
    assert report["lora"]["ratio"] == pytest.approx(ratio) and "batch" not in report
    text = (tmp_path / "r.md").read_text()
    assert f"{report['lora']['ratio']:.2f}x" in text and "noisy" in text


@pytest.mark.slow  # three server starts; the fast twin above runs the same launch and clients
def test_whole_command_with_two_isolation_runs(tiny_model, tmp_path):
    args = _args(["--model", tiny_model, "--adapters", "2", "--streams", "2", "--num-requests", "2", "--input-len",
                  "8", "--output-len", "2", "--online-requests", "4", "--online-output-len", "2", "--batch-lines", "6",
                  "--batch-max-tokens", "2", "--isolation", "default",
                  "--isolation=--background-max-prefill-tokens 0 --background-decodes-while-online",
                  "--json", str(tmp_path / "r.json"), "--markdown", str(tmp_path / "r.md")])
    assert bench_lora.run(args) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    runs = report["batch"]
    assert [r["flags"] for r in runs] == ["(defaults)",
                                          "--background-max-prefill-tokens 0 --background-decodes-while-online"]
    for r in runs:
        assert r["batch_status"] == "completed" and r["batch_completed"] == 6 and r["batch_failed"] == 0
        assert r["alone"]["completed"] == r["with_batch"]["completed"] == 4
        assert r["p99_ratio"] == pytest.approx(r["with_batch"]["ttft_ms"]["p99"] / r["alone"]["ttft_ms"]["p99"])
    assert "Online TTFT alone vs with a batch running" in (tmp_path / "r.md").read_text()
