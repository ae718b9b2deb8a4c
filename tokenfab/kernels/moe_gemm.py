"""MoE expert MLP: the grouped GEMMs over the aligned pairs (``moe_align``) and the per-token sum.

One grouped GEMM launch for gate+up (each program multiplies BLOCK_M gathered token rows by one
expert's gate and up column tiles, two accumulators, and applies the activation on the way out),
one for down (expert bias, routing weight, one row per pair), then ``moe_sum`` adds each token's k
rows in fp32 (fixed order: deterministic, no atomics). The reference loops over the experts that
received tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# isort: off
# _launch picks Triton's interpreter on machines without a GPU; it must run before triton loads
from tokenfab.kernels._launch import check_device, dot_precision, next_pow2
import triton
import triton.language as tl
# isort: on

from tokenfab.kernels._dispatch import checked, kernel_op
from tokenfab.kernels.moe_align import _moe_align_block_size_triton
from tokenfab.kernels.moe_common import (
    down_epilogue,
    experts_loop_ref,
    gate_up_epilogue,
    moe_pair_tile,
    moe_program_tile,
    store_pair_rows,
)

ACTIVATIONS = ("silu", "swiglu_oai", "silu_clamp")  # silu_clamp: DeepSeek-V4 (gate <= limit, |up| <= limit)


def _check_activation(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, not {activation!r}")


def moe_activation_ref(
    gate_up: torch.Tensor, activation: str, alpha: float = 1.702, limit: float = 7.0
) -> torch.Tensor:
    """gate_up [..., 2I] = [gate | up] -> [..., I]: silu(g) * u, GPT-OSS's clamped SwiGLU, or DeepSeek-V4's
    silu(min(g, limit)) * clamp(u, -limit, limit) ("silu_clamp")."""
    i = gate_up.shape[-1] // 2
    g, u = gate_up[..., :i], gate_up[..., i:]
    if activation == "silu":
        return F.silu(g) * u
    g = g.clamp(max=limit)
    u = u.clamp(min=-limit, max=limit)
    if activation == "silu_clamp":
        return F.silu(g) * u
    return (u + 1) * (g * torch.sigmoid(g * alpha))


def _check_experts(hidden, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, activation, **_) -> None:
    _check_activation(activation)
    if hidden.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError("fused_experts expects hidden [T, H], w13 [E, 2I, H], w2 [E, H, I]")
    t, h = hidden.shape
    e, two_i, h1 = w13.shape
    if h1 != h or two_i % 2 or tuple(w2.shape) != (e, h, two_i // 2):
        raise ValueError(f"expert weights {tuple(w13.shape)}, {tuple(w2.shape)} do not fit hidden size {h}")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != t:
        raise ValueError(f"topk ids {tuple(topk_ids.shape)} / weights {tuple(topk_weights.shape)} for {t} tokens")
    if w13_bias is not None and tuple(w13_bias.shape) != (e, two_i):
        raise ValueError(f"w13_bias must be [{e}, {two_i}], got {tuple(w13_bias.shape)}")
    if w2_bias is not None and tuple(w2_bias.shape) != (e, h):
        raise ValueError(f"w2_bias must be [{e}, {h}], got {tuple(w2_bias.shape)}")


def fused_experts_ref(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    activation: str = "silu",
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
) -> torch.Tensor:
    """hidden [T, H] -> [T, H]: sum over j of topk_weights[t, j] * expert_{ids[t, j]}(hidden[t]).

    Loops over the experts that received pairs. Products, biases and the activation are computed
    in fp32; values are rounded to the input dtype where the kernel stores them (the activated
    intermediate, each pair's weighted output) and the k outputs of a token are summed in fp32,
    in slot order. (For fp32 inputs the ``.float()`` calls are free.)
    """
    k = topk_ids.shape[1]

    def expert(e: int, pairs: torch.Tensor) -> torch.Tensor:
        x = hidden[pairs // k].float()
        gu = F.linear(x, w13[e].float(), None if w13_bias is None else w13_bias[e].float())
        act = moe_activation_ref(gu, activation, swiglu_alpha, swiglu_limit).to(hidden.dtype)
        return F.linear(act.float(), w2[e].float(), None if w2_bias is None else w2_bias[e].float())

    return experts_loop_ref(hidden, topk_weights, topk_ids, w13.shape[0], expert)


@triton.jit
def _moe_gate_up_kernel(
    x_ptr, w_ptr, b_ptr, d_ptr, out_ptr, sorted_ptr, expert_ids_ptr, npost_ptr,
    num_pairs, inter, hidden, sxm, swe, swn, sbe, sdm, som,
    alpha, limit,
    TOP_K: tl.constexpr,
    ACT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Program (row tile, column tile): out[pair, n] = act(x[pair // k] . W13[e, n] + b, x . W13[e, I + n] + b).

    The row tile's BLOCK_M sorted pairs share expert e = expert_ids[tile]; sentinel rows load
    zeros and are not stored. ACT: 0 SiLU-gated, 1 GPT-OSS clamped SwiGLU, 2 DeepSeek-V4's clamped SiLU.
    HAS_DELTA (multi-LoRA on experts, ``moe_lora.py``): each pair's gate/up delta rows d[pair, n], d[pair, I + n]
    are added to the fp32 accumulators before the bias and the activation.
    """
    pid_m, pid_n = moe_program_tile(inter, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(npost_ptr):
        return
    pair, valid, row, e, offs_n, nmask = moe_pair_tile(pid_m, pid_n, sorted_ptr, expert_ids_ptr, num_pairs, inter,
                                                       TOP_K, BLOCK_M, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + row[:, None] * sxm + offs_k[None, :]
    g_ptrs = w_ptr + e * swe + offs_n[None, :].to(tl.int64) * swn + offs_k[:, None]
    u_ptrs = g_ptrs + inter * swn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kk in range(0, (hidden + BLOCK_K - 1) // BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
            bg = tl.load(g_ptrs, mask=nmask[None, :], other=0.0)
            bu = tl.load(u_ptrs, mask=nmask[None, :], other=0.0)
        else:
            kmask = offs_k < hidden - kk * BLOCK_K
            a = tl.load(a_ptrs, mask=valid[:, None] & kmask[None, :], other=0.0)
            bg = tl.load(g_ptrs, mask=nmask[None, :] & kmask[:, None], other=0.0)
            bu = tl.load(u_ptrs, mask=nmask[None, :] & kmask[:, None], other=0.0)
        acc_g = tl.dot(a, bg, acc_g, input_precision=DOT_PREC)
        acc_u = tl.dot(a, bu, acc_u, input_precision=DOT_PREC)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    if HAS_DELTA:
        d_ptrs = d_ptr + tl.where(valid, pair, 0).to(tl.int64)[:, None] * sdm + offs_n[None, :]
        dmask = valid[:, None] & nmask[None, :]
        acc_g += tl.load(d_ptrs, mask=dmask, other=0.0).to(tl.float32)
        acc_u += tl.load(d_ptrs + inter, mask=dmask, other=0.0).to(tl.float32)
    h = gate_up_epilogue(acc_g, acc_u, b_ptr, e, sbe, inter, offs_n, nmask, alpha, limit, HAS_BIAS, ACT)
    store_pair_rows(out_ptr, som, pair, valid, offs_n, nmask, h)


@triton.jit
def _moe_down_kernel(
    x_ptr, w_ptr, b_ptr, tw_ptr, out_ptr, sorted_ptr, expert_ids_ptr, npost_ptr,
    num_pairs, hidden, inter, sxm, swe, swn, sbe, som,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Program (row tile, column tile): out[pair, n] = (x[pair] . W2[e, n] + b2[e, n]) * topk_weight[pair]."""
    pid_m, pid_n = moe_program_tile(hidden, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(npost_ptr):
        return
    pair, valid, row, e, offs_n, nmask = moe_pair_tile(pid_m, pid_n, sorted_ptr, expert_ids_ptr, num_pairs, hidden,
                                                       1, BLOCK_M, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + row[:, None] * sxm + offs_k[None, :]
    b_ptrs = w_ptr + e * swe + offs_n[None, :].to(tl.int64) * swn + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kk in range(0, (inter + BLOCK_K - 1) // BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=nmask[None, :], other=0.0)
        else:
            kmask = offs_k < inter - kk * BLOCK_K
            a = tl.load(a_ptrs, mask=valid[:, None] & kmask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=nmask[None, :] & kmask[:, None], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PREC)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    acc = down_epilogue(acc, b_ptr, e, sbe, offs_n, nmask, tw_ptr, row, valid, HAS_BIAS)
    store_pair_rows(out_ptr, som, pair, valid, offs_n, nmask, acc)


@triton.jit
def _moe_sum_kernel(x_ptr, out_ptr, num_tokens, hidden, sxm, som, TOP_K: tl.constexpr, BLOCK_T: tl.constexpr,
                    BLOCK_H: tl.constexpr):
    """Program (token block, column block): out[t] = sum_j x[t * k + j] in fp32, slot order."""
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    m = (t[:, None] < num_tokens) & (cols[None, :] < hidden)
    acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(x_ptr + (t[:, None] * TOP_K + j) * sxm + cols[None, :], mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + t[:, None] * som + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=m)


def moe_config(num_tokens: int, top_k: int, num_experts: int, dtype: torch.dtype) -> dict:
    """Tiles of the two grouped GEMMs, chosen by the average rows per expert (tokens * k / E).

    Few rows per expert (decode): BLOCK_M 16 so little of each tile is padding, long K tiles.
    Many rows (prefill, >= 64 per expert): 128-row tiles, 8 warps, a 3-4 stage cp.async pipeline
    feeding Hopper's warp-group MMA. gate_up keeps two accumulators, so half the columns of down.
    fp32 (exact "ieee" products on CUDA cores) uses smaller tiles.
    """
    rows = num_tokens * top_k / max(num_experts, 1)
    if dtype == torch.float32:
        bm = 16 if rows <= 16 else 32 if rows <= 32 else 64
        gu = dict(BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=2)
        down = dict(BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=2)
    elif rows <= 16:
        bm = 16
        gu = dict(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)
        down = dict(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)
    elif rows <= 48:
        bm = 32
        gu = dict(BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4)
        down = dict(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)
    elif rows <= 96:
        bm = 64
        gu = dict(BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4)
        down = dict(BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4)
    else:
        bm = 128
        gu = dict(BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=4)
        down = dict(BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4)
    return dict(BLOCK_M=bm, gate_up=gu, down=down, GROUP_M=8)


def _fused_experts_triton(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    activation: str = "silu",
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
    *,
    config: dict | None = None,
) -> torch.Tensor:
    """See ``fused_experts_ref``. ``config`` overrides ``moe_config`` (benchmark sweeps)."""
    check_device(hidden)
    _check_experts(hidden, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, activation)
    t, h = hidden.shape
    e, two_i, _ = w13.shape
    inter = two_i // 2
    k = topk_ids.shape[1]
    if t == 0:
        return hidden.new_empty(0, h)
    hidden = hidden.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()
    tw = topk_weights.reshape(-1).float().contiguous()
    cfg = moe_config(t, k, e, hidden.dtype)
    if config:
        cfg = {**cfg, **config}
    bm, gm = cfg["BLOCK_M"], cfg["GROUP_M"]
    sorted_ids, expert_ids, npost = _moe_align_block_size_triton(topk_ids, e, bm)
    tiles_m = sorted_ids.numel() // bm
    prec = dot_precision(hidden.dtype)
    n_pairs = t * k

    inter_out = hidden.new_empty(n_pairs, inter)
    gu = cfg["gate_up"]
    b13 = w13_bias.contiguous() if w13_bias is not None else w13
    _moe_gate_up_kernel[(tiles_m * triton.cdiv(inter, gu["BLOCK_N"]),)](
        hidden, w13, b13, w13, inter_out, sorted_ids, expert_ids, npost,  # no delta: w13 stands in, never read
        n_pairs, inter, h, hidden.stride(0), w13.stride(0), w13.stride(1), b13.stride(0), 0, inter_out.stride(0),
        float(swiglu_alpha), float(swiglu_limit),
        TOP_K=k, ACT=ACTIVATIONS.index(activation), HAS_BIAS=w13_bias is not None, HAS_DELTA=False,
        EVEN_K=h % gu["BLOCK_K"] == 0,
        BLOCK_M=bm, GROUP_M=gm, DOT_PREC=prec, **gu,
    )
    pair_out = hidden.new_empty(n_pairs, h)
    dn = cfg["down"]
    b2 = w2_bias.contiguous() if w2_bias is not None else w2
    _moe_down_kernel[(tiles_m * triton.cdiv(h, dn["BLOCK_N"]),)](
        inter_out, w2, b2, tw, pair_out, sorted_ids, expert_ids, npost,
        n_pairs, h, inter, inter_out.stride(0), w2.stride(0), w2.stride(1), b2.stride(0), pair_out.stride(0),
        HAS_BIAS=w2_bias is not None, EVEN_K=inter % dn["BLOCK_K"] == 0,
        BLOCK_M=bm, GROUP_M=gm, DOT_PREC=prec, **dn,
    )
    return _moe_sum_triton(pair_out.view(t, k, h))


def moe_sum_ref(x: torch.Tensor) -> torch.Tensor:
    """x [T, k, H] -> [T, H], summed in fp32 in slot order."""
    return x.float().sum(dim=1).to(x.dtype)


def sum_config(hidden: int) -> dict:
    block_h = min(next_pow2(hidden), 1024)
    return dict(BLOCK_T=max(1, 2048 // block_h), BLOCK_H=block_h, num_warps=4)


def _moe_sum_triton(x: torch.Tensor) -> torch.Tensor:
    check_device(x)
    t, k, h = x.shape
    out = x.new_empty(t, h)
    if t == 0:
        return out
    x2 = x.reshape(t * k, h)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    cfg = sum_config(h)
    grid = (triton.cdiv(t, cfg["BLOCK_T"]), triton.cdiv(h, cfg["BLOCK_H"]))
    _moe_sum_kernel[grid](x2, out, t, h, x2.stride(0), out.stride(0), TOP_K=k, **cfg)
    return out


moe_sum = kernel_op(
    "moe_sum", _moe_sum_triton, moe_sum_ref, lambda x: x.new_empty(x.shape[0], x.shape[2]),
    doc="Sum over each token's k expert outputs: [T, k, H] -> [T, H].",
)


fused_experts = kernel_op(
    "fused_experts", _fused_experts_triton, checked(fused_experts_ref, _check_experts),
    lambda hidden, *_: hidden.new_empty(hidden.shape), signature=fused_experts_ref,
    doc="The routed experts of one MoE layer; see the module docstring and ``fused_experts_ref``.",
)
