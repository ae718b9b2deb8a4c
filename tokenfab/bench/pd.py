"""`tokenfab bench pd`: what prefill/decode disaggregation buys a decoding stream while long prompts flood in.

Two setups, one run, each instance pinned to its own core (``taskset``):

- disaggregated: a producer (``--kv-transfer-config`` kv_producer) on core A, a consumer (kv_consumer) on core B,
  ``vllm-router --vllm-pd-disaggregation`` in front (unpinned; it only forwards);
- unified: one ``tokenfab serve`` on core B.

In each, S streams decode ``--stream-tokens`` tokens (greedy, ignore_eos), ``--rounds`` times, first alone (idle),
then while F clients send long prompts (``--prompt-words``, ``max_tokens`` 1, each unique: no prefix hits) as fast
as they are answered (flood). Disaggregated, both go through the router: every flood prompt is prefilled on the
producer and handed to the consumer, which computes its last token (what a real PD fleet pays); unified, both go
to the one instance. Reported: the streams' inter-token latency (gaps between streamed chunks) p50/p99 idle and
under the flood, their ratio, and the flood prompts answered. JSON + Markdown under ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tokenfab.bench.common import git_commit, load_average, machine, markdown_table, percentile, write_json

WORDS = ("river stone lantern copper meadow harbor violet thunder orchard canyon ember glacier willow falcon "
         "marble compass saffron tundra beacon juniper").split()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="default: the bundled model")
    p.add_argument("--cores", default="0,1", help="prefill core, decode core (the unified instance: the second)")
    p.add_argument("--streams", type=int, default=2, help="concurrent decoding streams")
    p.add_argument("--stream-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3, help="times the streams run, per condition")
    p.add_argument("--flood-clients", type=int, default=2)
    p.add_argument("--prompt-words", type=int, default=300, help="words per flood prompt (~1.3 tokens each)")
    p.add_argument("--num-kv-blocks", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--out", default="benchmarks/results/pd_disagg", help="writes OUT.json and OUT.md")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_cmd(args: argparse.Namespace, core: str, port: int, kv: dict | None) -> list[str]:
    cmd = ["taskset", "-c", core, sys.executable, "-m", "tokenfab", "serve", *([args.model] if args.model else []),
           "--port", str(port), "--cpu-threads", "1", "--num-kv-blocks", str(args.num_kv_blocks),
           "--max-model-len", str(args.max_model_len), "--no-access-log", "--log-level", "warning"]
    if kv is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv)]
    return cmd


@contextlib.contextmanager
def _started(cmds: list[tuple[list[str], str]], logs: Path, name: str) -> Iterator[None]:
    """Processes (command, health URL), each in its own session with a log file; stopped at exit."""
    procs = []
    try:
        for i, (cmd, _) in enumerate(cmds):
            out = open(logs / f"{name}{i}.log", "w")  # noqa: SIM115 (the process owns it)
            procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
        for proc, (cmd, url) in zip(procs, cmds):
            _wait(url, proc, cmd[0])
        yield
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _wait(url: str, proc: subprocess.Popen, what: str, timeout: float = 600) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not come up within {timeout:.0f} s ({url})")
        time.sleep(0.3)


async def _stream(client: Any, base: str, prompt: str, tokens: int) -> list[float]:
    """One streamed completion: the gaps (s) between its chunks after the first."""
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    times = []
    async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                if json.loads(line[6:]).get("choices"):
                    times.append(time.perf_counter())
    return [b - a for a, b in zip(times, times[1:])]


async def _flood(client: Any, base: str, words: int, stop: asyncio.Event, tag: str, done: list[int]) -> None:
    i = 0
    while not stop.is_set():
        prompt = f"{tag} {i}: " + " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(words))
        i += 1
        with contextlib.suppress(Exception):
            r = await client.post(f"{base}/v1/completions", json={"prompt": prompt, "max_tokens": 1,
                                                                  "temperature": 0})
            if r.status_code == 200:
                done[0] += 1


async def _condition(args: argparse.Namespace, stream_base: str, flood_base: str | None, tag: str) -> dict:
    import httpx

    stop, done, gaps = asyncio.Event(), [0], []
    async with httpx.AsyncClient(timeout=600) as client:
        flood = [asyncio.create_task(_flood(client, flood_base, args.prompt_words, stop, f"{tag}-{k}", done))
                 for k in range(args.flood_clients)] if flood_base else []
        if flood:
            await asyncio.sleep(3.0)  # the flood under way before the streams start
        t0 = time.perf_counter()
        for r in range(args.rounds):
            results = await asyncio.gather(*[_stream(client, stream_base, f"Stream {s} round {r}: tell a story.",
                                                     args.stream_tokens) for s in range(args.streams)])
            gaps += [g for res in results for g in res]
        elapsed = time.perf_counter() - t0
        stop.set()
        for task in flood:
            task.cancel()
        await asyncio.gather(*flood, return_exceptions=True)
    ms = [g * 1000 for g in gaps]
    return {"itl_p50_ms": percentile(ms, 50), "itl_p99_ms": percentile(ms, 99), "itl_mean_ms": sum(ms) / len(ms),
            "gaps": len(ms), "seconds": elapsed, "flood_prompts_answered": done[0]}


def _kv(role: str) -> dict:
    return {"kv_connector": "NixlConnector", "kv_role": role, "kv_ip": "127.0.0.1", "kv_port": _free_port(),
            "kv_buffer_size": 256 << 20, "kv_connector_extra_config": {"pin_timeout_s": 30}}


def _router_cmd(prefill: str, decode: str, port: int) -> list[str]:
    binary = Path(sys.executable).parent / "vllm-router"
    binary = str(binary) if binary.exists() else shutil.which("vllm-router")
    if binary is None:
        raise RuntimeError("vllm-router is not installed (pip install vllm-router)")
    return [binary, "--vllm-pd-disaggregation", "--prefill", prefill, "--decode", decode, "--kv-connector", "nixl",
            "--policy", "round_robin", "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-port", str(_free_port())]


def run(args: argparse.Namespace) -> int:
    prefill_core, decode_core = args.cores.split(",")
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="tokenfab-bench-pd-") as tmp:
        logs = Path(tmp)
        pp, cp, rp = _free_port(), _free_port(), _free_port()
        p_url, c_url, r_url = (f"http://127.0.0.1:{p}" for p in (pp, cp, rp))
        print(f"disaggregated: producer on core {prefill_core}, consumer on core {decode_core}", flush=True)
        with _started([(_serve_cmd(args, prefill_core, pp, _kv("kv_producer")), f"{p_url}/health"),
                       (_serve_cmd(args, decode_core, cp, _kv("kv_consumer")), f"{c_url}/health")], logs, "pd"), \
                _started([(_router_cmd(p_url, c_url, rp), f"{r_url}/health")], logs, "router"):
            asyncio.run(_condition(args, r_url, None, "warmup"))
            results["pd_idle"] = asyncio.run(_condition(args, r_url, None, "pd-idle"))
            results["pd_flood"] = asyncio.run(_condition(args, r_url, r_url, "pd-flood"))
        up = _free_port()
        u_url = f"http://127.0.0.1:{up}"
        print(f"unified: one instance on core {decode_core}", flush=True)
        with _started([(_serve_cmd(args, decode_core, up, None), f"{u_url}/health")], logs, "unified"):
            asyncio.run(_condition(args, u_url, None, "warmup"))
            results["unified_idle"] = asyncio.run(_condition(args, u_url, None, "u-idle"))
            results["unified_flood"] = asyncio.run(_condition(args, u_url, u_url, "u-flood"))
    report = {
        "benchmark": "pd_disagg", "commit": git_commit(), "machine": machine(), "load_average_after": load_average(),
        "model": args.model or "bundled SmolLM2-135M-Instruct (GGUF, float32)",
        "workload": {k: getattr(args, k) for k in ("cores", "streams", "stream_tokens", "rounds", "flood_clients",
                                                   "prompt_words", "num_kv_blocks")},
        "results": results,
        "ratios": {"pd_flood_over_idle_p99": results["pd_flood"]["itl_p99_ms"] / results["pd_idle"]["itl_p99_ms"],
                   "unified_flood_over_idle_p99":
                       results["unified_flood"]["itl_p99_ms"] / results["unified_idle"]["itl_p99_ms"]},
    }
    write_json(f"{args.out}.json", report)
    Path(f"{args.out}.md").write_text(_markdown(report))
    print(_markdown(report))
    return 0


def _markdown(report: dict) -> str:
    rows = [[name, r["itl_p50_ms"], r["itl_p99_ms"], r["gaps"], r["flood_prompts_answered"], r["seconds"]]
            for name, r in report["results"].items()]
    ratios = report["ratios"]
    w = report["workload"]
    return "\n".join([
        "# Prefill/decode disaggregation: decode inter-token latency under a long-prompt flood", "",
        f"Commit {report['commit']}, {report['model']}; load average after the run {report['load_average_after']} "
        "(a shared machine: other agents' work runs beside this, so the figures are noisy).", "",
        f"Workload: {w['streams']} streams x {w['stream_tokens']} tokens x {w['rounds']} rounds per condition; flood: "
        f"{w['flood_clients']} clients sending {w['prompt_words']}-word prompts (max_tokens 1); cores {w['cores']} "
        "(prefill, decode; the unified instance on the decode core); one CPU thread per instance.", "",
        markdown_table(["condition", "ITL p50 ms", "ITL p99 ms", "gaps", "flood prompts answered", "seconds"], rows),
        "", f"p99 under flood / idle: disaggregated {ratios['pd_flood_over_idle_p99']:.2f}x, unified "
        f"{ratios['unified_flood_over_idle_p99']:.2f}x.", "",
        "Re-run: `tokenfab bench pd` (see docs/fleet.md).", ""])


if __name__ == "__main__":
    from tokenfab.bench.common import script_main

    raise SystemExit(script_main(__doc__, add_arguments, run))
