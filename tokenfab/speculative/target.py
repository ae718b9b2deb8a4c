"""What speculative decoding needs from the engine it serves: the target model and its facts, the
scheduler (the step's token budget, the waiting queue) and the block manager (rollback). ``LLMEngine``
has all of it; the speculative code never imports the engine (it lies below it)."""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from tokenfab.engine.requests.block_manager import BlockManager
from tokenfab.engine.requests.scheduler import Scheduler


class LoadArgs(Protocol):
    """The engine arguments a draft model is loaded with, as the target was."""

    quantization: str | None
    cpu_weight_packing: bool


class TargetEngine(Protocol):
    args: LoadArgs
    model: nn.Module
    config: Any  # the target's Hugging Face config
    tokenizer: Any
    device: torch.device
    dtype: torch.dtype
    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int]
    scheduler: Scheduler
    block_manager: BlockManager
    tp: Any  # the tensor-parallel executor, or None
