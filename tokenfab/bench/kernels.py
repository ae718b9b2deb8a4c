"""`tokenfab bench kernels`: microbenchmarks of the Triton kernels against their torch equivalents.

Each kernel runs at a realistic size (the issue's: decode attention over batch 64 x 4k context
with 32/8 heads of dim 128 in bf16, prefill over 8 x 2k tokens, ...). Memory-bound kernels
report GB/s (the fewest bytes the op must move: each input read once, each output written
once) and the fraction of the device's copy bandwidth, measured in the same run (a
device-to-device copy, bytes read + written) and of the datasheet peak; attention prefill
reports TFLOP/s against a bf16 matrix product measured in the same run. Each row also times the
best plain-PyTorch versions of the op on the same inputs (F.rms_norm, F.silu * up, index_copy_,
SDPA over dense K/V for attention, and torch.compile of the reference; ``--compile-peers``), takes
the fastest as the peer, and gives the speedup and the peer's own fraction of the roofline. On
CPU the kernels run in Triton's interpreter: only the tiny
sizes run (``--size tiny``) and the timings say nothing about speed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from tokenfab.bench.kernels_report import ceilings, compiled_kernels, machine_info, markdown
from tokenfab.bench.kernels_rows import _bench_cpu, _bench_cuda, make_row


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", choices=("realistic", "tiny"), default=None,
                        help="problem sizes (default: realistic on CUDA, tiny on CPU)")
    parser.add_argument("--ops", default="all",
                        help="comma-separated subset: rms_norm,add_rms_norm,rotary,silu_and_mul,gelu_and_mul,"
                             "store_kv,decode_attention,prefill_attention,sample")
    parser.add_argument("--json", dest="json_path", default=None, help="write the results as JSON here")
    parser.add_argument("--markdown", dest="md_path", default=None, help="write a markdown table here")
    parser.add_argument("--rep-ms", type=float, default=200.0, help="timed milliseconds per measurement")
    parser.add_argument("--no-peer", action="store_true", help="skip the torch equivalents")
    parser.add_argument("--sweep", action="store_true",
                        help="also time launch-configuration variants of the attention kernels (CUDA)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="skip the remaining sweep variants and torch.compile peers once this many seconds "
                             "have passed")
    parser.add_argument("--compile-peers", choices=("auto", "on", "off"), default="auto",
                        help="also time torch.compile of each op's reference as a peer (auto: on CUDA only; on "
                             "CPU the kernels run interpreted and inductor compiles take minutes on 2 cores)")


# --------------------------------------------------------------------------- workloads


def _sizes(tiny: bool) -> dict:
    if tiny:
        return dict(tokens=8, hidden=256, inter=512, hq=4, hkv=2, d=64, batch=2, ctx=48, pre_seqs=2,
                    pre_len=40, vocab=2000, sample_rows=2)
    return dict(tokens=16384, hidden=4096, inter=14336, hq=32, hkv=8, d=128, batch=64, ctx=4096, pre_seqs=8,
                pre_len=2048, vocab=151936, sample_rows=256)


def _workloads(tiny: bool, dev, dtype, rep_ms: float, bench, want_peer: bool, compile_peers: bool = False,
               deadline: float | None = None):
    """Each op's workload: (op, shape, bytes or FLOPs, our kernel, [(peer name, peer)], max error).
    The peers are the best plain-PyTorch versions of the op (a fused torch function where one exists,
    SDPA, the reference under torch.compile); the fastest of them is the row's peer."""
    import torch
    import torch.nn.functional as F

    from tokenfab.kernels import activation, attention, kv_cache, norm, rope, sampling

    s = _sizes(tiny)
    g = torch.Generator(device="cpu").manual_seed(0)
    el = torch.tensor([], dtype=dtype).element_size()

    def rnd(*shape, dt=dtype, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dt).to(dev)

    def compiled(name, ref, *args):
        if not compile_peers:
            return []
        cfn = torch.compile(ref, dynamic=False)
        return [(f"torch.compile({name})", lambda: cfn(*args))]

    def timed(fn, peers):
        """Our time and each peer's (ms), or why a peer has none."""
        t = bench(fn, rep_ms)
        times: dict[str, float | str] = {}
        for name, peer in peers if want_peer else []:
            if name.startswith("torch.compile") and deadline is not None and time.perf_counter() > deadline:
                times[name] = "skipped: time budget spent"
                continue
            try:
                peer()  # compiles a torch.compile peer outside the timing
                times[name] = bench(peer, rep_ms)
            except Exception as exc:  # a peer that fails to compile must not hide the row
                times[name] = f"{type(exc).__name__}: {exc}"[:200]
        return t, times

    def err(a, b):
        return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0

    t_, h, inter = s["tokens"], s["hidden"], s["inter"]
    variants: dict[str, Callable[[dict], Callable[[], object]]] = {}  # filled by the attention workloads

    def w_rms():
        x, w = rnd(t_, h), rnd(h)
        fn = lambda: norm._rms_norm_triton(x, w, 1e-6)
        peers = [("F.rms_norm", lambda: F.rms_norm(x, (h,), w, 1e-6)),
                 *compiled("reference", norm.rms_norm_ref, x, w, 1e-6)]
        return "rms_norm", f"[{t_}, {h}]", 2 * t_ * h * el, fn, peers, err(fn(), norm.rms_norm_ref(x, w, 1e-6))

    def w_add_rms():
        x, r, w = rnd(t_, h), rnd(t_, h), rnd(h)
        r2 = r.clone()
        e = err(norm._add_rms_norm_triton(x, r, w, 1e-6), norm.add_rms_norm_ref(x, r2, w, 1e-6))
        fn = lambda: norm._add_rms_norm_triton(x, r, w, 1e-6)
        peers = [("add_ + F.rms_norm", lambda: F.rms_norm(r2.add_(x), (h,), w, 1e-6)),
                 *compiled("reference", norm.add_rms_norm_ref, x, r2, w, 1e-6)]
        return "add_rms_norm", f"[{t_}, {h}]", 4 * t_ * h * el, fn, peers, e

    def w_rope():
        hq, hk, d = s["hq"], s["hkv"], s["d"]
        q, k = rnd(t_, hq, d), rnd(t_, hk, d)
        pos = torch.randint(0, 8192, (t_,), generator=g).to(dev)
        cs = rnd(8192, d, dt=torch.float32)
        fn = lambda: rope._rotary_embedding_triton(pos, q, k, cs, True)
        peers = [("reference (eager)", lambda: rope.rotary_embedding_ref(pos, q, k, cs, True)),
                 *compiled("reference", rope.rotary_embedding_ref, pos, q, k, cs, True)]
        a, b = fn(), rope.rotary_embedding_ref(pos, q, k, cs, True)
        nbytes = 2 * t_ * (hq + hk) * d * el + t_ * d * 4 + t_ * 8
        return "rotary_embedding", f"T={t_} {hq}/{hk}x{d} neox", nbytes, fn, peers, max(err(a[0], b[0]),
                                                                                       err(a[1], b[1]))

    def w_act(kind):
        def make():
            x = rnd(t_, 2 * inter)
            gate, up = x[:, :inter], x[:, inter:]
            if kind == "silu":
                fn = lambda: activation._silu_and_mul_triton(x)
                ref = activation.silu_and_mul_ref
                peers = [("F.silu(gate) * up", lambda: F.silu(gate) * up), *compiled("reference", ref, x)]
                e = err(fn(), ref(x))
            else:
                fn = lambda: activation._gelu_and_mul_triton(x, "tanh")
                ref = activation.gelu_and_mul_ref
                peers = [("F.gelu(gate, 'tanh') * up", lambda: F.gelu(gate, approximate="tanh") * up),
                         *compiled("reference", ref, x, "tanh")]
                e = err(fn(), ref(x, "tanh"))
            return f"{kind}_and_mul", f"[{t_}, 2x{inter}]", 3 * t_ * inter * el, fn, peers, e
        return make

    def w_store():
        hk, d = s["hkv"], s["d"]
        k, v = rnd(t_, hk, d), rnd(t_, hk, d)
        bs = 16
        kc = torch.zeros((t_ + bs - 1) // bs + 1, bs, hk, d, dtype=dtype, device=dev)
        vc = torch.zeros_like(kc)
        slots = torch.randperm(kc.shape[0] * bs, generator=g)[:t_].to(dev)
        kc2, vc2 = kc.clone(), vc.clone()
        kv_cache._store_kv_triton(k, v, kc, vc, slots)
        kv_cache.store_kv_ref(k, v, kc2, vc2, slots)
        e = max(err(kc, kc2), err(vc, vc2))
        fn = lambda: kv_cache._store_kv_triton(k, v, kc, vc, slots)

        def index_copy():
            kc2.view(-1, hk, d).index_copy_(0, slots, k)
            vc2.view(-1, hk, d).index_copy_(0, slots, v)

        peers = [("index_copy_", index_copy), *compiled("reference", kv_cache.store_kv_ref, k, v, kc2, vc2, slots)]
        return "store_kv", f"T={t_} {hk}x{d} bs={bs}", 4 * t_ * hk * d * el + 8 * t_, fn, peers, e

    def paged(b, ctx, bs=16):
        hk, d = s["hkv"], s["d"]
        nblk = (ctx + bs - 1) // bs
        kc = rnd(b * nblk, bs, hk, d)
        vc = rnd(b * nblk, bs, hk, d)
        bt = torch.randperm(b * nblk, generator=g).to(torch.int32).view(b, nblk).to(dev)
        lens = torch.full((b,), ctx, dtype=torch.int32, device=dev)
        # the same keys/values, dense [B, Hkv, L, D], for the SDPA peer
        kd = kc[bt.long()].reshape(b, nblk * bs, hk, d)[:, :ctx].transpose(1, 2).contiguous()
        vd = vc[bt.long()].reshape(b, nblk * bs, hk, d)[:, :ctx].transpose(1, 2).contiguous()
        return kc, vc, bt, lens, kd, vd

    def w_decode():
        b, ctx, hq, hk, d = s["batch"], s["ctx"], s["hq"], s["hkv"], s["d"]
        kc, vc, bt, lens, kd, vd = paged(b, ctx)
        q = rnd(b, hq, d)
        scale = d**-0.5
        fn = lambda: attention._paged_decode_attention_triton(q, kc, vc, bt, lens, ctx, scale)
        peer = lambda: F.scaled_dot_product_attention(q[:, :, None], kd, vd, scale=scale, enable_gqa=True)
        peers = [("torch SDPA, dense K/V (no page gather)", peer)]
        e = err(fn(), peer()[:, :, 0])
        variants["decode_attention"] = lambda cfg: (
            lambda: attention._paged_decode_attention_triton(q, kc, vc, bt, lens, ctx, scale, config=cfg))
        nbytes = 2 * b * ctx * hk * d * el + 2 * b * hq * d * el + b * ((ctx + 15) // 16) * 4
        return "paged_decode_attention", f"B={b} ctx={ctx} {hq}/{hk}x{d} bs=16", nbytes, fn, peers, e

    def w_prefill():
        n, L, hq, hk, d = s["pre_seqs"], s["pre_len"], s["hq"], s["hkv"], s["d"]
        kc, vc, bt, lens, kd, vd = paged(n, L)
        q = rnd(n * L, hq, d)
        cu = torch.arange(0, n * L + 1, L, dtype=torch.int32, device=dev)
        scale = d**-0.5
        fn = lambda: attention._prefill_attention_triton(q, kc, vc, bt, cu, lens, L, L, scale)
        variants["prefill_attention"] = lambda cfg: (
            lambda: attention._prefill_attention_triton(q, kc, vc, bt, cu, lens, L, L, scale, config=cfg))
        qd = q.view(n, L, hq, d).transpose(1, 2)
        peer = lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale, enable_gqa=True)
        peers = [("torch SDPA causal, dense K/V (no page gather)", peer)]
        e = err(fn(), peer().transpose(1, 2).reshape(n * L, hq, d))
        flops = 4.0 * n * hq * d * L * (L + 1) / 2  # causal: QK^T and PV over the lower triangle
        return "prefill_attention", f"{n}x{L} tokens {hq}/{hk}x{d} causal", flops, fn, peers, e

    def w_sample():
        b, v = s["sample_rows"], s["vocab"]
        logits = rnd(b, v, dt=torch.float32, scale=3.0)
        t = torch.full((b,), 0.8, device=dev)
        k = torch.full((b,), 50, dtype=torch.int64, device=dev)
        p = torch.full((b,), 0.9, device=dev)
        m = torch.zeros(b, device=dev)
        seeds = torch.arange(b, device=dev)
        fn = lambda: sampling._sample_triton(logits, t, k, p, m, seeds)
        peer = lambda: sampling.sample_ref(logits, t, k, p, m, seeds)
        peers = [("reference (eager, full sort)", peer),
                 *compiled("reference", sampling.sample_ref, logits, t, k, p, m, seeds)]
        agree = float((fn() == peer()).float().mean())
        return "sample", f"[{b}, {v}] T=0.8 top_k=50 top_p=0.9", b * v * 4, fn, peers, 1.0 - agree

    def w_moe(tokens: int):
        """Fused MoE at a Qwen3-30B-A3B layer shape: 128 experts, top-8, hidden 2048, expert 768."""
        from tokenfab.kernels import moe

        def make():
            e, k, hid, it = (8, 2, 64, 32) if tiny else (128, 8, 2048, 768)
            n = min(tokens, 16) if tiny else tokens
            x = rnd(n, hid)
            w13 = rnd(e, 2 * it, hid, scale=hid**-0.5)
            w2 = rnd(e, hid, it, scale=it**-0.5)
            logits = torch.randn(n, e, generator=g).to(dev)
            weights, ids = moe.topk_softmax_ref(logits, k, True)
            fn = lambda: moe._fused_experts_triton(x, w13, w2, weights, ids)
            peer = lambda: moe.fused_experts_ref(x, w13, w2, weights, ids)
            # no torch.compile peer: the per-expert loop is data-dependent (a graph per routing)
            peers = [("torch per-expert loop (reference; not compiled: data-dependent)", peer)]
            flops = 6.0 * n * k * hid * it  # gate+up (2 x H x 2I) and down (2 x I x H) per routed pair
            return f"fused_moe T={n}", f"E={e} top-{k} H={hid} I={it}", flops, fn, peers, err(fn(), peer())

        return make

    from tokenfab.bench.gemm_workloads import gemm_workloads

    return {
        **gemm_workloads(tiny, dev, dtype, rnd, err),  # low-precision GEMMs vs bf16 (issue 13)
        "fused_moe_1": w_moe(1),
        "fused_moe_64": w_moe(64),
        "fused_moe_1024": w_moe(1024),
        "fused_moe_8192": w_moe(8192),
        "rms_norm": w_rms,
        "add_rms_norm": w_add_rms,
        "rotary": w_rope,
        "silu_and_mul": w_act("silu"),
        "gelu_and_mul": w_act("gelu"),
        "store_kv": w_store,
        "decode_attention": w_decode,
        "prefill_attention": w_prefill,
        "sample": w_sample,
    }, timed, variants


# launch-configuration variants timed by --sweep (overrides of the dispatcher's pick)
SWEEPS = {
    "decode_attention": [dict(BLOCK_N=n, num_stages=st) for n in (32, 64, 128) for st in (2, 3)]
    + [dict(NUM_SPLITS=1), dict(NUM_SPLITS=4), dict(NUM_SPLITS=8), dict(num_warps=8)],
    "prefill_attention": [dict(BLOCK_N=n, num_stages=st) for n in (64, 128) for st in (2, 3)]
    + [dict(BLOCK_M=64, num_warps=4), dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2)],
}




