"""GGUF checkpoints (llama.cpp's one-file format): config, tokenizer and dequantized weights.

A GGUF file keeps a model's hyper-parameters and tokenizer as metadata under llama.cpp's key names
(``llama.block_count``, ``tokenizer.ggml.tokens``, ...) and its tensors under llama.cpp's names
(``blk.0.attn_q.weight``), often quantized in blocks. This module turns such a file into what the
rest of tokenfab gets from a Hugging Face checkpoint:

* a ``transformers`` config (``LlamaConfig``/``Qwen2Config``/``Qwen3Config``) with HF field names;
* tensors under HF names, dequantized to float32, in HF layout. llama.cpp's converter reorders the
  rows of q and k for Llama-architecture files (it interleaves the two rotary halves of each head,
  to suit its own RoPE kernel); :meth:`GGUFCheckpoint.tensors` undoes that. Qwen2/Qwen3 files are
  written unpermuted;
* a fast tokenizer built from the vocabulary, merges, special-token ids and chat template in the
  metadata.

Every way a file can be unusable (missing, not GGUF, truncated, an architecture or tensor type we
cannot handle, a tensor missing or misshapen) raises :class:`ModelLoadError` naming the file and
the problem.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QT

from tokenfab.loader.errors import ModelLoadError

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerFast

__all__ = [
    "PACKABLE_TYPES",
    "GGUFCheckpoint",
    "PackedTensor",
    "dequantize",
    "load_gguf",
    "load_gguf_tokenizer",
    "supports_ggml_type",
]

# GGUF `general.architecture` -> (HF `architectures` name, transformers config class name).
# Mistral files say "llama": llama.cpp runs them with the same graph, and so does LlamaConfig.
_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "LlamaConfig"),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config"),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config"),
}

# llama.cpp tensor names -> Hugging Face names.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate.bias": "mlp.gate_proj.bias",
    "ffn_up.bias": "mlp.up_proj.bias",
    "ffn_down.bias": "mlp.down_proj.bias",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")
_REQUIRED_GLOBAL = ("token_embd.weight", "output_norm.weight")
_REQUIRED_LAYER = (
    "attn_norm.weight",
    "ffn_norm.weight",
    "attn_q.weight",
    "attn_k.weight",
    "attn_v.weight",
    "attn_output.weight",
    "ffn_gate.weight",
    "ffn_up.weight",
    "ffn_down.weight",
)
_ATTN_BIASES = ("attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_output.bias")
_MLP_BIASES = ("ffn_gate.bias", "ffn_up.bias", "ffn_down.bias")
# Per architecture: per-layer tensors it must have, and optional groups (all or none) with the
# config flag each turns on. HF's Llama/Qwen3 `attention_bias` covers q, k, v and o; Qwen2 always
# has q/k/v biases and never an o bias.
_ARCH_REQUIRED_LAYER = {
    "llama": (),
    "qwen2": ("attn_q.bias", "attn_k.bias", "attn_v.bias"),
    "qwen3": ("attn_q_norm.weight", "attn_k_norm.weight"),
}
_ARCH_OPTIONAL_GROUPS = {
    "llama": {"attention_bias": _ATTN_BIASES, "mlp_bias": _MLP_BIASES},
    "qwen2": {},
    "qwen3": {"attention_bias": _ATTN_BIASES},
}
# A tensor llama.cpp adds that has no HF counterpart: Llama 3's RoPE frequency factors, which
# stand in for the `rope_scaling` dict of the HF config (read back into the config here).
_ROPE_FREQS = "rope_freqs.weight"

# Types dequantized here; the others that `gguf.quants` can dequantize are passed to it.
_OWN_TYPES = (QT.F32, QT.F16, QT.BF16, QT.F64, QT.Q8_0, QT.Q4_0, QT.Q4_1)
_NOT_WEIGHTS = (QT.I8, QT.I16, QT.I32, QT.I64)
_CHUNK_ELEMENTS = 1 << 22  # block formats are decoded this many values at a time, bounding temporaries


# --------------------------------------------------------------------------------------------
# Reading the file
# --------------------------------------------------------------------------------------------


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
# Dequantization
# --------------------------------------------------------------------------------------------


def _f16_column(blocks: np.ndarray, start: int) -> np.ndarray:
    """The little-endian float16 at byte `start` of each block, as a float32 column."""
    return blocks[:, start : start + 2].view(np.float16).astype(np.float32)


def _q8_0(blocks: np.ndarray, out: np.ndarray) -> None:
    # block: f16 scale d, then 32 int8 q; value = q * d
    np.multiply(blocks[:, 2:].view(np.int8), _f16_column(blocks, 0), out=out)


def _q4_0(blocks: np.ndarray, out: np.ndarray) -> None:
    # block: f16 scale d, then 16 bytes; value j < 16 is the low nibble of byte j, value j >= 16
    # the high nibble of byte j - 16; value = (nibble - 8) * d
    qs = blocks[:, 2:]
    out[:, :16] = (qs & 0x0F).view(np.int8) - np.int8(8)
    out[:, 16:] = (qs >> 4).view(np.int8) - np.int8(8)
    out *= _f16_column(blocks, 0)


def _q4_1(blocks: np.ndarray, out: np.ndarray) -> None:
    # block: f16 scale d, f16 minimum m, then 16 bytes of nibbles as in Q4_0; value = nibble * d + m
    qs = blocks[:, 4:]
    out[:, :16] = qs & 0x0F
    out[:, 16:] = qs >> 4
    out *= _f16_column(blocks, 0)
    out += _f16_column(blocks, 2)


_BLOCK_DECODERS = {QT.Q8_0: _q8_0, QT.Q4_0: _q4_0, QT.Q4_1: _q4_1}


@functools.cache
def supports_ggml_type(ggml_type: QT) -> bool:
    """Whether :func:`dequantize` handles this ggml type (ours, or one `gguf.quants` decodes)."""
    if ggml_type in _OWN_TYPES:
        return True
    if ggml_type in _NOT_WEIGHTS or ggml_type not in gguf.GGML_QUANT_SIZES:
        return False
    _, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    try:
        gguf.quants.dequantize(np.zeros((1, type_size), dtype=np.uint8), ggml_type)
    except Exception:  # NotImplementedError, or whatever a half-implemented type trips over
        return False
    return True


def dequantize(data: np.ndarray, ggml_type: QT | int, shape: Sequence[int]) -> np.ndarray:
    """A tensor's stored bytes (as `GGUFReader` exposes them) -> a new float32 array of `shape`.

    `shape` is in torch order (outermost first), the reverse of GGUF's dimension list. The result
    is always a fresh, writable array, never a view of the file.
    """
    ggml_type = QT(ggml_type)
    shape = tuple(int(d) for d in shape)
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    if ggml_type == QT.F32:
        return raw.view("<f4").reshape(shape).copy()
    if ggml_type == QT.F16:
        return raw.view("<f2").astype(np.float32).reshape(shape)
    if ggml_type == QT.F64:
        return raw.view("<f8").astype(np.float32).reshape(shape)
    if ggml_type == QT.BF16:
        # bfloat16 is the top half of a float32
        wide = raw.view("<u2").astype(np.uint32)
        wide <<= 16
        return wide.view(np.float32).reshape(shape)
    block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    blocks = raw.reshape(-1, type_size)
    decoder = _BLOCK_DECODERS.get(ggml_type)
    if decoder is not None:
        out = np.empty((blocks.shape[0], block_size), dtype=np.float32)
        step = max(1, _CHUNK_ELEMENTS // block_size)
        for start in range(0, blocks.shape[0], step):
            decoder(blocks[start : start + step], out[start : start + step])
        return out.reshape(shape)
    # Everything else (K-quants, IQ-quants, Q5_x, ...): gguf's own numpy decoders.
    row_bytes = shape[-1] // block_size * type_size if shape else type_size
    values = gguf.quants.dequantize(raw.reshape(-1, row_bytes), ggml_type)
    return np.ascontiguousarray(values, dtype=np.float32).reshape(shape)


def _unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation for one projection (weight or bias).

    convert_hf_to_gguf.py writes row (head h, half i, pair j) of the HF weight to row
    (h, j, i): within a head, the rows of the two rotary halves are interleaved. Reading the rows
    as (head, j, i) and swapping the last two axes back gives HF's (head, i, j).
    """
    rows = w.shape[0]
    return np.ascontiguousarray(w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2)).reshape(
        w.shape
    )


