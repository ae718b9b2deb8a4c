"""Kimi K2 / K2.5 tokenizers (``tiktoken.model`` + ``tokenizer_config.json``) as a fast
``transformers`` tokenizer, without running the repository's remote code.

Those repositories ship no ``tokenizer.json``; their ``tokenization_kimi.py`` builds a ``tiktoken``
encoding from three things, which this module reads or restates:

- ``tiktoken.model``: one ``<base64 token bytes> <rank>`` line per token; the rank is the id and the
  BPE merge priority. Read here (no ``tiktoken`` package needed) and turned into a byte-level BPE by
  ``transformers``' ``TikTokenConverter``.
- the pre-tokenization pattern (below): Han runs, words with case-aware splits and English
  contractions, 1-3 digit groups, punctuation runs, whitespace. It uses character-class intersection
  (``&&``), which the ``tokenizers`` library's regex engine (Oniguruma) supports.
- special tokens: the 256 + 2 ids right after the base vocabulary, named by
  ``added_tokens_decoder`` in ``tokenizer_config.json``, the rest ``<|reserved_token_{id}|>``. They are
  recognized inside text (tiktoken's ``allowed_special="all"``) and skipped by
  ``skip_special_tokens``.

The chat template comes from ``tokenizer_config.json`` or ``chat_template.jinja``.
"""

from __future__ import annotations

import base64
import binascii
import json
from pathlib import Path
from typing import Any

from tokenfab.loader.errors import ModelLoadError

TIKTOKEN_FILE = "tiktoken.model"
NUM_RESERVED_SPECIAL_TOKENS = 256 + 2  # tokenization_kimi.py: range(n, n + num_reserved_special_tokens + 2)

# Kimi's pre-tokenizer (tokenization_kimi.py's pat_str, alternatives in the same order)
_NOT_HAN_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_NOT_HAN_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
KIMI_PATTERN = "|".join([
    r"[\p{Han}]+",
    rf"[^\r\n\p{{L}}\p{{N}}]?{_NOT_HAN_UPPER}*{_NOT_HAN_LOWER}+{_CONTRACTION}",
    rf"[^\r\n\p{{L}}\p{{N}}]?{_NOT_HAN_UPPER}+{_NOT_HAN_LOWER}*{_CONTRACTION}",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])


def is_tiktoken_dir(model_dir: Path) -> bool:
    """A folder in the Kimi layout: ``tiktoken.model`` and no ``tokenizer.json`` beside it."""
    return (model_dir / TIKTOKEN_FILE).is_file() and not (model_dir / "tokenizer.json").is_file()


def read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """``<base64> <rank>`` lines -> {token bytes: rank}; ranks must be 0..n-1, each once."""
    ranks: dict[bytes, int] = {}
    try:
        lines = path.read_bytes().splitlines()
    except OSError as e:
        raise ModelLoadError(path, f"cannot read the tiktoken file: {e}") from e
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError("expected '<base64 token> <rank>'")
            token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
        except (ValueError, binascii.Error) as e:
            raise ModelLoadError(path, f"line {lineno}: {e}") from None
        if token in ranks:
            raise ModelLoadError(path, f"line {lineno}: token {token!r} appears twice")
        ranks[token] = rank
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ModelLoadError(path, "ranks must be 0..n-1, each exactly once")
    if not ranks:
        raise ModelLoadError(path, "empty tiktoken file")
    return ranks


def _token_str(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _special_tokens(config: dict[str, Any], base: int, where: Path) -> list[str]:
    """Names of ids base .. base + 257 in order (tokenizer_config's added_tokens_decoder, else reserved)."""
    decoder = config.get("added_tokens_decoder") or {}
    if not isinstance(decoder, dict):
        raise ModelLoadError(where, "added_tokens_decoder must be an object")
    names: dict[int, str] = {}
    for key, value in decoder.items():
        name = _token_str(value)
        if not str(key).isdigit() or name is None:
            raise ModelLoadError(where, f"added_tokens_decoder entry {key!r} must map an id to a token")
        names[int(key)] = name
    outside = [i for i in names if not base <= i < base + NUM_RESERVED_SPECIAL_TOKENS]
    if outside:
        raise ModelLoadError(where, f"added token ids {outside[:5]} fall outside the special range "
                                    f"{base}..{base + NUM_RESERVED_SPECIAL_TOKENS - 1}")
    tokens = [names.get(i, f"<|reserved_token_{i}|>") for i in range(base, base + NUM_RESERVED_SPECIAL_TOKENS)]
    if len(set(tokens)) != len(tokens):
        raise ModelLoadError(where, "a special token name is used for two ids")
    return tokens


def load_tiktoken_tokenizer(model_dir: str | Path) -> Any:
    """A ``PreTrainedTokenizerFast`` equal to Kimi's remote ``TikTokenTokenizer`` (no remote code)."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    model_dir = Path(model_dir)
    config_path = model_dir / "tokenizer_config.json"
    config: dict[str, Any] = {}
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ModelLoadError(config_path, f"not valid JSON ({e})") from None
        if not isinstance(config, dict):
            raise ModelLoadError(config_path, "expected a JSON object")
    ranks = read_tiktoken_ranks(model_dir / TIKTOKEN_FILE)
    specials = _special_tokens(config, len(ranks), config_path)

    class _Converter(TikTokenConverter):
        @staticmethod
        def load_tiktoken_bpe(tiktoken_url: str) -> dict[bytes, int]:
            return ranks  # already read and checked; transformers' default needs the tiktoken package

    try:
        backend = _Converter(str(model_dir / TIKTOKEN_FILE), pattern=KIMI_PATTERN).converted()
    except Exception as e:  # the tokenizers library reports its own errors (e.g. merges it cannot build)
        raise ModelLoadError(model_dir / TIKTOKEN_FILE, f"cannot build a BPE tokenizer: {e}") from e
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    wrong = [t for i, t in enumerate(specials) if backend.token_to_id(t) != len(ranks) + i]
    if wrong:  # a special name that is also a base token would shift the ids
        raise ModelLoadError(config_path, f"special tokens {wrong[:3]} collide with base tokens")

    template = config.get("chat_template")
    jinja = model_dir / "chat_template.jinja"
    if template is None and jinja.is_file():
        template = jinja.read_text()
    extra = [t for t in (config.get("additional_special_tokens") or []) if isinstance(t, str)]
    named = {k: _token_str(config.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
    missing = [v for v in named.values() if v is not None and v not in specials]
    if missing:
        raise ModelLoadError(config_path, f"{missing} are not among the special tokens")
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, chat_template=template, additional_special_tokens=extra,
        model_max_length=int(config.get("model_max_length") or 1 << 30), clean_up_tokenization_spaces=False,
        **{k: v for k, v in named.items() if v is not None},
    )
