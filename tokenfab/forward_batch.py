"""The one flat, unpadded token batch that a model step consumes."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import ClassVar

import torch


@dataclass
class ForwardBatch:
    """Tensors for one model step over B sequences and T = sum of their new tokens.

    input_ids, positions, slot_mapping: [T] (slot = block * block_size + offset; -1 skip)
    block_tables: [B, max_blocks] int32 (rows padded with 0)
    cu_seqlens_q: [B + 1] int32, the new tokens of sequence b are cu[b]:cu[b+1]
    context_lens: [B] int32, keys of sequence b after this step (cached + new)
    logits_indices: [R] int64, rows of the hidden states whose logits are wanted
    max_query_len, max_context_len: host ints (known when the batch is built; no sync)
    prompt_indices: [P] int64 or None, rows whose hidden states are kept for prompt logprobs
    state_slots: [B] int32 or None, hybrid cache: the recurrent-state slot of each sequence, the row
        of the state tensors bound to the layers that declare ``recurrent_state_spec()`` (None for
        models without recurrent state). A slot is stable across all chunks of a sequence, so a
        chunk continues from the state the previous chunk left. A sequence starts fresh when the
        first position of its chunk is 0 (``positions[cu_seqlens_q[:-1]] == 0``): the layer must
        then zero or ignore the slot's old contents (left by an earlier owner). That is also how a
        preempted sequence, recomputed from its first token, restarts from a zero state: no other
        field says so (docs/hybrid-cache.md).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    cu_seqlens_q: torch.Tensor
    context_lens: torch.Tensor
    logits_indices: torch.Tensor
    max_query_len: int
    max_context_len: int
    prompt_indices: torch.Tensor | None = None
    state_slots: torch.Tensor | None = None

    # the batch built last (weakly held): the native kernels check its index tensors once, not once
    # a layer (kernels/cpu/checks.py); a batch's tensors are never changed in place while it is used
    latest: ClassVar[weakref.ref | None] = None

    def __post_init__(self) -> None:
        ForwardBatch.latest = weakref.ref(self)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]