# --------------------------------------------------------------------------------------------
# The checkpoint
# --------------------------------------------------------------------------------------------


# ggml block types a weight can stay packed in (the CPU kernels in kernels/cpu/ggml_matmul.py).
PACKABLE_TYPES = ("Q8_0", "Q4_0", "Q4_1")


@dataclass(frozen=True)
class PackedTensor:
    """A 2-D weight kept in its file's ggml blocks: ``rows`` is uint8 ``[N, K / 32 * block_bytes]``
    (one row of the HF-layout weight per row, its blocks as stored), ``qtype`` one of
    :data:`PACKABLE_TYPES`, ``k`` the logical row length."""

    rows: torch.Tensor
    qtype: str
    k: int

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.rows.shape[0]), self.k)


class _Entry(NamedTuple):
    hf_name: str
    tensor: Any  # gguf.ReaderTensor
    shape: tuple[int, ...]  # torch order
    unpermute_heads: int | None  # Llama q/k: the head count to un-permute the rows with


@dataclass
class GGUFCheckpoint:
    """A parsed GGUF file: its config as transformers would build it, and its tensors on demand."""

    path: Path
    config: PretrainedConfig
    architecture: str  # HF `architectures` name, e.g. "LlamaForCausalLM"
    _entries: list[_Entry] = field(default_factory=list, repr=False, compare=False)

    def tensor_names(self) -> list[str]:
        """The HF names :meth:`tensors` yields, in file order, without reading any data."""
        return [e.hf_name for e in self._entries]

    def ggml_types(self) -> dict[str, str]:
        """HF name -> the ggml type the file stores that tensor in (e.g. "Q4_1", "F32")."""
        return {e.hf_name: QT(e.tensor.tensor_type).name for e in self._entries}

    def tensors(self, packed: bool = False) -> Iterator[tuple[str, torch.Tensor | PackedTensor]]:
        """Yield (HF name, float32 CPU tensor in HF layout), one at a time, dequantizing lazily.

        With ``packed``, 2-D tensors stored in a :data:`PACKABLE_TYPES` block type come as a
        :class:`PackedTensor` instead: the raw rows, copied out of the file, never dequantized
        (the Llama q/k row un-permutation moves whole rows, so it applies to packed rows as is).
        """
        for e in self._entries:
            qtype = QT(e.tensor.tensor_type).name
            if packed and qtype in PACKABLE_TYPES and len(e.shape) == 2:
                rows = np.array(e.tensor.data, dtype=np.uint8, copy=True).reshape(e.shape[0], -1)
                if e.unpermute_heads is not None:
                    rows = _unpermute_rows(rows, e.unpermute_heads)
                yield e.hf_name, PackedTensor(torch.from_numpy(rows), qtype, e.shape[1])
                continue
            try:
                values = dequantize(e.tensor.data, e.tensor.tensor_type, e.shape)
            except (ValueError, TypeError) as err:
                raise ModelLoadError(self.path, f"cannot decode tensor {e.tensor.name}: {err}") from None
            if e.unpermute_heads is not None:
                values = _unpermute_rows(values, e.unpermute_heads)
            yield e.hf_name, torch.from_numpy(values)


