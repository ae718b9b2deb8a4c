"""Layers whose weights stay in a GGUF file's ggml blocks (Q8_0, Q4_0, Q4_1) on CPU.

A packed weight is the file's raw rows, uint8 ``[N, K / 32 * block_bytes]``: 4.5-5 bits a weight
for Q4_x, 8.5 for Q8_0, where a float32 copy costs 32. The products go through
``kernels.cpu.ggml_matmul`` (dequantized in registers, multiplied with float32 activations by
default; ``act="q8"`` quantizes the activations to int8 blocks as llama.cpp does).

- :class:`GGMLLinear`: a linear layer; a merged projection (qkv, gate_up) is its checkpoint
  tensors' packed rows stacked (same K, same block type).
- :class:`GGMLEmbedding`: the token embedding; a lookup dequantizes only the looked-up rows.
- :class:`GGMLLMHead`: the LM head, through the same product; a tied head shares the embedding's
  packed rows (one copy).
"""

from __future__ import annotations

import torch
from torch import nn

from tokenfab.distributed.parallel_state import tp_all_gather_last, tp_all_reduce
from tokenfab.kernels.cpu import native_library
from tokenfab.kernels.cpu.checks import check_status
from tokenfab.kernels.cpu.crossover import PANEL, Q8_TILES, apply_crossover
from tokenfab.kernels.cpu.ggml_matmul import _QTYPE_ID, ggml_dequantize_rows, ggml_matmul
from tokenfab.layers.embedding import vocab_parallel_lookup

# activation modes: "f32" (W4A32/W8A32, the default) and "q8" (int8 activation blocks, opt-in)
ACT_MODES = ("f32", "q8")
_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}
_CHECKED_MATMUL = ggml_matmul  # tests may swap ggml_matmul for the reference: then it runs


def _native_fn(act: str):
    """The C entry point of an activation mode, or None (no native library). The f32 kernel's
    switch to its panel path is set here, once per process, from this machine's measurement
    (``kernels/cpu/crossover.py``); so is the int8 kernel's switch to its many-row tiles."""
    lib = native_library()
    if lib is None:
        return None
    apply_crossover(PANEL if act == "f32" else Q8_TILES)
    return lib.ggml_matmul_f32 if act == "f32" else lib.ggml_matmul_q8


class GGMLLinear(nn.Module):
    """``y = x @ dequant(qweight).T + bias`` with the weight kept packed. Tensor parallel: the rows
    (column-parallel) or the whole 32-element blocks of K (row-parallel, then all-reduced) this
    rank keeps, ``tp_split`` as on the layer it replaced (loader.gguf_packed slices the rows)."""

    tp_split = None  # layers.tp_split.TPSplit at TP > 1
    reduce_output = False

    def __init__(self, qweight: torch.Tensor, qtype: str, in_features: int,
                 bias: torch.Tensor | None = None, act: str = "f32") -> None:
        super().__init__()
        if act not in ACT_MODES:
            raise ValueError(f"act must be one of {ACT_MODES}, got {act!r}")
        if qweight.dtype != torch.uint8 or qweight.dim() != 2:
            raise ValueError(f"a packed weight is a 2-D uint8 tensor, got {qweight.dtype} {tuple(qweight.shape)}")
        self.register_buffer("qweight", qweight.contiguous(), persistent=False)
        self.qtype, self.in_features, self.out_features = qtype, in_features, int(qweight.shape[0])
        self.act = act
        self._qid = _QTYPE_ID[qtype]
        # the C entry point, chosen once at load (None without the native library:
        # TOKENFAB_CPU_NATIVE=0 or no compiler -> the checked wrapper and its reference)
        self._fn = _native_fn(act)
        self._lib = native_library() if self._fn is not None else None
        if self.in_features % 32 or qweight.shape[1] != self.in_features // 32 * _BLOCK_BYTES[qtype]:
            raise ValueError(f"a {qtype} weight of K={in_features} has {self.in_features // 32 * _BLOCK_BYTES[qtype]} "
                             f"bytes a row, got {qweight.shape[1]}")
        # a buffer, not a Parameter: the packed loader fills it (load_weights checks Parameters)
        self.register_buffer("bias", bias, persistent=False)
        # int8 activations: a second copy of the weight in the decode kernel's row16 layout (built
        # on first use from the qweight it was made of; kernels/cpu/ggml_q8_decode.c)
        self.row16: torch.Tensor | None = None
        self._row16_of: torch.Tensor | None = None

    def row16_weight(self) -> torch.Tensor | None:
        """The weight in the row16 layout of the int8 decode kernel, or None (float32 activations,
        no native library, or a build without the kernel: one without AVX2)."""
        lib = native_library() if self.act == "q8" else None
        if lib is None or not lib.ggml_q8_row16_built() or self.qweight.is_cuda:
            return None
        if self._row16_of is not self.qweight:
            w = self.qweight.contiguous()
            n, k, qid = self.out_features, self.in_features, self._qid
            buf = torch.empty(lib.ggml_q8_row16_bytes(n, k, qid), dtype=torch.uint8)
            lib.ggml_q8_row16_pack(w.data_ptr(), n, k, qid, buf.data_ptr())
            self.row16, self._row16_of = buf, self.qweight
        return self.row16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        fn = self._fn if x2.dtype == torch.float32 and not x2.is_cuda else None
        if fn is None or ggml_matmul is not _CHECKED_MATMUL or shape[-1] != self.in_features:
            out = ggml_matmul(x2, self.qweight, self.qtype, self.in_features, act=self.act)
        else:
            # the C kernel straight away: the weight's shape and type were checked once, here
            # (the checked wrapper costs ~10-20 us a call, ~2 ms a token over 121 products)
            out = torch.empty(x2.shape[0], self.out_features, dtype=torch.float32)
            w = self.qweight
            if self.act == "q8":
                # below the many-row tiles' switch (any M in a build without them, 0): the row16
                # copy (the same bits; llama_step.c's rule)
                tiles_from = self._lib.ggml_q8_tile_min_rows()
                r16 = self.row16 if self._row16_of is w else self.row16_weight()
                if r16 is not None and (tiles_from == 0 or x2.shape[0] < tiles_from):
                    fn, w = self._lib.ggml_matmul_q8_row16, r16
            if x2.shape[0]:
                check_status(fn(x2.data_ptr(), w.data_ptr(), x2.shape[0], self.out_features,
                                self.in_features, self._qid, out.data_ptr()), "ggml_matmul")
        if self.bias is not None:
            out += self.bias
        out = out.view(*shape[:-1], self.out_features)
        return tp_all_reduce(out) if self.reduce_output else out

    def logical_numel(self) -> int:
        return self.out_features * self.in_features

    def extra_repr(self) -> str:
        return f"{self.qtype}, in={self.in_features}, out={self.out_features}, act={self.act}"


