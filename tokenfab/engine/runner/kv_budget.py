"""How many KV cache blocks the engine allocates: the memory budget (a share of the GPU less weights
and the measured activation peak, or the CPU's --kv-cache-memory), less the recurrent-state slots of a
hybrid model (runner/state_cache.py), over the bytes one block takes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from tokenfab.engine.requests.sampling_params import SamplingParams
from tokenfab.engine.requests.sequence import Sequence
from tokenfab.engine.runner.device_setup import default_cpu_kv_bytes
from tokenfab.engine.runner.model_runner import ModelRunner


class KVBudgetArgs(Protocol):
    """The engine arguments the budget reads (``EngineArgs`` has them)."""

    num_kv_blocks: int | None
    block_size: int
    kv_cache_memory: int | None
    gpu_memory_utilization: float
    max_num_seqs: int
    max_num_batched_tokens: int


def kv_cache_blocks(args: KVBudgetArgs, bytes_per_token: int, device: torch.device, max_model_len: int,
                    make_runner: Callable[[int, int], ModelRunner], state_bytes: int = 0) -> int:
    """Blocks that fit the budget, at most what ``max_num_seqs`` full-length sequences use; a clear
    error when not even one sequence of ``max_model_len`` fits. ``bytes_per_token``: every cache the
    blocks index (the model's and a draft module's). ``state_bytes``: the recurrent-state tensors of a
    hybrid model (all slots), taken from the budget first (they are allocated whatever the blocks)."""
    if args.num_kv_blocks is not None:
        return args.num_kv_blocks
    per_block = bytes_per_token * args.block_size
    if device.type == "cuda":
        budget = cuda_kv_budget(args, device, max_model_len, make_runner)
    else:
        budget = args.kv_cache_memory or default_cpu_kv_bytes()
    budget -= state_bytes
    per_seq = -(-max_model_len // args.block_size)
    blocks = budget // per_block
    if blocks < per_seq:
        what = "--gpu-memory-utilization" if device.type == "cuda" else "--kv-cache-memory"
        states = f" after {state_bytes / 2**20:.0f} MiB of recurrent-state slots" if state_bytes else ""
        raise ValueError(
            f"the KV cache budget{states} ({max(budget, 0) / 2**20:.0f} MiB, {max(blocks, 0)} blocks of "
            f"{args.block_size} tokens) cannot hold one sequence of max_model_len={max_model_len} "
            f"tokens ({per_seq} blocks, {per_seq * per_block / 2**20:.0f} MiB): raise {what} or lower "
            "--max-model-len" + (" or --num-state-slots" if state_bytes else "")
        )
    return min(blocks, per_seq * max(args.max_num_seqs, 1))


def cuda_kv_budget(args: KVBudgetArgs, device: torch.device, max_model_len: int,
                   make_runner: Callable[[int, int], ModelRunner]) -> int:
    """A fraction of the GPU's memory, less weights and the measured activation peak of a forward
    over the largest chunk (run once against a small throwaway cache)."""
    n = min(args.max_num_batched_tokens, max_model_len - 1)
    probe = make_runner(args.block_size, -(-n // args.block_size))
    seq = Sequence("profile", None, [0] * n, SamplingParams(max_tokens=1), 0)
    seq.block_table = list(range(probe.num_blocks))
    seq.state_slot = 0  # a hybrid model's probe runner has state slots too (ignored without recurrent state)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    probe.execute(probe.prepare([seq], [n], [True]))
    torch.cuda.synchronize(device)
    activ = torch.cuda.max_memory_allocated(device) - base
    del probe
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return int(total * args.gpu_memory_utilization - (total - free) - activ)
