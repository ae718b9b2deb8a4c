"""The training loop: AdamW, linear warmup + cosine decay, gradient clipping and accumulation,
gradient checkpointing, eval every N steps, checkpoints with an exact resume, a progress bar, and a
loss-curve PNG at the end.

One optimizer step consumes ``batch_size * grad_accum`` samples (the global batch, whatever the
number of processes): ``grad_accum`` micro-batches of ``batch_size`` samples, each split across the
ranks and packed into rows of at most ``max_tokens`` tokens. The loss of a step is the sum of its
token losses over the number of loss tokens of the whole global batch (computed on the host from
the labels, so no rank waits for another to know it), so 1 and N processes train the same.
The order of the samples is ``randperm`` seeded by (seed, epoch): the step number alone says where
the data stands, which is what makes a resume exact.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from tokenfab.train import checkpoint as ckpt
from tokenfab.train.model import IGNORE_INDEX, apply_kernels, packed_loss


@dataclass
class TrainConfig:
    lr: float | None = None  # None: 1e-5 full, 1e-4 LoRA (a hosted fine-tuning API's defaults)
    epochs: int = 3
    max_steps: int | None = None  # overrides epochs when set
    batch_size: int = 8  # samples per micro-batch (global, over all ranks)
    grad_accum: int = 1
    warmup_ratio: float = 0.0
    warmup_steps: int | None = None
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    seed: int = 0
    gradient_checkpointing: bool = False
    eval_every: int = 0  # 0: eval only at the end (when there is eval data)
    save_every: int = 0  # 0: no intermediate checkpoints
    kernels: bool = True
    full: bool = False  # full fine-tuning instead of LoRA
    lora_r: int = 8
    lora_alpha: float = 8.0
    lora_dropout: float = 0.0
    lora_target_modules: list[str] | None = None
    use_rslora: bool = False
    fp8: bool = False
    fp8_recipe: str = "tensorwise"
    max_seq_len: int = 2048
    max_tokens: int | None = None  # tokens per packed row; None: max_seq_len
    output_dir: str = "finetune-out"
    resume_from: str | None = None
    progress: bool = True
    plot: bool = True

    @property
    def learning_rate(self) -> float:
        return self.lr if self.lr is not None else (1e-5 if self.full else 1e-4)


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)  # per optimizer step
    eval_losses: list[tuple[int, float]] = field(default_factory=list)  # (step, loss)
    tokens_per_s: float = 0.0
    steps: int = 0
    patched_ops: list[str] = field(default_factory=list)


def warmup_cosine(warmup: int, total: int):
    """LR multiplier: linear from 1/(warmup+1) to 1 over ``warmup`` steps, then cosine to 0."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def _loss_tokens(example: Any) -> int:
    """Loss tokens of one (input_ids, labels) example after the within-sample shift."""
    labels = torch.as_tensor(example[1])
    return int((labels[1:] != IGNORE_INDEX).sum())


def _dummy_batch() -> SimpleNamespace:
    """One token with no loss: a rank with no samples left still joins the collectives."""
    one = torch.zeros(1, 1, dtype=torch.long)
    return SimpleNamespace(input_ids=one, position_ids=one, labels=torch.full_like(one, IGNORE_INDEX),
                           cu_seqlens=torch.tensor([0, 1], dtype=torch.int32), num_loss_tokens=0, dummy=True)


