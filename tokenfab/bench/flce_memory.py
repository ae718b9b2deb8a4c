"""Peak memory of the LM head's loss step with and without fused linear cross-entropy.

One forward + backward of ``loss(hidden [T, H] @ W[V, H]^T, labels)`` per method, each in a fresh
subprocess: "hf" is what a Hugging Face causal LM does (``lm_head`` -> full ``[T, V]`` logits ->
``.float()`` -> ``F.cross_entropy``, autograd), "flce" is ``kernels.loss.fused_linear_cross_entropy``
(chunked; default chunk size). Both with a trainable head (full fine-tuning: the weight gradient
``[V, H]`` is part of both peaks) and a frozen head (LoRA). Defaults: the bundled model's vocabulary
(49152) and hidden size (576), 2048 tokens, fp32.

Memory: on CPU the process's peak resident set above its level just before the step (Linux: the
VmHWM high-water mark is reset through /proc/self/clear_refs, so imports and setup do not count;
tracemalloc cannot see torch's allocations); on CUDA ``torch.cuda.max_memory_allocated`` above
the allocated bytes before the step.

    tokenfab bench flce-memory [--tokens 2048 --vocab 49152 --hidden 576] \
        [--json benchmarks/results/cpu_flce_memory.json --markdown benchmarks/results/cpu_flce_memory.md]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tokenfab.bench.common import git_commit, git_dirty, load_average, machine, script_main

METHODS = ("hf", "flce")


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        m = re.search(rf"{field}:\s+(\d+) kB", fh.read())
    if m is None:
        raise RuntimeError(f"/proc/self/status has no {field}")
    return int(m.group(1))


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # reset VmHWM to the current resident set (Linux >= 4.0)


def _step(method: str, hid, w, labels, chunk_size: int | None):
    import torch.nn.functional as F

    from tokenfab.kernels.loss import fused_linear_cross_entropy

    if method == "hf":
        logits = F.linear(hid, w).float()
        loss = F.cross_entropy(logits, labels)
    else:
        loss = fused_linear_cross_entropy(hid, w, labels, chunk_size=chunk_size)
    loss.backward()
    return loss.item()


def worker(method: str, tokens: int, hidden: int, vocab: int, dtype: str, device: str, frozen: bool,
           chunk_size: int | None) -> dict[str, Any]:
    """One measurement in this (fresh) process."""
    import gc

    import torch

    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    hid = torch.randn(tokens, hidden, generator=g).to(device, dt).requires_grad_()
    w = (0.02 * torch.randn(vocab, hidden, generator=g)).to(device, dt).requires_grad_(not frozen)
    labels = torch.randint(0, vocab, (tokens,), generator=g).to(device)
    labels[::7] = -100
    # warm-up on 8 tokens (library initialisation, kernel compiles), then measure one step
    _step(method, hid[:8].detach().requires_grad_(), w, labels[:8], chunk_size)
    w.grad = None
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        _reset_peak_rss()
        before = _rss_kib("VmRSS") * 1024
    t0 = time.perf_counter()
    loss = _step(method, hid, w, labels, chunk_size)
    if device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        peak = _rss_kib("VmHWM") * 1024 - before
    return dict(method=method, frozen_head=frozen, peak_mib=round(peak / 2**20, 1),
                seconds=round(time.perf_counter() - t0, 3), loss=loss)


def measure(tokens: int, hidden: int, vocab: int, dtype: str, device: str, chunk_size: int | None) -> list[dict]:
    rows = []
    for frozen in (False, True):
        for method in METHODS:
            cmd = [sys.executable, "-m", "tokenfab.bench.flce_memory", "--worker", method, "--tokens", str(tokens),
                   "--hidden", str(hidden), "--vocab", str(vocab), "--dtype", dtype, "--device", device]
            if frozen:
                cmd.append("--frozen-head")
            if chunk_size:
                cmd += ["--chunk-size", str(chunk_size)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=dict(os.environ))
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return rows


def markdown(report: dict) -> str:
    w = report["workload"]
    lines = [
        f"# Fused linear cross-entropy: peak memory ({w['device']}, {w['dtype']})",
        "",
        f"One loss forward + backward, {w['tokens']} tokens, hidden {w['hidden']}, vocabulary {w['vocab']} "
        f"(full logits: {w['full_logits_mib']} MiB in fp32), every 7th label ignored; commit {report['commit']}"
        f"{' (dirty checkout)' if report['dirty'] else ''}, {report['machine'].get('cpu', '')}, "
        f"load average {report['load_average']}. Peak: {report['memory_measure']}.",
        "",
        "| head | method | peak (MiB) | time (s) | loss |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in report["rows"]:
        head = "frozen (LoRA)" if r["frozen_head"] else "trainable"
        lines.append(f"| {head} | {r['method']} | {r['peak_mib']} | {r['seconds']} | {r['loss']:.6f} |")
    lines.append("")
    for head, s in report["saving"].items():
        lines.append(f"- {head} head: FLCE peak {s['flce_mib']} MiB vs {s['hf_mib']} MiB, "
                     f"{s['saving_pct']}% less ({s['ratio']}x).")
    return "\n".join(lines) + "\n"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (CUDA default)")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    ap.add_argument("--chunk-size", type=int, default=None, help="FLCE rows per chunk (default: its rule)")
    ap.add_argument("--json", help="write the report here")
    ap.add_argument("--markdown", help="write the Markdown table here")
    ap.add_argument("--worker", choices=METHODS, help=argparse.SUPPRESS)
    ap.add_argument("--frozen-head", action="store_true", help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.worker:
        print(json.dumps(worker(args.worker, args.tokens, args.hidden, args.vocab, args.dtype, args.device,
                                args.frozen_head, args.chunk_size)))
        return 0
    rows = measure(args.tokens, args.hidden, args.vocab, args.dtype, args.device, args.chunk_size)
    saving = {}
    for frozen, head in ((False, "trainable"), (True, "frozen")):
        hf = next(r["peak_mib"] for r in rows if r["frozen_head"] == frozen and r["method"] == "hf")
        fl = next(r["peak_mib"] for r in rows if r["frozen_head"] == frozen and r["method"] == "flce")
        saving[head] = dict(hf_mib=hf, flce_mib=fl, saving_pct=round(100 * (1 - fl / hf), 1),
                            ratio=round(hf / max(fl, 1e-9), 1))
    report = dict(
        benchmark="flce_memory", commit=git_commit(), dirty=git_dirty(), machine=machine(),
        load_average=load_average(),
        memory_measure=("torch.cuda.max_memory_allocated above the step's start" if args.device == "cuda"
                        else "peak RSS (VmHWM, reset before the step) above the step's start, fresh process each"),
        workload=dict(tokens=args.tokens, hidden=args.hidden, vocab=args.vocab, dtype=args.dtype, device=args.device,
                      chunk_size=args.chunk_size, full_logits_mib=round(args.tokens * args.vocab * 4 / 2**20, 1)),
        rows=rows, saving=saving,
    )
    md = markdown(report)
    print(md)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(md)
    return 0


def main(argv: list[str] | None = None) -> int:
    return script_main(__doc__, add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
