"""`tokenfab bench lora`: multi-LoRA serving cost, and online latency next to a /v1/batches job (issue 27).

Two parts, each against a `tokenfab serve` the command starts itself (on the bundled model, or ``--model``):

- **lora**: ``--adapters`` PEFT adapters (written by ``peft`` onto the model's architecture, random but
  deterministic weights, rank ``--rank``, every attention and MLP projection: ``bench/lora_adapters.py``) served
  with ``--enable-lora --lora-modules ... --max-loras N``. ``--streams`` concurrent streams on the base model,
  then the same prompts with the requests spread round-robin over the adapters; output tokens/s of both and
  their ratio (the issue's target: at least 0.7x). Both modes run on the same server, after one warm-up request
  per adapter (so every adapter is in a device slot).
- **batch**: online streams (``--online-concurrency`` at a time) measured alone, then again while a batch of
  ``--batch-lines`` chat lines runs on the same server (the engine's background class); p50/p99 time to first
  token of both phases and their ratios, and whether and when the batch finished. ``--isolation FLAGS`` (repeatable)
  runs this part once per set of server flags, each on a fresh server: ``--isolation default
  --isolation='--background-max-prefill-tokens 0'`` compares the defaults with the caps off.

The streaming clients and prompts are `tokenfab bench serve`'s, the server launch `tokenfab bench fleet`'s.
Writes JSON and Markdown (default ``benchmarks/results/lora_bench.{json,md}``); exits with 1 when a request failed.

    tokenfab bench lora --serve-args='--cpu-threads 2'
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import itertools
import json
import os
import shlex
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tokenfab.bench.common import git_commit, git_dirty, load_average, machine
from tokenfab.bench.fleet import _free_port, _processes, _wait
from tokenfab.bench.lora_adapters import write_adapters
from tokenfab.bench.serve import Target, _level, _prompts, _request, _resolve_model

TERMINAL = ("completed", "failed", "cancelled", "expired")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="base model: a folder or .gguf (default: the bundled model)")
    p.add_argument("--parts", default="lora,batch", help="comma-separated: lora, batch (default both)")
    p.add_argument("--serve-args", default="", metavar="FLAGS",
                   help="extra `tokenfab serve` flags for every server, one string (write --serve-args='--x 1')")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and of the adapters' weights")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    p.add_argument("--server-timeout", type=float, default=900.0, help="seconds a server may take to start")
    lora = p.add_argument_group("lora part")
    lora.add_argument("--adapters", type=int, default=8, help="adapters (also the server's --max-loras)")
    lora.add_argument("--rank", type=int, default=8)
    lora.add_argument("--streams", type=int, default=16, help="requests in flight")
    lora.add_argument("--num-requests", type=int, default=32, help="requests per mode (base, adapters)")
    lora.add_argument("--input-len", type=int, default=64, help="approximate prompt length in words")
    lora.add_argument("--output-len", type=int, default=32, help="max_tokens (ignore_eos: every request runs to it)")
    lora.add_argument("--repeats", type=int, default=1, help="base / adapters pairs, alternated")
    batch = p.add_argument_group("batch part")
    batch.add_argument("--isolation", action="append", default=None, metavar="FLAGS",
                       help="server flags of one run of this part (repeatable, one server each; 'default': none)")
    batch.add_argument("--online-requests", type=int, default=30, help="online requests per phase")
    batch.add_argument("--online-concurrency", type=int, default=2)
    batch.add_argument("--online-input-len", type=int, default=16, help="approximate prompt length in words")
    batch.add_argument("--online-output-len", type=int, default=8)
    batch.add_argument("--batch-lines", type=int, default=300)
    batch.add_argument("--batch-max-tokens", type=int, default=8)
    batch.add_argument("--batch-timeout", type=float, default=1200.0,
                       help="seconds to wait for the batch to finish after the online phase (0: cancel it at once)")
    p.add_argument("--json", default="benchmarks/results/lora_bench.json", help="write the report as JSON here")
    p.add_argument("--markdown", default="benchmarks/results/lora_bench.md", help="write the tables here")


@contextlib.contextmanager
def _server(args: argparse.Namespace, flags: list[str], data_dir: Path) -> Iterator[str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "tokenfab", "serve", *([args.model] if args.model else []), "--port", str(port),
           "--no-access-log", "--data-dir", str(data_dir), *shlex.split(args.serve_args), *flags]
    # a step of 16 adapter prompts through the Python layers can take minutes on a busy shared CPU: the servers'
    # hang watchdog (120 s by default) would take it for a hung core
    env = {**os.environ, "TOKENFAB_ENGINE_HANG_TIMEOUT": os.environ.get("TOKENFAB_ENGINE_HANG_TIMEOUT", "1800")}
    with _processes([cmd], env) as (proc,):
        url = f"http://127.0.0.1:{port}"
        _wait(f"{url}/health", proc, "tokenfab serve " + " ".join(flags), args.server_timeout)
        yield url


def _client_args(args: argparse.Namespace, output_len: int) -> argparse.Namespace:
    """The fields `bench serve`'s request helpers read: streamed completions, greedy, ``ignore_eos``."""
    return argparse.Namespace(endpoint="completions", output_len=output_len, ignore_eos=True,
                              continuous_usage=False, timeout=args.timeout)


