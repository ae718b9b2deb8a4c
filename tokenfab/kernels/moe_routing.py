"""MoE routing: each token's k experts and their weights from the router logits.

``topk_softmax`` (Mixtral, Qwen-MoE, GPT-OSS): softmax over the experts, top k (optionally
renormalised). ``grouped_topk`` (DeepSeek-V3 family): sigmoid or softmax scores plus a correction
bias choose the best ``topk_groups`` expert groups, then the top k experts inside them; weights
are the uncorrected scores (renormalised, scaled). Triton: one program per block of tokens.
Weights are fp32, ids int32.
"""

from __future__ import annotations

import torch

# isort: off
# _launch picks Triton's interpreter on machines without a GPU; it must run before triton loads
from tokenfab.kernels._launch import check_device, next_pow2
import triton
import triton.language as tl
# isort: on

from tokenfab.kernels._dispatch import checked, kernel_op


def topk_softmax_ref(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k] fp32, ids [T, k] int32), largest first.

    weights = softmax(logits) at the k largest logits; with ``renormalize`` they are divided by
    their sum (= softmax over the k selected logits, GPT-OSS's "top-k then softmax").
    """
    probs = torch.softmax(logits.float(), dim=-1)
    w, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return w, ids.to(torch.int32)


def grouped_topk_ref(
    logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    num_groups: int,
    topk_groups: int,
    renormalize: bool,
    routed_scaling_factor: float = 1.0,
    scoring: str = "sigmoid",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-limited routing (DeepSeek-V2/V3): logits [T, E] -> (weights [T, k] fp32, ids [T, k] int32).

    scores = sigmoid(logits) (or softmax); choice = scores + correction_bias. The E experts form
    ``num_groups`` equal groups; a group's score is the sum of its two best choice values when a
    correction bias is given (V3), else its best value (V2). Only the ``topk_groups`` best groups
    stay; the k experts with the best choice values among them are picked. Their weights are the
    scores *without* the bias, renormalized to sum 1 if asked, times ``routed_scaling_factor``.
    """
    t, e = logits.shape
    scores = torch.sigmoid(logits.float()) if scoring == "sigmoid" else torch.softmax(logits.float(), dim=-1)
    choice = scores + correction_bias.float() if correction_bias is not None else scores
    per = choice.view(t, num_groups, e // num_groups)
    if correction_bias is not None:
        group_scores = per.topk(2, dim=-1).values.sum(dim=-1)
    else:
        group_scores = per.max(dim=-1).values
    top_groups = group_scores.topk(topk_groups, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, top_groups, True)
    keep = keep.repeat_interleave(e // num_groups, dim=1)
    ids = choice.masked_fill(~keep, float("-inf")).topk(top_k, dim=-1).indices
    w = scores.gather(1, ids)
    if renormalize:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * routed_scaling_factor, ids.to(torch.int32)


@triton.jit
def _topk_softmax_kernel(
    logits_ptr, w_ptr, ids_ptr, num_tokens, num_experts, slt,
    TOP_K: tl.constexpr,
    RENORM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Program: BLOCK_T tokens. Softmax over the experts, then k rounds of (max, first argmax, mask)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    ks = tl.arange(0, BLOCK_K)
    rmask = rows < num_tokens
    mask = rmask[:, None] & (cols[None, :] < num_experts)
    x = tl.load(logits_ptr + rows[:, None].to(tl.int64) * slt + cols[None, :], mask=mask,
                other=float("-inf")).to(tl.float32)
    x = tl.where(rmask[:, None], x, 0.0)  # padded rows: finite values, never stored
    m = tl.max(x, axis=1)
    denom = tl.sum(tl.exp(x - m[:, None]), axis=1)
    w = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        mj = tl.max(x, axis=1)
        idx = tl.min(tl.where(x == mj[:, None], cols[None, :], BLOCK_E), axis=1)
        w = tl.where(ks[None, :] == j, (tl.exp(mj - m) / denom)[:, None], w)
        ids = tl.where(ks[None, :] == j, idx[:, None], ids)
        x = tl.where(cols[None, :] == idx[:, None], float("-inf"), x)
    if RENORM:
        w = w / tl.sum(w, axis=1)[:, None]
    omask = rmask[:, None] & (ks[None, :] < TOP_K)
    out = rows[:, None].to(tl.int64) * TOP_K + ks[None, :]
    tl.store(w_ptr + out, w, mask=omask)
    tl.store(ids_ptr + out, ids, mask=omask)


def _routing_block_t(block_cols: int) -> int:
    return max(1, min(64, 4096 // block_cols))


def _check_routing(logits: torch.Tensor, top_k: int) -> None:
    if logits.dim() != 2:
        raise ValueError(f"router logits must be [T, E], got {tuple(logits.shape)}")
    if not 1 <= top_k <= logits.shape[1]:
        raise ValueError(f"top_k must be in 1..{logits.shape[1]}, got {top_k}")


def _topk_softmax_triton(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    check_device(logits)
    _check_routing(logits, top_k)
    t, e = logits.shape
    w = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int32, device=logits.device)
    if t == 0:
        return w, ids
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    block_e = next_pow2(e)
    block_t = _routing_block_t(block_e)
    _topk_softmax_kernel[(triton.cdiv(t, block_t),)](
        logits, w, ids, t, e, logits.stride(0),
        TOP_K=top_k, RENORM=renormalize, BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=next_pow2(top_k),
        num_warps=4,
    )
    return w, ids


@triton.jit
def _grouped_topk_kernel(
    logits_ptr, bias_ptr, w_ptr, ids_ptr, num_tokens, group_size, num_groups, slt,
    scale,
    TOP_K: tl.constexpr,
    TOPK_GROUPS: tl.constexpr,
    SIGMOID: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RENORM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Program: BLOCK_T tokens, each as a [groups, group size] tile (expert = g * group_size + s)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    gs = tl.arange(0, BLOCK_G)
    ss = tl.arange(0, BLOCK_S)
    ks = tl.arange(0, BLOCK_K)
    rmask = rows < num_tokens
    emask = (gs[:, None] < num_groups) & (ss[None, :] < group_size)  # [G, S]
    expert = gs[:, None] * group_size + ss[None, :]  # [G, S]
    mask = rmask[:, None, None] & emask[None, :, :]
    x = tl.load(logits_ptr + rows[:, None, None].to(tl.int64) * slt + expert[None, :, :], mask=mask,
                other=0.0).to(tl.float32)
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-x))
    else:
        xm = tl.where(emask[None, :, :], x, float("-inf"))  # padded rows hold zeros: finite
        mx = tl.max(tl.max(xm, axis=2), axis=1)
        p = tl.where(emask[None, :, :], tl.exp(xm - mx[:, None, None]), 0.0)
        scores = p / tl.sum(tl.sum(p, axis=2), axis=1)[:, None, None]
    choice = scores
    if HAS_BIAS:
        b = tl.load(bias_ptr + expert, mask=emask, other=0.0).to(tl.float32)
        choice = scores + b[None, :, :]
    choice = tl.where(emask[None, :, :], choice, float("-inf"))
    # group scores: the best value (no bias) or the sum of the two best values (bias, DeepSeek-V3)
    m1 = tl.max(choice, axis=2)  # [T, G]
    if HAS_BIAS:
        first = tl.min(tl.where(choice == m1[:, :, None], ss[None, None, :], BLOCK_S), axis=2)
        rest = tl.where(ss[None, None, :] == first[:, :, None], float("-inf"), choice)
        gscore = m1 + tl.max(rest, axis=2)
    else:
        gscore = m1
    gscore = tl.where(gs[None, :] < num_groups, gscore, float("-inf"))
    keep = tl.zeros([BLOCK_T, BLOCK_G], dtype=tl.int1)
    for _ in tl.static_range(TOPK_GROUPS):
        mg = tl.max(gscore, axis=1)
        gi = tl.min(tl.where(gscore == mg[:, None], gs[None, :], BLOCK_G), axis=1)
        hit = gs[None, :] == gi[:, None]
        keep = keep | hit
        gscore = tl.where(hit, float("-inf"), gscore)
    choice = tl.where(keep[:, :, None], choice, float("-inf"))
    w = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    big = BLOCK_G * BLOCK_S
    flat = gs[:, None] * BLOCK_S + ss[None, :]
    for j in tl.static_range(TOP_K):
        mj = tl.max(tl.max(choice, axis=2), axis=1)
        sel = tl.min(tl.min(tl.where(choice == mj[:, None, None], flat[None, :, :], big), axis=2), axis=1)
        hit = flat[None, :, :] == sel[:, None, None]
        wj = tl.sum(tl.sum(tl.where(hit, scores, 0.0), axis=2), axis=1)
        idx = (sel // BLOCK_S) * group_size + sel % BLOCK_S
        w = tl.where(ks[None, :] == j, wj[:, None], w)
        ids = tl.where(ks[None, :] == j, idx[:, None], ids)
        choice = tl.where(hit, float("-inf"), choice)
    if RENORM:
        w = w / (tl.sum(w, axis=1)[:, None] + 1e-20)
    w = w * scale
    omask = rmask[:, None] & (ks[None, :] < TOP_K)
    out = rows[:, None].to(tl.int64) * TOP_K + ks[None, :]
    tl.store(w_ptr + out, w, mask=omask)
    tl.store(ids_ptr + out, ids, mask=omask)


def _check_grouped(logits: torch.Tensor, correction_bias, top_k, num_groups, topk_groups, scoring, **_) -> None:
    _check_routing(logits, top_k)
    e = logits.shape[1]
    if num_groups < 1 or e % num_groups:
        raise ValueError(f"{e} experts do not split into {num_groups} groups")
    if not 1 <= topk_groups <= num_groups:
        raise ValueError(f"topk_groups must be in 1..{num_groups}, got {topk_groups}")
    if top_k > topk_groups * (e // num_groups):
        raise ValueError(f"top_k {top_k} exceeds the experts of {topk_groups} groups")
    if correction_bias is not None and e // num_groups < 2:
        raise ValueError("a correction bias scores groups by their two best experts: groups need >= 2 experts")
    if scoring not in ("sigmoid", "softmax"):
        raise ValueError(f"scoring must be sigmoid or softmax, not {scoring!r}")


def _grouped_topk_triton(
    logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    num_groups: int,
    topk_groups: int,
    renormalize: bool,
    routed_scaling_factor: float = 1.0,
    scoring: str = "sigmoid",
) -> tuple[torch.Tensor, torch.Tensor]:
    check_device(logits)
    _check_grouped(logits, correction_bias, top_k, num_groups, topk_groups, scoring)
    t, e = logits.shape
    w = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int32, device=logits.device)
    if t == 0:
        return w, ids
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    block_g, block_s = next_pow2(num_groups), next_pow2(e // num_groups)
    block_t = _routing_block_t(block_g * block_s)
    bias = correction_bias.contiguous() if correction_bias is not None else logits
    _grouped_topk_kernel[(triton.cdiv(t, block_t),)](
        logits, bias, w, ids, t, e // num_groups, num_groups, logits.stride(0), float(routed_scaling_factor),
        TOP_K=top_k, TOPK_GROUPS=topk_groups, SIGMOID=scoring == "sigmoid",
        HAS_BIAS=correction_bias is not None, RENORM=renormalize,
        BLOCK_T=block_t, BLOCK_G=block_g, BLOCK_S=block_s, BLOCK_K=next_pow2(top_k), num_warps=4,
    )
    return w, ids


def _topk_fake(logits: torch.Tensor, top_k: int, *_) -> tuple[torch.Tensor, torch.Tensor]:
    t = logits.shape[0]
    return (logits.new_empty(t, top_k, dtype=torch.float32), logits.new_empty(t, top_k, dtype=torch.int32))


topk_softmax = kernel_op(
    "topk_softmax", _topk_softmax_triton, topk_softmax_ref, _topk_fake,
    doc="Softmax top-k routing; see ``topk_softmax_ref``.",
)


grouped_topk = kernel_op(
    "grouped_topk", _grouped_topk_triton, checked(grouped_topk_ref, _check_grouped),
    lambda logits, bias, top_k, *_: _topk_fake(logits, top_k), signature=grouped_topk_ref,
    doc="Group-limited (DeepSeek) routing; see ``grouped_topk_ref``.",
)