def load_gguf(path: str | Path) -> GGUFCheckpoint:
    """Open a GGUF file: parse and check its header; tensors are read by ``.tensors()``.

    Raises ModelLoadError when the file is missing, not GGUF, truncated, of an unsupported
    architecture, stores a tensor in a type we cannot dequantize, or lacks (or misshapes) a
    tensor the architecture needs.
    """
    path = Path(path)
    reader = _open(path)
    meta = _Meta(reader, path)
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelLoadError(path, "the metadata does not name the architecture (general.architecture)")
    if arch not in _ARCHITECTURES:
        raise ModelLoadError(
            path,
            f"unsupported architecture {arch!r}: GGUF files of architecture "
            f"{', '.join(_ARCHITECTURES)} can be loaded",
        )
    by_name = {t.name: t for t in reader.tensors}
    for t in reader.tensors:
        if not supports_ggml_type(t.tensor_type):
            raise ModelLoadError(
                path,
                f"unsupported quantization type: tensor {t.name} is stored as "
                f"{QT(t.tensor_type).name}, which tokenfab cannot dequantize",
            )
    groups = _check_tensor_names(path, arch, meta, by_name)
    config = _build_config(path, arch, meta, by_name, groups)
    entries = _plan(path, arch, config, by_name)
    return GGUFCheckpoint(path=path, config=config, architecture=_ARCHITECTURES[arch][0], _entries=entries)


