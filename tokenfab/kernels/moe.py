"""Mixture-of-experts: routing, token-to-expert alignment, and the fused expert MLP.

One MoE layer on a flat batch of T tokens with hidden size H, E experts of intermediate size I,
each token sent to k experts:

    logits = x Wr^T (+ br)                                    [T, E]   (router, a plain Linear)
    weights, ids = route(logits)                              [T, k]   (``topk_softmax`` or ``grouped_topk``)
    for each (token t, slot j), e = ids[t, j]:
        h = act(x_t W13[e]^T + b13[e])                        [I]      W13[e] = [gate; up], [2I, H]
        y_tj = (h W2[e]^T + b2[e]) * weights[t, j]            [H]      W2[e]: [H, I]
    out_t = sum_j y_tj

The GPU path (``fused_experts``) runs without a Python loop over experts or a host sync:
1. ``moe_align_block_size``: the T*k (token, slot) pairs are grouped by expert, each expert's run
   padded to a multiple of BLOCK_M with a sentinel, so that every BLOCK_M-row tile of the sorted
   list belongs to one expert (``expert_ids[tile]``). Three small kernels: per-chunk expert
   histograms, one program that turns them into write offsets (and the tile -> expert table),
   and a scatter whose order inside an expert's run is the pairs' order (deterministic).
2. One grouped GEMM launch for gate+up: each program multiplies BLOCK_M gathered token rows by
   one expert's gate and up column tiles (two accumulators) and applies the activation on the
   way out: SiLU-gated ``silu(g) * u``, or GPT-OSS's clamped SwiGLU
   ``(clamp(u, -l, l) + 1) * g' * sigmoid(alpha * g')`` with ``g' = min(g, l)``.
3. One grouped GEMM launch for down, adding the expert bias and multiplying by the pair's
   routing weight, writing one row per pair.
4. ``moe_sum``: each token's k rows summed in fp32 (fixed order: deterministic, no atomics).

The references (same signatures) loop over the experts that received tokens; they are the CPU
path. Routing weights are fp32; ids are int32.

One file per step: ``moe_routing`` (``topk_softmax``, ``grouped_topk``), ``moe_align``
(``moe_align_block_size``) and ``moe_gemm`` (the grouped GEMMs, ``moe_sum``, ``fused_experts``).
This module re-exports their public names (layers, tests, benchmarks).
"""

from __future__ import annotations

from tokenfab.kernels.moe_align import (
    _moe_align_block_size_triton,
    align_config,
    max_padded_pairs,
    moe_align_block_size,
    moe_align_block_size_ref,
)
from tokenfab.kernels.moe_gemm import (
    ACTIVATIONS,
    _fused_experts_triton,
    _moe_sum_triton,
    fused_experts,
    fused_experts_ref,
    moe_activation_ref,
    moe_config,
    moe_sum,
    moe_sum_ref,
    sum_config,
)
from tokenfab.kernels.moe_routing import (
    _grouped_topk_triton,
    _topk_softmax_triton,
    grouped_topk,
    grouped_topk_ref,
    topk_softmax,
    topk_softmax_ref,
)

__all__ = [
    "ACTIVATIONS",
    "_fused_experts_triton",
    "_grouped_topk_triton",
    "_moe_align_block_size_triton",
    "_moe_sum_triton",
    "_topk_softmax_triton",
    "align_config",
    "fused_experts",
    "fused_experts_ref",
    "grouped_topk",
    "grouped_topk_ref",
    "max_padded_pairs",
    "moe_activation_ref",
    "moe_align_block_size",
    "moe_align_block_size_ref",
    "moe_config",
    "moe_sum",
    "moe_sum_ref",
    "sum_config",
    "topk_softmax",
    "topk_softmax_ref",
]
