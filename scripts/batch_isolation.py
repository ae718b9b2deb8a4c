"""Online TTFT with and without a /v1/batches batch running on the same server (issue 27's isolation figure).

Starts `tokenfab serve` (extra flags after `--`), measures the time to the first streamed token of online chat
requests sent at a fixed concurrency, alone; then uploads a batch of --batch-lines lines, creates it, and measures
the same online load while the batch runs; reports p50/p99 TTFT of both phases, their ratio, and the batch's
progress (and, with --wait, whether it finishes). Prints a table and writes JSON.

    python scripts/batch_isolation.py --batch-lines 2000 --out /tmp/iso.json -- --scheduling-policy priority
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai

PROMPT = "Write one sentence about the sea."


def start_server(data_dir: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "tokenfab", "serve", "--port", "0", "--no-access-log", "--data-dir", data_dir,
           *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    url = None
    deadline = time.monotonic() + 300
    assert proc.stdout is not None
    while url is None:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError("server exited:\n" + "".join(lines))
        lines.append(line)
        m = re.search(r"serving .* at (http://\S+)/v1", line)
        url = m.group(1) if m else None
        if time.monotonic() > deadline:
            raise RuntimeError("server did not start")
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # keep the pipe drained
    return proc, url


def ttft(http: httpx.Client, model: str, max_tokens: int) -> float:
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True}
    t0 = time.perf_counter()
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        lines = r.iter_lines()
        for line in lines:
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[len("data: "):]).get("choices") or [{}]
            if choices[0].get("delta", {}).get("content"):
                first = time.perf_counter() - t0
                for _ in lines:  # read the rest: the request ends before the next one starts
                    pass
                return first
    raise RuntimeError("no token streamed")


def online_phase(url: str, model: str, n: int, concurrency: int, max_tokens: int) -> list[float]:
    with httpx.Client(base_url=url, timeout=600) as http, ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda _: ttft(http, model, max_tokens), range(n)))


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--online-requests", type=int, default=60)
    p.add_argument("--online-concurrency", type=int, default=2)
    p.add_argument("--online-max-tokens", type=int, default=16)
    p.add_argument("--batch-lines", type=int, default=2000)
    p.add_argument("--batch-max-tokens", type=int, default=16)
    p.add_argument("--wait", action="store_true", help="wait for the batch to finish and report its duration")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("serve_args", nargs="*", help="flags for tokenfab serve (after --)")
    args = p.parse_args()
    data_dir = tempfile.mkdtemp(prefix="tokenfab-iso-")
    proc, url = start_server(data_dir, args.serve_args)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=os.environ.get("TOKENFAB_API_KEY", "unused"))
        model = client.models.list().data[0].id
        online_phase(url, model, 4, args.online_concurrency, args.online_max_tokens)  # warm-up
        alone = online_phase(url, model, args.online_requests, args.online_concurrency, args.online_max_tokens)
        lines = "".join(json.dumps({"custom_id": f"b{i}", "method": "POST", "url": "/v1/chat/completions", "body": {
            "model": model, "messages": [{"role": "user", "content": f"Tell me fact number {i} about rivers."}],
            "max_tokens": args.batch_max_tokens, "temperature": 0.0}}) + "\n" for i in range(args.batch_lines))
        f = client.files.create(file=("batch.jsonl", io.BytesIO(lines.encode())), purpose="batch")
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        t_batch = time.perf_counter()
        while client.batches.retrieve(batch.id).request_counts.completed < 1:
            time.sleep(0.05)
        with_batch = online_phase(url, model, args.online_requests, args.online_concurrency, args.online_max_tokens)
        progress = client.batches.retrieve(batch.id)
        finished_s = None
        if args.wait:
            while (progress := client.batches.retrieve(batch.id)).status not in ("completed", "failed", "cancelled"):
                time.sleep(1)
            finished_s = time.perf_counter() - t_batch
        result = {
            "serve_args": args.serve_args, "online_requests": args.online_requests,
            "online_concurrency": args.online_concurrency, "online_max_tokens": args.online_max_tokens,
            "batch_lines": args.batch_lines, "batch_max_tokens": args.batch_max_tokens,
            "alone": {"p50": pct(alone, 0.5), "p99": pct(alone, 0.99), "mean": statistics.mean(alone)},
            "with_batch": {"p50": pct(with_batch, 0.5), "p99": pct(with_batch, 0.99),
                           "mean": statistics.mean(with_batch)},
            "batch_status": progress.status, "batch_completed": progress.request_counts.completed,
            "batch_finished_s": finished_s,
        }
        result["p99_ratio"] = result["with_batch"]["p99"] / result["alone"]["p99"]
        print(f"{'phase':<12}{'p50 TTFT s':>12}{'p99 TTFT s':>12}")
        for name in ("alone", "with_batch"):
            print(f"{name:<12}{result[name]['p50']:>12.3f}{result[name]['p99']:>12.3f}")
        print(f"p99 ratio {result['p99_ratio']:.2f}x; batch {progress.status}, {progress.request_counts.completed}"
              f"/{args.batch_lines} lines" + (f", finished in {finished_s:.0f}s" if finished_s else ""))
        if args.out:
            with open(args.out, "w") as out:
                json.dump(result, out, indent=2)
        return 0
    finally:
        proc.terminate()
        proc.wait(60)


if __name__ == "__main__":
    sys.exit(main())