def _check_tensor_names(
    path: Path, arch: str, meta: _Meta, by_name: dict[str, Any]
) -> dict[str, bool]:
    """Every required tensor is present and every tensor is one we know; returns which optional
    groups (attention_bias, mlp_bias) the file has."""
    n_layers = meta.int(f"{arch}.block_count")
    allowed_layer = set(_REQUIRED_LAYER) | set(_ARCH_REQUIRED_LAYER[arch])
    for members in _ARCH_OPTIONAL_GROUPS[arch].values():
        allowed_layer |= set(members)
    for name in by_name:
        if name in _GLOBAL_NAMES or (name == _ROPE_FREQS and arch == "llama"):
            continue
        m = _LAYER_RE.fullmatch(name)
        if m is None or m.group(2) not in allowed_layer or int(m.group(1)) >= n_layers:
            raise ModelLoadError(
                path, f"unexpected tensor {name}: it has no counterpart in a {arch} model of {n_layers} layers"
            )
    for name in _REQUIRED_GLOBAL:
        if name not in by_name:
            raise ModelLoadError(path, f"missing tensor {name} (required for every {arch} model)")
    groups: dict[str, bool] = {}
    for flag, members in _ARCH_OPTIONAL_GROUPS[arch].items():
        groups[flag] = any(f"blk.{i}.{s}" in by_name for i in range(n_layers) for s in members)
    required = list(_REQUIRED_LAYER) + list(_ARCH_REQUIRED_LAYER[arch])
    for flag, present in groups.items():
        if present:
            required += _ARCH_OPTIONAL_GROUPS[arch][flag]
    for i in range(n_layers):
        for suffix in required:
            if f"blk.{i}.{suffix}" not in by_name:
                raise ModelLoadError(path, f"missing tensor blk.{i}.{suffix} (the metadata says {n_layers} layers)")
    return groups


