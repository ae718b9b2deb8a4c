"""`tokenfab bench chaos`: N `tokenfab serve` instances behind `vllm-router` under a bounded load, with SIGKILLs of an
instance (the server process) and of an engine core (the server's child) at random times, and the instances
restarted as a liveness probe would (``chaos_fleet.py``). It accounts for every request sent (``chaos_load.py``):
each one completed or got a retryable 503, none lost, no 5xx but 503. It reports the recovery time of every kill
(kill -> the instance healthy and serving again) and the RSS of every instance over time.

``--kill-interval 0`` runs no kills: the soak (``--duration 3600 --streams 16``), whose RSS curve ``--plot`` draws.
Where the client sees something else than a completion or a 503, the report says which kill it followed: a stream
already under way through a server that is SIGKILLed cannot get an HTTP status any more (its 200 left long ago), so
the router can only cut it; such ends within ``--blame-window`` s of a server kill are counted apart as
``dropped_by_server_kill`` (the client's view; no router setting turns them into anything else).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tokenfab.bench.chaos_fleet import Instance, Kill, sample_rss, supervise, wait_healthy
from tokenfab.bench.chaos_load import RETRYABLE, LoadGenerator, Record
from tokenfab.bench.chaos_report import rss_summary, write_markdown, write_plot
from tokenfab.bench.common import git_commit, load_average, machine, write_json
from tokenfab.bench.fleet import _free_port, _router_cmd, _wait

# The router's defaults would send traffic to a dead instance for minutes (a health check a minute, 3 failures to
# mark a worker down; a circuit breaker that, once open, stayed open 60 s after the instance was back). Here: check
# every second, mark a worker down at the first failure and up at the first success, no circuit breaker (the 1 s
# health check does its work: a dead engine answers /health 503), and retries spread over ~5 s (backoff 0.2, 0.4,
# 0.8, 1.6, 2 s): a worker that refuses connections and is still marked healthy is retried past the next health check,
# so the router ends on a healthy worker or its own 503, where 3 quick tries ended on its 500 "Request failed: error
# sending request" (docs/fleet.md).
ROUTER_ARGS = ("--health-check-interval-secs 1 --health-failure-threshold 1 --health-success-threshold 1 "
               "--health-check-timeout-secs 2 --retry-max-retries 6 --retry-initial-backoff-ms 200 "
               "--retry-backoff-multiplier 2 --retry-max-backoff-ms 2000 --disable-circuit-breaker")

CONFIG_KEYS = ("instances", "duration", "streams", "kill_interval", "kill_kinds", "max_num_seqs", "cpu_threads",
               "num_kv_blocks", "router", "policy", "router_args", "seed")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="the instances' model (default: the bundled one)")
    p.add_argument("--instances", type=int, default=3)
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load (kills happen inside it)")
    p.add_argument("--streams", type=int, default=6, help="concurrent request loops")
    p.add_argument("--kill-interval", type=float, default=60.0,
                   help="one kill at a random time in every interval of this many seconds (0: no kills, a soak)")
    p.add_argument("--kill-kinds", nargs="+", default=["server", "core"], choices=["server", "core"],
                   help="what the kills hit, in turn: the server process, its engine core")
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--cpu-threads", type=int, default=1)
    p.add_argument("--num-kv-blocks", type=int, default=64,
                   help="KV blocks per instance (16 tokens each): small, so a restart allocates little")
    p.add_argument("--router", default="vllm-router", choices=["vllm-router", "sglang-router"])
    p.add_argument("--policy", default="round_robin")
    p.add_argument("--router-args", default=ROUTER_ARGS, help="extra router flags (one string)")
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--rss-every", type=float, default=5.0, help="seconds between RSS samples")
    p.add_argument("--blame-window", type=float, default=3.0,
                   help="a dropped stream that ended this many seconds after a server kill is counted as its doing")
    p.add_argument("--recovery-timeout", type=float, default=600.0,
                   help="after the load, wait this long for the last recoveries")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logs", default=None, help="directory for the instances' and the router's logs")
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)
    p.add_argument("--plot", default=None, help="PNG of every instance's RSS over time")


async def _chaos(instances: list[Instance], args: argparse.Namespace, t_start: float, kills: list[Kill],
                 skipped: list[dict], stop: asyncio.Event) -> None:
    """One kill at a random point of every ``kill_interval`` window, the kinds in turn, on a healthy instance."""
    if args.kill_interval <= 0:
        return
    rng = random.Random(args.seed + 1)
    slot = 0
    while True:
        at = t_start + (slot + rng.uniform(0.2, 0.8)) * args.kill_interval
        if at > t_start + args.duration - 2:
            return
        kind = args.kill_kinds[slot % len(args.kill_kinds)]
        slot += 1
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), max(0.0, at - time.monotonic()))
            return
        ready = [i for i in instances if i.healthy and i.pending is None]
        kill = rng.choice(ready).kill(kind) if ready else None
        if kill is None:
            skipped.append({"t": round(at - t_start, 1), "kind": kind, "why": "no healthy instance to kill"})
            continue
        kills.append(kill)
        print(f"[{at - t_start:6.1f}s] SIGKILL {kind} of instance {kill.instance} (pid {kill.pid})", flush=True)


def _blame(records: list[Record], kills: list[Kill], window: float) -> dict[str, int]:
    """Failed requests by what they followed: a server kill (within ``window`` s), a core kill, or nothing."""
    out: dict[str, int] = {}
    for rec in records:
        if rec.outcome == "ok" or rec.outcome in RETRYABLE:
            continue
        near = [k for k in kills if k.at <= rec.end <= k.at + window]
        cause = near[-1].kind + "_kill" if near else "no_kill"
        key = f"{rec.outcome}_by_{cause}"
        out[key] = out.get(key, 0) + 1
    return out


def _routers_doing(cause: str) -> bool:
    """A failure the router alone causes: its own 503 while no instance is up, or a request in flight on a server that
    was SIGKILLed (a stream cut, or the router's 500 for a non-streamed one): no server could answer those."""
    return cause.startswith("router_503") or cause in ("dropped_by_server_kill", "router_5xx_by_server_kill")


def _samples(records: list[Record], t_start: float) -> list[dict]:
    """Every failure but the router's own 503s (up to 200), then a few of those."""
    failed = [r for r in records if r.outcome != "ok" and r.outcome not in RETRYABLE]
    ours = [r for r in failed if r.outcome != "router_503"]
    picked = ours[:200] + [r for r in failed if r.outcome == "router_503"][:5]
    return [{"t": round(r.end - t_start, 1), "kind": r.kind, "stream": r.stream, "outcome": r.outcome,
             "status": r.status, "detail": r.detail} for r in sorted(picked, key=lambda r: r.end)]


def _pct(xs: list[float], q: float) -> float | None:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 2) if xs else None


