"""Per-request generation parameters (names follow vLLM's, which users already know).

``validate()`` checks what can be checked without the model (types, ranges, bounds that keep every
integer inside what the engine holds: int32 for counts, int63 for seeds); ``LLMEngine.check_request``
checks the rest against the loaded model (token ids inside the vocabulary, lengths). ValueError
messages start with the parameter's name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol


class LogitsConstraint(Protocol):
    """A per-request constraint on the next token (grammar-constrained decoding).

    The engine calls ``mask_logits`` on the request's [V] logits row before sampling
    (it must set forbidden tokens to -inf in place) and ``accept_token`` with the token
    sampled. ``is_terminated`` tells the engine the constraint reached an accepting end
    and generation should stop (finish reason "stop").
    """

    def mask_logits(self, logits: object) -> None: ...

    def accept_token(self, token_id: int) -> None: ...

    def is_terminated(self) -> bool: ...


INT32_MAX = 2**31 - 1
SEED_MAX = 2**63 - 1
MAX_N = 128
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0


def _int(name: str, value: object, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value}")
    return value


def _float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return float(value)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None: up to the context length; 0: prefill (and score) only
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives returned with each token
    # prompt token logprobs with k top alternatives (first prompt token: None); None: off
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None  # token id -> bias in [-100, 100], added to the logits first
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # speculative decoding may be used for this request when the engine has it on (False: opt out)
    speculative: bool = True
    constraint: LogitsConstraint | None = field(default=None, repr=False, compare=False)
    # prefill/decode disaggregation: vLLM's kv_transfer_params of the request (engine/kv_transfer/pd_params.py
    # checks them; they travel as given, a JSON object)
    kv_transfer_params: dict | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and not isinstance(self.stop, (list, tuple)):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        self.stop = list(self.stop or [])
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None or (isinstance(self.top_k, int) and not isinstance(self.top_k, bool) and self.top_k < 0):
            self.top_k = 0
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a mapping of token id to bias, got {self.logit_bias!r}")
            self.logit_bias = {_bias_key(k): v for k, v in self.logit_bias.items()} or None
        self.validate()

    def validate(self) -> None:
        """Raise ValueError with a message naming the parameter for values we cannot serve."""
        _int("n", self.n, 1, MAX_N)
        if _float("temperature", self.temperature) < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < _float("top_p", self.top_p) <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _int("top_k", self.top_k, 0, INT32_MAX)  # above the vocabulary: off (clamped when sampling)
        if not 0.0 <= _float("min_p", self.min_p) <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _int("seed", self.seed, 0, SEED_MAX)
        if self.max_tokens is not None:
            _int("max_tokens", self.max_tokens, 0, INT32_MAX)
        _int("min_tokens", self.min_tokens, 0, INT32_MAX)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if not -2.0 <= _float("presence_penalty", self.presence_penalty) <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= _float("frequency_penalty", self.frequency_penalty) <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if _float("repetition_penalty", self.repetition_penalty) <= 0:
            raise ValueError(f"repetition_penalty must be positive, got {self.repetition_penalty}")
        if self.logprobs is not None:
            _int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        if not isinstance(self.speculative, bool):
            raise ValueError(f"speculative must be a boolean, got {self.speculative!r}")
        for t in self.stop_token_ids or []:
            _int("stop_token_ids", t, 0, INT32_MAX)
        for st in self.stop or []:
            if not isinstance(st, str) or not st:
                raise ValueError(f"stop must hold non-empty strings, got {st!r}")
        for tok, bias in (self.logit_bias or {}).items():
            _int("logit_bias", tok, 0, INT32_MAX)
            if not -MAX_LOGIT_BIAS <= _float("logit_bias", bias) <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for token {tok}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _bias_key(key: object) -> int:
    """OpenAI sends logit_bias keys as strings ("50256"); accept those and ints."""
    if isinstance(key, str):
        try:
            return int(key.strip())
        except ValueError:
            raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
    if isinstance(key, bool) or not isinstance(key, int):
        raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
    return key
