"""From sampled token ids to what the user reads: incremental detokenization, stop strings (with the
hold-back of a tail that may begin one), logprob entries.

One code path for both ways the engine runs: ``LLMEngine`` (``engine/postprocess.py``) calls
``append_text`` / ``take_delta`` / ``logprob_entry`` on its ``Sequence`` when it detokenizes itself
(the offline ``LLM``, the in-thread server), and ``OutputProcessor`` calls the same functions on a
``TextState`` in the API-server process when the engine core runs in its own process and sends
token ids only. Both objects carry
the same attributes (``token_ids``, ``num_prompt_tokens``, ``prefix_offset``, ``read_offset``,
``output_text``, ``emitted_text_len``, ``emitted_token_len``, ``stop_reason``, ``params``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tokenfab.engine.requests.outputs import (
    CompletionOutput,
    Logprob,
    RequestMetrics,
    RequestOutput,
    logprobs_from_wire,
)
from tokenfab.engine.requests.sampling_params import SamplingParams
from tokenfab.engine.requests.sequence import Sequence, SequenceStatus
from tokenfab.tokenizer import detokenize_incrementally


def append_text(tokenizer: Any, seq: Any, skip: bool) -> bool:
    """Detokenize ``seq``'s newest token (already in ``seq.token_ids``) into ``seq.output_text``.
    ``skip``: the token is EOS or a stop token (never shown). True when a stop string ended the
    request (the text is cut and ``seq.stop_reason`` set); stop strings count only once
    ``min_tokens`` are generated (vLLM)."""
    if tokenizer is None or skip:
        return False
    p = seq.params
    new_text, seq.prefix_offset, seq.read_offset = detokenize_incrementally(
        tokenizer, seq.token_ids, seq.prefix_offset, seq.read_offset, p.skip_special_tokens
    )
    seq.output_text += new_text
    return bool(p.stop and new_text and len(seq.token_ids) - seq.num_prompt_tokens >= p.min_tokens
                and check_stop_strings(seq, len(new_text)))


def check_stop_strings(seq: Any, new_len: int) -> bool:
    """Whether a stop string ends in the last ``new_len`` characters (or straddles them)."""
    text = seq.output_text
    for stop in seq.params.stop:
        start = max(0, len(text) - new_len - len(stop) + 1)
        idx = text.find(stop, start)
        if idx != -1:
            keep = idx + len(stop) if seq.params.include_stop_str_in_output else idx
            seq.output_text = text[:keep]
            seq.stop_reason = stop
            return True
    return False


def visible_text(seq: Any, finished: bool) -> tuple[str, str]:
    """(text shown so far, its part new since the last call); while running, a tail that could be
    the start of a stop string is held back."""
    text = seq.output_text
    if not finished and seq.params.stop:
        text = text[: max(seq.emitted_text_len, len(text) - max(len(s) for s in seq.params.stop) + 1)]
    delta = text[seq.emitted_text_len :]
    seq.emitted_text_len = len(text)
    return text, delta


def take_delta(seq: Any, finished: bool) -> tuple[str, str, list[int]]:
    """(text shown so far, its new part, the token ids new since the last call): what one
    ``RequestOutput`` carries; marks them emitted."""
    text, delta_text = visible_text(seq, finished)  # holds back a possible stop-string prefix
    delta_ids = seq.token_ids[seq.num_prompt_tokens + seq.emitted_token_len :]
    seq.emitted_token_len = len(seq.token_ids) - seq.num_prompt_tokens
    return text, delta_text, delta_ids


def request_output(seq: Sequence) -> RequestOutput:
    """The engine's output for ``seq`` now (text and token ids so far, what is new since the last)."""
    finished = seq.status == SequenceStatus.FINISHED
    text, delta_text, delta_ids = take_delta(seq, finished)
    out = CompletionOutput(
        index=0,
        text=text,
        token_ids=seq.output_token_ids,  # a fresh slice already
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
        logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
        delta_text=delta_text,
        delta_token_ids=delta_ids,
    )
    metrics = RequestMetrics(seq.arrival_time, seq.first_scheduled_time, seq.first_token_time, seq.finished_time)
    return RequestOutput(
        seq.request_id, seq.prompt, seq.prompt_token_ids, [out], finished,
        seq.num_cached_tokens, metrics, seq.prompt_logprobs, seq.error,
    )


