"""The GPU check cannot rot while no GPU is at hand: its shell script, its report and the engine
correctness script are exercised here on CPU (the part of each that makes sense without CUDA)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
REPORT = [sys.executable, str(ROOT / "scripts" / "gpu_report.py")]
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_engine_check  # noqa: E402


def _code_lines() -> list[str]:
    return [ln for ln in SCRIPT.read_text().splitlines() if not ln.lstrip().startswith("#")]


def _sections() -> list[tuple[str, int]]:
    return [(m[1], int(m[2])) for m in re.finditer(r"run_section (\w+) (\d+) ", "\n".join(_code_lines()))]


def test_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_sections_order_and_limits():
    """Every section runs under its own limit; warm-up first, engine correctness before any speed
    section; the default budget keeps the whole inside 8 minutes."""
    names = [n for n, _ in _sections()]
    assert names[0] == "warmup"
    assert names.index("engine_correctness") < min(names.index(s) for s in
                                                   ("kernel_benchmarks", "mla_benchmarks", "end_to_end"))
    assert names.index("warmup") < names.index("kernel_tests")
    assert {"kernel_tests", "c_kernels"} <= set(names)
    assert all(0 < limit <= 300 for _, limit in _sections())
    budget = int(re.search(r'BUDGET_S="\$\{GPU_CHECK_BUDGET_S:-(\d+)\}"', SCRIPT.read_text())[1])
    assert budget <= 480
    text = "\n".join(_code_lines())
    assert 'timeout -s INT -k 10 "$limit"' in text  # the one place sections run (SIGINT: pytest writes its junit)
    assert "export TRITON_CACHE_DIR" in text  # one Triton cache shared by every section


def test_float16_is_not_checked():
    """The engine refuses float16 on CUDA, so the check never asks for it."""
    assert not any("float16" in ln.replace("bfloat16", "") for ln in _code_lines())


def test_report_is_written_section_by_section(tmp_path):
    """After each `add` the JSON and Markdown hold that section: a run killed later still reports it."""
    out = tmp_path / "out"
    subprocess.run([*REPORT, "init", "--out", str(out), "--title", "test machine"], check=True)
    (tmp_path / "a.json").write_text(json.dumps({"pass": True, "rows": []}))
    (tmp_path / "a.md").write_text("| a | table |")
    (tmp_path / "k.xml").write_text(
        '<testsuites><testsuite tests="3" failures="1" errors="0" skipped="0" time="1.5">'
        '<testcase classname="t" name="ok"/><testcase classname="t" name="bad"><failure/></testcase>'
        '<testcase classname="t" name="ok2"/></testsuite></testsuites>')
    subprocess.run([*REPORT, "add", "--out", str(out), "--section", "engine_correctness", "--rc", "0", "--seconds",
                    "12", "--limit", "100", "--json", str(tmp_path / "a.json"), "--markdown", str(tmp_path / "a.md")],
                   check=True)
    report = json.loads((out / "gpu_report.json").read_text())
    assert report["verdict"].startswith("incomplete")
    assert report["sections"][0]["status"] == "ok"
    assert "| a | table |" in (out / "gpu_report.md").read_text()
    subprocess.run([*REPORT, "add", "--out", str(out), "--section", "kernel_tests", "--rc", "124", "--seconds",
                    "110", "--limit", "110", "--junit", str(tmp_path / "k.xml")], check=True)
    report = json.loads((out / "gpu_report.json").read_text())
    kt = report["sections"][1]
    assert kt["status"] == "timeout" and kt["tests"]["failed"] == ["t::bad"] and kt["tests"]["passed"] == 2
    subprocess.run([*REPORT, "add", "--out", str(out), "--section", "end_to_end", "--skipped", "no time left",
                    "--no-time"], check=True)
    subprocess.run([*REPORT, "finish", "--out", str(out), "--elapsed", "300"], check=True, capture_output=True)
    report = json.loads((out / "gpu_report.json").read_text())
    assert report["verdict"] == "fail"
    assert report["failed_sections"] == ["kernel_tests (timeout)", "end_to_end (not_run)"]
    assert "**FAIL**" in (out / "gpu_report.md").read_text()


def test_engine_rows_that_fail_fail_the_section(tmp_path):
    out = tmp_path / "out"
    subprocess.run([*REPORT, "init", "--out", str(out)], check=True)
    (tmp_path / "e.json").write_text(json.dumps({"pass": False}))
    subprocess.run([*REPORT, "add", "--out", str(out), "--section", "engine_correctness", "--rc", "0",
                    "--json", str(tmp_path / "e.json")], check=True)
    assert json.loads((out / "gpu_report.json").read_text())["sections"][0]["status"] == "fail"


def _path_without_cc(tmp_path: Path) -> str:
    """A PATH holding the tools the script uses, and no C compiler."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "timeout", "date", "tee", "mktemp", "tail", "head", "rm", "mkdir", "dirname", "git", "cat",
                 "sleep", "env"):
        found = shutil.which(tool)
        if found:
            (bin_dir / tool).symlink_to(found)
    return str(bin_dir)


