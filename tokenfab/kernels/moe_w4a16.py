"""Fused-MoE expert MLP with 4-bit packed expert weights (W4A16), dequantized in registers.

The same machinery as ``moe_gemm`` (``moe_align`` groups the (token, slot) pairs by expert in
BLOCK_M-aligned runs; one grouped GEMM launch for gate+up with the activation on the way out,
one for down with the expert bias and the routing weight; ``moe_sum`` adds each token's k rows),
with the expert weights in one of ``w4a16``'s codecs instead of bf16:

- ``w13_q`` uint8 [E, 2I, ceil(H/2)] (gate rows, then up rows), ``w13_s`` [E, 2I, ceil(H/G)];
- ``w2_q`` uint8 [E, H, ceil(I/2)], ``w2_s`` [E, H, ceil(I/G)];
- NVFP4 only: ``w13_g`` float32 [E] or [E, 2] (gate's and up's) and ``w2_g`` [E]: global scales.

Each program streams its expert's packed bytes and scales and decodes them with
``w4a16._dequant_tile`` (the dense kernel's decoder) right before ``tl.dot``. The reference loops
over the experts that received pairs and dequantizes one expert at a time; the CPU path runs the
same loop with each product through the C kernel (``kernels/cpu/w4a16.c``, one weight row decoded
at a time), so the packed experts are never expanded to a full-precision copy of the layer.
"""

from __future__ import annotations

import torch

# isort: off
# _launch picks Triton's interpreter on machines without a GPU; it must run before triton loads
from tokenfab.kernels._launch import check_device, dot_precision
import triton
import triton.language as tl
# isort: on

from tokenfab.kernels._dispatch import eager_op, kernel_op
from tokenfab.kernels.moe_align import _moe_align_block_size_triton
from tokenfab.kernels.moe_common import (
    down_epilogue,
    gate_up_epilogue,
    moe_pair_tile,
    moe_program_tile,
    store_pair_rows,
)
from tokenfab.kernels.moe_gemm import ACTIVATIONS, _moe_sum_triton, moe_config
from tokenfab.kernels.moe_w4a16_ref import _check, fused_experts_w4a16_native, fused_experts_w4a16_ref
from tokenfab.kernels.w4a16 import CODECS, GROUP_SIZE, _dequant_tile, _unpack_codes, even_block_k

__all__ = ["fused_experts_w4a16", "fused_experts_w4a16_eager", "fused_experts_w4a16_native",
           "fused_experts_w4a16_ref"]


