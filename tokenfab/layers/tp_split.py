"""How a tensor-parallel layer keeps its part of a full checkpoint tensor.

The loader hands every layer the *full* checkpoint tensor; a layer built for TP > 1 carries a
:class:`TPSplit` (``layer.tp_split``) and keeps only its rank's slice, so no rank ever holds
another rank's weights beyond the one tensor being read. At TP 1 layers carry no split and load
exactly as before.

- column-parallel (``dim`` 0): the output rows are split. A merged projection (qkv, gate/up) splits
  each checkpoint shard separately (``ranges[i]`` is shard i's row range on this rank); QKV's K/V
  rows are a KV head range, replicated when TP exceeds the KV heads. A range past the end of the
  tensor is zero-padded (the vocabulary-parallel embedding and LM head).
- row-parallel (``dim`` 1): the input columns (K) are split; the partial products are summed by
  one all-reduce after the layer, and the bias is held by rank 0 only (the others hold zeros), so
  the sum adds it once whatever the layer's kernel (plain, FP8, INT4, GGUF packed).

Quantized layouts slice the same ranges in their own units (``take(..., unit, width)``: ``unit``
logical elements per ``width`` stored entries): a 128x128 FP8 scale grid in units of 128, INT4's
int32 words in units of 8, INT4 scales in groups of 32, GGUF rows in 32-element blocks of
``block_bytes``. A range that does not fall on those boundaries is a ValueError naming them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenfab.distributed.parallel_state import get_parallel_state


class TPSplitError(ValueError):
    """A model that cannot be split at this tensor parallel size (heads or features that do not divide)."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class TPSplit:
    dim: int  # 0: column-parallel (output rows split), 1: row-parallel (input columns split)
    ranges: tuple[tuple[int, int], ...]  # per checkpoint shard: this rank's [start, end) along dim
    full: tuple[int, ...]  # per checkpoint shard: the full checkpoint size along dim
    rank: int
    size: int

    @property
    def reduce_output(self) -> bool:
        return self.dim == 1

    def local_sizes(self) -> list[int]:
        return [hi - lo for lo, hi in self.ranges]

    def take(self, t: torch.Tensor, shard: int | None = None, unit: int = 1, width: int = 1,
             what: str = "tensor") -> torch.Tensor:
        """This rank's part of the full checkpoint tensor ``t`` of shard ``shard``, along ``dim``,
        where every ``unit`` logical elements take ``width`` entries of ``t`` (1, 1 for plain weights)."""
        lo, hi = self.ranges[shard or 0]
        full = self.full[shard or 0]
        d = self.dim if t.dim() > 1 else 0
        if self.dim == 1 and t.dim() < 2:
            raise ValueError(f"{what}: a 1-D tensor of a row-parallel layer is not split (use take_bias)")
        self.check_blocks(unit, shard, what)
        expected = _cdiv(full, unit) * width
        if t.shape[d] != expected:
            raise ValueError(f"{what} has {t.shape[d]} entries along dim {d}, expected {expected} "
                             f"(the full checkpoint tensor)")
        a = min(lo // unit, _cdiv(full, unit)) * width
        b = max(a, min(_cdiv(hi, unit), _cdiv(full, unit)) * width)
        part = t.narrow(d, a, b - a)
        want = _cdiv(hi - lo, unit) * width
        if part.shape[d] < want:  # padding past the end (vocabulary rows)
            pad = [0, 0] * (t.dim() - 1 - d) + [0, want - part.shape[d]]
            part = F.pad(part, pad)
        return part

    def check_blocks(self, unit: int, shard: int | None = None, what: str = "tensor") -> None:
        """A ValueError unless this rank's range of ``shard`` falls on ``unit``-element blocks."""
        lo, hi = self.ranges[shard or 0]
        if unit > 1 and (lo % unit or (hi % unit and hi < self.full[shard or 0])):
            axis = "rows" if self.dim == 0 else "input columns"
            raise ValueError(f"{what}: tensor parallel rank {self.rank} of {self.size} holds {axis} [{lo}, {hi}), "
                             f"which does not fall on the format's {unit}-element blocks")

    def take_bias(self, t: torch.Tensor, shard: int | None = None) -> torch.Tensor:
        """A bias: column-parallel, its rows; row-parallel, whole on rank 0, zeros elsewhere."""
        if self.dim == 0:
            return self.take(t, shard, what="bias")
        return t if self.rank == 0 else torch.zeros_like(t)

    def take_param(self, suffix: str, t: torch.Tensor, shard: int | None = None) -> torch.Tensor:
        """A plain (float) parameter ``suffix`` of the layer: its bias or its weight rows/columns."""
        if suffix == "bias":
            return self.take_bias(t, shard)
        return self.take(t, shard, what=suffix)


def tp_rank_size() -> tuple[int, int]:
    s = get_parallel_state()
    return s.tp_rank, s.tp_size


def _split(n: int, tp: int, what: str) -> int:
    if n % tp:
        raise TPSplitError(f"{what} ({n}) do not divide by the tensor parallel size {tp}")
    return n // tp


def local_heads(num_heads: int) -> int:
    """This rank's number of attention heads (a ValueError when they do not divide by the TP size)."""
    return _split(num_heads, tp_rank_size()[1], "attention heads")


def column_split(shard_sizes: list[int], what: str = "output features") -> TPSplit | None:
    """Each shard's rows split evenly; None at TP 1."""
    rank, tp = tp_rank_size()
    if tp == 1:
        return None
    ranges = []
    for s in shard_sizes:
        n = _split(s, tp, what)
        ranges.append((rank * n, (rank + 1) * n))
    return TPSplit(0, tuple(ranges), tuple(shard_sizes), rank, tp)


def row_split(in_features: int, what: str = "input features") -> TPSplit | None:
    rank, tp = tp_rank_size()
    if tp == 1:
        return None
    n = _split(in_features, tp, what)
    return TPSplit(1, ((rank * n, (rank + 1) * n),), (in_features,), rank, tp)


def qkv_split(head_dim: int, num_heads: int, num_kv_heads: int) -> TPSplit | None:
    """Query heads split; KV heads split when TP <= their count, else each rank holds the KV head
    its query heads attend with (query head h uses KV head h * num_kv // num_heads)."""
    rank, tp = tp_rank_size()
    if tp == 1:
        return None
    if num_kv_heads % tp and tp % num_kv_heads:
        raise TPSplitError(f"{num_kv_heads} KV heads and tensor parallel size {tp}: neither divides the other")
    hq = _split(num_heads, tp, "attention heads")
    hkv = max(1, num_kv_heads // tp)
    kv0 = rank * num_kv_heads // tp if tp >= num_kv_heads else rank * hkv
    q = (rank * hq * head_dim, (rank + 1) * hq * head_dim)
    kv = (kv0 * head_dim, (kv0 + hkv) * head_dim)
    full_kv = num_kv_heads * head_dim
    return TPSplit(0, (q, kv, kv), (num_heads * head_dim, full_kv, full_kv), rank, tp)


def heads_split(num_heads: int, per_head: int = 1) -> TPSplit | None:
    """``per_head`` rows per head (attention sinks: 1; MLA's q_b / kv_b projections), split by head."""
    rank, tp = tp_rank_size()
    if tp == 1:
        return None
    h = _split(num_heads, tp, "attention heads")
    return TPSplit(0, ((rank * h * per_head, (rank + 1) * h * per_head),), (num_heads * per_head,), rank, tp)


def vocab_split(vocab_size: int, rows_per_rank: int) -> TPSplit | None:
    rank, tp = tp_rank_size()
    if tp == 1:
        return None
    start = rank * rows_per_rank
    return TPSplit(0, ((start, start + rows_per_rank),), (vocab_size,), rank, tp)