def logprob_entry(token: int, lp: tuple, decode_one: Callable[[int], str]) -> dict[int, Logprob]:
    """The sampler's (logprob, rank, [(alt, logprob)...]) of ``token`` as a logprob dict: the top
    alternatives by rank, then the chosen token if it is not among them."""
    entry = {tok: Logprob(v, r + 1, decode_one(tok)) for r, (tok, v) in enumerate(lp[2])}
    entry.setdefault(token, Logprob(lp[0], lp[1], decode_one(token)))
    return entry


class TokenTexts:
    """Each token's text alone (the logprob entries' ``decoded_token``), cached."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        if self.tokenizer is None:
            return ""
        text = self._cache.get(token)
        if text is None:
            text = self._cache[token] = self.tokenizer.decode([token])
        return text


class TextState:
    """One request's text state in the API-server process (the core sends token ids only)."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.request_id = request_id
        self.params = params
        self.prompt_token_ids = prompt_token_ids
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.prefix_offset = max(len(prompt_token_ids) - 6, 0)
        self.read_offset = len(prompt_token_ids)
        self.output_text = ""
        self.emitted_text_len = 0
        self.emitted_token_len = 0
        self.stop_reason: int | str | None = None
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None
        self.num_cached_tokens = 0


class OutputProcessor:
    """The API-server side of the engine core: token ids in, ``RequestOutput``s (text, stop strings,
    logprob texts) out, exactly as ``LLMEngine`` builds them when it detokenizes itself. A request a
    stop string ended here is reported in ``stopped`` so the caller aborts it in the core (whose
    later tokens for it are dropped)."""

    def __init__(self, tokenizer: Any, eos_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.decode_one = TokenTexts(tokenizer)
        self.states: dict[str, TextState] = {}

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.states[request_id] = TextState(request_id, prompt_token_ids, params)

    def remove(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def process(self, request_id: str, new_ids: list[int], logprobs: list | None, finish_reason: str | None,
                stop_reason: int | str | None, error: str | None, num_cached_tokens: int,
                prompt_logprobs: list | None, stopped: list[str],
                kv_transfer_params: dict | None = None) -> RequestOutput | None:
        """One output record of the core (see ``ipc``); None for a request no longer tracked."""
        st = self.states.get(request_id)
        if st is None:
            return None
        st.num_cached_tokens = num_cached_tokens
        if prompt_logprobs is not None and st.prompt_logprobs is None:
            st.prompt_logprobs = [None if t is None else logprobs_from_wire(t, self.decode_one)
                                  for t in prompt_logprobs]
        p = st.params
        for k, token in enumerate(new_ids):
            st.token_ids.append(token)
            if st.logprobs is not None and logprobs is not None and k < len(logprobs):
                st.logprobs.append(logprobs_from_wire(logprobs[k], self.decode_one))
            skip = token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids)
            if append_text(self.tokenizer, st, skip):
                st.finish_reason = "stop"
                stopped.append(request_id)
                break
        if st.finish_reason is None and finish_reason is not None:
            st.finish_reason = finish_reason
            st.stop_reason = stop_reason
            st.error = error
        finished = st.finish_reason is not None
        text, delta_text, delta_ids = take_delta(st, finished)
        if finished:
            self.states.pop(request_id, None)
        out = CompletionOutput(
            index=0, text=text, token_ids=st.token_ids[st.num_prompt_tokens :], finish_reason=st.finish_reason,
            stop_reason=st.stop_reason, logprobs=st.logprobs,  # the live list: the caller reads its tail
            delta_text=delta_text, delta_token_ids=delta_ids,
        )
        return RequestOutput(request_id, None, st.prompt_token_ids, [out], finished, st.num_cached_tokens,
                             None, st.prompt_logprobs, st.error, kv_transfer_params)
