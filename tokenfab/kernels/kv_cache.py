"""Writing a flat batch's new keys and values into the paged KV cache.

Cache layout: k_cache, v_cache are [num_blocks, block_size, num_kv_heads, head_dim].
Token t goes to slot ``slot_mapping[t]`` = block_id * block_size + offset; a slot of -1
is skipped (padding tokens of a CUDA-graph batch).
"""

from __future__ import annotations

import torch

# isort: off
# _launch picks Triton's interpreter on machines without a GPU; it must run before triton loads
from tokenfab.kernels._launch import check_device, next_pow2
import triton
import triton.language as tl
# isort: on

from tokenfab.kernels._dispatch import use_triton


def store_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k, v: [T, Hkv, D]; slot_mapping: [T] int64. Writes in place."""
    nb, bs, h, d = k_cache.shape
    slots = slot_mapping.long()
    if bool((slots < 0).any()):  # padding slots: drop them (rare off the CUDA-graph path)
        valid = slots >= 0
        slots, k, v = slots[valid], k[valid], v[valid]
    k_cache.view(nb * bs, h, d).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(nb * bs, h, d).index_copy_(0, slots, v.to(v_cache.dtype))


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
    n_heads, dk, dv, block_size,
    skt, skh, svt, svh,
    skc_b, skc_t, skc_h, svc_b, svc_t, svc_h,
    BLOCK_H: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """Program (token, head block): copy its K and V rows into slot ``slot_mapping[token]``."""
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    # slot -1: no head is valid (a where on the bound; `vector & scalar_bool` trips the interpreter)
    ok = heads < tl.where(slot >= 0, n_heads, 0)
    blk = slot // block_size
    off = slot % block_size
    h64 = heads.to(tl.int64)[:, None]
    dk_i = tl.arange(0, BLOCK_DK)[None, :]
    mk = ok[:, None] & (dk_i < dk)
    kx = tl.load(k_ptr + t * skt + h64 * skh + dk_i, mask=mk)
    tl.store(kc_ptr + blk * skc_b + off * skc_t + h64 * skc_h + dk_i, kx.to(kc_ptr.dtype.element_ty), mask=mk)
    dv_i = tl.arange(0, BLOCK_DV)[None, :]
    mv = ok[:, None] & (dv_i < dv)
    vx = tl.load(v_ptr + t * svt + h64 * svh + dv_i, mask=mv)
    tl.store(vc_ptr + blk * svc_b + off * svc_t + h64 * svc_h + dv_i, vx.to(vc_ptr.dtype.element_ty), mask=mv)


def store_kv_config(n_heads: int, dk: int, dv: int) -> dict:
    """Launch configuration (also used by the compile test)."""
    bdk, bdv = next_pow2(dk), next_pow2(dv)
    block_h = min(next_pow2(n_heads), max(1, 2048 // max(bdk, bdv)))
    return dict(BLOCK_H=block_h, BLOCK_DK=bdk, BLOCK_DV=bdv, num_warps=4)


def _store_kv_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    check_device(k)
    t, h, dk = k.shape
    dv = v.shape[-1]
    if t == 0:
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("store_kv: the caches' last dim must be contiguous")
    cfg = store_kv_config(h, dk, dv)
    grid = (t, triton.cdiv(h, cfg["BLOCK_H"]))
    _store_kv_kernel[grid](
        k, v, k_cache, v_cache, slot_mapping, h, dk, dv, k_cache.shape[1],
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        **cfg,
    )


@torch.library.custom_op("tokenfab::store_kv", mutates_args=("k_cache", "v_cache"))
def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    if use_triton(k):
        _store_kv_triton(k, v, k_cache, v_cache, slot_mapping)
    else:
        store_kv_ref(k, v, k_cache, v_cache, slot_mapping)


@store_kv.register_fake
def _(k, v, k_cache, v_cache, slot_mapping):
    return None
