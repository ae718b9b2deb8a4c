"""Picks each step's batch: decodes first, then prompt chunks within a token budget.

Continuous batching: requests join at any step and leave the step they finish. A prompt
longer than the budget is prefilled over several steps (chunked prefill). When a running
request needs a block and none is free, the lowest-priority, newest running request is
preempted: its blocks are freed and it goes back to the waiting queue with its generated
tokens kept, to be recomputed later (reusing whatever prefix is still cached).

Background work (``Sequence.is_background``: the lowest priority, what the Batches worker submits)
yields to online work whatever the scheduling policy, in the manner of vLLM's and SGLang's priority
scheduling. While an online request waits or prefills, a step runs: the online running sequences;
then waiting online prompts, admitted in order, each preempting the newest running background
sequences when a sequence slot or KV blocks are short; then background decodes (unless
``background_decodes_while_online`` is off) and background prefill chunks and admissions, the latter
within ``background_prefill_share`` of the step's token budget. With no online work waiting or
prefilling, background work is scheduled like any other and may use the whole budget, or at most
``background_max_prefill_tokens`` prefill tokens a step when that is set: an online request that
arrives waits for the step in flight, so on a compute-bound device (a CPU) this bounds its wait.
While online traffic is present (an online request in the engine, or one left it less than
``ONLINE_LINGER_S`` ago), background work (its decode rows and prefill tokens together) takes at most
``background_max_tokens_while_online`` tokens of a step: on a CPU a step costs a fixed part plus about the
same per row, decode or prompt token, so a small background step is what keeps the next online arrival's
wait short while the batch still advances every step.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tokenfab.engine.requests.block_manager import BlockManager
from tokenfab.engine.requests.sequence import Sequence, SequenceStatus

# online traffic counts as present this long after the last online request left the engine (see online_present)
ONLINE_LINGER_S = 1.0


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
        background_prefill_share: float = 0.0,
        background_decodes_while_online: bool = True,
        background_max_prefill_tokens: int | None = None,
        background_max_tokens_while_online: int | None = None,
    ) -> None:
        if not 0.0 <= background_prefill_share <= 1.0:
            raise ValueError(f"background_prefill_share must be in [0, 1], got {background_prefill_share!r}")
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # while online work waits or prefills: the share of the step's tokens that background prefill chunks
        # (and background decodes, when those are paused) may take, and whether background decodes go on
        self.background_prefill_share = background_prefill_share
        self.background_decodes_while_online = background_decodes_while_online
        # at any time: the most background prefill tokens in one step (None: the budget). A step is only
        # interrupted at its end, so this bounds how long an arriving online request waits behind one
        if background_max_prefill_tokens is not None and background_max_prefill_tokens < 1:
            raise ValueError(f"background_max_prefill_tokens must be at least 1, got {background_max_prefill_tokens!r}")
        self.background_max_prefill_tokens = background_max_prefill_tokens
        # while online traffic is present: the most background tokens (decode rows + prefill) in one step (None:
        # no such cap). ``clock`` says when online work was last seen (tests give their own)
        if background_max_tokens_while_online is not None and background_max_tokens_while_online < 1:
            raise ValueError("background_max_tokens_while_online must be at least 1, got "
                             f"{background_max_tokens_while_online!r}")
        self.background_max_tokens_while_online = background_max_tokens_while_online
        self.clock: Callable[[], float] = time.monotonic
        self._online_seen_at: float | None = None
        self.waiting: list[Sequence] = []  # sorted by sort_key (background last: its priority is the largest)
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

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> int:
        """Send a running sequence back to the queue (taken out of this step's batch if it was in it);
        returns the tokens it gave back to the step's budget."""
        given_back = 0
        if seq in batch.seqs:  # already scheduled this step
            given_back = batch.remove(batch.seqs.index(seq))
        self.running.remove(seq)
        self.bm.free(seq)
        seq.spec_token_ids = []
        seq.num_preemptions += 1
        self.num_preemptions_total += 1
        self.add(seq)
        batch.preempted.append(seq)
        return given_back

    def _victim(self) -> Sequence:
        """The running sequence to preempt: lowest priority (largest key), newest."""
        return max(self.running, key=lambda s: s.sort_key)

    def online_pending(self) -> bool:
        """Whether an online request waits or prefills: then background work yields to it."""
        if self.waiting and not self.waiting[0].is_background:
            return True
        return any(not s.is_background and not s.is_decoding for s in self.running)

    def online_present(self) -> bool:
        """Whether online traffic is present: an online request in the engine (waiting, prefilling or
        decoding), or one was there less than ``ONLINE_LINGER_S`` ago (the next one of a stream, or of a
        client between two requests, is likely on its way). Records the time it was last seen."""
        if (self.waiting and not self.waiting[0].is_background) or any(not s.is_background for s in self.running):
            self._online_seen_at = self.clock()
            return True
        return self._online_seen_at is not None and self.clock() - self._online_seen_at < ONLINE_LINGER_S

    # ---- the step's batch -----------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        pending = self.online_pending()
        decoding = self.background_decodes_while_online or not pending
        cap = self.max_num_batched_tokens if self.background_max_prefill_tokens is None \
            else self.background_max_prefill_tokens
        if pending:
            cap = min(cap, int(self.background_prefill_share * self.max_num_batched_tokens))
        room = self.max_num_batched_tokens  # background tokens of any kind this step may take
        if self.background_max_tokens_while_online is not None and self.online_present():
            room = self.background_max_tokens_while_online
        # with no online work pending (and no cap) this is the old order: decodes, prefill chunks, admissions
        self._schedule_running(batch, [s for s in self.running if not s.is_background], self._budget_left(batch))
        self._admit(batch, self._budget_left(batch), online=True)
        background = [s for s in self.running if s.is_background]
        self._schedule_running(batch, [s for s in background if decoding and s.is_decoding],
                               min(self._budget_left(batch), room - self._background(batch)))
        capped = [s for s in background if not (decoding and s.is_decoding)]
        self._schedule_running(batch, capped, min(self._budget_left(batch), cap - self._capped(batch, decoding),
                                                  room - self._background(batch)))
        self._admit(batch, min(self._budget_left(batch), cap - self._capped(batch, decoding),
                               room - self._background(batch)), online=False)
        return batch

    def _budget_left(self, batch: ScheduledBatch) -> int:
        return self.max_num_batched_tokens - batch.num_prefill_tokens - batch.num_decode_tokens

    @staticmethod
    def _background(batch: ScheduledBatch) -> int:
        """Background tokens of the step's batch, decode rows and prefill chunks alike."""
        return sum(n for s, n in zip(batch.seqs, batch.num_new_tokens) if s.is_background)

    @staticmethod
    def _capped(batch: ScheduledBatch, decoding: bool) -> int:
        """Tokens of the step's batch under the background cap: background prefill chunks, and background
        decodes when those are paused (``decoding`` False)."""
        return sum(n for s, n, d in zip(batch.seqs, batch.num_new_tokens, batch.is_decode)
                   if s.is_background and not (decoding and d))

    def _schedule_running(self, batch: ScheduledBatch, seqs: list[Sequence], budget: int) -> int:
        """Schedule running sequences, decodes first, then unfinished prefill chunks; a sequence short of
        blocks preempts the lowest-priority, newest running ones (itself included). Returns the budget left."""
        ordered = sorted(seqs, key=lambda s: (not s.is_decoding, s.sort_key))
        for seq in ordered:
            if seq.status != SequenceStatus.RUNNING or seq.length_capped:
                # preempted earlier in this step (a status check: list membership is O(n)), or its
                # pending token ends it (overlap scheduling): nothing more to compute
                continue
            if budget <= 0:
                break
            n = min(seq.num_tokens - seq.num_computed_tokens + len(seq.spec_token_ids), budget)
            if seq.spec_token_ids:  # speculative drafts: never worth a preemption, cut by the budget
                if not self.bm.can_allocate(seq, n):
                    seq.spec_token_ids, n = [], min(seq.num_tokens - seq.num_computed_tokens, budget)
                del seq.spec_token_ids[max(n - (seq.num_tokens - seq.num_computed_tokens), 0):]
            n = self.bm.align_chunk(seq, n)  # hybrid prefix caching: chunks end on block boundaries
            while not self.bm.can_allocate(seq, n):
                victim = self._victim()
                budget += self._preempt(victim, batch)
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                continue
            self.bm.allocate(seq, n)
            batch.add(seq, n)
            budget -= n
        return budget

    def _preempt_background(self, batch: ScheduledBatch) -> bool:
        """Make room for an online request: preempt the newest running background sequence, if any."""
        victims = [s for s in self.running if s.is_background]
        if not victims:
            return False
        self._preempt(max(victims, key=lambda s: s.sort_key), batch)
        return True

    def _admit(self, batch: ScheduledBatch, budget: int, online: bool) -> None:
        """Admit waiting sequences in order while they fit. ``online``: the online ones only, each making
        room by preempting background sequences, and none after a step preempted an online sequence;
        otherwise none in a step that preempted anything."""
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if online and (seq.is_background or any(not s.is_background for s in batch.preempted)):
                break
            if not online and batch.preempted:
                break
            if len(self.running) >= self.max_num_seqs:
                if online and self._preempt_background(batch):
                    budget = self._budget_left(batch)
                    continue
                break
            if not seq.block_table:
                cached = self.bm.allocate_cached_prefix(seq)
                if seq.num_preemptions == 0 and seq.first_scheduled_time is None:
                    seq.num_cached_tokens = cached
            n = self.bm.align_chunk(seq, min(seq.num_tokens - seq.num_computed_tokens, budget))
            if not self.bm.allocate(seq, n):
                self.bm.free(seq)  # give back prefix hits; it stays first in line
                if online and self._preempt_background(batch):
                    budget = self._budget_left(batch)
                    continue
                break
            self.waiting.pop(0)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.add(seq, n)
            budget -= n
