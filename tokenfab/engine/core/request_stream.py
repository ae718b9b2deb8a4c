"""One API request's view of the async engine: its choices and the merged stream of their outputs.

``RequestStream`` lives on the caller's event loop; the engine thread hands it ``StreamChunk``s (or an
exception) with ``call_soon_threadsafe``. A request with ``n > 1`` (or several prompts) is one
``Choice`` per engine request (``{id}-{i}``; seeded requests get ``seed + i``; grammar constraints
cloned), merged back here under their choice index.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from tokenfab.engine.requests.lora_request import LoRARequest
from tokenfab.engine.requests.outputs import Finishable, Logprob, RequestOutput
from tokenfab.engine.requests.sampling_params import SEED_MAX, SamplingParams

PromptType = str | list[int]


@dataclass
class StreamChunk(Finishable):
    """What one engine step produced for one choice of a request."""

    index: int  # choice index (prompt_index * n + i)
    prompt_index: int
    delta_text: str
    delta_token_ids: list[int]
    delta_logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # the prompt's logprobs (first entry None), on the first chunk of a choice that asked for them
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # Set on the finishing chunk only: the whole output, as the engine reports it.
    text: str | None = None
    token_ids: list[int] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finished_time: float | None = None
    kv_transfer_params: dict | None = None  # prefill/decode disaggregation: a producer's answer to the consumer


@dataclass
class Choice:
    """One engine request (one choice)."""

    engine_id: str
    stream: RequestStream
    index: int
    prompt_index: int
    prompt: PromptType
    params: SamplingParams
    priority: int
    cache_salt: str | None = None
    lora_request: LoRARequest | None = None  # multi-LoRA: the adapter this choice runs with
    num_tokens: int = 0
    first_token_time: float | None = None
    sent_prompt_logprobs: bool = False


class RequestStream:
    """The merged output stream of one API request: an async iterator of ``StreamChunk``."""

    def __init__(self, on_abort: Callable[[RequestStream], None], request_id: str, num_choices: int,
                 loop: asyncio.AbstractEventLoop, arrival_time: float | None = None) -> None:
        self._on_abort = on_abort  # hands the abort to the engine thread (``AsyncEngine``)
        self.request_id = request_id
        self.num_choices = num_choices
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self._loop = loop
        self._queue: asyncio.Queue[StreamChunk | BaseException] = asyncio.Queue()
        self._accepted: asyncio.Future[None] = loop.create_future()
        self._remaining = num_choices
        self.finished = False
        self.aborted = False
        self.subs: list[Choice] = []

    # Called on the event loop (scheduled from the engine thread).
    def _set_accepted(self, error: BaseException | None) -> None:
        if self._accepted.done():
            return
        if error is None:
            self._accepted.set_result(None)
        else:
            self._accepted.set_exception(error)
            self._accepted.exception()  # mark retrieved: no "never retrieved" warning if unawaited

    def _put(self, item: StreamChunk | BaseException) -> None:
        if isinstance(item, StreamChunk) and item.finished:
            self._remaining -= 1
            if self._remaining <= 0:
                self.finished = True
        elif isinstance(item, BaseException):
            self.finished = True
            self._set_accepted(item)
        self._queue.put_nowait(item)

    async def wait_accepted(self) -> None:
        """Wait until the engine took every choice; re-raises its ValueError for bad requests."""
        await self._accepted

    def __aiter__(self) -> AsyncIterator[StreamChunk]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[StreamChunk]:
        remaining = self.num_choices
        while remaining > 0:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                remaining -= 1
            yield item

    def abort(self, error: BaseException | None = None) -> None:
        """Abort the choices still running (client went away). Idempotent. With ``error``, a
        consumer still iterating gets it raised instead of waiting for chunks that never come."""
        if not self.finished and not self.aborted:
            self.aborted = True
            self._on_abort(self)
            if error is not None:
                self._queue.put_nowait(error)


def next_chunk(sub: Choice, out: RequestOutput, now: float) -> StreamChunk:
    """The chunk of one engine output for its choice ``sub`` (whose token count and first-token
    time it updates); the finishing chunk carries the whole output."""
    co = out.outputs[0]
    delta_ids = list(co.delta_token_ids)
    if delta_ids and sub.first_token_time is None:
        sub.first_token_time = now
    sub.num_tokens += len(delta_ids)
    delta_lp = None
    if co.logprobs is not None and delta_ids:
        delta_lp = list(co.logprobs[-len(delta_ids):])
    chunk = StreamChunk(
        index=sub.index,
        prompt_index=sub.prompt_index,
        delta_text=co.delta_text,
        delta_token_ids=delta_ids,
        delta_logprobs=delta_lp,
        num_prompt_tokens=len(out.prompt_token_ids),
        num_cached_tokens=int(out.num_cached_tokens or 0),
        arrival_time=sub.stream.arrival_time,
        first_token_time=sub.first_token_time,
    )
    plp = getattr(out, "prompt_logprobs", None)
    if plp is not None and not sub.sent_prompt_logprobs:
        chunk.prompt_logprobs = plp
        sub.sent_prompt_logprobs = True
    if out.finished or co.finish_reason is not None:
        chunk.finish_reason = co.finish_reason or "stop"
        chunk.stop_reason = co.stop_reason
        chunk.text = co.text
        chunk.token_ids = list(co.token_ids)
        chunk.finished_time = now
        chunk.kv_transfer_params = getattr(out, "kv_transfer_params", None)
    return chunk


def deliver(items: list[tuple[RequestStream, StreamChunk | BaseException]]) -> None:
    for stream, chunk in items:
        stream._put(chunk)


def make_choices(stream: RequestStream, prompts: list[PromptType], params: SamplingParams, priority: int,
                 cache_salt: str | None, lora_request: LoRARequest | None = None) -> list[Choice]:
    """One ``Choice`` per prompt and per ``n``: choice index = prompt_index * n + i; engine request id
    ``{id}-{index}`` (the stream's id alone when there is one choice)."""
    n = max(1, int(params.n))
    total = n * len(prompts)
    subs: list[Choice] = []
    for p_idx, prompt in enumerate(prompts):
        for i in range(n):
            index = p_idx * n + i
            sub_params = choice_params(params, i, clone_constraint=index > 0)
            engine_id = stream.request_id if total == 1 else f"{stream.request_id}-{index}"
            subs.append(Choice(engine_id, stream, index, p_idx, prompt, sub_params, priority, cache_salt,
                               lora_request))
    return subs


def choice_params(params: SamplingParams, i: int, clone_constraint: bool) -> SamplingParams:
    """The engine-level params of choice ``i``: n=1, seed+i, and its own grammar matcher."""
    constraint = params.constraint
    if constraint is not None and clone_constraint:
        clone = getattr(constraint, "clone", None)
        if clone is None:
            raise ValueError("this constraint cannot be shared by several choices (n > 1)")
        spec = getattr(constraint, "spec_json", None)  # what an engine-core process compiles it from
        constraint = clone()
        if spec is not None:
            constraint.spec_json = spec
    seed = (params.seed + i) % (SEED_MAX + 1) if params.seed is not None else None
    if params.n == 1 and seed == params.seed and constraint is params.constraint:
        return params
    return dataclasses.replace(params, n=1, seed=seed, constraint=constraint)