@pytest.fixture(scope="module")
def script_runs(tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """The two dry runs of the script below, started together: each spends most of its time in a
    single-threaded Python start-up (torch's import), so side by side they take about the time of one
    on a two-core machine. name -> (the finished process, its $OUT)."""
    root = tmp_path_factory.mktemp("gpu_check_runs")
    no_cc = dict(os.environ, PATH=_path_without_cc(root), OUT=str(root / "no_cc"), PYTHON=sys.executable,
                 GPU_CHECK_SECTIONS="c_kernels")
    no_cc.pop("CC", None)
    spent = dict(os.environ, OUT=str(root / "spent"), PYTHON=sys.executable, GPU_CHECK_BUDGET_S="10",
                 GPU_CHECK_SECTIONS="warmup engine_correctness kernel_tests")
    procs = {name: subprocess.Popen(["bash", str(SCRIPT)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True)
             for name, env in (("no_cc", no_cc), ("spent", spent))}
    runs = {}
    for name, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        runs[name] = (subprocess.CompletedProcess(proc.args, proc.returncode, out, err), root / name)
    return runs


def test_c_kernel_section_is_skipped_with_a_reason_without_cc(script_runs):
    proc, out = script_runs["no_cc"]
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((out / "gpu_report.json").read_text())
    (section,) = report["sections"]
    assert section["name"] == "c_kernels" and section["status"] == "skipped" and section["optional"]
    assert "no C compiler" in section["skipped"]
    assert report["verdict"] == "pass"
    assert "no C compiler" in (out / "gpu_report.md").read_text()


def test_a_spent_budget_is_reported_not_overrun(script_runs):
    """With no time left every section is recorded as not run, and the verdict fails."""
    proc, out = script_runs["spent"]
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((out / "gpu_report.json").read_text())
    assert [s["status"] for s in report["sections"]] == ["not_run"] * 3
    assert report["verdict"] == "fail"


class _FakeRef:
    """Reference logits where token 5 leads token 6 by `gap`."""

    def __init__(self, gap: float) -> None:
        self.gap = gap

    def next_logits(self, ids):
        import torch

        logits = torch.zeros(10)
        logits[5], logits[6] = 3.0, 3.0 - self.gap
        return logits


def test_compare_tells_near_ties_from_mismatches():
    cmp = gpu_engine_check.compare
    assert cmp(_FakeRef(1.0), [1], [5, 5], [5, 5], "float32")["result"] == "exact"
    assert cmp(_FakeRef(1e-5), [1], [5, 5], [5, 6], "float32")["result"] == "near_tie"
    assert cmp(_FakeRef(0.5), [1], [5, 5], [5, 6], "float32")["result"] == "mismatch"
    assert cmp(_FakeRef(0.05), [1], [5, 5], [6, 1], "bfloat16")["result"] == "near_tie"
    assert cmp(_FakeRef(0.5), [1], [5, 5], [6, 1], "bfloat16")["result"] == "mismatch"
    assert cmp(_FakeRef(0.0), [1], [5, 5], [5], "float32")["result"] == "mismatch"  # a length bug


@pytest.mark.parametrize("model", list(gpu_engine_check.MODELS))
def test_engine_check_runs_on_cpu(tmp_path, model):
    """The CPU part of the engine-correctness section (eager vs transformers, fp32) passes here."""
    out = tmp_path / "engine.json"
    rc = gpu_engine_check.main(["--device", "cpu", "--dtypes", "float32", "--modes", "eager", "--models", model,
                                "--new-tokens", "6", "--json", str(out), "--markdown", str(tmp_path / "e.md")])
    report = json.loads(out.read_text())
    assert rc == 0 and report["pass"], report
    (row,) = report["rows"]
    assert row["counts"] == {"exact": len(gpu_engine_check.PROMPT_LENS), "near_tie": 0, "mismatch": 0}
    assert "PASS" in (tmp_path / "e.md").read_text()
