"""``tokenfab finetune [MODEL] --data train.jsonl --output-dir OUT ...``: LoRA (default) or full
fine-tuning of a Hugging Face model (MODEL omitted: the bundled SmolLM2-135M-Instruct GGUF).

Outputs: LoRA adapters in PEFT's format at the top of OUT (``--merge``: also OUT/merged, a Hugging
Face folder ``tokenfab serve`` loads); full fine-tuning writes the model as safetensors in OUT.
Under ``torchrun --nproc-per-node N -m tokenfab finetune ...`` it shards with FSDP2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

BUNDLED_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="HF folder or .gguf file (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--data", required=True, help="training JSONL (chat `messages` or prompt/completion)")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--eval", default=None, help="eval JSONL (same formats)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--full", action="store_true", help="full fine-tuning instead of LoRA")
    mode.add_argument("--lora-r", type=int, default=8)
    p.add_argument("--lora-alpha", type=float, default=8.0)
    p.add_argument("--lora-dropout", type=float, default=0.0)
    p.add_argument("--lora-target-modules", nargs="+", default=None,
                   help="module names to adapt (default: the attention and MLP projections)")
    p.add_argument("--use-rslora", action="store_true", help="scale alpha/sqrt(r) instead of alpha/r")
    p.add_argument("--max-steps", type=int, default=None, help="overrides --epochs")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=None, help="default 1e-4 (LoRA) / 1e-5 (full)")
    p.add_argument("--batch-size", type=int, default=8, help="samples per micro-batch (global)")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--warmup-ratio", type=float, default=0.0)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--max-seq-len", type=int, default=2048, help="samples are truncated to this")
    p.add_argument("--eval-every", type=int, default=0, help="eval loss every N steps (and at the end)")
    p.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps")
    p.add_argument("--merge", action="store_true", help="also write the merged model to OUT/merged")
    p.add_argument("--no-kernels", action="store_true", help="plain PyTorch/transformers, no fused kernels")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--fp8", action="store_true", help="torchao float8 training (CUDA only)")
    p.add_argument("--fp8-recipe", choices=["tensorwise", "rowwise"], default="tensorwise")
    p.add_argument("--resume-from", default=None, help="a checkpoint-STEP folder of an earlier run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")


def _fail(msg: str) -> int:
    print(f"tokenfab finetune: {msg}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    import torch

    from tokenfab.train import distributed as dist_util

    if args.fp8 and not torch.cuda.is_available():
        return _fail("--fp8 needs a CUDA GPU (torchao float8 training); it is refused on CPU")
    if args.merge and args.full:
        return _fail("--merge applies to LoRA; full fine-tuning already writes the whole model")
    for flag in ("batch_size", "grad_accum", "epochs", "max_seq_len"):
        if getattr(args, flag) < 1:
            return _fail(f"--{flag.replace('_', '-')} must be at least 1")
    if args.max_steps is not None and args.max_steps < 1:
        return _fail("--max-steps must be at least 1")
    from tokenfab.train.data import DataError, load_records

    try:
        train = load_records(args.data)
        evals = load_records(args.eval) if args.eval else None
    except (DataError, OSError) as e:
        return _fail(str(e))
    if not train:
        return _fail(f"{args.data}: no records")
    distributed = dist_util.launched_by_torchrun()
    device = dist_util.init_distributed() if distributed else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")
    try:
        return _train(args, train, evals, device)
    finally:
        if distributed:
            dist_util.shutdown()


def _train(args: argparse.Namespace, train: list, evals: list | None, device) -> int:
    import torch

    from tokenfab.train import distributed as dist_util
    from tokenfab.train.data import DataError
    from tokenfab.train.model import load_training_model
    from tokenfab.train.trainer import TrainConfig, Trainer

    # CUDA: LoRA keeps the frozen base in bf16; full fine-tuning keeps fp32 master weights (bf16 autocast).
    dtype = torch.bfloat16 if device.type == "cuda" and not args.full else torch.float32
    try:
        model, tokenizer = load_training_model(args.model, dtype, device)
    except (FileNotFoundError, ValueError) as e:
        return _fail(str(e))
    config = TrainConfig(
        lr=args.lr, epochs=args.epochs, max_steps=args.max_steps, batch_size=args.batch_size,
        grad_accum=args.grad_accum, warmup_ratio=args.warmup_ratio, weight_decay=args.weight_decay,
        max_grad_norm=args.max_grad_norm, seed=args.seed, gradient_checkpointing=args.gradient_checkpointing,
        eval_every=args.eval_every, save_every=args.save_every, kernels=not args.no_kernels, full=args.full,
        lora_r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
        lora_target_modules=args.lora_target_modules, use_rslora=args.use_rslora, fp8=args.fp8,
        fp8_recipe=args.fp8_recipe, max_seq_len=args.max_seq_len, output_dir=args.output_dir,
        resume_from=args.resume_from, progress=not args.no_progress,
    )
    try:
        trainer = Trainer(model, tokenizer, train, evals, config)
    except (DataError, FileNotFoundError, ValueError) as e:  # bad records, settings, checkpoint
        return _fail(str(e))
    result = trainer.train()
    rank, world = dist_util.rank_and_world()
    out = Path(args.output_dir)
    _save_outputs(args, trainer, tokenizer, out, rank, world)
    if rank == 0:
        ops = ", ".join(result.patched_ops) or "none"
        last_eval = f", eval loss {result.eval_losses[-1][1]:.4f}" if result.eval_losses else ""
        print(f"finetune: {result.steps} steps, final loss {result.losses[-1]:.4f}{last_eval}, "
              f"{result.tokens_per_s:.0f} tokens/s, kernels: {ops}; wrote {out}")
    return 0


def _save_outputs(args, trainer, tokenizer, out: Path, rank: int, world: int) -> None:
    model = trainer.base_model
    base_name = args.model or BUNDLED_HUB_ID
    if world > 1:
        model = _gathered_copy(args, trainer, rank)
        if model is None:
            return
    if args.full:
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        return
    from tokenfab.train.peft_io import save_adapter, save_merged

    save_adapter(model, out, base_name)
    if args.merge:
        save_merged(model, tokenizer, out / "merged")  # merges the adapter into the weights in place


def _gathered_copy(args, trainer, rank: int):
    """Under FSDP2: all ranks gather the full state dict (a collective); rank 0 loads it into a fresh,
    unsharded copy of the model (transformers' save and our adapter writer then see plain tensors,
    and no rank waits on a collective the others never join). Other ranks get None."""
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from tokenfab.train.model import load_training_model

    state = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank != 0:
        return None
    model, _ = load_training_model(args.model, torch.float32, "cpu")
    if not args.full:
        from tokenfab.train.lora import inject_lora

        c = trainer.config
        inject_lora(model, r=c.lora_r, alpha=c.lora_alpha, dropout=c.lora_dropout,
                    target_modules=c.lora_target_modules, use_rslora=c.use_rslora, init_seed=c.seed)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    if unexpected or set(missing) - tied:
        raise RuntimeError(f"gathered state does not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return model
