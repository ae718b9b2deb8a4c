"""Attention data-parallel + expert-parallel serving (``--data-parallel-size N --enable-expert-parallel``).

DeepSeek's serving layout: N engine-core replicas (``engine/core/dp_client.py``), each with its own
requests and its own KV (latent) cache, form one torch.distributed world (rank = DP rank) whose
MoE layers are expert-parallel over all N ranks (``init_parallel(1)`` + ``init_expert_parallel``,
EP mode "normal": it needs no agreement between ranks with different batches).

The MoE all-to-alls of every rank must meet, so the replicas' run loops step in lockstep
(``run_lockstep``): each iteration every replica all-reduces [busy, stop] (MAX, a gloo group on
the host); if any is busy, every rank steps — a busy one its engine step (exactly one forward),
an idle one the empty MoE pass (``idle_pass``: a zero-token batch through each FusedMoE layer).
When no rank is busy they wait for work in ``poll`` (``IDLE_POLL_MS``), then all-reduce again.
A stop (shutdown, API server gone) on any rank stops all of them together.

A dead replica cannot be stepped around (the collectives would hang): the flag all-reduce fails
(gloo sees the closed connection), each survivor tells its front ends ``dead`` and exits 1, and
``DPClient`` in this mode treats one dead replica as all dead (the server answers 503).

Limits: TP 1 per replica; no speculative decoding, async scheduling, EPLB or two-batch overlap
(each would change the number of MoE calls per step on one rank only); eager mode on CUDA.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tokenfab.distributed import admission, ep_dispatch, parallel_state
from tokenfab.engine.requests.errors import EngineDeadError
from tokenfab.executors.tp_protocol import collective_timeout
from tokenfab.layers.moe import FusedMoE

log = logging.getLogger("tokenfab.dp")

MASTER_ENV = "TOKENFAB_DP_EP_MASTER"  # "host:port" of rank 0's rendezvous; set by dp_client in this mode
SIZE_ENV = "TOKENFAB_DP_SIZE"
RANK_ENV = "TOKENFAB_DP_RANK"
IDLE_POLL_MS = 20  # how long an idle replica waits for work between two flag all-reduces
_FLAG_TIMEOUT = timedelta(days=365)  # a busy peer may take long; a dead one closes the connection


def dp_ep_enabled(args: Any) -> bool:
    """Whether ``args`` ask for attention-DP + EP (checked on the API server's side)."""
    return admission.dp_ep_enabled(args.data_parallel_size, args.enable_expert_parallel)


def validate_dp_ep(args: Any) -> None:
    """Refuse the options this layout cannot keep in lockstep yet (a clear error before any load); the rule
    lives in ``distributed/admission.py``, shared with ``tokenfab plan``."""
    if not dp_ep_enabled(args):
        return
    admission.check_dp_ep(args.data_parallel_size, args.enable_expert_parallel, args.tensor_parallel_size,
                          speculative=args.speculative_config is not None, async_scheduling=bool(args.async_scheduling),
                          eplb=args.eplb_config is not None, two_batch_overlap=bool(args.enable_two_batch_overlap))


def replica_env(rank: int, size: int, master: str) -> dict[str, str]:
    return {RANK_ENV: str(rank), SIZE_ENV: str(size), MASTER_ENV: master}


class Lockstep:
    """One replica's side of the lockstep: the flag all-reduce and the empty MoE pass.

    ``all_reduce_max``: a [2] int64 tensor reduced (MAX) in place over every replica (injected by
    tests); ``moes``: the model's FusedMoE layers, in forward order."""

    def __init__(self, all_reduce_max: Callable[[torch.Tensor], None], moes: list[torch.nn.Module],
                 device: torch.device, dtype: torch.dtype, rank: int = 0) -> None:
        self.rank = rank
        self.all_reduce_max = all_reduce_max
        self.moes = moes
        self.device = device
        self.dtype = dtype
        self.moe_calls = 0  # calls of the first MoE layer (one per forward)
        self.idle_steps = 0
        self.busy_steps = 0
        if moes:  # the models call ``mlp.forward`` directly (no hooks run): count on the instance
            first, inner = moes[0], moes[0].forward

            def counted(*a: Any, **kw: Any) -> Any:
                self.moe_calls += 1
                return inner(*a, **kw)

            first.forward = counted

    def sync(self, busy: bool, stop: bool) -> tuple[bool, bool]:
        """(any replica busy, any replica stopping); raises EngineDeadError when a peer is gone."""
        flags = torch.tensor([int(busy), int(stop)], dtype=torch.int64)
        try:
            self.all_reduce_max(flags)
        except Exception as e:  # gloo: the peer's connection closed, or a timeout
            raise EngineDeadError(f"a data-parallel + expert-parallel peer replica is gone ({e}); "
                                  "this replica cannot continue alone") from e
        return bool(flags[0]), bool(flags[1])

    @torch.inference_mode()
    def idle_pass(self) -> None:
        """A zero-token batch through every MoE layer: this rank's side of the step's all-to-alls."""
        self.idle_steps += 1
        for m in self.moes:
            m(torch.empty(0, m.hidden_size, device=self.device, dtype=self.dtype))

    def step(self, run_step: Callable[[], None]) -> int:
        """A busy rank's step: ``run_step`` (the engine step); a step that ran no forward (nothing
        schedulable, or it failed before the model) still takes part with the empty pass. Returns
        the forwards the step ran (more than one breaks the lockstep: the caller ends the replica)."""
        before = self.moe_calls
        run_step()
        calls = self.moe_calls - before
        self.busy_steps += 1
        if self.busy_steps == 1:
            log.info("attention-DP + EP replica %d: serving its first requests", self.rank)
        if calls == 0:
            self.idle_pass()
        return calls


def join_world(device: torch.device) -> tuple[int, int, Any]:
    """Join the replicas' world from the environment dp_client set; EP over all ranks, TP 1.
    Returns (rank, size, the gloo group of the flag all-reduce)."""
    rank, size, master = int(os.environ[RANK_ENV]), int(os.environ[SIZE_ENV]), os.environ[MASTER_ENV]
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=f"tcp://{master}", rank=rank, world_size=size,
                            timeout=collective_timeout())
    parallel_state.init_parallel(1)
    parallel_state.init_expert_parallel(True)
    ep_dispatch.set_ep_mode("normal")  # the ranks' batches differ: a mode that needs no agreement
    flags = dist.new_group(list(range(size)), backend="gloo", timeout=_FLAG_TIMEOUT)
    log.info("attention-DP + EP: replica %d of %d joined (%s)", rank, size, backend)
    return rank, size, flags


