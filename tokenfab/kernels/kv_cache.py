"""Writing a flat batch's new keys and values into the paged KV cache.

Cache layout: k_cache, v_cache are [num_blocks, block_size, num_kv_heads, head_dim].
Token t goes to slot ``slot_mapping[t]`` = block_id * block_size + offset; a slot of -1
is skipped (padding tokens of a CUDA-graph batch).

FP8 KV cache (``torch.float8_e4m3fn`` caches): one float32 scale per tensor (``k_scale``, ``v_scale``:
shape [1], on the cache's device, read by the kernels on the device so that a first-batch calibration
can change them without recompiling or recapturing CUDA graphs). A stored value is
``clamp(x / scale, -448, 448)`` cast to e4m3 (round to nearest even; out-of-range values saturate,
never inf/nan); a read is ``fp8.to(float32) * scale`` (``quantize_fp8_ref`` / ``dequantize_fp8_ref``).
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

#: The cache dtype of the FP8 KV cache, and its largest finite value (stored values clamp to +-FP8_MAX).
FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether a cache of this dtype holds FP8 (e4m3) values that need a scale."""
    return dtype == FP8_KV_DTYPE


def quantize_fp8_ref(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The stored value: ``clamp(x / scale, -448, 448)`` in fp32, cast to e4m3 (round to nearest even)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE)


