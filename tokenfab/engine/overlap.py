"""Overlap scheduling (``--async-scheduling``): step N+1 is scheduled and launched before the host
reads step N's sampled tokens.

The models are SGLang's zero-overhead scheduler and vLLM V1's async scheduling. One call of
``OverlapScheduler.step()``:

1. schedules step N+1. Every sequence sampled at step N already carries a placeholder token
   (``PLACEHOLDER``) at the end of ``token_ids`` and has its step-N tokens counted as computed, so
   the scheduler, the block manager and ``ModelRunner.prepare`` see it as a decode of one more
   token: positions, slots and block tables are built on the host as usual. A sequence whose
   pending token is its last by count (``max_tokens``, the context) is not scheduled again
   (``Sequence.length_capped``): only a stop by content (EOS, stop ids/strings) costs a token;
2. launches step N+1: the placeholders' rows of ``input_ids`` are filled on the device from step
   N's sampled-token tensor (one ``index_copy_``), then forward and sampling are queued; the
   sampled ids stay a device tensor, and a non-blocking copy to (pinned) host memory plus an
   event are queued behind them;
3. resolves step N: waits for step N's event only (step N+1 keeps the device busy meanwhile),
   swaps each placeholder for its token and runs the stop checks (EOS, stop_token_ids,
   max_tokens, stop strings, ...) exactly as the synchronous engine does. A sequence that
   finishes here was also in step N+1: its step-N+1 token is dropped, and freeing it frees the
   block its last K/V went to; it is skipped below, so no prefix-cache digest ever covers a token
   it did not keep;
4. books step N+1 for the sequences still alive (computed tokens, full blocks offered to the
   prefix cache, new placeholders) and keeps it pending for the next call.

Outputs therefore arrive one call later than in the synchronous engine; the tokens are the same
(a request's draws depend only on its seed and position; ``num_output_tokens`` counts the
placeholder, which is the token the step is about to produce).

Falls back to the synchronous step (resolving step N first, dropping sequences that finished
there) when a scheduled request needs its latest token on the host: a grammar constraint (its
matcher must accept step N's token before it masks step N+1) or prompt logprobs (the scoring
path); and when the batched forward fails (the synchronous path isolates the failing request).
A step that may carry speculative drafts (``--speculative-config``) is synchronous too: proposers
read the latest token. ``logit_bias`` and ``min_tokens`` need only counts; penalties get step N's token from the device
tensor (``sample_tokens(pending=...)``); ``logprobs`` are computed on the device with the tokens
and read back with them: all stay overlapped.

On CPU the "device" is the CPU, so nothing really overlaps, but the control flow is the same one;
that is what the tests check against the synchronous engine.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from tokenfab.engine.postprocess import Postprocessor
from tokenfab.engine.requests.errors import EngineDeadError, raise_if_fatal
from tokenfab.engine.requests.outputs import RequestOutput
from tokenfab.engine.requests.scheduler import ScheduledBatch, Scheduler
from tokenfab.engine.requests.sequence import Sequence
from tokenfab.engine.runner.model_runner import ModelRunner
from tokenfab.engine.runner.sampler import logprob_rows, logprob_tensors, sample_tokens
from tokenfab.speculative.step import SpecDecoder

log = logging.getLogger("tokenfab")

# stands for a sampled token the host has not read yet; never a valid id, so a leak fails loudly
PLACEHOLDER = -1


def needs_sync(seq: Sequence) -> bool:
    """Whether this request's step needs its latest token on the host: a grammar constraint
    advances its matcher with it; prompt logprobs take the scoring path."""
    return seq.params.constraint is not None or seq.prompt_logprobs is not None


def _penalized(seq: Sequence) -> bool:
    p = seq.params
    return bool(p.presence_penalty) or bool(p.frequency_penalty) or p.repetition_penalty != 1.0


@dataclass
class PendingStep:
    """A launched step whose sampled tokens the host has not read yet."""

    tokens: torch.Tensor  # [R] int64 on the device: the next step's inputs come from here
    host: torch.Tensor  # [R] int64 on the CPU, filled by a non-blocking copy behind ``event``
    event: torch.cuda.Event | None
    # (chosen logprob, rank, top values, top ids) per row on the CPU, when a row asked for logprobs
    logprobs: tuple[torch.Tensor, ...] | None = None
    rows: dict[Sequence, int] = field(default_factory=dict)  # live sequence -> its row


def _to_host(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


class SteppedEngine(Protocol):
    """What the overlapped step loop drives (``LLMEngine``): its parts and its synchronous step."""

    scheduler: Scheduler
    runner: ModelRunner
    spec: SpecDecoder | None
    post: Postprocessor
    eos_token_ids: list[int]
    max_model_len: int

    def run_batch(self, batch: ScheduledBatch) -> list[RequestOutput]: ...


class OverlapScheduler:
    """The step loop of an ``LLMEngine`` with async scheduling on (see the module docstring)."""

    def __init__(self, engine: SteppedEngine) -> None:
        self.engine = engine
        self.pending: PendingStep | None = None
        self.num_sync_steps = 0  # steps that fell back to the synchronous path
        self.num_dropped_tokens = 0  # tokens computed for requests that had finished one step before

    def step(self) -> list[RequestOutput]:
        eng = self.engine
        if eng.spec is not None:
            if eng.spec.would_speculate(eng.scheduler.running):
                return self._spec_step()
            eng.spec.propose(eng.scheduler.running)  # drafts nothing; clears any stale drafts
        batch = eng.scheduler.schedule()
        if batch.empty:
            if self.pending is None:
                return eng.post.unschedulable()
            return self.resolve()
        if any(needs_sync(s) for s in batch.seqs):
            return self._sync_step(batch)
        try:
            launched = self._launch(batch)
        except EngineDeadError:
            raise
        except Exception as e:
            raise_if_fatal(e)
            log.warning("the overlapped step of %d sequences failed (%r); running it synchronously",
                        len(batch.seqs), e)
            return self._sync_step(batch)
        outputs = self.resolve()
        outputs += self._advance(batch, *launched)
        return outputs

    def resolve(self) -> list[RequestOutput]:
        """Read the pending step's tokens (waiting for that step only) and process them."""
        prev, self.pending = self.pending, None
        if prev is None:
            return []
        eng = self.engine
        try:
            if prev.event is not None:
                prev.event.synchronize()
            tokens = prev.host.tolist()
            lps = [t.tolist() for t in prev.logprobs] if prev.logprobs is not None else None
        except Exception as e:  # the device failed under step N: EngineDeadError when fatal
            raise_if_fatal(e)
            raise
        post = eng.post
        outputs = []
        for seq, row in prev.rows.items():
            assert seq.token_ids[-1] == PLACEHOLDER, "a pending sequence lost its placeholder"
            seq.token_ids.pop()
            if seq.is_finished:  # aborted meanwhile: nothing more is reported for it
                continue
            lp = None
            if lps is not None and seq.params.logprobs is not None:
                lp = logprob_rows([seq], *([t[row]] for t in lps))[0]
            try:
                post.append_token(seq, tokens[row], lp)
            except Exception as e:
                raise_if_fatal(e)
                post.fail(seq, f"processing the sampled token failed: {e}")
            outputs.append(post.output(seq))
        return outputs

    # ---- internals -------------------------------------------------------------------
    def _spec_step(self) -> list[RequestOutput]:
        """A step that may carry speculative drafts runs synchronously: the proposer needs every
        sequence's latest token on the host (tokenfab/speculative/step.py)."""
        eng = self.engine
        self.num_sync_steps += 1
        outputs = self.resolve()
        eng.spec.propose(eng.scheduler.running)
        batch = eng.scheduler.schedule()
        if batch.empty:
            return outputs + eng.post.unschedulable()
        return outputs + eng.run_batch(batch)

    def _sync_step(self, batch: ScheduledBatch) -> list[RequestOutput]:
        self.num_sync_steps += 1
        outputs = self.resolve()
        self._drop_finished(batch)
        if not batch.empty:
            outputs += self.engine.run_batch(batch)
        return outputs

    def _drop_finished(self, batch: ScheduledBatch) -> None:
        for i in reversed(range(len(batch.seqs))):
            if batch.seqs[i].is_finished:  # finished when step N's token arrived: not run at all
                batch.remove(i)

    def _launch(self, batch: ScheduledBatch) -> tuple[list[bool], list[bool], PendingStep | None]:
        """Queue forward + sampling of ``batch``; touches no sequence state (a failure here leaves
        everything as scheduled, for the synchronous retry)."""
        eng = self.engine
        seqs, counts = batch.seqs, batch.num_new_tokens
        done = [s.num_computed_tokens + n == s.num_tokens for s, n in zip(seqs, counts)]
        sample_mask = [d and s.params.max_tokens != 0 for s, d in zip(seqs, done)]
        fb = eng.runner.prepare(seqs, counts, sample_mask)
        prev = self.pending
        if prev is not None:
            dst: list[int] = []
            src: list[int] = []
            end = 0
            for s, n in zip(seqs, counts):
                end += n
                row = prev.rows.get(s)
                if row is not None:
                    # a decode of the token step N sampled: its one input row is the placeholder
                    assert n == 1 and s.num_computed_tokens == s.num_tokens - 1
                    dst.append(end - 1)
                    src.append(row)
            if dst:
                dev = fb.input_ids.device
                src_t = torch.tensor(src, dtype=torch.int64).to(dev, non_blocking=True)
                dst_t = torch.tensor(dst, dtype=torch.int64).to(dev, non_blocking=True)
                fb.input_ids.index_copy_(0, dst_t, prev.tokens.index_select(0, src_t))
        logits = eng.runner.execute(fb)
        sampled = [s for s, m in zip(seqs, sample_mask) if m]
        if not sampled:
            return done, sample_mask, None
        pending = None
        if prev is not None and any(_penalized(s) for s in sampled):
            # penalties count the token each row sampled at step N, still on the device
            src_t = torch.tensor([prev.rows.get(s, -1) for s in sampled], dtype=torch.int64)
            src_t = src_t.to(prev.tokens.device, non_blocking=True)
            pending = torch.where(src_t >= 0, prev.tokens.index_select(0, src_t.clamp(min=0)), -1)
        tokens = sample_tokens(logits, sampled, eng.eos_token_ids, pending)
        lp = logprob_tensors(logits, tokens, sampled)  # of the raw logits (sample_tokens copies to edit)
        event = None
        if tokens.device.type == "cuda":  # queued behind this step; the host waits on the event only
            host, lp = _to_host(tokens), (tuple(_to_host(t) for t in lp) if lp is not None else None)
            event = torch.cuda.Event()
            event.record()
        else:
            host = tokens
        return done, sample_mask, PendingStep(tokens, host, event, lp)

    def _advance(
        self, batch: ScheduledBatch, done: list[bool], sample_mask: list[bool], step: PendingStep | None,
    ) -> list[RequestOutput]:
        """Book the launched step for the sequences still alive; it becomes the pending step."""
        eng, post = self.engine, self.engine.post
        now = time.time()
        post.count_step(batch)
        outputs = []
        row = 0
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
            r, row = row, row + sample_mask[i]
            if seq.is_finished:  # finished when step N's token arrived; its blocks are free already
                self.num_dropped_tokens += 1
                continue
            post.book_computed(seq, n)  # before the placeholder: digests cover known tokens
            if sample_mask[i]:
                seq.token_ids.append(PLACEHOLDER)
                step.rows[seq] = r
                mt = seq.params.max_tokens
                seq.length_capped = (mt is not None and seq.num_output_tokens >= mt) \
                    or seq.num_tokens >= eng.max_model_len
            elif done[i]:  # max_tokens 0: prefill only
                post.finish(seq, "length")
                outputs.append(post.output(seq))
        if step is not None and step.rows:
            self.pending = step
        return outputs
