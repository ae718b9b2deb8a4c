"""Process groups for tensor parallelism on ``torch.distributed`` (NCCL on CUDA, gloo on CPU).

Ranks ``[k*tp, (k+1)*tp)`` form tensor-parallel group k (consecutive ranks: one node's GPUs when tp
fits a node); ranks with the same ``rank % tp`` form a data-parallel group. Nothing here starts
processes: ``torchrun`` (its env:// rendezvous) or a spawner calls ``init_distributed`` first.
Without initialization everything is the single-process identity (rank 0 of 1, collectives no-ops),
so layers written against this module run unchanged in one process.

``CommCounter`` records the collectives the parallel layers issue (kind and payload bytes), so the
communication volume that ``tokenfab plan`` assumes can be checked against what a run sends.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class CommCounter:
    calls: list[tuple[str, int]] = field(default_factory=list)  # (kind, payload bytes per rank)

    def add(self, kind: str, t: torch.Tensor) -> None:
        self.calls.append((kind, t.numel() * t.element_size()))

    def add_bytes(self, kind: str, nbytes: int) -> None:
        self.calls.append((kind, int(nbytes)))

    def total(self, kind: str | None = None) -> int:
        return sum(b for k, b in self.calls if kind is None or k == kind)


@dataclass
class ParallelState:
    tp_rank: int = 0
    tp_size: int = 1
    tp_group: dist.ProcessGroup | None = None
    dp_rank: int = 0
    dp_size: int = 1
    dp_group: dist.ProcessGroup | None = None
    counter: CommCounter | None = None
    # expert parallel (init_expert_parallel): vLLM's rule, EP size = TP x DP (every rank), the EP
    # group being the TP group at DP 1; off: ep_size 1 and experts TP-sharded
    ep_rank: int = 0
    ep_size: int = 1
    ep_group: dist.ProcessGroup | None = None
    ep_redundant: int = 0  # EPLB: redundant physical experts per MoE layer (all ranks together)
    # two-batch overlap (distributed/two_batch.py): when a list, tp_all_reduce / ep_all_to_all launch
    # async_op and append their Work here (the stage runner waits before the result is read)
    deferred: list | None = None


_state = ParallelState()


def init_distributed(rank: int | None = None, world_size: int | None = None, init_method: str = "env://",
                     backend: str | None = None) -> None:
    """Join the default process group (rank/world size from torchrun's environment when not given)."""
    if dist.is_initialized():
        return
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)


