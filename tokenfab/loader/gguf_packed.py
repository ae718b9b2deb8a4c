"""Loading a GGUF file with its block-quantized weights kept packed (``--quantization gguf``).

The model is built as usual, then every linear whose checkpoint tensors are all stored in one
packable ggml type (Q8_0, Q4_0, Q4_1; a merged qkv / gate_up needs all its shards in the same
type) is swapped for a :class:`~tokenfab.layers.ggml_linear.GGMLLinear` holding the raw rows; the
token embedding for a :class:`GGMLEmbedding`, and the LM head (tied: sharing the embedding's rows)
for a :class:`GGMLLMHead`. The swap happens before any weight is read, so the float32 parameters
of the swapped layers are never written (their pages never touched) and are freed at once.
At TP > 1 a swapped layer keeps only its rank's packed rows / K blocks (``_tp_part``).
Tensors in other types (norms, F16/F32 weights, K-quants) load dequantized through
:func:`~tokenfab.loader.weights.load_weights` exactly as in the unpacked path, and so do packable
tensors of a layer that cannot be swapped (mixed types in one merged projection).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from tokenfab.kernels.cpu.ggml_matmul import dequantize as dequantize_packed
from tokenfab.layers.embedding import LMHead, VocabEmbedding
from tokenfab.layers.ggml_linear import GGMLEmbedding, GGMLLinear, GGMLLMHead
from tokenfab.layers.linear import Linear, MergedLinear
from tokenfab.layers.tp_split import TPSplit
from tokenfab.loader.errors import ModelLoadError
from tokenfab.loader.gguf import PACKABLE_TYPES, GGUFCheckpoint, PackedTensor
from tokenfab.loader.weights import _target, load_weights

log = logging.getLogger("tokenfab")

_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}


def row_bytes(qtype: str, k: int) -> int:
    return k // 32 * _BLOCK_BYTES[qtype]


@dataclass
class _Swap:
    module: str  # our module name
    qtype: str
    shards: list[tuple[int, int]]  # row range of each checkpoint shard
    filled: set[tuple[str, int]] = field(default_factory=set)  # ("weight"|"bias", shard)


def _set_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)


def _groups(model: nn.Module, ckpt: GGUFCheckpoint) -> dict[str, dict[int | None, str]]:
    """our weight parameter name -> {shard (None: unmerged): checkpoint name}."""
    remap = getattr(model, "remap_checkpoint_name", None)
    out: dict[str, dict[int | None, str]] = {}
    for name in ckpt.tensor_names():
        ours = remap(name) if remap is not None else name
        if ours is None or not ours.endswith(".weight"):
            continue
        target, shard = _target(model, ours)
        out.setdefault(target, {})[shard] = name
    return out


def _plan_swaps(model: nn.Module, ckpt: GGUFCheckpoint, act: str) -> dict[str, _Swap]:
    """Swap the layers that can run packed; returns our module name -> its swap."""
    types = ckpt.ggml_types()
    modules = dict(model.named_modules())
    swaps: dict[str, _Swap] = {}
    for weight, shards in _groups(model, ckpt).items():
        mod_name = weight.rsplit(".", 1)[0]
        mod = modules.get(mod_name)
        qtypes = {types[n] for n in shards.values()}
        if len(qtypes) != 1 or (qtype := qtypes.pop()) not in PACKABLE_TYPES:
            continue
        if isinstance(mod, MergedLinear):
            if set(shards) != set(range(len(mod.shard_sizes))):
                continue  # a missing shard: load_weights reports it
            ranges = [mod.shard_range(i) for i in range(len(mod.shard_sizes))]
        elif type(mod) in (Linear, VocabEmbedding, LMHead):
            ranges = [(0, mod.weight.shape[0])]
        else:
            continue
        n, k = mod.weight.shape
        split = mod.tp_split
        if k % 32 and split is not None and split.dim == 1 and split.full[0] % 32 == 0:
            raise ModelLoadError(ckpt.path, f"{weight}: tensor parallel size {split.size} splits its {split.full[0]} "
                                 f"input columns into {k} per rank, which are not whole 32-element {qtype} blocks")
        if k % 32:
            continue
        rows = torch.empty(n, row_bytes(qtype, k), dtype=torch.uint8)
        if isinstance(mod, VocabEmbedding):
            new: nn.Module = GGMLEmbedding(rows, qtype, k)
        else:
            bias = torch.empty(n) if getattr(mod, "bias", None) is not None else None
            cls = GGMLLMHead if isinstance(mod, LMHead) else GGMLLinear
            new = cls(rows, qtype, k, bias=bias, act=act)
        if mod.tp_split is not None:  # tensor parallel: the packed layer keeps the same part
            new.tp_split, new.reduce_output = mod.tp_split, getattr(mod, "reduce_output", False)
            if isinstance(new, GGMLLMHead):
                new.vocab_size = mod.vocab_size
        _set_module(model, mod_name, new)
        swaps[mod_name] = _Swap(mod_name, qtype, ranges)
    # a tied LM head reads the embedding's packed rows
    emb = getattr(getattr(model, "model", None), "embed_tokens", None)
    head = getattr(model, "lm_head", None)
    if (isinstance(emb, GGMLEmbedding) and isinstance(head, LMHead) and head.bias is None
            and getattr(model.config, "tie_word_embeddings", False)):
        tied = GGMLLMHead(emb.qweight, emb.qtype, emb.hidden_size, act=act)
        tied.tied = True
        tied.tp_split, tied.vocab_size = emb.tp_split, head.vocab_size
        model.lm_head = tied
    return swaps


def _fill(model: nn.Module, swaps: dict[str, _Swap], ckpt: GGUFCheckpoint
          ) -> Iterator[tuple[str, torch.Tensor]]:
    """Copy the swapped layers' rows (and biases) in; yield every other tensor, dequantized."""
    remap = getattr(model, "remap_checkpoint_name", None)
    for name, t in ckpt.tensors(packed=True):
        ours = remap(name) if remap is not None else name
        target, shard = _target(model, ours) if ours is not None else (name, None)
        mod_name, _, kind = target.rpartition(".")
        swap = swaps.get(mod_name)
        if swap is None or kind not in ("weight", "bias"):
            yield name, dequantize_packed(t.rows, t.qtype, t.k) if isinstance(t, PackedTensor) else t
            continue
        mod = model.get_submodule(mod_name)
        lo, hi = swap.shards[shard or 0]
        dst = mod.qweight if kind == "weight" else mod.bias
        src = t.rows if isinstance(t, PackedTensor) else t
        if mod.tp_split is not None:
            src = _tp_part(mod.tp_split, kind, src, shard, swap.qtype, name, ckpt.path)
        if dst is None or tuple(dst[lo:hi].shape) != tuple(src.shape):
            raise ModelLoadError(ckpt.path, f"tensor {name} has shape {tuple(src.shape)}, expected "
                                 f"{tuple(dst[lo:hi].shape) if dst is not None else 'none'}")
        dst[lo:hi].copy_(src)
        swap.filled.add((kind, shard or 0))
    for swap in swaps.values():
        mod = model.get_submodule(swap.module)
        kinds = ("weight", "bias") if getattr(mod, "bias", None) is not None else ("weight",)
        missing = [f"{swap.module}.{k} (shard {i})" for k in kinds for i in range(len(swap.shards))
                   if (k, i) not in swap.filled]
        if missing:
            raise ModelLoadError(ckpt.path, f"missing tensors: {', '.join(missing[:5])}")


def _tp_part(split: TPSplit, kind: str, src: torch.Tensor, shard: int | None, qtype: str, name: str,
             path) -> torch.Tensor:
    """Tensor parallel: this rank's packed rows (column-parallel, vocabulary rows zero-padded: a
    zero block dequantizes to zeros) or its whole 32-element blocks of every row (row-parallel)."""
    try:
        if kind == "bias":
            return split.take_bias(src, shard)
        if split.dim == 0:
            return split.take(src, shard, what=name)
        return split.take(src, shard, unit=32, width=_BLOCK_BYTES[qtype], what=name)
    except ValueError as e:
        raise ModelLoadError(path, f"tensor {name}: {e}") from e


def load_gguf_packed(model: nn.Module, ckpt: GGUFCheckpoint, act: str = "f32") -> int:
    """Swap the packable layers of ``model`` and load every tensor of ``ckpt``; returns how many
    layers run packed."""
    swaps = _plan_swaps(model, ckpt, act)
    load_weights(model, _fill(model, swaps, ckpt), Path(ckpt.path))
    log.info("GGUF weights packed: %d layers (%s activations)", len(swaps), act)
    return len(swaps)
