"""Tensor-parallel execution, rank 0's side: start (or join) the TP group, feed the workers each
step's batch, and watch them.

Rank 0 is the engine (scheduler, sampler, the API's engine core); ranks 1..N-1 only hold a model
shard and its KV cache (``executors/tp_worker.py``). Each model step, rank 0 broadcasts the step's
``ForwardBatch`` (a fixed 16-int header over a gloo command group, then all the batch's int tensors
concatenated into one int64 tensor over the TP group: no pickle anywhere) and then runs its own
forward; every worker runs the same forward, so their all-reduces / all-gathers meet. Only rank 0
samples: the TP group's tokens are consistent by construction. Everything that fixes the KV cache
layout (block size, number of blocks, dtype) is decided on rank 0 and sent in the ``RUNNER``
command before any forward.

Launch: with ``WORLD_SIZE`` > 1 in the environment (``torchrun``), rank 0 joins the env://
rendezvous and the other ranks are ``tokenfab serve`` processes that run the worker loop. Otherwise
N-1 workers are spawned on this node (``python -m tokenfab.executors.tp_worker``: nothing of the
caller's ``__main__`` is re-run; a TCPStore on a free loopback port; gloo on CPU / NCCL on CUDA).

Failure: the command group waits without a deadline (the server may idle for hours), the TP
group's collectives with a bounded one (``TOKENFAB_TP_TIMEOUT``, default 120 s). Spawned workers
are watched through their pidfds: a dead worker marks the executor dead at once
(``dead``, ``death_fd`` becomes readable, ``on_death`` callbacks run); a collective in flight fails
within seconds (gloo sees the closed connection) or at the timeout. Any failure of a TP forward is
an ``EngineDeadError``: the group is out of step and cannot be trusted any more.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from tokenfab.distributed.parallel_state import destroy_parallel
from tokenfab.engine.requests.errors import EngineDeadError
from tokenfab.engine.runner.cpu_threads import child_env
from tokenfab.engine.runner.device_setup import resolve_device
from tokenfab.engine.runner.model_runner import ModelRunner
from tokenfab.executors.eplb_engine import redundant_experts
from tokenfab.executors.tp_protocol import (
    CMD_CAPTURE,
    CMD_EPLB,
    CMD_RUNNER,
    CMD_STOP,
    DTYPES,
    HEADER_LEN,
    MODE_EXECUTE,
    MODE_LOGITS,
    MODE_SCORING,
    TPGroup,
    batch_header,
    collective_timeout,
    free_port,
    join_group,
    pack_batch,
    run_forward,
    send_header,
)
from tokenfab.forward_batch import ForwardBatch
from tokenfab.speculative.config import SpeculativeConfig

log = logging.getLogger("tokenfab.tp")

def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1


# ---- rank 0 ----------------------------------------------------------------------------------
def start_tensor_parallel(args: Any) -> TPExecutor:
    """Validate ``args.tensor_parallel_size`` and bring the TP group up with this process as rank 0."""
    tp = args.tensor_parallel_size
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {tp!r}")
    spec = SpeculativeConfig.parse(args.speculative_config)
    if spec is not None and spec.method not in ("ngram", "suffix"):  # their draft modules run on rank 0 only
        raise ValueError(f"speculative_config: method {spec.method!r} does not run under tensor parallelism yet "
                         "(ngram and suffix do)")
    executor = TPExecutor.start(args)
    atexit.register(executor.shutdown)
    return executor


class TPExecutor:
    """Rank 0's handle on the TP group (see the module docstring)."""

    def __init__(self, group: TPGroup, procs: list[Any]) -> None:
        self.group = group
        self.procs = procs  # spawned workers (subprocess.Popen), rank i+1 at index i
        self.dead: str | None = None
        self.on_death: list[Callable[[str], None]] = []
        self._death_r, self._death_w = os.pipe()
        self._stop_r, self._stop_w = os.pipe()
        self._closed = False
        self.bytes_sent = 0  # batch payload + header bytes broadcast (the TP step's control traffic)
        self._watcher = None
        if procs:
            self._watcher = threading.Thread(target=self._watch, name="tokenfab-tp-watch", daemon=True)
            self._watcher.start()

    @property
    def death_fd(self) -> int:
        """Readable once a worker is known dead."""
        return self._death_r

    @classmethod
    def start(cls, args: Any) -> TPExecutor:
        """Join (torchrun) or spawn the TP group of ``args.tensor_parallel_size`` ranks; this
        process is rank 0. Returns once every rank joined."""
        tp = args.tensor_parallel_size
        device = resolve_device(args.device)
        if launched_by_torchrun():
            world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
            if world != tp:
                raise ValueError(f"--tensor-parallel-size {tp} must equal torchrun's world size {world}")
            if rank != 0:
                raise RuntimeError("only rank 0 builds the engine; other ranks run the worker loop")
            return cls(join_group(0, world, "env://", device, expert_parallel=args.enable_expert_parallel,
                                  num_redundant_experts=redundant_experts(args)), [])
        # our own spawner: a TCPStore on a free loopback port, the workers as `python -m
        # tokenfab.executors.tp_worker` (no re-import of the caller's __main__); a worker that dies
        # before the group forms fails the start at once instead of at the rendezvous timeout
        port = free_port()
        store = dist.TCPStore("127.0.0.1", port, tp, is_master=True, timeout=collective_timeout(),
                              wait_for_workers=False)
        wire = json.dumps(dataclasses.asdict(args))
        procs = []
        try:
            for r in range(1, tp):
                # on CPU each rank gets its own slice of this process's cores (rank 0 keeps slice 0)
                env = None if device.type != "cpu" or args.cpu_threads else {**os.environ, **child_env(r, tp)}
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "tokenfab.executors.tp_worker", "--rank", str(r), "--world", str(tp),
                     "--port", str(port), "--parent-pid", str(os.getpid()), "--args-json", wire], env=env))
            deadline = time.monotonic() + collective_timeout().total_seconds()
            keys = [f"tokenfab/worker{r}" for r in range(1, tp)]
            while not store.check(keys):
                gone = [(i + 1, p.returncode) for i, p in enumerate(procs) if p.poll() is not None]
                if gone:
                    raise RuntimeError(f"tensor-parallel worker rank {gone[0][0]} exited before joining "
                                       f"(exit code {gone[0][1]}; see its log)")
                if time.monotonic() > deadline:
                    raise RuntimeError("tensor-parallel workers did not join in time")
                time.sleep(0.05)
            group = join_group(0, tp, None, device, store=store, expert_parallel=args.enable_expert_parallel,
                               num_redundant_experts=redundant_experts(args))
        except BaseException:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
            raise
        log.info("tensor parallel: %d ranks (workers pid %s)", tp, ", ".join(str(p.pid) for p in procs))
        return cls(group, procs)

    # ---- commands ----
    def _send(self, *ints: int) -> None:
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        try:
            send_header(self.group, *ints)
        except Exception as e:
            raise self._dead_error(e) from e
        self.bytes_sent += HEADER_LEN * 8

    def make_runner(self, model: Any, device: torch.device, dtype: torch.dtype, block_size: int,
                    num_blocks: int) -> TPRunner:
        """A ``ModelRunner`` here and its twin on every worker (the same cache layout)."""
        self._send(CMD_RUNNER, block_size, num_blocks, DTYPES.index(dtype))
        return TPRunner(self, ModelRunner(model, device, dtype, block_size, num_blocks))

    def send_forward(self, mode: int, batch: ForwardBatch) -> None:
        header = batch_header(mode, batch)
        self._send(*header)
        payload = pack_batch(batch)
        try:
            dist.broadcast(payload, 0, group=self.group.tp_group)
        except Exception as e:
            raise self._dead_error(e) from e
        self.bytes_sent += payload.numel() * 8

    def send_capture(self, max_batch: int, max_model_len: int) -> None:
        self._send(CMD_CAPTURE, max_batch, max_model_len)

    def send_eplb(self, action: int) -> None:
        """An EPLB action between two forwards; the workers apply it to their layers as rank 0 does."""
        self._send(CMD_EPLB, action)

    def _dead_error(self, error: BaseException) -> EngineDeadError:
        if isinstance(error, EngineDeadError):
            return error
        if self.dead is None and self._watcher is not None:  # a worker's death is the likely cause: name it
            select.select([self._death_r], [], [], 2.0)
        first = str(error).strip().splitlines()[0][:300] if str(error).strip() else repr(error)
        why = self.dead or f"a tensor-parallel step failed (a worker crashed, hung or failed): {first}"
        self._mark_dead(why)
        return EngineDeadError(why)

    # ---- watching ----
    def _watch(self) -> None:
        fds = {}
        for i, p in enumerate(self.procs):
            try:
                fds[os.pidfd_open(p.pid)] = (i + 1, p)
            except OSError:  # already gone: its pidfd cannot be opened
                self._report(i + 1, p)
                return
        try:
            ready = select.select([self._stop_r, *fds], [], [])[0]
            if self._stop_r in ready or self._closed:
                return
            self._report(*fds[ready[0]])
        finally:
            for fd in fds:
                os.close(fd)

    def _report(self, rank: int, p: subprocess.Popen) -> None:
        code = p.wait()
        how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
        self._mark_dead(f"tensor-parallel worker rank {rank} (pid {p.pid}) died ({how})")

    def _mark_dead(self, message: str) -> None:
        if self.dead is not None or self._closed:
            return
        self.dead = message
        log.error("%s", message)
        try:
            os.write(self._death_w, b"x")
        except OSError:
            pass
        for cb in list(self.on_death):
            try:
                cb(message)
            except Exception:  # pragma: no cover
                log.exception("on_death callback failed")

    # ---- shutdown ----
    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the workers (a STOP command; killed if they do not exit) and leave the group."""
        if self._closed:
            return
        if self.dead is None:
            try:
                send_header(self.group, CMD_STOP)
            except Exception:
                pass
        self._closed = True
        try:
            os.write(self._stop_w, b"x")
        except OSError:
            pass
        for p in self.procs:
            try:
                p.wait(timeout if self.dead is None else 0.5)  # a broken group: the others may be stuck
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        try:
            destroy_parallel()
        except Exception:  # pragma: no cover - a broken group
            log.debug("destroy_process_group failed", exc_info=True)
        if self._watcher is not None:
            self._watcher.join(2)
        for fd in (self._death_r, self._death_w, self._stop_r, self._stop_w):
            try:
                os.close(fd)
            except OSError:
                pass


class TPRunner:
    """A ``ModelRunner`` whose forwards are mirrored on the workers: each broadcasts the batch
    first. Everything else (``prepare``, the cache, ...) is the local runner's."""

    def __init__(self, executor: TPExecutor, runner: ModelRunner) -> None:
        object.__setattr__(self, "executor", executor)
        object.__setattr__(self, "runner", runner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)

    def __setattr__(self, name: str, value: Any) -> None:  # settings (batch_invariant, ...) are the runner's
        setattr(self.runner, name, value)

    def prepare(self, *args: Any, **kwargs: Any) -> ForwardBatch:
        return self.runner.prepare(*args, **kwargs)

    def _run(self, mode: int, batch: ForwardBatch) -> Any:
        ex = self.executor
        ex.send_forward(mode, batch)
        try:
            return run_forward(self.runner, mode, batch)
        except Exception as e:  # the workers may be waiting in a collective: the group is out of step
            raise ex._dead_error(e) from e

    @torch.inference_mode()
    def execute(self, batch: ForwardBatch) -> torch.Tensor:
        return self._run(MODE_EXECUTE, batch)

    @torch.inference_mode()
    def execute_scoring(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self._run(MODE_SCORING, batch)

    def forward_logits(self, batch: ForwardBatch) -> torch.Tensor:
        return self._run(MODE_LOGITS, batch)

    def capture_decode_graphs(self, max_batch: int, max_model_len: int) -> None:
        self.executor.send_capture(max_batch, max_model_len)
        self.runner.capture_decode_graphs(max_batch, max_model_len)
