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

ACTIVATIONS = ("silu", "swiglu_oai")


# =========================================================================== routing


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


def _check_grouped(logits: torch.Tensor, correction_bias, top_k, num_groups, topk_groups, scoring) -> None:
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


@torch.library.custom_op("tokenfab::topk_softmax", mutates_args=())
def topk_softmax(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing; see ``topk_softmax_ref``."""
    if use_triton(logits):
        return _topk_softmax_triton(logits, top_k, renormalize)
    return topk_softmax_ref(logits, top_k, renormalize)


@topk_softmax.register_fake
def _(logits, top_k, renormalize):
    t = logits.shape[0]
    return (logits.new_empty(t, top_k, dtype=torch.float32), logits.new_empty(t, top_k, dtype=torch.int32))


@torch.library.custom_op("tokenfab::grouped_topk", mutates_args=())
def grouped_topk(
    logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    num_groups: int,
    topk_groups: int,
    renormalize: bool,
    routed_scaling_factor: float = 1.0,
    scoring: str = "sigmoid",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-limited (DeepSeek) routing; see ``grouped_topk_ref``."""
    if use_triton(logits):
        return _grouped_topk_triton(logits, correction_bias, top_k, num_groups, topk_groups, renormalize,
                                    routed_scaling_factor, scoring)
    _check_grouped(logits, correction_bias, top_k, num_groups, topk_groups, scoring)
    return grouped_topk_ref(logits, correction_bias, top_k, num_groups, topk_groups, renormalize,
                            routed_scaling_factor, scoring)


@grouped_topk.register_fake
def _(logits, correction_bias, top_k, num_groups, topk_groups, renormalize, routed_scaling_factor=1.0,
      scoring="sigmoid"):
    t = logits.shape[0]
    return (logits.new_empty(t, top_k, dtype=torch.float32), logits.new_empty(t, top_k, dtype=torch.int32))


# =========================================================================== align block size


def max_padded_pairs(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Length of ``sorted_ids``: every expert that gets a pair pads its run by < block_m, rounded
    up to whole tiles. Depends only on the sizes (no host sync, CUDA-graph safe)."""
    padded = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return triton.cdiv(padded, block_m) * block_m


def moe_align_block_size_ref(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] -> (sorted_ids, expert_ids, num_post_padded), all int32.

    sorted_ids [max_padded_pairs]: flat pair indices (t * k + j) grouped by expert in increasing
    expert order, pairs of one expert in increasing order, each expert's run padded with the
    sentinel T * k to a multiple of ``block_m`` (experts without pairs take no room); the tail
    after ``num_post_padded`` entries is sentinel too. expert_ids [max_padded_pairs / block_m]:
    the expert of each tile, -1 past ``num_post_padded``. num_post_padded [1].
    """
    flat = topk_ids.reshape(-1).long()
    n = flat.numel()
    dev = topk_ids.device
    size = max_padded_pairs(n, num_experts, block_m)
    counts = torch.bincount(flat, minlength=num_experts)[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    start = torch.cumsum(padded, 0) - padded
    first = torch.cumsum(counts, 0) - counts  # index of the expert's first pair in sorted order
    order = torch.argsort(flat, stable=True)
    e_sorted = flat[order]
    pos = start[e_sorted] + torch.arange(n, device=dev) - first[e_sorted]
    sorted_ids = torch.full((size,), n, dtype=torch.int32, device=dev)
    sorted_ids[pos] = order.to(torch.int32)
    total = int(padded.sum())
    expert_ids = torch.full((size // block_m,), -1, dtype=torch.int32, device=dev)
    expert_ids[: total // block_m] = torch.repeat_interleave(
        torch.arange(num_experts, device=dev, dtype=torch.int32), padded // block_m
    )
    return sorted_ids, expert_ids, torch.tensor([total], dtype=torch.int32, device=dev)


@triton.jit
def _moe_count_kernel(ids_ptr, counts_ptr, num_pairs, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr):
    """Program c: histogram of the experts of pairs c*CHUNK .. (c+1)*CHUNK - 1 -> counts[c, :]."""
    c = tl.program_id(0)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1)
    es = tl.arange(0, BLOCK_E)
    cnt = tl.sum((ids[:, None] == es[None, :]).to(tl.int32), axis=0)
    tl.store(counts_ptr + c.to(tl.int64) * BLOCK_E + es, cnt)


@triton.jit
def _moe_offsets_kernel(
    counts_ptr, offsets_ptr, expert_ids_ptr, npost_ptr, num_chunks, num_tiles,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    """One program: per-expert totals -> padded runs -> offsets[c, e] = where chunk c's first pair
    of expert e goes; the tile -> expert table; the padded total."""
    es = tl.arange(0, BLOCK_E)
    total_e = tl.zeros([BLOCK_E], dtype=tl.int32)
    for c0 in range(0, num_chunks, BLOCK_C):
        cs = c0 + tl.arange(0, BLOCK_C)
        x = tl.load(counts_ptr + cs[:, None].to(tl.int64) * BLOCK_E + es[None, :], mask=cs[:, None] < num_chunks,
                    other=0)
        total_e += tl.sum(x, axis=0)
    padded = (total_e + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, axis=0)
    running = end - padded  # the expert's start in sorted_ids
    total = tl.sum(padded, axis=0)
    tl.store(npost_ptr, total)
    for c0 in range(0, num_chunks, BLOCK_C):
        cs = c0 + tl.arange(0, BLOCK_C)
        ptr = cs[:, None].to(tl.int64) * BLOCK_E + es[None, :]
        cm = cs[:, None] < num_chunks
        x = tl.load(counts_ptr + ptr, mask=cm, other=0)
        tl.store(offsets_ptr + ptr, tl.cumsum(x, axis=0) - x + running[None, :], mask=cm)
        running += tl.sum(x, axis=0)
    for b0 in range(0, num_tiles, BLOCK_B):
        bs = b0 + tl.arange(0, BLOCK_B)
        pos = bs * BLOCK_M
        e = tl.sum((end[None, :] <= pos[:, None]).to(tl.int32), axis=1)
        tl.store(expert_ids_ptr + bs, tl.where(pos < total, e, -1), mask=bs < num_tiles)


@triton.jit
def _moe_scatter_kernel(ids_ptr, offsets_ptr, sorted_ptr, num_pairs, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr):
    """Program c: each pair of the chunk goes to offsets[c, e] + (earlier pairs of e in the chunk)."""
    c = tl.program_id(0)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    m = offs < num_pairs
    ids = tl.load(ids_ptr + offs, mask=m, other=-1)
    es = tl.arange(0, BLOCK_E)
    onehot = (ids[:, None] == es[None, :]).to(tl.int32)
    rank = tl.sum(tl.cumsum(onehot, axis=0) * onehot, axis=1) - 1
    base = tl.load(offsets_ptr + c.to(tl.int64) * BLOCK_E + ids, mask=m, other=0)
    tl.store(sorted_ptr + base + rank, offs, mask=m)


def align_config(num_experts: int) -> dict:
    """Chunk sizes of the align kernels: one-hot tiles [CHUNK, BLOCK_E] of at most 8K entries,
    [BLOCK_C, BLOCK_E] count tiles of at most 2K (the offsets program's cumsum stays in registers)."""
    block_e = next_pow2(num_experts)
    return dict(BLOCK_E=block_e, CHUNK=max(16, min(256, 8192 // block_e)), BLOCK_C=max(1, min(64, 2048 // block_e)))


def _moe_align_block_size_triton(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_device(topk_ids)
    dev = topk_ids.device
    flat = topk_ids.reshape(-1)
    if flat.dtype != torch.int32 or not flat.is_contiguous():
        flat = flat.to(torch.int32).contiguous()
    n = flat.numel()
    size = max_padded_pairs(n, num_experts, block_m)
    sorted_ids = torch.full((size,), n, dtype=torch.int32, device=dev)
    num_tiles = size // block_m
    expert_ids = torch.empty(num_tiles, dtype=torch.int32, device=dev)
    npost = torch.empty(1, dtype=torch.int32, device=dev)
    cfg = align_config(num_experts)
    num_chunks = max(1, triton.cdiv(n, cfg["CHUNK"]))
    counts = torch.empty(num_chunks, cfg["BLOCK_E"], dtype=torch.int32, device=dev)
    offsets = torch.empty_like(counts)
    _moe_count_kernel[(num_chunks,)](flat, counts, n, CHUNK=cfg["CHUNK"], BLOCK_E=cfg["BLOCK_E"], num_warps=4)
    _moe_offsets_kernel[(1,)](
        counts, offsets, expert_ids, npost, num_chunks, num_tiles,
        BLOCK_M=block_m, BLOCK_C=cfg["BLOCK_C"], BLOCK_E=cfg["BLOCK_E"], BLOCK_B=max(16, 4096 // cfg["BLOCK_E"]),
        num_warps=4,
    )
    if n:
        _moe_scatter_kernel[(num_chunks,)](flat, offsets, sorted_ids, n, CHUNK=cfg["CHUNK"], BLOCK_E=cfg["BLOCK_E"],
                                           num_warps=4)
    return sorted_ids, expert_ids, npost


@torch.library.custom_op("tokenfab::moe_align_block_size", mutates_args=())
def moe_align_block_size(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group (token, slot) pairs by expert in BLOCK_M-aligned runs; see ``moe_align_block_size_ref``."""
    if use_triton(topk_ids):
        return _moe_align_block_size_triton(topk_ids, num_experts, block_m)
    return moe_align_block_size_ref(topk_ids, num_experts, block_m)


@moe_align_block_size.register_fake
def _(topk_ids, num_experts, block_m):
    size = max_padded_pairs(topk_ids.numel(), num_experts, block_m)
    return (topk_ids.new_empty(size, dtype=torch.int32), topk_ids.new_empty(size // block_m, dtype=torch.int32),
            topk_ids.new_empty(1, dtype=torch.int32))


# =========================================================================== fused experts


def _check_activation(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, not {activation!r}")


def moe_activation_ref(
    gate_up: torch.Tensor, activation: str, alpha: float = 1.702, limit: float = 7.0
) -> torch.Tensor:
    """gate_up [..., 2I] = [gate | up] -> [..., I]: silu(g) * u, or GPT-OSS's clamped SwiGLU."""
    i = gate_up.shape[-1] // 2
    g, u = gate_up[..., :i], gate_up[..., i:]
    if activation == "silu":
        return F.silu(g) * u
    g = g.clamp(max=limit)
    u = u.clamp(min=-limit, max=limit)
    return (u + 1) * (g * torch.sigmoid(g * alpha))


def _check_experts(hidden, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, activation) -> None:
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
    t, h = hidden.shape
    k = topk_ids.shape[1]
    out = hidden.new_empty(t * k, h)
    if t == 0:
        return hidden.new_empty(0, h)
    flat = topk_ids.reshape(-1).long()
    wflat = topk_weights.reshape(-1).float()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    start = 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        pairs = order[start : start + c]
        start += c
        x = hidden[pairs // k].float()
        gu = F.linear(x, w13[e].float(), None if w13_bias is None else w13_bias[e].float())
        act = moe_activation_ref(gu, activation, swiglu_alpha, swiglu_limit).to(hidden.dtype)
        y = F.linear(act.float(), w2[e].float(), None if w2_bias is None else w2_bias[e].float())
        out[pairs] = (y * wflat[pairs, None]).to(out.dtype)
    return out.view(t, k, h).float().sum(dim=1).to(hidden.dtype)


@triton.jit
def _moe_gate_up_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, sorted_ptr, expert_ids_ptr, npost_ptr,
    num_pairs, inter, hidden, sxm, swe, swn, sbe, som,
    alpha, limit,
    TOP_K: tl.constexpr,
    ACT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Program (row tile, column tile): out[pair, n] = act(x[pair // k] . W13[e, n] + b, x . W13[e, I + n] + b).

    The row tile's BLOCK_M sorted pairs share expert e = expert_ids[tile]; sentinel rows load
    zeros and are not stored. ACT: 0 SiLU-gated, 1 GPT-OSS clamped SwiGLU.
    """
    # grouped ordering: GROUP_M row tiles sweep all column tiles together (weights stay in L2)
    pid = tl.program_id(0)
    num_pid_n = (inter + BLOCK_N - 1) // BLOCK_N
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    size_m = tl.minimum(tl.num_programs(0) // num_pid_n - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % size_m
    pid_n = (pid % in_group) // size_m
    if pid_m * BLOCK_M >= tl.load(npost_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + offs_m)
    valid = pair < num_pairs
    row = tl.where(valid, pair // TOP_K, 0).to(tl.int64)
    e = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < inter
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
    if HAS_BIAS:
        acc_g += tl.load(b_ptr + e * sbe + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(b_ptr + e * sbe + inter + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    if ACT == 0:
        h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    else:
        g = tl.minimum(acc_g, limit)
        u = tl.minimum(tl.maximum(acc_u, -limit), limit)
        h = (u + 1.0) * (g / (1.0 + tl.exp(-alpha * g)))
    o_ptrs = out_ptr + pair[:, None].to(tl.int64) * som + offs_n[None, :]
    tl.store(o_ptrs, h.to(out_ptr.dtype.element_ty), mask=valid[:, None] & nmask[None, :])


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
    # grouped ordering: GROUP_M row tiles sweep all column tiles together (weights stay in L2)
    pid = tl.program_id(0)
    num_pid_n = (hidden + BLOCK_N - 1) // BLOCK_N
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    size_m = tl.minimum(tl.num_programs(0) // num_pid_n - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % size_m
    pid_n = (pid % in_group) // size_m
    if pid_m * BLOCK_M >= tl.load(npost_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + offs_m)
    valid = pair < num_pairs
    row = tl.where(valid, pair, 0).to(tl.int64)
    e = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < hidden
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
    if HAS_BIAS:
        acc += tl.load(b_ptr + e * sbe + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    acc = acc * tl.load(tw_ptr + row, mask=valid, other=0.0)[:, None]
    o_ptrs = out_ptr + pair[:, None].to(tl.int64) * som + offs_n[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & nmask[None, :])


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
        hidden, w13, b13, inter_out, sorted_ids, expert_ids, npost,
        n_pairs, inter, h, hidden.stride(0), w13.stride(0), w13.stride(1), b13.stride(0), inter_out.stride(0),
        float(swiglu_alpha), float(swiglu_limit),
        TOP_K=k, ACT=ACTIVATIONS.index(activation), HAS_BIAS=w13_bias is not None, EVEN_K=h % gu["BLOCK_K"] == 0,
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


@torch.library.custom_op("tokenfab::moe_sum", mutates_args=())
def moe_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over each token's k expert outputs: [T, k, H] -> [T, H]."""
    if use_triton(x):
        return _moe_sum_triton(x)
    return moe_sum_ref(x)


@moe_sum.register_fake
def _(x):
    return x.new_empty(x.shape[0], x.shape[2])


@torch.library.custom_op("tokenfab::fused_experts", mutates_args=())
def fused_experts(
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
    """The routed experts of one MoE layer; see the module docstring and ``fused_experts_ref``."""
    if use_triton(hidden):
        return _fused_experts_triton(hidden, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, activation,
                                     swiglu_alpha, swiglu_limit)
    _check_experts(hidden, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, activation)
    return fused_experts_ref(hidden, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, activation,
                             swiglu_alpha, swiglu_limit)


@fused_experts.register_fake
def _(hidden, w13, w2, topk_weights, topk_ids, w13_bias=None, w2_bias=None, activation="silu",
      swiglu_alpha=1.702, swiglu_limit=7.0):
    return hidden.new_empty(hidden.shape)
