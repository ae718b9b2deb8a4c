"""Picks each step's batch: decodes first, then prompt chunks within a token budget.

Continuous batching: requests join at any step and leave the step they finish. A prompt
longer than the budget is prefilled over several steps (chunked prefill). When a running
request needs a block and none is free, the lowest-priority, newest running request is
preempted: its blocks are freed and it goes back to the waiting queue with its generated
tokens kept, to be recomputed later (reusing whatever prefix is still cached).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from tokenfab.engine.requests.block_manager import BlockManager
from tokenfab.engine.requests.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    # per entry, whether it was a decode when scheduled (a sequence freed since, e.g. one the
    # overlap scheduler drops after it finished, no longer says)
    is_decode: list[bool] = field(default_factory=list)

    def add(self, seq: Sequence, n: int) -> None:
        decode = seq.is_decoding and n == 1 + len(seq.spec_token_ids)  # + draft tokens to verify
        if decode:
            self.num_decode_tokens += n
        else:
            self.num_prefill_tokens += n
        self.seqs.append(seq)
        self.num_new_tokens.append(n)
        self.is_decode.append(decode)

    def remove(self, i: int) -> int:
        self.seqs.pop(i)
        n = self.num_new_tokens.pop(i)
        if self.is_decode.pop(i):
            self.num_decode_tokens -= n
        else:
            self.num_prefill_tokens -= n
        return n

    @property
    def empty(self) -> bool:
        return not self.seqs


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
    ) -> None:
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Sequence] = []  # sorted by sort_key
        self.running: list[Sequence] = []  # in admission order
        self.num_preemptions_total = 0

    # ---- queue management -----------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and free its blocks."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free(seq)
        seq.status = SequenceStatus.FINISHED

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free(seq)
        seq.spec_token_ids = []
        seq.num_preemptions += 1
        self.num_preemptions_total += 1
        self.add(seq)

    def _victim(self) -> Sequence:
        """The running sequence to preempt: lowest priority (largest key), newest."""
        return max(self.running, key=lambda s: s.sort_key)

    # ---- the step's batch -----------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        # 1. running sequences: decodes first, then unfinished prefill chunks
        ordered = sorted(self.running, key=lambda s: (not s.is_decoding, s.sort_key))
        for seq in ordered:
            if seq.status != SequenceStatus.RUNNING or seq.length_capped:
                # preempted earlier in this loop (a status check: list membership is O(n)), or its
                # pending token ends it (overlap scheduling): nothing more to compute
                continue
            if budget <= 0:
                break
            n = min(seq.num_tokens - seq.num_computed_tokens + len(seq.spec_token_ids), budget)
            if seq.spec_token_ids:  # speculative drafts: never worth a preemption, cut by the budget
                if not self.bm.can_allocate(seq, n):
                    seq.spec_token_ids, n = [], min(seq.num_tokens - seq.num_computed_tokens, budget)
                del seq.spec_token_ids[max(n - (seq.num_tokens - seq.num_computed_tokens), 0):]
            while not self.bm.can_allocate(seq, n):
                victim = self._victim()
                if victim in batch.seqs:  # already scheduled this step: take it back out
                    i = batch.seqs.index(victim)
                    budget += batch.remove(i)
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                continue
            self.bm.allocate(seq, n)
            batch.add(seq, n)
            budget -= n
        # 2. waiting sequences, in order, while they fit (no admission in a step that preempted)
        while self.waiting and budget > 0 and not batch.preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not seq.block_table:
                cached = self.bm.allocate_cached_prefix(seq)
                if seq.num_preemptions == 0 and seq.first_scheduled_time is None:
                    seq.num_cached_tokens = cached
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.bm.allocate(seq, n):
                self.bm.free(seq)  # give back prefix hits; it stays first in line
                break
            self.waiting.pop(0)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.add(seq, n)
            budget -= n
        return batch
