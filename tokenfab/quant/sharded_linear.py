"""What the quantized linears (``FP8Linear``, ``W4Linear``) share: output rows made of merged shards
(q/k/v, gate/up), each shard's tensors arriving on their own; this rank's part of each full checkpoint
tensor at tensor parallel (``tp_split``, ``_tp_part``); a bias; a row-parallel layer's all-reduce.

A subclass keeps its own buffers and checks: ``_load_rows`` takes one tensor (this rank's part) into
output rows ``lo:hi``; the bias, the shard bookkeeping and ``mark`` are done here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tokenfab.distributed.parallel_state import tp_all_reduce
from tokenfab.quant.base import QuantizedModule, check_shape


class ShardedQuantLinear(QuantizedModule):
    tp_split = None  # layers.tp_split.TPSplit at TP > 1 (copied from the layer replaced, loader/quant_apply.py)
    reduce_output = False
    bias: torch.Tensor | None

    def _set_shards(self, in_features: int, shard_sizes: Sequence[int]) -> list[int | None]:
        """Record the shard layout; returns the shard indices each tensor is expected for."""
        self.in_features, self.shard_sizes = in_features, list(shard_sizes)
        self.out_features = sum(self.shard_sizes)
        self.offsets = [sum(self.shard_sizes[:i]) for i in range(len(self.shard_sizes))]
        return list(range(len(self.shard_sizes))) if len(self.shard_sizes) > 1 else [None]

    def _rows(self, shard: int | None) -> tuple[int, int]:
        if shard is None:
            if len(self.shard_sizes) > 1:
                raise ValueError("a merged projection's tensor arrived without its shard index")
            return 0, self.out_features
        if not 0 <= shard < len(self.shard_sizes):
            raise ValueError(f"shard {shard} out of range 0..{len(self.shard_sizes) - 1}")
        return self.offsets[shard], self.offsets[shard] + self.shard_sizes[shard]

    def _tp_part(self, suffix: str, t: torch.Tensor, shard: int | None) -> torch.Tensor:
        raise NotImplementedError

    def _load_rows(self, suffix: str, tensor: torch.Tensor, lo: int, hi: int) -> bool:
        """Take ``tensor`` (suffix ``suffix``) into output rows ``lo:hi``; False: not a tensor of this layer."""
        raise NotImplementedError

    def load_quantized(self, suffix: str, tensor: torch.Tensor, shard: int | None) -> bool:
        if self.tp_split is not None:
            tensor = self._tp_part(suffix, tensor, shard)
        lo, hi = self._rows(shard)
        if suffix == "bias" and self.bias is not None:
            check_shape("bias", tensor, (hi - lo,))
            self.bias[lo:hi].copy_(tensor)
        elif not self._load_rows(suffix, tensor, lo, hi):
            return False
        self.mark(suffix, shard)
        return True

    def _reduced(self, y: torch.Tensor) -> torch.Tensor:
        """A row-parallel layer's partial sums all-reduced over the TP group."""
        return tp_all_reduce(y) if self.reduce_output else y
