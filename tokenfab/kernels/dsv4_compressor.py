"""DeepSeek-V4's KV compressor: one compressed entry per closed window, pooled from gathered token rows.

``dsv4_compress(new, new_idx, ring, ring_idx, window, col, head_dim, ratio, overlap, norm_weight, inv_freq,
rope_scale, eps)`` -> entries [W, head_dim]. Window w pools S slots (S = ratio, or 2 ratio with ``overlap``, CSA);
slot j of window w is row ``new_idx[w, j]`` of ``new`` or else row ``ring_idx[w, j]`` of ``ring`` (-1 in both: no
row, the slot's gate is -inf). A row holds, from column ``col``, the token's C [width] then its biased gate Z
[width] (width = head_dim, or 2 head_dim with ``overlap``: slots j < ratio read the first half of C and Z,
the previous window's Ca, the others the second half, Cb). Per channel c:

    pooled_c = sum_j softmax_j(Z[j, c]) C[j, c]
    entry    = RoPE(RMSNorm(pooled) * norm_weight, position window * ratio)

RoPE rotates the trailing ``2 len(inv_freq)`` channels in consecutive pairs (``interleaved_rope``), cos and
sin scaled by ``rope_scale``. The reference is the layer's PyTorch math op for op; the Triton kernel runs a
program per window, streaming its slots in tiles with an online softmax per channel (even and odd channels as
two vectors, so the RoPE pairs meet without a shuffle) and normalising and rotating in registers (cos and sin
of the W entries' angles come from the launcher, [W, len(inv_freq)]).
"""

from __future__ import annotations

import torch

# isort: off
# _launch picks Triton's interpreter on machines without a GPU; it must run before triton loads
from tokenfab.kernels._launch import check_device, next_pow2
import triton
import triton.language as tl
# isort: on

from tokenfab.kernels._dispatch import eager_op, kernel_op
from tokenfab.kernels.norm import rms_norm_ref


