"""Multi-LoRA's batched delta (Punica's BGMV/SGMV): every token of a flat batch gets the delta of
its own adapter, ``delta[t] = B[s] (A[s] x[t])`` with ``s = token_slots[t]`` (-1: no adapter, a zero
row), in one launch however many adapters the batch mixes.

- ``a``: [S, r, K] the shrink matrices of the S resident adapters (r = the pool's max rank; an
  adapter of smaller rank is zero-padded, which adds exact zeros);
- ``b``: [S, N, r] the expand matrices (the scale folded in);
- ``x``: [T, K]; ``token_slots``: int32/int64 [T].

The reference is segmented (SGMV): one shrink and one expand matrix product per adapter over the
rows that use it, accumulated in float32. The CPU path (``lora_delta_cpu``, dispatched as the op's
"native" implementation; there is no C kernel) takes decode-sized batches through two dense products
over every pool slot at once, the shrink's columns of other slots masked to exact zeros: two GEMMs
instead of two per adapter, S times the (small) FLOPs; larger batches take the reference.

The Triton kernel is gathered (BGMV): program (token, N-block) reads its token's adapter, shrinks x
through A in K-blocks into r float32 accumulators, expands through its N-block of B; the shrink is
recomputed per N-block, which costs r*K per block against the N-block's r*BLOCK_N, cheap while r is small.
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


def lora_delta_ref(x: torch.Tensor, token_slots: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[T, N] in x's dtype: row t = b[s] @ (a[s] @ x[t]) for s = token_slots[t] >= 0, zeros where s < 0."""
    out = torch.zeros(x.shape[0], b.shape[1], dtype=torch.float32, device=x.device)
    slots = token_slots.long()
    for s in torch.unique(slots).tolist():
        if s < 0:
            continue
        rows = (slots == s).nonzero().squeeze(1)
        xs = x.index_select(0, rows).float()
        out.index_copy_(0, rows, (xs @ a[s].float().t()) @ b[s].float().t())
    return out.to(x.dtype)


DENSE_MAX_ROWS = 64  # the CPU path's dense form up to this many tokens (decode-sized batches)


def lora_delta_cpu(x: torch.Tensor, token_slots: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``lora_delta_ref``'s result for decode-sized batches in two GEMMs: ``x`` against every slot's A at
    once, each row's columns of other slots (and all of a base row's) zeroed, then against every B."""
    t, (s, r, k), n = x.shape[0], a.shape, b.shape[1]
    if t > DENSE_MAX_ROWS or t == 0:
        return lora_delta_ref(x, token_slots, a, b)
    xa = x.float() @ a.reshape(s * r, k).float().t()  # [T, S*r]
    owner = torch.arange(s, device=x.device).repeat_interleave(r)
    xa = xa * (token_slots.long().unsqueeze(1) == owner.unsqueeze(0))
    return (xa @ b.permute(0, 2, 1).reshape(s * r, n).float()).to(x.dtype)


@triton.jit
def _lora_bgmv_kernel(x_ptr, slot_ptr, a_ptr, b_ptr, o_ptr, K, N, sx, sa_s, sa_r, sb_s, sb_n, so,
                      R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    nb = tl.program_id(1)
    s = tl.load(slot_ptr + t).to(tl.int64)
    ns = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = ns < N
    if s < 0:
        tl.store(o_ptr + t * so + ns, tl.zeros([BLOCK_N], dtype=tl.float32).to(o_ptr.dtype.element_ty), mask=nmask)
    else:
        rs = tl.arange(0, BLOCK_R)
        rmask = rs < R
        acc = tl.zeros([BLOCK_R], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            kmask = ks < K
            xv = tl.load(x_ptr + t * sx + ks, mask=kmask, other=0.0).to(tl.float32)
            av = tl.load(a_ptr + s * sa_s + rs[:, None] * sa_r + ks[None, :], mask=rmask[:, None] & kmask[None, :],
                         other=0.0).to(tl.float32)
            acc += tl.sum(av * xv[None, :], axis=1)
        bv = tl.load(b_ptr + s * sb_s + ns[:, None] * sb_n + rs[None, :], mask=nmask[:, None] & rmask[None, :],
                     other=0.0).to(tl.float32)
        out = tl.sum(bv * acc[None, :], axis=1)
        tl.store(o_ptr + t * so + ns, out.to(o_ptr.dtype.element_ty), mask=nmask)


def lora_config(k: int, n: int, r: int) -> dict:
    """Launch configuration (also used by the compile test)."""
    return dict(BLOCK_R=max(next_pow2(r), 16), BLOCK_K=min(max(next_pow2(k), 16), 128),
                BLOCK_N=min(max(next_pow2(n), 16), 64), num_warps=4)


def _lora_delta_triton(x: torch.Tensor, token_slots: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    check_device(x)
    t, k = x.shape
    s, r, ka = a.shape
    n = b.shape[1]
    if ka != k or b.shape != (s, n, r) or token_slots.shape != (t,):
        raise ValueError(f"lora_delta: x {tuple(x.shape)}, slots {tuple(token_slots.shape)}, a {tuple(a.shape)}, "
                         f"b {tuple(b.shape)} do not fit")
    out = torch.empty(t, n, dtype=x.dtype, device=x.device)
    if t == 0 or n == 0:
        return out
    x, a, b = x.contiguous(), a.contiguous(), b.contiguous()
    slots = token_slots.contiguous()
    cfg = lora_config(k, n, r)
    grid = (t, triton.cdiv(n, cfg["BLOCK_N"]))
    _lora_bgmv_kernel[grid](x, slots, a, b, out, k, n, x.stride(0), a.stride(0), a.stride(1), b.stride(0),
                            b.stride(1), out.stride(0), R=r, **cfg)
    return out


def _lora_delta_fake(x: torch.Tensor, token_slots: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], b.shape[1])


lora_delta = kernel_op("lora_delta", _lora_delta_triton, lora_delta_ref, _lora_delta_fake, native=lora_delta_cpu)