def make_lockstep(engine: Any, flag_group: Any, rank: int = 0) -> Lockstep:
    moes = [m for m in engine.runner.model.modules() if isinstance(m, FusedMoE)]
    if not moes:
        log.warning("attention-DP + EP on a model without MoE layers: the replicas only step together")

    def all_reduce_max(t: torch.Tensor) -> None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=flag_group)

    return Lockstep(all_reduce_max, moes, engine.device, engine.dtype, rank)


def run_lockstep(core: Any, lock: Lockstep, poller: Any) -> None:
    """``EngineCore.run`` in this mode (see the module docstring); returns when every rank stops."""
    try:
        _loop(core, lock, poller)
    finally:
        log.info("attention-DP + EP replica %d stops: %d engine steps, %d empty MoE passes", lock.rank,
                 lock.busy_steps, lock.idle_steps)


def _loop(core: Any, lock: Lockstep, poller: Any) -> None:
    engine = core.engine
    while True:
        busy = engine.has_unfinished_requests()
        events = dict(poller.poll(0 if busy else IDLE_POLL_MS))
        if core._parent_gone(events):
            log.warning("the API server process is gone: the engine core stops with its peers")
            core._stop = True
        if core.sock in events or busy:
            core._drain()
        try:
            any_busy, any_stop = lock.sync(engine.has_unfinished_requests(), core._stop)
        except EngineDeadError as e:
            core._die(e)
        if any_stop:
            return
        if any_busy:
            try:
                calls = lock.step(core._step) if engine.has_unfinished_requests() else lock.idle_pass()
            except EngineDeadError:
                raise  # core._step told the front ends already
            except Exception as e:  # the empty pass's collectives failed: a peer is gone
                core._die(EngineDeadError(f"the expert-parallel empty pass failed ({e})"))
            if calls is not None and calls > 1:
                core._die(EngineDeadError(f"an engine step ran {calls} forwards: the expert-parallel "
                                          "lockstep is broken"))
        core._flush_stats()
        core._heartbeat()
