"""Multi-LoRA on MoE experts: one layer's routed experts with each token's own adapter delta added to
the outputs of the experts it is routed to, in one call however many adapters the batch mixes.

For the pair (token t, slot j), expert e = ids[t, j] and adapter s = token_slots[t] (-1: the base):

    gate = x_t W13[e, :I]^T + Bg[e, s] Ag[e, s] x_t        up = x_t W13[e, I:]^T + Bu[e, s] Au[e, s] x_t
    h    = act(gate, up)                                    (biases, when the experts have them, added too)
    y_tj = (h W2[e]^T + Bd[e, s] Ad[e, s] h) * w_tj
    out_t = sum_j y_tj

Pools (``layers.moe_lora``): ``a_*`` [E, S, r, K], ``b_*`` [E, S, N, r] for gate, up (K = H, N = I)
and down (K = I, N = H), the adapter's scale folded into B, zeros past an adapter's rank; expert-major,
so one expert's slice of every slot is contiguous. A base token's delta is an exact zero.

- The reference (and the CPU path) loops over the experts that received pairs, as the plain experts'
  reference does, and takes each expert's deltas through ``lora_delta`` over that expert's slice of
  the pools, grouped by adapter inside (so the work is grouped by (adapter, expert), never per token).
- Triton: the pools viewed as E*S adapters of the BGMV kernel (``kernels.lora``, index e*S + s per
  pair) give the gate/up deltas of every pair; ``moe_gemm``'s grouped gate+up GEMM (HAS_DELTA) adds
  them before the activation; the down delta of the activated rows, times the routing weight, is added to
  ``moe_gemm``'s down output rows before the per-token sum. Base tokens go the same way (zero deltas);
  a step without any adapter never comes here (the layer calls ``fused_experts``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# isort: off
# _launch picks Triton's interpreter on machines without a GPU; it must run before triton loads
from tokenfab.kernels._launch import check_device, dot_precision
import triton
# isort: on

from tokenfab.kernels._dispatch import kernel_op
from tokenfab.kernels.lora import _lora_delta_triton, lora_delta_cpu, lora_delta_ref
from tokenfab.kernels.moe_align import _moe_align_block_size_triton
from tokenfab.kernels.moe_common import experts_loop_ref
from tokenfab.kernels.moe_gemm import (
    ACTIVATIONS,
    _check_experts,
    _moe_down_kernel,
    _moe_gate_up_kernel,
    _moe_sum_triton,
    moe_activation_ref,
    moe_config,
)


def _check_pools(hidden, w13, w2, token_slots, a_gate, b_gate, a_up, b_up, a_down, b_down) -> None:
    t, h = hidden.shape
    e, two_i, _ = w13.shape
    i = two_i // 2
    if token_slots.shape != (t,):
        raise ValueError(f"token_slots must be [{t}], got {tuple(token_slots.shape)}")
    _, s, r, _ = a_gate.shape
    for name, a, b, k, n in (("gate", a_gate, b_gate, h, i), ("up", a_up, b_up, h, i), ("down", a_down, b_down, i, h)):
        if tuple(a.shape) != (e, s, r, k) or tuple(b.shape) != (e, s, n, r):
            raise ValueError(f"LoRA pool of {name}: a {tuple(a.shape)} / b {tuple(b.shape)} do not fit "
                             f"{s} slots, {e} experts, rank {r}, {k} -> {n}")


def _experts_lora(hidden, w13, w2, topk_weights, topk_ids, token_slots, a_gate, b_gate, a_up, b_up, a_down, b_down,
                  w13_bias, w2_bias, activation, swiglu_alpha, swiglu_limit, delta) -> torch.Tensor:
    """The reference's loop over experts, with ``delta`` (``lora_delta_ref`` or the CPU path) for the deltas."""
    k = topk_ids.shape[1]
    slots = token_slots.long()

    def expert(e: int, pairs: torch.Tensor) -> torch.Tensor:
        tokens = pairs // k
        x, s = hidden[tokens], slots[tokens]
        gu = F.linear(x.float(), w13[e].float(), None if w13_bias is None else w13_bias[e].float())
        i = gu.shape[1] // 2
        gu[:, :i] += delta(x, s, a_gate[e], b_gate[e]).float()
        gu[:, i:] += delta(x, s, a_up[e], b_up[e]).float()
        act = moe_activation_ref(gu, activation, swiglu_alpha, swiglu_limit).to(hidden.dtype)
        y = F.linear(act.float(), w2[e].float(), None if w2_bias is None else w2_bias[e].float())
        return y + delta(act, s, a_down[e], b_down[e]).float()

    return experts_loop_ref(hidden, topk_weights, topk_ids, w13.shape[0], expert)


def fused_experts_lora_ref(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    token_slots: torch.Tensor,
    a_gate: torch.Tensor,
    b_gate: torch.Tensor,
    a_up: torch.Tensor,
    b_up: torch.Tensor,
    a_down: torch.Tensor,
    b_down: torch.Tensor,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    activation: str = "silu",
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
) -> torch.Tensor:
    """hidden [T, H] -> [T, H]: ``fused_experts_ref`` with each pair's adapter deltas (module docstring)."""
    _check_experts(hidden, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, activation)
    _check_pools(hidden, w13, w2, token_slots, a_gate, b_gate, a_up, b_up, a_down, b_down)
    return _experts_lora(hidden, w13, w2, topk_weights, topk_ids, token_slots, a_gate, b_gate, a_up, b_up, a_down,
                         b_down, w13_bias, w2_bias, activation, swiglu_alpha, swiglu_limit, lora_delta_ref)