def interleaved_rope(
    x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scale: float, inverse: bool = False
) -> torch.Tensor:
    """x [N, ..., d] rotated at positions [N] on its trailing ``2 len(inv_freq)`` channels, consecutive pairs
    (``inverse``: by -angle); cos/sin from the positions, times ``scale``."""
    freqs = positions.float().unsqueeze(-1) * inv_freq
    cos, sin = freqs.cos() * scale, freqs.sin() * scale
    shape = (positions.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    cos, sin = cos.view(shape), sin.view(shape)
    if inverse:
        sin = -sin
    rd = 2 * inv_freq.shape[0]
    rope = x[..., -rd:].float()
    x0, x1 = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack((x0 * cos - x1 * sin, x1 * cos + x0 * sin), dim=-1).flatten(-2)
    return torch.cat((x[..., :-rd], rotated.to(x.dtype)), dim=-1)


def dsv4_compress_ref(
    new: torch.Tensor,
    new_idx: torch.Tensor,
    ring: torch.Tensor,
    ring_idx: torch.Tensor,
    window: torch.Tensor,
    col: int,
    head_dim: int,
    ratio: int,
    overlap: bool,
    norm_weight: torch.Tensor,
    inv_freq: torch.Tensor,
    rope_scale: float,
    eps: float,
) -> torch.Tensor:
    """new [T, >= col + 2 width], ring [R, same]; new_idx, ring_idx [W, S] int64 (-1: none); window [W] ->
    [W, head_dim] in ``new``'s dtype (ring rows are read in that dtype)."""
    d, width = head_dim, head_dim * (2 if overlap else 1)
    from_new = (new_idx >= 0).unsqueeze(-1)
    rows = torch.where(
        from_new,
        new[new_idx.clamp(min=0), col : col + 2 * width],
        ring[ring_idx.clamp(min=0), col : col + 2 * width].to(new.dtype),
    )
    kv, gate = rows[..., :d], rows[..., width : width + d]
    if overlap:  # slots past the first ratio read the second half: the current window's Cb
        second = (torch.arange(new_idx.shape[1], device=new.device) >= ratio).view(1, -1, 1)
        kv = torch.where(second, rows[..., d:width], kv)
        gate = torch.where(second, rows[..., width + d :], gate)
    missing = ((new_idx < 0) & (ring_idx < 0)).unsqueeze(-1)
    kv, gate = kv.masked_fill(missing, 0.0), gate.masked_fill(missing, float("-inf"))
    pooled = (kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1)
    return interleaved_rope(rms_norm_ref(pooled, norm_weight, eps), window * ratio, inv_freq, rope_scale)


@triton.jit
def _pool_half(
    new_ptr, ring_ptr, from_new, from_ring, ni, ri, kv_col, stride_new, stride_ring, width, ch, c_ok, m_i, l_i, acc
):
    """Fold one tile of slots into one channel parity's running (max, sum, weighted sum)."""
    ok = from_new | from_ring
    pn = new_ptr + ni[:, None] * stride_new + kv_col[:, None] + ch[None, :]
    pr = ring_ptr + ri[:, None] * stride_ring + kv_col[:, None] + ch[None, :]
    mn, mr = from_new[:, None] & c_ok[None, :], from_ring[:, None] & c_ok[None, :]
    kv = tl.load(pn, mask=mn, other=0.0).to(tl.float32) + tl.load(pr, mask=mr, other=0.0).to(tl.float32)
    z = tl.load(pn + width, mask=mn, other=0.0).to(tl.float32) + tl.load(pr + width, mask=mr, other=0.0).to(tl.float32)
    z = tl.where(ok[:, None], z, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(z, axis=0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(z - m_safe[None, :])
    return m_new, l_i * alpha + tl.sum(p, axis=0), acc * alpha + tl.sum(p * kv, axis=0)


@triton.jit
def _dsv4_compress_kernel(
    new_ptr,
    new_idx_ptr,
    ring_ptr,
    ring_idx_ptr,
    w_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    S,
    D,
    col,
    ratio,
    n_freq,
    stride_new,
    stride_ring,
    eps,
    OVERLAP: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """A program per window: its S slots in tiles of BLOCK_S, channels as even / odd vectors of BLOCK_H; the RoPE
    cos / sin [W, n_freq] come computed (libdevice's sin / cos keep a local-memory array for huge angles)."""
    w = tl.program_id(0).to(tl.int64)
    half = tl.arange(0, BLOCK_H)
    ev, od = 2 * half, 2 * half + 1
    e_ok, o_ok = ev < D, od < D
    width = D * 2 if OVERLAP else D
    m_e = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    m_o = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    l_e = tl.zeros((BLOCK_H,), dtype=tl.float32)
    l_o = tl.zeros((BLOCK_H,), dtype=tl.float32)
    a_e = tl.zeros((BLOCK_H,), dtype=tl.float32)
    a_o = tl.zeros((BLOCK_H,), dtype=tl.float32)
    offs_s = tl.arange(0, BLOCK_S)
    for s0 in range(0, S, BLOCK_S):
        ss = s0 + offs_s
        s_ok = ss < S
        ni = tl.load(new_idx_ptr + w * S + ss, mask=s_ok, other=-1)
        ri = tl.load(ring_idx_ptr + w * S + ss, mask=s_ok, other=-1)
        from_new = ni >= 0
        from_ring = (ri >= 0) & (ni < 0)
        ni, ri = tl.where(from_new, ni, 0), tl.where(from_ring, ri, 0)
        if OVERLAP:
            kv_col = col + tl.where(ss >= ratio, D, 0)
        else:
            kv_col = col + tl.zeros_like(ss)
        m_e, l_e, a_e = _pool_half(
            new_ptr,
            ring_ptr,
            from_new,
            from_ring,
            ni,
            ri,
            kv_col,
            stride_new,
            stride_ring,
            width,
            ev,
            e_ok,
            m_e,
            l_e,
            a_e,
        )
        m_o, l_o, a_o = _pool_half(
            new_ptr,
            ring_ptr,
            from_new,
            from_ring,
            ni,
            ri,
            kv_col,
            stride_new,
            stride_ring,
            width,
            od,
            o_ok,
            m_o,
            l_o,
            a_o,
        )
    x_e = tl.where(e_ok & (l_e > 0), a_e / tl.where(l_e > 0, l_e, 1.0), 0.0)
    x_o = tl.where(o_ok & (l_o > 0), a_o / tl.where(l_o > 0, l_o, 1.0), 0.0)
    # RMSNorm as rms_norm_ref: normalised in float32, rounded to the output dtype, times the weight there (a
    # product of two 16-bit values is exact in float32, so rounding it once is the 16-bit multiply)
    out_ty = out_ptr.dtype.element_ty
    x_e, x_o = x_e.to(out_ty).to(tl.float32), x_o.to(out_ty).to(tl.float32)
    rstd = 1.0 / tl.sqrt((tl.sum(x_e * x_e, axis=0) + tl.sum(x_o * x_o, axis=0)) / D + eps)
    w_e = tl.load(w_ptr + ev, mask=e_ok, other=0.0).to(out_ty).to(tl.float32)
    w_o = tl.load(w_ptr + od, mask=o_ok, other=0.0).to(out_ty).to(tl.float32)
    y_e = ((x_e * rstd).to(out_ty).to(tl.float32) * w_e).to(out_ty).to(tl.float32)
    y_o = ((x_o * rstd).to(out_ty).to(tl.float32) * w_o).to(out_ty).to(tl.float32)
    # RoPE on the trailing 2 n_freq channels: pair i (channels 2i, 2i + 1) at frequency i - (D / 2 - n_freq)
    f = half - (D // 2 - n_freq)
    f_ok = (f >= 0) & e_ok
    cos = tl.load(cos_ptr + w * n_freq + tl.where(f_ok, f, 0), mask=f_ok, other=1.0)
    sin = tl.load(sin_ptr + w * n_freq + tl.where(f_ok, f, 0), mask=f_ok, other=0.0)
    r_e = tl.where(f_ok, y_e * cos - y_o * sin, y_e)
    r_o = tl.where(f_ok, y_o * cos + y_e * sin, y_o)
    tl.store(out_ptr + w * D + ev, r_e.to(out_ty), mask=e_ok)
    tl.store(out_ptr + w * D + od, r_o.to(out_ty), mask=o_ok)


def dsv4_compress_config(head_dim: int, slots: int) -> dict:
    """Launch configuration (also used by the compile check): slots in tiles of at most 8 at head_dim 512 (4
    tiles of [8, 256] live a step: kv and gate, even and odd channels), more at narrower heads."""
    block_h = max(16, next_pow2((head_dim + 1) // 2))
    block_s = max(2, min(next_pow2(slots), 2048 // block_h))
    return dict(BLOCK_S=block_s, BLOCK_H=block_h, num_warps=4 if block_h <= 128 else 8)


def _dsv4_compress_triton(
    new: torch.Tensor,
    new_idx: torch.Tensor,
    ring: torch.Tensor,
    ring_idx: torch.Tensor,
    window: torch.Tensor,
    col: int,
    head_dim: int,
    ratio: int,
    overlap: bool,
    norm_weight: torch.Tensor,
    inv_freq: torch.Tensor,
    rope_scale: float,
    eps: float,
) -> torch.Tensor:
    check_device(new)
    w, s = new_idx.shape
    out = torch.empty(w, head_dim, dtype=new.dtype, device=new.device)
    if w == 0:
        return out
    if new.stride(-1) != 1 or ring.stride(-1) != 1:
        raise ValueError("dsv4_compress: token rows must be contiguous along the last dimension")
    if ring_idx.shape != new_idx.shape or window.shape != (w,):
        raise ValueError(
            f"dsv4_compress: new_idx {tuple(new_idx.shape)}, ring_idx {tuple(ring_idx.shape)} and "
            f"window {tuple(window.shape)} must be [W, S], [W, S] and [W]"
        )
    if head_dim % 2 or 2 * inv_freq.numel() > head_dim:
        raise ValueError(
            f"dsv4_compress: head_dim {head_dim} must be even and hold the {2 * inv_freq.numel()} rotary channels"
        )
    cfg = dsv4_compress_config(head_dim, s)
    angle = (window * ratio).float().unsqueeze(-1) * inv_freq.float()  # as interleaved_rope computes them
    cos, sin = angle.cos() * rope_scale, angle.sin() * rope_scale
    _dsv4_compress_kernel[(w,)](
        new,
        new_idx.contiguous(),
        ring,
        ring_idx.contiguous(),
        norm_weight.contiguous(),
        cos,
        sin,
        out,
        s,
        head_dim,
        col,
        ratio,
        inv_freq.numel(),
        new.stride(0),
        ring.stride(0),
        float(eps),
        OVERLAP=overlap,
        **cfg,
    )
    return out


def _compress_fake(new, new_idx, ring, ring_idx, window, col, head_dim, *_):
    return new.new_empty(new_idx.shape[0], head_dim)


dsv4_compress_op = kernel_op("dsv4_compress", _dsv4_compress_triton, dsv4_compress_ref, _compress_fake)
dsv4_compress = eager_op(dsv4_compress_op, dsv4_compress_ref, triton_fn=_dsv4_compress_triton)
