"""How many CPU threads an engine process runs its kernels on, and which cores, so that the
processes of one machine never oversubscribe its cores.

Rules (issue 26, "threads and memory"):

- The budget is the cores this process may run on: its affinity mask (``sched_getaffinity``),
  capped by a container's CPU quota (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``).
  ``os.cpu_count()`` counts the host's cores, which a container or ``taskset`` may not own.
- Processes that compute side by side share the budget without overlap: the ranks of tensor
  parallelism on one node and the replicas of data parallelism each get a disjoint slice of the
  cores and are pinned to it (``TOKENFAB_CPUS``, set by the launcher for the child). Rank 0 of a TP
  group takes the first slice of its own share. With fewer cores than processes, each gets one core,
  shared round-robin.
- Processes that do no tensor work (the API server processes: HTTP, tokenizing, detokenizing) run
  torch with one thread, so an idle pool never competes with the engine core.
- The native C kernels follow the same count as torch's own kernels on every thread that steps the
  engine (``kernels/cpu/threads.c``), not only the thread that planned it.
- An explicit ``--cpu-threads N`` wins, then ``OMP_NUM_THREADS``; neither pins. Otherwise torch's own
  count stands (a caller's ``torch.set_num_threads``), cut to the budget.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path

import torch

from tokenfab.kernels.cpu import native_library

log = logging.getLogger("tokenfab")

CPUS_ENV = "TOKENFAB_CPUS"  # the cores a launcher gave this process, "0,1,4"
_CGROUP = Path("/sys/fs/cgroup")


@dataclasses.dataclass(frozen=True)
class CpuThreads:
    threads: int
    cpus: tuple[int, ...] | None  # pinned to these cores; None: not pinned
    why: str


def cgroup_cpu_limit(root: Path = _CGROUP) -> int | None:
    """Whole cores a container's CPU quota allows (rounded up), or None when there is no quota."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]  # cgroup v2: "max 100000" or "200000 100000"
        if quota != "max":
            return max(1, math.ceil(int(quota) / int(period)))
        return None
    except (OSError, ValueError):
        pass
    try:  # cgroup v1
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return max(1, math.ceil(quota_us / period_us)) if quota_us > 0 and period_us > 0 else None
    except (OSError, ValueError):
        return None


def usable_cpus(cgroup_root: Path = _CGROUP) -> list[int]:
    """The cores this process may use: its affinity mask, cut to the container's quota."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = list(range(os.cpu_count() or 1))
    limit = cgroup_cpu_limit(cgroup_root)
    return cpus[:limit] if limit is not None else cpus


def parse_cpus(text: str) -> tuple[int, ...]:
    """``"0,1,4"`` -> (0, 1, 4); ValueError naming the variable for anything else."""
    try:
        cpus = tuple(int(c) for c in text.split(",") if c.strip())
    except ValueError:
        cpus = ()
    if not cpus or min(cpus) < 0:
        raise ValueError(f"{CPUS_ENV} must be a comma-separated list of core numbers, got {text!r}")
    return cpus


_share_before_pin: list[int] | None = None  # this process's cores before apply_threads pinned it to its slice


def own_share(environ: Mapping[str, str] = os.environ) -> list[int]:
    """The cores this process hands out: its launcher's slice, else every core it could use before it
    pinned itself to its own slice (TP rank 0 pins to slice 0 and still splits the whole share)."""
    given = environ.get(CPUS_ENV)
    if given:
        return list(parse_cpus(given))
    return list(_share_before_pin) if _share_before_pin is not None else usable_cpus()


def split_cpus(cpus: list[int], parts: int) -> list[tuple[int, ...]]:
    """``parts`` disjoint slices of ``cpus`` (contiguous, sizes differing by at most one); with fewer
    cores than parts, one core each, round-robin."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    if len(cpus) < parts:
        return [(cpus[i % len(cpus)],) for i in range(parts)]
    bounds = [len(cpus) * i // parts for i in range(parts + 1)]
    return [tuple(cpus[bounds[i]:bounds[i + 1]]) for i in range(parts)]


def child_env(index: int, parts: int, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The environment entry that gives a child process (TP worker, DP replica) slice ``index`` of
    ``parts`` of this process's cores."""
    return {CPUS_ENV: ",".join(map(str, split_cpus(own_share(environ), parts)[index]))}


def plan_threads(requested: int | None = None, part: tuple[int, int] | None = None,
                 environ: Mapping[str, str] = os.environ) -> CpuThreads:
    """The thread plan of an engine process (see the module docstring for the order). ``part`` =
    (index, parts): this process takes that slice of its own share (rank 0 of a TP group, a
    torchrun rank among the node's local ranks)."""
    if requested is not None:
        if requested < 1:
            raise ValueError(f"--cpu-threads must be >= 1, got {requested}")
        return CpuThreads(requested, None, "--cpu-threads")
    if part is not None and part[1] > 1:
        cpus = split_cpus(own_share(environ), part[1])[part[0]]
        return CpuThreads(len(cpus), cpus, f"slice {part[0]} of {part[1]} of this node's cores (one per rank)")
    given = environ.get(CPUS_ENV)
    if given:
        cpus = parse_cpus(given)
        return CpuThreads(len(cpus), cpus, f"this process's slice of the node's cores ({CPUS_ENV})")
    omp = environ.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) > 0:
        return CpuThreads(int(omp), None, "OMP_NUM_THREADS")
    # torch's own count, cut to the budget: a caller's torch.set_num_threads(1) stands, and torch's
    # default (the host's cores in a container with a CPU quota) does not oversubscribe the quota
    n = min(len(usable_cpus()), torch.get_num_threads())
    return CpuThreads(n, None, "torch's thread count, at most the cores this process may use (affinity, quota)")


def apply_threads(plan: CpuThreads) -> CpuThreads:
    """Pin (when the plan says) and set torch's and the native kernels' thread counts."""
    global _share_before_pin
    if plan.cpus is not None and hasattr(os, "sched_setaffinity"):
        if _share_before_pin is None:
            _share_before_pin = own_share()
        try:
            os.sched_setaffinity(0, plan.cpus)
        except OSError as e:  # a core outside the allowed set: run unpinned rather than fail
            log.warning("cannot pin to cores %s (%s): running unpinned", plan.cpus, e)
    if torch.get_num_threads() != plan.threads:
        torch.set_num_threads(plan.threads)
    lib = native_library()
    if lib is not None:
        lib.tf_set_num_threads(plan.threads)
    log.info("CPU threads: %d (%s)%s", plan.threads, plan.why,
             f", pinned to cores {','.join(map(str, plan.cpus))}" if plan.cpus else "")
    return plan


def configure_engine_threads(requested: int | None = None, part: tuple[int, int] | None = None) -> CpuThreads:
    """Plan and apply the threads of a CPU engine process."""
    return apply_threads(plan_threads(requested, part))


def configure_api_process_threads() -> None:
    """An API server process does no tensor work: one torch thread, so it never competes with the
    engine core for cores."""
    torch.set_num_threads(1)  # (it runs no native kernel: the library is not built or loaded here)
