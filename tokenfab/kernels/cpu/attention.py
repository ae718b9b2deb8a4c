"""ctypes wrapper of ``paged_attention.c``: paged attention (decode and prefill rows) reading the
cache in place: float32 / bfloat16 caches of the queries' dtype, or float8 e4m3 caches with their
float32 [1] ``k_scale`` / ``v_scale`` (a read is ``e4m3 * scale``; tokenfab/quant/kv_fp8.py)."""

from __future__ import annotations

import ctypes

import torch

from tokenfab.kernels.cpu import native_library
from tokenfab.kernels.cpu.checks import check_paged_attention, check_query_rows, check_status, indices_checked

_FUNCTIONS = {torch.float32: "paged_attention_f32", torch.bfloat16: "paged_attention_bf16"}
_FP8 = torch.float8_e4m3fn
_FP8_FUNCTIONS = {torch.float32: "paged_attention_f32_fp8kv", torch.bfloat16: "paged_attention_bf16_fp8kv"}
_declared: set[str] = set()


def _fp8_function(lib: ctypes.CDLL, dtype: torch.dtype):
    """The fp8-cache entry point, its ctypes signature declared on first use (the plain entry points'
    arguments, then the k and v scale pointers)."""
    name = _FP8_FUNCTIONS[dtype]
    fn = getattr(lib, name)
    if name not in _declared:
        p, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
        fn.argtypes = [p] * 7 + [i64] * 15 + [f32, i64, f32, p, p, p]
        fn.restype = ctypes.c_int
        _declared.add(name)
    return fn


def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the native kernel can run these tensors (CPU, float32/bfloat16 queries over a cache of
    their dtype or of float8 e4m3, unit last stride)."""
    return (
        q.device.type == "cpu"
        and q.dtype in _FUNCTIONS
        and k_cache.dtype in (q.dtype, _FP8)
        and v_cache.dtype == k_cache.dtype
        and k_cache.stride(-1) == 1
        and v_cache.stride(-1) == 1
        and native_library() is not None
    )


def _scale_arg(name: str, scale: torch.Tensor | None) -> torch.Tensor:
    """An fp8 cache's scale as a contiguous float32 [1] CPU tensor (the kernel reads it in place)."""
    if scale is None:
        raise ValueError(f"an fp8 KV cache needs its {name} (float32 [1])")
    if scale.numel() != 1 or scale.device.type != "cpu":
        raise ValueError(f"{name} must be one float32 value on the CPU, got {tuple(scale.shape)} on {scale.device}")
    return scale if scale.dtype == torch.float32 and scale.is_contiguous() else scale.float().contiguous()


def paged_attention_native(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, Hq, D] -> [T, Hq, Dv]; the contract of ``paged_attention_ref``: sequence b's
    queries are rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` at its last positions. With
    ``cu_seqlens_q`` None every sequence has one query (decode, T = B).

    The caller checks ``supports`` first. Index tensors are converted to contiguous int32
    (cheap: [B], [B + 1] and [B, max_blocks]) and checked (``checks.check_paged_attention``): a
    block id outside the cache, a negative context or one longer than its block table covers, or
    mismatched shapes raise ValueError before the kernel reads anything.
    """
    lib = native_library()
    if q.dim() != 3 or v_cache.dim() != 4 or context_lens.dim() != 1:
        raise ValueError(f"expected q [T, Hq, D], v_cache [blocks, block_size, Hkv, Dv] and context_lens [B], got "
                         f"{tuple(q.shape)}, {tuple(v_cache.shape)} and {tuple(context_lens.shape)}")
    t, hq, d = q.shape
    _, bs, hkv, dv = v_cache.shape
    b = context_lens.shape[0]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({hkv})")
    cu = None
    if cu_seqlens_q is not None:
        cu = cu_seqlens_q.to(torch.int32).contiguous()
        # the same tensors in every layer of a step: checked once (checks.indices_checked)
        if cu.dim() != 1 or cu.shape[0] != b + 1 or not indices_checked(block_tables, context_lens, cu,
                                                                       k_cache.shape[0], bs, t):
            check_query_rows(cu, context_lens, t)
    elif t != b:
        raise ValueError(f"decode attention takes one query per sequence: {t} rows for {b} sequences")
    out = q.new_empty(t, hq, dv)
    if t == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    ctx = context_lens.to(torch.int32).contiguous()
    check_paged_attention(q, k_cache, v_cache, tables, ctx, cu, sinks)
    sinks_f = sinks.float().contiguous() if sinks is not None else None
    args = (
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
        cu.data_ptr() if cu is not None else None, ctx.data_ptr(), out.data_ptr(),
        b, hq, hkv, d, dv, bs, q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), tables.stride(0),
        float(scale), int(sliding_window), float(softcap),
        sinks_f.data_ptr() if sinks_f is not None else None,
    )
    if k_cache.dtype == _FP8:
        ks, vs = _scale_arg("k_scale", k_scale), _scale_arg("v_scale", v_scale)
        rc = _fp8_function(lib, q.dtype)(*args, ks.data_ptr(), vs.data_ptr())
        check_status(rc, _FP8_FUNCTIONS[q.dtype])
    else:
        rc = getattr(lib, _FUNCTIONS[q.dtype])(*args)
        check_status(rc, _FUNCTIONS[q.dtype])
    return out


def paged_decode_attention_native(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, Hq, D] -> [B, Hq, Dv]; same contract as ``paged_decode_attention_ref``."""
    return paged_attention_native(q, k_cache, v_cache, block_tables, None, context_lens, scale, sliding_window,
                                  softcap, sinks, k_scale, v_scale)
