"""The tensor-parallel wire protocol between rank 0 (``executors/tp_executor.py``) and the workers
(``executors/tp_worker.py``): joining the group, the fixed 16-int command header over the gloo
command group, and a step's ``ForwardBatch`` as one int64 payload over the TP group (all of the
batch's int tensors concatenated: no pickle anywhere).

Commands: ``RUNNER`` [block size, blocks, dtype index] builds the KV cache; ``FORWARD`` [mode and the
batch's sizes] precedes the payload; ``CAPTURE`` [max batch, max model len] CUDA graphs; ``EPLB``
[action]; ``STOP``.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tokenfab.distributed.parallel_state import init_expert_parallel, init_parallel
from tokenfab.engine.runner.model_runner import ModelRunner
from tokenfab.forward_batch import ForwardBatch

HEADER_LEN = 16
CMD_RUNNER, CMD_FORWARD, CMD_CAPTURE, CMD_STOP = 1, 2, 3, 4
CMD_EPLB = 5  # [EPLB, action]: reset the expert-load counters / rebalance (executors/eplb_engine.py)
MODE_EXECUTE, MODE_SCORING, MODE_LOGITS = 0, 1, 2
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
_IDLE_TIMEOUT = timedelta(days=365)


def collective_timeout() -> timedelta:
    return timedelta(seconds=float(os.environ.get("TOKENFAB_TP_TIMEOUT", "120")))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class TPGroup:
    """What every rank holds once the group is up."""

    rank: int
    world: int
    device: torch.device
    cmd_group: Any  # gloo, no deadline: headers (a worker idles here)
    tp_group: Any  # the model's TP group (NCCL on CUDA): batch payloads


def join_group(rank: int, world: int, init_method: str | None, device: torch.device,
               store: Any = None, expert_parallel: bool = False, num_redundant_experts: int = 0) -> TPGroup:
    """Join the default group and make the TP groups current (the same calls, in the same order,
    on every rank). ``store``: a ready ``TCPStore`` instead of ``init_method``; ``expert_parallel``:
    also the EP group (``--enable-expert-parallel``) with EPLB's redundant experts."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        if store is not None:
            dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=collective_timeout())
        else:
            dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                                    timeout=collective_timeout())
    state = init_parallel(world)
    if expert_parallel:
        init_expert_parallel(True, num_redundant_experts)
    cmd = dist.new_group(list(range(world)), backend="gloo", timeout=_IDLE_TIMEOUT)
    return TPGroup(dist.get_rank(), world, device, cmd, state.tp_group)


def send_header(group: TPGroup, *ints: int) -> None:
    h = torch.zeros(HEADER_LEN, dtype=torch.int64)
    h[: len(ints)] = torch.tensor(ints, dtype=torch.int64)
    dist.broadcast(h, 0, group=group.cmd_group)


def recv_header(group: TPGroup) -> list[int]:
    h = torch.zeros(HEADER_LEN, dtype=torch.int64)
    dist.broadcast(h, 0, group=group.cmd_group)
    return h.tolist()


# ---- the batch on the wire -----------------------------------------------------------------
def batch_header(mode: int, b: ForwardBatch) -> list[int]:
    """[FORWARD, mode, T, B, max_blocks, R, P (-1: no prompt rows), max_query_len, max_context_len]"""
    p = -1 if b.prompt_indices is None else b.prompt_indices.shape[0]
    return [CMD_FORWARD, mode, b.num_tokens, b.num_seqs, b.block_tables.shape[1], b.logits_indices.shape[0], p,
            b.max_query_len, b.max_context_len]


def pack_batch(b: ForwardBatch) -> torch.Tensor:
    parts = [b.input_ids, b.positions, b.slot_mapping, b.block_tables.reshape(-1), b.cu_seqlens_q, b.context_lens,
             b.logits_indices]
    if b.prompt_indices is not None:
        parts.append(b.prompt_indices)
    return torch.cat([t.to(torch.int64) for t in parts])


def unpack_batch(header: list[int], payload: torch.Tensor) -> ForwardBatch:
    t, b, w, r, p, max_q, max_ctx = header[2:9]
    sizes = [t, t, t, b * w, b + 1, b, r] + ([p] if p >= 0 else [])
    f = torch.split(payload, sizes)
    return ForwardBatch(
        input_ids=f[0], positions=f[1], slot_mapping=f[2], block_tables=f[3].to(torch.int32).view(b, w),
        cu_seqlens_q=f[4].to(torch.int32), context_lens=f[5].to(torch.int32), logits_indices=f[6],
        max_query_len=max_q, max_context_len=max_ctx, prompt_indices=f[7] if p >= 0 else None,
    )


def payload_size(header: list[int]) -> int:
    t, b, w, r, p = header[2:7]
    return 3 * t + b * w + (b + 1) + b + r + max(p, 0)


def run_forward(runner: ModelRunner, mode: int, batch: ForwardBatch) -> Any:
    if mode == MODE_SCORING:
        return runner.execute_scoring(batch)
    if mode == MODE_LOGITS:
        return runner.forward_logits(batch)
    return runner.execute(batch)
