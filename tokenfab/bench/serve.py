"""`tokenfab bench serve`: a load generator for any OpenAI-compatible server.

For each concurrency level it keeps that many streaming requests in flight until
``--num-requests`` have finished, and reports request throughput, output tokens/s, and time to
first token (TTFT), time per output token (TPOT: (last - first token time) / (tokens - 1)) and
inter-token latency (ITL: gaps between streamed chunks) at p50/p90/p99, as a Markdown table, JSON
(``--json``) and a PNG (``--plot``).

    tokenfab bench serve --base-url http://127.0.0.1:8000 --concurrency 1,4,16 --num-requests 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

_WORDS = (
    "the a model token server batch cache kernel stream request latency memory block prefix decode prefill "
    "river mountain city ocean forest garden window morning evening story music paper science history "
    "quickly slowly carefully brightly quietly always never often sometimes because while after before "
    "red blue green small large ancient modern simple complex gentle strong bright dark warm cold"
).split()


@dataclass
class RequestResult:
    ok: bool
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float | None:
        if self.output_tokens <= 1:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000",
                        help="server root, with or without /v1 (default http://127.0.0.1:8000)")
    parser.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    parser.add_argument("--endpoint", default="completions", choices=["completions", "chat"])
    parser.add_argument("--concurrency", default="1,4,16", help="comma-separated levels (default 1,4,16)")
    parser.add_argument("--num-requests", type=int, default=32, help="requests per concurrency level")
    parser.add_argument("--input-len", type=int, default=128, help="approximate prompt length in words")
    parser.add_argument("--output-len", type=int, default=64, help="max_tokens of each request")
    parser.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                        help="do not send ignore_eos (for servers that reject unknown fields)")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY") or os.environ.get("TOKENFAB_API_KEY"))
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic prompts")
    parser.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    parser.add_argument("--warmup", type=int, default=1, help="warm-up requests before measuring")
    parser.add_argument("--json", dest="json_out", default=None, help="write results as JSON here")
    parser.add_argument("--plot", default=None, help="write a PNG plot here")
    parser.add_argument("--label", default=None, help="name of the server in the report")


def _prompts(n: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        body = " ".join(rng.choice(_WORDS) for _ in range(max(1, words - 8)))
        # a distinct head per request: no two prompts share a cached prefix by accident
        out.append(f"Request {i} {rng.randrange(1 << 30)}: continue this text. {body}")
    return out


def _root(base_url: str) -> str:
    url = base_url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


async def _one(client: Any, url: str, payload: dict[str, Any], timeout: float) -> RequestResult:
    start = time.perf_counter()
    first: float | None = None
    last = start
    chunks = 0
    itls: list[float] = []
    usage: dict[str, Any] | None = None
    try:
        async with client.stream("POST", url, json=payload, timeout=timeout) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                return RequestResult(False, f"HTTP {resp.status_code}: {body[:200]}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if "error" in msg:
                    return RequestResult(False, str(msg["error"])[:200])
                if msg.get("usage"):
                    usage = msg["usage"]
                has_text = False
                for choice in msg.get("choices") or []:
                    text = choice.get("text")
                    if text is None:
                        text = (choice.get("delta") or {}).get("content")
                    if text:
                        has_text = True
                if has_text:
                    now = time.perf_counter()
                    if first is None:
                        first = now
                    else:
                        itls.append(now - last)
                    last = now
                    chunks += 1
    except Exception as e:  # network errors, timeouts
        return RequestResult(False, f"{type(e).__name__}: {e}"[:200])
    end = time.perf_counter()
    if first is None:
        return RequestResult(False, "no tokens received")
    out_tokens = int(usage.get("completion_tokens", chunks)) if usage else chunks
    prompt_tokens = int(usage.get("prompt_tokens", 0)) if usage else 0
    return RequestResult(True, prompt_tokens=prompt_tokens, output_tokens=out_tokens, ttft=first - start,
                         e2e=last - start if last > start else end - start, itls=itls)


def _payload(args: argparse.Namespace, model: str, prompt: str) -> dict[str, Any]:
    p: dict[str, Any] = {"model": model, "max_tokens": args.output_len, "stream": True,
                         "stream_options": {"include_usage": True}, "temperature": 0.0}
    if args.endpoint == "chat":
        p["messages"] = [{"role": "user", "content": prompt}]
    else:
        p["prompt"] = prompt
    if args.ignore_eos:
        p["ignore_eos"] = True
    return p


def _pct(values: list[float], scale: float = 1000.0) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    import numpy as np

    a = np.asarray(values, dtype=float) * scale
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99))}


async def _level(client: Any, args: argparse.Namespace, model: str, url: str, concurrency: int,
                 prompts: list[str]) -> dict[str, Any]:
    queue: asyncio.Queue[str] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    results: list[RequestResult] = []

    async def worker() -> None:
        while True:
            try:
                prompt = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            results.append(await _one(client, url, _payload(args, model, prompt), args.timeout))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    duration = time.perf_counter() - t0
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    errors = sorted({r.error for r in results if not r.ok})
    return {
        "concurrency": concurrency,
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": errors[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "mean_input_tokens": in_tokens / len(ok) if ok else 0.0,
        "mean_output_tokens": out_tokens / len(ok) if ok else 0.0,
        "ttft_ms": _pct([r.ttft for r in ok]),
        "tpot_ms": _pct([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": _pct([x for r in ok for x in r.itls]),
        "e2e_ms": _pct([r.e2e for r in ok]),
    }


def _fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def markdown_table(results: list[dict[str, Any]]) -> str:
    head = ("| concurrency | ok/total | req/s | output tok/s | TTFT p50 / p90 / p99 (ms) "
            "| TPOT p50 / p90 / p99 (ms) | ITL p50 / p90 / p99 (ms) |")
    lines = [head, "|---:|---:|---:|---:|---:|---:|---:|"]

    def trio(d: dict[str, float | None]) -> str:
        return f"{_fmt(d['p50'])} / {_fmt(d['p90'])} / {_fmt(d['p99'])}"

    for r in results:
        lines.append(f"| {r['concurrency']} | {r['completed']}/{r['num_requests']} | "
                     f"{r['request_throughput']:.2f} | {r['output_throughput']:.1f} | {trio(r['ttft_ms'])} | "
                     f"{trio(r['tpot_ms'])} | {trio(r['itl_ms'])} |")
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    conc = [r["concurrency"] for r in results]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    axes[0].plot(conc, [r["output_throughput"] for r in results], "o-")
    for c, r in zip(conc, results):
        axes[0].annotate(f"{r['request_throughput']:.2f} req/s", (c, r["output_throughput"]),
                         textcoords="offset points", xytext=(4, -12), fontsize=8)
    axes[0].set_ylabel("output tokens/s")
    axes[0].set_title("throughput")
    for ax, key, name in ((axes[1], "ttft_ms", "time to first token"), (axes[2], "tpot_ms", "time per output token")):
        for q, style in (("p50", "o-"), ("p90", "^--"), ("p99", "v:")):
            ax.plot(conc, [r[key][q] if r[key][q] is not None else float("nan") for r in results], style, label=q)
        ax.set_title(name)
        ax.set_ylabel("ms")
        ax.legend()
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(conc)
        ax.set_xticklabels([str(c) for c in conc])
        ax.set_xlabel("concurrency")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=os.path.dirname(os.path.abspath(__file__)))
        return out.stdout.strip() or None
    except Exception:
        return None


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    root = _root(args.base_url)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    levels = [int(x) for x in str(args.concurrency).split(",") if x.strip()]
    if not levels or min(levels) < 1:
        raise SystemExit("--concurrency: give positive integers, e.g. 1,4,16")
    limits = httpx.Limits(max_connections=max(levels) + 4, max_keepalive_connections=max(levels) + 4)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=args.timeout) as client:
        model = args.model
        if model is None:
            r = await client.get(f"{root}/v1/models")
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        url = f"{root}/v1/{'chat/completions' if args.endpoint == 'chat' else 'completions'}"
        for p in _prompts(args.warmup, args.input_len, args.seed + 10_000):
            w = await _one(client, url, _payload(args, model, p), args.timeout)
            if not w.ok:
                raise SystemExit(f"warm-up request failed: {w.error}")
        results = []
        for i, c in enumerate(levels):
            prompts = _prompts(args.num_requests, args.input_len, args.seed + i)
            res = await _level(client, args, model, url, c, prompts)
            results.append(res)
            print(f"concurrency {c}: {res['completed']}/{res['num_requests']} ok in {res['duration_s']:.1f}s, "
                  f"{res['output_throughput']:.1f} output tok/s", file=sys.stderr, flush=True)
            for err in res["errors"]:
                print(f"  error: {err}", file=sys.stderr)
    return {
        "benchmark": "serve",
        "label": args.label or root,
        "base_url": root,
        "model": model,
        "endpoint": args.endpoint,
        "input_len_words": args.input_len,
        "output_len": args.output_len,
        "ignore_eos": args.ignore_eos,
        "num_requests": args.num_requests,
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpus": os.cpu_count()},
        "commit": _commit(),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "results": results,
    }


def run(args: argparse.Namespace) -> int:
    report = asyncio.run(_main(args))
    print(f"\n{report['label']} · model {report['model']} · {report['endpoint']} · "
          f"~{args.input_len} words in, {args.output_len} tokens out · {args.num_requests} requests per level\n")
    print(markdown_table(report["results"]))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=2)
    if args.plot:
        plot(report["results"], args.plot, f"{report['model']} @ {report['label']}")
    failed = sum(r["failed"] for r in report["results"])
    return 1 if failed and failed == sum(r["num_requests"] for r in report["results"]) else 0


__all__ = ["add_arguments", "run", "markdown_table", "plot", "RequestResult"]
