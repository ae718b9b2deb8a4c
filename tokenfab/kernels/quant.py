"""FP8 (e4m3) GEMMs with block or per-channel scales: DeepSeek-style block FP8, compressed-tensors FP8.

Two ops, each a Triton kernel, a plain-PyTorch reference of the same signature and a custom op:

``per_token_group_quant_fp8(x, group, ue8m0)`` -> (q, s)
    x [M, K] -> q float8_e4m3fn [M, K] and s float32 [M, ceil(K / group)], per token and group:
    ``s = max(amax, 1e-10) / 448`` (``ue8m0``: rounded up to a power of two, DeepSeek-V3.1's
    ``scale_fmt``), ``q = clamp(x / s, -448, 448)``. The last group of a row is zero-padded.

``w8a8_scaled_mm(a, a_s, w, w_s, group_n, out_dtype)`` -> c [M, N]
    ``c[m, n] = sum_kt (a[m, kt] . w[n, kt]) * a_s[m, kt] * w_s[n // group_n, kt]`` over K tiles
    kt of BLOCK_K = 128 = the scale group: one scale product per tile, accumulated in fp32 (vLLM's
    ``_w8a8_triton_block_scaled_mm`` scheme). a float8 [M, K], w float8 [N, K]; a_s [M, ceil(K/128)]
    or [M, 1] (one scale per token, or a static per-tensor scale expanded); w_s [ceil(N/group_n),
    ceil(K/128)] (block FP8, group_n 128) or [N, 1] (per-channel, group_n 1). Scale tensors with
    one column are read with a zero K stride. K and N need not be multiples of 128: the edge tiles
    are masked (zero), as the checkpoints' edge blocks were zero-padded before scaling.

``fp8_linear`` is what the quantized layers call: on CUDA (or ``TOKENFAB_KERNELS=triton``) it
quantizes the activations and runs the W8A8 GEMM; on CPU it dequantizes the layer's weight for
this call (the weights stay float8 in memory) and runs ``F.linear``, with the activations rounded
through float8 or not, matching what transformers computes for each format.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# isort: off
# _launch picks Triton's interpreter on machines without a GPU; it must run before triton loads
from tokenfab.kernels._launch import check_device, interpreting
import triton
import triton.language as tl
# isort: on

from tokenfab.kernels._dispatch import backend, use_triton
from tokenfab.kernels.cpu.fp8_matmul import fp8_linear_native

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
GROUP_K = 128  # the activation / weight scale group along K, and the GEMM's BLOCK_K
SCALE_MIN = 1e-10


def _ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


# ----------------------------------------------------------------------------- interpreter


def patch_interpreter_fp8() -> None:
    """Make Triton's interpreter (3.9) convert and multiply float8_e4m3fn as the GPU does.

    Its fp32 -> e4m3 cast drops the carry when rounding up crosses a power of two (1.96 -> 1.0),
    so casts go through torch (round to nearest even, saturated at 448 by the kernel's clamp), and
    ``tl.dot`` gets e4m3 operands widened to fp32 (exact). Compiled kernels are unaffected."""
    import numpy as np
    from triton.runtime import interpreter

    if getattr(interpreter, "_tokenfab_fp8_patched", False):
        return
    original_convert = interpreter._convert_float

    def to_f32(data):
        u8 = torch.from_numpy(np.ascontiguousarray(data).view(np.uint8))
        return u8.view(FP8).float().numpy().view(np.uint32).reshape(data.shape)

    def convert(input, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype == tl.float8e4nv:
            src = torch.from_numpy(np.ascontiguousarray(input).view(np.float32))
            return src.to(FP8).view(torch.uint8).numpy().reshape(input.shape)
        if input_dtype == tl.float8e4nv and output_dtype == tl.float32:
            return to_f32(input)
        return original_convert(input, input_dtype, output_dtype, rounding_mode)

    builder_cls = type(interpreter.interpreter_builder)
    original_dot = builder_cls.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        def up(h):
            if h.dtype.scalar == tl.float8e4nv:
                return interpreter.TensorHandle(to_f32(h.data).view(np.float32), tl.float32)
            return h

        return original_dot(self, up(a), up(b), d, "ieee" if a.dtype.scalar == tl.float8e4nv else input_precision,
                            max_num_imprecise_acc)

    interpreter._convert_float = convert
    builder_cls.create_dot = create_dot
    interpreter._tokenfab_fp8_patched = True


def _check(t: torch.Tensor) -> None:
    check_device(t)
    if interpreting():
        patch_interpreter_fp8()


# ----------------------------------------------------------------------------- activation quant


def per_token_group_quant_fp8_ref(x: torch.Tensor, group: int, ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = x.shape
    g = _ceil_div(k, group)
    xf = F.pad(x.float(), (0, g * group - k)).view(m, g, group)
    s = xf.abs().amax(-1).clamp_min(SCALE_MIN) / FP8_MAX
    if ue8m0:
        s = torch.exp2(torch.ceil(torch.log2(s)))
    q = (xf / s[..., None]).clamp(-FP8_MAX, FP8_MAX).view(m, g * group)[:, :k].to(FP8)
    return q.contiguous(), s.contiguous()


@triton.jit
def _per_token_group_quant_kernel(
    x_ptr, q_ptr, s_ptr, M, K, sxm, sqm, ssm,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, UE8M0: tl.constexpr,
):
    """One program: BLOCK_M rows x one group of GROUP columns."""
    pid_m = tl.program_id(0)
    g = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = g * GROUP + tl.arange(0, GROUP)
    row_ok = rows < M
    mask = row_ok[:, None] & (cols[None, :] < K)
    r64 = rows.to(tl.int64)
    x = tl.load(x_ptr + r64[:, None] * sxm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    s = tl.maximum(amax, 1e-10) / 448.0
    if UE8M0:
        s = tl.exp2(tl.ceil(tl.log2(s)))
    q = tl.clamp(x / s[:, None], -448.0, 448.0)
    tl.store(q_ptr + r64[:, None] * sqm + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + r64 * ssm + g, s, mask=row_ok)


def quant_config(m: int) -> dict:
    return dict(BLOCK_M=16 if m >= 16 else 1, num_warps=4)


def _per_token_group_quant_triton(x: torch.Tensor, group: int, ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    _check(x)
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8, device=x.device)
    s = torch.empty((m, _ceil_div(k, group)), dtype=torch.float32, device=x.device)
    if m == 0 or k == 0:
        return q, s
    if x.stride(-1) != 1:
        x = x.contiguous()
    cfg = quant_config(m)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), s.shape[1])
    _per_token_group_quant_kernel[grid](x, q, s, m, k, x.stride(0), q.stride(0), s.stride(0),
                                        GROUP=group, UE8M0=ue8m0, **cfg)
    return q, s


@torch.library.custom_op("tokenfab::per_token_group_quant_fp8", mutates_args=())
def per_token_group_quant_fp8(x: torch.Tensor, group: int, ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(x):
        return _per_token_group_quant_triton(x, group, ue8m0)
    return per_token_group_quant_fp8_ref(x, group, ue8m0)


@per_token_group_quant_fp8.register_fake
def _(x, group, ue8m0):
    m, k = x.shape
    return x.new_empty((m, k), dtype=FP8), x.new_empty((m, _ceil_div(k, group)), dtype=torch.float32)


# ----------------------------------------------------------------------------- scaled GEMM


def _expand_scales(s: torch.Tensor, rows: int, k: int, group_rows: int) -> torch.Tensor:
    """A scale grid [ceil(rows / group_rows), ceil(k / 128)] (or one column) as a [rows, k] tensor."""
    s = s.float()
    s = s.repeat_interleave(group_rows, 0)[:rows]
    if s.shape[1] == 1:
        return s.expand(rows, k)
    return s.repeat_interleave(GROUP_K, 1)[:, :k]


def dequantize_fp8(w: torch.Tensor, w_s: torch.Tensor, group_n: int, dtype: torch.dtype) -> torch.Tensor:
    """w float8 [N, K] times its scales (block grid with ``group_n`` rows a block, or [N, 1]) in ``dtype``."""
    n, k = w.shape
    return (w.float() * _expand_scales(w_s, n, k, group_n)).to(dtype)


def w8a8_scaled_mm_ref(a: torch.Tensor, a_s: torch.Tensor, w: torch.Tensor, w_s: torch.Tensor, group_n: int,
                       out_dtype: torch.dtype) -> torch.Tensor:
    """The definition, tile by tile: per K tile, the fp32 product of the float8 values times both scales."""
    m, k = a.shape
    n = w.shape[0]
    out = torch.zeros((m, n), dtype=torch.float32, device=a.device)
    af, wf = a.float(), w.float()
    a_full = _expand_scales(a_s, m, k, 1)
    w_full = _expand_scales(w_s, n, k, group_n)
    for k0 in range(0, k, GROUP_K):
        k1 = min(k, k0 + GROUP_K)
        out += (af[:, k0:k1] @ wf[:, k0:k1].T) * a_full[:, k0:k0 + 1] * w_full[:, k0:k0 + 1].T
    return out.to(out_dtype)


@triton.jit
def _w8a8_scaled_mm_kernel(
    a_ptr, w_ptr, c_ptr, as_ptr, ws_ptr, M, N, K,
    sam, swn, scm, sasm, sask, swsn, swsk,
    GROUP_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """C tile [BLOCK_M, BLOCK_N]; each K tile of BLOCK_K (= the scale group) adds
    ``dot(a, w^T) * a_s[:, None] * w_s[None, :]`` to an fp32 accumulator."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_n  # grouped ordering: neighbouring programs share weight tiles in L2
    group_id = pid // width
    first_m = group_id * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * sam + offs_k[None, :]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[None, :] * swn + offs_k[:, None]
    as_ptrs = as_ptr + offs_m.to(tl.int64) * sasm
    ws_ptrs = ws_ptr + (offs_n // GROUP_N).to(tl.int64) * swsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - kt * BLOCK_K
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        a_s = tl.load(as_ptrs + kt * sask, mask=m_ok, other=0.0)
        w_s = tl.load(ws_ptrs + kt * swsk, mask=n_ok, other=0.0)
        acc += tl.dot(a, w) * a_s[:, None] * w_s[None, :]
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    c = acc.to(c_ptr.dtype.element_ty)
    tl.store(c_ptr + offs_m.to(tl.int64)[:, None] * scm + offs_n[None, :], c, mask=m_ok[:, None] & n_ok[None, :])


def mm_config(m: int) -> dict:
    """Launch configuration by token count (also used by the compile check). BLOCK_K is the scale
    group; 64-row tiles let Hopper use warp-group MMA (vLLM's default tile is M64 N128 K128)."""
    if m <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=GROUP_K, GROUP_M=1, num_warps=4, num_stages=3)
    if m <= 64:
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=GROUP_K, GROUP_M=8, num_warps=4, num_stages=3)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=GROUP_K, GROUP_M=8, num_warps=8, num_stages=3)


