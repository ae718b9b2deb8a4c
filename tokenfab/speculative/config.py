"""``--speculative-config``: which proposer, how many draft tokens, when to switch speculation off.

The JSON object has vLLM's shape and names::

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}

Keys: ``method`` ("ngram" | "suffix" | "draft_model" | "eagle3" | "mtp"), ``num_speculative_tokens``
(k, the most drafts per sequence and step), ``model`` (the draft model or head, for the methods that
need one), ``prompt_lookup_min`` / ``prompt_lookup_max`` (n-gram lengths matched), and
``disable_by_batch_size`` (vLLM's name: no speculation in a step with more decoding sequences than
this), and for "suffix" vLLM's ``suffix_decoding_max_tree_depth``, ``suffix_decoding_max_spec_factor``,
``suffix_decoding_min_token_prob``, ``suffix_decoding_max_cached_requests``. Unknown keys and
unsupported values are a ``ValueError`` naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from tokenfab.engine.requests.errors import parse_json_option

METHODS = ("ngram", "suffix", "draft_model", "eagle3", "mtp")
MAX_SPECULATIVE_TOKENS = 32


@dataclass
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4
    model: str | None = None
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    # no speculation in a step with more decoding sequences than this (CPU: verifying k extra tokens
    # per sequence stops being free once the step is compute-bound; see tokenfab bench spec)
    disable_by_batch_size: int = 32
    # suffix decoding (vLLM's names; tokenfab/speculative/suffix.py)
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_spec_factor: float = 2.0
    suffix_decoding_min_token_prob: float = 0.1
    suffix_decoding_max_cached_requests: int = 1000

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(METHODS)}; got {self.method!r}")
        if self.method in ("draft_model", "eagle3") and not self.model:
            raise ValueError(f"speculative_config.model is required for method {self.method!r} "
                             "(the draft model's directory / the EAGLE-3 head's folder)")
        if self.method == "mtp" and self.model:
            raise ValueError('speculative_config.model must not be set for method "mtp": the MTP layer comes '
                             "from the target's checkpoint")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"speculative_config.{name} must be a positive integer, got {v!r}")
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config.num_speculative_tokens must be at most {MAX_SPECULATIVE_TOKENS}, "
                             f"got {self.num_speculative_tokens}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"speculative_config.model must be a path string, got {self.model!r}")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """From the CLI's JSON string, a dict (``LLM(speculative_config={...})``, the engine-core
        process's JSON args) or a config; None, "" and "null" mean no speculation."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            if not value.strip() or value.strip() == "null":
                return None
            value = parse_json_option(value, "speculative_config")
            if value is None:
                return None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(map(repr, unknown))}; "
                             f"known: {', '.join(sorted(known))}")
        if "method" not in value:
            raise ValueError("speculative_config.method is required (one of " + ", ".join(METHODS) + ")")
        return cls(**value)
