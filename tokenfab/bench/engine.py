"""`tokenfab bench engine`: end-to-end engine speed on a random-weight model of a real
model's shape, built on the spot from a transformers config (no download needed; random
weights cost exactly what real ones do when generation ignores EOS).

Measures, in one run: batch-1 decode tokens/s and the output tokens/s of N requests of
``--input-len`` in / ``--output-len`` out, for tokenfab with CUDA graphs, tokenfab eager,
and transformers ``generate`` (the peer) at each batch size of ``--hf-batch-sizes``, and reports
the ratios against the peer's best batch size. Each engine runs in a fresh spawned process (fresh
device memory, nothing inherited; ``--same-process`` frees each one instead) and warms up on
prompts that are never measured (so no prefix cache holds a measured prompt).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import tempfile
import time
from pathlib import Path

from tokenfab.bench.common import git_commit, machine, markdown_table, write_json

SHAPES = {
    # Qwen3-0.6B
    "qwen3-0.6b": dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       max_position_embeddings=40960, rope_theta=1_000_000.0, tie_word_embeddings=True,
                       rms_norm_eps=1e-6),
    # Llama-3.1-8B
    "llama-3.1-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=False,
                         rms_norm_eps=1e-5),
    # a small shape for trying the command on CPU
    "tiny": dict(model_type="llama", vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True,
                 rms_norm_eps=1e-5),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--decode-tokens", type=int, default=256, help="tokens generated in the batch-1 test")
    p.add_argument("--hf-batch-sizes", default="16,64,all",
                   help="the peer's batch sizes, comma list ('all': every request at once); the best is the peer")
    p.add_argument("--hf-batch-size", type=int, default=None, help="one peer batch size (overrides --hf-batch-sizes)")
    p.add_argument("--warmup-requests", type=int, default=64,
                   help="fresh prompts (never measured) each engine generates 8 tokens for before timing")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--same-process", action="store_true",
                   help="run every engine in this process (freeing the previous one) instead of a fresh process each")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--async-scheduling", action="store_true",
                   help="also run tokenfab with overlap scheduling (extra rows: on vs off, same workload)")
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)


def build_model_dir(shape: str, dtype, out: Path) -> Path:
    import torch
    import transformers

    cfg = dict(SHAPES[shape])
    model_type = cfg.pop("model_type")
    config = transformers.AutoConfig.for_model(model_type, **cfg)
    config.architectures = [{"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}[model_type]]
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(out)
    del model
    return out


WARMUP_TOKENS = 8


def _tokenfab(path: Path, args, work: dict, eager: bool, async_scheduling: bool = False) -> dict:
    from tokenfab.engine.llm import LLM
    from tokenfab.engine.requests.sampling_params import SamplingParams

    t0 = time.perf_counter()
    llm = LLM(str(path), dtype=args.dtype, device=args.device, enforce_eager=eager,
              max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=max(args.num_requests, 1),
              async_scheduling=async_scheduling)
    load_s = time.perf_counter() - t0
    warm = SamplingParams(temperature=0, max_tokens=WARMUP_TOKENS, ignore_eos=True)
    llm.generate(work["warm"], warm)  # fresh prompts: nothing measured is in the prefix cache
    one = SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True)
    _sync()
    t0 = time.perf_counter()
    llm.generate([work["batch1"]], one)
    _sync()
    b1 = args.decode_tokens / (time.perf_counter() - t0)
    many = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    _sync()
    t0 = time.perf_counter()
    outs = llm.generate(work["prompts"], many)
    _sync()
    dt = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    name = "tokenfab" + (" eager" if eager else " + CUDA graphs") + (" + async scheduling" if async_scheduling else "")
    res = {"engine": name, "load_s": load_s,
           "batch1_decode_tok_s": b1, "output_tok_s": n / dt, "seconds": dt, "output_tokens": n,
           "device": str(llm.engine.device), "dtype": str(llm.engine.dtype), "pid": os.getpid(),
           "settings": {"max_num_batched_tokens": args.max_num_batched_tokens, "enforce_eager": eager,
                        "async_scheduling": async_scheduling,
                        "warmup": f"{len(work['warm'])} fresh prompts x {WARMUP_TOKENS} tokens"}}
    del llm, outs
    gc.collect()
    _empty()
    return res


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _empty() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _hf_batches(hf, prompts: list[list[int]], batch_size: int, new_tokens: int, device) -> int:
    import torch

    n = 0
    for i in range(0, len(prompts), batch_size):
        chunk = torch.tensor(prompts[i : i + batch_size], device=device)  # equal lengths: no padding
        out = hf.generate(input_ids=chunk, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        n += (out.shape[1] - chunk.shape[1]) * chunk.shape[0]
    return n


def _transformers(path: Path, args, work: dict, device: str, dtype: str, batch_size: int, batch1: bool) -> dict:
    """transformers generate at one batch size, warmed up at that size on the fresh prompts; the
    batch-1 decode test only where ``batch1`` (it does not depend on the batch size)."""
    import torch
    import transformers

    from tokenfab.bench.throughput import check_peer_dtype

    tdtype = getattr(torch, dtype.removeprefix("torch."))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=tdtype).to(device).eval()
    param_dtypes = check_peer_dtype(hf, tdtype)
    b1 = None
    with torch.inference_mode():
        _hf_batches(hf, work["warm"], batch_size, WARMUP_TOKENS, device)
        if batch1:
            ids = torch.tensor([work["batch1"]], device=device)
            hf.generate(input_ids=ids, max_new_tokens=WARMUP_TOKENS, min_new_tokens=WARMUP_TOKENS, do_sample=False)
            _sync()
            t0 = time.perf_counter()
            hf.generate(input_ids=ids, max_new_tokens=args.decode_tokens, min_new_tokens=args.decode_tokens,
                        do_sample=False)
            _sync()
            b1 = args.decode_tokens / (time.perf_counter() - t0)
        _sync()
        t0 = time.perf_counter()
        n = _hf_batches(hf, work["prompts"], batch_size, args.output_len, device)
        _sync()
        dt = time.perf_counter() - t0
    settings = {"transformers": transformers.__version__, "param_dtypes": param_dtypes, "batch_size": batch_size,
                "attn_implementation": getattr(hf.config, "_attn_implementation", None),
                "warmup": f"{len(work['warm'])} fresh prompts x {WARMUP_TOKENS} tokens at batch {batch_size}"}
    del hf
    gc.collect()
    _empty()
    return {"engine": f"transformers (batch {batch_size})", "batch1_decode_tok_s": b1, "output_tok_s": n / dt,
            "seconds": dt, "output_tokens": n, "pid": os.getpid(), "settings": settings}


def run(args: argparse.Namespace) -> int:
    import torch

    from tokenfab.bench.throughput import in_fresh_process, in_this_process, peer_batch_sizes
    from tokenfab.engine.llm_engine import resolve_device, resolve_dtype

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    vocab = SHAPES[args.shape]["vocab_size"]

    def fresh(n: int, seed: int) -> list[list[int]]:
        rng = random.Random(seed)
        return [[rng.randrange(100, vocab) for _ in range(args.input_len)] for _ in range(n)]

    work = {"prompts": fresh(args.num_requests, 0), "warm": fresh(args.warmup_requests, 1),
            "batch1": fresh(1, 2)[0]}
    sizes = [] if args.skip_hf else (
        [min(args.hf_batch_size, args.num_requests)] if args.hf_batch_size
        else peer_batch_sizes(args.hf_batch_sizes, args.num_requests))
    call = in_this_process if args.same_process else in_fresh_process
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model_dir(args.shape, dtype, Path(tmp) / args.shape)
        results: list[dict] = []

        def keep(r: dict) -> None:  # save after each engine, so a time limit loses only the rest
            results.append(r)
            write_json(args.json, {"benchmark": "engine", "partial": True, "shape": args.shape, "results": results})

        if device.type == "cuda":
            keep(call(_tokenfab, path, args, work, False))
        keep(call(_tokenfab, path, args, work, True))
        if getattr(args, "async_scheduling", False):  # the same engine with overlap scheduling
            keep(call(_tokenfab, path, args, work, device.type != "cuda", True))
        num_ours = len(results)
        for i, bs in enumerate(sizes):
            keep(call(_transformers, path, args, work, str(device), str(dtype), bs, i == 0))
    ours = results[0]
    peers = results[num_ours:]
    ratios = {}
    if peers:
        best = max(peers, key=lambda r: r["output_tok_s"])
        ratios = {"batch1_decode": ours["batch1_decode_tok_s"] / peers[0]["batch1_decode_tok_s"],
                  "throughput": ours["output_tok_s"] / best["output_tok_s"], "best_peer": best["engine"]}
    rows = [[r["engine"], r["batch1_decode_tok_s"] if r["batch1_decode_tok_s"] is not None else "-",
             r["output_tok_s"], r["seconds"]] for r in results]
    table = markdown_table(["engine", "batch-1 decode tok/s", f"{args.num_requests} req output tok/s", "seconds"], rows)
    where = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    isolation = "all in one process" if args.same_process else "each engine in a fresh process"
    head = (f"shape {args.shape}, {dtype} on {device} ({where}); "
            f"{args.num_requests} requests x {args.input_len} in / {args.output_len} out; {isolation}; "
            f"warm-up on {args.warmup_requests} fresh prompts each; commit {git_commit()}")
    text = head + "\n\n" + table
    if ratios:
        text += "\n\nratio vs transformers (throughput: vs its best batch size): " + json.dumps(
            {k: round(v, 2) if isinstance(v, float) else v for k, v in ratios.items()})
    print(text)
    report = {"benchmark": "engine", "shape": args.shape, "machine": machine(), "commit": git_commit(),
              "dtype": str(dtype), "device": str(device), "isolation": isolation,
              "workload": {"num_requests": args.num_requests, "input_len": args.input_len,
                           "output_len": args.output_len, "decode_tokens": args.decode_tokens,
                           "warmup_requests": args.warmup_requests, "peer_batch_sizes": sizes},
              "results": results, "ratios_vs_transformers": ratios}
    write_json(args.json, report)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    return 0
