"""Training checkpoints: ``OUT/checkpoint-STEP/`` holds what an exact resume needs.

- ``trainable.safetensors``: the trainable parameters (LoRA A/B, or every weight in full fine-tuning);
  under FSDP2 the sharded state goes through ``torch.distributed.checkpoint`` instead (``dcp/``).
- ``optimizer.pt``, ``scheduler.pt``: our own files, tensors and numbers only, read back with
  ``torch.load(weights_only=True)``.
- ``rng-rank{R}.pt``: torch (CPU and CUDA) and Python RNG states of each rank.
- ``trainer_state.json``: the step (the data position: the order of the samples is a function of the
  seed and the epoch), the losses so far, the eval losses.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

STATE_FILE = "trainer_state.json"


def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / f"checkpoint-{step}"


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Trainable parameters by name (tied weights once: named_parameters dedups them)."""
    return {n: p.detach().cpu().contiguous() for n, p in model.named_parameters() if p.requires_grad}


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": _py_state_to_tensor()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _py_state_to_tensor() -> torch.Tensor:
    version, internal, gauss = random.getstate()
    assert version == 3 and gauss is None
    return torch.tensor(internal, dtype=torch.int64)


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate((3, tuple(int(x) for x in state["python"].tolist()), None))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                    state: dict[str, Any], rank: int = 0, sharded: bool = False) -> None:
    """Write one checkpoint; every rank calls it (ranks > 0 write their RNG state, and their
    shards when ``sharded``)."""
    path.mkdir(parents=True, exist_ok=True)
    if sharded:
        from tokenfab.train.distributed import save_sharded

        save_sharded(path / "dcp", model, optimizer)
    elif rank == 0:
        save_file(trainable_state(model), str(path / "trainable.safetensors"))
        torch.save(optimizer.state_dict(), path / "optimizer.pt")
    torch.save(rng_state(), path / f"rng-rank{rank}.pt")
    if rank == 0:
        torch.save(scheduler.state_dict(), path / "scheduler.pt")
        (path / STATE_FILE).write_text(json.dumps(state, indent=1))


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                    rank: int = 0, sharded: bool = False) -> dict[str, Any]:
    """Restore a checkpoint written by ``save_checkpoint``; returns its trainer state."""
    path = Path(path)
    if not (path / STATE_FILE).exists():
        raise FileNotFoundError(f"--resume-from {path}: not a checkpoint (no {STATE_FILE})")
    if sharded:
        from tokenfab.train.distributed import load_sharded

        load_sharded(path / "dcp", model, optimizer)
    else:
        weights = load_file(str(path / "trainable.safetensors"))
        params = dict(model.named_parameters())
        missing = [n for n, p in params.items() if p.requires_grad and n not in weights]
        unknown = [n for n in weights if n not in params]
        if missing or unknown:
            raise ValueError(f"checkpoint {path} does not match the model: missing {missing[:3]}, "
                             f"unknown {unknown[:3]} (same --full/--lora settings as the run?)")
        with torch.no_grad():
            for name, tensor in weights.items():
                params[name].copy_(tensor)
        optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    rng_file = path / f"rng-rank{rank}.pt"
    if rng_file.exists():
        set_rng_state(torch.load(rng_file, weights_only=True))
    return json.loads((path / STATE_FILE).read_text())