def _w8a8_scaled_mm_triton(a: torch.Tensor, a_s: torch.Tensor, w: torch.Tensor, w_s: torch.Tensor,
                           group_n: int, out_dtype: torch.dtype) -> torch.Tensor:
    _check(a)
    m, k = a.shape
    n = w.shape[0]
    if w.shape[1] != k:
        raise ValueError(f"w8a8_scaled_mm: a is [{m}, {k}] but w is {tuple(w.shape)}")
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return c
    if k == 0:
        return c.zero_()
    a = a if a.stride(-1) == 1 else a.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    a_s, w_s = a_s.float(), w_s.float()
    cfg = mm_config(m)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    _w8a8_scaled_mm_kernel[grid](
        a, w, c, a_s, w_s, m, n, k,
        a.stride(0), w.stride(0), c.stride(0),
        a_s.stride(0), a_s.stride(1) if a_s.shape[1] > 1 else 0,
        w_s.stride(0), w_s.stride(1) if w_s.shape[1] > 1 else 0,
        GROUP_N=group_n, **cfg,
    )
    return c


@torch.library.custom_op("tokenfab::w8a8_scaled_mm", mutates_args=())
def w8a8_scaled_mm(a: torch.Tensor, a_s: torch.Tensor, w: torch.Tensor, w_s: torch.Tensor, group_n: int,
                   out_dtype: torch.dtype) -> torch.Tensor:
    if use_triton(a):
        return _w8a8_scaled_mm_triton(a, a_s, w, w_s, group_n, out_dtype)
    return w8a8_scaled_mm_ref(a, a_s, w, w_s, group_n, out_dtype)


