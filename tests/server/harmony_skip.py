"""Whether the offline o200k vocabulary GPT-OSS (Harmony) needs is here, for the Harmony tests' skips."""

from __future__ import annotations

import pytest

from tokenfab.server.reasoning.harmony_vocab import HarmonyVocabUnavailable, ensure_harmony_vocab


def harmony_vocab_missing() -> str | None:
    """None when ``ensure_harmony_vocab`` finds the vocabulary, else why not."""
    try:
        ensure_harmony_vocab()
        return None
    except HarmonyVocabUnavailable as e:
        return str(e)


def skip_without_harmony_vocab() -> pytest.MarkDecorator:
    """A skip mark for tests that need the vocabulary (checked now, once)."""
    why = harmony_vocab_missing()
    return pytest.mark.skipif(why is not None, reason=f"no offline o200k: {why}")
