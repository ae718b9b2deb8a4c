"""W4A16 GEMM: 16/32-bit activations times 4-bit packed weights, dequantized in registers.

    out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]),   w[n, k] = value(code[n, k]) * scale[n, k // G] (* g[n])

Three weight codecs share one byte layout, ``qweight`` uint8 [N, ceil(K / 2)]: byte j of a row
holds elements 2j (low nibble) and 2j + 1 (high nibble). Each checkpoint format is that layout
as stored, viewed without a copy:

- ``int4``: compressed-tensors ``weight_packed`` int32 [N, K/8] (8 nibbles a word, element i at
  bits 4i: its little-endian bytes are the layout above); value ``nibble - 8``; ``weight_scale``
  [N, K/32] bf16/fp16/fp32 (G = 32).
- ``mxfp4``: GPT-OSS ``*_blocks`` uint8 [rows, K/32, 16]; E2M1 values (sign bit 3; 0, .5, 1, 1.5,
  2, 3, 4, 6); ``*_scales`` uint8 E8M0, ``2^(s - 127)`` (G = 32).
- ``nvfp4``: ModelOpt ``weight`` uint8 [N, K/2]; E2M1; ``weight_scale`` float8 E4M3 [N, K/16]
  (G = 16) times the float32 global ``weight_scale_2`` (one per tensor; a merged projection passes
  one per output row, each shard's own).

The kernel streams a [BLOCK_K / G, BLOCK_N] tile of scales and a K-contiguous [BLOCK_K / 2, BLOCK_N]
tile of bytes (unmasked along K when K is a multiple of the tile, so both load by cp.async; the two
nibbles of a byte are spread with ``tl.join`` + reshape), decodes the codes with integer ops, multiplies by the
scale broadcast over its group, rounds to the activation dtype and feeds ``tl.dot`` (fp32
accumulator; exact "ieee" products for fp32 activations). NVFP4's global scale (a scalar, or one
per output column) multiplies the accumulator once, with the bias, at the end.

Hopper has no FP4 tensor cores, so MXFP4/NVFP4 run here as W4A16 (as vLLM and SGLang do on
Hopper). A Blackwell (sm_100) path slots in at the one place the weight tile meets the MMA: for
``mxfp4``/``nvfp4`` the packed byte tile and the raw scale tile are exactly the operands of
``tl.dot_scaled(a, None, "bf16", w_bytes, w_scales, "e2m1")`` (E8M0 scales; NVFP4's E4M3 scales
with group 16 map to the tcgen05 ``mxf4nvf4`` kind), so a ``BLACKWELL`` constexpr would replace
``_dequant_tile`` + ``tl.dot`` by ``dot_scaled`` with the same loads, strides and grid.

The reference (``w4a16_gemm_ref``, same signature) dequantizes the whole layer to fp32, rounds
it to the activation dtype like the kernel, and multiplies. On CPU the C kernel
(``kernels/cpu/w4a16.c``, float32/bfloat16 activations) decodes one weight row at a time per
thread instead; the reference is its fallback. Either way only the packed weights live between
calls.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# isort: off
# _launch picks Triton's interpreter on machines without a GPU; it must run before triton loads
from tokenfab.kernels._launch import DEFAULT_NUM_SMS, check_device, dot_precision, num_sms
import triton
import triton.language as tl
# isort: on

from tokenfab.kernels._dispatch import eager_op, kernel_op
from tokenfab.kernels.cpu.w4a16 import w4a16_native
from tokenfab.kernels.moe_common import grouped_tile

CODECS = ("int4", "mxfp4", "nvfp4")
GROUP_SIZE = {"int4": 32, "mxfp4": 32, "nvfp4": 16}

# E2M1 values of the 16 FP4 codes (sign bit 3, exponent bits 2-1, mantissa bit 0).
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A packed weight (int32 words or uint8 bytes, rows last-dim contiguous) as its uint8 bytes."""
    if t.dtype == torch.uint8:
        return t
    if not t.is_contiguous():
        t = t.contiguous()
    return t.view(torch.uint8)


def scale_values(scales: torch.Tensor, codec: str) -> torch.Tensor:
    """The float32 value of each group scale (E8M0 exponents for mxfp4, E4M3 for nvfp4)."""
    if codec == "mxfp4":
        return torch.exp2(scales.to(torch.float32) - 127.0)
    if codec == "nvfp4" and scales.dtype == torch.uint8:
        scales = scales.view(torch.float8_e4m3fn)
    return scales.float()