class GGMLEmbedding(nn.Module):
    """Token embedding from packed rows; a lookup dequantizes only the rows it reads. At TP > 1:
    vocabulary-parallel (this rank's rows, zero-padded; layers.embedding)."""

    tp_split = None

    def __init__(self, qweight: torch.Tensor, qtype: str, hidden_size: int) -> None:
        super().__init__()
        self.register_buffer("qweight", qweight.contiguous(), persistent=False)
        self.qtype, self.hidden_size = qtype, hidden_size
        self.num_embeddings = int(qweight.shape[0])

    def _lookup(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1)
        out = ggml_dequantize_rows(self.qweight, self.qtype, self.hidden_size, ids)
        return out.view(*input_ids.shape, self.hidden_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_split is None:
            return self._lookup(input_ids)
        return vocab_parallel_lookup(input_ids, self.tp_split, self._lookup)

    def logical_numel(self) -> int:
        return self.num_embeddings * self.hidden_size

    def extra_repr(self) -> str:
        return f"{self.qtype}, {self.num_embeddings} x {self.hidden_size}"


class GGMLLMHead(GGMLLinear):
    """Output projection to float32 vocabulary logits from packed rows (tied: the embedding's). At
    TP > 1 its rows are this rank's vocabulary rows; the logits are all-gathered (padding dropped)."""

    vocab_size: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = super().forward(x)
        if self.tp_split is None:
            return logits
        return tp_all_gather_last(logits)[..., : self.vocab_size]

    def logical_numel(self) -> int:  # a tied head's rows are counted once, with the embedding
        return 0 if getattr(self, "tied", False) else super().logical_numel()


def packed_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes of weights, logical parameter count) of a model, packed rows counted as stored and
    tied tensors once; rotary caches and other non-weight buffers are not weights."""
    seen: set[int] = set()
    nbytes = numel = 0
    for p in model.parameters():  # tied parameters listed once
        nbytes += p.numel() * p.element_size()
        numel += p.numel()
    for m in model.modules():
        q = getattr(m, "qweight", None)
        if isinstance(m, GGMLLinear | GGMLEmbedding) and q is not None:
            numel += m.logical_numel()
            if q.data_ptr() not in seen:
                seen.add(q.data_ptr())
                nbytes += q.numel()
            b = getattr(m, "bias", None)
            if isinstance(b, torch.Tensor):
                nbytes, numel = nbytes + b.numel() * b.element_size(), numel + b.numel()
    return nbytes, numel
