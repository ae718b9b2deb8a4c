"""A plain-torch stand-in for ``kernels.cpu.ggml_matmul`` (same signatures), used only while that
module is absent: dequantize the packed rows, then matmul. Slow (dequantizes every call)."""

from __future__ import annotations

import torch

_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    return blocks[..., start:start + 2].contiguous().view(torch.float16).float()


def dequantize_packed(w: torch.Tensor, qtype: str, k: int) -> torch.Tensor:
    """uint8 ``[N, K/32*block_bytes]`` -> float32 ``[N, K]`` (the gguf dequantizer's arithmetic)."""
    if qtype not in _BLOCK_BYTES:
        raise ValueError(f"unsupported ggml type {qtype!r}")
    if k % 32:
        raise ValueError(f"K must be a multiple of 32, got {k}")
    blocks = w.view(w.shape[0], k // 32, _BLOCK_BYTES[qtype])
    if qtype == "Q8_0":
        return (blocks[..., 2:].contiguous().view(torch.int8).float() * _f16(blocks, 0)).view(-1, k)
    qs = blocks[..., 4:] if qtype == "Q4_1" else blocks[..., 2:]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).float()
    if qtype == "Q4_0":
        return ((q - 8) * _f16(blocks, 0)).view(-1, k)
    return (q * _f16(blocks, 0) + _f16(blocks, 2)).view(-1, k)


def _quantize_act_q8(x: torch.Tensor) -> torch.Tensor:
    """x with each 32-block rounded to int8 steps of amax/127 (scale rounded to float16)."""
    b = x.view(x.shape[0], -1, 32)
    d = (b.abs().amax(-1, keepdim=True) / 127).half().float()
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return (torch.round(b * inv).clamp(-127, 127) * d).view_as(x)


def ggml_matmul(x: torch.Tensor, w: torch.Tensor, qtype: str, k: int, *, act: str = "f32") -> torch.Tensor:
    if act == "q8":
        x = _quantize_act_q8(x)
    return x @ dequantize_packed(w, qtype, k).T


def ggml_dequantize_rows(w: torch.Tensor, qtype: str, k: int, rows: torch.Tensor) -> torch.Tensor:
    return dequantize_packed(w.index_select(0, rows), qtype, k)
