"""Rotary position embedding applied to q and k with a precomputed cos/sin cache.

``cos_sin_cache`` is [max_positions, rotary_dim]: the first rotary_dim/2 columns hold
cos(pos * inv_freq), the last rotary_dim/2 hold sin. Scaled variants (Llama 3, YaRN,
linear) only change how the cache is built (``tokenfab/layers/rotary.py``); YaRN's
attention scaling ("mscale") is folded into the cache values.
Only the first ``rotary_dim`` channels of each head rotate (partial rotary).
"""

from __future__ import annotations

import torch

# isort: off
# _launch picks Triton's interpreter on machines without a GPU; it must run before triton loads
from tokenfab.kernels._launch import check_device, next_pow2
import triton
import triton.language as tl
# isort: on

from tokenfab.kernels._dispatch import kernel_op


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    # x: [T, H, rot]; cos/sin: [T, 1, rot/2]
    if is_neox:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


def rotary_embedding_ref(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [T] int; q: [T, Hq, D]; k: [T, Hk, D]. Returns rotated (q, k), new tensors.

    NeoX layout rotates the halves (x[:r/2], x[r/2:]); GPT-J layout rotates interleaved
    pairs (x[0::2], x[1::2]). Math runs in fp32 and is cast back to the input dtype.
    """
    rot = cos_sin_cache.shape[-1]
    cs = cos_sin_cache.index_select(0, positions.long()).float()
    cos, sin = cs[:, None, : rot // 2], cs[:, None, rot // 2 :]
    outs = []
    for x in (q, k):
        xr = _rotate(x[..., :rot].float(), cos, sin, is_neox).to(x.dtype)
        if rot < x.shape[-1]:
            xr = torch.cat((xr, x[..., rot:]), dim=-1)
        outs.append(xr)
    return outs[0], outs[1]


@triton.jit
def _rope_heads(
    x_ptr, o_ptr, tok, h0, n_heads, sxt, sxh, sot, soh, cos, sin, rot_half, head_dim,
    IS_NEOX: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
):
    """Rotate heads h0..h0+BLOCK_H of token ``tok``; copy the channels past the rotary part."""
    heads = h0 + tl.arange(0, BLOCK_H)
    j = tl.arange(0, BLOCK_HALF)
    m = (heads < n_heads)[:, None] & (j < rot_half)[None, :]
    if IS_NEOX:
        i1 = j
        i2 = j + rot_half
    else:
        i1 = 2 * j
        i2 = 2 * j + 1
    xrow = x_ptr + tok * sxt + heads.to(tl.int64)[:, None] * sxh
    orow = o_ptr + tok * sot + heads.to(tl.int64)[:, None] * soh
    x1 = tl.load(xrow + i1[None, :], mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(xrow + i2[None, :], mask=m, other=0.0).to(tl.float32)
    c = cos[None, :]
    s = sin[None, :]
    o1 = x1 * c - x2 * s
    o2 = x2 * c + x1 * s
    tl.store(orow + i1[None, :], o1.to(o_ptr.dtype.element_ty), mask=m)
    tl.store(orow + i2[None, :], o2.to(o_ptr.dtype.element_ty), mask=m)
    if BLOCK_PASS > 0:
        pcols = 2 * rot_half + tl.arange(0, BLOCK_PASS)
        pm = (heads < n_heads)[:, None] & (pcols < head_dim)[None, :]
        xp = tl.load(xrow + pcols[None, :], mask=pm, other=0.0)
        tl.store(orow + pcols[None, :], xp.to(o_ptr.dtype.element_ty), mask=pm)


@triton.jit
def _rope_kernel(
    pos_ptr, q_ptr, k_ptr, qo_ptr, ko_ptr, cs_ptr,
    n_q_heads, n_k_heads, rot_half, head_dim,
    sqt, sqh, skt, skh, sqot, sqoh, skot, skoh, scs,
    IS_NEOX: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
):
    """Program (token, head block): head blocks of q come first, then those of k."""
    tok = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    j = tl.arange(0, BLOCK_HALF)
    jm = j < rot_half
    cos = tl.load(cs_ptr + pos * scs + j, mask=jm, other=0.0).to(tl.float32)
    sin = tl.load(cs_ptr + pos * scs + rot_half + j, mask=jm, other=0.0).to(tl.float32)
    n_qb = tl.cdiv(n_q_heads, BLOCK_H)
    if hb < n_qb:
        _rope_heads(q_ptr, qo_ptr, tok, hb * BLOCK_H, n_q_heads, sqt, sqh, sqot, sqoh, cos, sin,
                    rot_half, head_dim, IS_NEOX, BLOCK_H, BLOCK_HALF, BLOCK_PASS)
    else:
        _rope_heads(k_ptr, ko_ptr, tok, (hb - n_qb) * BLOCK_H, n_k_heads, skt, skh, skot, skoh, cos, sin,
                    rot_half, head_dim, IS_NEOX, BLOCK_H, BLOCK_HALF, BLOCK_PASS)


def rope_config(n_q_heads: int, n_k_heads: int, head_dim: int, rotary_dim: int) -> dict:
    """Launch configuration (also used by the compile test)."""
    block_half = next_pow2(rotary_dim // 2)
    block_pass = next_pow2(head_dim - rotary_dim) if head_dim > rotary_dim else 0
    block_h = min(next_pow2(max(n_q_heads, n_k_heads)), max(1, 1024 // block_half))
    return dict(BLOCK_H=block_h, BLOCK_HALF=block_half, BLOCK_PASS=block_pass, num_warps=4)


def _heads_view(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _rotary_embedding_triton(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    check_device(q)
    t, hq, d = q.shape
    hk = k.shape[1]
    qo = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    ko = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if t == 0:
        return qo, ko
    rot = cos_sin_cache.shape[-1]
    if rot % 2 or rot > d or k.shape[-1] != d:
        raise ValueError(f"rotary_embedding: rotary dim {rot} does not fit head dims {d}, {k.shape[-1]}")
    q, k = _heads_view(q), _heads_view(k)
    cs = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    cfg = rope_config(hq, hk, d, rot)
    grid = (t, triton.cdiv(hq, cfg["BLOCK_H"]) + triton.cdiv(hk, cfg["BLOCK_H"]))
    _rope_kernel[grid](
        positions, q, k, qo, ko, cs, hq, hk, rot // 2, d,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        qo.stride(0), qo.stride(1), ko.stride(0), ko.stride(1), cs.stride(0),
        IS_NEOX=is_neox, **cfg,
    )
    return qo, ko


rotary_embedding = kernel_op(
    "rotary_embedding", _rotary_embedding_triton, rotary_embedding_ref,
    lambda positions, q, k, *_: (torch.empty_like(q), torch.empty_like(k)),
)
