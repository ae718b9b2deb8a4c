"""A benchmark function run on TP spawned gloo ranks of this machine (the communication benchmarks:
``bench comm``, its ``--tbo`` mode): every rank's JSON result, in rank order."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable
from typing import Any


def _rank(rank: int, tp: int, port: int, out_dir: str, threads: int, fn: Callable[..., Any], args: tuple,
          ep_mode: str | None) -> None:
    import torch

    from tokenfab.distributed import ep_dispatch
    from tokenfab.distributed import parallel_state as ps

    torch.set_num_threads(threads)
    ps.init_distributed(rank, tp, init_method=f"tcp://127.0.0.1:{port}", backend="gloo")
    ps.init_parallel(tp)
    if ep_mode is not None:  # the MoE layers expert-parallel over the TP group
        ps.init_expert_parallel(True)
        if ep_mode:
            ep_dispatch.set_ep_mode(ep_mode)
    try:
        res = fn(*args)
    finally:
        ps.destroy_parallel()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)


def run_on_ranks(fn: Callable[..., Any], args: tuple, tp: int, out_dir: str, threads: int = 1,
                 ep_mode: str | None = None) -> list[Any]:
    """``fn(*args)`` (a module-level function: it is pickled) on ``tp`` spawned gloo ranks, ``threads``
    torch threads each, their results written under ``out_dir``. ``ep_mode``: None, no expert
    parallelism; "" expert parallel in the default mode; else that ``ep_dispatch`` mode."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(tp, port, out_dir, threads, fn, args, ep_mode), nprocs=tp, join=True)
    return [json.loads(open(os.path.join(out_dir, f"rank{r}.json")).read()) for r in range(tp)]
