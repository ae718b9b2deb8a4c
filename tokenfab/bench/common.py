"""Shared bits of the benchmark commands: machine description, percentiles, report files."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any


def git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
            cwd=Path(__file__).resolve().parents[2],
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def git_dirty() -> bool | None:
    """Whether the checkout has uncommitted changes to tracked files (what ran is then not exactly
    the commit: a shared checkout holds other people's work in progress)."""
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                             text=True, check=True, cwd=Path(__file__).resolve().parents[2]).stdout
        return bool(out.strip())
    except (OSError, subprocess.CalledProcessError):
        return None


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"platform": platform.platform(), "python": platform.python_version(),
                            "cpus": os.cpu_count()}
    try:
        import torch

        info["torch"] = torch.__version__
        info["threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    env = {k: v for k, v in os.environ.items()
           if k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "LD_PRELOAD",
                    "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
           or k.startswith(("MALLOC_", "TOKENFAB_"))}
    if env:
        info["env"] = env  # what changes threads, the allocator, our kernels or torch's ISA
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return info


def load_average() -> float | None:
    """The machine's 1-minute load average (these machines are shared: a run says how busy it was)."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def markdown_table(headers: list[str], rows: list[list[Any]]) -> str:
    def fmt(v: Any) -> str:
        return f"{v:.2f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def write_json(path: str | None, data: dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=2))


def script_main(doc: str, add_arguments: Callable[[argparse.ArgumentParser], None],
                run: Callable[[argparse.Namespace], int], argv: list[str] | None = None) -> int:
    """A bench module run as a script (``python -m tokenfab.bench.<name>``): its own arguments (the
    ones ``tokenfab bench <name>`` adds), parsed from ``argv``, then ``run``; described by ``doc``'s first line."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    add_arguments(ap)
    return run(ap.parse_args(argv))