def _http(concurrency: int, timeout: float) -> Any:
    import httpx

    n = concurrency + 4
    return httpx.AsyncClient(limits=httpx.Limits(max_connections=n, max_keepalive_connections=n), timeout=timeout)


async def _lora_levels(args: argparse.Namespace, url: str, names: list[str]) -> list[dict[str, Any]]:
    ns = _client_args(args, args.output_len)
    async with _http(args.streams, args.timeout) as client:
        base = Target("base", url)
        await _resolve_model(client, base)
        spread = itertools.cycle(names)
        adapters = Target(f"{len(names)} adapters", url, base.model, adapt=lambda p: {**p, "model": next(spread)})
        # warm-up, all at once, 2 tokens each: every adapter read and put in a device slot
        short = _client_args(args, 2)
        warm = await asyncio.gather(*(_request(client, short, Target("warm-up", url, name), "Say hello.", True)
                                      for name in [base.model, *names]))
        for name, w in zip([base.model, *names], warm):
            if not w.ok:
                raise SystemExit(f"warm-up request on {name} failed: {w.error}")
        rows = []
        for k in range(args.repeats):
            prompts = _prompts(args.num_requests, args.input_len, args.seed + k)
            for target in (base, adapters) if k % 2 == 0 else (adapters, base):
                rows.append({**await _level(client, ns, target, args.streams, prompts, True), "repeat": k})
    return rows


def lora_part(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    adapters = write_adapters(args.model, work / "adapters", args.adapters, args.rank, seed=args.seed)
    flags = ["--enable-lora", "--lora-modules", *(f"{name}={path}" for name, path in adapters),
             "--max-loras", str(args.adapters), "--max-lora-rank", str(args.rank)]
    with _server(args, flags, work / "data-lora") as url:
        rows = asyncio.run(_lora_levels(args, url, [name for name, _ in adapters]))
    base = sum(r["output_throughput"] for r in rows if r["server"] == "base")
    with_adapters = sum(r["output_throughput"] for r in rows if r["server"] != "base")
    return {"adapters": args.adapters, "rank": args.rank, "targets": "attention + MLP (7 projections)",
            "streams": args.streams, "num_requests": args.num_requests, "input_len_words": args.input_len,
            "output_len": args.output_len, "rows": rows,
            "server_flags": f"--enable-lora --lora-modules lora0..lora{args.adapters - 1}=<folders> --max-loras "
                            f"{args.adapters} --max-lora-rank {args.rank}",
            "ratio": with_adapters / base if base else float("nan")}


def _batch_lines(model: str, n: int, max_tokens: int) -> bytes:
    return "".join(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions", "body": {
        "model": model, "messages": [{"role": "user", "content": f"Tell me fact number {i} about rivers."}],
        "max_tokens": max_tokens, "temperature": 0.0}}) + "\n" for i in range(n)).encode()


