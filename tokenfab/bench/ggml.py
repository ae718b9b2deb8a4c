"""Microbenchmark of the packed GGUF matmul kernels (``kernels/cpu/ggml_matmul``) on CPU.

    tokenfab bench ggml [--m 1 4 64] [--threads N] [--json out.json]   (or python -m tokenfab.bench.ggml)

For each weight shape and activation row count M it times ``ggml_matmul`` (act f32 and q8) and
torch's float32 ``x @ w.T`` on the dequantized weight, and reports weight bytes read per second
(the figure that bounds single-stream decode) and the speedup over float32. Each timed call uses
the next of several weight copies, together larger than the last-level cache, so the weights
stream from memory as they do in a real forward pass (one model's weights do not fit in cache);
the fastest call is reported.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from tokenfab.bench.common import script_main
from tokenfab.kernels.cpu.ggml_matmul import BLOCK_BYTES, dequantize, ggml_kernel_info, ggml_matmul

# (name, N, K, qtype): the bundled SmolLM2-135M's linear shapes (Q4_1) and its tied LM head (Q8_0)
BUNDLED = [
    ("q/o_proj", 576, 576, "Q4_1"),
    ("k/v_proj", 192, 576, "Q4_1"),
    ("gate/up_proj", 1536, 576, "Q4_1"),
    ("down_proj", 576, 1536, "Q4_1"),
    ("lm_head", 49152, 576, "Q8_0"),
]


def random_packed(n: int, k: int, qtype: str, gen: torch.Generator) -> torch.Tensor:
    """Random packed blocks with sane float16 scales (d in [0.001, 0.01), Q4_1's m in [-0.08, 0))."""
    bb = BLOCK_BYTES[qtype]
    blocks = torch.randint(0, 256, (n, k // 32, bb), dtype=torch.uint8, generator=gen)
    d = (torch.rand(n, k // 32, generator=gen) * 0.009 + 0.001).half()
    blocks[..., 0:2] = d.view(torch.uint8).view(n, k // 32, 2)
    if qtype == "Q4_1":
        m = (-torch.rand(n, k // 32, generator=gen) * 0.08).half()
        blocks[..., 2:4] = m.view(torch.uint8).view(n, k // 32, 2)
    return blocks.reshape(n, -1)


def _time(fn, copies: int, min_s: float) -> float:
    """Fastest single call, in seconds, call i taking copy i (so each call reads its weights cold).
    The minimum, not the mean: on a shared machine other processes only ever add time."""
    for i in range(copies):
        fn(i)
    best = float("inf")
    t_end = time.perf_counter() + min_s
    while True:
        for i in range(copies):
            t0 = time.perf_counter()
            fn(i)
            best = min(best, time.perf_counter() - t0)
        if time.perf_counter() > t_end:
            return best


def bench_shape(n: int, k: int, qtype: str, m: int, cache_bytes: int, min_s: float, torch_peer: bool = True) -> dict:
    gen = torch.Generator().manual_seed(0)
    w0 = random_packed(n, k, qtype, gen)
    copies_q = max(2, -(-2 * cache_bytes // w0.numel()))
    ws = [w0] + [w0.clone() for _ in range(copies_q - 1)]
    x = torch.randn(m, k, generator=gen)
    row = {"N": n, "K": k, "qtype": qtype, "M": m, "weight_bytes": w0.numel(), "f32_weight_bytes": n * k * 4}
    for act in ("f32", "q8"):
        t = _time(lambda i, a=act: ggml_matmul(x, ws[i], qtype, k, act=a), copies_q, min_s)
        row[f"{act}_us"] = t * 1e6
        row[f"{act}_GBps"] = w0.numel() / t / 1e9
    if torch_peer:
        wd0 = dequantize(w0, qtype, k)
        copies_t = max(2, -(-2 * cache_bytes // (wd0.numel() * 4)))
        wds = [wd0] + [wd0.clone() for _ in range(copies_t - 1)]
        t = _time(lambda i: torch.matmul(x, wds[i].T), copies_t, min_s)
        row["torch_f32_us"] = t * 1e6
        row["torch_f32_GBps"] = wd0.numel() * 4 / t / 1e9
        row["speedup_f32"] = row["torch_f32_us"] / row["f32_us"]
        row["speedup_q8"] = row["torch_f32_us"] / row["q8_us"]
    return row


def _llc_bytes() -> int:
    try:
        import os
        return max(os.sysconf("SC_LEVEL3_CACHE_SIZE"), 32 << 20)
    except (ValueError, OSError, AttributeError):
        return 32 << 20


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--m", type=int, nargs="+", default=[1], help="activation rows (1 = single-stream decode)")
    ap.add_argument("--min-seconds", type=float, default=0.5, help="time per measurement")
    ap.add_argument("--no-torch", action="store_true", help="skip the float32 torch peer")
    ap.add_argument("--threads", type=int, help="torch (and kernel) threads; default: torch's")
    ap.add_argument("--json", help="write the rows here")


def main(argv: list[str] | None = None) -> int:
    return script_main(__doc__, add_arguments, run, argv)


def run(args: argparse.Namespace) -> int:
    """``tokenfab bench ggml``: print the table (and write JSON with ``--json``)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    info = ggml_kernel_info()
    print(f"kernel: {info}")
    cache = _llc_bytes()
    rows = []
    print(f"{'shape':>14} {'N':>6} {'K':>5} {'type':>5} {'M':>4} | {'f32 us':>8} {'GB/s':>6} | "
          f"{'q8 us':>8} {'GB/s':>6} | {'torch fp32 us':>13} {'GB/s':>6} | {'x f32':>6} {'x q8':>6}")
    for m in args.m:
        for name, n, k, qt in BUNDLED:
            r = bench_shape(n, k, qt, m, cache, args.min_seconds, not args.no_torch)
            r["shape"] = name
            rows.append(r)
            print(f"{name:>14} {n:>6} {k:>5} {qt:>5} {m:>4} | {r['f32_us']:8.1f} {r['f32_GBps']:6.1f} | "
                  f"{r['q8_us']:8.1f} {r['q8_GBps']:6.1f} | {r.get('torch_f32_us', float('nan')):13.1f} "
                  f"{r.get('torch_f32_GBps', float('nan')):6.1f} | {r.get('speedup_f32', float('nan')):6.2f} "
                  f"{r.get('speedup_q8', float('nan')):6.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"kernel": info, "threads": torch.get_num_threads(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
