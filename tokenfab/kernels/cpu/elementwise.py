"""ctypes wrappers of ``elementwise.c``: RMSNorm (+ residual), SiLU-and-mul, RoPE, row argmax,
KV-cache store.

Each wrapper has its reference's signature and returns None when it cannot take the tensors
(not CPU, a dtype other than float32/bfloat16, rows without one common stride, no compiler);
the caller then runs the reference.
"""

from __future__ import annotations

import torch

from tokenfab.kernels.cpu import native_library

_DTYPES = (torch.float32, torch.bfloat16)


def _rows(t: torch.Tensor, width: int) -> tuple[int, int] | None:
    """(row count, row stride) of ``t`` seen as rows of ``width`` contiguous elements, or None."""
    if t.is_contiguous() and t.shape[-1] == width:  # the common case, without building a view
        return (t.numel() // width if width else 0), width
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        return None
    if t.dim() == 1:
        return 1, width
    try:
        v = t.view(-1, width)
    except RuntimeError:
        return None
    return v.shape[0], (v.stride(0) if v.shape[0] > 1 else width)


def _row_layout(t: torch.Tensor, width: int) -> tuple[int, int, int, int] | None:
    """(rows, outer stride, rows per outer step, inner stride): rows of ``width`` contiguous
    elements, either with one common stride or as [T, n, width] with two strides."""
    rows = _rows(t, width)
    if rows is not None:
        return rows[0], rows[1], 1, 0
    if t.dim() == 3 and t.stride(-1) == 1:
        return t.shape[0] * t.shape[1], t.stride(0), t.shape[1], t.stride(1)
    return None


def _usable(*ts: torch.Tensor) -> bool:
    dtype = ts[0].dtype
    if ts[0].device.type != "cpu" or dtype not in _DTYPES:
        return False
    for t in ts:
        if t.dtype != dtype:
            return False
    return True


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    h = x.shape[-1]
    lib = native_library()
    layout = _row_layout(x, h)
    if lib is None or layout is None or not _usable(x, weight) or not weight.is_contiguous():
        return None
    rows, stride, per, inner = layout
    out = torch.empty(x.shape, dtype=x.dtype)
    lib.rms_norm(x.data_ptr(), stride, per, inner, None, 0, weight.data_ptr(), out.data_ptr(), h, rows, h,
                 float(eps), int(x.dtype == torch.bfloat16))
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    h = x.shape[-1]
    lib = native_library()
    rows, res_rows = _rows(x, h), _rows(residual, h)
    if (lib is None or rows is None or res_rows is None or rows[0] != res_rows[0]
            or not _usable(x, residual, weight) or not weight.is_contiguous()):
        return None
    out = torch.empty(x.shape, dtype=x.dtype)
    lib.rms_norm(x.data_ptr(), rows[1], 1, 0, residual.data_ptr(), res_rows[1], weight.data_ptr(), out.data_ptr(),
                 h, rows[0], h, float(eps), int(x.dtype == torch.bfloat16))
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor | None:
    lib = native_library()
    rows = _rows(x, x.shape[-1])
    if lib is None or rows is None or not _usable(x) or x.shape[-1] % 2:
        return None
    i = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], i, dtype=x.dtype)
    lib.silu_and_mul(x.data_ptr(), rows[1], out.data_ptr(), i, rows[0], i, int(x.dtype == torch.bfloat16))
    return out


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
                     is_neox: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    lib = native_library()
    if (lib is None or not _usable(q, k) or q.dim() != 3 or k.dim() != 3 or k.shape[0] != q.shape[0]
            or k.shape[2] != q.shape[2] or cos_sin_cache.dtype != torch.float32
            or not cos_sin_cache.is_contiguous() or q.stride(-1) != 1 or k.stride(-1) != 1
            or positions.device.type != "cpu"):
        return None
    t, hq, d = q.shape
    hk = k.shape[1]
    pos = positions if positions.dtype == torch.int64 and positions.is_contiguous() else (
        positions.to(torch.int64).contiguous())
    q_out = torch.empty(t, hq, d, dtype=q.dtype)
    k_out = torch.empty(t, hk, d, dtype=k.dtype)
    lib.rotary_qk(pos.data_ptr(), q.data_ptr(), q.stride(0), q.stride(1), hq, q_out.data_ptr(),
                  k.data_ptr(), k.stride(0), k.stride(1), hk, k_out.data_ptr(), cos_sin_cache.data_ptr(),
                  t, d, cos_sin_cache.shape[-1], int(is_neox), int(q.dtype == torch.bfloat16))
    return q_out, k_out


def argmax(logits: torch.Tensor) -> torch.Tensor | None:
    """Row argmax of float32 [R, V] logits (first maximum; NaN counts as the maximum)."""
    lib = native_library()
    if lib is None or logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2:
        return None
    x = logits.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64)
    if x.shape[0] and x.shape[1]:
        lib.argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr())
    return out


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> bool | None:
    """Write k [T, H, D], v [T, H, Dv] into the paged caches at ``slot_mapping`` (-1 skipped).
    Returns True when done, None when it cannot take the tensors (the reference then runs)."""
    lib = native_library()
    if (lib is None or not _usable(k, v, k_cache, v_cache) or k.dim() != 3 or v.dim() != 3
            or k.stride(-1) != 1 or v.stride(-1) != 1 or not k_cache.is_contiguous() or not v_cache.is_contiguous()
            or slot_mapping.device.type != "cpu"):
        return None
    t, h, d = k.shape
    slots = slot_mapping if slot_mapping.dtype == torch.int64 else slot_mapping.to(torch.int64)
    slots = slots.contiguous()
    lib.store_kv(k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0), v.stride(1), k_cache.data_ptr(),
                 v_cache.data_ptr(), slots.data_ptr(), t, h, d, v.shape[-1], int(k.dtype == torch.bfloat16))
    return True