async def _online(args: argparse.Namespace, url: str, model: str, seed: int, warmup: int) -> dict[str, Any]:
    ns = _client_args(args, args.online_output_len)
    target = Target("online", url, model)
    async with _http(args.online_concurrency, args.timeout) as client:
        for prompt in _prompts(warmup, args.online_input_len, seed + 10_000):
            await _request(client, ns, target, prompt, True)
        prompts = _prompts(args.online_requests, args.online_input_len, seed)
        return await _level(client, ns, target, args.online_concurrency, prompts, True)


def _isolation_run(args: argparse.Namespace, flags: str, data_dir: Path) -> dict[str, Any]:
    import openai

    with _server(args, shlex.split(flags), data_dir) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=args.timeout)
        model = client.models.list().data[0].id
        alone = asyncio.run(_online(args, url, model, args.seed + 1, warmup=2))
        f = client.files.create(file=("batch.jsonl", io.BytesIO(_batch_lines(model, args.batch_lines,
                                                                             args.batch_max_tokens))), purpose="batch")
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        t0 = time.monotonic()
        while (b := client.batches.retrieve(batch.id)).request_counts.completed < 1 and b.status not in TERMINAL:
            if time.monotonic() - t0 > args.timeout:
                raise SystemExit("the batch answered no line in time")
            time.sleep(0.05)
        done_before = b.request_counts.completed
        with_batch = asyncio.run(_online(args, url, model, args.seed + 2, warmup=0))
        b = client.batches.retrieve(batch.id)
        done_during = b.request_counts.completed - done_before
        if args.batch_timeout <= 0:
            client.batches.cancel(batch.id)
        t1 = time.monotonic()  # the wait for the batch to finish counts from here (a cancelled one: its lines stop)
        while b.status not in TERMINAL and time.monotonic() - t1 < max(args.batch_timeout, 0) + 60:
            time.sleep(1.0)
            b = client.batches.retrieve(batch.id)
    finished = b.status == "completed"

    def ratio(q: str) -> float:
        return with_batch["ttft_ms"][q] / alone["ttft_ms"][q]

    return {"flags": flags or "(defaults)", "alone": alone, "with_batch": with_batch,
            "p50_ratio": ratio("p50"), "p99_ratio": ratio("p99"), "batch_status": b.status,
            "batch_completed": b.request_counts.completed, "batch_failed": b.request_counts.failed,
            "batch_lines_during_online_phase": done_during,
            "batch_seconds": (b.completed_at - b.created_at) if finished and b.completed_at is not None else None}