@triton.jit
def _moe_w4_gate_up_kernel(
    x_ptr, w_ptr, s_ptr, g_ptr, b_ptr, out_ptr, sorted_ptr, expert_ids_ptr, npost_ptr,
    num_pairs, inter, hidden, sxm, swe, swn, sse, ssn, sbe, som, sge, sgu,
    alpha, limit,
    TOP_K: tl.constexpr,
    ACT: tl.constexpr,
    CODEC: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_GLOBAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PREC: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """Program (row tile, column tile): out[pair, n] = act(x[pair // k] . G[e, n], x . U[e, n]) with
    G, U the dequantized gate and up rows of expert e = expert_ids[tile]; sentinel rows are skipped."""
    pid_m, pid_n = moe_program_tile(inter, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(npost_ptr):
        return
    pair, valid, row, e, offs_n, nmask = moe_pair_tile(pid_m, pid_n, sorted_ptr, expert_ids_ptr, num_pairs, inter,
                                                       TOP_K, BLOCK_M, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_b = tl.arange(0, BLOCK_K // 2)
    offs_g = tl.arange(0, BLOCK_K // GROUP)
    a_ptrs = x_ptr + row[:, None] * sxm + offs_k[None, :]
    g_ptrs = w_ptr + e * swe + offs_n[None, :].to(tl.int64) * swn + offs_b[:, None]
    u_ptrs = g_ptrs + inter * swn
    gs_ptrs = s_ptr + e * sse + offs_n[None, :].to(tl.int64) * ssn + offs_g[:, None]
    us_ptrs = gs_ptrs + inter * ssn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kk in range(0, (hidden + BLOCK_K - 1) // BLOCK_K):
        krem = hidden - kk * BLOCK_K
        if EVEN_K:  # no K mask: the weight loads vectorize along K
            a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
            wmask = nmask[None, :]
            smask = nmask[None, :]
        else:
            a = tl.load(a_ptrs, mask=valid[:, None] & (offs_k[None, :] < krem), other=0.0)
            wmask = nmask[None, :] & (offs_b[:, None] * 2 < krem)
            smask = nmask[None, :] & (offs_g[:, None] * GROUP < krem)
        bg = tl.load(g_ptrs, mask=wmask, other=0)
        wg = _dequant_tile(_unpack_codes(bg, BLOCK_K, BLOCK_N), tl.load(gs_ptrs, mask=smask, other=0), CODEC, GROUP,
                           BLOCK_K, BLOCK_N)
        acc_g = tl.dot(a, wg.to(a.dtype), acc_g, input_precision=DOT_PREC)
        bu = tl.load(u_ptrs, mask=wmask, other=0)
        wu = _dequant_tile(_unpack_codes(bu, BLOCK_K, BLOCK_N), tl.load(us_ptrs, mask=smask, other=0), CODEC, GROUP,
                           BLOCK_K, BLOCK_N)
        acc_u = tl.dot(a, wu.to(a.dtype), acc_u, input_precision=DOT_PREC)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K // 2
        u_ptrs += BLOCK_K // 2
        gs_ptrs += BLOCK_K // GROUP
        us_ptrs += BLOCK_K // GROUP
    if HAS_GLOBAL:
        acc_g = acc_g * tl.load(g_ptr + e * sge).to(tl.float32)
        acc_u = acc_u * tl.load(g_ptr + e * sge + sgu).to(tl.float32)
    h = gate_up_epilogue(acc_g, acc_u, b_ptr, e, sbe, inter, offs_n, nmask, alpha, limit, HAS_BIAS, ACT)
    store_pair_rows(out_ptr, som, pair, valid, offs_n, nmask, h)


@triton.jit
def _moe_w4_down_kernel(
    x_ptr, w_ptr, s_ptr, g_ptr, b_ptr, tw_ptr, out_ptr, sorted_ptr, expert_ids_ptr, npost_ptr,
    num_pairs, hidden, inter, sxm, swe, swn, sse, ssn, sbe, som,
    CODEC: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_GLOBAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PREC: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """Program (row tile, column tile): out[pair, n] = (x[pair] . D[e, n] + b2[e, n]) * topk_weight[pair]."""
    pid_m, pid_n = moe_program_tile(hidden, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(npost_ptr):
        return
    pair, valid, row, e, offs_n, nmask = moe_pair_tile(pid_m, pid_n, sorted_ptr, expert_ids_ptr, num_pairs, hidden,
                                                       1, BLOCK_M, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_b = tl.arange(0, BLOCK_K // 2)
    offs_g = tl.arange(0, BLOCK_K // GROUP)
    a_ptrs = x_ptr + row[:, None] * sxm + offs_k[None, :]
    b_ptrs = w_ptr + e * swe + offs_n[None, :].to(tl.int64) * swn + offs_b[:, None]
    s_ptrs = s_ptr + e * sse + offs_n[None, :].to(tl.int64) * ssn + offs_g[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kk in range(0, (inter + BLOCK_K - 1) // BLOCK_K):
        krem = inter - kk * BLOCK_K
        if EVEN_K:
            a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=nmask[None, :], other=0)
            sc = tl.load(s_ptrs, mask=nmask[None, :], other=0)
        else:
            a = tl.load(a_ptrs, mask=valid[:, None] & (offs_k[None, :] < krem), other=0.0)
            b = tl.load(b_ptrs, mask=nmask[None, :] & (offs_b[:, None] * 2 < krem), other=0)
            sc = tl.load(s_ptrs, mask=nmask[None, :] & (offs_g[:, None] * GROUP < krem), other=0)
        w = _dequant_tile(_unpack_codes(b, BLOCK_K, BLOCK_N), sc, CODEC, GROUP, BLOCK_K, BLOCK_N)
        acc = tl.dot(a, w.to(a.dtype), acc, input_precision=DOT_PREC)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K // 2
        s_ptrs += BLOCK_K // GROUP
    if HAS_GLOBAL:
        acc = acc * tl.load(g_ptr + e).to(tl.float32)
    acc = down_epilogue(acc, b_ptr, e, sbe, offs_n, nmask, tw_ptr, row, valid, HAS_BIAS)
    store_pair_rows(out_ptr, som, pair, valid, offs_n, nmask, acc)


def _contig(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.float8_e4m3fn:
        t = t.view(torch.uint8)
    return t if t.is_contiguous() else t.contiguous()


def _fused_experts_w4a16_triton(
    hidden: torch.Tensor,
    w13_q: torch.Tensor,
    w13_s: torch.Tensor,
    w2_q: torch.Tensor,
    w2_s: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    w13_g: torch.Tensor | None = None,
    w2_g: torch.Tensor | None = None,
    codec: str = "int4",
    activation: str = "silu",
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
    *,
    config: dict | None = None,
) -> torch.Tensor:
    """See ``fused_experts_w4a16_ref``. ``config`` overrides ``moe_config`` (benchmark sweeps)."""
    check_device(hidden)
    t, h, e, inter = _check(hidden, w13_q, w13_s, w2_q, w2_s, topk_weights, topk_ids, w13_g, w2_g, codec,
                            activation)
    k = topk_ids.shape[1]
    if t == 0:
        return hidden.new_empty(0, h)
    hidden = hidden.contiguous()
    w13_q, w13_s, w2_q, w2_s = _contig(w13_q), _contig(w13_s), _contig(w2_q), _contig(w2_s)
    tw = topk_weights.reshape(-1).float().contiguous()
    cfg = moe_config(t, k, e, hidden.dtype)
    grp = GROUP_SIZE[codec]
    cfg = {**cfg, "gate_up": {**cfg["gate_up"], "BLOCK_K": even_block_k(cfg["gate_up"]["BLOCK_K"], h, grp)},
           "down": {**cfg["down"], "BLOCK_K": even_block_k(cfg["down"]["BLOCK_K"], inter, grp)}}
    if config:
        cfg = {**cfg, **config}
    bm, gm = cfg["BLOCK_M"], cfg["GROUP_M"]
    sorted_ids, expert_ids, npost = _moe_align_block_size_triton(topk_ids, e, bm)
    tiles_m = sorted_ids.numel() // bm
    common = dict(CODEC=CODECS.index(codec), GROUP=GROUP_SIZE[codec], HAS_GLOBAL=w13_g is not None,
                  BLOCK_M=bm, GROUP_M=gm, DOT_PREC=dot_precision(hidden.dtype))
    n_pairs = t * k

    inter_out = hidden.new_empty(n_pairs, inter)
    gu = cfg["gate_up"]
    b13 = w13_bias.contiguous() if w13_bias is not None else w13_s
    g13 = w13_g.float().contiguous() if w13_g is not None else w13_s
    _moe_w4_gate_up_kernel[(tiles_m * triton.cdiv(inter, gu["BLOCK_N"]),)](
        hidden, w13_q, w13_s, g13, b13, inter_out, sorted_ids, expert_ids, npost,
        n_pairs, inter, h, hidden.stride(0), w13_q.stride(0), w13_q.stride(1), w13_s.stride(0), w13_s.stride(1),
        b13.stride(0), inter_out.stride(0), g13.stride(0) if w13_g is not None else 0,
        int(w13_g is not None and w13_g.dim() == 2), float(swiglu_alpha), float(swiglu_limit),
        TOP_K=k, ACT=ACTIVATIONS.index(activation), HAS_BIAS=w13_bias is not None, EVEN_K=h % gu["BLOCK_K"] == 0,
        **common, **gu,
    )
    pair_out = hidden.new_empty(n_pairs, h)
    dn = cfg["down"]
    b2 = w2_bias.contiguous() if w2_bias is not None else w2_s
    g2 = w2_g.float().contiguous() if w2_g is not None else w2_s
    _moe_w4_down_kernel[(tiles_m * triton.cdiv(h, dn["BLOCK_N"]),)](
        inter_out, w2_q, w2_s, g2, b2, tw, pair_out, sorted_ids, expert_ids, npost,
        n_pairs, h, inter, inter_out.stride(0), w2_q.stride(0), w2_q.stride(1), w2_s.stride(0), w2_s.stride(1),
        b2.stride(0), pair_out.stride(0), HAS_BIAS=w2_bias is not None, EVEN_K=inter % dn["BLOCK_K"] == 0,
        **common, **dn,
    )
    return _moe_sum_triton(pair_out.view(t, k, h))


fused_experts_w4a16 = kernel_op(
    "fused_experts_w4a16", _fused_experts_w4a16_triton, fused_experts_w4a16_ref,
    lambda hidden, *_: hidden.new_empty(hidden.shape),
    doc="The routed experts of one MoE layer with 4-bit packed weights; see the module docstring.",
)


# What layers call: the custom op under ``torch.compile``, else by the dispatch rule Triton, the C kernel
# per expert (CPU) or the reference (skipping the custom-op dispatcher on CPU).
fused_experts_w4a16_eager = eager_op(fused_experts_w4a16, fused_experts_w4a16_ref, fused_experts_w4a16_native,
                                     triton_fn=_fused_experts_w4a16_triton)
