"""What every fused-MoE grouped GEMM shares: bf16 ``moe_gemm``, FP8 ``moe_fp8``, 4-bit ``moe_w4a16``.

The kernels differ only in how they load and multiply a K tile. Around that loop they are the same:
a program's place (grouped tile order over the pairs that ``moe_align`` sorted by expert, the row
tile's pairs, the token row each reads, its expert), the two epilogues (gate+up: bias, then the
activation; down: bias, then the routing weight), the store of one tile of pair rows. The
``@triton.jit`` helpers below are inlined into each kernel. ``experts_loop_ref`` is the references'
side: the loop over the experts that received pairs, one expert's rows at a time.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# isort: off
# _launch picks Triton's interpreter on machines without a GPU; it must run before triton loads
import tokenfab.kernels._launch  # noqa: F401
import triton
import triton.language as tl
# isort: on


@triton.jit
def grouped_tile(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(row tile, column tile) of program ``pid`` in grouped order: GROUP_M row tiles sweep all column tiles
    together, so a weight tile stays in L2 while those rows use it."""
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (pid % in_group) % size_m, (pid % in_group) // size_m


@triton.jit
def moe_program_tile(n_cols, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row tile, column tile) of this program of a 1-D grid of row tiles x ceil(n_cols / BLOCK_N)."""
    num_pid_n = (n_cols + BLOCK_N - 1) // BLOCK_N
    return grouped_tile(tl.program_id(0), tl.num_programs(0) // num_pid_n, num_pid_n, GROUP_M)


@triton.jit
def moe_pair_tile(pid_m, pid_n, sorted_ptr, expert_ids_ptr, num_pairs, n_cols, TOP_K: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Row tile ``pid_m``'s sorted pair ids, which of them are real pairs (sentinels are not), the input
    row each reads (``pair // TOP_K``: the token for gate+up; TOP_K 1: the pair's own row for down),
    the tile's expert; column tile ``pid_n``'s columns and their mask."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + offs_m)
    valid = pair < num_pairs
    row = tl.where(valid, pair // TOP_K, 0).to(tl.int64)
    e = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < n_cols
    return pair, valid, row, e, offs_n, nmask


@triton.jit
def gate_up_epilogue(acc_g, acc_u, b_ptr, e, sbe, inter, offs_n, nmask, alpha, limit, HAS_BIAS: tl.constexpr,
                     ACT: tl.constexpr):
    """fp32 gate and up tiles -> the activated tile: expert e's gate and up biases (columns n, I + n)
    added, then ACT 0: silu(g) * u; 1: GPT-OSS's clamped SwiGLU; 2: silu(min(g, limit)) * clamp(u, +-limit)
    (DeepSeek-V4) (``moe_activation_ref``)."""
    if HAS_BIAS:
        acc_g += tl.load(b_ptr + e * sbe + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(b_ptr + e * sbe + inter + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    if ACT == 0:
        h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    elif ACT == 1:
        g = tl.minimum(acc_g, limit)
        u = tl.minimum(tl.maximum(acc_u, -limit), limit)
        h = (u + 1.0) * (g / (1.0 + tl.exp(-alpha * g)))
    else:
        g = tl.minimum(acc_g, limit)
        u = tl.minimum(tl.maximum(acc_u, -limit), limit)
        h = g / (1.0 + tl.exp(-g)) * u
    return h


@triton.jit
def down_epilogue(acc, b_ptr, e, sbe, offs_n, nmask, tw_ptr, row, valid, HAS_BIAS: tl.constexpr):
    """fp32 down tile -> (acc + expert e's bias) * each pair's routing weight (``tw[row]``)."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + e * sbe + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    return acc * tl.load(tw_ptr + row, mask=valid, other=0.0)[:, None]


@triton.jit
def store_pair_rows(out_ptr, som, pair, valid, offs_n, nmask, val):
    """out[pair, n] = val in out's dtype for the real pairs of the tile and its columns in range."""
    o_ptrs = out_ptr + pair[:, None].to(tl.int64) * som + offs_n[None, :]
    tl.store(o_ptrs, val.to(out_ptr.dtype.element_ty), mask=valid[:, None] & nmask[None, :])


def experts_loop_ref(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                     expert: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """hidden [T, H] -> [T, H]: sum over j of topk_weights[t, j] * expert_{ids[t, j]}(hidden[t]).

    ``expert(e, pairs)`` returns expert e's fp32 outputs [c, H] for the flat (token, slot) pairs it
    received (``pairs // k`` are their tokens), called once per expert that received any, in pair
    order. Each pair's weighted row is rounded to the input dtype (as the kernels store it) and the
    k rows of a token are summed in fp32 in slot order (as ``moe_sum``)."""
    t, h = hidden.shape
    k = topk_ids.shape[1]
    if t == 0:
        return hidden.new_empty(0, h)
    out = hidden.new_empty(t * k, h)
    flat = topk_ids.reshape(-1).long()
    wflat = topk_weights.reshape(-1).float()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    start = 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        pairs = order[start : start + c]
        start += c
        out[pairs] = (expert(e, pairs) * wflat[pairs, None]).to(out.dtype)
    return out.view(t, k, h).float().sum(dim=1).to(hidden.dtype)
