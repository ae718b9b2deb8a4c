"""MoE training: the grouped GEMM with its backward, and the SwiGLU experts of a MoE layer built
on it, so MoE models train without a per-expert Python loop.

``grouped_gemm_train(x [T, K], w [E, N, K], counts [E])``: the rows of ``x`` are sorted by expert
(expert e owns ``counts[e]`` consecutive rows, possibly none); ``y[rows of e] = x_e @ w[e]^T``.
Backward: ``dx_e = dy_e @ w[e]`` (the same grouped kernel, reading ``w`` untransposed) and
``dw[e] = dy_e^T @ x_e`` (one program per (expert, N tile, K tile) looping over the expert's rows;
an expert without rows gets zeros). Row tiles never straddle two experts: each expert's run is cut
into ceil(count / BLOCK_M) tiles and a program finds its tile's expert from the cumulative tile
counts (no host sync, no padding copy of the activations).

``moe_experts_train(hidden, topk_ids, topk_weights, w_gate_up, w_down, act)`` is the routed experts
of Hugging Face's ``Qwen3MoeExperts`` (the same weight layout: ``gate_up_proj [E, 2I, H]``,
``down_proj [E, H, I]``): the (token, slot) pairs are sorted by expert (a stable argsort, as
``moe_align``'s order), two grouped GEMMs with the activation between them, the routing weight,
and the pairs unsorted and summed per token in slot order. Every step is a tensor op with an
autograd rule, so gradients reach hidden, topk_weights, w_gate_up and w_down; the gather/unsort
are permutations (no atomics): the result is deterministic.

Dispatch: "triton" -> the Triton grouped kernels in an ``autograd.Function``; otherwise the
per-expert loop of ``grouped_gemm_train_ref`` (autograd), which is also the test oracle.
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

from tokenfab.kernels._dispatch import use_triton

TRAIN_ACTIVATIONS = ("silu", "gelu")  # gate activation: SiLU (SwiGLU) or tanh-GELU (GeGLU)


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _grouped_mm_kernel(
    a_ptr, b_ptr, c_ptr, counts_ptr, row_start_ptr, tile_end_ptr,
    num_experts, n_out, k_in, sam, sbe, sbk, sbn, scm,
    BLOCK_E: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Program (row tile p, column tile): C[r, n] = sum_k A[r, k] * B[e, k, n] over the rows r of
    tile p, which belongs to expert e (tile_end = cumulative tiles per expert). B's strides make it
    w[e]^T (forward) or w[e] (d input)."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(n_out, BLOCK_N)
    p = pid // num_n
    pid_n = pid % num_n
    es = tl.arange(0, BLOCK_E)
    ends = tl.load(tile_end_ptr + es, mask=es < num_experts, other=2147483647)
    e = tl.sum((ends <= p).to(tl.int32), axis=0)
    if e >= num_experts:
        return
    count = tl.load(counts_ptr + e)
    first_tile = tl.load(tile_end_ptr + e) - tl.cdiv(count, BLOCK_M)
    row0 = tl.load(row_start_ptr + e)
    local = (p - first_tile) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = local < count
    rows = (row0 + local).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < n_out
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * sam + offs_k[None, :]
    b_ptrs = b_ptr + e.to(tl.int64) * sbe + offs_k[:, None].to(tl.int64) * sbk + offs_n[None, :].to(tl.int64) * sbn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kk in range(0, tl.cdiv(k_in, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=rmask[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=nmask[None, :], other=0.0)
        else:
            kmask = offs_k < k_in - kk * BLOCK_K
            a = tl.load(a_ptrs, mask=rmask[:, None] & kmask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PREC)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * sbk
    c_ptrs = c_ptr + rows[:, None] * scm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=rmask[:, None] & nmask[None, :])


@triton.jit
def _grouped_wgrad_kernel(
    dy_ptr, x_ptr, dw_ptr, counts_ptr, row_start_ptr,
    n_dim, k_dim, sdy, sx, swe, swn,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Program (expert e, N tile, K tile): dW[e, n, k] = sum over e's rows r of dY[r, n] * X[r, k]."""
    e = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(2) * BLOCK_K + tl.arange(0, BLOCK_K)
    nmask = offs_n < n_dim
    kmask = offs_k < k_dim
    count = tl.load(counts_ptr + e)
    row0 = tl.load(row_start_ptr + e)
    offs_t = tl.arange(0, BLOCK_T)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for t0 in range(0, count, BLOCK_T):
        tmask = t0 + offs_t < count
        rows = (row0 + t0 + offs_t).to(tl.int64)
        a = tl.load(dy_ptr + rows[None, :] * sdy + offs_n[:, None], mask=nmask[:, None] & tmask[None, :], other=0.0)
        b = tl.load(x_ptr + rows[:, None] * sx + offs_k[None, :], mask=tmask[:, None] & kmask[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PREC)
    out = dw_ptr + e.to(tl.int64) * swe + offs_n[:, None].to(tl.int64) * swn + offs_k[None, :]
    tl.store(out, acc.to(dw_ptr.dtype.element_ty), mask=nmask[:, None] & kmask[None, :])


def grouped_config(dtype: torch.dtype) -> dict:
    """Tiles: 16-bit operands get 64-row tiles (Hopper's warp-group MMA), a 3-stage pipeline; fp32
    (exact "ieee" products on CUDA cores) smaller tiles."""
    if dtype == torch.float32:
        return dict(mm=dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=2),
                    wgrad=dict(BLOCK_N=32, BLOCK_K=32, BLOCK_T=32, num_warps=4, num_stages=2))
    return dict(mm=dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=3),
                wgrad=dict(BLOCK_N=128, BLOCK_K=64, BLOCK_T=64, num_warps=4, num_stages=3))


