"""Shared SPMD launcher for the multi-process (gloo) tests.

``run_ranks(fn, world_size, *args)`` spawns ``world_size`` processes with torch.multiprocessing, joins
them to one gloo process group on a free loopback port (``parallel_state.init_distributed``), calls
``fn(rank, *args)`` in each, and returns every rank's result in rank order. ``fn`` must be a
module-level (picklable) function; its result must be picklable. ``fn`` makes its own groups
(``parallel_state.init_parallel(tp, ...)``); the launcher tears the state down afterwards. A rank that
raises fails the whole call with that rank's traceback (torch.multiprocessing's ProcessRaisedException).
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable[..., Any], world_size: int, port: int, out_dir: str, threads: int,
           args: tuple) -> None:
    from tokenfab.distributed import parallel_state as ps

    torch.set_num_threads(threads)
    ps.init_distributed(rank, world_size, init_method=f"tcp://127.0.0.1:{port}", backend="gloo")
    try:
        result = fn(rank, *args)
    finally:
        ps.destroy_parallel()
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, threads: int = 1) -> list[Any]:
    """Run ``fn(rank, *args)`` on ``world_size`` gloo ranks; their results in rank order."""
    with tempfile.TemporaryDirectory(prefix="tokenfab-ranks-") as out:
        mp.spawn(_entry, args=(fn, world_size, free_port(), out, threads, args), nprocs=world_size, join=True)
        results = []
        for r in range(world_size):
            with open(os.path.join(out, f"rank{r}.pkl"), "rb") as f:
                results.append(pickle.load(f))
    return results
