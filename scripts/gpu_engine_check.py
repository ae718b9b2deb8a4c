"""Engine correctness on tiny random models: tokenfab (CUDA graphs, eager) vs transformers, greedy.

The first section of ``scripts/gpu_check.sh`` (ARCHITECTURE.md, "The GPU check"): before any
speed is measured, the engine must produce transformers' tokens. Tiny random-weight models are
built on the spot from transformers config classes (a Llama, and a Qwen3-MoE with a dense layer
between MoE layers and 2 of 8 experts per token), saved as safetensors, and every prompt is
generated greedily by

* transformers on the same device and dtype, one prompt at a time (no padding): the reference;
* tokenfab with CUDA graphs (CUDA only) and eager, all prompts in one batch (ragged lengths that
  cross block boundaries, so decode batches are padded to a captured graph size).
* ``--modes async``: tokenfab with overlap scheduling (``async_scheduling=True``; over CUDA graphs
  on CUDA, eager on CPU): the same tokens are expected.

A sequence passes when its tokens equal the reference's, or when they first differ at a near
tie: the reference's logit for our token is within a dtype tolerance of its own choice (bf16
rounding can legitimately flip a near tie; what follows then is a different continuation, so
comparison stops there). Anything else is a mismatch and fails the check.

    python scripts/gpu_engine_check.py --json out.json --markdown out.md            # GPU: bf16 + fp32
    python scripts/gpu_engine_check.py --device cpu --dtypes float32 --modes eager  # the CPU part

Exit status 0 when every row passes, 1 when one fails, 2 on a usage error. Results are written
after each row, so a run killed by its time limit still reports what it finished.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

COMMON = dict(vocab_size=512, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
              max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=False)
MODELS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(num_hidden_layers=2, intermediate_size=256)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_hidden_layers=3, intermediate_size=256, moe_intermediate_size=64, num_experts=8,
                       num_experts_per_tok=2, mlp_only_layers=[1], norm_topk_prob=True)),
}
# prompt lengths: one token, inside a block, a block boundary (16), across blocks
PROMPT_LENS = (1, 7, 16, 33, 70)
# a divergence is a near tie when ref_logit[ref_token] - ref_logit[our_token] <= abs + rel * |ref top logit|
# (bf16: both sides round every activation to 8 bits of mantissa, in different places)
TIE_TOL = {"float32": (1e-4, 1e-4), "bfloat16": (0.1, 0.03)}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build_model(name: str, out: Path, seed: int = 0) -> Path:
    """A tiny random-weight transformers model saved as safetensors (fp32) in ``out``."""
    import transformers

    cfg_cls, arch, extra = MODELS[name]
    config = getattr(transformers, cfg_cls)(**COMMON, **extra)
    config.architectures = [arch]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():  # larger than the default init: logits far from uniform
            p.normal_(0, 0.2)
    model.save_pretrained(out, safe_serialization=True)
    return out


def make_prompts(vocab: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


class Reference:
    """transformers on ``device`` in ``dtype``: greedy continuations and next-token logits."""

    def __init__(self, path: Path, dtype: torch.dtype, device: torch.device) -> None:
        import transformers

        self.device = device
        self.model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()

    @torch.inference_mode()
    def generate(self, prompt: list[int], n: int) -> list[int]:
        ids = torch.tensor([prompt], device=self.device)
        out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                  min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
        return out[0, len(prompt):].tolist()

    @torch.inference_mode()
    def next_logits(self, ids: list[int]) -> torch.Tensor:
        return self.model(torch.tensor([ids], device=self.device)).logits[0, -1].float().cpu()

    def close(self) -> None:
        del self.model


def compare(ref: Reference, prompt: list[int], expected: list[int], ours: list[int], dtype: str) -> dict[str, Any]:
    """exact / near_tie (first divergence within tolerance) / mismatch, with the divergence step."""
    if ours == expected:
        return {"result": "exact"}
    n = min(len(ours), len(expected))
    i = next((j for j in range(n) if ours[j] != expected[j]), n)
    if i == n:  # one is a prefix of the other: a length bug, never a tie
        return {"result": "mismatch", "step": i, "why": f"{len(ours)} tokens, reference {len(expected)}"}
    logits = ref.next_logits(prompt + expected[:i])
    top = float(logits[expected[i]])
    gap = top - float(logits[ours[i]])
    tol_abs, tol_rel = TIE_TOL[dtype]
    tol = tol_abs + tol_rel * abs(top)
    rank = int((logits > logits[ours[i]]).sum())
    return {"result": "near_tie" if gap <= tol else "mismatch", "step": i, "ours": ours[i], "reference": expected[i],
            "logit_gap": round(gap, 6), "tolerance": round(tol, 6), "our_token_rank": rank}


def run_tokenfab(path: Path, prompts: list[list[int]], n: int, dtype: str, device: str, eager: bool,
                 async_scheduling: bool = False) -> list[list[int]]:
    from tokenfab.engine.llm import LLM
    from tokenfab.engine.requests.sampling_params import SamplingParams

    llm = LLM(str(path), dtype=dtype, device=device, enforce_eager=eager, num_kv_blocks=256, max_num_seqs=16,
              max_model_len=512, cpu_weight_packing=False, async_scheduling=async_scheduling)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _write(report: dict[str, Any], json_path: str | None, md_path: str | None) -> None:
    rows = report["rows"]
    report["pass"] = bool(rows) and all(r["verdict"] == "pass" for r in rows)
    if json_path:
        tmp = Path(json_path + ".tmp")
        tmp.write_text(json.dumps(report, indent=1))
        os.replace(tmp, json_path)
    if md_path:
        lines = [f"Engine correctness on {report['device']} (tiny random models, greedy, {report['new_tokens']} new "
                 f"tokens, prompts of {list(PROMPT_LENS)} tokens in one batch; reference: transformers):", "",
                 "| model | dtype | tokenfab | verdict | exact | near ties | mismatches | seconds |",
                 "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in rows:
            c = r.get("counts", {})
            lines.append(f"| {r['model']} | {r['dtype']} | {r['mode']} | {r['verdict'].upper()} "
                         f"| {c.get('exact', '-')} | {c.get('near_tie', '-')} | {c.get('mismatch', '-')} "
                         f"| {r.get('seconds', '-')} |")
            if r.get("error"):
                lines.append(f"|  | | error: {r['error'][:300]} | | | | | |")
        for g in report["graphs_vs_eager"]:
            lines.append(f"\nCUDA graphs vs eager, {g['model']} {g['dtype']}: {g['identical']} of {g['sequences']} "
                         "sequences identical")
        Path(md_path).write_text("\n".join(lines) + "\n")


def check_model(report: dict[str, Any], name: str, path: Path, prompts: list[list[int]], dtype: str,
                modes: list[str], device: torch.device, args: argparse.Namespace) -> None:
    """One model in one dtype: the reference's tokens, then one row per tokenfab mode (written at once)."""
    t0 = time.perf_counter()
    try:
        ref = Reference(path, DTYPES[dtype], device)
        expected = [ref.generate(pr, args.new_tokens) for pr in prompts]
    except Exception as e:  # the reference itself failed: say so, and let the other rows run
        report["rows"].append({"model": name, "dtype": dtype, "mode": "reference", "verdict": "fail",
                               "error": f"transformers: {type(e).__name__}: {e}"})
        _write(report, args.json, args.markdown)
        return
    ref_s = round(time.perf_counter() - t0, 1)
    ours_by_mode: dict[str, list[list[int]]] = {}
    for mode in modes:
        row: dict[str, Any] = {"model": name, "dtype": dtype, "mode": mode, "reference_seconds": ref_s}
        t0 = time.perf_counter()
        try:
            # "async": overlap scheduling, over CUDA graphs on CUDA (eager on CPU)
            ours = run_tokenfab(path, prompts, args.new_tokens, dtype, str(device),
                                eager=mode == "eager" or (mode == "async" and device.type != "cuda"),
                                async_scheduling=mode == "async")
            ours_by_mode[mode] = ours
            seqs = [compare(ref, pr, e, o, dtype) for pr, e, o in zip(prompts, expected, ours)]
            counts = {k: sum(s["result"] == k for s in seqs) for k in ("exact", "near_tie", "mismatch")}
            row.update(sequences=seqs, counts=counts, verdict="pass" if not counts["mismatch"] else "fail")
        except Exception as e:  # a crash is a failed row, and the other rows still run
            row.update(verdict="fail", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-3000:])
        row["seconds"] = round(time.perf_counter() - t0, 1)
        report["rows"].append(row)
        what = row.get("counts", row.get("error"))
        print(f"[engine_check] {name} {dtype} {mode}: {row['verdict']} {what} ({row['seconds']} s)", flush=True)
        _write(report, args.json, args.markdown)
    if "graphs" in ours_by_mode and "eager" in ours_by_mode:
        same = sum(a == b for a, b in zip(ours_by_mode["graphs"], ours_by_mode["eager"]))
        report["graphs_vs_eager"].append({"model": name, "dtype": dtype, "identical": same, "sequences": len(prompts)})
        _write(report, args.json, args.markdown)
    ref.close()
    gc.collect()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--dtypes", nargs="+", default=None, choices=sorted(DTYPES),
                   help="default: bfloat16 float32 on CUDA, float32 on CPU")
    p.add_argument("--modes", nargs="+", default=None, choices=["graphs", "eager", "async"],
                   help="default: graphs eager on CUDA, eager on CPU (no CUDA graphs there)")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)
    args = p.parse_args(argv)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    dtypes = args.dtypes or (["bfloat16", "float32"] if device.type == "cuda" else ["float32"])
    modes = args.modes or (["graphs", "eager"] if device.type == "cuda" else ["eager"])
    if device.type != "cuda" and "graphs" in modes:
        p.error("CUDA graphs need --device cuda")
    report: dict[str, Any] = {"kind": "engine_check", "device": str(device), "torch": torch.__version__,
                              "gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else None,
                              "new_tokens": args.new_tokens, "prompt_lens": list(PROMPT_LENS), "rows": [],
                              "graphs_vs_eager": []}
    with tempfile.TemporaryDirectory() as tmp:
        paths = {name: build_model(name, Path(tmp) / name) for name in args.models}
        prompts = make_prompts(COMMON["vocab_size"])
        for dtype in dtypes:  # the first dtype (bf16 on CUDA) for every model before the next
            for name, path in paths.items():
                check_model(report, name, path, prompts, dtype, modes, device, args)
    _write(report, args.json, args.markdown)
    print(f"[engine_check] {'PASS' if report['pass'] else 'FAIL'}", flush=True)
    return 0 if report["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