class Trainer:
    def __init__(self, model: nn.Module, tokenizer: Any, train_data: list, eval_data: list | None,
                 config: TrainConfig) -> None:
        from tokenfab.train import distributed as dist_util

        self.config, self.tokenizer = config, tokenizer
        self.rank, self.world = dist_util.rank_and_world()
        self.device = next(model.parameters()).device
        if config.fp8 and self.device.type != "cuda":
            raise ValueError("--fp8 needs a CUDA GPU (torchao float8 training); refused on CPU")
        torch.manual_seed(config.seed)
        random.seed(config.seed)
        self.train_examples = self._tokenize(train_data)
        self.eval_examples = self._tokenize(eval_data or [])
        if not self.train_examples:
            raise ValueError("no training examples")
        self.patched_ops = apply_kernels(model) if config.kernels else []
        self.base_model = model
        self._prepare_trainable(model)
        if config.gradient_checkpointing:
            _enable_checkpointing(model)
        if config.fp8:
            _convert_fp8(model, config.fp8_recipe)
        self.model = dist_util.shard_model(model) if self.world > 1 else model
        self.sharded = self.world > 1
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=config.weight_decay)
        self.step_samples = config.batch_size * config.grad_accum
        self.steps_per_epoch = math.ceil(len(self.train_examples) / self.step_samples)
        self.total_steps = config.max_steps or config.epochs * self.steps_per_epoch
        warmup = config.warmup_steps if config.warmup_steps is not None else math.ceil(
            config.warmup_ratio * self.total_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, warmup_cosine(warmup, self.total_steps))
        self.result = TrainResult(patched_ops=self.patched_ops)
        self.start_step = 0
        if config.resume_from:
            state = ckpt.load_checkpoint(Path(config.resume_from), self.model, self.optimizer, self.scheduler,
                                         self.rank, self.sharded)
            self.start_step = state["step"]
            self.result.losses = list(state["losses"])
            self.result.eval_losses = [tuple(x) for x in state["eval_losses"]]

    # -- setup ---------------------------------------------------------------------------------
    def _tokenize(self, data: list) -> list:
        if not data or not isinstance(data[0], dict):
            return list(data)
        from tokenfab.train.data import tokenize_record

        return [tokenize_record(self.tokenizer, r, self.config.max_seq_len) for r in data]

    def _prepare_trainable(self, model: nn.Module) -> None:
        c = self.config
        if c.full:
            for p in model.parameters():
                p.requires_grad_(True)
            return
        from tokenfab.train.lora import inject_lora

        for p in model.parameters():
            p.requires_grad_(False)
        inject_lora(model, r=c.lora_r, alpha=c.lora_alpha, dropout=c.lora_dropout,
                    target_modules=c.lora_target_modules, use_rslora=c.use_rslora, init_seed=c.seed)
        for p in model.parameters():  # the adapter trains in fp32 (bf16 base + autocast on CUDA)
            if p.requires_grad:
                p.data = p.data.float()
        if c.gradient_checkpointing:
            model.enable_input_require_grads()  # frozen embeddings: checkpointed blocks still get grads

    # -- data ----------------------------------------------------------------------------------
    def _order(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.config.seed * 100_003 + epoch)
        return torch.randperm(len(self.train_examples), generator=g).tolist()

    def _step_examples(self, step: int) -> list:
        epoch, i = divmod(step, self.steps_per_epoch)
        idx = self._order(epoch)[i * self.step_samples:(i + 1) * self.step_samples]
        return [self.train_examples[j] for j in idx]

    def _rank_packs(self, examples: list) -> list:
        """This rank's packed rows of ``examples`` (a global micro-batch), padded with dummy rows to
        the largest count over the ranks: every rank runs as many forwards (FSDP's collectives)."""
        from tokenfab.train.data import pack

        max_tokens = self.config.max_tokens or self.config.max_seq_len
        shares = [examples[r::self.world] for r in range(self.world)]
        counts = [len(pack(s, max_tokens)) if s else 0 for s in shares] if self.world > 1 else None
        mine = pack(shares[self.rank], max_tokens) if shares[self.rank] else []
        target = max(counts) if counts else len(mine)
        return mine + [_dummy_batch() for _ in range(target - len(mine))]

    # -- steps ---------------------------------------------------------------------------------
    def _autocast(self):
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _train_step(self, step: int) -> tuple[float, int]:
        examples = self._step_examples(step)
        total_tokens = max(1, sum(_loss_tokens(e) for e in examples))
        micro = [examples[i:i + self.config.batch_size] for i in range(0, len(examples), self.config.batch_size)]
        loss_sum = torch.zeros((), device=self.device)
        seen = sum(len(e[0]) for e in examples)  # tokens of the global batch (host lists: no sync)
        for m, chunk in enumerate(micro):
            packs = self._rank_packs(chunk)
            last_micro = m == len(micro) - 1
            for k, batch in enumerate(packs):
                if self.sharded:
                    self.model.set_requires_gradient_sync(last_micro and k == len(packs) - 1)
                with self._autocast():
                    loss, _ = packed_loss(self.model, batch, self.config.kernels)
                # FSDP averages gradients over ranks: scale so the sum is the global mean.
                (loss * (self.world / total_tokens)).backward()
                loss_sum += loss.detach().float()
        params = [p for p in self.model.parameters() if p.requires_grad]
        torch.nn.utils.clip_grad_norm_(params, self.config.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(self._all_sum(loss_sum)) / total_tokens, seen

    def _all_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(t)
        return t

    @torch.no_grad()
    def evaluate(self) -> float | None:
        if not self.eval_examples:
            return None
        was_training = self.model.training
        self.model.eval()
        total = torch.zeros((), device=self.device)
        tokens = sum(_loss_tokens(e) for e in self.eval_examples)
        for i in range(0, len(self.eval_examples), self.config.batch_size):
            for batch in self._rank_packs(self.eval_examples[i:i + self.config.batch_size]):
                with self._autocast():
                    loss, _ = packed_loss(self.model, batch, self.config.kernels)
                total += loss.float()
        self.model.train(was_training)
        return float(self._all_sum(total)) / max(1, tokens)

    # -- the loop ------------------------------------------------------------------------------
    def train(self) -> TrainResult:
        c = self.config
        out = Path(c.output_dir)
        if self.rank == 0:
            out.mkdir(parents=True, exist_ok=True)
        self.model.train()
        bar = _progress(self.total_steps, self.start_step, c.progress and self.rank == 0)
        t0, tokens = time.perf_counter(), 0
        for step in range(self.start_step, self.total_steps):
            loss, n = self._train_step(step)
            tokens += n
            self.result.losses.append(loss)
            done = step + 1
            rate = tokens / max(1e-9, time.perf_counter() - t0)
            if bar is not None:
                bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{rate:.0f}")
                bar.update(1)
            if c.eval_every and done % c.eval_every == 0 and done < self.total_steps:
                self._eval(done, bar)
            if c.save_every and done % c.save_every == 0 and done < self.total_steps:
                self.save_checkpoint(done)
        if bar is not None:
            bar.close()
        self._eval(self.total_steps, None)
        self.result.steps = self.total_steps
        self.result.tokens_per_s = tokens / max(1e-9, time.perf_counter() - t0)
        if self.rank == 0:
            (out / "train_result.json").write_text(json.dumps(asdict(self.result), indent=1))
            if c.plot:
                plot_losses(self.result, out / "loss.png")
        return self.result

    def _eval(self, step: int, bar: Any) -> None:
        loss = self.evaluate()
        if loss is None:
            return
        self.result.eval_losses.append((step, loss))
        if bar is not None:
            bar.write(f"step {step}: eval loss {loss:.4f}")

    def save_checkpoint(self, step: int) -> Path:
        path = ckpt.checkpoint_dir(self.config.output_dir, step)
        state = {"step": step, "losses": self.result.losses, "eval_losses": self.result.eval_losses,
                 "config": asdict(self.config)}
        ckpt.save_checkpoint(path, self.model, self.optimizer, self.scheduler, state, self.rank, self.sharded)
        return path


def _enable_checkpointing(model: nn.Module) -> None:
    """HF's activation (gradient) checkpointing of every decoder layer, non-reentrant."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x; the old name warns
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _progress(total: int, initial: int, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc="finetune", unit="step", dynamic_ncols=True)


def _convert_fp8(model: nn.Module, recipe: str) -> None:
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        raise ValueError("--fp8 needs torchao (pip install torchao); it is not installed") from e

    def eligible(module: nn.Module, fqn: str) -> bool:
        # torchao's float8 GEMMs want both dims divisible by 16; the vocab projection stays in bf16.
        return isinstance(module, nn.Linear) and "lm_head" not in fqn and \
            module.in_features % 16 == 0 and module.out_features % 16 == 0

    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe),
                               module_filter_fn=eligible)


def plot_losses(result: TrainResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(range(1, len(result.losses) + 1), result.losses, label="train loss")
    if result.eval_losses:
        xs, ys = zip(*result.eval_losses)
        ax.plot(xs, ys, "o-", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (mean per token)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
