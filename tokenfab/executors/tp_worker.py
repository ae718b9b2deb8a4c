"""A tensor-parallel worker (ranks 1..N-1): a model shard, its KV cache, and a loop that runs
whatever forward rank 0 announces (``executors/tp_executor.py`` holds the protocol).

The worker never schedules or samples. It loads the model exactly as rank 0 does (the layers
shard themselves from ``get_parallel_state()`` at build time), then waits for commands: ``RUNNER``
(build the KV cache with rank 0's block size, block count and dtype), ``FORWARD`` (receive the
batch, run the same forward, drop the logits), ``CAPTURE`` (CUDA graphs, in step with rank 0),
``EPLB`` (reset the expert-load counters or rebalance the MoE layers, in step with rank 0),
``STOP``. Any error ends the process (exit 1): rank 0 sees the closed connection and reports it;
a spawned worker also exits when its parent (rank 0) is gone.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import select
import sys
import threading
from typing import Any

import torch
import torch.distributed as dist

from tokenfab.distributed import two_batch
from tokenfab.engine.runner.cpu_threads import configure_engine_threads
from tokenfab.engine.runner.device_setup import (
    maybe_pack_cpu_weights,
    resolve_device,
    resolve_dtype,
    tune_cpu_allocator,
)
from tokenfab.engine.runner.model_runner import ModelRunner
from tokenfab.executors.eplb_engine import apply_action, moe_layers, redundant_experts
from tokenfab.executors.tp_protocol import (
    CMD_CAPTURE,
    CMD_EPLB,
    CMD_FORWARD,
    CMD_RUNNER,
    CMD_STOP,
    DTYPES,
    TPGroup,
    collective_timeout,
    join_group,
    payload_size,
    recv_header,
    run_forward,
    unpack_batch,
)
from tokenfab.loader.model_loader import load_model
from tokenfab.quant.kv_fp8 import configure_kv_cache

log = logging.getLogger("tokenfab.tp_worker")


class TPWorker:
    def __init__(self, args: Any, group: TPGroup) -> None:
        self.args = args
        self.group = group
        self.device = group.device
        self.dtype = resolve_dtype(args.dtype, self.device)
        self.model = load_model(args.model, self.dtype, self.device, args.max_model_len,
                                quantization=args.quantization).model
        if self.device.type == "cpu":
            tune_cpu_allocator()
        maybe_pack_cpu_weights(self.model, self.device, args.cpu_weight_packing)
        # what LLMEngine does to the model after the load, so both sides run the same forward
        configure_kv_cache(self.model, args.kv_cache_dtype, args.kv_cache_dtype_skip_layers)  # FP8 KV layers
        two_batch.configure_from_args(args)  # two-batch overlap as on rank 0 (same collectives, same order)
        self.runner: Any = None
        self.steps = 0

    @torch.inference_mode()
    def loop(self) -> None:
        while True:
            h = recv_header(self.group)
            cmd = h[0]
            if cmd == CMD_FORWARD:
                payload = torch.empty(payload_size(h), dtype=torch.int64, device=self.device)
                dist.broadcast(payload, 0, group=self.group.tp_group)
                run_forward(self.runner, h[1], unpack_batch(h, payload))
                self.steps += 1
            elif cmd == CMD_RUNNER:
                self.runner = None  # the previous (profiling) cache goes first
                self.runner = ModelRunner(self.model, self.device, DTYPES[h[3]], h[1], h[2])
                if self.args.speculative_config is not None:  # as rank 0's: verify rows round as decode rows
                    self.runner.batch_invariant = True
            elif cmd == CMD_CAPTURE:
                self.runner.capture_decode_graphs(h[1], h[2])
            elif cmd == CMD_EPLB:
                apply_action(moe_layers(self.model), h[1])
            elif cmd == CMD_STOP:
                return
            else:
                raise RuntimeError(f"unknown tensor-parallel command {cmd}")


def _exit_with_parent(parent_pid: int) -> None:
    try:
        fd = os.pidfd_open(parent_pid)
    except (AttributeError, OSError):
        return
    select.select([fd], [], [])
    log.warning("rank 0 (pid %d) is gone: the tensor-parallel worker exits", parent_pid)
    os._exit(0)


def run_worker(args: Any, rank: int, world: int, init_method: str | None, local_rank: int = 0,
               store: Any = None) -> int:
    """Join the group as ``rank`` and serve rank 0's commands until STOP; the exit code."""
    device = resolve_device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    group = join_group(rank, world, init_method, device, store=store, expert_parallel=args.enable_expert_parallel,
                       num_redundant_experts=redundant_experts(args))
    try:
        worker = TPWorker(args, group)
        worker.loop()
    except Exception:
        log.exception("tensor-parallel worker rank %d failed", rank)
        return 1
    try:
        dist.destroy_process_group()
    except Exception:  # pragma: no cover
        pass
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m tokenfab.executors.tp_worker``: a worker spawned by ``TPExecutor.start`` on this node."""
    parser = argparse.ArgumentParser(prog="tokenfab-tp-worker")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--args-json", required=True)
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s tp-rank{ns.rank}: %(message)s")
    threading.Thread(target=_exit_with_parent, args=(ns.parent_pid,), daemon=True).start()
    # rank 0's EngineArgs, validated there (``dataclasses.asdict``): the worker reads them as attributes
    args = argparse.Namespace(**json.loads(ns.args_json))
    if resolve_device(args.device).type == "cpu":  # the slice of the node's cores rank 0 gave us (TOKENFAB_CPUS)
        configure_engine_threads(args.cpu_threads)
    store = dist.TCPStore("127.0.0.1", ns.port, ns.world, is_master=False, timeout=collective_timeout())
    store.set(f"tokenfab/worker{ns.rank}", "1")
    return run_worker(args, ns.rank, ns.world, None, local_rank=ns.rank, store=store)


def torchrun_worker_main(args: Any) -> int:
    """A non-zero torchrun rank of ``tokenfab serve``: the worker loop (env:// rendezvous)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.tensor_parallel_size not in (1, world):
        print(f"tokenfab serve: --tensor-parallel-size {args.tensor_parallel_size} must equal torchrun's world "
              f"size {world}", file=sys.stderr)
        return 2
    args.tensor_parallel_size = world
    if resolve_device(args.device).type == "cpu":  # this node's cores split over its local ranks
        local = (int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", world)))
        configure_engine_threads(getattr(args, "cpu_threads", None), local)
    return run_worker(args, rank, world, "env://", local_rank=int(os.environ.get("LOCAL_RANK", 0)))


if __name__ == "__main__":
    sys.exit(main())
