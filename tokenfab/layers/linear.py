"""Linear layers, including the merged ones (qkv, gate_up) that load several checkpoint
tensors into row ranges of one weight so a layer does one matrix product instead of three.

On CPU in float32 a weight may also be kept pre-packed for MKL (``prepack_cpu_linears``):
MKL's packed GEMM skips re-packing the weight on every call, which is 25-45% of the time of
the skinny (decode-sized, 16-64 row) products that dominate a CPU decode step. The packed copy
costs as much memory again as the weights, so the engine only packs models that fit easily.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# above this many rows (prefill chunks) the unpacked product is as fast or faster
PACKED_MAX_ROWS = 1024


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: torch.Tensor | None) -> torch.Tensor:
    """F.linear, through MKL's packed GEMM when a packed copy of ``weight`` exists."""
    shape = x.shape
    if packed is None or x.numel() > PACKED_MAX_ROWS * shape[-1] or torch.compiler.is_compiling():
        return F.linear(x, weight, bias)
    x2 = x.reshape(-1, shape[-1])
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    # the packed weight serves any row count; passing the actual count selects the packed path
    out = torch.ops.mkl._mkl_linear(x2, packed, weight, bias, x2.shape[0])
    return out.view(*shape[:-1], weight.shape[0])


class Linear(nn.Module):
    packed_weight: torch.Tensor | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed_weight)


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


def mkl_packing_available() -> bool:
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")


def prepack_cpu_linears(model: nn.Module) -> int:
    """Give every float32 CPU module with a 2-D ``weight`` and a ``packed_weight`` slot (Linear,
    LMHead) an MKL-packed copy of it. Returns the bytes of weight packed (0 when MKL is absent)."""
    if not mkl_packing_available():
        return 0
    packed = 0
    for m in model.modules():
        w = getattr(m, "weight", None)
        if not hasattr(type(m), "packed_weight") or w is None or w.dim() != 2:
            continue
        if w.device.type != "cpu" or w.dtype != torch.float32:
            continue
        # the row-count hint only tunes the packing; 64 is a typical decode batch
        m.packed_weight = torch.ops.mkl._mkl_reorder_linear_weight(w.detach().contiguous(), 64)
        packed += w.numel() * w.element_size()
    return packed