@w8a8_scaled_mm.register_fake
def _(a, a_s, w, w_s, group_n, out_dtype):
    return a.new_empty((a.shape[0], w.shape[0]), dtype=out_dtype)


# ----------------------------------------------------------------------------- the layers' entry


def quantize_per_token_fp8(x: torch.Tensor, input_scale: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8 [M, K], scales [M, 1]): one scale per token (amax / 448), or the static
    per-tensor ``input_scale`` for every token. Plain tensor ops (a few elementwise kernels)."""
    xf = x.float()
    if input_scale is not None:
        s = input_scale.float().reshape(1, 1).expand(x.shape[0], 1)
    else:
        s = xf.abs().amax(-1, keepdim=True).clamp_min(SCALE_MIN) / FP8_MAX
    return (xf / s).clamp(-FP8_MAX, FP8_MAX).to(FP8), s


def fp8_linear(x: torch.Tensor, w: torch.Tensor, w_s: torch.Tensor, group_n: int, bias: torch.Tensor | None,
               ue8m0: bool = False, input_scale: torch.Tensor | None = None, act: str = "group",
               cpu_act_quant: bool = False) -> torch.Tensor:
    """``x @ dequant(w, w_s).T + bias`` for x [..., K].

    ``act``: how activations are quantized: "group" (per token and 128 channels, block FP8),
    "token" (one scale per token), "static" (``input_scale``, one per tensor).
    Triton (CUDA, or ``TOKENFAB_KERNELS=triton``): W8A8, the activations quantized so, then the scaled
    GEMM. Otherwise the weight is dequantized for this call only and multiplied in x's dtype; with
    ``cpu_act_quant`` the activations are first rounded through float8 as the GPU path does
    (compressed-tensors' semantics, what transformers computes for it), else they are not
    (transformers' dequantized block-FP8 model)."""
    shape = x.shape
    n, k = w.shape
    x2 = x.reshape(-1, k)
    choice = backend(x, native=True)
    if choice != "triton":
        if cpu_act_quant:
            if act == "group":
                q, a_s = per_token_group_quant_fp8_ref(x2, GROUP_K, ue8m0)
            else:
                q, a_s = quantize_per_token_fp8(x2, input_scale if act == "static" else None)
            x2 = dequantize_fp8(q, a_s, 1, x.dtype)
        out = None
        if choice == "native" and not torch.compiler.is_compiling():  # the C kernel (cpu/fp8_matmul.c)
            out = fp8_linear_native(x2, w, w_s, group_n, bias)
        if out is None:
            out = F.linear(x2, dequantize_fp8(w, w_s, group_n, x.dtype), bias)
        return out.view(*shape[:-1], n)
    if act == "group":
        q, a_s = per_token_group_quant_fp8(x2, GROUP_K, ue8m0)
    else:
        q, a_s = quantize_per_token_fp8(x2, input_scale if act == "static" else None)
    out = w8a8_scaled_mm(q, a_s, w, w_s, group_n, x.dtype)
    if bias is not None:
        out = out + bias
    return out.view(*shape[:-1], n)
