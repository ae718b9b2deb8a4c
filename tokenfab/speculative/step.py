"""The speculative step: drafts before scheduling, one verify forward, acceptance, KV rollback.

How a step runs with speculation on (``LLMEngine.step``):

1. ``SpecDecoder.propose`` (before the scheduler runs) gives each eligible decoding sequence up to
   k draft ids in ``seq.spec_token_ids``. k comes from the request's measured acceptance and the
   batch's size (``draft_budget``); a step with more decoding sequences than
   ``disable_by_batch_size`` proposes nothing, and the proposers return nothing when they have no
   guess, so those sequences decode plainly in the same step.
   Model-based proposers (draft model, EAGLE-3, MTP: ``speculative/draft_model.py``,
   ``speculative/feature_draft.py``) put k placeholders there; ``fill_drafts`` replaces them with the
   draft module's tokens once the scheduler has allocated their blocks (the draft caches use the
   target's block tables), and ``execute`` runs the target's forward so the draft module follows
   it (its K/V, or the target's features).
2. The scheduler allocates KV slots for the k + 1 tokens (the last real token and the drafts; a
   draft never costs a preemption: without the blocks, the sequence drops its drafts), and
   ``ModelRunner.prepare`` builds the flat batch: k + 1 query tokens for such a sequence, whose k + 1
   rows all get logits. The forward is the same one chunked prefill uses (paged cache, the
   prefill/mixed attention path).
3. ``SpecDecoder.sample`` samples the plain rows as usual and hands the verify rows to
   ``spec.accept.accept_tokens`` (lossless: greedy = longest prefix matching the argmax + the
   target's token; sampled = the rejection rule).
4. The engine appends the accepted tokens one at a time through its normal append path, so EOS,
   stop ids, stop strings, max_tokens and the context length cut the run exactly where plain
   decoding would stop; then ``SpecDecoder.commit`` rolls back the rejected drafts: the computed
   count covers only accepted tokens, the prefix cache hashes only blocks full of accepted tokens,
   and the tail blocks that held only rejected drafts go back to the free list.

Per-request opt-out: ``SamplingParams.speculative=False``, and every request whose logits the
sampler edits or whose logprobs are returned (logit_bias, penalties, grammar, unmet min_tokens,
logprobs, prompt logprobs) is decoded plainly: the acceptance rule would need per-position edits.

Overlap scheduling: a step that may speculate runs synchronously (the pending token must be on the
host for the proposer; like a grammar row), see ``OverlapScheduler.step``. CUDA graphs: decode-only
steps still replay the captured graphs; a verify step (k + 1 query tokens) runs eagerly like any
mixed step, so switching speculation on or off never changes the graph mode or recaptures.
"""

from __future__ import annotations

import logging
import time

import torch

from tokenfab.engine.requests.errors import raise_if_fatal
from tokenfab.engine.requests.sequence import Sequence, SequenceStatus
from tokenfab.engine.runner.isolation import isolated_sample
from tokenfab.kernels.batch_invariant import batch_invariant_mode
from tokenfab.speculative.accept import accept_tokens
from tokenfab.speculative.config import SpeculativeConfig
from tokenfab.speculative.draft_model import DraftModelProposer
from tokenfab.speculative.feature_draft import Eagle3Proposer, MtpProposer
from tokenfab.speculative.ngram import NgramProposer
from tokenfab.speculative.proposer import Proposer
from tokenfab.speculative.state_rollback import RecurrentStateRollback, supports_rollback
from tokenfab.speculative.suffix import SuffixProposer
from tokenfab.speculative.target import TargetEngine

log = logging.getLogger("tokenfab")

_DECAY = 0.7  # weight of the past in a request's acceptance estimate
_PRIOR = (1.0, 2.0)  # (accepted, trials) pseudo-counts: 0.5 before anything is measured
_COST_PER_SEQ = 0.05  # a draft must be accepted with probability >= this x batch size to be proposed


def make_proposer(config: SpeculativeConfig, engine: TargetEngine | None = None) -> Proposer:
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "suffix":
        return SuffixProposer(config)
    if engine is None:
        raise ValueError(f"speculative_config.method {config.method!r} needs the engine's target model")
    if config.method == "draft_model":
        return DraftModelProposer(config, engine)
    return (Eagle3Proposer if config.method == "eagle3" else MtpProposer)(config, engine)


def eligible(seq: Sequence) -> bool:
    """Whether this request may be speculated at all (the per-request opt-out path)."""
    p = seq.params
    return (
        p.speculative
        and not seq.edits_logits
        and seq.num_output_tokens >= p.min_tokens
        and p.logprobs is None
        and seq.prompt_logprobs is None
    )


