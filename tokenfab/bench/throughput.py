"""`tokenfab bench throughput`: offline generation throughput against transformers `generate`.

Workload: N requests with prompts of random token ids (uniform lengths in [min, max]) and
exactly ``--output-len`` generated tokens each (EOS ignored, so both engines do the same
work). transformers runs the same requests, greedy, in padded batches at each batch size
of ``--hf-batch-sizes``; its best is the peer. With ``--repeats N`` the set runs N times
interleaved and the reported ratio is the median of the rounds' ratios.

Each engine run gets a fresh Python process (spawned), so that neither inherits the other's
process state: on CPU our engine tunes glibc's allocator for the whole process (see
``llm_engine.tune_cpu_allocator``), which makes a transformers run that follows it in the same
process 10-20% faster than transformers on its own; warmed thread pools and a heap grown by
the previous run would skew things too. ``--same-process`` runs everything in this process,
one after the other, as earlier versions of this benchmark did.
"""

from __future__ import annotations

import argparse
import os
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
    p.add_argument("--same-process", action="store_true",
                   help="run every engine in this process instead of a fresh process each (see the module doc)")
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


def tokenfab_run(args: argparse.Namespace) -> tuple[dict, list[list[int]], dict]:
    """run_tokenfab, keeping only what can leave the process: (result, prompts, engine facts)."""
    ours, prompts, llm = run_tokenfab(args)
    ours["pid"] = os.getpid()
    engine = llm.engine
    facts = {"device": str(engine.device), "model": engine.model_name, "dtype": str(engine.dtype)}
    return ours, prompts, facts


def transformers_run(args: argparse.Namespace, prompts: list[list[int]], path, batch_size: int, device: str,
                     dtype: str) -> dict:
    import torch

    res = run_transformers(args, prompts, path, batch_size, torch.device(device),
                           getattr(torch, dtype.removeprefix("torch.")))
    res["pid"] = os.getpid()
    return res


def in_fresh_process(fn, *fn_args):
    """fn(*fn_args) in a newly spawned Python process (nothing inherited from this one)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *fn_args).result()


def in_this_process(fn, *fn_args):
    return fn(*fn_args)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tokenfab.loader.bundled import bundled_model_path

    path = Path(args.model) if args.model else bundled_model_path()
    hf_sizes = [int(b) for b in args.hf_batch_sizes.split(",") if b.strip()]
    call = in_this_process if args.same_process else in_fresh_process
    rounds = []
    for _ in range(max(args.repeats, 1)):
        ours, prompts, facts = call(tokenfab_run, args)
        device, model_name, dtype = facts["device"], facts["model"], facts["dtype"]
        results = [ours] + [call(transformers_run, args, prompts, path, bs, device, dtype) for bs in hf_sizes]
        best = max(results[1:], key=lambda r: r["output_tok_s"]) if hf_sizes else None
        ratio = ours["output_tok_s"] / best["output_tok_s"] if best else None
        rounds.append({"results": results, "best_peer": best["engine"] if best else None, "ratio": ratio})
    where = "all in this process" if args.same_process else "each engine run in a fresh process"
    print(f"model {model_name} ({dtype}) on {device}; {args.num_requests} requests, prompts "
          f"{args.min_prompt_len}-{args.max_prompt_len} tokens, {args.output_len} output tokens each; {where}")
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
        "isolation": "one process for everything" if args.same_process else "a fresh process per engine run",
        "workload": {"num_requests": args.num_requests, "prompt_len": [args.min_prompt_len, args.max_prompt_len],
                     "output_len": args.output_len, "max_num_batched_tokens": args.max_num_batched_tokens},
        "rounds": rounds, "ratios": ratios, "ratio_vs_best_peer": ratio,
    })
    return 0
