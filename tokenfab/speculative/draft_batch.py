"""What every model-based proposer's draft loop needs: batches of rows through the target's block
tables, and the draft token of each row (greedy, or sampled from the draft's own distribution q).

Draft caches are indexed by the TARGET's block tables and slot mapping (same block size, same
number of blocks; vLLM's EAGLE does this): allocation, rollback of rejected drafts, prefix caching
and preemption need no second block manager. A draft row at position p writes its K/V at the slot
the target uses for p; a rejected draft's slot is simply written again later.

Sampled requests: draft j of a request that has generated n tokens is drawn from q (the draft's
logits through the request's own temperature / top-k / top-p / min-p, as the target's p is) with
one uniform of ``substream_seed(step_seed(base_seed, n + j), DRAFT_STREAM)``, independent of the
acceptance rule's streams (``speculative/accept.py``), so a seeded request is reproducible whatever the batch.
"""

from __future__ import annotations

import torch

from tokenfab.engine.requests.sequence import Sequence
from tokenfab.engine.runner.sampler import step_seed
from tokenfab.forward_batch import ForwardBatch
from tokenfab.kernels import argmax
from tokenfab.kernels.sampling import hash_uniform
from tokenfab.speculative.accept import DRAFT_STREAM, _target_probs, substream_seed


class TableRows:
    """The block tables of a set of sequences, on the device once, for rows at given positions."""

    def __init__(self, seqs: list[Sequence], block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        self.device = device
        width = max(len(s.block_table) for s in seqs)
        self.tables_host = [s.block_table + [0] * (width - len(s.block_table)) for s in seqs]
        self.tables = torch.tensor(self.tables_host, dtype=torch.int32).view(len(seqs), width).to(device)
        # hybrid cache: the target's state slots (a draft module with per-sequence state uses the same rows)
        slots = [s.state_slot for s in seqs]
        self.slots = torch.tensor(slots, dtype=torch.int32).to(device) if min(slots) >= 0 else None

    def batch(self, which: list[int], starts: list[int], counts: list[int], input_ids: torch.Tensor,
              logits_rows: list[int] | None = None) -> ForwardBatch:
        """Sequence ``which[i]`` gets ``counts[i]`` rows at positions starts[i] ...; ``input_ids``
        [sum counts] (on the device); logits for ``logits_rows`` (default: each sequence's last row)."""
        bs = self.block_size
        positions: list[int] = []
        slots: list[int] = []
        cu = [0]
        for w, st, n in zip(which, starts, counts):
            table = self.tables_host[w]
            for p in range(st, st + n):
                positions.append(p)
                slots.append(table[p // bs] * bs + p % bs)
            cu.append(cu[-1] + n)
        ctx = [st + n for st, n in zip(starts, counts)]
        if logits_rows is None:
            logits_rows = [c - 1 for c in cu[1:]]
        dev = self.device
        idx = torch.tensor(which, dtype=torch.int64).to(dev)
        return ForwardBatch(
            input_ids=input_ids,
            positions=torch.tensor(positions, dtype=torch.int64).to(dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64).to(dev),
            block_tables=self.tables.index_select(0, idx) if len(which) != self.tables.shape[0] else self.tables,
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32).to(dev),
            context_lens=torch.tensor(ctx, dtype=torch.int32).to(dev),
            logits_indices=torch.tensor(logits_rows, dtype=torch.int64).to(dev),
            max_query_len=max(counts),
            max_context_len=max(ctx),
            state_slots=None if self.slots is None else self.slots.index_select(0, idx),
        )


def pick_drafts(logits: torch.Tensor, seqs: list[Sequence], js: list[int],
                want_q: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Row i of ``logits`` [R, V] drafts token j = js[i] of ``seqs[i]``: (tokens [R] int64, q [R, V]
    float32 or None). Greedy requests take the argmax (the plain sampler's, ties included); sampled
    ones draw from q by inverse CDF with one uniform. q (only when ``want_q``) is one-hot on greedy rows."""
    dev = logits.device
    tokens = argmax(logits).to(torch.int64)
    sampled = [i for i, s in enumerate(seqs) if s.params.temperature != 0.0]
    if not want_q:
        return tokens, None
    q = torch.zeros(logits.shape, dtype=torch.float32, device=dev)
    q.scatter_(1, tokens[:, None], 1.0)
    if sampled:
        idx = torch.tensor(sampled, device=dev)
        probs = _target_probs(logits.index_select(0, idx), [seqs[i].params for i in sampled], logits.shape[1])
        seeds = [substream_seed(step_seed(seqs[i].base_seed, seqs[i].num_output_tokens + js[i]), DRAFT_STREAM)
                 for i in sampled]
        u = hash_uniform(torch.tensor(seeds, dtype=torch.int64, device=dev), 1)
        cdf = probs.cumsum(-1)
        drawn = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1).clamp(max=logits.shape[1] - 1)
        tokens = tokens.index_copy(0, idx, drawn)
        q.index_copy_(0, idx, probs)
    return tokens, q


def any_sampled(seqs: list[Sequence]) -> bool:
    return any(s.params.temperature != 0.0 for s in seqs)
