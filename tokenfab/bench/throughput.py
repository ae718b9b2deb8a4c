"""`tokenfab bench throughput`: offline generation throughput against transformers `generate`.

Workload: N requests with prompts of random token ids (uniform lengths in [min, max]) and
exactly ``--output-len`` generated tokens each (EOS ignored, so both engines do the same
work). transformers runs the same requests, greedy, in padded batches (prompts sorted by
length, its best case) at each batch size of ``--hf-batch-sizes`` (default 8, 16, 32, 64 and all
of them at once); its best batch size is the peer of each round.

Both sides get the same care:
- warm-up: each engine first generates for ``--warmup-requests`` prompts that the measured set
  does not contain (another seed), so neither is timed cold and no prefix cache or allocator
  pool is primed with the measured prompts;
- the same allocator: on CPU our engine tunes glibc for its whole process
  (``llm_engine.tune_cpu_allocator``: freed memory stays in the process), which also makes
  transformers 10-20% faster. ``--allocator tuned`` (default) applies it to the peer's process
  too, ``default`` to neither, ``both`` runs every round under each setting;
- the same dtype: the peer's loaded parameters are checked to be of the dtype our engine ran in
  (an error otherwise), and each result names its engine's settings (threads, dtype, batching).

Each engine run gets a fresh spawned Python process, so that neither inherits the other's
process state (allocator, thread pools, heap); ``--same-process`` runs everything here.
With ``--repeats N`` the rounds run interleaved; the report gives every round's ratio, their
median, and two conservative figures: the worst round and our median against the peer's best
single run of all rounds.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

from tokenfab.bench.common import git_commit, git_dirty, load_average, machine, markdown_table, write_json

ALLOCATOR_SETTINGS = ("tuned", "default")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF directory or .gguf (default: bundled model)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--min-prompt-len", type=int, default=32)
    p.add_argument("--max-prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--hf-batch-sizes", default="8,16,32,64,all",
                   help="comma list of the peer's batch sizes ('all': every request in one batch); empty: no peer")
    p.add_argument("--warmup-requests", type=int, default=8, help="fresh prompts each engine warms up on")
    p.add_argument("--warmup-tokens", type=int, default=8, help="tokens generated per warm-up prompt")
    p.add_argument("--allocator", choices=(*ALLOCATOR_SETTINGS, "both"), default="tuned",
                   help="glibc allocator setting of BOTH processes: 'tuned' (our engine's, applied to the peer "
                        "too), 'default' (neither), 'both' (every round under each)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default=None,
                   help="GGUF mode of our engine (gguf, gguf-q8act, none; default: packed gguf on CPU)")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1,
                   help="rounds of (tokenfab, each peer batch size), interleaved (these machines drift 10%% and more)")
    p.add_argument("--same-process", action="store_true",
                   help="run every engine in this process instead of a fresh process each (see the module doc)")
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--markdown", default=None, help="write the printed tables and settings here")


def make_requests(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # avoid the lowest ids, which are special tokens in most vocabularies
    return [[rng.randrange(100, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def peer_batch_sizes(spec: str, num_requests: int) -> list[int]:
    """The peer's batch sizes from ``--hf-batch-sizes`` ('all' = every request), capped at the
    request count, duplicates dropped, order kept."""
    out: list[int] = []
    for item in spec.split(","):
        item = item.strip().lower()
        if not item:
            continue
        bs = num_requests if item == "all" else int(item)
        if bs < 1:
            raise ValueError(f"--hf-batch-sizes: batch sizes are positive, got {item!r}")
        bs = min(bs, num_requests)
        if bs not in out:
            out.append(bs)
    return out


def apply_allocator(setting: str) -> bool:
    """Put this process's allocator in ``setting``; returns whether glibc tuning is on. 'default'
    only works before our engine is built in this process (the tuning cannot be undone)."""
    from tokenfab.engine.llm_engine import tune_cpu_allocator

    if setting == "tuned":
        return tune_cpu_allocator()  # still honours TOKENFAB_CPU_MALLOC_TUNING=0: then neither side is tuned
    os.environ["TOKENFAB_CPU_MALLOC_TUNING"] = "0"
    return False


def _threads() -> dict:
    import torch

    return {"torch_threads": torch.get_num_threads(), "interop_threads": torch.get_num_interop_threads(),
            **{k: os.environ[k] for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS") if k in os.environ}}


def run_tokenfab(args: argparse.Namespace, allocator: str = "tuned") -> tuple[dict, list, list, object]:
    """Our engine: warm up on fresh prompts, then time the measured set. Returns (result,
    measured prompts, warm-up prompts, the LLM)."""
    from tokenfab.engine.llm import LLM
    from tokenfab.engine.requests.sampling_params import SamplingParams

    tuned = apply_allocator(allocator)
    llm = LLM(args.model, dtype=args.dtype, device=args.device, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, quantization=args.quantization)
    vocab = llm.engine.vocab_size
    prompts = make_requests(args.num_requests, args.min_prompt_len, args.max_prompt_len, vocab, args.seed)
    warm = make_requests(args.warmup_requests, args.min_prompt_len, args.max_prompt_len, vocab,
                         args.seed + 1_000_003)
    if warm:
        llm.generate(warm, SamplingParams(temperature=0, max_tokens=args.warmup_tokens, ignore_eos=True))
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    eng = llm.engine
    settings = {"dtype": str(eng.dtype), "device": str(eng.device), "quantization": args.quantization or "default",
                "max_num_seqs": args.max_num_seqs,
                "max_num_batched_tokens": args.max_num_batched_tokens, "allocator_tuned": tuned,
                "warmup": f"{len(warm)} fresh prompts x {args.warmup_tokens} tokens", **_threads()}
    res = {"engine": "tokenfab", "allocator": allocator, "seconds": dt, "output_tokens": n_out,
           "load_1m": load_average(),
           "output_tok_s": n_out / dt, "total_tok_s": (n_out + sum(map(len, prompts))) / dt, "settings": settings}
    return res, prompts, warm, llm


def check_peer_dtype(model, dtype) -> list[str]:
    """The peer really computes in ``dtype``: every parameter is of it (transformers may keep some
    in float32) and no linear layer is a quantized module (a GGUF checkpoint could be loaded with
    packed weights and its own kernels). Raises otherwise; returns the parameter dtypes seen."""
    import torch

    seen = sorted({str(p.dtype) for p in model.parameters()})
    if seen != [str(dtype)]:
        raise RuntimeError(f"transformers loaded parameters of dtype {seen}, not the {dtype} our engine ran in")
    odd = sorted({type(m).__name__ for m in model.modules()
                  if "linear" in type(m).__name__.lower() and not isinstance(m, torch.nn.Linear)})
    if odd:
        raise RuntimeError(f"transformers loaded linear layers of another kind ({', '.join(odd)}): not a dense "
                           f"{dtype} model")
    return seen


def _hf_generate(hf, prompts: list[list[int]], batch_size: int, new_tokens: int, device) -> int:
    import torch

    pad, n_out = 0, 0
    order = sorted(prompts, key=len)  # each padded batch wastes little (the peer's best case)
    with torch.inference_mode():
        for i in range(0, len(order), batch_size):
            chunk = order[i : i + batch_size]
            width = max(map(len, chunk))
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device)
            out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)
            n_out += (out.shape[1] - width) * len(chunk)
    return n_out


def run_transformers(args: argparse.Namespace, prompts: list[list[int]], path, batch_size: int, device,
                     dtype, warm: list[list[int]] | None = None) -> dict:
    """transformers generate in the same dtype as our engine ran, warmed up on ``warm`` first."""
    import torch
    import transformers

    if path.suffix == ".gguf":
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    else:
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    hf = hf.to(device).eval()
    param_dtypes = check_peer_dtype(hf, dtype)
    if warm:
        _hf_generate(hf, warm, batch_size, args.warmup_tokens, device)
    t0 = time.perf_counter()
    n_out = _hf_generate(hf, prompts, batch_size, args.output_len, device)
    dt = time.perf_counter() - t0
    settings = {"transformers": transformers.__version__, "torch": torch.__version__, "param_dtypes": param_dtypes,
                "attn_implementation": getattr(hf.config, "_attn_implementation", None), "batch_size": batch_size,
                "batching": "padded batches, prompts sorted by length, left padding",
                "decoding": "greedy, min_new_tokens = max_new_tokens", "device": str(device),
                "warmup": f"{len(warm or [])} fresh prompts x {args.warmup_tokens} tokens", **_threads()}
    return {"engine": f"transformers (batch {batch_size})", "seconds": dt, "output_tokens": n_out,
            "load_1m": load_average(),
            "output_tok_s": n_out / dt, "total_tok_s": (n_out + sum(map(len, prompts))) / dt, "settings": settings}


def tokenfab_run(args: argparse.Namespace, allocator: str = "tuned") -> tuple[dict, list, list, dict]:
    """run_tokenfab, keeping only what can leave the process: (result, prompts, warm-up prompts, engine facts)."""
    ours, prompts, warm, llm = run_tokenfab(args, allocator)
    ours["pid"] = os.getpid()
    engine = llm.engine
    facts = {"device": str(engine.device), "model": engine.model_name, "dtype": str(engine.dtype)}
    return ours, prompts, warm, facts


def transformers_run(args: argparse.Namespace, prompts: list[list[int]], path, batch_size: int, device: str,
                     dtype: str, warm: list[list[int]] | None = None, allocator: str = "tuned") -> dict:
    import torch

    tuned = apply_allocator(allocator)
    res = run_transformers(args, prompts, path, batch_size, torch.device(device),
                           getattr(torch, dtype.removeprefix("torch.")), warm)
    res["allocator"] = allocator
    res["settings"]["allocator_tuned"] = tuned
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


def summarize(rounds: list[dict]) -> dict:
    """Per-round ratios, their median, and the conservative figures (worst round; our median
    against the peer's best single run)."""
    ratios = [r["ratio"] for r in rounds if r["ratio"] is not None]
    if not ratios:
        return {"ratios": [], "ratio_median": None, "ratio_min": None, "ratio_vs_peer_best_run": None}
    ours = [r["results"][0]["output_tok_s"] for r in rounds]
    peer_best = max(x["output_tok_s"] for r in rounds for x in r["results"][1:])
    vs_best = statistics.median(ours) / peer_best
    return {"ratios": ratios, "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
            "ratio_vs_peer_best_run": vs_best, "conservative_ratio": min(min(ratios), vs_best)}


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tokenfab.loader.bundled import bundled_model_path

    path = Path(args.model) if args.model else bundled_model_path()
    hf_sizes = peer_batch_sizes(args.hf_batch_sizes, args.num_requests)
    settings = list(ALLOCATOR_SETTINGS) if args.allocator == "both" else [args.allocator]
    if args.same_process and args.allocator == "both":  # glibc tuning cannot be undone in a process
        raise SystemExit("--allocator both needs a fresh process per run (drop --same-process)")
    call = in_this_process if args.same_process else in_fresh_process
    commit, dirty = git_commit(), git_dirty()  # at the start: what the runs import (HEAD may move meanwhile)
    rounds = []
    for _ in range(max(args.repeats, 1)):
        for alloc in settings:
            ours, prompts, warm, facts = call(tokenfab_run, args, alloc)
            device, model_name, dtype = facts["device"], facts["model"], facts["dtype"]
            peers = [call(transformers_run, args, prompts, path, bs, device, dtype, warm, alloc) for bs in hf_sizes]
            best = max(peers, key=lambda r: r["output_tok_s"]) if peers else None
            ratio = ours["output_tok_s"] / best["output_tok_s"] if best else None
            rounds.append({"allocator": alloc, "results": [ours, *peers], "best_peer": best["engine"] if best else None,
                           "ratio": ratio})
    where = "all in this process" if args.same_process else "each engine run in a fresh process"
    mach = machine()
    out = [f"model {model_name} ({dtype}) on {device} ({mach.get('cpu') or mach.get('gpu') or mach['platform']}, "
           f"{mach['cpus']} CPUs), commit {commit}; {args.num_requests} requests, prompts "
           f"{args.min_prompt_len}-{args.max_prompt_len} tokens, {args.output_len} output tokens each; {where}; "
           f"warm-up {args.warmup_requests} fresh prompts x {args.warmup_tokens} tokens each side", ""]
    if mach.get("env"):
        out[-1:-1] = ["", "Environment (every engine of the run inherits it): "
                      + ", ".join(f"{k}={v}" for k, v in sorted(mach["env"].items()))]
    rows = [[i + 1, rnd["allocator"], r["engine"], r["settings"].get("torch_threads"), r["output_tokens"],
             r["seconds"], r["output_tok_s"], r["total_tok_s"], r.get("load_1m")]
            for i, rnd in enumerate(rounds) for r in rnd["results"]]
    out.append(markdown_table(["round", "allocator", "engine", "threads", "output tokens", "seconds", "output tok/s",
                               "total tok/s", "load (1 min)"], rows))
    summary = {alloc: summarize([r for r in rounds if r["allocator"] == alloc]) for alloc in settings}
    for alloc, s in summary.items():
        if s["ratio_median"] is not None:
            each = ", ".join(f"{x:.2f}x" for x in s["ratios"])
            out += ["", f"allocator {alloc}: tokenfab / best transformers, output tok/s: median "
                    f"{s['ratio_median']:.2f}x, worst round {s['ratio_min']:.2f}x, our median vs the peer's best run "
                    f"{s['ratio_vs_peer_best_run']:.2f}x (rounds: {each})"]
    first = rounds[0]["results"]
    out += ["", "Settings (first run of each engine):", ""]
    out += [f"- {r['engine']}: " + ", ".join(f"{k}={v}" for k, v in r["settings"].items()) for r in first]
    text = "\n".join(out)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    main = summary[settings[0]]
    write_json(args.json, {
        "benchmark": "throughput", "machine": mach, "commit": commit, "uncommitted_changes": dirty,
        "model": model_name,
        "dtype": dtype, "device": str(device),
        "isolation": "one process for everything" if args.same_process else "a fresh process per engine run",
        "workload": {"num_requests": args.num_requests, "prompt_len": [args.min_prompt_len, args.max_prompt_len],
                     "output_len": args.output_len, "max_num_batched_tokens": args.max_num_batched_tokens,
                     "warmup_requests": args.warmup_requests, "warmup_tokens": args.warmup_tokens,
                     "peer_batch_sizes": hf_sizes, "allocator": args.allocator},
        "rounds": rounds, "summary": summary, "ratios": main["ratios"], "ratio_vs_best_peer": main["ratio_median"],
        "conservative_ratio": main.get("conservative_ratio"),
    })
    return 0
