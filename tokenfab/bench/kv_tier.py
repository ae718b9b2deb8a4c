"""`tokenfab bench kv-tier`: second-turn time to first token with the KV tier beyond the device vs recompute.

The workload of issue 28: a device KV cache of about three second-turn sequences, N conversations whose first
turns all run before any second turn (so most first turns' blocks are evicted from the device by then), then
each conversation's second turn (its first prompt, the first answer, a new message), one at a time, in the
same order. Without the tier the evicted prefix is recomputed; with it (host memory; host memory 0 and the disk
level alone) it is loaded back. Reported per mode: second-turn TTFT mean / p50 / p99, prompt tokens computed,
the tier's hits; whether the greedy outputs are identical across modes. Prompts are random tokens, EOS ignored.

Timings on a shared machine are noisy: the report records the load average; rerun it when the machine is quiet.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

from tokenfab.bench.common import git_commit, load_average, machine, markdown_table, percentile, write_json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    p.add_argument("--num-conversations", type=int, default=20)
    p.add_argument("--first-len", type=int, default=512, help="first-turn prompt tokens")
    p.add_argument("--new-len", type=int, default=32, help="second-turn new message tokens")
    p.add_argument("--output-len", type=int, default=8, help="tokens generated per turn")
    p.add_argument("--device-sequences", type=float, default=3.0,
                   help="device KV cache size, in second-turn sequences (default 3)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--modes", default="recompute,host,disk",
                   help="comma-separated: recompute (no tier), host (--kv-offload-bytes), disk (host 0, "
                   "--kv-offload-dir in a temporary directory)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--json", default=None, help="write the report here (JSON)")
    p.add_argument("--md", default=None, help="write the report here (Markdown)")


def _tier_args(mode: str, tmp: str) -> dict:
    if mode == "recompute":
        return {}
    if mode == "host":
        return {"kv_offload_bytes": 8 * 2**30}
    if mode == "disk":
        return {"kv_offload_bytes": 0, "kv_offload_dir": tmp, "kv_offload_disk_bytes": 8 * 2**30}
    raise ValueError(f"unknown mode {mode!r} (recompute, host, disk)")


def run_mode(args: argparse.Namespace, mode: str, tmp: str) -> dict:
    from tokenfab.engine.llm_engine import LLMEngine
    from tokenfab.engine.requests.sampling_params import SamplingParams

    second_len = args.first_len + args.output_len + args.new_len
    num_blocks = max(1, round(args.device_sequences * -(-second_len // args.block_size)))
    engine = LLMEngine(model=args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
                       num_kv_blocks=num_blocks, max_num_batched_tokens=args.max_num_batched_tokens,
                       **_tier_args(mode, tmp))
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    rng = random.Random(0)
    vocab = engine.vocab_size

    def generate(rid: str, prompt: list[int]) -> tuple[list[int], float]:
        t0 = time.perf_counter()
        engine.add_request(rid, prompt, params)
        ttft, tokens = None, []
        while engine.has_unfinished_requests():
            for out in engine.step():
                if ttft is None and out.outputs[0].token_ids:
                    ttft = time.perf_counter() - t0
                if out.finished:
                    tokens = list(out.outputs[0].token_ids)
        return tokens, ttft

    generate("warmup", [rng.randrange(100, vocab) for _ in range(64)])  # first-forward costs out of the figures
    engine.block_manager.reset_prefix_cache()  # (and the tier)
    firsts = [[rng.randrange(100, vocab) for _ in range(args.first_len)] for _ in range(args.num_conversations)]
    answers = [generate(f"t1-{i}", p)[0] for i, p in enumerate(firsts)]
    before = engine.get_stats()
    outputs, ttfts = [], []
    for i, (p, a) in enumerate(zip(firsts, answers)):
        tokens, ttft = generate(f"t2-{i}", p + a + [rng.randrange(100, vocab) for _ in range(args.new_len)])
        outputs.append(tokens)
        ttfts.append(ttft)
    s = engine.get_stats()
    engine.shutdown()
    return {
        "mode": mode, "num_kv_blocks": num_blocks,
        "ttft_mean_s": sum(ttfts) / len(ttfts), "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "computed_prompt_tokens": s.computed_prompt_tokens_total - before.computed_prompt_tokens_total,
        "prefix_cache_hit_tokens": s.prefix_cache_hits_total - before.prefix_cache_hits_total,
        "tier_hit_tokens": s.kv_offload_hits_total - before.kv_offload_hits_total,
        "tier_query_tokens": s.kv_offload_queries_total - before.kv_offload_queries_total,
        "tier_saved_blocks": s.kv_offload_saved_blocks_total, "tier_loaded_blocks": s.kv_offload_loaded_blocks_total,
        "tier_host_bytes": s.kv_offload_host_bytes, "tier_disk_bytes": s.kv_offload_disk_bytes,
        "kv_bytes_per_token": s.kv_bytes_per_token,
        "first_turn_outputs": answers, "second_turn_outputs": outputs,
    }


def _machine_line(m: dict) -> str:
    where = f"{m.get('cpu', m.get('platform'))}, {m.get('cpus')} CPUs, {m.get('threads')} torch threads"
    return where + (f", {m['gpu']}" if m.get("gpu") else "")


def markdown(report: dict) -> str:
    w = report["workload"]
    rows = [[r["mode"], r["ttft_mean_s"] * 1e3, r["ttft_p50_s"] * 1e3, r["ttft_p99_s"] * 1e3,
             r["computed_prompt_tokens"], r["prefix_cache_hit_tokens"], r["tier_hit_tokens"]]
            for r in report["runs"]]
    lines = [
        "# KV tier: second-turn TTFT, tier vs recompute",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Machine: {_machine_line(report['machine'])}; commit {report['commit']}; model "
        f"{report['model']}; load average at the start {report['load_average_start']}, at the end "
        f"{report['load_average_end']}.",
        "",
        f"Workload: {w['num_conversations']} conversations; first turn {w['first_len']} prompt tokens + "
        f"{w['output_len']} generated; second turn = first prompt + answer + {w['new_len']} new tokens, one at a "
        f"time after every first turn; device KV cache {report['runs'][0]['num_kv_blocks']} blocks of "
        f"{w['block_size']} tokens (about {w['device_sequences']} second-turn sequences).",
        "",
        markdown_table(["mode", "TTFT mean ms", "TTFT p50 ms", "TTFT p99 ms", "prompt tokens computed",
                        "device prefix hits (tokens)", "tier hits (tokens)"], rows),
        "",
        f"Greedy outputs identical across modes: {report['outputs_identical']}.",
    ]
    for name, ratio in report["ttft_speedup_vs_recompute"].items():
        lines.append(f"Mean second-turn TTFT, recompute / {name}: {ratio:.2f}x.")
    lines += ["", "One run on a shared machine: the timings are noisy; rerun the command when the machine is quiet."]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    report = {"benchmark": "kv-tier", "machine": machine(), "commit": git_commit(), "model": args.model or "bundled",
              "command": "tokenfab bench kv-tier " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in
                                                             vars(args).items() if v is not None and k in (
                                                                 "num_conversations", "first_len", "new_len",
                                                                 "output_len", "device_sequences", "modes")),
              "workload": {k: getattr(args, k) for k in ("num_conversations", "first_len", "new_len", "output_len",
                                                         "device_sequences", "block_size")},
              "load_average_start": load_average()}
    runs = []
    with tempfile.TemporaryDirectory(prefix="kv-tier-bench-") as tmp:
        for mode in modes:
            runs.append(run_mode(args, mode, tmp))
            r = runs[-1]
            print(f"{mode}: TTFT mean {r['ttft_mean_s'] * 1e3:.1f} ms, p99 {r['ttft_p99_s'] * 1e3:.1f} ms, "
                  f"{r['computed_prompt_tokens']} prompt tokens computed, {r['tier_hit_tokens']} loaded from the tier")
    report["load_average_end"] = load_average()
    report["runs"] = runs
    base = next((r for r in runs if r["mode"] == "recompute"), None)
    report["outputs_identical"] = all(r["first_turn_outputs"] == runs[0]["first_turn_outputs"] and
                                      r["second_turn_outputs"] == runs[0]["second_turn_outputs"] for r in runs)
    report["ttft_speedup_vs_recompute"] = {r["mode"]: base["ttft_mean_s"] / r["ttft_mean_s"]
                                           for r in runs if base is not None and r is not base}
    md = markdown(report)
    print(md)
    write_json(args.json, report)
    if args.md:
        with open(args.md, "w") as f:
            f.write(md)
    return 0 if report["outputs_identical"] else 1
