"""`tokenfab bench prefix`: the two workloads the scheduler's features are for.

1. Shared prefix: N requests share a long system prompt and differ in a short question.
   Prefix caching on vs off: time to first token and output throughput, and the ratio.
2. Mixed long/short: short streams are decoding when long prompts arrive. With an
   unlimited step budget a long prompt's prefill stalls every running stream for a whole
   step; chunked prefill bounds each step. Reported: the inter-token latency (p50/p99) of
   the running streams, chunked vs unchunked.

Both run through the engine in this process (the same engine the server uses), with
random token prompts and EOS ignored.
"""

from __future__ import annotations

import argparse
import random
import time

from tokenfab.bench.common import git_commit, machine, markdown_table, percentile, write_json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--system-len", type=int, default=1000)
    p.add_argument("--question-len", type=int, default=50)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--num-short", type=int, default=8, help="running streams in the mixed workload")
    p.add_argument("--num-long", type=int, default=2)
    p.add_argument("--long-len", type=int, default=1500)
    p.add_argument("--chunk-budget", type=int, default=256, help="max-num-batched-tokens when chunking")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--skip", choices=["prefix", "mixed"], default=None)
    p.add_argument("--json", default=None)


def _engine(args, **kw):
    from tokenfab.engine.llm_engine import LLMEngine

    return LLMEngine(model=args.model, dtype=args.dtype, device=args.device, **kw)


def _drain(engine, on_output=None) -> None:
    while engine.has_unfinished_requests():
        for out in engine.step():
            if on_output:
                on_output(out, time.perf_counter())


def shared_prefix(args, caching: bool) -> dict:
    from tokenfab.engine.requests.sampling_params import SamplingParams

    engine = _engine(args, enable_prefix_caching=caching, max_num_batched_tokens=2048)
    rng = random.Random(1)
    vocab = engine.vocab_size
    system = [rng.randrange(100, vocab) for _ in range(args.system_len)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    engine.add_request("warm", system[:64], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    _drain(engine)
    engine.block_manager.reset_prefix_cache()
    first: dict[str, float] = {}
    t0 = time.perf_counter()
    for i in range(args.num_requests):
        q = [rng.randrange(100, vocab) for _ in range(args.question_len)]
        engine.add_request(f"q{i}", system + q, params)
    computed_before = engine.computed_prompt_tokens_total

    def on_output(out, now):
        first.setdefault(out.request_id, now - t0)

    _drain(engine, on_output)
    dt = time.perf_counter() - t0
    ttft = list(first.values())
    return {"prefix_caching": caching, "seconds": dt, "output_tok_s": args.num_requests * args.output_len / dt,
            "ttft_mean_s": sum(ttft) / len(ttft), "ttft_p50_s": percentile(ttft, 50),
            "ttft_p99_s": percentile(ttft, 99),
            "computed_prompt_tokens": engine.computed_prompt_tokens_total - computed_before,
            "hit_rate": engine.get_stats().prefix_cache_hit_rate}


def mixed(args, budget: int) -> dict:
    from tokenfab.engine.requests.sampling_params import SamplingParams

    engine = _engine(args, max_num_batched_tokens=budget, enable_prefix_caching=False)
    rng = random.Random(2)
    vocab = engine.vocab_size
    short = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    for i in range(args.num_short):
        engine.add_request(f"s{i}", [rng.randrange(100, vocab) for _ in range(32)], short)
    last: dict[str, float] = {}
    gaps: list[float] = []
    injected = False
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            rid = out.request_id
            if rid.startswith("s"):
                if rid in last:
                    gaps.append(now - last[rid])
                last[rid] = now
        if not injected and len(gaps) >= 4 * args.num_short:
            injected = True
            for j in range(args.num_long):
                engine.add_request(f"l{j}", [rng.randrange(100, vocab) for _ in range(args.long_len)],
                                   SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    return {"max_num_batched_tokens": budget, "itl_p50_ms": percentile(gaps, 50) * 1e3,
            "itl_p99_ms": percentile(gaps, 99) * 1e3, "itl_max_ms": max(gaps) * 1e3}


def run(args: argparse.Namespace) -> int:
    report = {"benchmark": "prefix", "machine": machine(), "commit": git_commit(), "model": args.model or "bundled"}
    if args.skip != "prefix":
        on, off = shared_prefix(args, True), shared_prefix(args, False)
        rows = [["on" if r["prefix_caching"] else "off", r["computed_prompt_tokens"], r["ttft_mean_s"],
                 r["ttft_p99_s"], r["output_tok_s"], r["seconds"]] for r in (on, off)]
        print(f"shared prefix: {args.num_requests} requests, {args.system_len}-token system prompt + "
              f"{args.question_len}-token question, {args.output_len} output tokens")
        print(markdown_table(["prefix caching", "prompt tokens computed", "TTFT mean s", "TTFT p99 s",
                              "output tok/s", "seconds"], rows))
        ratio = {"ttft_mean_speedup": off["ttft_mean_s"] / on["ttft_mean_s"],
                 "throughput_ratio": on["output_tok_s"] / off["output_tok_s"]}
        print(f"caching on vs off: TTFT {ratio['ttft_mean_speedup']:.2f}x faster, "
              f"throughput {ratio['throughput_ratio']:.2f}x\n")
        report["shared_prefix"] = {"on": on, "off": off, **ratio}
    if args.skip != "mixed":
        chunked, whole = mixed(args, args.chunk_budget), mixed(args, args.long_len + 64 * args.num_long + 64)
        rows = [[r["max_num_batched_tokens"], r["itl_p50_ms"], r["itl_p99_ms"], r["itl_max_ms"]]
                for r in (chunked, whole)]
        print(f"mixed: {args.num_short} streams decoding while {args.num_long} prompts of "
              f"{args.long_len} tokens arrive")
        print(markdown_table(["step token budget", "ITL p50 ms", "ITL p99 ms", "ITL max ms"], rows))
        print(f"chunked prefill cuts the running streams' p99 inter-token latency "
              f"{whole['itl_p99_ms'] / chunked['itl_p99_ms']:.2f}x")
        report["mixed"] = {"chunked": chunked, "unchunked": whole,
                           "p99_itl_ratio": whole["itl_p99_ms"] / chunked["itl_p99_ms"]}
    write_json(args.json, report)
    return 0
