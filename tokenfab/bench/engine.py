"""`tokenfab bench engine`: end-to-end engine speed on a random-weight model of a real
model's shape, built on the spot from a transformers config (no download needed; random
weights cost exactly what real ones do when generation ignores EOS).

Measures, in one run: batch-1 decode tokens/s and the output tokens/s of N requests of
``--input-len`` in / ``--output-len`` out, for tokenfab with CUDA graphs, tokenfab eager,
and transformers ``generate`` (the peer), and reports the ratios.
"""

from __future__ import annotations

import argparse
import gc
import json
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
    p.add_argument("--hf-batch-size", type=int, default=64)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
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


def _tokenfab(path: Path, args, prompts, eager: bool) -> dict:
    from tokenfab.engine.llm import LLM
    from tokenfab.engine.sampling_params import SamplingParams

    t0 = time.perf_counter()
    llm = LLM(str(path), dtype=args.dtype, device=args.device, enforce_eager=eager,
              max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=max(args.num_requests, 1))
    load_s = time.perf_counter() - t0
    one = SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True)
    llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # warm-up
    t0 = time.perf_counter()
    llm.generate([prompts[0]], one)
    b1 = args.decode_tokens / (time.perf_counter() - t0)
    many = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    _sync()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, many)
    _sync()
    dt = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    res = {"engine": "tokenfab" + (" eager" if eager else " + CUDA graphs"), "load_s": load_s,
           "batch1_decode_tok_s": b1, "output_tok_s": n / dt, "seconds": dt, "output_tokens": n,
           "device": str(llm.engine.device), "dtype": str(llm.engine.dtype)}
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


def _transformers(path: Path, args, prompts, device, dtype) -> dict:
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()
    with torch.inference_mode():
        ids = torch.tensor([prompts[0]], device=device)
        hf.generate(input_ids=ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
        _sync()
        t0 = time.perf_counter()
        hf.generate(input_ids=ids, max_new_tokens=args.decode_tokens, min_new_tokens=args.decode_tokens,
                    do_sample=False)
        _sync()
        b1 = args.decode_tokens / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        n = 0
        for i in range(0, len(prompts), args.hf_batch_size):
            chunk = torch.tensor(prompts[i : i + args.hf_batch_size], device=device)  # equal lengths: no padding
            out = hf.generate(input_ids=chunk, max_new_tokens=args.output_len, min_new_tokens=args.output_len,
                              do_sample=False)
            n += (out.shape[1] - chunk.shape[1]) * chunk.shape[0]
        _sync()
        dt = time.perf_counter() - t0
    del hf
    gc.collect()
    _empty()
    return {"engine": f"transformers (batch {args.hf_batch_size})", "batch1_decode_tok_s": b1,
            "output_tok_s": n / dt, "seconds": dt, "output_tokens": n}


def run(args: argparse.Namespace) -> int:
    import torch

    from tokenfab.engine.llm_engine import resolve_device, resolve_dtype

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    rng = random.Random(0)
    vocab = SHAPES[args.shape]["vocab_size"]
    prompts = [[rng.randrange(100, vocab) for _ in range(args.input_len)] for _ in range(args.num_requests)]
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model_dir(args.shape, dtype, Path(tmp) / args.shape)
        results: list[dict] = []

        def keep(r: dict) -> None:  # save after each engine, so a time limit loses only the rest
            results.append(r)
            write_json(args.json, {"benchmark": "engine", "partial": True, "shape": args.shape, "results": results})

        if device.type == "cuda":
            keep(_tokenfab(path, args, prompts, eager=False))
        keep(_tokenfab(path, args, prompts, eager=True))
        if not args.skip_hf:
            keep(_transformers(path, args, prompts, device, dtype))
    ours = results[0]
    peer = results[-1] if not args.skip_hf else None
    ratios = {}
    if peer:
        ratios = {"batch1_decode": ours["batch1_decode_tok_s"] / peer["batch1_decode_tok_s"],
                  "throughput": ours["output_tok_s"] / peer["output_tok_s"]}
    rows = [[r["engine"], r["batch1_decode_tok_s"], r["output_tok_s"], r["seconds"]] for r in results]
    table = markdown_table(["engine", "batch-1 decode tok/s", f"{args.num_requests} req output tok/s", "seconds"], rows)
    where = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    head = (f"shape {args.shape}, {dtype} on {device} ({where}); "
            f"{args.num_requests} requests x {args.input_len} in / {args.output_len} out; commit {git_commit()}")
    text = head + "\n\n" + table
    if ratios:
        text += "\n\nratio vs transformers: " + json.dumps({k: round(v, 2) for k, v in ratios.items()})
    print(text)
    report = {"benchmark": "engine", "shape": args.shape, "machine": machine(), "commit": git_commit(),
              "dtype": str(dtype), "device": str(device),
              "workload": {"num_requests": args.num_requests, "input_len": args.input_len,
                           "output_len": args.output_len, "decode_tokens": args.decode_tokens},
              "results": results, "ratios_vs_transformers": ratios}
    write_json(args.json, report)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    return 0
