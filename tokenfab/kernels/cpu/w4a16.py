"""W4A16 on CPU with the weights kept packed (``w4a16.c``): the native path of
``kernels/w4a16.py``'s GEMM for CPU tensors.

``w4a16_native(x, qweight, scales, global_scale, bias, codec, in_features)`` has the reference's
signature and returns None for what the C kernel does not take (a non-CPU tensor, activations other
than float32/bfloat16, no compiler, ``TOKENFAB_CPU_NATIVE=0``), so the caller falls back to the
reference. Up to ``GEMV_MAX_ROWS`` activation rows (decode) it decodes one weight row at a time per
thread and takes its dot products: the packed bytes are read once a call. More rows (prefill): the C
code dequantizes ``TILE_BYTES`` of weight rows at a time for torch's float32 GEMM. Either way no
full-precision copy of the layer is made (the reference dequantizes the whole layer each call).
"""

from __future__ import annotations

import ctypes

import torch

from tokenfab.kernels.cpu import native_library
from tokenfab.kernels.cpu.checks import check_status

_CODEC = {"int4": 0, "mxfp4": 1, "nvfp4": 2}
_GROUP = {"int4": 32, "mxfp4": 32, "nvfp4": 16}
_SCALE_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_ACT = {torch.float32: 0, torch.bfloat16: 1}
# above this many rows the weight is dequantized a tile of rows at a time (C) and multiplied by torch's
# GEMM, which is faster than the row-by-row dot products once the activations are a matrix
GEMV_MAX_ROWS = 16
TILE_BYTES = 1 << 22  # float32 bytes of one dequantized weight tile


def _tiled_gemm(lib, x2, q, s, kind, global_scale, bias, codec, k, out) -> torch.Tensor:
    """Prefill-sized products: weight rows dequantized TILE_BYTES at a time (rounded to bfloat16 for
    bfloat16 activations, as the reference does), multiplied in float32, scaled, biased, rounded."""
    n = q.shape[0]
    rows = max(1, TILE_BYTES // (4 * k))
    xf = x2.float()
    tile = torch.empty(min(rows, n), k, dtype=torch.float32)
    for n0 in range(0, n, rows):
        n1 = min(n, n0 + rows)
        w = tile[: n1 - n0]
        status = lib.w4a16_dequant(
            ctypes.c_void_p(q[n0].data_ptr()), q.stride(0), ctypes.c_void_p(s[n0].data_ptr()), kind, s.stride(0),
            _CODEC[codec], _GROUP[codec], n1 - n0, k, ctypes.c_void_p(w.data_ptr()), int(x2.dtype == torch.bfloat16),
        )
        check_status(status, "w4a16_dequant")
        y = xf @ w.T
        if global_scale is not None:
            y *= global_scale.reshape(-1).float()[n0:n1] if global_scale.numel() > 1 else global_scale.float()
        if bias is not None:
            y += bias[n0:n1].float()
        out[:, n0:n1] = y
    return out


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def w4a16_native(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    global_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    codec: str,
    in_features: int,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor | None:
    """``x [..., K] @ dequant(W).T`` (see ``kernels/w4a16.py``), or None when the C kernel cannot run.
    ``out_dtype``: float32 keeps the unrounded products (the MoE path applies its activation to them)."""
    lib = native_library()
    if lib is None or codec not in _CODEC or x.device.type != "cpu" or x.dtype not in _ACT:
        return None
    if qweight.device.type != "cpu" or qweight.dtype != torch.uint8 or qweight.dim() != 2:
        return None
    if codec == "mxfp4":
        kind = 3 if scales.dtype == torch.uint8 else None
    elif codec == "nvfp4":
        kind = 4 if scales.dtype in (torch.uint8, torch.float8_e4m3fn) else None
    else:
        kind = _SCALE_KIND.get(scales.dtype)
    n, g_size = qweight.shape[0], _GROUP[codec]
    if kind is None or x.shape[-1] != in_features or qweight.shape[1] != (in_features + 1) // 2:
        return None  # the reference raises the clear error for a bad shape
    if tuple(scales.shape) != (n, (in_features + g_size - 1) // g_size) or scales.device.type != "cpu":
        return None
    if global_scale is not None and global_scale.numel() not in (1, n):
        return None
    if bias is not None and tuple(bias.shape) != (n,):
        return None
    shape = x.shape
    x2 = x.reshape(-1, in_features)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out_dtype = out_dtype or x.dtype
    if out_dtype not in _ACT:
        return None
    out = x2.new_empty(m, n, dtype=out_dtype)
    if m == 0 or n == 0:
        return out.view(*shape[:-1], n)
    q = qweight if qweight.stride(-1) == 1 else qweight.contiguous()
    s = scales.view(torch.uint8) if scales.dtype == torch.float8_e4m3fn else scales
    s = s if s.stride(-1) == 1 else s.contiguous()
    if m > GEMV_MAX_ROWS:
        return _tiled_gemm(lib, x2, q, s, kind, global_scale, bias, codec, in_features, out).view(*shape[:-1], n)
    g = None
    if global_scale is not None:
        g = global_scale.reshape(-1).float().expand(n).contiguous()
    b = bias.float().contiguous() if bias is not None else None
    status = lib.w4a16_matmul(
        ctypes.c_void_p(x2.data_ptr()), _ACT[x.dtype], x2.stride(0), ctypes.c_void_p(q.data_ptr()), q.stride(0),
        ctypes.c_void_p(s.data_ptr()), kind, s.stride(0), ctypes.c_void_p(_ptr(g)), ctypes.c_void_p(_ptr(b)),
        _CODEC[codec], _GROUP[codec], m, n, in_features, ctypes.c_void_p(out.data_ptr()), _ACT[out_dtype],
        out.stride(0),
    )
    check_status(status, "w4a16_matmul")
    return out.view(*shape[:-1], n)
