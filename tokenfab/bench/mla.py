"""MLA / DSA kernel microbenchmarks at DeepSeek-V3 / V3.2 sizes (for the GPU check).

    python -m tokenfab.bench.mla [--size tiny] [--json out.json] [--rep-ms 200]

Rows (``tokenfab.bench.kernels_rows.Row``, so ``tokenfab bench kernels`` can merge them):
- MLA decode: batch 64, 128 heads, latent 512 + rope 64, 4k context, bf16, paged (block 64). The op
  must read every sequence's cached rows once (64 x 4096 x 576 x 2 B = 302 MB): GB/s of that against
  the copy bandwidth measured in the same run (the issue's goal: 70%). Its matrix work is large too
  (2 (576 + 512) FLOP per key per head: 73 GFLOP), reported alongside as TFLOP/s.
- DSA sparse decode: the same with each token attending to 2048 selected keys of its 4k.
- DSA indexer scores: 64 tokens x 64 index heads of 128 against 4k cached index keys.
Peer: the PyTorch reference of each op on the same device (gathered pages, dense masked softmax).
On CPU the kernels run in Triton's interpreter: only ``--size tiny`` makes sense there.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict

import torch

from tokenfab.bench.kernels_rows import Row, _bench_cpu, _bench_cuda


def _copy_gbps(dev: torch.device, bench: Callable) -> float:
    x = torch.empty(256 * 2**20, dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    ms = bench(lambda: y.copy_(x))
    return 2 * x.numel() / ms / 1e6


def _paged(b: int, ctx: int, width: int, bs: int, dtype: torch.dtype, dev: torch.device, gen: torch.Generator):
    nblk = (ctx + bs - 1) // bs
    perm = torch.randperm(b * nblk, generator=gen).to(torch.int32)
    cache = (torch.randn(b * nblk, bs, 1, width, generator=gen) * 0.5).to(dtype).to(dev)
    bt = perm.view(b, nblk).to(dev)
    cu = torch.arange(b + 1, dtype=torch.int32, device=dev)
    lens = torch.full((b,), ctx, dtype=torch.int32, device=dev)
    return cache, bt, cu, lens


def mla_rows(tiny: bool, dev: torch.device, rep_ms: float = 200.0, want_peer: bool = True) -> list[Row]:
    from tokenfab.kernels import dsa, mla

    bench = (lambda fn: _bench_cuda(fn, rep_ms)) if dev.type == "cuda" else (lambda fn: _bench_cpu(fn, rep_ms))
    gen = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16
    if tiny:
        b, h, r, rope, ctx, bs, topk, hi, di = 2, 16, 64, 16, 96, 16, 32, 16, 32
    else:
        b, h, r, rope, ctx, bs, topk, hi, di = 64, 128, 512, 64, 4096, 64, 2048, 64, 128
    d = r + rope
    copy = _copy_gbps(dev, bench)
    rows: list[Row] = []

    def row(op: str, shape: str, fn, ref, nbytes: float, flops: float, notes: str = "") -> None:
        out = fn()
        err = None
        peer_ms = None
        if want_peer:
            expect = ref()
            err = float((out.float() - expect.float()).abs().max())
            peer_ms = bench(ref)
        ms = bench(fn)
        gbps = nbytes / ms / 1e6
        rows.append(Row(
            op=op, shape=shape, dtype="bfloat16", metric="GB/s", time_us=ms * 1000, value=gbps, ceiling=copy,
            fraction_of_ceiling=gbps / copy, peer="torch reference", peer_time_us=None if peer_ms is None else
            peer_ms * 1000, speedup_vs_peer=None if peer_ms is None else peer_ms / ms, max_abs_err=err,
            notes=notes, extra={"tflops": flops / ms / 1e9},
        ))

    cache, bt, cu, lens = _paged(b, ctx, d, bs, dtype, dev, gen)
    q = (torch.randn(b, h, d, generator=gen) * 0.5).to(dtype).to(dev)
    scale = 192**-0.5
    row("mla_decode", f"B{b} H{h} r{r}+{rope} ctx{ctx}",
        lambda: mla._mla_attention_triton(q, cache, bt, cu, lens, 1, ctx, scale, r),
        lambda: mla.mla_attention_ref(q, cache, bt, cu, lens, 1, ctx, scale, r),
        b * ctx * d * 2 + 2 * q.numel() * 2, 2 * b * h * ctx * (d + r), "absorbed form, split-KV")

    idx = torch.stack([torch.randperm(ctx, generator=gen)[:topk] for _ in range(b)]).to(torch.int32).to(dev)
    row("dsa_sparse_decode", f"B{b} H{h} r{r}+{rope} top{topk} of {ctx}",
        lambda: dsa._dsa_sparse_attention_triton(q, cache, bt, cu, lens, idx, scale, r),
        lambda: dsa.dsa_sparse_attention_ref(q, cache, bt, cu, lens, idx, scale, r),
        b * topk * (d * 2 + 4) + 2 * q.numel() * 2, 2 * b * h * topk * (d + r), "random selections")

    icache, ibt, icu, ilens = _paged(b, ctx, d + di, bs, dtype, dev, gen)
    qi = (torch.randn(b, hi, di, generator=gen) * 0.5).to(dtype).to(dev)
    w = torch.randn(b, hi, generator=gen).to(dev)
    row("dsa_index_scores", f"T{b} Hi{hi} d{di} ctx{ctx}",
        lambda: dsa._dsa_index_scores_triton(qi, w, icache, ibt, icu, ilens, 1, ctx, d),
        lambda: dsa.dsa_index_scores_ref(qi, w, icache, ibt, icu, ilens, 1, ctx, d),
        b * ctx * (di * 2 + 4), 2 * b * hi * ctx * di, "scores only (top-k: torch.topk)")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=("realistic", "tiny"), default=None)
    ap.add_argument("--json", dest="json_path", default=None)
    ap.add_argument("--rep-ms", type=float, default=200.0)
    ap.add_argument("--no-peer", action="store_true")
    args = ap.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tiny = (args.size or ("realistic" if dev.type == "cuda" else "tiny")) == "tiny"
    t0 = time.perf_counter()
    rows = mla_rows(tiny, dev, args.rep_ms, not args.no_peer)
    print("| op | shape | us | GB/s | of copy | TFLOP/s | vs torch | max err |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        vs = f"{r.speedup_vs_peer:.2f}x" if r.speedup_vs_peer else "-"
        print(f"| {r.op} | {r.shape} | {r.time_us:.1f} | {r.value:.0f} | {r.fraction_of_ceiling:.0%} | "
              f"{r.extra['tflops']:.1f} | {vs} | {r.max_abs_err} |")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"device": str(dev), "seconds": time.perf_counter() - t0, "rows": [asdict(r) for r in rows]}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
