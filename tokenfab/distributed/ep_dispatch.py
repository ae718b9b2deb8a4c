"""Expert-parallel dispatch and combine: tokens travel to the ranks that hold their experts and back.

The EP group's ``ep`` ranks hold ``P = ep * L`` physical experts, rank d the ids ``[d*L, (d+1)*L)``.
A rank routes its own T tokens (physical ids ``phys`` [T, k], weights ``w`` [T, k] fp32), and
``expert_fn(rows [N, H], w [N, 1], local ids [N, 1] int32)`` computes the weighted output of one
(row, expert) pair per row with this rank's local experts (FusedMoE's fused kernel with k = 1).
DeepEP's split, written on ``all_to_all_single``:

normal mode (prefill; sizes vary, one host sync per layer for the split sizes):
  1. count exchange: each rank sends every other rank the number of token rows it will send;
  2. dispatch: a token row goes once to each rank that holds one of its k experts (no copy for a
     second expert on the same rank), with its k (local expert id or -1, weight) as metadata;
  3. the receiver expands rows into (row, slot) pairs, runs its local experts on them, and
  4. combine: sends every pair's weighted output back; the home rank puts them in their (token,
     slot) places and sums each token's k outputs in fp32 in slot order, exactly as the
     single-process ``moe_sum`` does, so with row-invariant expert products the result is
     bit-identical to one process.

low-latency mode (decode; static shapes, no count exchange, no host sync: safe under CUDA graphs):
  every (destination expert) has a fixed slot of ``capacity`` rows in a padded send buffer
  [P * capacity, H]; a pair's row goes to slot ``phys * capacity + pos`` where pos counts the
  earlier pairs of the same expert on this rank. Overflow is impossible by construction: a token's
  k experts are distinct, so one expert gets at most T pairs from a rank, and the mode is used only
  when T <= capacity. One all-to-all of equal splits moves rows (and one their weights, 0 on
  padding); the receiver runs its L experts over all ep * L * capacity rows (padding weighs 0),
  combine returns the same buffer shape and the home rank gathers its pairs from their slots.
  Costs: ep * L * capacity rows each way whatever the batch, the price of a static shape (DeepEP
  writes only the filled slots, one-sided; all_to_all_single moves the whole buffer). On the CPU
  (no graphs) the experts run on the filled slots only.

``set_ep_mode`` picks the mode for the following steps: "auto" (low-latency when the rank's tokens
fit the capacity: decode batches), "normal" or "low_latency". Every rank of the EP group must take
the same mode in a step; in SPMD runs (same batch everywhere) "auto" does; under attention-DP the
runner sets it from the batch sizes the DP ranks exchange.

Each all-to-all is a yield point (``*_stages`` generators, ``two_batch.collective``): in a two-batch
overlapped step (distributed/two_batch.py) it is launched asynchronously and the other micro-batch
computes before this one waits; otherwise the generators are drained at once (same code, same result).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from tokenfab.distributed import parallel_state as ps
from tokenfab.distributed import two_batch

ExpertFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
MODES = ("auto", "normal", "low_latency")


class AllToAll(Protocol):
    def __call__(self, x: torch.Tensor, send_splits: list[int] | None = None,
                 recv_splits: list[int] | None = None, kind: str = "all_to_all") -> torch.Tensor: ...


_config = {"mode": "auto", "capacity": 128}
STATIC_ON_CPU = False  # tests: the CUDA-graph-safe low-latency path (every slot row computed) on the CPU


def set_ep_mode(mode: str = "auto", capacity: int | None = None) -> None:
    """The dispatch mode of the following steps, and the low-latency capacity (max tokens per rank)."""
    if mode not in MODES:
        raise ValueError(f"EP dispatch mode must be one of {MODES}, not {mode!r}")
    if capacity is not None and capacity < 1:
        raise ValueError(f"low-latency capacity must be >= 1, got {capacity}")
    _config["mode"] = mode
    if capacity is not None:
        _config["capacity"] = int(capacity)


def ep_mode() -> tuple[str, int]:
    return _config["mode"], _config["capacity"]


def choose_mode(num_tokens: int) -> str:
    mode, cap = _config["mode"], _config["capacity"]
    if mode == "auto":
        return "low_latency" if num_tokens <= cap else "normal"
    if mode == "low_latency" and num_tokens > cap:
        raise ValueError(f"low-latency EP dispatch takes at most {cap} tokens per rank, got {num_tokens}")
    return mode


def dispatch_combine(x: torch.Tensor, phys: torch.Tensor, w: torch.Tensor, expert_fn: ExpertFn,
                     ep_size: int, num_local: int, mode: str, capacity: int,
                     a2a: AllToAll = ps.ep_all_to_all) -> torch.Tensor:
    """The routed experts' output [T, H] for this rank's tokens (see the module docstring)."""
    return two_batch.run_plain(dispatch_combine_stages(x, phys, w, expert_fn, ep_size, num_local, mode, capacity,
                                                       a2a))


def dispatch_combine_stages(x: torch.Tensor, phys: torch.Tensor, w: torch.Tensor, expert_fn: ExpertFn,
                            ep_size: int, num_local: int, mode: str, capacity: int,
                            a2a: AllToAll = ps.ep_all_to_all) -> two_batch.Stages:
    """``dispatch_combine`` as stages: a yield point after each all-to-all (two-batch overlap)."""
    if mode == "low_latency":
        return (yield from low_latency_stages(x, phys, w, expert_fn, ep_size, num_local, capacity, a2a))
    return (yield from normal_stages(x, phys, w, expert_fn, ep_size, num_local, a2a))


def _sum_slots(pair_out: torch.Tensor, t: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    return pair_out.view(t, k, pair_out.shape[-1]).float().sum(dim=1).to(dtype)


def normal(x: torch.Tensor, phys: torch.Tensor, w: torch.Tensor, expert_fn: ExpertFn, ep_size: int,
           num_local: int, a2a: AllToAll = ps.ep_all_to_all) -> torch.Tensor:
    return two_batch.run_plain(normal_stages(x, phys, w, expert_fn, ep_size, num_local, a2a))


def normal_stages(x: torch.Tensor, phys: torch.Tensor, w: torch.Tensor, expert_fn: ExpertFn, ep_size: int,
                  num_local: int, a2a: AllToAll = ps.ep_all_to_all) -> two_batch.Stages:
    t, h = x.shape
    k = phys.shape[1]
    phys = phys.long()
    dest, local = phys // num_local, phys % num_local
    hit = torch.zeros(t, ep_size, dtype=torch.bool, device=x.device)
    hit.scatter_(1, dest, True)
    nz = torch.nonzero(hit.t())  # (rank, token) pairs, by rank then token
    row_dest, send_tok = nz[:, 0], nz[:, 1]
    send_counts = hit.sum(dim=0)
    match = dest[send_tok] == row_dest[:, None]  # [n, k]: which of the row's slots that rank serves
    meta = torch.cat((torch.where(match, local[send_tok], -1).to(torch.float32),
                      torch.where(match, w[send_tok].float(), 0.0)), dim=1)
    recv_counts = yield from two_batch.collective(a2a, send_counts, kind="count_exchange")
    send_split, recv_split = send_counts.tolist(), recv_counts.tolist()
    recv_x = yield from two_batch.collective(a2a, x[send_tok], send_split, recv_split, kind="dispatch")
    recv_meta = yield from two_batch.collective(a2a, meta, send_split, recv_split, kind="dispatch_meta")
    recv_ids, recv_w = recv_meta[:, :k].to(torch.int64), recv_meta[:, k:]
    valid = recv_ids >= 0
    pr, pj = torch.nonzero(valid, as_tuple=True)  # row-major: by source rank, row, slot
    y = expert_fn(recv_x[pr], recv_w[pr, pj][:, None].contiguous(), recv_ids[pr, pj][:, None].to(torch.int32))
    per_src = torch.zeros(ep_size, dtype=torch.int64, device=x.device)
    src_of_row = torch.repeat_interleave(torch.arange(ep_size, device=x.device), recv_counts.to(x.device))
    per_src.index_add_(0, src_of_row, valid.sum(dim=1))
    back_split = torch.bincount(dest.flatten(), minlength=ep_size).tolist()
    back = yield from two_batch.collective(a2a, y, per_src.tolist(), back_split, kind="combine")
    si, sj = torch.nonzero(match, as_tuple=True)  # the same (row, slot) order the receivers used
    pair_out = x.new_zeros(t * k, h)
    pair_out[send_tok[si] * k + sj] = back
    return _sum_slots(pair_out, t, k, x.dtype)


def low_latency(x: torch.Tensor, phys: torch.Tensor, w: torch.Tensor, expert_fn: ExpertFn, ep_size: int,
                num_local: int, capacity: int, a2a: AllToAll = ps.ep_all_to_all) -> torch.Tensor:
    return two_batch.run_plain(low_latency_stages(x, phys, w, expert_fn, ep_size, num_local, capacity, a2a))


def low_latency_stages(x: torch.Tensor, phys: torch.Tensor, w: torch.Tensor, expert_fn: ExpertFn, ep_size: int,
                       num_local: int, capacity: int, a2a: AllToAll = ps.ep_all_to_all) -> two_batch.Stages:
    t, h = x.shape
    k = phys.shape[1]
    if t > capacity:
        raise ValueError(f"low-latency EP dispatch takes at most {capacity} tokens per rank, got {t}")
    p = ep_size * num_local
    flat = phys.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(p, dtype=torch.int64, device=x.device).index_add_(0, flat, torch.ones_like(flat))
    starts = torch.cumsum(counts, 0) - counts
    pos = torch.empty_like(flat)
    pos[order] = torch.arange(flat.numel(), device=x.device) - starts[flat[order]]
    slot = flat * capacity + pos  # < P * capacity: pos < T <= capacity
    send = x.new_zeros(p * capacity, h)
    send[slot] = x.repeat_interleave(k, dim=0)
    send_w = torch.zeros(p * capacity, dtype=torch.float32, device=x.device)
    send_w[slot] = w.reshape(-1).float()
    recv = yield from two_batch.collective(a2a, send, kind="dispatch_ll")
    recv_w = yield from two_batch.collective(a2a, send_w, kind="dispatch_ll_meta")
    ids = (torch.arange(p * capacity, device=x.device, dtype=torch.int32) // capacity) % num_local
    if x.is_cuda or STATIC_ON_CPU:  # static shapes (CUDA graphs): every slot row, padding weighs 0
        y = expert_fn(recv, recv_w[:, None], ids[:, None])
    else:  # no graphs on the CPU: only the filled slots (a padding row's output, 0, is never read)
        live = torch.nonzero(recv_w).flatten()
        y = recv.new_zeros(recv.shape)
        y[live] = expert_fn(recv[live], recv_w[live, None], ids[live, None])
    back = yield from two_batch.collective(a2a, y, kind="combine_ll")
    return _sum_slots(back[slot], t, k, x.dtype)
