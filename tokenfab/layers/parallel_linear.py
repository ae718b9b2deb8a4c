"""Tensor-parallel layers (Megatron-style), standalone reference versions with explicit
``load_full`` / ``load_shard``. The models use the TP-aware ``layers.linear.Linear`` /
``MergedLinear`` / ``qkv_linear`` and ``layers.embedding`` classes instead, which take the same
splits from ``layers.tp_split`` through the weight loader (and keep the quantized replacements).

With W split over ``tp`` ranks:
- column-parallel: rank r holds rows W_r of the output dim, computes y_r = x W_r^T (its slice of the
  output; ``gather_output`` concatenates the slices). The merged variants (gate/up, qkv) split each
  projection separately, so the local output is [gate_r ; up_r] / [q_r ; k_r ; v_r].
- QKV: query heads split over ranks; KV heads split when tp <= num_kv_heads, else each rank holds the
  one KV head its query heads attend with (rank r: head r * num_kv // tp), replicated tp / num_kv times.
- row-parallel: rank r holds the input columns W[:, r], takes its slice of the input (the output of
  a column-parallel layer), and the partial products are summed by one all-reduce; the bias is added
  once, after it.
- vocab-parallel embedding / LM head: each rank holds ``ceil(V / (64 tp)) * 64`` vocabulary rows (the
  padding rows are zero); the embedding looks up the ids in its range (others give zero) and
  all-reduces; the LM head computes its rows' logits and all-gathers them, dropping the padding.

Loading: ``load_full`` / ``load_shard`` take the full checkpoint tensor and copy this rank's part.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenfab.distributed.parallel_state import tp_all_gather_last, tp_all_reduce
from tokenfab.layers.embedding import VOCAB_PADDING, vocab_rows_per_rank  # noqa: F401 (re-exported)
from tokenfab.layers.linear import linear
from tokenfab.layers.tp_split import tp_rank_size


def _split(n: int, tp: int, what: str) -> int:
    if n % tp:
        raise ValueError(f"{what} {n} does not divide by tensor parallel size {tp}")
    return n // tp


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class _TPLinear(nn.Module):
    """What the column- and row-parallel linears share: the full sizes, this rank's place in the TP
    group, its part of the weight and bias (filled by ``load_full`` / ``load_shard``)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank_size()
        self.in_features, self.out_features = in_features, out_features

    def _params(self, rows: int, cols: int, bias_rows: int | None) -> None:
        self.weight = _param(rows, cols)
        self.bias = _param(bias_rows) if bias_rows is not None else None


class ColumnParallelLinear(_TPLinear):
    def __init__(self, in_features: int, out_features: int, bias: bool = False, gather_output: bool = False) -> None:
        super().__init__(in_features, out_features)
        self.gather_output = gather_output
        self.out_per_rank = _split(out_features, self.tp_size, "output features")
        self._params(self.out_per_rank, in_features, self.out_per_rank if bias else None)

    def load_full(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        rows = slice(self.tp_rank * self.out_per_rank, (self.tp_rank + 1) * self.out_per_rank)
        self.weight.data.copy_(weight[rows])
        if self.bias is not None and bias is not None:
            self.bias.data.copy_(bias[rows])

    def _load_part(self, i: int, w: torch.Tensor, first: int) -> None:
        """Local part ``i`` (``local_sizes``, of a merged layer) from rows ``first:`` of the full checkpoint
        tensor ``w`` (weight [rows, in] or bias [rows])."""
        n = self.local_sizes[i]
        start = sum(self.local_sizes[:i])
        target = self.weight if w.dim() == 2 else self.bias
        assert target is not None, "this layer has no bias"
        target.data[start : start + n].copy_(w[first : first + n])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, self.bias, None)
        return tp_all_gather_last(y) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Projections of the same input (gate/up), each split over the ranks: local output [p0_r ; p1_r ...]."""

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool = False) -> None:
        super().__init__(in_features, sum(shard_sizes), bias)
        self.local_sizes = [_split(s, self.tp_size, "merged projection size") for s in shard_sizes]

    def load_shard(self, i: int, w: torch.Tensor) -> None:
        """Full checkpoint tensor of projection ``i`` (weight [rows, in] or bias [rows])."""
        self._load_part(i, w, self.tp_rank * self.local_sizes[i])


class QKVParallelLinear(ColumnParallelLinear):
    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False) -> None:
        rank, tp = tp_rank_size()
        if num_kv_heads % tp and tp % num_kv_heads:
            raise ValueError(f"{num_kv_heads} KV heads and tensor parallel size {tp}: neither divides the other")
        heads, kv_heads = _split(num_heads, tp, "attention heads"), max(1, num_kv_heads // tp)
        super().__init__(hidden_size, (heads + 2 * kv_heads) * head_dim * tp, bias)
        self.num_heads, self.num_kv_heads, self.head_dim = heads, kv_heads, head_dim
        # the KV heads this rank's query heads use (query head h attends with KV head h * num_kv // num_heads)
        self.kv_start = rank * num_kv_heads // tp if tp >= num_kv_heads else rank * kv_heads
        self.local_sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]

    def load_shard(self, i: int, w: torch.Tensor) -> None:
        """Full checkpoint q (i=0), k (1) or v (2) weight [heads * head_dim, hidden] or bias."""
        self._load_part(i, w, (self.tp_rank * self.num_heads if i == 0 else self.kv_start) * self.head_dim)


class RowParallelLinear(_TPLinear):
    def __init__(self, in_features: int, out_features: int, bias: bool = False, reduce_output: bool = True) -> None:
        super().__init__(in_features, out_features)
        self.reduce_output = reduce_output
        self.in_per_rank = _split(in_features, self.tp_size, "input features")
        self._params(out_features, self.in_per_rank, out_features if bias else None)

    def load_full(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        cols = slice(self.tp_rank * self.in_per_rank, (self.tp_rank + 1) * self.in_per_rank)
        self.weight.data.copy_(weight[:, cols])
        if self.bias is not None and bias is not None:
            self.bias.data.copy_(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: this rank's slice of the input features."""
        y = linear(x, self.weight, None, None)
        if self.reduce_output:
            y = tp_all_reduce(y)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank_size()
        self.vocab_size = vocab_size
        self.rows = vocab_rows_per_rank(vocab_size, self.tp_size)
        self.start = self.tp_rank * self.rows
        self.weight = nn.Parameter(torch.zeros(self.rows, hidden_size), requires_grad=False)

    def load_full(self, weight: torch.Tensor) -> None:
        part = weight[self.start : self.start + self.rows]
        self.weight.data.zero_()
        self.weight.data[: part.shape[0]].copy_(part)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return tp_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits (float32) of the whole vocabulary from each rank's rows; ``tie(embedding)`` shares its rows."""

    def tie(self, embedding: VocabParallelEmbedding) -> None:
        assert embedding.rows == self.rows and embedding.start == self.start
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden, self.weight, None, None).float()
        return tp_all_gather_last(logits)[..., : self.vocab_size]
