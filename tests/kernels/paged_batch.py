"""The paged-batch layout the attention kernel tests share (standard attention, MLA)."""

from __future__ import annotations

import torch


def shuffled_block_tables(ctx_lens: list[int], bs: int, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """Block tables for sequences of ``ctx_lens`` keys in pages of ``bs``: the pages are handed out in a
    shuffled order from a pool with two spare pages nobody owns, and each row is padded past the
    sequence's last page with a spare page's id. Returns (block_tables [B, max_blocks] int32, pages)."""
    nblk = [(c + bs - 1) // bs for c in ctx_lens]
    max_blocks = max(max(nblk, default=0), 1) + 1
    total = sum(nblk) + 2
    perm = torch.randperm(total, generator=gen)
    bt = torch.full((len(ctx_lens), max_blocks), int(perm[-1]), dtype=torch.int32)
    i = 0
    for s, n in enumerate(nblk):
        bt[s, :n] = perm[i : i + n]
        i += n
    return bt, total


def seq_lens(q_lens: list[int], ctx_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(cu_seqlens_q [B + 1], context_lens [B]) int32 of a flat batch."""
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens, dtype=torch.int32).cumsum(0)
    return cu, torch.tensor(ctx_lens, dtype=torch.int32)
