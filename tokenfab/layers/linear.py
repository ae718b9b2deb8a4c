"""Linear layers, including the merged ones (qkv, gate_up) that load several checkpoint
tensors into row ranges of one weight so a layer does one matrix product instead of three."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output dim.

    ``shard_sizes`` gives each projection's rows; ``load_shard(i, w)`` copies checkpoint
    tensor ``w`` (weight or bias) into the rows of shard ``i``.
    """

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool = False) -> None:
        super().__init__(in_features, sum(shard_sizes), bias)
        self.shard_sizes = list(shard_sizes)

    def shard_range(self, i: int) -> tuple[int, int]:
        start = sum(self.shard_sizes[:i])
        return start, start + self.shard_sizes[i]