def _layout(counts: torch.Tensor, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(counts, first row of each expert, cumulative row tiles) as int32 device tensors (no sync)."""
    c = counts.to(torch.int32)
    start = torch.cumsum(c, 0, dtype=torch.int32) - c
    tile_end = torch.cumsum((c + block_m - 1) // block_m, 0, dtype=torch.int32)
    return c.contiguous(), start, tile_end


def _grouped_mm_triton(a: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, transpose_w: bool) -> torch.Tensor:
    """a [T, K'] -> [T, N']: a_e @ w[e]^T (transpose_w, w [E, N', K']) or a_e @ w[e] (w [E, K', N'])."""
    check_device(a)
    a = a.contiguous()
    e = w.shape[0]
    if transpose_w:
        n_out, k_in = w.shape[1], w.shape[2]
        sbk, sbn = w.stride(2), w.stride(1)
    else:
        k_in, n_out = w.shape[1], w.shape[2]
        sbk, sbn = w.stride(1), w.stride(2)
    t = a.shape[0]
    out = a.new_empty(t, n_out)
    if t == 0 or n_out == 0:
        return out
    cfg = grouped_config(a.dtype)["mm"]
    bm = cfg["BLOCK_M"]
    c, start, tile_end = _layout(counts, bm)
    max_tiles = triton.cdiv(t, bm) + min(e, t)  # each expert with rows pads its run by < one tile
    grid = (max_tiles * triton.cdiv(n_out, cfg["BLOCK_N"]),)
    _grouped_mm_kernel[grid](
        a, w, out, c, start, tile_end, e, n_out, k_in, a.stride(0), w.stride(0), sbk, sbn, out.stride(0),
        BLOCK_E=next_pow2(e), EVEN_K=k_in % cfg["BLOCK_K"] == 0, DOT_PREC=dot_precision(a.dtype), **cfg,
    )
    return out


def _grouped_wgrad_triton(dy: torch.Tensor, x: torch.Tensor, counts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """dy [T, N], x [T, K] -> dw [E, N, K] = per expert dy_e^T @ x_e (zeros for experts without rows)."""
    check_device(dy)
    dy, x = dy.contiguous(), x.contiguous()
    n, k = dy.shape[1], x.shape[1]
    dw = dy.new_empty(num_experts, n, k)
    if dw.numel() == 0:
        return dw
    cfg = grouped_config(dy.dtype)["wgrad"]
    c, start, _ = _layout(counts, 1)
    grid = (num_experts, triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(k, cfg["BLOCK_K"]))
    _grouped_wgrad_kernel[grid](
        dy, x, dw, c, start, n, k, dy.stride(0), x.stride(0), dw.stride(0), dw.stride(1),
        DOT_PREC=dot_precision(dy.dtype), **cfg,
    )
    return dw


class _GroupedGemm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, counts):
        ctx.save_for_backward(x, w, counts)
        return _grouped_mm_triton(x, w, counts, transpose_w=True)

    @staticmethod
    def backward(ctx, dy):
        x, w, counts = ctx.saved_tensors
        dx = _grouped_mm_triton(dy, w, counts, transpose_w=False) if ctx.needs_input_grad[0] else None
        dw = _grouped_wgrad_triton(dy, x, counts, w.shape[0]) if ctx.needs_input_grad[1] else None
        return dx, dw, None


# ----------------------------------------------------------------------------- public ops


def _check_grouped(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> None:
    if x.dim() != 2 or w.dim() != 3 or w.shape[2] != x.shape[1]:
        raise ValueError(f"expected x [T, K] and w [E, N, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.dtype != w.dtype:
        raise ValueError(f"x and w must share a dtype: {x.dtype}, {w.dtype}")
    if counts.shape != (w.shape[0],) or counts.dtype.is_floating_point:
        raise ValueError(f"counts must be an integer tensor [{w.shape[0]}], got {counts.dtype} {tuple(counts.shape)}")
    if counts.device != x.device or w.device != x.device:
        raise ValueError(f"x, w and counts must be on one device: {x.device}, {w.device}, {counts.device}")
    if counts.device.type == "cpu":  # free on CPU; on a GPU it would be a sync
        if bool((counts < 0).any()) or int(counts.sum()) != x.shape[0]:
            raise ValueError(f"counts must be >= 0 and sum to the {x.shape[0]} rows of x, got {counts.tolist()}")


def grouped_gemm_train_ref(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The per-expert loop (autograd): y[rows of e] = x_e @ w[e]^T, products in fp32, rounded to x's dtype."""
    outs = []
    start = 0
    for e, c in enumerate(counts.tolist()):
        if c:
            outs.append(F.linear(x[start:start + c].float(), w[e].float()).to(x.dtype))
        start += c
    if not outs:
        return x.new_zeros(x.shape[0], w.shape[1]) + 0 * w.sum()  # keeps w in the graph
    return torch.cat(outs)


def grouped_gemm_train(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x [T, K] with rows sorted by expert, w [E, N, K], counts [E] (rows per expert) -> [T, N],
    differentiable in x and w. Triton (grouped forward, d input and d weight kernels) where the
    dispatcher says so, else the per-expert loop."""
    _check_grouped(x, w, counts)
    if use_triton(x):
        return _GroupedGemm.apply(x, w, counts)
    return grouped_gemm_train_ref(x, w, counts)


def _check_experts(hidden, topk_ids, topk_weights, w_gate_up, w_down, act) -> None:
    if act not in TRAIN_ACTIVATIONS:
        raise ValueError(f"act must be one of {TRAIN_ACTIVATIONS}, not {act!r}")
    if hidden.dim() != 2 or w_gate_up.dim() != 3 or w_down.dim() != 3:
        raise ValueError("expected hidden [T, H], w_gate_up [E, 2I, H], w_down [E, H, I]")
    t, h = hidden.shape
    e, two_i, h1 = w_gate_up.shape
    if h1 != h or two_i % 2 or tuple(w_down.shape) != (e, h, two_i // 2):
        raise ValueError(f"expert weights {tuple(w_gate_up.shape)}, {tuple(w_down.shape)} do not fit hidden size {h}")
    if topk_ids.dim() != 2 or topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != t:
        raise ValueError(f"topk ids {tuple(topk_ids.shape)} / weights {tuple(topk_weights.shape)} for {t} tokens")
    if topk_ids.dtype.is_floating_point:
        raise ValueError(f"topk_ids must be integers, got {topk_ids.dtype}")
    if not hidden.dtype == w_gate_up.dtype == w_down.dtype:
        raise ValueError(f"hidden and expert weights must share a dtype: {hidden.dtype}, {w_gate_up.dtype}, "
                         f"{w_down.dtype}")
    if not hidden.device == topk_ids.device == topk_weights.device == w_gate_up.device == w_down.device:
        raise ValueError("hidden, topk ids/weights and expert weights must be on one device")
    if topk_ids.device.type == "cpu" and topk_ids.numel():
        if bool(((topk_ids < 0) | (topk_ids >= e)).any()):
            raise ValueError(f"topk_ids must lie in [0, {e})")


def _gated(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    g, u = gate_up.chunk(2, dim=-1)
    return (F.silu(g) if act == "silu" else F.gelu(g, approximate="tanh")) * u


def moe_experts_train(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    act: str = "silu",
) -> torch.Tensor:
    """hidden [T, H] -> [T, H] = sum_j topk_weights[t, j] * down_e(act(gate_e(x)) * up_e(x)), e = topk_ids[t, j].

    No per-expert Python loop on the Triton path; differentiable in hidden, topk_weights,
    w_gate_up and w_down. The k outputs of a token are summed in fp32, in slot order.
    """
    dev_type = hidden.device.type
    if torch.is_autocast_enabled(dev_type):  # what autocast does to HF's per-expert F.linear calls
        dt = torch.get_autocast_dtype(dev_type)
        hidden, w_gate_up, w_down = hidden.to(dt), w_gate_up.to(dt), w_down.to(dt)
    _check_experts(hidden, topk_ids, topk_weights, w_gate_up, w_down, act)
    with torch.autocast(dev_type, enabled=False):
        return _experts(hidden, topk_ids, topk_weights, w_gate_up, w_down, act)


def _experts(hidden, topk_ids, topk_weights, w_gate_up, w_down, act) -> torch.Tensor:
    t, h = hidden.shape
    k = topk_ids.shape[1]
    e = w_gate_up.shape[0]
    flat = topk_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert, in pair order within one
    inverse = torch.argsort(order)
    counts = torch.zeros(e, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    # pair p = t * k + j reads token t; a permutation gather (its backward scatters without collisions)
    x = hidden.unsqueeze(1).expand(t, k, h).reshape(t * k, h)[order]
    y = grouped_gemm_train(_gated(grouped_gemm_train(x, w_gate_up, counts), act), w_down, counts)
    y = y * topk_weights.reshape(-1)[order, None].to(y.dtype)
    return y[inverse].view(t, k, h).float().sum(dim=1).to(hidden.dtype)


def moe_experts_train_ref(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    act: str = "silu",
) -> torch.Tensor:
    """The oracle: a loop over experts (autograd), the same rounding points as ``moe_experts_train``."""
    t, h = hidden.shape
    k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1).long()
    out = torch.zeros(t, h, dtype=torch.float32, device=hidden.device)
    for ex in range(w_gate_up.shape[0]):
        pairs = (flat == ex).nonzero().squeeze(1)
        if pairs.numel() == 0:
            continue
        x = hidden[pairs // k]
        gu = F.linear(x.float(), w_gate_up[ex].float()).to(hidden.dtype)
        y = F.linear(_gated(gu, act).float(), w_down[ex].float()).to(hidden.dtype)
        y = y * topk_weights.reshape(-1)[pairs, None].to(y.dtype)
        out = out.index_add(0, pairs // k, y.float())
    return out.to(hidden.dtype)


_HF_ACTIVATIONS = {"SiLUActivation": "silu", "SiLU": "silu", "GELUTanh": "gelu", "PytorchGELUTanh": "gelu",
                   "NewGELUActivation": "gelu"}


def hf_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                       top_k_weights: torch.Tensor) -> torch.Tensor:
    """A drop-in forward for Hugging Face's 3-D expert modules (``Qwen3MoeExperts``: ``gate_up_proj
    [E, 2I, H]``, ``down_proj [E, H, I]``, ``act_fn``), replacing their per-expert loop:
    ``experts.forward = types.MethodType(hf_experts_forward, experts)``."""
    act = _HF_ACTIVATIONS.get(type(self.act_fn).__name__)
    if act is None:
        raise ValueError(f"moe_experts_train has no gated activation for {type(self.act_fn).__name__}")
    return moe_experts_train(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj, act)
