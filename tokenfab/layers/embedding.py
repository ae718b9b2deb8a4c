from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenfab.layers.linear import linear


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """Output projection to vocabulary logits (float32, for sampling)."""

    packed_weight: torch.Tensor | None = None  # see layers.linear.prepack_cpu_linears

    def __init__(self, vocab_size: int, hidden_size: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(vocab_size), requires_grad=False) if bias else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.weight, self.bias, self.packed_weight).float()
