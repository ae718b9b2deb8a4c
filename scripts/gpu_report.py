"""The GPU check's report, appended to section by section (``scripts/gpu_check.sh``).

Each section of the check calls ``add`` as soon as it ends, which rewrites ``$OUT/gpu_report.json``
(atomically) and appends to ``$OUT/gpu_report.md``: a run killed halfway still leaves a report of
every section it finished. The JSON's ``verdict`` is kept current after every section:
"pass" / "fail" once ``finish`` ran, "incomplete (...)" before. Standard library only (no torch:
it runs between sections in a fraction of a second).

    python scripts/gpu_report.py init --out DIR --title TEXT
    python scripts/gpu_report.py add --out DIR --section NAME --rc RC --seconds S --limit L \\
        [--json FILE] [--markdown FILE] [--junit FILE] [--log FILE] [--skipped REASON] [--optional]
    python scripts/gpu_report.py finish --out DIR --elapsed S
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

TIMEOUT_RCS = (124, 137)


def _load(out: Path) -> dict[str, Any]:
    p = out / "gpu_report.json"
    if p.exists():
        try:
            return json.loads(p.read_text())
        except ValueError:
            pass
    return {"kind": "gpu_check", "sections": [], "verdict": "incomplete (no section finished)"}


def _save(out: Path, report: dict[str, Any]) -> None:
    p = out / "gpu_report.json"
    tmp = p.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=1))
    os.replace(tmp, p)


def _append_md(out: Path, lines: list[str]) -> None:
    with open(out / "gpu_report.md", "a") as f:
        f.write("\n".join(lines) + "\n")


def _read(path: str | None) -> str | None:
    if path and Path(path).is_file():
        return Path(path).read_text(errors="replace")
    return None


def junit_summary(xml_text: str) -> dict[str, Any]:
    root = ET.fromstring(xml_text)
    suites = [root] if root.tag == "testsuite" else list(root)
    s: dict[str, Any] = {k: sum(int(x.get(k, 0)) for x in suites) for k in ("tests", "failures", "errors", "skipped")}
    s["passed"] = s["tests"] - s["failures"] - s["errors"] - s["skipped"]
    s["time_s"] = round(sum(float(x.get("time", 0)) for x in suites), 1)
    s["failed"] = [f"{c.get('classname')}::{c.get('name')}" for x in suites for c in x.iter("testcase")
                   if c.find("failure") is not None or c.find("error") is not None]
    return s


def status_of(rc: int | None, skipped: str | None, data: Any, no_time: bool = False) -> str:
    if no_time:
        return "not_run"  # the budget ran out: the check is incomplete, which fails the verdict
    if skipped:
        return "skipped"
    if rc in TIMEOUT_RCS:
        return "timeout"
    if isinstance(data, dict) and data.get("pass") is False:
        return "fail"
    return "ok" if rc == 0 else "fail"


def goals(section: str, data: Any) -> list[dict[str, Any]]:
    """The issue's performance goals, read from a benchmark section's JSON (reported, not a verdict)."""
    out: list[dict[str, Any]] = []
    if not isinstance(data, dict):
        return out
    if section == "kernel_benchmarks" and isinstance(data.get("results"), list):
        rows = {r.get("op"): r for r in data["results"] if isinstance(r, dict) and "error" not in r}
        for name, op, key, target, fmt in (
            ("decode attention >= 80% of copy bandwidth", "paged_decode_attention", "fraction_of_ceiling", 0.80, "pct"),
            ("prefill attention >= 1.0x torch SDPA", "prefill_attention", "speedup_vs_peer", 1.0, "x"),
            ("rms_norm >= 85% of copy bandwidth", "rms_norm", "fraction_of_ceiling", 0.85, "pct"),
            ("add_rms_norm >= 85% of copy bandwidth", "add_rms_norm", "fraction_of_ceiling", 0.85, "pct"),
            ("fused MoE (Qwen3-30B-A3B layer) at 8192 tokens >= 50% of matrix peak", "fused_moe T=8192",
             "fraction_of_ceiling", 0.50, "pct"),
        ):
            v = (rows.get(op) or {}).get(key)
            out.append(dict(goal=name, value=v, target=target, met=v is not None and v >= target, fmt=fmt))
    if section == "mla_benchmarks" and isinstance(data.get("rows"), list):
        first = next((r for r in data["rows"] if str(r.get("op", "")).startswith("mla")), None)
        v = first.get("fraction_of_ceiling") if first else None
        out.append(dict(goal="MLA decode (DeepSeek-V3 sizes) >= 70% of copy bandwidth", value=v, target=0.70,
                        met=v is not None and v >= 0.70, fmt="pct"))
    return out


def _goal_lines(gs: list[dict[str, Any]]) -> list[str]:
    lines = ["", "| goal | measured | met |", "| --- | --- | --- |"]
    for g in gs:
        v = g["value"]
        shown = "-" if v is None else (f"{100 * v:.0f}%" if g["fmt"] == "pct" else f"{v:.2f}x")
        lines.append(f"| {g['goal']} | {shown} | {'yes' if g['met'] else 'no'} |")
    return lines


def cmd_init(a: argparse.Namespace) -> None:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"kind": "gpu_check", "title": a.title, "sections": [], "verdict": "incomplete (no section finished)"}
    _save(out, report)
    (out / "gpu_report.md").write_text(f"# GPU check report\n\n{a.title}\n")


def cmd_add(a: argparse.Namespace) -> None:
    out = Path(a.out)
    report = _load(out)
    text = _read(a.json)
    data: Any = None
    if text:
        try:
            data = json.loads(text)
        except ValueError:
            data = {"unparsed": text[-2000:]}
    section: dict[str, Any] = {"name": a.section, "rc": a.rc, "seconds": a.seconds, "limit_s": a.limit,
                               "optional": a.optional}
    junit = _read(a.junit)
    if junit:
        try:
            section["tests"] = junit_summary(junit)
        except ET.ParseError as e:
            section["tests"] = {"unparsed": str(e)}
    section["status"] = status_of(a.rc, a.skipped, data, a.no_time)
    if a.skipped:
        section["skipped"] = a.skipped
    if data is not None:
        section["result"] = data
    gs = goals(a.section, data)
    if gs:
        section["goals"] = gs
    log = _read(a.log)
    if log and section["status"] not in ("ok", "skipped"):
        section["log_tail"] = log[-3000:]
    report["sections"].append(section)
    report["verdict"] = f"incomplete ({len(report['sections'])} sections finished)"
    _save(out, report)

    md = ["", f"## {a.section}: {section['status'].upper()}", "",
          f"rc {a.rc}, {a.seconds} s of a {a.limit} s limit" + (" (optional)" if a.optional else "") + "."]
    if a.skipped:
        md.append(f"Skipped: {a.skipped}")
    t = section.get("tests")
    if t and "tests" in t:
        md.append(f"{t['tests']} tests: {t['passed']} passed, {t['failures']} failed, {t['errors']} errors, "
                  f"{t['skipped']} skipped in {t['time_s']} s.")
        md += [f"- FAILED {f}" for f in t["failed"][:50]]
    body = _read(a.markdown)
    if body:
        md += ["", body.rstrip()]
    if gs:
        md += _goal_lines(gs)
    if section.get("log_tail"):
        md += ["", "Log tail:", "", "```", section["log_tail"], "```"]
    _append_md(out, md)


def cmd_finish(a: argparse.Namespace) -> None:
    out = Path(a.out)
    report = _load(out)
    report["elapsed_s"] = a.elapsed
    required = [s for s in report["sections"] if not s.get("optional")]
    bad = [f"{s['name']} ({s['status']})" for s in required if s["status"] not in ("ok", "skipped")]
    report["verdict"] = "fail" if bad else "pass"
    report["failed_sections"] = bad
    _save(out, report)
    lines = ["", "## Verdict", "", f"**{report['verdict'].upper()}** after {a.elapsed} s"]
    lines += [f"- {s['name']}: {s['status']}" + (f" ({s['skipped']})" if s.get("skipped") else "")
              for s in report["sections"]]
    _append_md(out, lines)
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="the GPU check's report")
    sub = p.add_subparsers(dest="cmd", required=True)
    i = sub.add_parser("init")
    i.add_argument("--out", required=True)
    i.add_argument("--title", default="")
    ad = sub.add_parser("add")
    ad.add_argument("--out", required=True)
    ad.add_argument("--section", required=True)
    ad.add_argument("--rc", type=int, default=None)
    ad.add_argument("--seconds", type=int, default=0)
    ad.add_argument("--limit", type=int, default=0)
    ad.add_argument("--json")
    ad.add_argument("--markdown")
    ad.add_argument("--junit")
    ad.add_argument("--log")
    ad.add_argument("--skipped")
    ad.add_argument("--optional", action="store_true", help="a failure here does not fail the verdict")
    ad.add_argument("--no-time", action="store_true", help="not run: the time budget was spent (fails the verdict)")
    f = sub.add_parser("finish")
    f.add_argument("--out", required=True)
    f.add_argument("--elapsed", type=int, default=0)
    a = p.parse_args(argv)
    {"init": cmd_init, "add": cmd_add, "finish": cmd_finish}[a.cmd](a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