def batch_part(args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    configs = args.isolation or ["default"]
    return [_isolation_run(args, "" if flags == "default" else flags, work / f"data-batch{i}")
            for i, flags in enumerate(configs)]


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def markdown(report: dict[str, Any]) -> str:
    m = report["machine"]
    out = [f"# tokenfab bench lora ({report['model']})", "",
           f"commit {report['commit']}{' (uncommitted changes in the tree)' if report['uncommitted_changes'] else ''}"
           f" · {m.get('cpu') or m['platform']}, {m['cpus']} CPUs{', ' + m['gpu'] if m.get('gpu') else ''} · load "
           f"average {report['load_average']} · server flags `{report['serve_args'] or '(none)'}` · "
           f"{report['timestamp']}", "", f"Command: `{report['command']}`", "", report["note"], ""]
    lora = report.get("lora")
    if lora:
        out += [f"## {lora['streams']} streams over {lora['adapters']} adapters vs {lora['streams']} on the base", "",
                f"{lora['adapters']} PEFT adapters (rank {lora['rank']}, {lora['targets']}, random weights), "
                f"`--max-loras {lora['adapters']}`; {lora['streams']} streams in flight, {lora['num_requests']} "
                f"requests per mode, ~{lora['input_len_words']} words in, {lora['output_len']} tokens out (greedy, "
                "ignore_eos); the adapters' requests spread round-robin.", "",
                "| mode | repeat | ok/total | output tok/s | TTFT p50 / p99 (ms) | TPOT p50 (ms) |",
                "|---|---:|---:|---:|---:|---:|"]
        for r in lora["rows"]:
            out.append(f"| {r['server']} | {r['repeat']} | {r['completed']}/{r['num_requests']} | "
                       f"{r['output_throughput']:.1f} | {_ms(r['ttft_ms']['p50'])} / {_ms(r['ttft_ms']['p99'])} | "
                       f"{_ms(r['tpot_ms']['p50'])} |")
        out += ["", f"**adapters / base output tok/s: {lora['ratio']:.2f}x** (target: at least 0.7x)", ""]
    runs = report.get("batch") or []
    if runs:
        a = report["batch_workload"]
        out += ["## Online TTFT alone vs with a batch running", "",
                f"{a['online_requests']} online streamed completions per phase, {a['online_concurrency']} at a time, "
                f"~{a['online_input_len_words']} words in, {a['online_output_len']} tokens out; the batch: "
                f"{a['batch_lines']} chat lines of {a['batch_max_tokens']} tokens, created after the alone phase, the "
                "second phase starting once its first line is answered.", "",
                "| server flags | alone p50 / p99 (ms) | with batch p50 / p99 (ms) | p50 ratio | p99 ratio "
                "| batch lines done in the phase | batch |", "|---|---:|---:|---:|---:|---:|---|"]
        for r in runs:
            al, wb = r["alone"]["ttft_ms"], r["with_batch"]["ttft_ms"]
            done = (f"{r['batch_status']} ({r['batch_completed']} ok, {r['batch_failed']} failed"
                    + (f", {r['batch_seconds']:.0f} s" if r["batch_seconds"] is not None else "") + ")")
            out.append(f"| `{r['flags']}` | {_ms(al['p50'])} / {_ms(al['p99'])} | {_ms(wb['p50'])} / "
                       f"{_ms(wb['p99'])} | {r['p50_ratio']:.2f}x | {r['p99_ratio']:.2f}x | "
                       f"{r['batch_lines_during_online_phase']} | {done} |")
        out += ["", f"p99: numpy's percentile of the phase's {a['online_requests']} samples (near the worst of them); "
                "TTFT = time to the first streamed token."]
    return "\n".join(out) + "\n"


def run(args: argparse.Namespace) -> int:
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    if not parts or parts - {"lora", "batch"}:
        raise SystemExit("--parts: give lora, batch or both")
    report: dict[str, Any] = {
        "benchmark": "lora", "model": args.model or "bundled SmolLM2-135M-Instruct (Q4_1 GGUF)",
        "command": "tokenfab bench lora " + (" ".join(shlex.quote(a) for a in sys.argv[3:])
                                             if sys.argv[1:3] == ["bench", "lora"] else "(called from Python)"),
        "serve_args": args.serve_args, "machine": machine(), "commit": git_commit(), "uncommitted_changes": git_dirty(),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "load_average_start": load_average(),
        "note": "One run on a shared machine: the figures are noisy, re-run the command to measure again.",
    }
    with tempfile.TemporaryDirectory(prefix="tokenfab-bench-lora-") as tmp:
        if "lora" in parts:
            report["lora"] = lora_part(args, Path(tmp))
            print(f"adapters / base output tok/s: {report['lora']['ratio']:.2f}x", file=sys.stderr, flush=True)
        if "batch" in parts:
            report["batch_workload"] = {k: getattr(args, k) for k in (
                "online_requests", "online_concurrency", "online_output_len", "batch_lines", "batch_max_tokens")}
            report["batch_workload"]["online_input_len_words"] = args.online_input_len
            report["batch"] = batch_part(args, Path(tmp))
    report["load_average"] = [report.pop("load_average_start"), load_average()]
    text = markdown(report)
    print("\n" + text)
    for path, data in ((args.json, json.dumps(report, indent=2)), (args.markdown, text)):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(data)
    rows = (report.get("lora") or {}).get("rows", []) + [r[k] for r in report.get("batch", [])
                                                         for k in ("alone", "with_batch")]
    failed = sum(r["failed"] for r in rows) + sum(r["batch_failed"] for r in report.get("batch", []))
    if failed:
        print(f"{failed} request(s) failed", file=sys.stderr)
    return 1 if failed else 0
