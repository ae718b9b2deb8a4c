"""ctypes wrappers of ``elementwise.c``: RMSNorm (+ residual), SiLU-and-mul, RoPE, row argmax,
KV-cache store.

Each wrapper has its reference's signature and returns None when it cannot take the tensors
(not CPU, a dtype other than float32/bfloat16, rows without one common stride, no compiler);
the caller then runs the reference. Inputs that no kernel may take (mismatched shapes, a slot
outside the cache, a position outside the rotary cache) raise ValueError (``checks``), and a
kernel that cannot allocate its work buffer raises MemoryError.
"""

from __future__ import annotations

import torch

from tokenfab.kernels.cpu import native_library
from tokenfab.kernels.cpu.checks import check_positions, check_slots, check_status

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


def _check_weight(weight: torch.Tensor, h: int) -> None:
    if weight.shape != (h,):
        raise ValueError(f"RMSNorm weight has shape {tuple(weight.shape)}, expected ({h},)")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    h = x.shape[-1]
    _check_weight(weight, h)
    lib = native_library()
    layout = _row_layout(x, h)
    if lib is None or layout is None or not _usable(x, weight) or not weight.is_contiguous():
        return None
    rows, stride, per, inner = layout
    out = torch.empty(x.shape, dtype=x.dtype)
    rc = lib.rms_norm(x.data_ptr(), stride, per, inner, None, 0, weight.data_ptr(), out.data_ptr(), h, rows, h,
                      float(eps), int(x.dtype == torch.bfloat16))
    check_status(rc, "rms_norm")
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    h = x.shape[-1]
    if residual.shape != x.shape:
        raise ValueError(f"residual has shape {tuple(residual.shape)}, x has {tuple(x.shape)}")
    _check_weight(weight, h)
    lib = native_library()
    rows, res_rows = _rows(x, h), _rows(residual, h)
    if (lib is None or rows is None or res_rows is None or rows[0] != res_rows[0]
            or not _usable(x, residual, weight) or not weight.is_contiguous()):
        return None
    out = torch.empty(x.shape, dtype=x.dtype)
    rc = lib.rms_norm(x.data_ptr(), rows[1], 1, 0, residual.data_ptr(), res_rows[1], weight.data_ptr(),
                      out.data_ptr(), h, rows[0], h, float(eps), int(x.dtype == torch.bfloat16))
    check_status(rc, "add_rms_norm")
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor | None:
    lib = native_library()
    rows = _rows(x, x.shape[-1])
    if lib is None or rows is None or not _usable(x) or x.shape[-1] % 2:
        return None
    i = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], i, dtype=x.dtype)
    rc = lib.silu_and_mul(x.data_ptr(), rows[1], out.data_ptr(), i, rows[0], i, int(x.dtype == torch.bfloat16))
    check_status(rc, "silu_and_mul")
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
    rot = cos_sin_cache.shape[-1]
    if cos_sin_cache.dim() != 2 or rot % 2 or rot > d:
        raise ValueError(f"cos_sin_cache must be [positions, rotary_dim] with an even rotary_dim <= head size {d}, "
                         f"got {tuple(cos_sin_cache.shape)}")
    check_positions(positions, t, cos_sin_cache.shape[0])
    pos = positions if positions.dtype == torch.int64 and positions.is_contiguous() else (
        positions.to(torch.int64).contiguous())
    q_out = torch.empty(t, hq, d, dtype=q.dtype)
    k_out = torch.empty(t, hk, d, dtype=k.dtype)
    rc = lib.rotary_qk(pos.data_ptr(), q.data_ptr(), q.stride(0), q.stride(1), hq, q_out.data_ptr(),
                       k.data_ptr(), k.stride(0), k.stride(1), hk, k_out.data_ptr(), cos_sin_cache.data_ptr(),
                       t, d, rot, int(is_neox), int(q.dtype == torch.bfloat16))
    check_status(rc, "rotary_qk")
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
    dv = v.shape[-1]
    if v.shape[:2] != (t, h) or k_cache.shape[-2:] != (h, d) or v_cache.shape[-2:] != (h, dv):
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} do not fit k_cache {tuple(k_cache.shape)} / "
                         f"v_cache {tuple(v_cache.shape)} (caches are [..., heads, head size])")
    n_slots = k_cache.numel() // (h * d) if h * d else 0
    if (v_cache.numel() // (h * dv) if h * dv else 0) != n_slots:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} hold different "
                         "numbers of slots")
    check_slots(slot_mapping, t, n_slots)
    slots = slot_mapping if slot_mapping.dtype == torch.int64 else slot_mapping.to(torch.int64)
    slots = slots.contiguous()
    lib.store_kv(k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0), v.stride(1), k_cache.data_ptr(),
                 v_cache.data_ptr(), slots.data_ptr(), t, h, d, v.shape[-1], int(k.dtype == torch.bfloat16))
    return True