def _torch_shape(tensor: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


def _build_config(
    path: Path, arch: str, meta: _Meta, by_name: dict[str, Any], groups: dict[str, bool]
) -> PretrainedConfig:
    import transformers

    p = f"{arch}."
    hidden = meta.int(p + "embedding_length")
    n_head = meta.int(p + "attention.head_count")
    n_kv = meta.int(p + "attention.head_count_kv", n_head)
    if n_head <= 0 or n_kv <= 0 or n_head % n_kv:
        raise ModelLoadError(path, f"metadata gives {n_head} attention heads and {n_kv} key/value heads")
    # head_dim: llama.cpp writes attention.key_length when the HF config names a head_dim, and for
    # Llama also rope.dimension_count (the rotary width, which for these models is the head dim).
    head_dim = meta.optional_int(p + "attention.key_length")
    if head_dim is None and arch == "llama":
        head_dim = meta.optional_int(p + "rope.dimension_count")
    if head_dim is None:
        head_dim = hidden // n_head
    rope_theta = meta.float(p + "rope.freq_base", 10000.0)
    vocab = _torch_shape(by_name["token_embd.weight"])[0]
    kwargs: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[arch][0]],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": meta.int(p + "feed_forward_length"),
        "num_hidden_layers": meta.int(p + "block_count"),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": meta.int(p + "context_length"),
        "rms_norm_eps": meta.float(p + "attention.layer_norm_rms_epsilon"),
        "rope_theta": rope_theta,
        "tie_word_embeddings": "output.weight" not in by_name,
        "bos_token_id": meta.optional_int("tokenizer.ggml.bos_token_id"),
        "eos_token_id": _eos_ids(meta),
        "pad_token_id": meta.optional_int("tokenizer.ggml.padding_token_id"),
        **groups,
    }
    if arch in ("qwen2", "qwen3"):
        kwargs["use_sliding_window"] = False
    scaling = _rope_scaling(path, arch, meta, by_name, head_dim, rope_theta)
    if scaling is not None:
        kwargs["rope_scaling"] = scaling
    config_cls = getattr(transformers, _ARCHITECTURES[arch][1])
    try:
        return config_cls(**kwargs)
    except (ValueError, TypeError, KeyError) as e:
        raise ModelLoadError(path, f"the metadata does not make a valid {config_cls.__name__}: {e}") from None


def _eos_ids(meta: _Meta) -> int | list[int] | None:
    """EOS id, plus end-of-turn / end-of-message ids when the file names distinct ones (Llama 3
    files do): generation should stop at any of them, as llama.cpp does."""
    ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        v = meta.optional_int(key)
        if v is not None and v not in ids:
            ids.append(v)
    if not ids:
        return None
    return ids[0] if len(ids) == 1 else ids


def _rope_scaling(
    path: Path, arch: str, meta: _Meta, by_name: dict[str, Any], head_dim: int, rope_theta: float
) -> dict[str, Any] | None:
    """The HF `rope_scaling` dict (without rope_theta) the file implies, or None for plain RoPE."""
    p = f"{arch}.rope.scaling."
    kind = meta.get(p + "type")
    factor = meta.get(p + "factor")
    if _ROPE_FREQS in by_name:
        if kind not in (None, "none"):
            raise ModelLoadError(path, f"the file has both {_ROPE_FREQS} and rope scaling type {kind!r}")
        return _llama3_scaling(path, by_name[_ROPE_FREQS], head_dim, rope_theta)
    if kind in (None, "none"):
        return None
    if kind not in ("linear", "yarn"):
        raise ModelLoadError(path, f"unsupported rope scaling type {kind!r} (linear and yarn are supported)")
    if not isinstance(factor, int | float):
        raise ModelLoadError(path, f"rope scaling type {kind!r} without a numeric {p}factor")
    out: dict[str, Any] = {"rope_type": kind, "factor": float(factor)}
    if kind == "yarn":
        orig = meta.optional_int(p + "original_context_length")
        if orig is not None:
            out["original_max_position_embeddings"] = orig
        for gguf_key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            v = meta.get(p + gguf_key)
            if v is not None:
                out[hf_key] = float(v)
        # llama.cpp's `attn_factor` is not written for these architectures by its converter, and
        # its meaning differs from HF's `attention_factor`, so it is not carried over.
    return out


