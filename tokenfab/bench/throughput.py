"""`tokenfab bench throughput`: offline generation throughput against transformers `generate`.

Workload: N requests with prompts of random token ids (uniform lengths in [min, max]) and
exactly ``--output-len`` generated tokens each (EOS ignored, so both engines do the same
work). transformers runs the same requests, greedy, in padded batches at each batch size
of ``--hf-batch-sizes``; its best is the peer. Both run in this process, one after the
other, on the same weights; with ``--repeats N`` the pair runs N times interleaved and the
reported ratio is the median of the rounds' ratios.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from tokenfab.bench.common import git_commit, machine, markdown_table, write_json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF directory or .gguf (default: bundled model)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--min-prompt-len", type=int, default=32)
    p.add_argument("--max-prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--hf-batch-sizes", default="16,64", help="comma list; empty to skip the peer")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1,
                   help="rounds of (tokenfab, each peer batch size), interleaved; the ratio reported is the "
                        "median of the rounds' ratios (these machines' speed drifts by 10%% and more)")
    p.add_argument("--json", default=None, help="write the report here")


def make_requests(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # avoid the lowest ids, which are special tokens in most vocabularies
    return [[rng.randrange(100, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run_tokenfab(args: argparse.Namespace) -> tuple[dict, list[list[int]], object]:
    from tokenfab.engine.llm import LLM
    from tokenfab.engine.sampling_params import SamplingParams

    llm = LLM(args.model, dtype=args.dtype, device=args.device, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens)
    prompts = make_requests(args.num_requests, args.min_prompt_len, args.max_prompt_len,
                            llm.engine.vocab_size, args.seed)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    res = {"engine": "tokenfab", "seconds": dt, "output_tokens": n_out, "output_tok_s": n_out / dt,
           "total_tok_s": (n_out + sum(map(len, prompts))) / dt}
    return res, prompts, llm

def run_transformers(args: argparse.Namespace, prompts: list[list[int]], path, batch_size: int, device,
                     dtype) -> dict:
    """transformers generate in the same dtype as our engine ran."""
    import torch
    import transformers

    if path.suffix == ".gguf":
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=dtype)
    else:
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    hf = hf.to(device).eval()
    pad = 0
    t0 = time.perf_counter()
    n_out = 0
    # sort by length so each padded batch wastes little (the peer's best case)
    order = sorted(prompts, key=len)
    with torch.inference_mode():
        for i in range(0, len(order), batch_size):
            chunk = order[i : i + batch_size]
            width = max(map(len, chunk))
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device)
            out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.output_len,
                              min_new_tokens=args.output_len, do_sample=False, pad_token_id=pad)
            n_out += (out.shape[1] - width) * len(chunk)
    dt = time.perf_counter() - t0
    return {"engine": f"transformers (batch {batch_size})", "seconds": dt, "output_tokens": n_out,
            "output_tok_s": n_out / dt, "total_tok_s": (n_out + sum(map(len, prompts))) / dt}


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tokenfab.loader.bundled import bundled_model_path

    path = Path(args.model) if args.model else bundled_model_path()
    hf_sizes = [int(b) for b in args.hf_batch_sizes.split(",") if b.strip()]
    rounds = []
    for _ in range(max(args.repeats, 1)):
        ours, prompts, llm = run_tokenfab(args)
        engine = llm.engine
        device, model_name, dtype = engine.device, engine.model_name, str(engine.dtype)
        torch_dtype = engine.dtype
        del llm, engine
        results = [ours] + [run_transformers(args, prompts, path, bs, device, torch_dtype) for bs in hf_sizes]
        best = max(results[1:], key=lambda r: r["output_tok_s"]) if hf_sizes else None
        ratio = ours["output_tok_s"] / best["output_tok_s"] if best else None
        rounds.append({"results": results, "best_peer": best["engine"] if best else None, "ratio": ratio})
    print(f"model {model_name} ({dtype}) on {device}; {args.num_requests} requests, prompts "
          f"{args.min_prompt_len}-{args.max_prompt_len} tokens, {args.output_len} output tokens each")
    rows = [[i + 1, r["engine"], r["output_tokens"], r["seconds"], r["output_tok_s"], r["total_tok_s"]]
            for i, rnd in enumerate(rounds) for r in rnd["results"]]
    print(markdown_table(["round", "engine", "output tokens", "seconds", "output tok/s", "total tok/s"], rows))
    ratios = [r["ratio"] for r in rounds if r["ratio"] is not None]
    ratio = statistics.median(ratios) if ratios else None
    if ratio is not None:
        each = ", ".join(f"{x:.2f}x" for x in ratios)
        print(f"\ntokenfab / best transformers, output tokens/s: {ratio:.2f}x (median of rounds: {each})")
    write_json(args.json, {
        "benchmark": "throughput", "machine": machine(), "commit": git_commit(), "model": model_name,
        "dtype": dtype, "device": str(device),
        "workload": {"num_requests": args.num_requests, "prompt_len": [args.min_prompt_len, args.max_prompt_len],
                     "output_len": args.output_len, "max_num_batched_tokens": args.max_num_batched_tokens},
        "rounds": rounds, "ratios": ratios, "ratio_vs_best_peer": ratio,
    })
    return 0
