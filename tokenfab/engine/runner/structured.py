"""Grammar-constrained decoding with xgrammar: ``response_format`` json_object / json_schema.

``StructuredOutputCompiler`` builds xgrammar's tokenizer info once per tokenizer and caches
compiled grammars (keyed by the normalized schema text); ``make_constraint`` returns a fresh
``GrammarConstraint`` (one xgrammar matcher per request) that implements the engine's
``LogitsConstraint`` protocol: ``mask_logits`` sets the tokens the grammar forbids to -inf,
``accept_token`` advances the matcher, ``is_terminated`` says the grammar accepted the stop token.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from typing import Any

import torch
import xgrammar as xgr

from tokenfab.engine.requests.errors import parse_json_option

logger = logging.getLogger(__name__)


class StructuredOutputError(ValueError):
    """The requested schema/format cannot be compiled (a client error: HTTP 400)."""


class GrammarConstraint:
    """One request's grammar state. Not thread-safe: the engine thread owns it after submission."""

    def __init__(self, compiled: xgr.CompiledGrammar, tokenizer_vocab_size: int) -> None:
        self._compiled = compiled
        self._matcher = xgr.GrammarMatcher(compiled)
        self._vocab = tokenizer_vocab_size
        self._bitmask = xgr.allocate_token_bitmask(1, tokenizer_vocab_size)
        self.num_rejected = 0

    def clone(self) -> GrammarConstraint:
        """A fresh constraint on the same grammar (for n > 1 fan-out: one matcher per sequence)."""
        return GrammarConstraint(self._compiled, self._vocab)

    def mask_logits(self, logits: torch.Tensor) -> None:
        row = logits.view(-1)
        width = row.shape[0]
        if self._matcher.is_terminated():
            return
        self._matcher.fill_next_token_bitmask(self._bitmask)
        n = min(width, self._vocab)
        bitmask = self._bitmask.to(row.device) if row.device.type != "cpu" else self._bitmask
        if n == width:
            xgr.apply_token_bitmask_inplace(row.unsqueeze(0), bitmask, vocab_size=n)
        else:
            # The model's vocab (logits width) is padded past the tokenizer's: padding ids are never valid.
            xgr.apply_token_bitmask_inplace(row[:n].unsqueeze(0), bitmask, vocab_size=n)
            row[n:] = float("-inf")

    def accept_token(self, token_id: int) -> None:
        if self._matcher.is_terminated():
            return
        if not self._matcher.accept_token(int(token_id)):
            # Should not happen when the engine applied our mask; never crash the engine for it.
            self.num_rejected += 1
            logger.warning("grammar rejected token %d", token_id)

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())


class StructuredOutputCompiler:
    """Compiles and caches grammars for one tokenizer. Safe to call from several threads."""

    def __init__(self, tokenizer: Any, vocab_size: int | None = None, cache_size: int = 128,
                 max_threads: int = 2) -> None:
        vocab = vocab_size or len(tokenizer)
        # xgrammar needs a vocab at least as large as the tokenizer's (added tokens included).
        vocab = max(vocab, len(tokenizer))
        self.vocab_size = vocab
        self._info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
        self._compiler = xgr.GrammarCompiler(self._info, max_threads=max_threads, cache_enabled=True)
        self._cache: OrderedDict[str, xgr.CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def _compile(self, key: str, schema: str, strict: bool) -> xgr.CompiledGrammar:
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        try:
            compiled = self._compiler.compile_json_schema(schema, any_whitespace=False, strict_mode=strict)
        except Exception as e:  # xgrammar raises RuntimeError/InvalidJSONError on unsupported schemas
            raise StructuredOutputError(f"invalid or unsupported JSON schema: {e}") from e
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def json_object(self) -> GrammarConstraint:
        """Any JSON object (OpenAI's ``{"type": "json_object"}``)."""
        compiled = self._compile("json_object", '{"type": "object"}', strict=False)
        return GrammarConstraint(compiled, self.vocab_size)

    def json_schema(self, schema: dict[str, Any] | str, strict: bool = True) -> GrammarConstraint:
        if isinstance(schema, str):
            schema = parse_json_option(schema, "json_schema.schema", StructuredOutputError)
        if not isinstance(schema, dict):
            raise StructuredOutputError("json_schema.schema must be a JSON object")
        text = json.dumps(schema, sort_keys=True, separators=(",", ":"))
        compiled = self._compile(f"schema:{int(strict)}:{text}", text, strict=strict)
        return GrammarConstraint(compiled, self.vocab_size)

    def structural_tag(self, spec: dict[str, Any]) -> GrammarConstraint:
        """vLLM's ``structural_tag`` format (``{"structures": [{"begin", "schema", "end"}], "triggers"}``): free
        text until a trigger, then one structure: its begin, a JSON value valid against its schema, its end."""
        tags = [{"type": "tag", "begin": t["begin"], "end": t["end"],
                 "content": {"type": "json_schema", "json_schema": t.get("schema") or {}}}
                for t in spec.get("structures") or ()]
        fmt = {"type": "triggered_tags", "triggers": list(spec.get("triggers") or ()), "tags": tags}
        try:
            compiled = self._compiler.compile_structural_tag({"type": "structural_tag", "format": fmt})
        except Exception as e:  # xgrammar: InvalidStructuralTagError, RuntimeError on a bad schema
            raise StructuredOutputError(f"invalid structural tag: {e}") from e
        return GrammarConstraint(compiled, self.vocab_size)

    def from_response_format(self, response_format: dict[str, Any] | None) -> GrammarConstraint | None:
        """``response_format`` as OpenAI spells it; None for plain text."""
        if not response_format:
            return None
        kind = response_format.get("type", "text")
        if kind == "text":
            return None
        if kind == "json_object":
            return self.json_object()
        if kind == "json_schema":
            spec = response_format.get("json_schema") or {}
            schema = spec.get("schema", spec.get("json_schema"))
            if schema is None:
                raise StructuredOutputError("response_format.json_schema.schema is required")
            strict = spec.get("strict")
            return self.json_schema(schema, strict=True if strict is None else bool(strict))
        if kind == "structural_tag":
            return self.structural_tag(response_format)
        raise StructuredOutputError(f"unsupported response_format type {kind!r}")
