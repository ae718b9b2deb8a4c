"""`tokenfab bench cpu` runs end to end on a tiny GGUF and writes every field of its report; the
llama.cpp part is skipped, and said so, when the tools are not built. Speed is never asserted.
The llama.cpp tools' output is parsed from captured runs (tests/engine/data/llama_cpp_tools/)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as QT

from tests.loader.tiny_gguf import TinySpec, write_tiny_gguf
from tokenfab.bench import cpu, llama_cpp_tools, roofline
from tokenfab.cli import main

DATA = Path(__file__).parent / "data" / "llama_cpp_tools"
TINY = ["--tiny", "--repeats", "1", "--prompt-len", "16", "--gen-len", "4", "--batches", "1,3",
        "--batch-prompt-len", "4", "--hf-batch-sizes", ""]


@pytest.fixture
def tiny_gguf(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.gguf"
    # vocab = the tokenizer's 264 tokens: llama.cpp refuses a GGUF whose token list and embedding differ
    write_tiny_gguf(path, TinySpec(arch="llama", vocab=264, default_type=QT.Q4_1), tokenizer=True)
    return path


def _run(tmp_path: Path, model: Path, *extra: str) -> tuple[dict, str]:
    out, md = tmp_path / "cpu.json", tmp_path / "cpu.md"
    assert main(["bench", "cpu", "--model", str(model), *TINY, *extra, "--json", str(out), "--markdown", str(md)]) == 0
    return json.loads(out.read_text()), md.read_text()


def test_bench_cpu_report_without_llama_cpp_tools(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMA_CPP_TOOLS", str(tmp_path / "not-built"))
    report, md = _run(tmp_path, tiny_gguf)
    assert report["benchmark"] == "cpu" and report["commit"]
    assert set(report["isa_flags"]) == set(cpu.ISA_FLAGS)
    assert all(isinstance(v, bool) for v in report["isa_flags"].values())
    assert report["isa_tag"] in ("amx", "avx512_vnni", "avx512", "avx2", "generic")
    assert "lscpu_model_name" in report["machine"] and report["threads"] >= 1
    assert len(report["load_average_before"]) == 3 and len(report["load_average_after"]) == 3
    assert "ggml" in report["kernels"] and "isa" in report["kernels"]["ggml"]
    ours = report["tokenfab"]
    assert ours["prefill"]["workload"] == "pp16" and ours["prefill"]["tok_s"] > 0
    assert ours["decode"]["workload"] == "tg4" and ours["decode"]["tok_s"] > 0
    assert [b["batch"] for b in ours["batched"]] == [1, 3]
    assert all(b["tok_s"] > 0 and b["e2e_output_tok_s"] > 0 for b in ours["batched"])
    assert ours["settings"]["quantization"] == "gguf" and ours["settings"]["sampling"] == "greedy, ignore_eos"
    # the llama.cpp part is skipped with its reason, not failed; no ratio against it
    assert "not built" in report["llama_cpp"]["skipped"] and "build-tools" in report["llama_cpp"]["skipped"]
    assert report["transformers"] == {"skipped": "--hf-batch-sizes is empty"}
    assert report["ratios"] == {}
    roof = report["roofline"]
    assert roof["copy"]["gb_s"] > 0 and roof["fp32_matmul"]["gflop_s"] > 0
    assert 0 < roof["model"]["weight_bytes"] < tiny_gguf.stat().st_size and roof["model"]["parameters"] > 0
    assert roof["model"]["tensor_types"]["Q4_1"] > 0
    assert set(report["roofline_bounds"]) >= {"pp16", "tg4", "B=1, pp4, tg4", "B=3, pp4, tg4"}
    assert "llama.cpp: skipped (llama.cpp tools not built" in md and "## Roofline" in md


def test_bench_cpu_with_llama_cpp_tools(tiny_gguf, tmp_path):
    missing = llama_cpp_tools.missing_tools()
    if missing:
        pytest.skip(f"llama.cpp tools not built ({', '.join(missing)}): scripts/llama_cpp_server.sh build-tools")
    report, md = _run(tmp_path, tiny_gguf)
    llama = report["llama_cpp"]
    assert "skipped" not in llama and llama["threads"] == report["threads"]
    assert f"-t {report['threads']}" in llama["llama_bench"]["command"]
    assert set(llama["llama_bench"]["results"]) == {"pp16", "tg4"}
    assert [int(r["B"]) for r in llama["batched_bench"]["rows"]] == [1, 3]
    assert "AMX_INT8=OFF" in llama["settings"]["cmake_args"]
    assert set(report["ratios"]) >= {"pp16 vs llama-bench", "tg4 vs llama-bench",
                                     "B=3 decode vs llama-batched-bench S_TG"}
    assert "tokenfab / llama.cpp" in md


def test_isa_flags_and_tag(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 fma f16c avx512f avx512_vnni\n")
    flags = cpu.cpu_flags(str(info))
    assert flags["avx2"] and flags["avx512_vnni"] and not flags["amx_int8"] and not flags["avx_vnni"]
    assert cpu.isa_tag(flags) == "avx512_vnni"
    assert cpu.isa_tag({}) == "generic"


def test_roofline_bounds():
    # 1 GB/s over 100 MB of weights: 10 tokens/s per sequence, capped by 1 GFLOP/s over 2 x 10 M parameters
    assert roofline.decode_bound(1, 1.0, 100_000_000) == pytest.approx(10.0)
    assert roofline.decode_bound(16, 1.0, 100_000_000, 1e9, 10_000_000) == pytest.approx(50.0)
    assert roofline.prefill_bound(1e9, 10_000_000) == pytest.approx(50.0)


def test_parse_llama_bench_json():
    res = llama_cpp_tools.parse_llama_bench_json((DATA / "llama_bench.json").read_text())
    assert set(res) == {"pp512", "tg128"}
    for r in res.values():
        assert r["tok_s"] > 0 and r["n_threads"] == 2 and r["build_commit"]


def test_parse_batched_bench():
    text = (DATA / "batched_bench.txt").read_text()
    rows = llama_cpp_tools.parse_batched_bench(text)
    assert [int(r["B"]) for r in rows] == [1, 4, 16, 48]
    for r in rows:
        assert r["PP"] == 32 and r["TG"] == 128 and r["S_TG t/s"] > 0 and r["S_PP t/s"] > 0
        assert r["N_KV"] == r["B"] * (r["PP"] + r["TG"])
    assert "n_threads = 2" in llama_cpp_tools.batched_bench_header(text)


def test_parse_ignores_logs_and_rules():
    text = ("build: x\n|  PP |  TG |  B | S_TG t/s |\n|-----|-----|----|----------|\n"
            "|  8 |  4 |  2 |  55.5 |\nllama_perf\n")
    assert llama_cpp_tools.parse_batched_bench(text) == [{"PP": 8.0, "TG": 4.0, "B": 2.0, "S_TG t/s": 55.5}]
    assert llama_cpp_tools.parse_llama_bench_json("no json here") == {}


def test_batched_bench_run_that_lost_its_table_is_repeated(tmp_path, monkeypatch):
    """A stand-in tool that exits 0 with no table on its first run (as llama.cpp's unjoined log
    writer can) and prints it, to stderr, on the second: the rows come from the second run."""
    table = (DATA / "batched_bench.txt").read_text()
    (tmp_path / "table.txt").write_text(table)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tool = bin_dir / "llama-batched-bench"
    tool.write_text(f"#!/bin/sh\nif [ -f {tmp_path}/ran ]; then cat {tmp_path}/table.txt >&2; "
                    f"else touch {tmp_path}/ran; echo 'build: x' >&2; fi\n")
    tool.chmod(0o755)
    monkeypatch.setenv("LLAMA_CPP_TOOLS", str(tmp_path))
    out = llama_cpp_tools.run_batched_bench("m.gguf", 2, [1, 4, 16, 48], 32, 128)
    assert out["runs"] == 2 and [int(r["B"]) for r in out["rows"]] == [1, 4, 16, 48]
    assert "n_threads = 2" in out["settings_line"]


def test_bounds_use_the_int8_peak_for_an_int8_activation_run():
    roof = {"copy": {"gb_s": 10.0}, "fp32_matmul": {"gflop_s": 100.0}, "int8_matmul": {"gop_s": 400.0},
            "model": {"weight_bytes": 100_000_000, "parameters": 100_000_000}}
    ours = {"prefill": {"workload": "pp512"}, "decode": {"workload": "tg128"},
            "batched": [{"workload": "B=16", "batch": 16}], "settings": {"quantization": "gguf"}}
    assert cpu.bounds(roof, ours)["pp512"] == pytest.approx(500.0)
    assert cpu.bounds(roof, ours)["B=16"] == pytest.approx(500.0)  # compute-bound at 16 sequences
    ours["settings"]["quantization"] = "gguf-q8act"
    assert cpu.bounds(roof, ours)["pp512"] == pytest.approx(2000.0)
    assert cpu.bounds(roof, ours)["B=16"] == pytest.approx(1600.0)  # now the memory side: 16 x 100
    assert cpu.bounds(roof, ours)["tg128"] == pytest.approx(100.0)
