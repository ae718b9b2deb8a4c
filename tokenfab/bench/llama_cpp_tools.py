"""llama.cpp's own benchmark tools as the peer of `tokenfab bench cpu`: find them, run them, read
their output.

The tools are built by ``scripts/llama_cpp_server.sh build-tools`` from the llama.cpp tree vendored
in the llama-cpp-python sdist, with the same CPU flags as the Python peer (every x86 feature named
from /proc/cpuinfo, AMX off), into ``.llama-cpp-tools/bin`` (``$LLAMA_CPP_TOOLS``; git-ignored).

- ``llama-bench -p 512 -n 128 -o json``: prompt processing of 512 tokens (pp512) and generation of
  128 tokens (tg128), tokens/s averaged over its repetitions;
- ``llama-batched-bench -npp PP -ntg TG -npl 1,4,16,48``: B sequences of PP prompt tokens each
  decoding TG tokens together; its markdown table gives S_PP (prompt t/s) and S_TG (generation
  t/s over all B sequences) per B.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from tokenfab.bench.llama_cpp_peer import SCRIPT

TOOLS = ("llama-bench", "llama-batched-bench", "llama-server")


def tools_dir() -> Path:
    """Where the built tools are: ``$LLAMA_CPP_TOOLS/bin`` (default ``.llama-cpp-tools/bin``)."""
    root = Path(os.environ.get("LLAMA_CPP_TOOLS", SCRIPT.parents[1] / ".llama-cpp-tools"))
    if not root.is_absolute():
        root = SCRIPT.parents[1] / root
    return root / "bin"


def missing_tools(bin_dir: Path | None = None) -> list[str]:
    """The tools that are not built (empty when all are there)."""
    bin_dir = bin_dir or tools_dir()
    return [t for t in TOOLS[:2] if not os.access(bin_dir / t, os.X_OK)]


def tools_settings() -> dict[str, Any]:
    """The tools' source, version and cmake flags (``llama_cpp_server.sh tools-info``)."""
    out = subprocess.run(["bash", str(SCRIPT), "tools-info"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "LLAMA_CPP_TOOLS": str(tools_dir().parent)})
    if out.returncode != 0:
        raise RuntimeError(f"llama_cpp_server.sh tools-info failed: {out.stderr.strip()[-500:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def parse_llama_bench_json(text: str) -> dict[str, dict[str, Any]]:
    """``llama-bench -o json`` output -> {"pp512": {...}, "tg128": {...}}: tokens/s (mean, stddev)
    and the run's facts (threads, build, model size) per test."""
    start = text.find("[")
    rows = json.loads(text[start:]) if start >= 0 else []
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        n_prompt, n_gen = int(r.get("n_prompt", 0)), int(r.get("n_gen", 0))
        name = f"pp{n_prompt}" if n_gen == 0 else (f"tg{n_gen}" if n_prompt == 0 else f"pp{n_prompt}+tg{n_gen}")
        out[name] = {"tok_s": float(r["avg_ts"]), "stddev_tok_s": float(r.get("stddev_ts", 0.0)),
                     "samples_tok_s": r.get("samples_ts"), "n_threads": r.get("n_threads"),
                     "build_commit": r.get("build_commit"), "build_number": r.get("build_number"),
                     "model_type": r.get("model_type"), "model_size": r.get("model_size"),
                     "cpu_info": r.get("cpu_info"), "backends": r.get("backends")}
    return out


def parse_batched_bench(text: str) -> list[dict[str, float]]:
    """``llama-batched-bench`` markdown table -> one dict per row, keyed by its column names
    (PP, TG, B, N_KV, T_PP s, S_PP t/s, T_TG s, S_TG t/s, T s, S t/s), numbers as floats."""
    header: list[str] | None = None
    rows: list[dict[str, float]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if header is None:
            if "S_TG t/s" in cells:
                header = cells
            continue
        if all(set(c) <= set("-: ") for c in cells):
            continue  # the |---|---| rule
        try:
            rows.append({h: float(c) for h, c in zip(header, cells)})
        except ValueError:
            continue
    return rows


def batched_bench_header(text: str) -> str | None:
    """The ``<function>: n_kv_max = ..., n_threads = ...`` line above the table (its settings)."""
    return next((ln.strip() for ln in text.splitlines() if ": n_kv_max = " in ln), None)


def _run(cmd: list[str], timeout: float, with_stderr: bool = False) -> str:
    """The tool's stdout (and then its stderr with ``with_stderr``: llama-batched-bench prints its
    table to stdout and its settings line, ``batched_bench_header``'s, to stderr)."""
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{Path(cmd[0]).name} exited {out.returncode}: {out.stderr.strip()[-800:]}")
    return out.stdout + ("\n" + out.stderr if with_stderr else "")


def run_llama_bench(model: str | Path, threads: int, prompt_len: int = 512, gen_len: int = 128,
                    repetitions: int = 3, timeout: float = 1800) -> dict[str, Any]:
    """pp``prompt_len`` and tg``gen_len`` with ``threads`` threads; returns the parsed figures and the command."""
    cmd = [str(tools_dir() / "llama-bench"), "-m", str(model), "-t", str(threads), "-p", str(prompt_len),
           "-n", str(gen_len), "-r", str(repetitions), "-o", "json"]
    text = _run(cmd, timeout)
    return {"command": " ".join(cmd), "results": parse_llama_bench_json(text), "raw": text}


def run_batched_bench(model: str | Path, threads: int, batches: list[int], prompt_len: int, gen_len: int,
                      timeout: float = 3600, attempts: int = 5) -> dict[str, Any]:
    """B sequences of ``prompt_len`` prompt tokens decoding ``gen_len`` tokens each, for each B of
    ``batches``; the KV cache holds them all (``-c = max(B) x (PP + TG)``), prompts not shared."""
    ctx = max(batches) * (prompt_len + gen_len)
    cmd = [str(tools_dir() / "llama-batched-bench"), "-m", str(model), "-t", str(threads), "-tb", str(threads),
           "-c", str(ctx), "-b", "2048", "-ub", "512", "-npp", str(prompt_len), "-ntg", str(gen_len),
           "-npl", ",".join(map(str, batches))]
    # llama.cpp's log is written by a worker thread that the tool does not join before it exits: a
    # short run can exit 0 with the table's last lines (or all of them) never written. Such a run is
    # repeated (up to ``attempts`` times), and the report says how many runs it took.
    runs, rows, text = 0, [], ""
    while runs < attempts and sorted(int(r["B"]) for r in rows if "B" in r) != sorted(batches):
        text = _run(cmd, timeout, with_stderr=True)
        rows, runs = parse_batched_bench(text), runs + 1
    return {"command": " ".join(cmd), "settings_line": batched_bench_header(text), "rows": rows, "raw": text,
            "runs": runs}
