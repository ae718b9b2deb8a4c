"""Request intake: from an API request (prompt, sampling parameters, priority, cache salt) to a
``Sequence`` the scheduler can queue, or a ValueError that names what is wrong and queues nothing.

``RequestLimits.check`` is pure (it reads only what never changes after the model is loaded), so any
thread may call it; the engine-core client runs the very same checks in the API-server process.
"""

from __future__ import annotations

import itertools
import operator
import secrets
from dataclasses import dataclass
from typing import Any

from tokenfab.engine.requests.sampling_params import SamplingParams
from tokenfab.engine.requests.sequence import BACKGROUND_PRIORITY, Sequence


def tokenize_prompt(tokenizer: Any, prompt: str | list[int]) -> tuple[str | None, list[int]]:
    """(the text, or None for a token-id prompt; its token ids)."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("this model has no tokenizer: give the prompt as token ids")
        try:
            return prompt, tokenizer.encode(prompt, add_special_tokens=True)
        except (TypeError, UnicodeError) as e:  # e.g. a lone UTF-16 surrogate ("\ud800")
            raise ValueError(f"prompt cannot be tokenized: {e}") from None
    try:
        return None, [operator.index(t) for t in prompt]  # ints, numpy/torch integer scalars
    except TypeError:
        raise ValueError("prompt token ids must be integers") from None


@dataclass(frozen=True)
class RequestLimits:
    """What makes a request unservable by the loaded model."""

    vocab_size: int
    max_model_len: int
    kv_cache_tokens: int

    def check(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raises ValueError whose message starts with the parameter's name."""
        params.validate()
        v = self.vocab_size
        ids = prompt_token_ids
        if not ids:
            raise ValueError("prompt is empty")
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < v for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {v})")
        n = len(ids)
        generates = params.max_tokens != 0
        if n + generates > self.max_model_len:
            raise ValueError(
                f"prompt has {n} tokens, but this model's context is {self.max_model_len} tokens"
                + (" (including at least one generated token)" if generates else "")
            )
        if n + generates > self.kv_cache_tokens:
            raise ValueError(f"prompt has {n} tokens, more than the KV cache holds ({self.kv_cache_tokens})")
        bad = [t for t in params.stop_token_ids or [] if not 0 <= t < v]
        if bad:
            raise ValueError(f"stop_token_ids must be in [0, {v}), got {bad[:5]}")
        bad = [t for t in params.logit_bias or {} if not 0 <= t < v]
        if bad:
            raise ValueError(f"logit_bias keys must be token ids in [0, {v}), got {bad[:5]}")


class RequestIntake:
    """Validates, tokenizes and seeds requests into ``Sequence``s (arrival order kept)."""

    def __init__(self, tokenizer: Any, limits: RequestLimits, scheduling_policy: str) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self.scheduling_policy = scheduling_policy
        self._arrivals = itertools.count()

    def new_sequence(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, priority: int,
        arrival_time: float | None, cache_salt: str | None, prompt_token_ids: list[int] | None,
    ) -> Sequence:
        """The request's ``Sequence``; ValueError if it cannot be served. ``prompt_token_ids``: the
        text prompt's ids when the caller tokenized it already."""
        if isinstance(priority, bool) or not isinstance(priority, int) or abs(priority) > 2**31 - 1:
            raise ValueError(f"priority must be an integer in [-2**31+1, 2**31-1], got {priority!r}")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a string, got {cache_salt!r}")
        if prompt_token_ids is not None:
            text, ids = (prompt if isinstance(prompt, str) else None), list(prompt_token_ids)
        else:
            text, ids = tokenize_prompt(self.tokenizer, prompt)
        self.limits.check(ids, params)
        # unseeded: OS entropy (two servers, or two runs, never share their "random" draws)
        base_seed = params.seed if params.seed is not None else secrets.randbits(63)
        if self.scheduling_policy != "priority" and priority != BACKGROUND_PRIORITY:
            priority = 0  # fcfs: every online request equal; background work stays background under any policy
        return Sequence(request_id, text, ids, params, base_seed, priority, next(self._arrivals), arrival_time,
                        cache_salt)
