"""Build ``ForwardBatch``es by hand for head/layer tests: sequences with contiguous block tables."""

from __future__ import annotations

import torch

from tokenfab.forward_batch import ForwardBatch


def paged_batch(chunks: list[tuple[list[int], int, int]], block_size: int, blocks_per_seq: int) -> ForwardBatch:
    """chunks: per sequence (new token ids, first position, sequence index); sequence s owns blocks
    s * blocks_per_seq ... (s + 1) * blocks_per_seq - 1."""
    ids, pos, slots, cu, ctx, tables = [], [], [0][:0], [0], [], []
    for toks, start, s in chunks:
        table = list(range(s * blocks_per_seq, (s + 1) * blocks_per_seq))
        assert start + len(toks) <= blocks_per_seq * block_size
        ids += toks
        pos += range(start, start + len(toks))
        slots += [table[p // block_size] * block_size + p % block_size for p in range(start, start + len(toks))]
        cu.append(cu[-1] + len(toks))
        ctx.append(start + len(toks))
        tables.append(table)
    return ForwardBatch(
        input_ids=torch.tensor(ids), positions=torch.tensor(pos), slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor(tables, dtype=torch.int32), cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
        context_lens=torch.tensor(ctx, dtype=torch.int32), logits_indices=torch.arange(len(ids)),
        max_query_len=max(len(c[0]) for c in chunks), max_context_len=max(ctx))
