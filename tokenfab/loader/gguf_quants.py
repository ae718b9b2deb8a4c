"""Dequantizing GGUF tensors to float32: our own numpy decoders for Q8_0/Q4_0/Q4_1 (chunked to bound
temporaries) and gguf's decoders for the other block types (split from ``gguf.py``)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

if TYPE_CHECKING:
    pass

# Types dequantized here; the others that `gguf.quants` can dequantize are passed to it.
_OWN_TYPES = (QT.F32, QT.F16, QT.BF16, QT.F64, QT.Q8_0, QT.Q4_0, QT.Q4_1)
_NOT_WEIGHTS = (QT.I8, QT.I16, QT.I32, QT.I64)
_CHUNK_ELEMENTS = 1 << 22  # block formats are decoded this many values at a time, bounding temporaries

# --------------------------------------------------------------------------------------------
# Dequantization
# --------------------------------------------------------------------------------------------


def _f16_column(blocks: np.ndarray, start: int) -> np.ndarray:
    """The little-endian float16 at byte `start` of each block, as a float32 column."""
    return blocks[:, start : start + 2].view(np.float16).astype(np.float32)


def _q8_0(blocks: np.ndarray, out: np.ndarray) -> None:
    # block: f16 scale d, then 32 int8 q; value = q * d
    np.multiply(blocks[:, 2:].view(np.int8), _f16_column(blocks, 0), out=out)


def _q4_0(blocks: np.ndarray, out: np.ndarray) -> None:
    # block: f16 scale d, then 16 bytes; value j < 16 is the low nibble of byte j, value j >= 16
    # the high nibble of byte j - 16; value = (nibble - 8) * d
    qs = blocks[:, 2:]
    out[:, :16] = (qs & 0x0F).view(np.int8) - np.int8(8)
    out[:, 16:] = (qs >> 4).view(np.int8) - np.int8(8)
    out *= _f16_column(blocks, 0)


def _q4_1(blocks: np.ndarray, out: np.ndarray) -> None:
    # block: f16 scale d, f16 minimum m, then 16 bytes of nibbles as in Q4_0; value = nibble * d + m
    qs = blocks[:, 4:]
    out[:, :16] = qs & 0x0F
    out[:, 16:] = qs >> 4
    out *= _f16_column(blocks, 0)
    out += _f16_column(blocks, 2)


_BLOCK_DECODERS = {QT.Q8_0: _q8_0, QT.Q4_0: _q4_0, QT.Q4_1: _q4_1}


@functools.cache
def supports_ggml_type(ggml_type: QT) -> bool:
    """Whether :func:`dequantize` handles this ggml type (ours, or one `gguf.quants` decodes)."""
    if ggml_type in _OWN_TYPES:
        return True
    if ggml_type in _NOT_WEIGHTS or ggml_type not in gguf.GGML_QUANT_SIZES:
        return False
    _, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    try:
        gguf.quants.dequantize(np.zeros((1, type_size), dtype=np.uint8), ggml_type)
    except Exception:  # NotImplementedError, or whatever a half-implemented type trips over
        return False
    return True


def dequantize(data: np.ndarray, ggml_type: QT | int, shape: Sequence[int]) -> np.ndarray:
    """A tensor's stored bytes (as `GGUFReader` exposes them) -> a new float32 array of `shape`.

    `shape` is in torch order (outermost first), the reverse of GGUF's dimension list. The result
    is always a fresh, writable array, never a view of the file.
    """
    ggml_type = QT(ggml_type)
    shape = tuple(int(d) for d in shape)
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    if ggml_type == QT.F32:
        return raw.view("<f4").reshape(shape).copy()
    if ggml_type == QT.F16:
        return raw.view("<f2").astype(np.float32).reshape(shape)
    if ggml_type == QT.F64:
        return raw.view("<f8").astype(np.float32).reshape(shape)
    if ggml_type == QT.BF16:
        # bfloat16 is the top half of a float32
        wide = raw.view("<u2").astype(np.uint32)
        wide <<= 16
        return wide.view(np.float32).reshape(shape)
    block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    blocks = raw.reshape(-1, type_size)
    decoder = _BLOCK_DECODERS.get(ggml_type)
    if decoder is not None:
        out = np.empty((blocks.shape[0], block_size), dtype=np.float32)
        step = max(1, _CHUNK_ELEMENTS // block_size)
        for start in range(0, blocks.shape[0], step):
            decoder(blocks[start : start + step], out[start : start + step])
        return out.reshape(shape)
    # Everything else (K-quants, IQ-quants, Q5_x, ...): gguf's own numpy decoders.
    row_bytes = shape[-1] // block_size * type_size if shape else type_size
    values = gguf.quants.dequantize(raw.reshape(-1, row_bytes), ggml_type)
    return np.ascontiguousarray(values, dtype=np.float32).reshape(shape)

