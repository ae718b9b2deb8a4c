"""What the engine asks of a proposer: draft tokens that continue a sequence, and a hook to forget it.

A proposer only guesses; the target model's verify forward and ``spec.accept`` decide what stands,
so a bad guess costs time, never correctness. ``propose`` sees the sequence's known tokens
(``seq.token_ids``: prompt + output, every one of them real: the engine never asks while a token is
still pending on the device) and returns at most ``k`` ids; an empty list means "no guess" and that
sequence is decoded plainly in the step.

Model-based proposers (``model_based = True``: ``DraftModelProposer``, ``Eagle3Proposer``,
``MtpProposer``) have another shape, used by ``spec.step.SpecDecoder``: ``kv_bytes_per_token`` and
``bind_cache(block_size, num_blocks)`` (their paged cache, indexed by the target's block tables),
``execute(runner, batch, seqs, counts)`` (the target's forward, which they follow) and
``draft(seqs, ks) -> (drafts, q per sequence or None)`` after scheduling.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from tokenfab.engine.requests.sequence import Sequence


@runtime_checkable
class Proposer(Protocol):
    def propose(self, seq: Sequence, k: int) -> list[int]:
        """At most ``k`` draft token ids continuing ``seq.token_ids``."""
        ...

    def release(self, request_id: str) -> None:
        """The request finished or was aborted: drop any state kept for it."""
        ...