async def _run(args: argparse.Namespace, model_id: str, instances: list[Instance], base: str) -> dict:
    stop_load, stop_all = asyncio.Event(), asyncio.Event()
    load = LoadGenerator(base, model_id, args.streams, args.request_timeout, args.seed)
    t_start = time.monotonic()
    kills: list[Kill] = []
    skipped: list[dict] = []
    background = [asyncio.create_task(supervise(i, model_id, stop_all)) for i in instances]
    background.append(asyncio.create_task(sample_rss(instances, t_start, args.rss_every, stop_all)))
    chaos = asyncio.create_task(_chaos(instances, args, t_start, kills, skipped, stop_load))
    load_task = asyncio.create_task(load.run(stop_load))
    await asyncio.sleep(args.duration)
    stop_load.set()
    await chaos
    await load_task  # the in-flight requests finish (each bounded by --request-timeout)
    load_s = time.monotonic() - t_start
    deadline = time.monotonic() + args.recovery_timeout
    while any(i.pending is not None for i in instances) and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
    stop_all.set()
    await asyncio.gather(*background)
    summary = load.summary()
    failures = {k: v for k, v in summary["outcomes"].items() if k != "ok" and k not in RETRYABLE and v}
    blame = _blame(load.records, kills, args.blame_window)
    unexplained = {k: v for k, v in blame.items() if not _routers_doing(k)}
    recoveries = [k.recovery_s for k in kills if k.recovery_s is not None]
    return {
        "load_seconds": round(load_s, 1), "summary": summary, "failures": failures, "failures_by_cause": blame,
        "passed": summary["lost"] == 0 and not unexplained and all(k.recovery_s is not None for k in kills),
        "kills": [{"instance": k.instance, "kind": k.kind, "pid": k.pid, "t": round(k.at - t_start, 1),
                   "recovery_s": None if k.recovery_s is None else round(k.recovery_s, 2),
                   "restarted_after_s": None if k.restarted_at is None else round(k.restarted_at - k.at, 2)}
                  for k in kills],
        "kills_skipped": skipped, "unrecovered": sum(k.recovery_s is None for k in kills),
        "recovery_s": {"n": len(recoveries), "p50": _pct(recoveries, 0.5), "p99": _pct(recoveries, 0.99),
                       "max": round(max(recoveries), 2) if recoveries else None},
        "failure_samples": _samples(load.records, t_start),
        "rss": {str(i.index): i.rss for i in instances}, "rss_summary": rss_summary(instances),
        "restarts": {str(i.index): i.generation - 1 for i in instances},
    }


