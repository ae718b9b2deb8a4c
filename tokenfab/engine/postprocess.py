"""After the forward: book what a step computed, append the sampled tokens with the stop checks,
finish or fail requests, and build their ``RequestOutput``s.

Shared by the synchronous step (``LLMEngine.run_batch``) and the overlapped one
(``engine/overlap.py``), so both stop a request at exactly the same token. The text side
(detokenization, stop strings, logprob texts) is ``output_processor``'s, the same code the API
server runs when the engine core sends token ids only.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from tokenfab.engine.output_processor import TokenTexts, append_text, logprob_entry, request_output
from tokenfab.engine.requests.block_manager import BlockManager
from tokenfab.engine.requests.errors import raise_if_fatal
from tokenfab.engine.requests.outputs import RequestOutput
from tokenfab.engine.requests.scheduler import ScheduledBatch, Scheduler
from tokenfab.engine.requests.sequence import Sequence
from tokenfab.speculative.step import SpecDecoder

log = logging.getLogger("tokenfab")


class Postprocessor:
    """Per-request bookkeeping after a step, and the engine's token counters."""

    def __init__(self, scheduler: Scheduler, block_manager: BlockManager, spec: SpecDecoder | None,
                 tokenizer: Any, detokenize: bool, eos_token_ids: list[int], max_model_len: int,
                 seqs: dict[str, Sequence]) -> None:
        self.scheduler = scheduler
        self.block_manager = block_manager
        self.spec = spec
        self.tokenizer = tokenizer
        # detokenize=False (the engine-core process): token ids only; the API server makes the text
        self.detokenize = detokenize
        self.decode_one = TokenTexts(tokenizer if detokenize else None)  # logprob entry texts
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.seqs = seqs  # the engine's live requests by id: a finished one leaves with its last output
        self.generation_tokens_total = 0
        self.computed_prompt_tokens_total = 0
        self.num_steps = 0
        self.last_step = (0, 0, 0)  # (sequences, prefill tokens, decode tokens)

    def count_step(self, batch: ScheduledBatch) -> None:
        self.num_steps += 1
        self.last_step = (len(batch.seqs), batch.num_prefill_tokens, batch.num_decode_tokens)

    def book_computed(self, seq: Sequence, n: int) -> None:
        """``n`` more of ``seq``'s tokens have their K/V in the cache; its full blocks join the prefix cache."""
        if seq.num_computed_tokens < seq.num_prompt_tokens:
            self.computed_prompt_tokens_total += min(n, seq.num_prompt_tokens - seq.num_computed_tokens)
        seq.num_computed_tokens += n
        self.block_manager.commit_full_blocks(seq)

    def append_sampled(self, seq: Sequence, result: list[tuple] | str, num_drafts: int) -> None:
        """One sequence's sampling result: its tokens (the accepted drafts and the target's token
        when it verified ``num_drafts`` drafts) or the message of its failed sampling."""
        if isinstance(result, str):
            return self.fail(seq, result)
        try:
            for token, lp in result:  # stops where plain decoding would
                self.append_token(seq, token, lp)
                if seq.is_finished:
                    break
            if num_drafts and not seq.is_finished:  # all of result appended
                self.spec.commit(seq, len(result))
        except Exception as e:
            raise_if_fatal(e)
            self.fail(seq, f"processing the sampled token failed: {e}")

    def append_token(self, seq: Sequence, token: int, lp: Any) -> None:
        """Append one sampled token and run the stop checks (vLLM's order)."""
        now = time.time()
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.token_ids.append(token)
        self.generation_tokens_total += 1
        p = seq.params
        if p.constraint is not None:
            p.constraint.accept_token(token)
        if lp is not None and seq.logprobs is not None:
            seq.logprobs.append(logprob_entry(token, lp, self.decode_one))
        stop_token = token in p.stop_token_ids
        is_eos = not p.ignore_eos and token in self.eos_token_ids
        if self.detokenize and append_text(self.tokenizer, seq, is_eos or stop_token):
            return self.finish(seq, "stop")
        if seq.num_output_tokens >= p.min_tokens:
            if is_eos:
                return self.finish(seq, "stop", token)
            if stop_token:
                return self.finish(seq, "stop", token)
        if p.constraint is not None and p.constraint.is_terminated():  # it accepts nothing more: min_tokens yields
            return self.finish(seq, "stop")
        if p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens:
            return self.finish(seq, "length")
        if seq.num_tokens >= self.max_model_len:
            return self.finish(seq, "length")

    def finish(self, seq: Sequence, reason: str, stop_token: int | None = None) -> None:
        seq.finish_reason = reason
        if stop_token is not None:
            seq.stop_reason = stop_token
        seq.finished_time = time.time()
        self.scheduler.finish(seq)
        if self.spec is not None:
            self.spec.release(seq)

    def fail(self, seq: Sequence, message: str) -> None:
        log.warning("request %s failed: %s", seq.request_id, message)
        seq.error = message
        self.finish(seq, "error")

    def output(self, seq: Sequence) -> RequestOutput:
        out = request_output(seq)
        if out.finished:
            self.seqs.pop(seq.request_id, None)
        return out

    def unschedulable(self) -> list[RequestOutput]:
        """Nothing fits although nothing runs: the head request exceeds the whole cache."""
        if self.scheduler.running or not self.scheduler.waiting:
            return []
        seq = self.scheduler.waiting[0]
        self.finish(seq, "length")  # also releases its proposer state
        return [self.output(seq)]
