"""Tokenizer helpers: incremental detokenization that is right for multi-byte UTF-8 and
for SentencePiece/BPE leading spaces.

Decoding one token at a time is wrong for both: a character can span tokens (emoji,
CJK in byte-level BPE) and a token's leading space depends on what precedes it. So each
step decodes a short window of recent tokens twice (with and without the new ones) and
emits the difference, holding back text that ends in an incomplete character (U+FFFD).
"""

from __future__ import annotations

from typing import Any


def detokenize_incrementally(
    tokenizer: Any,
    token_ids: list[int],
    prefix_offset: int,
    read_offset: int,
    skip_special_tokens: bool = True,
) -> tuple[str, int, int]:
    """Text newly readable at the end of ``token_ids``, and the new (prefix, read) offsets.

    ``prefix_offset:read_offset`` is the window already emitted, kept for context.
    """
    prefix = tokenizer.decode(token_ids[prefix_offset:read_offset], skip_special_tokens=skip_special_tokens)
    full = tokenizer.decode(token_ids[prefix_offset:], skip_special_tokens=skip_special_tokens)
    if len(full) > len(prefix) and not full.endswith("\ufffd"):
        return full[len(prefix) :], read_offset, len(token_ids)
    return "", prefix_offset, read_offset


def eos_token_ids(tokenizer: Any, config: Any) -> list[int]:
    """End-of-sequence ids from the tokenizer and the model config (which may list several)."""
    ids: set[int] = set()
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    cfg = getattr(config, "eos_token_id", None)
    if isinstance(cfg, int):
        ids.add(cfg)
    elif isinstance(cfg, (list, tuple)):
        ids.update(int(i) for i in cfg)
    return sorted(ids)
