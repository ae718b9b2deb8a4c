"""Linear layers, including the merged ones (qkv, gate_up) that load several checkpoint
tensors into row ranges of one weight so a layer does one matrix product instead of three.

On CPU a weight may also be kept pre-packed (``prepack_cpu_linears``), so that the GEMM does not
re-pack it on every call:
- float32: MKL's packed GEMM; re-packing was 25-45% of the time of the skinny (decode-sized,
  16-64 row) products that dominate a CPU decode step.
- bfloat16: oneDNN's packed (blocked) weight layout, the one its AMX/AVX-512 kernels read; the
  plain F.linear copies the weight into that layout on every call. Same results bit for bit,
  1.7x faster at 64 rows, 2.7x at one row.
The packed copy costs as much memory again as the weights, so the engine only packs models that
fit easily.

Batch-invariant mode (``set_batch_invariant``, ``TOKENFAB_BATCH_INVARIANT=1``): MKL's sgemm rounds
a row differently depending on how many rows are multiplied with it (a few rows take another
kernel), so a speculative verify row would not equal the decode row of the same token. In this
mode every CPU float32 linear goes through ``kernels.cpu.matmul_f32`` (row r's result never depends
on the other rows); speculative decoding turns it on. The packed GGUF layers (``ggml_linear``) are
row-invariant always.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from tokenfab.distributed.parallel_state import tp_all_reduce
from tokenfab.kernels.cpu import matmul_f32
from tokenfab.layers.tp_split import TPSplit, column_split, qkv_split, row_split

# above this many rows (prefill chunks) the unpacked float32 product is as fast or faster
PACKED_MAX_ROWS = 1024

_batch_invariant = os.environ.get("TOKENFAB_BATCH_INVARIANT", "0").lower() in ("1", "true", "yes")


def batch_invariant() -> bool:
    """Whether CPU float32 linears run the row-invariant kernel (see the module docstring)."""
    return _batch_invariant


def set_batch_invariant(on: bool) -> bool:
    """Turn batch-invariant float32 linears on or off (process-wide); returns the previous setting."""
    global _batch_invariant
    old, _batch_invariant = _batch_invariant, bool(on)
    return old


@contextlib.contextmanager
def batch_invariant_mode(on: bool = True) -> Iterator[None]:
    """``set_batch_invariant(on)`` for the duration of a ``with`` block (tests, benchmarks)."""
    old = set_batch_invariant(on)
    try:
        yield
    finally:
        set_batch_invariant(old)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: torch.Tensor | None) -> torch.Tensor:
    """F.linear, through a packed GEMM when a packed copy of ``weight`` exists, or through the
    row-invariant kernel in batch-invariant mode."""
    if (_batch_invariant and x.dtype == torch.float32 and x.device.type == "cpu" and matmul_f32.supports(x, weight)
            and not torch.compiler.is_compiling()):
        return matmul_f32.matmul_f32_rowinv(x, weight, bias)
    shape = x.shape
    if packed is None or torch.compiler.is_compiling():
        return F.linear(x, weight, bias)
    is_f32 = weight.dtype == torch.float32
    if is_f32 and x.numel() > PACKED_MAX_ROWS * shape[-1]:
        return F.linear(x, weight, bias)
    x2 = x.reshape(-1, shape[-1])
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    if is_f32:
        # the packed weight serves any row count; passing the actual count selects the packed path
        out = torch.ops.mkl._mkl_linear(x2, packed, weight, bias, x2.shape[0])
    else:
        out = torch.ops.mkldnn._linear_pointwise(x2, packed, bias, "none", [], "")
    return out.view(*shape[:-1], weight.shape[0])


class Linear(nn.Module):
    """``y = x W^T + b``. ``parallel`` ("column" / "row") builds it tensor-parallel when the TP size
    is above 1 (layers.tp_split): the weight is this rank's rows / input columns, ``tp_split`` says
    which part of the full checkpoint tensor the loader keeps, and a row-parallel layer all-reduces
    its output. At TP 1 the layer is the plain one (no split, no collective)."""

    packed_weight: torch.Tensor | None = None
    tp_split: TPSplit | None = None
    reduce_output: bool = False  # row-parallel at TP > 1: sum the partial products over the TP group

    def __init__(self, in_features: int, out_features: int, bias: bool = False, parallel: str | None = None) -> None:
        super().__init__()
        if parallel not in (None, "column", "row"):
            raise ValueError(f"parallel must be None, 'column' or 'row', not {parallel!r}")
        if parallel == "column":
            self.tp_split = column_split([out_features])
        elif parallel == "row":
            self.tp_split = row_split(in_features)
        if self.tp_split is not None:
            if self.tp_split.dim == 0:
                out_features = self.tp_split.local_sizes()[0]
            else:
                in_features, self.reduce_output = self.tp_split.local_sizes()[0], True
        self._init(in_features, out_features, bias)

    def _init(self, in_features: int, out_features: int, bias: bool) -> None:
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, self.bias, self.packed_weight)
        return tp_all_reduce(y) if self.reduce_output else y


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output dim.

    ``shard_sizes`` gives each projection's rows; ``load_shard(i, w)`` copies checkpoint
    tensor ``w`` (weight or bias) into the rows of shard ``i``. ``parallel="column"`` splits each
    projection over the TP ranks (``shard_sizes`` then holds the local sizes); ``split`` gives
    another split of the shards (QKV's head ranges: :func:`qkv_linear`).
    """

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool = False, parallel: str | None = None,
                 split: TPSplit | None = None) -> None:
        nn.Module.__init__(self)
        if parallel not in (None, "column"):
            raise ValueError(f"a merged projection is column-parallel or not split, not {parallel!r}")
        self.tp_split = split if split is not None else column_split(list(shard_sizes)) if parallel else None
        if self.tp_split is not None:
            shard_sizes = self.tp_split.local_sizes()
        self.shard_sizes = list(shard_sizes)
        self._init(in_features, sum(self.shard_sizes), bias)

    def shard_range(self, i: int) -> tuple[int, int]:
        start = sum(self.shard_sizes[:i])
        return start, start + self.shard_sizes[i]


