"""Triton kernels with PyTorch references, registered as torch custom ops (``torch.ops.tokenfab``).

The names exported here are what layers call. Under ``torch.compile`` and for tensors that
run Triton they are the registered custom ops; in eager mode on CPU they call the native C
kernel where one exists and takes the tensors (``kernels/cpu``), else the reference, skipping
the custom-op dispatcher (tens of microseconds a call, which adds up to milliseconds a step
over a model's ~200 op calls on CPU).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from tokenfab.kernels import activation, attention, kv_cache, norm, rope, sampling
from tokenfab.kernels._dispatch import use_triton
from tokenfab.kernels.cpu import elementwise as native


def _eager_fast_path(op: Callable, ref: Callable, native_op: Callable | None = None) -> Callable:
    """``native_op`` (same signature) returns None for tensors it cannot take."""

    @functools.wraps(ref)
    def call(first: torch.Tensor, *args, **kwargs):
        if torch.compiler.is_compiling() or use_triton(first):
            return op(first, *args, **kwargs)
        if native_op is not None:
            out = native_op(first, *args, **kwargs)
            if out is not None:
                return out
        return ref(first, *args, **kwargs)

    call.op = op  # type: ignore[attr-defined]
    return call


rms_norm = _eager_fast_path(norm.rms_norm, norm.rms_norm_ref, native.rms_norm)
add_rms_norm = _eager_fast_path(norm.add_rms_norm, norm.add_rms_norm_ref, native.add_rms_norm)
silu_and_mul = _eager_fast_path(activation.silu_and_mul, activation.silu_and_mul_ref, native.silu_and_mul)
gelu_and_mul = _eager_fast_path(activation.gelu_and_mul, activation.gelu_and_mul_ref)
paged_attention = _eager_fast_path(attention.paged_attention, attention.paged_attention_cpu)
sample = _eager_fast_path(sampling.sample, sampling.sample_ref)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
                     is_neox: bool) -> tuple[torch.Tensor, torch.Tensor]:
    # dispatch on q (positions is an index tensor that may live elsewhere)
    if torch.compiler.is_compiling() or use_triton(q):
        return rope.rotary_embedding(positions, q, k, cos_sin_cache, is_neox)
    out = native.rotary_embedding(positions, q, k, cos_sin_cache, is_neox)
    if out is not None:
        return out
    return rope.rotary_embedding_ref(positions, q, k, cos_sin_cache, is_neox)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """This step's keys/values into the paged cache (in place; slot -1 skipped)."""
    if torch.compiler.is_compiling() or use_triton(k):
        kv_cache.store_kv(k, v, k_cache, v_cache, slot_mapping)
    elif native.store_kv(k, v, k_cache, v_cache, slot_mapping) is None:
        kv_cache.store_kv_ref(k, v, k_cache, v_cache, slot_mapping)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Greedy choice per row of [R, V] logits (first maximum)."""
    if not torch.compiler.is_compiling():
        out = native.argmax(logits)
        if out is not None:
            return out
    return logits.argmax(-1)


__all__ = [
    "add_rms_norm",
    "argmax",
    "gelu_and_mul",
    "paged_attention",
    "rms_norm",
    "rotary_embedding",
    "sample",
    "silu_and_mul",
    "store_kv",
]