def dequantize_fp8_ref(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The value a kernel reads: ``fp8.to(float32) * scale``."""
    return x.float() * scale


def check_fp8_scales(op: str, cache: torch.Tensor, **scales: torch.Tensor | None) -> None:
    """An FP8 cache needs its scales: float32 tensors of one element on the cache's device."""
    for name, s in scales.items():
        if s is None:
            raise ValueError(f"{op}: an fp8 cache needs {name} (a float32 tensor of shape [1]), got None")
        if s.dtype != torch.float32 or s.numel() != 1 or s.device != cache.device:
            raise ValueError(f"{op}: {name} must be a float32 tensor of one element on {cache.device}, "
                             f"got {s.dtype} {tuple(s.shape)} on {s.device}")


def check_kv_dtypes(op: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> bool:
    """Whether an attention kernel reads an fp8 cache (then both caches are fp8, with their scales,
    and the queries are 16- or 32-bit floats, the dtype the kernel widens the cache values to)."""
    fp8 = is_fp8(k_cache.dtype)
    if fp8 != is_fp8(v_cache.dtype):
        raise ValueError(f"{op}: k_cache ({k_cache.dtype}) and v_cache ({v_cache.dtype}) must both be fp8 or neither")
    if fp8:
        check_fp8_scales(op, k_cache, k_scale=k_scale, v_scale=v_scale)
        _check_query_dtype(op, q)
    return fp8


def _check_query_dtype(op: str, q: torch.Tensor) -> None:
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{op}: queries over an fp8 cache must be float32/bfloat16/float16, got {q.dtype}")


def latent_rows(cache: torch.Tensor, rows: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """``rows`` (a latent-cache gather, e.g. ``gather_kv(cache.view(torch.uint8), ...)``, as bytes for an fp8
    cache) -> float32 values: an fp8 cache's bytes dequantized with ``scale``, others just widened."""
    if is_fp8(cache.dtype):
        return dequantize_fp8_ref(rows.view(cache.dtype), scale)
    return rows.float()


def raw_cache(cache: torch.Tensor) -> torch.Tensor:
    """The cache to gather from: an fp8 cache as bytes (CPU index_select/index_copy do not take fp8)."""
    return cache.view(torch.uint8) if is_fp8(cache.dtype) else cache


def check_latent_fp8(op: str, q: torch.Tensor, cache: torch.Tensor, kv_scale: torch.Tensor | None) -> bool:
    """Whether a latent-cache kernel reads an fp8 cache (then with its scale, q a 16/32-bit float)."""
    if not is_fp8(cache.dtype):
        return False
    check_fp8_scales(op, cache, kv_scale=kv_scale)
    _check_query_dtype(op, q)
    return True


def _write_rows(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """``cache.view(slots, ...)[slots] = rows`` (fp8 caches through their bytes: no fp8 index_copy on CPU)."""
    nb, bs = cache.shape[:2]
    flat = cache.view(nb * bs, *cache.shape[2:])
    if is_fp8(cache.dtype):
        flat.view(torch.uint8).index_copy_(0, slots, rows.view(torch.uint8))
    else:
        flat.index_copy_(0, slots, rows.to(cache.dtype))


def store_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """k, v: [T, Hkv, D]; slot_mapping: [T] int64. Writes in place.

    An fp8 cache stores ``quantize_fp8_ref(x, scale)`` (scales required); other caches ignore the scales.
    """
    slots = slot_mapping.long()
    if bool((slots < 0).any()):  # padding slots: drop them (rare off the CUDA-graph path)
        valid = slots >= 0
        slots, k, v = slots[valid], k[valid], v[valid]
    if is_fp8(k_cache.dtype) or is_fp8(v_cache.dtype):
        check_fp8_scales("store_kv", k_cache, k_scale=k_scale, v_scale=v_scale)
    if is_fp8(k_cache.dtype):
        k = quantize_fp8_ref(k, k_scale)
    if is_fp8(v_cache.dtype):
        v = quantize_fp8_ref(v, v_scale)
    _write_rows(k_cache, slots, k)
    _write_rows(v_cache, slots, v)


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, ks_ptr, vs_ptr,
    n_heads, dk, dv, block_size,
    skt, skh, svt, svh,
    skc_b, skc_t, skc_h, svc_b, svc_t, svc_h,
    BLOCK_H: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    QUANT_K: tl.constexpr = False,
    QUANT_V: tl.constexpr = False,
):
    """Program (token, head block): copy its K and V rows into slot ``slot_mapping[token]``.

    QUANT_K / QUANT_V (fp8 caches): store clamp(x / scale, -448, 448), rounded to nearest even by the
    cast; the division is IEEE-exact (div_rn) so the stored bytes equal the reference's.
    """
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
    if QUANT_K:
        kx = tl.clamp(tl.math.div_rn(kx.to(tl.float32), tl.load(ks_ptr)), -448.0, 448.0)
    tl.store(kc_ptr + blk * skc_b + off * skc_t + h64 * skc_h + dk_i, kx.to(kc_ptr.dtype.element_ty), mask=mk)
    dv_i = tl.arange(0, BLOCK_DV)[None, :]
    mv = ok[:, None] & (dv_i < dv)
    vx = tl.load(v_ptr + t * svt + h64 * svh + dv_i, mask=mv)
    if QUANT_V:
        vx = tl.clamp(tl.math.div_rn(vx.to(tl.float32), tl.load(vs_ptr)), -448.0, 448.0)
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
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
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
    quant_k, quant_v = is_fp8(k_cache.dtype), is_fp8(v_cache.dtype)
    if quant_k or quant_v:
        check_fp8_scales("store_kv", k_cache, k_scale=k_scale, v_scale=v_scale)
    cfg = store_kv_config(h, dk, dv)
    grid = (t, triton.cdiv(h, cfg["BLOCK_H"]))
    _store_kv_kernel[grid](
        k, v, k_cache, v_cache, slot_mapping, k_scale if quant_k else k, v_scale if quant_v else v,
        h, dk, dv, k_cache.shape[1],
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        QUANT_K=quant_k, QUANT_V=quant_v, **cfg,
    )


store_kv = kernel_op(
    "store_kv", _store_kv_triton, store_kv_ref, lambda *_: None, mutates_args=("k_cache", "v_cache"),
    doc="Write the step's keys and values into the paged cache (fp8 caches: quantized with the scales).",
)
