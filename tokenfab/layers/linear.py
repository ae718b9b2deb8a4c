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

Batch-invariant mode (``kernels.batch_invariant``: the runner's forward of an engine with
speculative decoding, ``batch_invariant_mode`` in tests, ``TOKENFAB_BATCH_INVARIANT=1``): MKL's
sgemm and cuBLAS round a row differently depending on how many rows are multiplied with it (they
pick another kernel), so a speculative verify row would not equal the decode row of the same
token. In this mode CPU float32 linears go through ``kernels.cpu.matmul_f32`` and CUDA (Triton)
linears through ``kernels.matmul_invariant`` (row r's result never depends on the other rows).
The packed GGUF layers (``ggml_linear``) are row-invariant always; CPU bfloat16 (oneDNN) is not.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenfab.distributed.parallel_state import tp_all_reduce
from tokenfab.kernels import matmul_invariant
from tokenfab.kernels._dispatch import backend
from tokenfab.kernels.batch_invariant import batch_invariant, batch_invariant_mode  # noqa: F401 (re-exported)
from tokenfab.kernels.cpu import matmul_f32
from tokenfab.layers.tp_split import TPSplit, column_split, qkv_split, row_split

# above this many rows (prefill chunks) the unpacked float32 product is as fast or faster
PACKED_MAX_ROWS = 1024


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """The row-invariant product (batch-invariant mode) by the dispatch rule: the Triton kernel where
    Triton runs (CUDA, ``TOKENFAB_KERNELS=triton``), the C kernel for CPU float32; None where neither
    takes the tensors (CPU bfloat16, the reference mode)."""
    where = backend(x)
    if where == "triton":
        if x.dtype in matmul_invariant.SUPPORTED_DTYPES and weight.dtype == x.dtype:
            return matmul_invariant._matmul_invariant_triton(x, weight, bias)
    elif x.device.type == "cpu" and matmul_f32.supports(x, weight):
        return matmul_f32.matmul_f32_rowinv(x, weight, bias)
    return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: torch.Tensor | None) -> torch.Tensor:
    """F.linear, through a packed GEMM when a packed copy of ``weight`` exists, or through a
    row-invariant kernel in batch-invariant mode."""
    if not torch.compiler.is_compiling() and batch_invariant():
        out = invariant_linear(x, weight, bias)
        if out is not None:
            return out
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
