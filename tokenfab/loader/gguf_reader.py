"""Reading a GGUF file: header parsing with errors that name the file, typed metadata access, and the
tokenizer built from the metadata (split from ``gguf.py``)."""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gguf
import numpy as np

from tokenfab.loader.errors import ModelLoadError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast


# --------------------------------------------------------------------------------------------
# Reading the file
# --------------------------------------------------------------------------------------------


def _torch_shape(tensor: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


class _Truncated(Exception):
    """A read past the end of the file: `needed` is the byte offset the read would end at."""

    def __init__(self, needed: int) -> None:
        super().__init__(needed)
        self.needed = needed


class _Reader(gguf.GGUFReader):
    """``gguf.GGUFReader`` with two changes that leave what it parses untouched.

    * It parses from a plain ``ndarray`` view of the memory map instead of the ``np.memmap``
      itself. Every metadata value is a slice, and slicing the memmap subclass costs about three
      times as much, which made a file with a 49k-token vocabulary take ~3.5 s to open, not ~1 s.
    * A read past the end of the file raises ``_Truncated``; the stock reader would slice a
      short array and then fail somewhere unrelated-looking (a reshape, an index error).
    """

    @property  # type: ignore[override]
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._memmap = value
        self._plain = value.view(np.ndarray)

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        end = int(offset) + np.dtype(dtype).itemsize * int(count)
        if end > len(self._plain):
            raise _Truncated(end)
        return super()._get(offset, dtype, count, override_order)


def _check_file(path: Path) -> None:
    """The checks that need no parsing: the file exists and starts with the GGUF magic."""
    if not path.exists():
        raise ModelLoadError(path, "no such file")
    if not path.is_file():
        raise ModelLoadError(path, "not a file (a GGUF model is a single .gguf file)")
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelLoadError(path, f"cannot read the file: {e.strerror or e}") from e
    if not magic:
        raise ModelLoadError(path, "not a GGUF file: the file is empty")
    if magic != b"GGUF":
        raise ModelLoadError(path, f"not a GGUF file: it starts with {magic!r}, not the magic bytes b'GGUF'")


_VERSION_RE = re.compile(r"appears to be version (\d+)")
_UNKNOWN_TYPE_RE = re.compile(r"(\d+)\)? is not a valid GGMLQuantizationType")  # "np.uint32(99) is not ..."


@functools.lru_cache(maxsize=2)
def _parse(path: str, mtime_ns: int, size: int) -> _Reader:
    """Parse a file's header once: `load_gguf` and `load_gguf_tokenizer` on the same unchanged
    file share the parse (keyed by modification time and size so a rewritten file is re-read)."""
    try:
        reader = _Reader(path, "r")
    except _Truncated as e:
        raise ModelLoadError(
            path,
            f"the file is truncated: it is {size} bytes long, but its header describes data up to "
            f"byte {e.needed} (an interrupted download or copy?)",
        ) from None
    except ValueError as e:
        if m := _UNKNOWN_TYPE_RE.search(str(e)):
            raise ModelLoadError(
                path,
                f"unsupported quantization type: a tensor is stored in ggml type {m.group(1)}, "
                f"which the installed gguf package (version {_gguf_version()}) does not know",
            ) from None
        if m := _VERSION_RE.search(str(e)):
            known = " and ".join(str(v) for v in getattr(gguf.gguf_reader, "READER_SUPPORTED_VERSIONS", (2, 3)))
            raise ModelLoadError(
                path, f"unsupported GGUF format version {m.group(1)} (versions {known} can be read)"
            ) from None
        raise ModelLoadError(path, f"corrupt GGUF header: {e}") from None
    except (KeyError, IndexError, OverflowError, UnicodeDecodeError, TypeError) as e:
        raise ModelLoadError(path, f"corrupt GGUF header ({type(e).__name__}: {e})") from None
    except OSError as e:
        raise ModelLoadError(path, f"cannot read the file: {e.strerror or e}") from e
    if reader.byte_order != "I":
        raise ModelLoadError(path, "big-endian GGUF files are not supported")
    return reader


def _gguf_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gguf")
    except PackageNotFoundError:
        return "unknown"


def _open(path: Path) -> _Reader:
    _check_file(path)
    st = path.stat()
    return _parse(str(path), st.st_mtime_ns, st.st_size)


class _Meta:
    """Typed access to a reader's metadata, with errors that name the key."""

    def __init__(self, reader: gguf.GGUFReader, path: Path) -> None:
        self.fields = reader.fields
        self.path = path

    def get(self, key: str, default: Any = None) -> Any:
        f = self.fields.get(key)
        if f is None:
            return default
        try:
            return f.contents()
        except (UnicodeDecodeError, IndexError, ValueError) as e:
            raise ModelLoadError(self.path, f"metadata {key} cannot be read: {e}") from None

    def length(self, key: str) -> int | None:
        """Element count of an array value, without decoding the elements."""
        f = self.fields.get(key)
        if f is None or not f.types or f.types[0] != gguf.GGUFValueType.ARRAY:
            return None
        return len(f.data)

    def int(self, key: str, default: int | None = None) -> int:
        v = self.get(key, default)
        if v is None:
            raise ModelLoadError(self.path, f"metadata key {key} is missing")
        if isinstance(v, bool) or not isinstance(v, int):
            raise ModelLoadError(self.path, f"metadata {key} should be an integer, found {v!r}")
        return v

    def float(self, key: str, default: float | None = None) -> float:
        v = self.get(key, default)
        if v is None:
            raise ModelLoadError(self.path, f"metadata key {key} is missing")
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise ModelLoadError(self.path, f"metadata {key} should be a number, found {v!r}")
        return float(v)

    def optional_int(self, key: str) -> int | None:
        return None if self.get(key) is None else self.int(key)


# --------------------------------------------------------------------------------------------
# The tokenizer
# --------------------------------------------------------------------------------------------

_SPECIAL_IDS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
}


def load_gguf_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """The file's tokenizer, built by transformers' GGUF support from the vocabulary and merges
    in the metadata; the chat template and bos/eos/pad/unk tokens are set from the metadata.

    Raises ModelLoadError for the same file problems as :func:`load_gguf`, or when the metadata
    holds no tokenizer or one transformers cannot rebuild.
    """
    path = Path(path)
    reader = _open(path)
    meta = _Meta(reader, path)
    n_tokens = meta.length("tokenizer.ggml.tokens")
    if not n_tokens:
        raise ModelLoadError(path, "the file holds no tokenizer (no tokenizer.ggml.tokens metadata)")
    from transformers import PreTrainedTokenizerFast

    try:
        # The concrete class, not AutoTokenizer: that would first rebuild the model config, which
        # re-parses the whole file and doubles the load time.
        tok = PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    except Exception as e:  # transformers raises ValueError/KeyError/OSError/... for files it cannot convert
        raise ModelLoadError(path, f"cannot build the tokenizer from the metadata: {type(e).__name__}: {e}") from None
    template = meta.get("tokenizer.chat_template")
    tok.chat_template = template if isinstance(template, str) and template else None
    for attr, key in _SPECIAL_IDS.items():
        token_id = meta.optional_int(key)
        if token_id is None:
            continue
        if not 0 <= token_id < n_tokens:
            raise ModelLoadError(path, f"metadata {key} = {token_id} is outside the vocabulary of {n_tokens} tokens")
        setattr(tok, attr, tok.convert_ids_to_tokens(token_id))
    return tok
