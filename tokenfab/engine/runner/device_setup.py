"""Where and how the engine runs: device, dtype, memory figures, CPU allocator and weight packing."""

from __future__ import annotations

import logging
import os

import torch

from tokenfab.engine.runner.model_runner import kv_bytes_per_token
from tokenfab.layers.ggml_linear import packed_bytes
from tokenfab.layers.linear import prepack_cpu_linears
from tokenfab.quant.memory import describe_report, quantized_bytes, weight_bytes_report

log = logging.getLogger("tokenfab")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {name!r}")
    if name == "float16" and device.type == "cuda":
        raise ValueError(
            "--dtype float16 is not supported on CUDA: the Triton kernels are compiled and tested for "
            "float32 and bfloat16 only; use --dtype bfloat16 (same memory) or float32"
        )
    return _DTYPES[name]


def physical_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def default_cpu_kv_bytes() -> int:
    """CPU default: 2 GiB, or a quarter of the machine's memory when that is less."""
    return min(2 << 30, physical_memory_bytes() // 4)


def tune_cpu_allocator() -> bool:
    """Keep freed memory in the process (glibc): a CPU step allocates and frees the same large
    activations every time, and by default glibc returns them to the OS (mmap for blocks over
    128 KB-32 MB, heap trimming), so every step page-faults them in again: ~1M faults a run of
    the throughput benchmark, 8-10% of its time. The cost is that the process keeps its peak
    heap. ``TOKENFAB_CPU_MALLOC_TUNING=0`` leaves the allocator alone. Returns whether it applied."""
    if os.environ.get("TOKENFAB_CPU_MALLOC_TUNING", "1") in ("0", "false", "no"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        ok = libc.mallopt(m_mmap_threshold, 1 << 30) and libc.mallopt(m_trim_threshold, 1 << 30)
        return bool(ok)
    except (OSError, AttributeError):  # not glibc
        return False


def maybe_pack_cpu_weights(model: torch.nn.Module, device: torch.device, enabled: bool) -> int:
    """Packed weight copies on CPU when they fit easily (``layers.linear.pack_weight`` decides which
    dtypes it can pack); returns the bytes packed."""
    if not enabled or device.type != "cpu":
        return 0
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if weight_bytes > physical_memory_bytes() // 4:
        log.info("not packing CPU weights: %.1f GiB of weights", weight_bytes / 2**30)
        return 0
    return prepack_cpu_linears(model)


def memory_figures(model: torch.nn.Module, dtype: torch.dtype, copy_bytes: int = 0) -> dict[str, float]:
    """Weight bytes per parameter (packed GGUF rows as stored, tied tensors once; ``copy_bytes``:
    the MKL/oneDNN packed copies, on top) and KV cache bytes per token, as served."""
    nbytes, numel = packed_bytes(model)
    qbytes, qnumel = quantized_bytes(model)  # FP8 / INT4 / FP4 layers (tokenfab.quant), as stored
    nbytes, numel = nbytes + qbytes, numel + qnumel
    return {
        "weight_bytes": float(nbytes + copy_bytes),
        "num_params": float(numel),
        "weight_bytes_per_param": (nbytes + copy_bytes) / max(numel, 1),
        "kv_bytes_per_token": float(kv_bytes_per_token(model, dtype)),
        "quantized_weight_bytes_per_param": qbytes / qnumel if qnumel else 0.0,
    }


def log_memory_figures(model: torch.nn.Module, dtype: torch.dtype, copy_bytes: int = 0) -> dict[str, float]:
    figures = memory_figures(model, dtype, copy_bytes)
    log.info(
        "memory: %.0f MiB of weights for %.1fM parameters = %.3f bytes/parameter%s; KV cache %d bytes/token",
        figures["weight_bytes"] / 2**20, figures["num_params"] / 1e6, figures["weight_bytes_per_param"],
        f" (incl. {copy_bytes / 2**20:.0f} MiB of packed GEMM copies)" if copy_bytes else "",
        figures["kv_bytes_per_token"],
    )
    if getattr(model, "quant_method", None) is not None:
        log.info("memory: quantized layers: %s", describe_report(weight_bytes_report(model)))
    return figures
