"""FP8 weights on CPU, kept float8 (``fp8_matmul.c``): the native path of ``kernels/quant.py``'s
``fp8_linear`` for CPU tensors (weight-only: the activations as given).

``fp8_linear_native(x, w, w_s, group_n, bias)`` returns None for what the C kernel does not take
(non-float32 activations, a non-CPU tensor, no compiler, ``TOKENFAB_CPU_NATIVE=0``); the caller then
runs the reference. Up to ``GEMV_MAX_ROWS`` rows (decode) each weight row is decoded once into a float
row per thread and dotted with every activation row. More rows (prefill): the C code dequantizes the
layer for the call and torch's GEMM multiplies (the float copy lives for the call only).
"""

from __future__ import annotations

import ctypes

import torch

from tokenfab.kernels.cpu import native_library
from tokenfab.kernels.cpu.checks import check_status

GEMV_MAX_ROWS = 16
_FP8 = torch.float8_e4m3fn


def fp8_dequant_native(w: torch.Tensor, w_s: torch.Tensor, group_n: int) -> torch.Tensor | None:
    """float8 [N, K] times its scales, as float32 [N, K]; None when the C kernel cannot."""
    lib = native_library()
    if lib is None or w.device.type != "cpu" or w.dtype != _FP8 or w.stride(-1) != 1:
        return None
    n, k = w.shape
    s = w_s.float().contiguous()
    out = torch.empty(n, k, dtype=torch.float32)
    if n and k:
        status = lib.fp8_dequant_rows(ctypes.c_void_p(w.data_ptr()), w.stride(0), n, k, ctypes.c_void_p(s.data_ptr()),
                                      s.stride(0), s.stride(1) if s.shape[1] > 1 else 0, group_n,
                                      ctypes.c_void_p(out.data_ptr()))
        check_status(status, "fp8_dequant_rows")
    return out


def fp8_linear_native(x: torch.Tensor, w: torch.Tensor, w_s: torch.Tensor, group_n: int,
                      bias: torch.Tensor | None) -> torch.Tensor | None:
    """``x @ dequant(w, w_s).T + bias`` for float32 x [..., K]; None when the C kernel cannot take it."""
    lib = native_library()
    if lib is None or x.dtype != torch.float32 or x.device.type != "cpu" or w.dtype != _FP8 or w.stride(-1) != 1:
        return None
    n, k = w.shape
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if m > GEMV_MAX_ROWS:
        deq = fp8_dequant_native(w, w_s, group_n)
        return None if deq is None else torch.nn.functional.linear(x, deq, bias)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    s = w_s.float().contiguous()
    out = torch.empty(m, n, dtype=torch.float32)
    if m and n:
        status = lib.fp8_matmul_f32(
            ctypes.c_void_p(x2.data_ptr()), x2.stride(0), m, k, ctypes.c_void_p(w.data_ptr()), w.stride(0), n,
            ctypes.c_void_p(s.data_ptr()), s.stride(0), s.stride(1) if s.shape[1] > 1 else 0, group_n,
            ctypes.c_void_p(out.data_ptr()), out.stride(0),
        )
        check_status(status, "fp8_matmul_f32")
    if bias is not None:
        out += bias.float()
    return out.view(*x.shape[:-1], n)
