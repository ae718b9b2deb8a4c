"""Training checkpoints: ``OUT/checkpoint-STEP/`` holds what an exact resume needs.

- ``trainable.safetensors``: the trainable parameters (LoRA A/B, or every weight in full fine-tuning);
  under FSDP2 the sharded state goes through ``torch.distributed.checkpoint`` instead (``dcp/``).
- ``optimizer``, ``scheduler``, ``rng-rank{R}`` (torch CPU/CUDA and Python RNG states of each rank):
  nested state dicts stored as ``NAME.json`` (the structure, numbers and strings) plus
  ``NAME.safetensors`` (the tensors). A checkpoint is untrusted input like any model file, so
  nothing is pickled: no ``torch.load``.
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


def _encode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """JSON for a state dict: tensors move to ``tensors`` (by a generated key), dict keys keep
    their type (optimizer state is keyed by int), tuples become lists."""
    if isinstance(obj, torch.Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = obj.detach().cpu().contiguous()
        return {"tensor": key}
    if isinstance(obj, dict):
        return {"dict": [[_encode(k, tensors), _encode(v, tensors)] for k, v in obj.items()]}
    if isinstance(obj, list | tuple):
        return [_encode(v, tensors) for v in obj]
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    raise TypeError(f"cannot store a {type(obj).__name__} in a checkpoint")


def _decode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if isinstance(obj, dict):
        if "tensor" in obj:
            return tensors[obj["tensor"]]
        return {_decode(k, tensors): _decode(v, tensors) for k, v in obj["dict"]}
    return obj


def save_state(stem: Path, state: Any) -> None:
    tensors: dict[str, torch.Tensor] = {}
    structure = _encode(state, tensors)
    save_file(tensors, str(stem.with_suffix(".safetensors")))
    stem.with_suffix(".json").write_text(json.dumps(structure))


def load_state(stem: Path) -> Any:
    try:
        return _decode(json.loads(stem.with_suffix(".json").read_text()),
                       load_file(str(stem.with_suffix(".safetensors"))))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"checkpoint file {stem}.json is malformed: {type(e).__name__}: {e}") from None


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
        save_state(path / "optimizer", optimizer.state_dict())
    save_state(path / f"rng-rank{rank}", rng_state())
    if rank == 0:
        save_state(path / "scheduler", scheduler.state_dict())
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
        optimizer.load_state_dict(load_state(path / "optimizer"))
    scheduler.load_state_dict(load_state(path / "scheduler"))
    rng_stem = path / f"rng-rank{rank}"
    if rng_stem.with_suffix(".json").exists():
        set_rng_state(load_state(rng_stem))
    return json.loads((path / STATE_FILE).read_text())