def fused_experts_lora_cpu(hidden, w13, w2, topk_weights, topk_ids, token_slots, a_gate, b_gate, a_up, b_up, a_down,
                           b_down, w13_bias=None, w2_bias=None, activation="silu", swiglu_alpha=1.702,
                           swiglu_limit=7.0) -> torch.Tensor:
    """The reference with the CPU path of ``lora_delta`` (two dense GEMMs over the slots for an expert's
    few rows, grouped products past that)."""
    _check_experts(hidden, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, activation)
    _check_pools(hidden, w13, w2, token_slots, a_gate, b_gate, a_up, b_up, a_down, b_down)
    return _experts_lora(hidden, w13, w2, topk_weights, topk_ids, token_slots, a_gate, b_gate, a_up, b_up, a_down,
                         b_down, w13_bias, w2_bias, activation, swiglu_alpha, swiglu_limit, lora_delta_cpu)


def _pair_adapters(token_slots: torch.Tensor, topk_ids: torch.Tensor, num_slots: int) -> torch.Tensor:
    """[T*k] int32: each pair's row of the pools viewed as [E*S, ...] (e*S + s), -1 for a base token."""
    slots = token_slots.long().repeat_interleave(topk_ids.shape[1])
    idx = topk_ids.reshape(-1).long() * num_slots + slots
    return torch.where(slots >= 0, idx, -1).to(torch.int32)


def _flat(pool: torch.Tensor) -> torch.Tensor:
    return pool.reshape(pool.shape[0] * pool.shape[1], *pool.shape[2:])


def _fused_experts_lora_triton(hidden, w13, w2, topk_weights, topk_ids, token_slots, a_gate, b_gate, a_up, b_up,
                               a_down, b_down, w13_bias=None, w2_bias=None, activation="silu", swiglu_alpha=1.702,
                               swiglu_limit=7.0) -> torch.Tensor:
    """See ``fused_experts_lora_ref``."""
    check_device(hidden)
    _check_experts(hidden, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, activation)
    _check_pools(hidden, w13, w2, token_slots, a_gate, b_gate, a_up, b_up, a_down, b_down)
    t, h = hidden.shape
    e, two_i, _ = w13.shape
    inter, k = two_i // 2, topk_ids.shape[1]
    if t == 0:
        return hidden.new_empty(0, h)
    hidden, w13, w2 = hidden.contiguous(), w13.contiguous(), w2.contiguous()
    n_pairs = t * k
    idx = _pair_adapters(token_slots, topk_ids, a_gate.shape[1])
    x_pairs = hidden.repeat_interleave(k, dim=0)  # pair p = t*k + j reads token t
    delta13 = torch.cat((_lora_delta_triton(x_pairs, idx, _flat(a_gate), _flat(b_gate)),
                         _lora_delta_triton(x_pairs, idx, _flat(a_up), _flat(b_up))), dim=1)
    cfg = moe_config(t, k, e, hidden.dtype)
    bm, gm = cfg["BLOCK_M"], cfg["GROUP_M"]
    sorted_ids, expert_ids, npost = _moe_align_block_size_triton(topk_ids, e, bm)
    tiles_m = sorted_ids.numel() // bm
    prec = dot_precision(hidden.dtype)

    inter_out = hidden.new_empty(n_pairs, inter)
    gu = cfg["gate_up"]
    b13 = w13_bias.contiguous() if w13_bias is not None else w13
    _moe_gate_up_kernel[(tiles_m * triton.cdiv(inter, gu["BLOCK_N"]),)](
        hidden, w13, b13, delta13, inter_out, sorted_ids, expert_ids, npost,
        n_pairs, inter, h, hidden.stride(0), w13.stride(0), w13.stride(1), b13.stride(0), delta13.stride(0),
        inter_out.stride(0), float(swiglu_alpha), float(swiglu_limit),
        TOP_K=k, ACT=ACTIVATIONS.index(activation), HAS_BIAS=w13_bias is not None, HAS_DELTA=True,
        EVEN_K=h % gu["BLOCK_K"] == 0,
        BLOCK_M=bm, GROUP_M=gm, DOT_PREC=prec, **gu,
    )
    tw = topk_weights.reshape(-1).float().contiguous()
    pair_out = hidden.new_empty(n_pairs, h, dtype=torch.float32)  # the down delta joins before any rounding
    dn = cfg["down"]
    b2 = w2_bias.contiguous() if w2_bias is not None else w2
    _moe_down_kernel[(tiles_m * triton.cdiv(h, dn["BLOCK_N"]),)](
        inter_out, w2, b2, tw, pair_out, sorted_ids, expert_ids, npost,
        n_pairs, h, inter, inter_out.stride(0), w2.stride(0), w2.stride(1), b2.stride(0), pair_out.stride(0),
        HAS_BIAS=w2_bias is not None, EVEN_K=inter % dn["BLOCK_K"] == 0,
        BLOCK_M=bm, GROUP_M=gm, DOT_PREC=prec, **dn,
    )
    delta2 = _lora_delta_triton(inter_out, idx, _flat(a_down), _flat(b_down))
    pair_out += delta2.float() * tw[:, None]
    return _moe_sum_triton(pair_out.view(t, k, h)).to(hidden.dtype)


fused_experts_lora = kernel_op(
    "fused_experts_lora", _fused_experts_lora_triton, fused_experts_lora_ref,
    lambda hidden, *_: hidden.new_empty(hidden.shape), native=fused_experts_lora_cpu,
    doc="The routed experts of one MoE layer with per-token LoRA deltas; see ``fused_experts_lora_ref``.",
)