def check_w4(qweight: torch.Tensor, scales: torch.Tensor, codec: str, in_features: int) -> None:
    if codec not in CODECS:
        raise ValueError(f"codec must be one of {CODECS}, not {codec!r}")
    g = GROUP_SIZE[codec]
    k_bytes, k_groups = (in_features + 1) // 2, (in_features + g - 1) // g
    if qweight.dtype != torch.uint8 or qweight.shape[-1] != k_bytes:
        raise ValueError(f"{codec} weight must be uint8 [..., {k_bytes}] for {in_features} inputs, "
                         f"got {qweight.dtype} {tuple(qweight.shape)}")
    if tuple(scales.shape) != (*qweight.shape[:-1], k_groups):
        raise ValueError(f"{codec} scales must be {(*qweight.shape[:-1], k_groups)}, got {tuple(scales.shape)}")


def dequantize_w4(qweight: torch.Tensor, scales: torch.Tensor, codec: str, in_features: int) -> torch.Tensor:
    """uint8 [..., ceil(K/2)] codes and [..., ceil(K/G)] scales -> float32 [..., K] (no global scale)."""
    check_w4(qweight, scales, codec, in_features)
    lo, hi = (qweight & 0x0F).long(), (qweight >> 4).long()
    codes = torch.stack((lo, hi), dim=-1).flatten(-2)[..., :in_features]
    if codec == "int4":
        vals = (codes - 8).float()
    else:
        vals = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32, device=qweight.device)[codes]
    s = scale_values(scales, codec).repeat_interleave(GROUP_SIZE[codec], dim=-1)[..., :in_features]
    return vals * s


def w4a16_gemm_ref(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    global_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    codec: str,
    in_features: int,
) -> torch.Tensor:
    """x [..., K] -> [..., N]. The weight, dequantized in fp32 and rounded to x's dtype (as the kernel
    feeds the MMA), multiplies in fp32; times the global scale, plus the bias, rounded to x's dtype."""
    w = dequantize_w4(qweight, scales, codec, in_features).to(x.dtype)
    out = F.linear(x.float(), w.float())
    if global_scale is not None:
        out = out * global_scale.float().reshape(-1)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


