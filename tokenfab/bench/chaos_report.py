"""The report of a chaos or soak run (``chaos.py``): the RSS trend of every instance, a Markdown summary, and the RSS
curve as a PNG (matplotlib)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from tokenfab.bench.common import markdown_table

WARMUP_S = 60.0  # RSS samples of an instance's first minute (allocator and caches filling) are not its trend


def _trend(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Start, end and peak RSS (server + core, MB) of one life of an instance while it served; start and end are medians
    of the first and last tenth of its samples after the warm-up."""
    serving = [s for s in samples if s.get("healthy")] or samples  # not the load of a (re)start
    total = [(s["t"], s["server_mb"] + s["core_mb"]) for s in serving]
    steady = [mb for t, mb in total if t - total[0][0] >= WARMUP_S] or [mb for _, mb in total]
    tenth = max(1, len(steady) // 10)
    start, end = statistics.median(steady[:tenth]), statistics.median(steady[-tenth:])
    return {"seconds": round(total[-1][0] - total[0][0], 1), "samples": len(total), "start_mb": round(start, 1),
            "end_mb": round(end, 1), "max_mb": round(max(mb for _, mb in total), 1),
            "growth_mb": round(end - start, 1)}


def rss_summary(instances: list[Any]) -> dict[str, Any]:
    """Per instance: the trend of its longest life (restarts begin a new one) and its number of lives."""
    out: dict[str, Any] = {}
    for inst in instances:
        lives: dict[int, list[dict[str, Any]]] = {}
        for s in inst.rss:
            lives.setdefault(s["generation"], []).append(s)
        if not lives:
            continue
        longest = max(lives.values(), key=len)
        out[str(inst.index)] = {"lives": len(lives), **_trend(longest)}
    return out


def write_markdown(report: dict[str, Any], path: Path) -> None:
    s, c, r = report["summary"], report["config"], report["recovery_s"]
    lines = [f"# tokenfab bench {report['benchmark']}", "",
             f"Commit `{report['commit']}`, model {report['model']}, {report['machine'].get('cpu', 'cpu')}; "
             f"{c['instances']} instance(s) (`--max-num-seqs {c['max_num_seqs']} --cpu-threads {c['cpu_threads']}`) "
             f"behind `{c['router']}` ({c['policy']}), {c['streams']} concurrent streams "
             f"for {report['load_seconds']} s, "
             + (f"one kill every {c['kill_interval']:g} s ({' / '.join(c['kill_kinds'])} in turn)."
                if c["kill_interval"] > 0 else "no kills (soak)."),
             "", f"Router flags: `{c['router_args']}`", "", *([report["note"], ""] if report.get("note") else []),
             f"**{'PASSED' if report['passed'] else 'FAILED'}** (nothing lost, every kill recovered, every answer "
             "that is not a completion is a 503 or the router's own doing): "
             f"sent {s['sent']}, accounted {s['accounted']}, lost {s['lost']}.", "", "## Outcomes (client's view)", "",
             markdown_table(["outcome", "requests"], [[k, v] for k, v in s["outcomes"].items()]), ""]
    if report["failures_by_cause"]:
        lines += ["Requests that neither completed nor got tokenfab's retryable 503, by the kill they followed "
                  "(ended within the blame window after it) -- `router_503` is vllm-router's own answer while it "
                  "has no healthy worker, `dropped_by_server_kill` a stream cut by a SIGKILLed server, "
                  "`router_5xx_by_server_kill` the router's 500 for a non-streamed request in flight on it:", "",
                  markdown_table(["outcome by cause", "requests"], list(report["failures_by_cause"].items())), ""]
    if report["kills"]:
        lines += ["## Kills and recovery (kill -> /health 200 and a completion served)", "",
                  f"Recovery p50 {r['p50']} s, **p99 {r['p99']} s**, max {r['max']} s over {r['n']} kills "
                  f"({report['unrecovered']} unrecovered).", "",
                  markdown_table(["t (s)", "instance", "kind", "recovery (s)"],
                                 [[k["t"], k["instance"], k["kind"], k["recovery_s"]] for k in report["kills"]]), ""]
    lat = (s.get("ok_latency_p50_s"), s.get("ok_latency_p99_s"))
    lines += [f"Completed requests: latency p50 {lat[0]} s, p99 {lat[1]} s (queueing included).", "",
              "## RSS (server + engine core) of each instance's longest life", "",
              markdown_table(["instance", "lives", "seconds", "start MB", "end MB", "max MB", "growth MB"],
                             [[k, v["lives"], v["seconds"], v["start_mb"], v["end_mb"], v["max_mb"], v["growth_mb"]]
                              for k, v in report["rss_summary"].items()]), "",
              f"Load average after the run: {report.get('load_average_after')} (a shared 2-core machine: latencies "
              "and recovery times are noisy).", ""]
    path.write_text("\n".join(lines))


def write_plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for index, samples in report["rss"].items():
        for gen in sorted({s["generation"] for s in samples}):
            life = [s for s in samples if s["generation"] == gen]
            ax.plot([s["t"] / 60 for s in life], [s["server_mb"] + s["core_mb"] for s in life], color=f"C{index}",
                    label=f"instance {index}" if gen == min(s["generation"] for s in samples) else None)
    for k in report["kills"]:
        ax.axvline(k["t"] / 60, color="grey", linestyle=":" if k["kind"] == "core" else "--", linewidth=0.8)
    ax.set_xlabel("minutes")
    ax.set_ylabel("RSS, server + engine core (MB)")
    ax.set_title(f"tokenfab bench {report['benchmark']}: {report['config']['streams']} streams, "
                 f"{report['config']['instances']} instance(s)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
