"""What the engine hands back for each request, step by step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str


def logprobs_to_wire(entry: dict[int, Logprob]) -> list[list[Any]]:
    """One position's logprob dict (insertion order kept) as [ids, logprobs, ranks] (the engine-core
    IPC form, ``engine/core/ipc.py``)."""
    return [list(entry), [float(v.logprob) for v in entry.values()], [int(v.rank) for v in entry.values()]]


def logprobs_from_wire(triple: list[list[Any]], decode_one: Callable[[int], str]) -> dict[int, Logprob]:
    """``logprobs_to_wire``'s inverse; ``decode_one`` gives each token's text."""
    ids, lps, ranks = triple
    return {t: Logprob(float(v), r, decode_one(t)) for t, v, r in zip(ids, lps, ranks)}


class Finishable:
    """``finished`` once a ``finish_reason`` is set (a choice's outputs, a streamed chunk)."""

    finish_reason: str | None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class CompletionOutput(Finishable):
    index: int
    text: str  # all text generated so far (stop string excluded)
    token_ids: list[int]
    finish_reason: str | None = None  # None while running; "stop", "length", "abort" or "error"
    stop_reason: int | str | None = None  # the stop string or stop token id that matched
    logprobs: list[dict[int, Logprob]] | None = None  # one dict per generated token
    delta_text: str = ""  # text new since the previous RequestOutput of this request
    delta_token_ids: list[int] = field(default_factory=list)


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    # one entry per prompt token (the first is None: nothing precedes it), when asked for
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    error: str | None = None  # why the request failed (finish_reason "error"), else None
    # prefill/decode disaggregation: what a producer's finished request tells the consumer (vLLM's field)
    kv_transfer_params: dict | None = None
