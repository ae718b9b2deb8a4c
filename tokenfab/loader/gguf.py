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

The pieces: ``gguf_reader.py`` (parsing, metadata, the tokenizer), ``gguf_quants.py`` (dequantization),
``gguf_config.py`` (the transformers config), this file (names, the tensor plan, the checkpoint),
``gguf_packed.py``/``gguf_mode.py`` (weights kept packed for the CPU kernels).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT

from tokenfab.loader.errors import ModelLoadError
from tokenfab.loader.gguf_config import _ARCHITECTURES, _ROPE_FREQS, _build_config
from tokenfab.loader.gguf_quants import dequantize, supports_ggml_type
from tokenfab.loader.gguf_reader import _Meta, _open, _torch_shape, load_gguf_tokenizer

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = [
    "PACKABLE_TYPES",
    "GGUFCheckpoint",
    "PackedTensor",
    "dequantize",
    "load_gguf",
    "load_gguf_tokenizer",
    "supports_ggml_type",
]

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


