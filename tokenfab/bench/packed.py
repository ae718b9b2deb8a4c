"""Packed GGUF weights on CPU (issue 14 part 4): offline single-stream TPOT per ``--quantization``
mode, and the int8-activation mode's drift from ``transformers`` float32.

    python -m tokenfab.bench.packed offline [--json F] [--markdown F]
    python -m tokenfab.bench.packed drift [--json F] [--markdown F]
    python -m tokenfab.bench.packed batches [--batches 1,4,16,64] [--json F] [--markdown F]

``offline``: for each mode (gguf, gguf-q8act, none) a fresh engine decodes one ~190-token prompt
alone, 64 tokens, greedy; TTFT is a 1-token run, TPOT = (time of 64 tokens - TTFT) / 63, the
median of ``--repeats`` runs (scripts/bench_cpu_packed.sh runs it; the serving side is
``tokenfab bench serve --llama-cpp``).

``batches``: for each mode, a fresh engine generates ``--output-len`` tokens (96 by default here)
for B prompts of 32 random token ids at each batch size B, twice; the better run's output tokens/s
is kept (issue 26: the default mode is never slower than another lossless mode at any batch size).

``drift``: transformers (float32, the same GGUF dequantized) generates 64 greedy tokens for each
test prompt of tests/models/test_bundled_vs_transformers.py; each mode then scores that same
sequence (teacher forcing) and we report top-1 agreement with transformers' logits at every
generated position, the largest logit difference, and whether free-running greedy output is
identical.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from tokenfab.bench.common import git_commit, git_dirty, load_average, machine
from tokenfab.bench.prompts import CHATS, TEXT_PROMPTS

MODES = ("gguf", "gguf-q8act", "none")
_WORDS = ("the model token server batch cache kernel stream request latency memory block prefix decode "
          "river mountain city ocean forest garden window morning evening story music paper science").split()


def _header() -> dict[str, Any]:
    return {"commit": git_commit(), "dirty": git_dirty(), "machine": machine(), "threads": torch.get_num_threads(),
            "load_average_start": load_average()}


def offline(repeats: int, output_len: int) -> dict[str, Any]:
    from tokenfab import LLM, SamplingParams

    prompt = " ".join(_WORDS[(i * 7) % len(_WORDS)] for i in range(128))
    rows = []
    for mode in MODES:
        llm = LLM(quantization=mode, max_num_batched_tokens=512, enable_prefix_caching=False)
        one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        full = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        llm.generate([prompt + " warm"], full)
        ttft, total = [], []
        for _ in range(repeats):
            t = time.perf_counter()
            llm.generate([prompt], one)
            ttft.append(time.perf_counter() - t)
            t = time.perf_counter()
            llm.generate([prompt], full)
            total.append(time.perf_counter() - t)
        t1, tn = statistics.median(ttft), statistics.median(total)
        tpot = (tn - t1) / (output_len - 1)
        rows.append({"quantization": mode, "prompt_tokens": len(llm.tokenizer.encode(prompt)),
                     "output_tokens": output_len, "ttft_ms": t1 * 1e3, "tpot_ms": tpot * 1e3,
                     "decode_tok_s": 1 / tpot, "weight_bytes_per_param": llm.engine.memory["weight_bytes_per_param"],
                     "load_average": load_average()})
        del llm
    return {**_header(), "benchmark": "offline single-stream decode", "rows": rows}


def batches(sizes: list[int], output_len: int) -> dict[str, Any]:
    from tokenfab import LLM, SamplingParams
    from tokenfab.bench.throughput import make_requests

    rows = []
    for mode in MODES:
        llm = LLM(quantization=mode, enable_prefix_caching=False)
        vocab = llm.engine.vocab_size
        llm.generate(make_requests(4, 32, 32, vocab, 99), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        row: dict[str, Any] = {"quantization": mode}
        for b in sizes:
            prompts = make_requests(b, 32, 32, vocab, b)
            best = 0.0
            for _ in range(2):
                t = time.perf_counter()
                llm.generate(prompts, params)
                best = max(best, b * output_len / (time.perf_counter() - t))
            row[f"B={b} tok/s"] = best
        row["load_average"] = load_average()
        rows.append(row)
        del llm
    return {**_header(), "benchmark": f"offline output tok/s by batch size (32-token prompts, {output_len} out)",
            "rows": rows}


def _hf_greedy(prompts: list[list[int]], n: int) -> tuple[Any, list[list[int]]]:
    import transformers

    from tokenfab.loader.bundled import bundled_model_path

    path = bundled_model_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    hf.eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            seq = list(ids)
            for _ in range(n):
                seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
            out.append(seq[len(ids):])
    return hf, out


def _our_logits(llm: Any, seq: list[int]) -> torch.Tensor:
    """Logits [len(seq), V] of every position of ``seq``, one prefill through a throwaway cache."""
    from tokenfab.engine.requests.sampling_params import SamplingParams
    from tokenfab.engine.requests.sequence import Sequence
    from tokenfab.engine.runner.model_runner import ModelRunner

    eng = llm.engine
    bs = eng.args.block_size
    runner = ModelRunner(eng.model, eng.device, eng.dtype, bs, -(-len(seq) // bs))
    s = Sequence("drift", None, list(seq), SamplingParams(max_tokens=1), 0)
    s.block_table = list(range(runner.num_blocks))
    with torch.inference_mode():
        hidden = eng.model(runner.prepare([s], [len(seq)], [True]))
        return eng.model.compute_logits(hidden)


def drift(new_tokens: int) -> dict[str, Any]:
    from tokenfab import LLM, SamplingParams

    probe = LLM(quantization="none")
    tok = probe.tokenizer
    prompts = [tok.encode(p) for p in TEXT_PROMPTS] + [probe.apply_chat_template(c) for c in CHATS]
    del probe
    hf, hf_tokens = _hf_greedy(prompts, new_tokens)
    rows = []
    for mode in MODES:
        llm = LLM(quantization=mode, max_num_batched_tokens=1024, enable_prefix_caching=False)
        free = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
        agree = total = identical = 0
        max_diff = 0.0
        for ids, gen, out in zip(prompts, hf_tokens, free):
            seq = ids + gen
            with torch.no_grad():
                ref = hf(torch.tensor([seq])).logits[0, len(ids) - 1 : len(seq) - 1].float()
            ours = _our_logits(llm, seq)[len(ids) - 1 : len(seq) - 1]
            agree += int((ours.argmax(-1) == ref.argmax(-1)).sum())
            total += len(gen)
            max_diff = max(max_diff, float((ours - ref).abs().max()))
            identical += int(list(out.outputs[0].token_ids) == gen)
        rows.append({"quantization": mode, "positions": total, "top1_agreement": agree / total,
                     "max_abs_logit_diff": max_diff, "greedy_identical_prompts": f"{identical}/{len(prompts)}"})
        del llm
    return {**_header(), "benchmark": "drift from transformers float32 (teacher-forced on its greedy output)",
            "new_tokens": new_tokens, "rows": rows}


def _markdown(res: dict[str, Any]) -> str:
    rows = res["rows"]
    cols = list(rows[0])
    lines = [f"{res['benchmark']} · bundled SmolLM2-135M-Instruct (Q4_1 GGUF) · commit {res['commit']}"
             f"{' (dirty)' if res['dirty'] else ''} · {res['machine']} · {res['threads']} threads · "
             f"load average at start {res['load_average_start']}", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in r.values()) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tokenfab.bench.packed", description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["offline", "drift", "batches"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--output-len", type=int, default=None, help="tokens per request (64; batches: 96)")
    p.add_argument("--batches", default="1,4,16,64", help="batch sizes of `batches`")
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)
    a = p.parse_args(argv)
    if a.what == "batches":
        res = batches([int(b) for b in a.batches.split(",")], a.output_len or 96)
    else:
        res = offline(a.repeats, a.output_len or 64) if a.what == "offline" else drift(a.output_len or 64)
    md = _markdown(res)
    print(md)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(md)


if __name__ == "__main__":
    main()