@triton.jit
def _dequant_tile(codes, scales, CODEC: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    """codes int32 [BLOCK_K, BLOCK_N] (0..15), raw scales [BLOCK_K // GROUP, BLOCK_N] -> fp32 weights.

    CODEC 0: int4 (nibble - 8, float scales); 1: E2M1 with E8M0 scales; 2: E2M1 with E4M3 scales
    (uint8 bits). E2M1 magnitude: twice the value is m (exponent 0) or (2 + m) << (e - 1).
    """
    if CODEC == 0:
        vals = (codes - 8).to(tl.float32)
        s = scales.to(tl.float32)
    else:
        e = (codes >> 1) & 3
        m = codes & 1
        twice = tl.where(e == 0, m, (2 + m) << tl.maximum(e - 1, 0))
        mag = twice.to(tl.float32) * 0.5
        vals = tl.where((codes & 8) != 0, -mag, mag)
        sb = scales.to(tl.int32)
        if CODEC == 1:
            s = tl.exp2(sb.to(tl.float32) - 127.0)
        else:
            se = (sb >> 3) & 15
            sm = (sb & 7).to(tl.float32)
            smag = tl.where(se == 0, sm * 0.001953125, (8.0 + sm) * tl.exp2(se.to(tl.float32) - 10.0))
            s = tl.where((sb & 128) != 0, -smag, smag)
    s_full = tl.reshape(tl.broadcast_to(s[:, None, :], (BLOCK_K // GROUP, GROUP, BLOCK_N)), (BLOCK_K, BLOCK_N))
    return vals * s_full


@triton.jit
def _unpack_codes(byte, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """uint8 bytes [BLOCK_K // 2, BLOCK_N] (K-contiguous in memory, so the load vectorizes) -> int32
    codes [BLOCK_K, BLOCK_N], element 2j from byte j's low nibble, 2j + 1 from its high nibble."""
    b = byte.to(tl.int32)
    pair = tl.join(b & 15, b >> 4)  # [BLOCK_K // 2, BLOCK_N, 2]
    return tl.reshape(tl.permute(pair, (0, 2, 1)), (BLOCK_K, BLOCK_N))


@triton.jit
def _w4a16_kernel(
    x_ptr, w_ptr, s_ptr, g_ptr, b_ptr, out_ptr, ws_ptr,
    M, N, K, sxm, swn, ssn, sgn, som,
    CODEC: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_GLOBAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PREC: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """Program (row tile, column tile, K split) of out = x . dequant(W)^T; BLOCK_K a multiple of GROUP.

    SPLIT_K > 1 (decode: few row tiles, long K): split s takes K tiles [s * per, (s + 1) * per) and
    writes its fp32 partial to ws[s]; ``_w4a16_reduce_kernel`` sums them in split order.
    """
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = grouped_tile(pid, num_pid_m, num_pid_n, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_b = tl.arange(0, BLOCK_K // 2)
    offs_g = tl.arange(0, BLOCK_K // GROUP)
    mmask = offs_m < M
    nmask = offs_n < N
    a_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * sxm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * swn + offs_b[:, None]
    s_ptrs = s_ptr + offs_n[None, :].to(tl.int64) * ssn + offs_g[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_tiles = tl.cdiv(K, BLOCK_K)
    per = tl.cdiv(k_tiles, SPLIT_K)
    k_first = pid_k * per
    k_last = tl.minimum(k_first + per, k_tiles)
    a_ptrs += k_first * BLOCK_K
    w_ptrs += k_first * (BLOCK_K // 2)
    s_ptrs += k_first * (BLOCK_K // GROUP)
    for kk in range(k_first, k_last):
        krem = K - kk * BLOCK_K
        kmask = offs_k < krem
        a = tl.load(a_ptrs, mask=mmask[:, None] & kmask[None, :], other=0.0)
        if EVEN_K:  # no K mask: the loads vectorize along K
            byte = tl.load(w_ptrs, mask=nmask[None, :], other=0)
            sc = tl.load(s_ptrs, mask=nmask[None, :], other=0)
        else:
            byte = tl.load(w_ptrs, mask=nmask[None, :] & (offs_b[:, None] * 2 < krem), other=0)
            sc = tl.load(s_ptrs, mask=nmask[None, :] & (offs_g[:, None] * GROUP < krem), other=0)
        w = _dequant_tile(_unpack_codes(byte, BLOCK_K, BLOCK_N), sc, CODEC, GROUP, BLOCK_K, BLOCK_N)
        acc = tl.dot(a, w.to(a.dtype), acc, input_precision=DOT_PREC)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K // 2
        s_ptrs += BLOCK_K // GROUP
    if SPLIT_K > 1:
        p_ptrs = ws_ptr + (pid_k * M + offs_m[:, None]).to(tl.int64) * N + offs_n[None, :]
        tl.store(p_ptrs, acc, mask=mmask[:, None] & nmask[None, :])
        return
    if HAS_GLOBAL:
        acc = acc * tl.load(g_ptr + offs_n * sgn, mask=nmask, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    o_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * som + offs_n[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


@triton.jit
def _w4a16_reduce_kernel(ws_ptr, g_ptr, b_ptr, out_ptr, M, N, sgn, som, SPLIT_K: tl.constexpr,
                         HAS_GLOBAL: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """out[m, n] = sum_s ws[s, m, n] (split order: deterministic) * g[n] + bias[n]."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for sk in tl.static_range(SPLIT_K):
        acc += tl.load(ws_ptr + sk * M * N + offs, mask=mask, other=0.0)
    n = offs % N
    if HAS_GLOBAL:
        acc = acc * tl.load(g_ptr + n * sgn, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + (offs // N).to(tl.int64) * som + n, acc.to(out_ptr.dtype.element_ty), mask=mask)


def w4a16_config(m: int, n: int, k: int, dtype: torch.dtype, sms: int = DEFAULT_NUM_SMS) -> dict:
    """Tiles by row count. Decode (<= 16 rows) is a weight stream: narrow column tiles and, when
    those leave SMs idle, a split of K (``SPLIT_K``, at least 4 K tiles a split) so that about four
    programs per SM keep loads in flight; it depends on N, K and the SM count only, never on the
    batch. Prefill: 128x128 tiles, 8 warps, a cp.async pipeline feeding Hopper's warp-group MMA.
    fp32 (exact products on CUDA cores): small tiles."""
    if dtype == torch.float32:
        return dict(BLOCK_M=16 if m <= 16 else 32, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=2, SPLIT_K=1)
    if m <= 16:
        tiles, k_tiles = triton.cdiv(n, 32), triton.cdiv(k, 128)
        split = max(1, min(k_tiles // 4, triton.cdiv(4 * sms, tiles), 16))
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=4, SPLIT_K=split)
    if m <= 64:
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4, SPLIT_K=1)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3, SPLIT_K=1)


def even_block_k(block_k: int, k: int, group: int) -> int:
    """The largest K tile <= ``block_k`` (halving, not below 32 or the scale group) that divides K,
    so the loads need no K mask (cp.async); ``block_k`` itself when none does."""
    bk = block_k
    while k % bk and bk // 2 >= max(32, group):
        bk //= 2
    return bk if k % bk == 0 else block_k


def _w4a16_gemm_triton(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    global_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    codec: str,
    in_features: int,
    *,
    config: dict | None = None,
) -> torch.Tensor:
    """See ``w4a16_gemm_ref``. ``config`` overrides ``w4a16_config`` (benchmark sweeps)."""
    check_device(x)
    check_w4(qweight, scales, codec, in_features)
    if x.shape[-1] != in_features:
        raise ValueError(f"input has {x.shape[-1]} features, the weight {in_features}")
    n = qweight.shape[0]
    shape = x.shape
    x2 = x.reshape(-1, in_features)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = x2.new_empty(m, n)
    if m == 0 or n == 0:
        return out.view(*shape[:-1], n)
    if qweight.stride(-1) != 1:
        qweight = qweight.contiguous()
    sc = scales.view(torch.uint8) if scales.dtype == torch.float8_e4m3fn else scales
    if sc.stride(-1) != 1:
        sc = sc.contiguous()
    cfg = w4a16_config(m, n, in_features, x.dtype, num_sms(x.device))
    cfg["BLOCK_K"] = even_block_k(cfg["BLOCK_K"], in_features, GROUP_SIZE[codec])
    cfg.update(config or {})
    split = cfg["SPLIT_K"]
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]), split)
    ws = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else out
    g = global_scale.reshape(-1).float().contiguous() if global_scale is not None else sc
    if global_scale is not None and g.numel() not in (1, n):
        raise ValueError(f"global_scale must have 1 or {n} elements, got {g.numel()}")
    b = bias if bias is not None else sc
    _w4a16_kernel[grid](
        x2, qweight, sc, g, b, out, ws, m, n, in_features, x2.stride(0), qweight.stride(0), sc.stride(0),
        int(g.numel() > 1), out.stride(0),
        CODEC=CODECS.index(codec), GROUP=GROUP_SIZE[codec], HAS_GLOBAL=global_scale is not None,
        HAS_BIAS=bias is not None, GROUP_M=8, DOT_PREC=dot_precision(x.dtype),
        EVEN_K=in_features % cfg["BLOCK_K"] == 0, **cfg,
    )
    if split > 1:
        _w4a16_reduce_kernel[(triton.cdiv(m * n, 1024),)](
            ws, g, b, out, m, n, int(g.numel() > 1), out.stride(0), SPLIT_K=split,
            HAS_GLOBAL=global_scale is not None, HAS_BIAS=bias is not None, BLOCK=1024, num_warps=4,
        )
    return out.view(*shape[:-1], n)


w4a16_gemm = kernel_op(
    "w4a16_gemm", _w4a16_gemm_triton, w4a16_gemm_ref,
    lambda x, qweight, *_: x.new_empty(*x.shape[:-1], qweight.shape[0]),
    doc="x [..., K] times a 4-bit packed [N, K] weight; see the module docstring.",
)


# The eager entry point layers call: the custom op under ``torch.compile``, else by the dispatch rule
# the Triton kernel, the C kernel (``kernels/cpu/w4a16.c``: packed weights decoded a row at a time) or
# the reference (skipping the custom-op dispatcher).
w4a16_linear = eager_op(w4a16_gemm, w4a16_gemm_ref, w4a16_native, triton_fn=_w4a16_gemm_triton)