def qkv_linear(hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False
               ) -> MergedLinear:
    """The merged q/k/v projection, tensor-parallel by heads at TP > 1 (layers.tp_split.qkv_split)."""
    q, kv = num_heads * head_dim, num_kv_heads * head_dim
    return MergedLinear(hidden_size, [q, kv, kv], bias=bias, split=qkv_split(head_dim, num_heads, num_kv_heads))


def mkl_packing_available() -> bool:
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")


def onednn_bf16_packing_available() -> bool:
    try:
        return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
                and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))
    except (AttributeError, RuntimeError):
        return False


def pack_weight(w: torch.Tensor) -> torch.Tensor | None:
    """The packed copy of a CPU float32 (MKL) or bfloat16 (oneDNN) weight, or None when this torch
    build cannot pack it."""
    if w.device.type != "cpu" or w.dim() != 2:
        return None
    w = w.detach().contiguous()
    # the row-count hint only tunes the packing; 64 is a typical decode batch
    if w.dtype == torch.float32 and mkl_packing_available():
        return torch.ops.mkl._mkl_reorder_linear_weight(w, 64)
    if w.dtype == torch.bfloat16 and onednn_bf16_packing_available():
        return torch.ops.mkldnn._reorder_linear_weight(w, 64)
    return None


def prepack_cpu_linears(model: nn.Module) -> int:
    """Give every CPU float32/bfloat16 module with a 2-D ``weight`` and a ``packed_weight`` slot
    (Linear, LMHead) a packed copy of it. Returns the bytes of weight packed (0 when this torch
    build cannot pack)."""
    packed = 0
    for m in model.modules():
        w = getattr(m, "weight", None)
        if not hasattr(type(m), "packed_weight") or w is None:
            continue
        copy = pack_weight(w)
        if copy is not None:
            m.packed_weight = copy
            packed += w.numel() * w.element_size()
    return packed