# Llama 3.x rope_scaling values other than `factor`; llama.cpp bakes them into rope_freqs.
_LLAMA3_CANDIDATES = ({"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},)


def _llama3_factors(head_dim: int, theta: float, factor: float, params: dict[str, Any]) -> np.ndarray:
    """The per-frequency divisors llama.cpp's converter computes for HF's "llama3" rope type."""
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < old_len / high:
            out.append(1.0)
        elif wavelen > old_len / low:
            out.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out)


def _llama3_scaling(path: Path, tensor: Any, head_dim: int, theta: float) -> dict[str, Any] | None:
    """Recover HF's llama3 `rope_scaling` from the rope_freqs tensor llama.cpp stores instead.

    The tensor holds one divisor per rotary frequency. Its maximum is `factor`; the remaining
    parameters are not recoverable in general, so known ones are tried and checked against it.
    """
    freqs = dequantize(tensor.data, tensor.tensor_type, _torch_shape(tensor)).reshape(-1).astype(np.float64)
    if freqs.shape[0] != head_dim // 2:
        raise ModelLoadError(path, f"{_ROPE_FREQS} has {freqs.shape[0]} entries, expected {head_dim // 2}")
    if np.all(freqs == 1.0):
        return None
    factor = float(np.float32(freqs.max()))
    for params in _LLAMA3_CANDIDATES:
        if np.allclose(_llama3_factors(head_dim, theta, factor, params), freqs, rtol=1e-5, atol=0):
            return {"rope_type": "llama3", "factor": factor, **params}
    raise ModelLoadError(path, f"{_ROPE_FREQS} does not match the Llama 3 rope scaling this loader recognises")


def _plan(path: Path, arch: str, config: Any, by_name: dict[str, Any]) -> list[_Entry]:
    """Map every tensor to its HF name and check its shape against the config."""
    h, inter = config.hidden_size, config.intermediate_size
    n_head, n_kv, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    expected_layer = {
        "attn_norm.weight": (h,),
        "ffn_norm.weight": (h,),
        "attn_q.weight": (n_head * hd, h),
        "attn_k.weight": (n_kv * hd, h),
        "attn_v.weight": (n_kv * hd, h),
        "attn_output.weight": (h, n_head * hd),
        "attn_q.bias": (n_head * hd,),
        "attn_k.bias": (n_kv * hd,),
        "attn_v.bias": (n_kv * hd,),
        "attn_output.bias": (h,),
        "attn_q_norm.weight": (hd,),
        "attn_k_norm.weight": (hd,),
        "ffn_gate.weight": (inter, h),
        "ffn_up.weight": (inter, h),
        "ffn_down.weight": (h, inter),
        "ffn_gate.bias": (inter,),
        "ffn_up.bias": (inter,),
        "ffn_down.bias": (h,),
    }
    vocab = config.vocab_size
    expected_global = {"token_embd.weight": (vocab, h), "output.weight": (vocab, h), "output_norm.weight": (h,)}
    entries = []
    for name, tensor in by_name.items():
        if name == _ROPE_FREQS:
            continue
        shape = _torch_shape(tensor)
        heads = None
        if name in _GLOBAL_NAMES:
            hf_name, expected = _GLOBAL_NAMES[name], expected_global[name]
        else:
            m = _LAYER_RE.fullmatch(name)
            assert m is not None  # _check_tensor_names let only known names through
            suffix = m.group(2)
            hf_name = f"model.layers.{m.group(1)}.{_LAYER_NAMES[suffix]}"
            expected = expected_layer[suffix]
            if arch == "llama" and suffix in ("attn_q.weight", "attn_q.bias"):
                heads = n_head
            elif arch == "llama" and suffix in ("attn_k.weight", "attn_k.bias"):
                heads = n_kv
        if shape != expected:
            raise ModelLoadError(
                path, f"tensor {name} has shape {shape}, but the metadata implies {expected}"
            )
        entries.append(_Entry(hf_name, tensor, shape, heads))
    return entries


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