def init_parallel(tp_size: int) -> ParallelState:
    """Create the TP and DP groups (every rank must call this, in the same order) and make them current."""
    global _state
    if not dist.is_initialized():
        if tp_size != 1:
            raise RuntimeError("tensor parallelism needs torch.distributed: call init_distributed first")
        _state = ParallelState()
        return _state
    world, rank = dist.get_world_size(), dist.get_rank()
    if tp_size < 1 or world % tp_size:
        raise ValueError(f"tensor parallel size {tp_size} must divide the world size {world}")
    dp_size = world // tp_size
    tp_group = dp_group = None
    for k in range(dp_size):  # new_group is collective: all ranks create every group
        g = dist.new_group(list(range(k * tp_size, (k + 1) * tp_size)))
        if rank // tp_size == k:
            tp_group = g
    for j in range(tp_size):
        g = dist.new_group(list(range(j, world, tp_size)))
        if rank % tp_size == j:
            dp_group = g
    _state = ParallelState(rank % tp_size, tp_size, tp_group, rank // tp_size, dp_size, dp_group)
    return _state


def get_parallel_state() -> ParallelState:
    return _state


def destroy_parallel() -> None:
    """Back to the single-process state and leave the default group (if any)."""
    global _state
    _state = ParallelState()
    if dist.is_initialized():
        dist.destroy_process_group()


def set_comm_counter(counter: CommCounter | None) -> None:
    _state.counter = counter


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the TP group, in place; the identity at TP 1."""
    s = _state
    if s.tp_size == 1:
        return x
    if s.counter is not None:
        s.counter.add("all_reduce", x)
    if s.deferred is not None:
        s.deferred.append(dist.all_reduce(x, group=s.tp_group, async_op=True))
        return x
    dist.all_reduce(x, group=s.tp_group)
    return x


def tp_all_gather_last(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every TP rank's ``x`` along the last dim (rank order)."""
    s = _state
    return _all_gather(x, s.tp_size, s.tp_group, -1, s.counter)


def _all_gather(x: torch.Tensor, size: int, group: dist.ProcessGroup | None, dim: int,
                counter: CommCounter | None) -> torch.Tensor:
    """Every rank's ``x`` of ``group`` concatenated along ``dim`` in rank order (counted when ``counter``);
    ``x`` itself for a group of one."""
    if size == 1:
        return x
    if counter is not None:
        counter.add("all_gather", x)
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


# ---------------------------------------------------------------- expert parallel


def init_expert_parallel(enabled: bool = True, num_redundant_experts: int = 0) -> ParallelState:
    """Turn expert parallelism on (after ``init_parallel``; every rank calls it): the EP group is every
    rank of the world (TP x DP ranks, vLLM's rule), ep_rank the global rank. Off: EP size 1.
    ``num_redundant_experts``: EPLB's extra physical experts per MoE layer (replicas of hot experts)."""
    s = _state
    if num_redundant_experts < 0:
        raise ValueError(f"num_redundant_experts must be >= 0, got {num_redundant_experts}")
    s.ep_redundant = num_redundant_experts
    if not enabled or not dist.is_initialized() or dist.get_world_size() == 1:
        s.ep_rank, s.ep_size, s.ep_group = 0, 1, None
        return s
    world = dist.get_world_size()
    s.ep_group = s.tp_group if s.dp_size == 1 else dist.new_group(list(range(world)))
    s.ep_rank, s.ep_size = dist.get_rank(), world
    return s


def ep_all_to_all(x: torch.Tensor, send_splits: list[int] | None = None, recv_splits: list[int] | None = None,
                  kind: str = "all_to_all") -> torch.Tensor:
    """``all_to_all_single`` over the EP group along dim 0 (equal splits when None). The counter records
    the bytes this rank sends to *other* ranks (its own chunk stays local)."""
    s = _state
    if s.ep_size == 1:
        return x
    x = x.contiguous()
    row = x.element_size() * math.prod(x.shape[1:])
    if recv_splits is None:
        out = torch.empty_like(x)
    else:
        out = x.new_empty((sum(recv_splits), *x.shape[1:]))
    if s.counter is not None:
        own = send_splits[s.ep_rank] if send_splits is not None else x.shape[0] // s.ep_size
        s.counter.add_bytes(kind, (x.shape[0] - own) * row)
    if s.deferred is not None:  # two-batch overlap: launched; the stage runner waits (keeps x alive)
        work = dist.all_to_all_single(out, x, recv_splits, send_splits, group=s.ep_group, async_op=True)
        s.deferred.append(_Pending(work, x))
        return out
    dist.all_to_all_single(out, x, recv_splits, send_splits, group=s.ep_group)
    return out


class _Pending:
    """A launched collective and its input, held until ``wait()`` (two-batch overlap)."""

    def __init__(self, work: dist.Work, keep: torch.Tensor) -> None:
        self.work, self.keep = work, keep

    def wait(self) -> bool:
        self.work.wait()
        self.keep = None
        return True


def ep_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the EP group, in place (expert-load counters; not counted as step traffic)."""
    s = _state
    if s.ep_size > 1:
        dist.all_reduce(x, group=s.ep_group)
    return x


def ep_all_gather(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every EP rank's ``x`` along dim 0 (rank order); used by expert rebalancing."""
    s = _state
    return _all_gather(x, s.ep_size, s.ep_group, 0, None)


def tp_all_gather_rows(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every TP rank's ``x`` along dim 0 (rank order): the MoE's token split under TP + EP."""
    s = _state
    return _all_gather(x, s.tp_size, s.tp_group, 0, s.counter)
