"""One row of ``tokenfab bench kernels`` and how it is timed: the ``Row`` record (our time, the
roofline fraction, the fastest plain-PyTorch peer), ``make_row`` (the row from the measured times),
and the median-time helpers on CUDA (CUDA events, L2 flush) and CPU (wall clock)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Row:
    op: str
    shape: str
    dtype: str
    metric: str  # "GB/s" or "TFLOP/s"
    time_us: float
    value: float  # achieved GB/s or TFLOP/s
    ceiling: float  # measured copy GB/s or matrix TFLOP/s of this run
    fraction_of_ceiling: float
    peer: str
    peer_time_us: float | None
    speedup_vs_peer: float | None
    max_abs_err: float | None
    notes: str = ""
    extra: dict = field(default_factory=dict)
    peer_fraction_of_ceiling: float | None = None  # the fastest peer's value / the same ceiling


def _bench_cuda(fn: Callable[[], object], rep_ms: float) -> float:
    """Median milliseconds of ``fn`` with CUDA events (triton's do_bench: warm-up, L2 flush)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=max(rep_ms / 4, 10), rep=rep_ms, return_mode="median"))


def _bench_cpu(fn: Callable[[], object], rep_ms: float) -> float:
    fn()
    times = []
    deadline = time.perf_counter() + rep_ms / 1000
    while not times or (time.perf_counter() < deadline and len(times) < 20):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    times.sort()
    return times[len(times) // 2]


def make_row(name: str, op: str, shape: str, dtype: str, flops: bool, amount: float, t_ms: float,
             peers: list, peer_times: dict, max_abs_err: float | None, measured: dict) -> Row:
    """The row of op ``name``: ``amount`` FLOPs (``flops``) or bytes moved in ``t_ms``, against this
    run's ceiling (matrix TFLOP/s or copy GB/s) and the fastest peer that has a time."""
    value = amount / (t_ms * 1e-3) / (1e12 if flops else 1e9)
    ceiling = measured.get("matmul_TFLOPs" if flops else "copy_GBps")
    timed_peers = {k: v for k, v in peer_times.items() if isinstance(v, float)}
    peer_name = min(timed_peers, key=timed_peers.get) if timed_peers else (peers[0][0] if peers else "-")
    tp_ms = timed_peers.get(peer_name)
    peer_value = amount / (tp_ms * 1e-3) / (1e12 if flops else 1e9) if tp_ms else None
    return Row(
        op=op, shape=shape, dtype=dtype, metric="TFLOP/s" if flops else "GB/s",
        time_us=t_ms * 1e3, value=value, ceiling=ceiling or 0.0,
        fraction_of_ceiling=(value / ceiling) if ceiling else 0.0,
        peer=peer_name, peer_time_us=tp_ms * 1e3 if tp_ms else None,
        speedup_vs_peer=(tp_ms / t_ms) if tp_ms else None, max_abs_err=max_abs_err,
        notes="sample: max_abs_err is the fraction of rows drawing another token" if name == "sample" else "",
        extra={"peers_us": {k: (v * 1e3 if isinstance(v, float) else v) for k, v in peer_times.items()}},
        peer_fraction_of_ceiling=(peer_value / ceiling) if (peer_value and ceiling) else None,
    )
