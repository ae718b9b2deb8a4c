"""The roofline of `tokenfab bench cpu`: what this machine could do at best, measured in the same run.

- memory bandwidth: a large-array copy (``torch.Tensor.copy_`` of ``size_mb`` MB, far past the
  caches), counted STREAM-style as bytes read + bytes written per second, in the threads the
  engines use;
- compute: a large float32 matmul through torch (oneDNN/MKL: FMA units, the attained peak, not the
  datasheet one) and an int8 matmul (``torch._int_mm``: VNNI/AMX where torch's kernel uses them;
  absent where this torch has none for the CPU);
- the model's side, read from the GGUF: the bytes of all its tensors (every one is read per
  decode step: the token embedding is tied to the output head) and its parameter count (a token
  of prefill costs about two FLOPs per weight, attention left out).

A decode step reads the weights once whatever the batch, so B sequences decode at most
``B x bandwidth / weight bytes`` tokens/s (KV reads left out), and never faster than compute
allows; prefill is bound by ``peak FLOP/s / (2 x parameters)``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import gguf
import torch


def _best_seconds(fn, repeats: int) -> float:
    fn()  # warm: pages touched, kernels picked
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def copy_bandwidth(size_mb: int = 512, repeats: int = 5) -> dict[str, Any]:
    """GB/s of a ``size_mb`` MB copy, read + write bytes counted (the best of ``repeats``)."""
    n = size_mb * 2**20 // 4
    src = torch.ones(n, dtype=torch.float32)
    dst = torch.empty_like(src)
    sec = _best_seconds(lambda: dst.copy_(src), repeats)
    return {"what": f"torch copy_ of {size_mb} MiB float32, (read + write) bytes / s, best of {repeats}",
            "bytes": 2 * n * 4, "seconds": sec, "gb_s": 2 * n * 4 / sec / 1e9, "threads": torch.get_num_threads()}


def fma_peak(n: int = 2048, repeats: int = 3) -> dict[str, Any]:
    """GFLOP/s of an n x n x n float32 torch matmul (2 n^3 FLOPs): the FMA units as torch reaches them."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    sec = _best_seconds(lambda: torch.mm(a, b), repeats)
    return {"what": f"float32 torch.mm {n}x{n}x{n} (oneDNN/MKL; an attained FMA peak, not the datasheet one)",
            "gflop_s": 2 * n**3 / sec / 1e9, "seconds": sec, "threads": torch.get_num_threads()}


def int8_peak(n: int = 2048, repeats: int = 3) -> dict[str, Any] | None:
    """GOP/s of an n x n x n int8 x int8 -> int32 ``torch._int_mm`` (VNNI/AMX where torch uses them);
    None where this torch build has no such CPU kernel."""
    if not hasattr(torch, "_int_mm"):
        return None
    a = torch.randint(-128, 127, (n, n), dtype=torch.int8)
    b = torch.randint(-128, 127, (n, n), dtype=torch.int8)
    try:
        sec = _best_seconds(lambda: torch._int_mm(a, b), repeats)
    except RuntimeError:
        return None
    return {"what": f"int8 torch._int_mm {n}x{n}x{n} -> int32 (VNNI/AMX proxy: whatever torch's CPU kernel uses)",
            "gop_s": 2 * n**3 / sec / 1e9, "seconds": sec, "threads": torch.get_num_threads()}


def gguf_weights(path: str | Path) -> dict[str, Any]:
    """The GGUF's tensor bytes, parameter count and tensor types (``{type: count}``)."""
    reader = gguf.GGUFReader(str(path))
    types: dict[str, int] = {}
    for t in reader.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    return {"path": str(path), "tensors": len(reader.tensors),
            "weight_bytes": sum(int(t.n_bytes) for t in reader.tensors),
            "parameters": sum(int(t.n_elements) for t in reader.tensors), "tensor_types": types}


def decode_bound(batch: int, bandwidth_gb_s: float, weight_bytes: int, flop_s: float | None = None,
                 parameters: int | None = None) -> float:
    """Tokens/s that ``batch`` sequences can decode at most: one weight read per step, and
    (when given) no faster than ``flop_s / (2 x parameters)``."""
    bound = batch * bandwidth_gb_s * 1e9 / weight_bytes
    if flop_s and parameters:
        bound = min(bound, prefill_bound(flop_s, parameters))
    return bound


def prefill_bound(flop_s: float, parameters: int) -> float:
    """Prompt tokens/s at most: two FLOPs per weight per token (attention left out)."""
    return flop_s / (2 * parameters)


def measure(model_path: str | Path, tiny: bool = False) -> dict[str, Any]:
    """All the probes at once (``tiny``: small sizes, for tests: the figures then mean little)."""
    return {
        "copy": copy_bandwidth(size_mb=16 if tiny else 512, repeats=1 if tiny else 5),
        "fp32_matmul": fma_peak(n=128 if tiny else 2048, repeats=1 if tiny else 3),
        "int8_matmul": int8_peak(n=128 if tiny else 2048, repeats=1 if tiny else 3),
        "model": gguf_weights(model_path),
    }
