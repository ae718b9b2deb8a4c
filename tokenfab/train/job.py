"""``python -m tokenfab.train.job SPEC.json``: one fine-tuning job, run by the server's job worker in a process of
its own (the server never imports ``tokenfab.train``). The spec (JSON) names the model, the data files, the output
folder and the hyperparameters; progress goes to stdout as one JSON object a line, each with an ``event`` key:

- ``{"event": "started", "total_steps", "steps_per_epoch", "examples"}``
- ``{"event": "step", "step", "total_steps", "train_loss"}`` after every optimizer step
- ``{"event": "checkpoint", "step", "path", "metrics": {"step", "train_loss", "valid_loss"}}`` at each epoch's end
  (LoRA: a PEFT adapter folder; valid_loss only with validation data)
- ``{"event": "succeeded", "path", "trained_tokens", "full"}`` (the adapter folder, or the model folder when full)
- ``{"event": "failed", "code", "message"}`` for bad data or settings (exit status 2)

The process exits when its stdin closes: a server that dies takes its training job with it.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path
from typing import Any

import torch

from tokenfab.train.data import DataError, load_records
from tokenfab.train.model import load_training_model
from tokenfab.train.peft_io import save_adapter
from tokenfab.train.trainer import TrainConfig, Trainer


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


class ReportingTrainer(Trainer):
    """The trainer, printing each step's loss and writing a checkpoint (with its metrics) at each epoch's end."""

    def __init__(self, *args: Any, checkpoints: Path, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.checkpoints = checkpoints
        self.trained_tokens = 0
        self.config.eval_every = self.steps_per_epoch  # the trainer calls _eval at every epoch's end and the last

    def _train_step(self, step: int) -> tuple[float, int]:
        loss, seen = super()._train_step(step)
        self.trained_tokens += seen
        emit("step", step=step + 1, total_steps=self.total_steps, train_loss=loss)
        return loss, seen

    def _eval(self, step: int, bar: Any) -> None:
        loss = self.evaluate()
        if loss is not None:
            self.result.eval_losses.append((step, loss))
        metrics = {"step": step, "train_loss": self.result.losses[-1] if self.result.losses else None}
        if loss is not None:
            metrics["valid_loss"] = loss
            metrics["full_valid_loss"] = loss
        path = None
        if not self.config.full:  # a full model per epoch is too heavy to keep; the final one is written anyway
            path = save_adapter(self.base_model, self.checkpoints / f"step-{step}", None)
        emit("checkpoint", step=step, path=str(path) if path else None, metrics=metrics)


def _watch_parent() -> None:
    """Exit as soon as stdin reaches EOF: the server holds the other end and closes it only by dying."""
    def watch() -> None:
        while os.read(0, 1 << 16):  # the raw descriptor: no buffered reader's lock held at interpreter exit
            pass
        os._exit(3)

    threading.Thread(target=watch, daemon=True, name="tokenfab-job-parent").start()


def run(spec: dict[str, Any]) -> int:
    out = Path(spec["output_dir"])
    try:
        train = load_records(spec["train"])
        evals = load_records(spec["eval"]) if spec.get("eval") else None
    except (DataError, OSError) as e:
        emit("failed", code="invalid_training_file", message=str(e))
        return 2
    device = torch.device(spec.get("device") or ("cuda" if torch.cuda.is_available() else "cpu"))
    full = bool(spec.get("full"))
    dtype = torch.bfloat16 if device.type == "cuda" and not full else torch.float32
    model, tokenizer = load_training_model(spec.get("model"), dtype, device)
    config = TrainConfig(lr=spec.get("lr"), epochs=int(spec["epochs"]), batch_size=int(spec["batch_size"]),
                         seed=int(spec.get("seed", 0)), full=full, lora_r=int(spec.get("lora_r", 8)),
                         lora_alpha=float(spec.get("lora_alpha", 8.0)), max_steps=spec.get("max_steps"),
                         max_seq_len=int(spec.get("max_seq_len", 2048)), output_dir=str(out), progress=False,
                         plot=False)
    try:
        trainer = ReportingTrainer(model, tokenizer, train, evals, config, checkpoints=out / "checkpoints")
    except (DataError, ValueError) as e:
        emit("failed", code="invalid_training_file", message=str(e))
        return 2
    emit("started", total_steps=trainer.total_steps, steps_per_epoch=trainer.steps_per_epoch, examples=len(train))
    trainer.train()
    if full:
        final = out / "model"
        trainer.base_model.save_pretrained(final)
        tokenizer.save_pretrained(final)
    else:
        final = save_adapter(trainer.base_model, out / "adapter", spec.get("base_name"))
    emit("succeeded", path=str(final), trained_tokens=trainer.trained_tokens, full=full)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m tokenfab.train.job SPEC.json", file=sys.stderr)
        return 2
    _watch_parent()
    return run(json.loads(Path(argv[0]).read_text()))


if __name__ == "__main__":
    sys.exit(main())
