"""Token embedding and LM head; vocabulary-parallel at TP > 1.

At TP > 1 each rank holds ``ceil(V / (64 tp)) * 64`` vocabulary rows (``tp_split``: rows
[rank * rows, (rank + 1) * rows) of the checkpoint, zero-padded past V). The embedding looks up
the ids in its range (zero elsewhere) and all-reduces; the LM head computes its rows' logits and
all-gathers them, dropping the padding, so every rank holds the full logits and samples alike.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenfab.distributed.parallel_state import tp_all_gather_last, tp_all_reduce
from tokenfab.layers.linear import linear
from tokenfab.layers.tp_split import TPSplit, tp_rank_size, vocab_split

VOCAB_PADDING = 64


def vocab_rows_per_rank(vocab_size: int, tp_size: int, multiple: int = VOCAB_PADDING) -> int:
    return -(-vocab_size // (multiple * tp_size)) * multiple


def _vocab_rows(vocab_size: int) -> tuple[int, TPSplit | None]:
    _, tp = tp_rank_size()
    if tp == 1:
        return vocab_size, None
    rows = vocab_rows_per_rank(vocab_size, tp)
    return rows, vocab_split(vocab_size, rows)


def vocab_parallel_lookup(input_ids: torch.Tensor, split: TPSplit, lookup) -> torch.Tensor:
    """``lookup(local_ids)`` of the ids in this rank's rows, zero for the others, summed over the TP group."""
    start, end = split.ranges[0]
    local = input_ids - start
    outside = (local < 0) | (local >= end - start)
    out = lookup(local.masked_fill(outside, 0))
    out.masked_fill_(outside.unsqueeze(-1), 0.0)
    return tp_all_reduce(out)


class VocabEmbedding(nn.Module):
    tp_split: TPSplit | None = None

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        rows, self.tp_split = _vocab_rows(vocab_size)
        self.weight = nn.Parameter(torch.empty(rows, hidden_size), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_split is None:
            return F.embedding(input_ids, self.weight)
        return vocab_parallel_lookup(input_ids, self.tp_split, lambda ids: F.embedding(ids, self.weight))


class LMHead(nn.Module):
    """Output projection to vocabulary logits (float32, for sampling)."""

    packed_weight: torch.Tensor | None = None  # see layers.linear.prepack_cpu_linears
    tp_split: TPSplit | None = None

    def __init__(self, vocab_size: int, hidden_size: int, bias: bool = False) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        rows, self.tp_split = _vocab_rows(vocab_size)
        self.weight = nn.Parameter(torch.empty(rows, hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(rows), requires_grad=False) if bias else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden, self.weight, self.bias, self.packed_weight).float()
        if self.tp_split is None:
            return logits
        return tp_all_gather_last(logits)[..., : self.vocab_size]
