"""A linear layer with 4-bit packed weights (W4A16): compressed-tensors INT4 or ModelOpt NVFP4.

The weight stays as the checkpoint stores it: ``qweight`` uint8 [N, ceil(K/2)] (two codes a
byte, low nibble first: compressed-tensors' int32 words are exactly these bytes, little-endian),
``scales`` [N, ceil(K/G)] (INT4: the checkpoint's float scales in the model dtype, G = 32;
NVFP4: E4M3 bits as uint8, G = 16) and, for NVFP4, ``global_scale`` float32 [N] (each merged
shard's ``weight_scale_2`` on its rows). ``forward`` is ``kernels.w4a16``'s GEMM: the weights are
dequantized in registers on GPU, one layer per call on CPU, never stored in full precision.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from tokenfab.kernels.w4a16 import GROUP_SIZE, dequantize_w4, w4a16_linear
from tokenfab.quant.base import check_shape
from tokenfab.quant.sharded_linear import ShardedQuantLinear


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


class W4Linear(ShardedQuantLinear):
    """``y = x @ dequant(qweight, scales).T * global_scale + bias``; see the module docstring.
    Tensor parallel: ``tp_split`` / ``reduce_output`` as on the layer it replaces (loader/quant_apply.py)."""

    def __init__(self, in_features: int, shard_sizes: Sequence[int], bias: bool, dtype: torch.dtype,
                 codec: str) -> None:
        super().__init__()
        if codec not in ("int4", "nvfp4"):
            raise ValueError(f"W4Linear codec must be int4 or nvfp4, not {codec!r}")
        shards = self._set_shards(in_features, shard_sizes)
        self.codec, self.dtype = codec, dtype
        n, k, g = self.out_features, in_features, GROUP_SIZE[codec]
        self.register_buffer("qweight", torch.zeros(n, _cdiv(k, 2), dtype=torch.uint8))
        self.register_buffer("scales", torch.zeros(n, _cdiv(k, g), dtype=dtype if codec == "int4" else torch.uint8))
        self.register_buffer("global_scale", torch.ones(n, dtype=torch.float32) if codec == "nvfp4" else None)
        self.register_buffer("bias", torch.zeros(n, dtype=dtype) if bias else None)
        wanted = ["weight_packed", "weight_scale"] if codec == "int4" else ["weight", "weight_scale", "weight_scale_2"]
        self.expect(wanted + (["bias"] if bias else []), shards)

    def _tp_part(self, suffix: str, t: torch.Tensor, shard: int | None) -> torch.Tensor:
        """Tensor parallel: this rank's part of a full checkpoint tensor. Column-parallel: its rows;
        row-parallel: its K range in whole scale groups (INT4: 32, NVFP4: 16 values; the packed words
        and bytes follow)."""
        split, g = self.tp_split, GROUP_SIZE[self.codec]
        if suffix == "bias":
            return split.take_bias(t, shard)
        if suffix == "weight_shape":  # the full [N, K]: checked here, then this rank's
            full_rows, full_k = (split.full[shard or 0], self.in_features) if split.dim == 0 else \
                (self.out_features, split.full[0])
            if [int(v) for v in t.reshape(-1)] != [full_rows, full_k]:
                raise ValueError(f"weight_shape is {t.tolist()}, the full layer is [{full_rows}, {full_k}]")
            lo, hi = self._rows(shard)
            return torch.tensor([hi - lo, self.in_features], dtype=torch.int32)
        packed = {"weight_packed": 8, "weight": 2}.get(suffix)  # values per stored entry
        if packed is not None or suffix == "weight_scale":
            if split.dim == 0:
                return split.take(t, shard, what=suffix)
            if packed is not None:  # whole scale groups of the K range, in stored entries
                split.check_blocks(g, shard, what=suffix)
                return split.take(t, shard, unit=packed, what=suffix)
            return split.take(t, shard, unit=g, what=suffix)
        return t  # weight_scale_2, input_scale: one value

    def _load_rows(self, suffix: str, tensor: torch.Tensor, lo: int, hi: int) -> bool:
        rows, k = hi - lo, self.in_features
        if self.codec == "int4" and suffix == "weight_packed":
            if tensor.dtype != torch.int32:
                raise ValueError(f"weight_packed must be int32, got {tensor.dtype}")
            check_shape("weight_packed", tensor, (rows, _cdiv(k, 8)))
            self.qweight[lo:hi].copy_(tensor.contiguous().view(torch.uint8)[:, : _cdiv(k, 2)])
        elif self.codec == "int4" and suffix == "weight_scale":
            check_shape("weight_scale", tensor, (rows, _cdiv(k, 32)))
            self.scales[lo:hi].copy_(tensor)
        elif self.codec == "int4" and suffix == "weight_shape":
            if [int(v) for v in tensor.reshape(-1)] != [rows, k]:
                raise ValueError(f"weight_shape is {tensor.tolist()}, the layer is [{rows}, {k}]")
        elif self.codec == "nvfp4" and suffix == "weight":
            if tensor.dtype != torch.uint8:
                raise ValueError(f"is stored as {str(tensor.dtype).removeprefix('torch.')}, but NVFP4 weights are "
                                 "uint8 (two E2M1 codes a byte)")
            check_shape("weight", tensor, (rows, _cdiv(k, 2)))
            self.qweight[lo:hi].copy_(tensor)
        elif self.codec == "nvfp4" and suffix == "weight_scale":
            if tensor.dtype != torch.float8_e4m3fn:
                raise ValueError(f"NVFP4 weight_scale must be float8_e4m3fn, got {tensor.dtype}")
            check_shape("weight_scale", tensor, (rows, _cdiv(k, 16)))
            self.scales[lo:hi].copy_(tensor.view(torch.uint8))
        elif self.codec == "nvfp4" and suffix == "weight_scale_2":
            if tensor.numel() != 1:
                raise ValueError(f"weight_scale_2 must be one value, got shape {tuple(tensor.shape)}")
            self.global_scale[lo:hi] = tensor.float().reshape(())
        elif self.codec == "nvfp4" and suffix == "input_scale":
            pass  # the activation scale of FP4 activations: W4A16 keeps activations in 16 bits
        else:
            return False
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = w4a16_linear(x, self.qweight, self.scales, self.global_scale, self.bias, self.codec, self.in_features)
        return self._reduced(y)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight, computed on each access (for layers that read ``.weight``); never stored."""
        w = dequantize_w4(self.qweight, self.scales, self.codec, self.in_features)
        if self.global_scale is not None:
            w = w * self.global_scale[:, None]
        return w.to(self.dtype)

    def num_weight_params(self) -> int:
        return self.out_features * self.in_features

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.shard_sizes}, codec={self.codec}"


def w4_linear_like(linear: nn.Module, codec: str) -> W4Linear:
    """A W4Linear with ``linear``'s shape (a Linear or a MergedLinear) and dtype."""
    shards = getattr(linear, "shard_sizes", None) or [linear.out_features]
    return W4Linear(linear.in_features, shards, linear.bias is not None, linear.weight.dtype, codec)
