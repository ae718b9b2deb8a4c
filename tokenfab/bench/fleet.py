"""`tokenfab bench fleet`: N `tokenfab serve` replicas behind the real routers (`vllm-router`, `sglang-router`),
one multi-turn workload per router and policy, in one run: the fleet's prefix-cache hit rate (from the workers'
``vllm:prefix_cache_hits_total`` / ``vllm:prefix_cache_queries_total``) and the time to first token seen by the
client (streamed, through the router).

The workload: C conversations, each with its own long system prompt, T turns each, the turns interleaved across
conversations (conversation 1 turn 1, conversation 2 turn 1, ...), each turn carrying the conversation so far. Every
router/policy pair gets fresh system prompts (a run tag in the text), so no pair profits from the caches an earlier
pair left behind. The replicas start once and serve every pair.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from tokenfab.bench.common import git_commit, load_average, machine, markdown_table, write_json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="the replicas' model (default: the bundled one)")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--routers", nargs="+", default=["vllm-router", "sglang-router"])
    p.add_argument("--policies", nargs="+", default=["round_robin", "cache_aware"])
    p.add_argument("--conversations", type=int, default=5,
                   help="not a multiple of --replicas, or round_robin would keep each conversation on one replica")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--system-words", type=int, default=120, help="words in each conversation's system prompt")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens generated per turn")
    p.add_argument("--num-kv-blocks", type=int, default=128, help="KV blocks per replica (16 tokens each)")
    p.add_argument("--cpu-threads", type=int, default=1, help="threads per replica")
    p.add_argument("--json", default=None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(url: str, proc: subprocess.Popen, what: str, timeout: float, ok=lambda r: r.status_code == 200) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
            if ok(httpx.get(url, timeout=2)):
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not come up within {timeout:.0f} s")
        time.sleep(0.3)


@contextlib.contextmanager
def _processes(cmds: list[list[str]], env: dict[str, str] | None = None) -> Iterator[list[subprocess.Popen]]:
    procs = [subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env) for c in cmds]
    try:
        yield procs
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()


def _router_cmd(name: str, policy: str, port: int, urls: list[str]) -> list[str]:
    binary = Path(sys.executable).parent / name
    exe = str(binary) if binary.exists() else shutil.which(name)
    if exe is None:
        raise RuntimeError(f"{name} is not installed (pip install {name})")
    return [exe, *(["launch"] if name == "sglang-router" else []), "--host", "127.0.0.1", "--port", str(port),
            "--policy", policy, "--worker-urls", *urls]


def _prefix_counters(urls: list[str]) -> tuple[float, float]:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    hits = queries = 0.0
    for url in urls:
        for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
            for s in family.samples:
                if s.name == "vllm:prefix_cache_hits_total":
                    hits += s.value
                elif s.name == "vllm:prefix_cache_queries_total":
                    queries += s.value
    return hits, queries


def _workload(base: str, model: str, args: argparse.Namespace, tag: str) -> list[float]:
    """The conversations through the router; the TTFT of every turn (seconds)."""
    import openai

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)
    filler = " ".join(f"rule{i % 37}" for i in range(args.system_words))
    convs = [[{"role": "system", "content": f"[{tag}] You are assistant {k}. {filler}"}]
             for k in range(args.conversations)]
    ttfts = []
    for turn in range(args.turns):
        for k, conv in enumerate(convs):
            conv.append({"role": "user", "content": f"Question {turn} of conversation {k}?"})
            t0 = time.perf_counter()
            first, text = None, []
            for chunk in client.chat.completions.create(model=model, messages=conv, max_tokens=args.max_tokens,
                                                        temperature=0, stream=True):
                if chunk.choices and chunk.choices[0].delta.content:
                    first = first or time.perf_counter()
                    text.append(chunk.choices[0].delta.content)
            ttfts.append((first or time.perf_counter()) - t0)
            conv.append({"role": "assistant", "content": "".join(text)})
    return ttfts


def run(args: argparse.Namespace) -> int:
    import httpx

    ports = [_free_port() for _ in range(args.replicas)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    serve = [sys.executable, "-m", "tokenfab", "serve", *([args.model] if args.model else []),
             "--num-kv-blocks", str(args.num_kv_blocks), "--cpu-threads", str(args.cpu_threads), "--no-access-log"]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.cpu_threads)}
    report = {"benchmark": "fleet", "machine": machine(), "commit": git_commit(), "model": args.model or "bundled",
              "workload": {k: getattr(args, k) for k in ("replicas", "conversations", "turns", "system_words",
                                                         "max_tokens", "num_kv_blocks")}, "runs": []}
    rows = []
    with _processes([[*serve, "--port", str(p)] for p in ports], env) as procs:
        for url, proc in zip(urls, procs):
            _wait(f"{url}/health", proc, "tokenfab serve", 900)
        model = httpx.get(f"{urls[0]}/v1/models").json()["data"][0]["id"]
        for name in args.routers:
            for policy in args.policies:
                port = _free_port()
                with _processes([_router_cmd(name, policy, port, urls)]) as (router,):
                    base = f"http://127.0.0.1:{port}"
                    _wait(f"{base}/workers", router, name, 60,
                          ok=lambda r: all(w["is_healthy"] for w in r.json()["workers"]))
                    h0, q0 = _prefix_counters(urls)
                    ttfts = _workload(base, model, args, tag=f"{name}/{policy}/{time.time_ns()}")
                    h1, q1 = _prefix_counters(urls)
                hit_rate = (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0
                mean_ttft = sum(ttfts) / len(ttfts)
                report["runs"].append({"router": name, "policy": policy, "prefix_hit_rate": hit_rate,
                                       "prefix_hit_tokens": h1 - h0, "prefix_query_tokens": q1 - q0,
                                       "mean_ttft_s": mean_ttft, "requests": len(ttfts)})
                rows.append([name, policy, f"{hit_rate:.1%}", f"{mean_ttft * 1000:.0f}", len(ttfts)])
                print(f"{name} {policy}: hit rate {hit_rate:.1%}, mean TTFT {mean_ttft * 1000:.0f} ms", flush=True)
    report["load_average_after"] = load_average()
    print(markdown_table(["router", "policy", "prefix hit rate", "mean TTFT (ms)", "requests"], rows))
    write_json(args.json, report)
    return 0
