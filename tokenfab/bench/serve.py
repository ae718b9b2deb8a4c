"""`tokenfab bench serve`: a load generator for OpenAI-compatible servers, with an optional peer.

For each concurrency level it keeps that many requests in flight until ``--num-requests`` have
finished, and reports request throughput, output tokens/s, end-to-end latency and, for streamed
requests, time to first token (TTFT), time per output token (TPOT: (last - first token time) /
(tokens - 1)) and inter-token latency (ITL, per token: see ``serve_client``) at p50/p90/p99, as a
Markdown table, JSON (``--json``) and a PNG (``--plot``).

A peer in the same run (``--llama-cpp`` starts llama-cpp-python's server on the same GGUF with
``scripts/llama_cpp_server.sh``, ``--llama-server`` llama.cpp's native `llama-server` with parallel
slots and continuous batching, streamed at every level; ``--peer-base-url`` names any other) gets
the same prompts, output lengths, warm-up and levels, interleaved with ours level by level. Where
the peer cannot stream at a level (llama-cpp-python's server above concurrency 1), it gets
non-streamed requests, and so does our server in an extra row at that level, so that every peer
row has a like-for-like row of ours.
The command exits with 1 when any request failed.

    tokenfab bench serve --base-url http://127.0.0.1:8000 --concurrency 1,4,16 --num-requests 32 --llama-cpp
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from tokenfab.bench import llama_cpp_peer, llama_server_peer
from tokenfab.bench.common import git_commit, git_dirty, load_average, machine
from tokenfab.bench.serve_client import RequestResult, one_plain, one_streamed

_WORDS = (
    "the a model token server batch cache kernel stream request latency memory block prefix decode prefill "
    "river mountain city ocean forest garden window morning evening story music paper science history "
    "quickly slowly carefully brightly quietly always never often sometimes because while after before "
    "red blue green small large ancient modern simple complex gentle strong bright dark warm cold"
).split()


@dataclass
class Target:
    """A server under test: where it is, what it is called, how it is asked."""

    label: str
    root: str
    model: str | None = None
    stream_up_to: int | None = None  # stream at concurrency <= this (None: always)
    adapt: Any = None  # payload -> payload, for servers that name things differently
    settings: dict[str, Any] = field(default_factory=dict)

    def streams_at(self, concurrency: int) -> bool:
        return self.stream_up_to is None or concurrency <= self.stream_up_to


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
    parser.add_argument("--warmup", type=int, default=1, help="warm-up requests before measuring (each server)")
    parser.add_argument("--continuous-usage", action="store_true",
                        help="ask for running usage in every chunk (vLLM's stream_options.continuous_usage_stats) "
                             "to count each chunk's tokens exactly")
    parser.add_argument("--json", dest="json_out", default=None, help="write results as JSON here")
    parser.add_argument("--plot", default=None, help="write a PNG plot here")
    parser.add_argument("--markdown", default=None, help="write the table and the servers' settings here")
    parser.add_argument("--label", default=None, help="name of the server in the report")
    parser.add_argument("--settings", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting of the server under test to print in the report (repeatable), "
                             "e.g. dtype=float32 threads=2")
    peer = parser.add_argument_group("peer (measured in the same run, interleaved level by level)")
    started = peer.add_mutually_exclusive_group()
    started.add_argument("--llama-cpp", action="store_true", help="start llama-cpp-python's server on the bundled "
                         "GGUF (scripts/llama_cpp_server.sh serve) as the peer")
    started.add_argument("--llama-server", action="store_true", help="start llama.cpp's native llama-server "
                         "(-np N -cb, scripts/llama_cpp_server.sh serve-native) as the peer; not with --peer-base-url")
    peer.add_argument("--llama-server-parallel", type=int, default=None, metavar="N",
                      help="llama-server's slots (default $LLAMA_CPP_PARALLEL or 16)")
    peer.add_argument("--peer-base-url", default=None, help="an already running peer (with --llama-cpp: "
                      "a llama_cpp.server started by hand)")
    peer.add_argument("--peer-label", default=None)
    peer.add_argument("--peer-model", default=None, help="the peer's model name (default: its first)")
    peer.add_argument("--peer-stream-up-to", type=int, default=None,
                      help="stream to the peer only up to this concurrency, non-streamed above "
                           "(default: always stream; 1 with --llama-cpp)")


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


def _payload(args: argparse.Namespace, model: str, prompt: str, stream: bool) -> dict[str, Any]:
    p: dict[str, Any] = {"model": model, "max_tokens": args.output_len, "stream": stream, "temperature": 0.0}
    if stream:
        p["stream_options"] = {"include_usage": True}
        if args.continuous_usage:  # vLLM's running usage: exact token counts per chunk
            p["stream_options"]["continuous_usage_stats"] = True
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


async def _request(client: Any, args: argparse.Namespace, target: Target, prompt: str, stream: bool) -> RequestResult:
    payload = _payload(args, target.model or "", prompt, stream)
    if target.adapt is not None:
        payload = target.adapt(payload)
    url = f"{target.root}/v1/{'chat/completions' if args.endpoint == 'chat' else 'completions'}"
    if stream:
        return await one_streamed(client, url, payload, args.timeout)
    return await one_plain(client, url, payload, args.timeout)


def summarize_level(results: list[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    return {
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "mean_input_tokens": in_tokens / len(ok) if ok else 0.0,
        "mean_output_tokens": out_tokens / len(ok) if ok else 0.0,
        "token_counts": sorted({r.token_counts for r in ok if r.token_counts}),
        "ttft_ms": _pct([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": _pct([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": _pct([x for r in ok for x in r.itls]),
        "e2e_ms": _pct([r.e2e for r in ok]),
    }


async def _level(client: Any, args: argparse.Namespace, target: Target, concurrency: int, prompts: list[str],
                 stream: bool) -> dict[str, Any]:
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
            results.append(await _request(client, args, target, prompt, stream))

    load0, t0 = load_average(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    row = {"server": target.label, "concurrency": concurrency, "stream": stream,
           **summarize_level(results, time.perf_counter() - t0), "load_1m": [load0, load_average()]}
    print(f"{target.label} concurrency {concurrency} ({'streamed' if stream else 'not streamed'}): "
          f"{row['completed']}/{row['num_requests']} ok in {row['duration_s']:.1f}s, "
          f"{row['output_throughput']:.1f} output tok/s", file=sys.stderr, flush=True)
    for err in row["errors"]:
        print(f"  error: {err}", file=sys.stderr)
    return row


def _fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def markdown_table(results: list[dict[str, Any]]) -> str:
    head = ("| server | concurrency | streamed | ok/total | req/s | output tok/s | E2E p50 / p99 (ms) "
            "| TTFT p50 / p90 / p99 (ms) | TPOT p50 / p90 / p99 (ms) | ITL p50 / p90 / p99 (ms) |")
    lines = [head, "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]

    def trio(d: dict[str, float | None]) -> str:
        return "-" if d["p50"] is None else f"{_fmt(d['p50'])} / {_fmt(d['p90'])} / {_fmt(d['p99'])}"

    for r in results:
        e2e = r["e2e_ms"]
        lines.append(f"| {r.get('server', '')} | {r['concurrency']} | {'yes' if r.get('stream', True) else 'no'} | "
                     f"{r['completed']}/{r['num_requests']} | {r['request_throughput']:.2f} | "
                     f"{r['output_throughput']:.1f} | {_fmt(e2e['p50'], 0)} / {_fmt(e2e['p99'], 0)} | "
                     f"{trio(r['ttft_ms'])} | {trio(r['tpot_ms'])} | {trio(r['itl_ms'])} |")
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[tuple[str, bool], list[dict[str, Any]]] = {}
    for r in results:
        series.setdefault((r.get("server", ""), r.get("stream", True)), []).append(r)
    fig, axes = plt.subplots(1, 4, figsize=(19, 4.4))
    panels = ((axes[0], lambda r: r["output_throughput"], "output tokens/s", "throughput"),
              (axes[1], lambda r: r["e2e_ms"]["p50"], "ms", "end-to-end latency p50"),
              (axes[2], lambda r: r["ttft_ms"]["p50"], "ms", "time to first token p50 (streamed)"),
              (axes[3], lambda r: r["itl_ms"]["p50"], "ms", "inter-token latency p50, per token (streamed)"))
    for ax, get, unit, name in panels:
        for (server, stream), rows in series.items():
            xs = [r["concurrency"] for r in rows]
            ys = [v if (v := get(r)) is not None else float("nan") for r in rows]
            if all(y != y for y in ys):  # nothing to draw (not streamed)
                continue
            ax.plot(xs, ys, "o-" if stream else "s--", label=f"{server} ({'streamed' if stream else 'not streamed'})")
        ax.set_title(name, fontsize=10)
        ax.set_ylabel(unit)
        levels = sorted({r["concurrency"] for r in results})
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels)
        ax.set_xticklabels([str(c) for c in levels])
        ax.set_xlabel("concurrency")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _settings(pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--settings: give KEY=VALUE, got {pair!r}")
        out[key.strip()] = value.strip()
    return out


async def _resolve_model(client: Any, target: Target) -> None:
    if target.model is None:
        r = await client.get(f"{target.root}/v1/models")
        r.raise_for_status()
        target.model = r.json()["data"][0]["id"]


async def _main(args: argparse.Namespace, targets: list[Target], transport: Any = None) -> list[dict[str, Any]]:
    import httpx

    levels = [int(x) for x in str(args.concurrency).split(",") if x.strip()]
    if not levels or min(levels) < 1:
        raise SystemExit("--concurrency: give positive integers, e.g. 1,4,16")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=max(levels) + 4, max_keepalive_connections=max(levels) + 4)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=args.timeout, transport=transport) as client:
        for t in targets:
            await _resolve_model(client, t)
            for p in _prompts(args.warmup, args.input_len, args.seed + 10_000):
                w = await _request(client, args, t, p, t.streams_at(1))
                if not w.ok:
                    raise SystemExit(f"{t.label}: warm-up request failed: {w.error}")
        ours, peers = targets[0], targets[1:]
        results = []
        for i, c in enumerate(levels):
            prompts = _prompts(args.num_requests, args.input_len, args.seed + i)
            results.append(await _level(client, args, ours, c, prompts, True))
            for peer in peers:
                stream = peer.streams_at(c)
                results.append(await _level(client, args, peer, c, prompts, stream))
                if not stream and not any(r["server"] == ours.label and r["concurrency"] == c and not r["stream"]
                                          for r in results):
                    results.append(await _level(client, args, ours, c, prompts, False))  # like for like
    return results


def run(args: argparse.Namespace, transport: Any = None) -> int:
    if args.llama_server:
        problem = ("--llama-server: not allowed with --peer-base-url (it starts its own llama-server)"
                   if args.peer_base_url else llama_server_peer.missing_binary_message())
        if problem:
            print(problem, file=sys.stderr)
            return 2
    ours = Target(args.label or "tokenfab", _root(args.base_url), args.model, settings=_settings(args.settings))
    targets = [ours]
    launched = None
    commit, dirty = git_commit(), git_dirty()  # at the start (HEAD may move during a long run)
    try:
        if args.llama_server:
            launched = llama_server_peer.LlamaServer(args.llama_server_parallel)
            targets.append(Target(args.peer_label or "llama-server", launched.url, args.peer_model,
                                  args.peer_stream_up_to, llama_server_peer.server_payload,
                                  llama_server_peer.settings(launched.parallel, launched.url)))
        elif args.llama_cpp:
            url = args.peer_base_url
            if url is None:
                launched = llama_cpp_peer.LlamaCppServer()
                url = launched.url
            stream_up_to = 1 if args.peer_stream_up_to is None else args.peer_stream_up_to
            targets.append(Target(args.peer_label or "llama.cpp", _root(url), args.peer_model, stream_up_to,
                                  llama_cpp_peer.peer_payload, llama_cpp_peer.settings()))
        elif args.peer_base_url:
            targets.append(Target(args.peer_label or _root(args.peer_base_url), _root(args.peer_base_url),
                                  args.peer_model, args.peer_stream_up_to))
        results = asyncio.run(_main(args, targets, transport))
    finally:
        if launched is not None:
            launched.stop()
    report = {
        "benchmark": "serve",
        "label": ours.label,
        "base_url": ours.root,
        "model": ours.model,
        "servers": [{"label": t.label, "base_url": t.root, "model": t.model, "settings": t.settings,
                     "streamed_up_to_concurrency": t.stream_up_to} for t in targets],
        "endpoint": args.endpoint,
        "input_len_words": args.input_len,
        "output_len": args.output_len,
        "ignore_eos": args.ignore_eos,
        "num_requests": args.num_requests,
        "warmup_requests": args.warmup,
        "itl": "per token: a chunk of k tokens after a gap dt gives k intervals of dt/k (bench/serve_client.py)",
        "machine": {**machine(), "processor": platform.processor() or platform.machine()},
        "commit": commit,
        "uncommitted_changes": dirty,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "results": results,
    }
    names = " vs ".join(f"{t.label} ({t.model})" for t in targets)
    text = [f"{names} · {args.endpoint} · ~{args.input_len} words in, {args.output_len} tokens out · "
            f"{args.num_requests} requests per level · {args.warmup} warm-up request(s) each · commit "
            f"{report['commit']} · {report['machine'].get('cpu') or report['machine']['processor']}, "
            f"{report['machine']['cpus']} CPUs" + (f" · env {report['machine']['env']}" if report['machine'].get('env')
                                                   else ""), "",
            markdown_table(results), "", "ITL is per token (a chunk of k tokens after a gap dt counts k intervals "
            "of dt/k); TTFT/TPOT/ITL exist only for streamed rows.", "", "Servers:", ""]
    text += [f"- {t.label} at {t.root} (model {t.model}" + (f"; streamed up to concurrency {t.stream_up_to}, "
             "non-streamed above" if t.stream_up_to is not None else "") + "): "
             + (json.dumps(t.settings) if t.settings else "no settings given") for t in targets]
    print("\n" + "\n".join(text))
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("\n".join(text) + "\n")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=2)
    if args.plot:
        plot(results, args.plot, f"{names} · ~{args.input_len} words in, {args.output_len} tokens out")
    failed = sum(r["failed"] for r in results)
    if failed:
        print(f"\n{failed} request(s) failed", file=sys.stderr)
    return 1 if failed else 0


__all__ = ["add_arguments", "run", "markdown_table", "plot", "RequestResult", "summarize_level"]