def run(args: argparse.Namespace) -> int:
    import httpx

    log_dir = Path(args.logs) if args.logs else Path(tempfile.mkdtemp(prefix="tokenfab-chaos-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    serve = [sys.executable, "-m", "tokenfab", "serve", *([args.model] if args.model else []),
             "--max-num-seqs", str(args.max_num_seqs), "--cpu-threads", str(args.cpu_threads),
             "--num-kv-blocks", str(args.num_kv_blocks),
             "--drain-timeout", "2", "--no-access-log", "--log-level", "warning"]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.cpu_threads)}
    instances = [Instance(k, _free_port(), serve, env, log_dir) for k in range(args.instances)]
    report: dict = {"benchmark": "chaos" if args.kill_interval > 0 else "soak", "machine": machine(),
                    "commit": git_commit(), "model": args.model or "bundled",
                    "config": {k: getattr(args, k) for k in CONFIG_KEYS},
                    "logs": str(log_dir)}
    # SIGTERM (a timeout, a Ctrl-C'd parent) unwinds through the finally blocks: no instance or router outlives us
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    for inst in instances:
        inst.start()
    try:
        asyncio.run(wait_healthy(instances, 900))
        model_id = httpx.get(f"{instances[0].url}/v1/models").json()["data"][0]["id"]
        port = _free_port()
        router_cmd = [*_router_cmd(args.router, args.policy, port, [i.url for i in instances]),
                      *args.router_args.split()]
        if args.router == "vllm-router":  # its metrics port defaults to 29000: another router may hold it
            router_cmd += ["--prometheus-port", str(_free_port())]
        with open(log_dir / "router.log", "w") as router_log:
            router = subprocess.Popen(router_cmd, stdout=router_log, stderr=subprocess.STDOUT)
        try:
            base = f"http://127.0.0.1:{port}"
            _wait(f"{base}/workers", router, args.router, 60,
                  ok=lambda r: all(w["is_healthy"] for w in r.json()["workers"]))
            report.update(asyncio.run(_run(args, model_id, instances, base)))
        finally:
            router.terminate()
            try:
                router.wait(10)
            except subprocess.TimeoutExpired:
                router.kill()
                router.wait()
    finally:
        for inst in instances:
            inst.stop()
    report["load_average_after"] = load_average()
    _print(report)
    write_json(args.json, report)
    if args.markdown:
        write_markdown(report, Path(args.markdown))
    if args.plot:
        write_plot(report, Path(args.plot))
    return 0 if report["passed"] else 1


def _print(report: dict) -> None:
    s = report["summary"]
    print(f"sent {s['sent']}, accounted {s['accounted']}, lost {s['lost']}; outcomes {s['outcomes']}")
    print(f"failures by cause: {report['failures_by_cause'] or 'none'}")
    r = report["recovery_s"]
    print(f"kills {len(report['kills'])} (unrecovered {report['unrecovered']}); recovery p50 {r['p50']} s, "
          f"p99 {r['p99']} s, max {r['max']} s")
    for k, v in report["rss_summary"].items():
        print(f"instance {k}: RSS {v}")
    print("PASSED" if report["passed"] else "FAILED")
