"""Turns a scheduled batch into one ForwardBatch, runs the model, returns logits.

Owns the KV cache memory: one tensor [num_layers, 2, num_blocks, block_size, Hkv, D]
whose per-layer slices are bound to the model's Attention modules.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenfab.engine.sequence import Sequence
from tokenfab.forward_batch import ForwardBatch
from tokenfab.layers.attention import Attention


def attention_layers(model: nn.Module) -> list[Attention]:
    return [m for m in model.modules() if isinstance(m, Attention)]


def kv_bytes_per_token(model: nn.Module, dtype: torch.dtype) -> int:
    """Bytes of K and V one token takes across all layers."""
    elem = torch.empty(0, dtype=dtype).element_size()
    return sum(2 * a.num_kv_heads * a.head_dim * elem for a in attention_layers(model))


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        dtype: torch.dtype,
        block_size: int,
        num_blocks: int,
    ) -> None:
        self.model = model
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        layers = attention_layers(model)
        shapes = {(a.num_kv_heads, a.head_dim) for a in layers}
        if len(shapes) != 1:
            raise NotImplementedError("layers with different KV shapes need per-layer caches")
        hkv, hd = shapes.pop()
        self.kv_cache = torch.zeros(
            len(layers), 2, num_blocks, block_size, hkv, hd, dtype=dtype, device=device
        )
        for i, layer in enumerate(layers):
            layer.k_cache = self.kv_cache[i, 0]
            layer.v_cache = self.kv_cache[i, 1]

    def prepare(
        self, seqs: list[Sequence], num_new_tokens: list[int], sample_mask: list[bool]
    ) -> ForwardBatch:
        """Flatten the scheduled chunks into one batch (host lists -> one copy to device)."""
        input_ids: list[int] = []
        positions: list[int] = []
        cu = [0]
        ctx_lens: list[int] = []
        max_blocks = 0
        for seq, n in zip(seqs, num_new_tokens):
            start = seq.num_computed_tokens
            input_ids += seq.token_ids[start : start + n]
            positions += range(start, start + n)
            cu.append(cu[-1] + n)
            ctx_lens.append(start + n)
            max_blocks = max(max_blocks, len(seq.block_table))
        tables = [s.block_table + [0] * (max_blocks - len(s.block_table)) for s in seqs]
        dev = self.device
        pos_t = torch.tensor(positions, dtype=torch.int64)
        tables_t = torch.tensor(tables, dtype=torch.int32).view(len(seqs), max_blocks)
        cu_t = torch.tensor(cu, dtype=torch.int32)
        q_lens = torch.tensor(num_new_tokens, dtype=torch.int64)
        seq_of_token = torch.repeat_interleave(torch.arange(len(seqs)), q_lens)
        block_of_token = tables_t[seq_of_token, pos_t // self.block_size].long()
        slots = block_of_token * self.block_size + pos_t % self.block_size
        logits_idx = [cu[i + 1] - 1 for i, s in enumerate(sample_mask) if s]
        return ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.int64).to(dev, non_blocking=True),
            positions=pos_t.to(dev, non_blocking=True),
            slot_mapping=slots.to(dev, non_blocking=True),
            block_tables=tables_t.to(dev, non_blocking=True),
            cu_seqlens_q=cu_t.to(dev, non_blocking=True),
            context_lens=torch.tensor(ctx_lens, dtype=torch.int32).to(dev, non_blocking=True),
            logits_indices=torch.tensor(logits_idx, dtype=torch.int64).to(dev, non_blocking=True),
            max_query_len=max(num_new_tokens),
            max_context_len=max(ctx_lens),
        )

    @torch.inference_mode()
    def execute(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [R, V] float32 for the rows in batch.logits_indices."""
        hidden = self.model(batch)
        return self.model.compute_logits(hidden.index_select(0, batch.logits_indices))