class SpecDecoder:
    """Owns the proposer, the per-request acceptance estimates and the speculation counters."""

    def __init__(self, config: SpeculativeConfig, engine: TargetEngine, proposer: Proposer | None = None) -> None:
        self.config = config
        self.engine = engine
        self.proposer: Proposer = proposer or make_proposer(config, engine)
        # a draft model / EAGLE-3 head / MTP layer: drafts after scheduling, from its own paged cache
        self.model_based = bool(getattr(self.proposer, "model_based", False))
        if self.model_based and getattr(engine, "tp", None) is not None:
            raise ValueError(f"speculative_config.method {config.method!r} does not run with tensor parallelism yet")
        self._q: dict[str, torch.Tensor] = {}  # request id -> q [k, V] of its drafts (sampled requests)
        self.rollback: RecurrentStateRollback | None = None  # hybrid cache: rejected drafts out of the states
        self._overlap_seconds = 0.0  # draft passes inside verify steps (counted as draft time)
        self._acc: dict[str, tuple[float, float]] = {}  # request id -> decayed (accepted, trials)
        # counters (EngineStats / metrics)
        self.num_draft_tokens = 0  # drafts verified
        self.num_accepted_tokens = 0  # of which accepted
        self.num_verified = 0  # sequence-steps that verified drafts
        self.num_spec_steps = 0  # steps with at least one verify row
        self.draft_seconds = 0.0
        self.verify_seconds = 0.0

    # ---- the draft module's cache (model-based proposers) -------------------------------
    def kv_bytes_per_token(self) -> int:
        """Draft cache bytes a token takes (budgeted with the target's: same blocks, same slots)."""
        return self.proposer.kv_bytes_per_token() if self.model_based else 0

    def bind_cache(self, block_size: int, num_blocks: int) -> None:
        if self.model_based:
            self.proposer.bind_cache(block_size, num_blocks)

    # ---- 1. drafts ---------------------------------------------------------------------
    def acceptance(self, request_id: str) -> float:
        """The request's estimated per-draft acceptance probability."""
        a, n = self._acc.get(request_id, (0.0, 0.0))
        return (a + _PRIOR[0]) / (n + _PRIOR[1])

    def draft_budget(self, seq: Sequence, batch_size: int) -> int:
        """k for this sequence now: the most drafts whose chance of all being accepted (alpha^j)
        pays for their verify cost, which grows with the batch (a verify row is nearly free in a
        memory-bound step, not in a compute-bound one); never past max_tokens or the context."""
        k = self.config.num_speculative_tokens
        p = seq.params
        if p.max_tokens is not None:
            k = min(k, p.max_tokens - seq.num_output_tokens - 1)
        k = min(k, self.engine.max_model_len - seq.num_tokens - 1)
        alpha, need = self.acceptance(seq.request_id), _COST_PER_SEQ * batch_size
        j, chance = 0, 1.0
        while j < k and chance * alpha >= need:
            j, chance = j + 1, chance * alpha
        return j

    def would_speculate(self, running: list[Sequence]) -> bool:
        """Cheap pre-check (no tokens read): must this step take the synchronous speculative path?
        Model-based proposers always do: their caches follow every target forward."""
        if self.model_based:  # every forward, prefills included (waiting requests are admitted this step)
            return bool(running) or bool(self.engine.scheduler.waiting)
        return self._may_draft(running)

    def _may_draft(self, running: list[Sequence]) -> bool:
        n = len(running)
        return 0 < n <= self.config.disable_by_batch_size and any(eligible(s) for s in running)

    def propose(self, running: list[Sequence]) -> None:
        """Set ``spec_token_ids`` on every running sequence (empty: a plain decode this step)."""
        t0 = time.perf_counter()
        for s in running:
            s.spec_token_ids = []
        if not self._may_draft(running):
            for s in running:
                self._decay(s.request_id)
            return
        b = len(running)
        # drafts may use at most half the step's token budget, the rest stays for prompt chunks
        room = max(0, self.engine.scheduler.max_num_batched_tokens - b) // 2
        for s in running:
            k = 0
            if room > 0 and s.status == SequenceStatus.RUNNING and s.is_decoding and not s.length_capped \
                    and eligible(s):
                k = min(self.draft_budget(s, b), room)
            if k <= 0:
                self._decay(s.request_id)
                continue
            if self.model_based:  # placeholders: the drafts come after scheduling (fill_drafts)
                s.spec_token_ids = [0] * k
                room -= k
                continue
            draft = [int(t) for t in self.proposer.propose(s, k)[:k]]
            if any(t < 0 or t >= self.engine.vocab_size for t in draft):
                log.warning("proposer returned out-of-vocabulary drafts for %s; ignored", s.request_id)
                draft = []
            s.spec_token_ids = draft
            room -= len(draft)
        self.draft_seconds += time.perf_counter() - t0

    def _decay(self, request_id: str) -> None:
        """Not measured this step: the estimate drifts back to the prior, so a request whose drafts
        were poor gets probed again later."""
        acc = self._acc.get(request_id)
        if acc is not None:
            self._acc[request_id] = (acc[0] * _DECAY, acc[1] * _DECAY)

    # ---- 2b. model-based drafts, after scheduling -------------------------------------
    def fill_drafts(self, seqs: list[Sequence]) -> None:
        """Replace the placeholders the scheduler kept (its blocks are allocated now) with the
        draft module's tokens; a feature-fed head also catches up on every scheduled sequence."""
        if not self.model_based or not seqs:
            return
        t0 = time.perf_counter()
        ks = [len(s.spec_token_ids) for s in seqs]
        try:
            with batch_invariant_mode(True):  # a self-draft's rows round as the target's decode rows do
                drafts, qs = self.proposer.draft(seqs, ks)
        except Exception as e:  # a draft is only a guess: verify placeholders (the last token) instead
            raise_if_fatal(e)
            log.warning("drafting for %d sequences failed (%r); their drafts are placeholders", len(seqs), e)
            drafts, qs = [[s.token_ids[-1]] * k for s, k in zip(seqs, ks)], [None] * len(seqs)
        for s, k, d, q in zip(seqs, ks, drafts, qs):
            if not k:
                continue
            if len(d) != k or any(t < 0 or t >= self.engine.vocab_size for t in d):  # a bug: guess instead
                log.warning("the draft module returned %d drafts for %d (or ids outside the vocabulary)", len(d), k)
                d, q = [s.token_ids[-1]] * k, None
            s.spec_token_ids = list(d)
            if q is not None:
                self._q[s.request_id] = q
        self.draft_seconds += time.perf_counter() - t0

    def execute(self, runner, fb, seqs: list[Sequence], counts: list[int]):
        """The target's forward for ``LLMEngine._execute``: (logits, prompt hidden states). With recurrent
        state (hybrid cache) the verifying slots are copied aside and the recurrent layers' inputs kept, so
        that rejected drafts can be taken out of the state after acceptance (``speculative/state_rollback.py``)."""
        # (positional state, DeepSeek-V4's rings, needs no rollback: rejected rows are written again)
        if self.rollback is None and getattr(runner, "state_caches", None) and supports_rollback(runner.model):
            self.rollback = RecurrentStateRollback(runner.model, runner.state_caches)
        plan = self.rollback.before_forward(fb, seqs, counts) if self.rollback is not None else []
        try:
            out = self._target_forward(runner, fb, seqs, counts)
        except BaseException:
            if plan:
                self.rollback.after_forward(plan, False)
            raise
        if plan:
            self.rollback.after_forward(plan, True)
        return out

    def _target_forward(self, runner, fb, seqs: list[Sequence], counts: list[int]):
        if not self.model_based:
            return runner.execute_scoring(fb)
        before = getattr(self.proposer, "observe_seconds", 0.0)
        with batch_invariant_mode(True):
            out = self.proposer.execute(runner, fb, seqs, counts)
        spent = getattr(self.proposer, "observe_seconds", 0.0) - before
        self.draft_seconds += spent
        if any(s.spec_token_ids for s in seqs):
            self._overlap_seconds += spent
        return out

    # ---- 3. sampling / acceptance ------------------------------------------------------
    def sample(self, seqs: list[Sequence], logits: torch.Tensor | None) -> list[list[tuple] | str]:
        """Per sampled sequence: [(token, logprob entry), ...] (1 .. k+1 tokens) or the error
        message of a sequence whose sampling failed. ``logits`` has k_i + 1 rows per sequence."""
        eng = self.engine
        ks = [len(s.spec_token_ids) for s in seqs]
        starts, r = [], 0
        for k in ks:
            starts.append(r)
            r += k + 1
        plain = [i for i, k in enumerate(ks) if k == 0]
        spec = [i for i, k in enumerate(ks) if k > 0]
        out: list[list[tuple] | str] = [[] for _ in seqs]
        if plain:
            rows = torch.tensor([starts[i] for i in plain], device=logits.device)
            plain_rows = isolated_sample(logits.index_select(0, rows), [seqs[i] for i in plain], eng.eos_token_ids)
            for i, res in zip(plain, plain_rows):
                out[i] = res if isinstance(res, str) else [res]
        if spec:
            rows = torch.tensor([starts[i] + j for i in spec for j in range(ks[i] + 1)], device=logits.device)
            verify = logits.index_select(0, rows)
            for i, res in zip(spec, self._accept([seqs[i] for i in spec], verify)):
                out[i] = res if isinstance(res, str) else [(t, None) for t in res]
            if self.rollback is not None:  # rejected drafts out of the recurrent states
                self.rollback.after_accept([seqs[i] for i in spec],
                                           [0 if isinstance(out[i], str) else len(out[i]) for i in spec])
        return out

    def _accept(self, seqs: list[Sequence], logits: torch.Tensor) -> list[list[int] | str]:
        """accept_tokens over the batch; on failure, sequence by sequence (to fail only the culprit)."""
        drafts = [s.spec_token_ids for s in seqs]
        eos = self.engine.eos_token_ids
        probs = self._draft_probs(seqs, logits)
        try:
            results: list[list[int] | str] = list(accept_tokens(logits, seqs, drafts, eos, probs))
        except Exception as e:
            raise_if_fatal(e)
            log.warning("accepting drafts of %d sequences failed (%r); one by one", len(seqs), e)
            results, r = [], 0
            for i, (s, d) in enumerate(zip(seqs, drafts)):
                try:
                    q = None if probs is None else probs[r - i : r - i + len(d)]
                    results.append(accept_tokens(logits[r : r + len(d) + 1], [s], [d], eos, q)[0])
                except Exception as e1:
                    raise_if_fatal(e1)
                    results.append(f"accepting draft tokens failed for this request: {e1}")
                r += len(d) + 1
        for s, d, res in zip(seqs, drafts, results):
            if isinstance(res, str):
                continue
            # accepted drafts: the common prefix of the emitted tokens and the drafts (the emitted run
            # may end on an accepted draft: cut at EOS); a rejection when a token differs from its draft
            m = 0
            while m < min(len(res), len(d)) and res[m] == d[m]:
                m += 1
            rejected = 1 if m < min(len(res), len(d)) else 0
            a, n = self._acc.get(s.request_id, (0.0, 0.0))
            self._acc[s.request_id] = (a * _DECAY + m, n * _DECAY + m + rejected)
            self.num_draft_tokens += len(d)
            self.num_accepted_tokens += m
            self.num_verified += 1
        return results

    def _draft_probs(self, seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor | None:
        """[sum k_i, V] q rows of the drafts (model-based proposers, when a request samples); None:
        point masses. A sequence without q (greedy) gets one-hot rows, which the greedy rule ignores."""
        qs = [self._q.pop(s.request_id, None) for s in seqs]
        if all(q is None for q in qs) or not any(s.params.temperature != 0.0 for s in seqs):
            return None
        rows = []
        for s, q in zip(seqs, qs):
            if q is None:
                q = torch.zeros(len(s.spec_token_ids), logits.shape[1], device=logits.device)
                q[torch.arange(len(s.spec_token_ids)), torch.tensor(s.spec_token_ids)] = 1.0
            rows.append(q.to(logits.device))
        return torch.cat(rows)

    # ---- 4. rollback -------------------------------------------------------------------
    def commit(self, seq: Sequence, num_emitted: int) -> None:
        """After ``num_emitted`` tokens of a verified sequence were appended (it is still running):
        the K/V of the last real token and the accepted drafts stand, that of the rejected drafts is
        dropped (their slots are overwritten later), and blocks holding only rejected drafts are freed."""
        seq.spec_token_ids = []
        seq.num_computed_tokens += num_emitted - 1  # the accepted drafts' K/V were written by the verify
        bm = self.engine.block_manager
        bm.trim(seq)
        bm.commit_full_blocks(seq)

    def release(self, seq: Sequence) -> None:
        seq.spec_token_ids = []
        self._acc.pop(seq.request_id, None)
        self._q.pop(seq.request_id, None)
        self.proposer.release(seq.request_id)
        if self.rollback is not None:
            self.rollback.release(seq.request_id)

    def stats(self) -> dict[str, float]:
        return {
            "spec_draft_tokens_total": self.num_draft_tokens,
            "spec_accepted_tokens_total": self.num_accepted_tokens,
            "spec_verified_total": self.num_verified,
            "spec_acceptance_rate": self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0,
            # tokens a verified sequence-step emits: accepted drafts + the target's own token
            "spec_mean_accepted_length": 1 + self.num_accepted_tokens / self.num_verified if self.num_verified else 0.0,
            "spec_draft_seconds_total": self.draft_seconds,
            "spec_verify_seconds_total": max(self.verify_seconds - self._overlap_seconds, 0.0),
        }
