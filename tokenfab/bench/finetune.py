"""`tokenfab bench finetune`: LoRA training tokens/s, our trainer vs `transformers` + `peft`, in one run.

Workload: ``--batch-size`` samples per optimizer step, lengths uniform in ``[--min-len, --seq-len]`` (random token
ids; the first third of each sample is prompt without loss), the same samples in the same order for both sides
(drawn by our trainer's own data order). Both sides: the same base weights (loaded once), LoRA with the same r,
alpha and target modules, AdamW with the same learning rate, clipping at 1.0, fp32 on CPU (bf16 autocast on CUDA
for ours only when the trainer does so).
- ours: ``tokenfab.train.Trainer``'s optimizer step (packed rows, attention kept inside each sample, our kernels
  patched in with ``--kernels``, fused linear cross-entropy: no full logits);
- peer: a ``peft``-wrapped ``transformers`` model on the same samples padded to the longest in the batch
  (the usual ``DataCollatorForSeq2Seq`` shape), ``model(..., labels=...)`` loss.

Both run ``--warmup-steps`` untimed steps first; then ``--repeats`` rounds of ``--steps`` timed steps each, the
sides interleaved (ours, peer, ours, peer: these machines drift). Tokens/s counts real tokens (padding excluded).
Step 0's losses are equal when both do the same computation (B starts at zero), which the report shows.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from typing import Any

from tokenfab.bench.common import git_commit, git_dirty, load_average, machine, markdown_table, write_json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF directory or .gguf (default: the bundled model)")
    p.add_argument("--batch-size", type=int, default=8, help="samples per optimizer step")
    p.add_argument("--seq-len", type=int, default=256, help="longest sample, in tokens")
    p.add_argument("--min-len", type=int, default=None, help="shortest sample (default: seq-len / 2)")
    p.add_argument("--max-tokens", type=int, default=2048, help="our packed row length (the trainer's default)")
    p.add_argument("--steps", type=int, default=4, help="timed steps per side per round")
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2, help="rounds, the two sides interleaved")
    p.add_argument("--lora-r", type=int, default=8)
    p.add_argument("--lora-alpha", type=float, default=8.0)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--no-kernels", action="store_true", help="our trainer without the patched kernels")
    p.add_argument("--no-peer", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
    p.add_argument("--output-md", default=None)


def synthetic_examples(n: int, vocab: int, min_len: int, max_len: int, seed: int) -> list[tuple[list, list]]:
    """``n`` (input_ids, labels) samples: random ids, the first third without loss."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        ids = torch.randint(0, vocab, (length,), generator=g).tolist()
        out.append((ids, [-100] * (length // 3) + ids[length // 3:]))
    return out


class PeerStep:
    """One optimizer step of transformers + peft on padded batches."""

    def __init__(self, base: Any, targets: list[str], r: int, alpha: float, lr: float, pad_id: int) -> None:
        import peft
        import torch

        cfg = peft.LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=targets, bias="none",
                              task_type="CAUSAL_LM")
        self.model = peft.get_peft_model(base, cfg)
        self.model.train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=lr, weight_decay=0.0)
        self.pad_id = pad_id

    def __call__(self, examples: list[tuple[list, list]]) -> tuple[float, int]:
        import torch

        width = max(len(ids) for ids, _ in examples)
        ids = torch.full((len(examples), width), self.pad_id, dtype=torch.long)
        labels = torch.full((len(examples), width), -100, dtype=torch.long)
        mask = torch.zeros((len(examples), width), dtype=torch.long)
        for i, (x, y) in enumerate(examples):
            ids[i, :len(x)], labels[i, :len(y)], mask[i, :len(x)] = torch.tensor(x), torch.tensor(y), 1
        device = self.params[0].device
        loss = self.model(input_ids=ids.to(device), attention_mask=mask.to(device), labels=labels.to(device),
                          use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.item(), int(mask.sum())


def _timed(fn, *args) -> tuple[float, int, float]:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    loss, tokens = fn(*args)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return loss, tokens, time.perf_counter() - t


def run(args: argparse.Namespace) -> int:
    import torch

    from tokenfab.train.lora import DEFAULT_TARGETS
    from tokenfab.train.model import load_training_model
    from tokenfab.train.trainer import TrainConfig, Trainer

    commit, dirty = git_commit(), git_dirty()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer = load_training_model(args.model, torch.float32, device)
    peer_base = None if args.no_peer else copy.deepcopy(model)  # before our kernels patch anything
    min_len = args.min_len or args.seq_len // 2
    total_steps = args.warmup_steps + args.steps * args.repeats
    data = synthetic_examples(total_steps * args.batch_size, model.config.vocab_size, min_len, args.seq_len,
                              args.seed)
    workdir = tempfile.mkdtemp(prefix="tokenfab-bench-finetune-")
    cfg = TrainConfig(lr=args.lr, max_steps=total_steps, batch_size=args.batch_size, lora_r=args.lora_r,
                      lora_alpha=args.lora_alpha, kernels=not args.no_kernels, max_seq_len=args.seq_len,
                      max_tokens=args.max_tokens, seed=args.seed, output_dir=workdir, progress=False, plot=False)
    trainer = Trainer(model, tokenizer, data, None, cfg)
    peer = None
    if peer_base is not None:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        peer = PeerStep(peer_base, list(DEFAULT_TARGETS), args.lora_r, args.lora_alpha, args.lr, pad)

    sides: dict[str, dict[str, list]] = {k: {"loss": [], "tokens": [], "s": []} for k in ("tokenfab", "peer")}

    def step(name: str, i: int, timed: bool) -> None:
        fn = trainer._train_step if name == "tokenfab" else (lambda k: peer(trainer._step_examples(k)))
        loss, tokens, sec = _timed(fn, i)
        sides[name]["loss"].append(loss)
        if timed:
            sides[name]["tokens"].append(tokens)
            sides[name]["s"].append(sec)
        when = f"{sec:.2f}s" if timed else "(warm-up)"
        print(f"{name:9s} step {i:3d} loss {loss:.4f} tokens {tokens:5d} {when}", flush=True)

    names = ["tokenfab"] + ([] if peer is None else ["peer"])
    for name in names:
        for i in range(args.warmup_steps):
            step(name, i, timed=False)
    for r in range(args.repeats):
        first = args.warmup_steps + r * args.steps
        for name in names:
            for i in range(first, first + args.steps):
                step(name, i, timed=True)

    results: dict[str, Any] = {}
    for name in names:
        s = sides[name]
        rounds = [sum(s["tokens"][k:k + args.steps]) / sum(s["s"][k:k + args.steps])
                  for k in range(0, len(s["s"]), args.steps)]
        results[name] = {"tokens_per_s": sum(s["tokens"]) / sum(s["s"]), "tokens_per_s_rounds": rounds,
                         "median_step_s": statistics.median(s["s"]), "losses": s["loss"]}
    report: dict[str, Any] = {
        "benchmark": "finetune", "command": "tokenfab " + " ".join(sys.argv[1:]),
        "commit": commit, "dirty": dirty, "machine": machine(),
        "load_average_end": load_average(), "device": device, "dtype": "float32",
        "model": args.model or "bundled SmolLM2-135M-Instruct (GGUF, dequantized)",
        "workload": {"batch_size": args.batch_size, "min_len": min_len, "seq_len": args.seq_len,
                     "max_tokens": args.max_tokens, "warmup_steps": args.warmup_steps, "steps": args.steps,
                     "repeats": args.repeats, "lora_r": args.lora_r, "lora_alpha": args.lora_alpha,
                     "lr": args.lr, "targets": list(DEFAULT_TARGETS)},
        "tokenfab_kernels": trainer.patched_ops, "results": results,
    }
    if peer is not None:
        report["ratio"] = results["tokenfab"]["tokens_per_s"] / results["peer"]["tokens_per_s"]
        report["ratio_rounds"] = [a / b for a, b in zip(results["tokenfab"]["tokens_per_s_rounds"],
                                                        results["peer"]["tokens_per_s_rounds"])]
    md = _markdown(report)
    print(md)
    write_json(args.output_json, report)
    if args.output_md:
        with open(args.output_md, "w") as f:
            f.write(md + "\n")
    return 0


def _markdown(rep: dict[str, Any]) -> str:
    w = rep["workload"]
    rows = [[name, round(r["tokens_per_s"], 1), " / ".join(f"{x:.1f}" for x in r["tokens_per_s_rounds"]),
             round(r["median_step_s"], 2), round(r["losses"][0], 4)] for name, r in rep["results"].items()]
    lines = [
        "# Fine-tuning throughput: tokenfab trainer vs transformers + peft (LoRA)",
        "",
        f"Commit {rep['commit']}{' (dirty checkout)' if rep['dirty'] else ''}, {rep['device']}, {rep['dtype']}, "
        f"{rep['machine'].get('cpu', '')} ({rep['machine'].get('threads')} threads), "
        f"load average at the end {rep['load_average_end']}.",
        f"Model: {rep['model']}. Batch {w['batch_size']} samples/step, lengths {w['min_len']}-{w['seq_len']}, "
        f"LoRA r={w['lora_r']} alpha={w['lora_alpha']} on {', '.join(w['targets'])}; "
        f"{w['warmup_steps']} warm-up + {w['repeats']} x {w['steps']} timed steps per side, interleaved.",
        f"Our kernels: {', '.join(rep['tokenfab_kernels']) or 'none'}. Command: `{rep['command']}`.",
        "",
        markdown_table(["side", "tokens/s", "per round", "median step s", "step-0 loss"], rows),
    ]
    if "ratio" in rep:
        lines += ["", f"Ratio tokenfab / peer: **{rep['ratio']:.2f}x** "
                      f"(rounds: {', '.join(f'{x:.2f}' for x in rep['ratio_rounds'])})."]
    return "\n".join(lines)
