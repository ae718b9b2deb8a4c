"""What the engine asks of a proposer: draft tokens that continue a sequence, and a hook to forget it.

A proposer only guesses; the target model's verify forward and ``spec.accept`` decide what stands,
so a bad guess costs time, never correctness. ``propose`` sees the sequence's known tokens
(``seq.token_ids``: prompt + output, every one of them real: the engine never asks while a token is
still pending on the device) and returns at most ``k`` ids; an empty list means "no guess" and that
sequence is decoded plainly in the step.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from tokenfab.engine.sequence import Sequence


@runtime_checkable
class Proposer(Protocol):
    def propose(self, seq: Sequence, k: int) -> list[int]:
        """At most ``k`` draft token ids continuing ``seq.token_ids``."""
        ...

    def release(self, request_id: str) -> None:
        """The request finished or was aborted: drop any state kept for it."""
        ...
