"""The fused-MoE expert MLP with block-FP8 experts (W8A8), the FP8 variant of ``moe_gemm``.

Same machinery as ``fused_experts``: pairs aligned per expert (``moe_align_block_size``), one grouped
GEMM launch for gate+up (SiLU-gated), one for down (times the routing weight), ``moe_sum``. Here:

- the tokens are quantized to e4m3 per token and 128 channels first (``per_token_group_quant_fp8``),
  and so is the activated intermediate before the down GEMM;
- the experts stay float8: ``w13`` [E, 2I, H] with scales [E, ceil(2I / g13), ceil(H / 128)] and
  ``w2`` [E, H, I] with [E, ceil(H / g2), ceil(I / 128)] (``g`` = 128: 128x128 blocks; 1: a scale row per
  output row, used when I is not a multiple of 128 so gate and up grids cannot stack);
- each K tile is BLOCK_K = 128 = the scale group: ``acc += dot(a, w) * a_s[:, None] * w_s[None, :]``.

The reference dequantizes both sides (activations rounded through float8 exactly as the kernel does)
and loops over the experts that received pairs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# isort: off
# _launch picks Triton's interpreter on machines without a GPU; it must run before triton loads
from tokenfab.kernels._launch import check_device, interpreting
import triton
import triton.language as tl
# isort: on

from tokenfab.kernels._dispatch import use_triton
from tokenfab.kernels.moe_align import _moe_align_block_size_triton
from tokenfab.kernels.moe_common import (
    down_epilogue,
    experts_loop_ref,
    gate_up_epilogue,
    moe_pair_tile,
    moe_program_tile,
    store_pair_rows,
)
from tokenfab.kernels.moe_gemm import _moe_sum_triton
from tokenfab.kernels.quant import (
    GROUP_K,
    _per_token_group_quant_triton,
    dequantize_fp8,
    patch_interpreter_fp8,
    per_token_group_quant_fp8_ref,
)


def _dequant_rows(w: torch.Tensor, s: torch.Tensor, group: int) -> torch.Tensor:
    return dequantize_fp8(w, s, group, torch.float32)


def fused_experts_fp8_ref(hidden: torch.Tensor, w13: torch.Tensor, w13_s: torch.Tensor, w2: torch.Tensor,
                          w2_s: torch.Tensor, group_13: int, group_2: int, topk_weights: torch.Tensor,
                          topk_ids: torch.Tensor, ue8m0: bool = False) -> torch.Tensor:
    """hidden [T, H] -> [T, H]: sum_j topk_weights[t, j] * expert_{ids[t, j]}(hidden[t]), SiLU-gated, with
    the activations rounded through float8 per token and 128 channels before each GEMM."""
    if hidden.shape[0] == 0:
        return hidden.new_empty(0, hidden.shape[1])
    k = topk_ids.shape[1]
    inter = w13.shape[1] // 2
    xq, xs = per_token_group_quant_fp8_ref(hidden, GROUP_K, ue8m0)
    x = dequantize_fp8(xq, xs, 1, torch.float32)

    def expert(e: int, pairs: torch.Tensor) -> torch.Tensor:
        gu = F.linear(x[pairs // k], _dequant_rows(w13[e], w13_s[e], group_13))
        act = (F.silu(gu[:, :inter]) * gu[:, inter:]).to(hidden.dtype)
        aq, a_s = per_token_group_quant_fp8_ref(act, GROUP_K, ue8m0)
        return F.linear(dequantize_fp8(aq, a_s, 1, torch.float32), _dequant_rows(w2[e], w2_s[e], group_2))

    return experts_loop_ref(hidden, topk_weights, topk_ids, w13.shape[0], expert)


@triton.jit
def _moe_fp8_gate_up_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, sorted_ptr, expert_ids_ptr, npost_ptr,
    num_pairs, inter, hidden, sxm, sxsm, swe, swn, swse, swsn, swsk, som,
    TOP_K: tl.constexpr, GROUP_N: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """out[pair, n] = silu(g) * u, g/u = sum over K tiles of dot(xq, Wq) * x_scale * w_scale (rows n, I + n)."""
    pid_m, pid_n = moe_program_tile(inter, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(npost_ptr):
        return
    pair, valid, row, e, offs_n, nmask = moe_pair_tile(pid_m, pid_n, sorted_ptr, expert_ids_ptr, num_pairs, inter,
                                                       TOP_K, BLOCK_M, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + row[:, None] * sxm + offs_k[None, :]
    as_ptrs = xs_ptr + row * sxsm
    g_ptrs = w_ptr + e * swe + offs_n[None, :].to(tl.int64) * swn + offs_k[:, None]
    u_ptrs = g_ptrs + inter * swn
    gs_ptrs = ws_ptr + e * swse + (offs_n // GROUP_N).to(tl.int64) * swsn
    us_ptrs = ws_ptr + e * swse + ((inter + offs_n) // GROUP_N).to(tl.int64) * swsn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kk in range(0, (hidden + BLOCK_K - 1) // BLOCK_K):
        kmask = offs_k < hidden - kk * BLOCK_K
        a = tl.load(a_ptrs, mask=valid[:, None] & kmask[None, :], other=0.0)
        bg = tl.load(g_ptrs, mask=nmask[None, :] & kmask[:, None], other=0.0)
        bu = tl.load(u_ptrs, mask=nmask[None, :] & kmask[:, None], other=0.0)
        a_s = tl.load(as_ptrs + kk, mask=valid, other=0.0)
        g_s = tl.load(gs_ptrs + kk * swsk, mask=nmask, other=0.0)
        u_s = tl.load(us_ptrs + kk * swsk, mask=nmask, other=0.0)
        acc_g += tl.dot(a, bg) * a_s[:, None] * g_s[None, :]
        acc_u += tl.dot(a, bu) * a_s[:, None] * u_s[None, :]
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    h = gate_up_epilogue(acc_g, acc_u, out_ptr, e, 0, inter, offs_n, nmask, 0.0, 0.0, False, 0)  # SiLU, no bias
    store_pair_rows(out_ptr, som, pair, valid, offs_n, nmask, h)


@triton.jit
def _moe_fp8_down_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, tw_ptr, out_ptr, sorted_ptr, expert_ids_ptr, npost_ptr,
    num_pairs, hidden, inter, sxm, sxsm, swe, swn, swse, swsn, swsk, som,
    GROUP_N: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """out[pair, n] = (sum over K tiles of dot(hq[pair], W2q[e, n]) * h_scale * w_scale) * topk_weight[pair]."""
    pid_m, pid_n = moe_program_tile(hidden, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(npost_ptr):
        return
    pair, valid, row, e, offs_n, nmask = moe_pair_tile(pid_m, pid_n, sorted_ptr, expert_ids_ptr, num_pairs, hidden,
                                                       1, BLOCK_M, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + row[:, None] * sxm + offs_k[None, :]
    as_ptrs = xs_ptr + row * sxsm
    b_ptrs = w_ptr + e * swe + offs_n[None, :].to(tl.int64) * swn + offs_k[:, None]
    bs_ptrs = ws_ptr + e * swse + (offs_n // GROUP_N).to(tl.int64) * swsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kk in range(0, (inter + BLOCK_K - 1) // BLOCK_K):
        kmask = offs_k < inter - kk * BLOCK_K
        a = tl.load(a_ptrs, mask=valid[:, None] & kmask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=nmask[None, :] & kmask[:, None], other=0.0)
        a_s = tl.load(as_ptrs + kk, mask=valid, other=0.0)
        b_s = tl.load(bs_ptrs + kk * swsk, mask=nmask, other=0.0)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    acc = down_epilogue(acc, out_ptr, e, 0, offs_n, nmask, tw_ptr, row, valid, False)  # no bias
    store_pair_rows(out_ptr, som, pair, valid, offs_n, nmask, acc)


def moe_fp8_config(num_tokens: int, top_k: int, num_experts: int) -> dict:
    """Tiles by the average rows per expert; BLOCK_K is the scale group (128). 64+-row tiles let
    Hopper run FP8 warp-group MMA; decode uses 16-row tiles."""
    rows = num_tokens * top_k / max(num_experts, 1)
    if rows <= 16:
        bm, warps = 16, 4
    elif rows <= 96:
        bm, warps = 64, 4
    else:
        bm, warps = 128, 8
    return dict(BLOCK_M=bm, GROUP_M=8, gate_up=dict(BLOCK_N=64, BLOCK_K=GROUP_K, num_warps=warps, num_stages=3),
                down=dict(BLOCK_N=128 if bm > 16 else 64, BLOCK_K=GROUP_K, num_warps=warps, num_stages=3))


def _fused_experts_fp8_triton(hidden: torch.Tensor, w13: torch.Tensor, w13_s: torch.Tensor, w2: torch.Tensor,
                              w2_s: torch.Tensor, group_13: int, group_2: int, topk_weights: torch.Tensor,
                              topk_ids: torch.Tensor, ue8m0: bool = False) -> torch.Tensor:
    check_device(hidden)
    if interpreting():
        patch_interpreter_fp8()
    t, h = hidden.shape
    e, two_i, _ = w13.shape
    inter = two_i // 2
    k = topk_ids.shape[1]
    if t == 0:
        return hidden.new_empty(0, h)
    tw = topk_weights.reshape(-1).float().contiguous()
    w13_s, w2_s = w13_s.float().contiguous(), w2_s.float().contiguous()
    cfg = moe_fp8_config(t, k, e)
    bm, gm = cfg["BLOCK_M"], cfg["GROUP_M"]
    sorted_ids, expert_ids, npost = _moe_align_block_size_triton(topk_ids, e, bm)
    tiles_m = sorted_ids.numel() // bm
    n_pairs = t * k
    xq, xs = _per_token_group_quant_triton(hidden.contiguous(), GROUP_K, ue8m0)
    act = hidden.new_empty(n_pairs, inter)
    gu = cfg["gate_up"]
    _moe_fp8_gate_up_kernel[(tiles_m * triton.cdiv(inter, gu["BLOCK_N"]),)](
        xq, xs, w13, w13_s, act, sorted_ids, expert_ids, npost,
        n_pairs, inter, h, xq.stride(0), xs.stride(0), w13.stride(0), w13.stride(1),
        w13_s.stride(0), w13_s.stride(1), w13_s.stride(2) if w13_s.shape[2] > 1 else 0, act.stride(0),
        TOP_K=k, GROUP_N=group_13, BLOCK_M=bm, GROUP_M=gm, **gu,
    )
    aq, a_s = _per_token_group_quant_triton(act, GROUP_K, ue8m0)
    pair_out = hidden.new_empty(n_pairs, h)
    dn = cfg["down"]
    _moe_fp8_down_kernel[(tiles_m * triton.cdiv(h, dn["BLOCK_N"]),)](
        aq, a_s, w2, w2_s, tw, pair_out, sorted_ids, expert_ids, npost,
        n_pairs, h, inter, aq.stride(0), a_s.stride(0), w2.stride(0), w2.stride(1),
        w2_s.stride(0), w2_s.stride(1), w2_s.stride(2) if w2_s.shape[2] > 1 else 0, pair_out.stride(0),
        GROUP_N=group_2, BLOCK_M=bm, GROUP_M=gm, **dn,
    )
    return _moe_sum_triton(pair_out.view(t, k, h))


@torch.library.custom_op("tokenfab::fused_experts_fp8", mutates_args=())
def fused_experts_fp8(hidden: torch.Tensor, w13: torch.Tensor, w13_s: torch.Tensor, w2: torch.Tensor,
                      w2_s: torch.Tensor, group_13: int, group_2: int, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, ue8m0: bool = False) -> torch.Tensor:
    """Block-FP8 routed experts of one MoE layer (SiLU-gated); see the module docstring."""
    if use_triton(hidden):
        return _fused_experts_fp8_triton(hidden, w13, w13_s, w2, w2_s, group_13, group_2, topk_weights, topk_ids,
                                         ue8m0)
    return fused_experts_fp8_ref(hidden, w13, w13_s, w2, w2_s, group_13, group_2, topk_weights, topk_ids, ue8m0)


@fused_experts_fp8.register_fake
def _(hidden, w13, w13_s, w2, w2_s, group_13, group_2, topk_weights, topk_ids, ue8m0=False):
    return hidden.new_empty(hidden.shape)