def run(args: argparse.Namespace) -> int:
    import torch

    start = time.perf_counter()
    cuda = torch.cuda.is_available()
    if not cuda:
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            print("bench kernels on CPU needs TRITON_INTERPRET=1 before triton is imported", file=sys.stderr)
            return 2
        os.environ["TRITON_INTERPRET"] = "1"
    from tokenfab.kernels._launch import interpreting, patch_interpreter_bf16

    if interpreting():
        patch_interpreter_bf16()
    size = args.size or ("realistic" if cuda else "tiny")
    tiny = size == "tiny"
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    bench = _bench_cuda if cuda else _bench_cpu
    rep_ms = args.rep_ms if cuda else min(args.rep_ms, 50.0)
    measured = ceilings(cuda, bench, rep_ms)
    if cuda:
        torch.cuda.empty_cache()
    compile_peers = {"on": True, "off": False}.get(args.compile_peers, cuda)
    deadline = start + args.budget_s if args.budget_s is not None else None
    workloads, timed, variants = _workloads(tiny, dev, dtype, rep_ms, bench, not args.no_peer, compile_peers,
                                            deadline)
    sweep: list[dict] = []
    wanted = list(workloads) if args.ops == "all" else [o.strip() for o in args.ops.split(",")]
    results: list[dict] = []
    report = dict(kind="kernels", size=size, dtype=str(dtype).removeprefix("torch."), machine=machine_info(cuda),
                  ceilings=measured, results=results, sweep=sweep, compiled=[],
                  peers="the fastest plain-PyTorch version of each op: fused torch functions (F.rms_norm, SDPA, "
                        "index_copy_) and, " + ("with" if compile_peers else "without (--compile-peers off)")
                        + " torch.compile of the reference")

    def save() -> None:  # after every op, so a run cut short still leaves its results
        if args.json_path:
            Path(args.json_path).write_text(json.dumps(report, indent=1))

    for name in wanted:
        if name not in workloads:
            print(f"unknown op {name!r}; choose from {', '.join(workloads)}", file=sys.stderr)
            return 2
        try:
            op, shape, amount, fn, peers, e = workloads[name]()
            t_ms, peer_times = timed(fn, peers)
        except Exception as exc:  # report and go on: one broken kernel must not hide the others
            results.append(dict(op=name, error=f"{type(exc).__name__}: {exc}"[:300]))
            print(f"{name}: {results[-1]['error']}", file=sys.stderr)
            if cuda:
                torch.cuda.empty_cache()
            save()
            continue
        flops = name == "prefill_attention" or name.startswith(("fused_moe", "gemm_"))
        row = make_row(name, op, shape, str(dtype).removeprefix("torch."), flops, amount, t_ms, peers, peer_times, e,
                       measured)
        results.append(asdict(row))
        tp_ms = row.peer_time_us / 1e3 if row.peer_time_us else None
        print(f"{op:24s} {shape:40s} {t_ms * 1e3:10.1f} us  {row.value:8.3g} {row.metric}"
              + (f"  {tp_ms / t_ms:5.2f}x vs {row.peer}" if tp_ms else ""), flush=True)
        if args.sweep and cuda and name in variants:
            for cfg in SWEEPS.get(name, []):
                if args.budget_s is not None and time.perf_counter() - start > args.budget_s:
                    sweep.append(dict(op=op, config=cfg, error="skipped: time budget spent"))
                    continue
                try:
                    tv = bench(variants[name](cfg), rep_ms / 2)
                    entry = dict(op=op, config=cfg, time_us=tv * 1e3, speedup_vs_default=t_ms / tv,
                                 value=amount / (tv * 1e-3) / (1e12 if flops else 1e9))
                except Exception as exc:
                    entry = dict(op=op, config=cfg, error=f"{type(exc).__name__}: {exc}"[:200])
                sweep.append(entry)
                print(f"    sweep {cfg}: " + (f"{entry['time_us']:.1f} us ({entry['speedup_vs_default']:.2f}x)"
                                               if "error" not in entry else entry["error"]), flush=True)
        if cuda:
            torch.cuda.empty_cache()
        save()
    report["compiled"] = compiled_kernels()
    save()
    md = markdown(report)
    print()
    print(md)
    if args.md_path:
        Path(args.md_path).write_text(md)
    return 0 if all("error" not in r for r in results) else 1
