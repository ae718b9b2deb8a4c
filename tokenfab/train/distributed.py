"""Scale-out for fine-tuning: ``torchrun --nproc-per-node N -m tokenfab finetune ...``.

PyTorch's own FSDP2 (``fully_shard``) shards each decoder layer and then the root (embeddings,
final norm, LM head); on CUDA with a ``MixedPrecisionPolicy`` (bf16 compute, fp32 gradient
reduction). FSDP2 has a CPU path over gloo (checked with torch 2.13: DTensor shards on a "cpu"
mesh, reduce-scatter through gloo), so CPU runs shard too; DDP is not needed.
Checkpoints are sharded with ``torch.distributed.checkpoint`` (each rank writes its own shard).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn


def rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1


def init_distributed() -> torch.device:
    """Join the process group torchrun describes (nccl on CUDA, gloo on CPU); this rank's device."""
    import torch.distributed as dist

    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend)
    return device


def shutdown() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        # Without the barrier gloo sometimes aborts in destroy ("terminate called without an active
        # exception", about 1 run in 8 here) when one rank tears down while the other still talks.
        dist.barrier()
        dist.destroy_process_group()


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no decoder layers (model.model.layers) to shard")
    return list(layers)


def shard_model(model: nn.Module) -> nn.Module:
    """FSDP2: ``fully_shard`` every decoder layer, then the root. Returns the same module (FSDP2
    changes it in place); the optimizer must be built after this, on the sharded parameters."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    device = next(model.parameters()).device
    kwargs = {}
    if device.type == "cuda":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in _decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def save_sharded(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Each rank writes its shard of the trainable weights and the optimizer state (DCP)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    model_sd = {k: v for k, v in model_sd.items() if k in trainable}
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))


def load_sharded(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    model_sd = {k: v for k, v in model_sd.items() if k in trainable}
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(strict=False))
