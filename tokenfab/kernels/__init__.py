"""Triton kernels with PyTorch references, registered as torch custom ops (``torch.ops.tokenfab``),
and native C CPU kernels (``kernels/cpu``).

The names exported here are what layers call: each is the op's eager entry point, which picks
Triton, the C kernel or the reference by the one rule of ``kernels/_dispatch.py`` (``backend``),
and is the registered custom op under ``torch.compile``.
"""

from __future__ import annotations

import torch

from tokenfab.kernels import activation, attention, causal_conv1d, dsa, gated_delta, kv_cache, mla, norm, rope, sampling
from tokenfab.kernels._dispatch import backend, choose, eager_op
from tokenfab.kernels.activation_train import gelu_and_mul_train, silu_and_mul_train
from tokenfab.kernels.cpu import elementwise as native
from tokenfab.kernels.loss import fused_linear_cross_entropy
from tokenfab.kernels.moe_train import grouped_gemm_train, moe_experts_train
from tokenfab.kernels.norm_train import rms_norm_train

# rope_train is not re-exported: the name would shadow the submodule tokenfab.kernels.rope_train
# (import it from there).

rms_norm = eager_op(norm.rms_norm, norm.rms_norm_ref, native.rms_norm)
add_rms_norm = eager_op(norm.add_rms_norm, norm.add_rms_norm_ref, native.add_rms_norm)
silu_and_mul = eager_op(activation.silu_and_mul, activation.silu_and_mul_ref, native.silu_and_mul)
gelu_and_mul = eager_op(activation.gelu_and_mul, activation.gelu_and_mul_ref)
paged_attention = eager_op(attention.paged_attention, attention.paged_attention_ref, attention.paged_attention_native)
sample = eager_op(sampling.sample, sampling.sample_ref)
mla_attention = eager_op(mla.mla_attention, mla.mla_attention_ref)
store_latent = eager_op(mla.store_latent, mla.store_latent_ref)
dsa_topk_indices = eager_op(dsa.dsa_topk_indices, dsa.dsa_topk_indices_ref)
dsa_sparse_attention = eager_op(dsa.dsa_sparse_attention, dsa.dsa_sparse_attention_ref)
# Gated DeltaNet (Qwen3-Next / Qwen3.5 linear-attention layers; no model calls them yet)
gated_delta_prefill = eager_op(gated_delta.gated_delta_prefill, gated_delta.prefill_reference)
gated_delta_decode = eager_op(gated_delta.gated_delta_decode, gated_delta.decode_reference)
causal_conv1d_prefill = eager_op(causal_conv1d.causal_conv1d_prefill, causal_conv1d.prefill_reference)
causal_conv1d_update = eager_op(causal_conv1d.causal_conv1d_update, causal_conv1d.update_reference)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
                     is_neox: bool) -> tuple[torch.Tensor, torch.Tensor]:
    # dispatch on q (positions is an index tensor that may live elsewhere)
    args = (positions, q, k, cos_sin_cache, is_neox)
    if torch.compiler.is_compiling():
        return rope.rotary_embedding(*args)
    return choose(q, rope.rotary_embedding, native.rotary_embedding, rope.rotary_embedding_ref, *args)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """This step's keys/values into the paged cache (in place; slot -1 skipped; fp8 caches: quantized
    with ``k_scale``/``v_scale``, which the C kernel does not take: the reference quantizes on CPU)."""
    fp8 = kv_cache.is_fp8(k_cache.dtype) or kv_cache.is_fp8(v_cache.dtype)
    args = (k, v, k_cache, v_cache, slot_mapping) + ((k_scale, v_scale) if fp8 else ())
    if torch.compiler.is_compiling():
        kv_cache.store_kv(*args)
    else:
        choose(k, kv_cache.store_kv, None if fp8 else native.store_kv, kv_cache.store_kv_ref, *args)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Greedy choice per row of [R, V] logits (first maximum). No Triton kernel: torch's argmax."""
    if not torch.compiler.is_compiling() and backend(logits, native=True) == "native":
        out = native.argmax(logits)
        if out is not None:
            return out
    return logits.argmax(-1)


__all__ = [
    "add_rms_norm",
    "argmax",
    "causal_conv1d_prefill",
    "causal_conv1d_update",
    "dsa_sparse_attention",
    "dsa_topk_indices",
    "fused_linear_cross_entropy",
    "gated_delta_decode",
    "gated_delta_prefill",
    "gelu_and_mul",
    "gelu_and_mul_train",
    "grouped_gemm_train",
    "mla_attention",
    "moe_experts_train",
    "paged_attention",
    "rms_norm",
    "rms_norm_train",
    "rotary_embedding",
    "sample",
    "silu_and_mul",
    "silu_and_mul_train",
    "store_kv",
    "store_latent",
]
