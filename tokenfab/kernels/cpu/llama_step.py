"""ctypes wrapper of ``llama_step.c``: one forward step of a Llama-family decoder with packed GGML
linear weights, driven from C (the same kernels as the Python layers, in the same order: the same
bits, without ~300 Python-level calls a step).

The model side (``models/llama_native.py``) describes the model in two int64 tables, built once:
``cfg`` (:data:`CFG_FIELDS`) and ``layers`` ``[n_layers, LAYER_WIDTH]`` (:data:`LAYER_FIELDS`, four
linear layers of :data:`LINEAR_FIELDS` each). Pointers are stored as int64; the tensors they point
to must stay alive and unmoved while the tables are used (the model side holds them).
"""

from __future__ import annotations

import torch

from tokenfab.kernels.cpu import native_library
from tokenfab.kernels.cpu.checks import (
    check_paged_indices,
    check_positions,
    check_query_rows,
    check_slots,
    check_status,
)

CFG_FIELDS = ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "embed", "embed_qtype",
              "final_norm", "rotary_dim", "neox", "block_size", "qk_norm")
LINEAR_FIELDS = ("weight", "qtype", "act_q8", "bias", "rows", "row16")
LINEARS = ("qkv", "o", "gate_up", "down")
LAYER_FIELDS = ("input_norm", "post_norm", "k_cache", "v_cache", "cos_sin", "window", "q_norm", "k_norm") + tuple(
    f"{lin}.{f}" for lin in LINEARS for f in LINEAR_FIELDS)
LAYER_WIDTH = len(LAYER_FIELDS)


def pack_table(rows: list[dict[str, int]], fields: tuple[str, ...]) -> torch.Tensor:
    """int64 ``[len(rows), len(fields)]`` with each row's values in ``fields`` order (missing: 0)."""
    return torch.tensor([[int(r.get(f, 0)) for f in fields] for r in rows], dtype=torch.int64)


def llama_step(cfg: torch.Tensor, layers: torch.Tensor, eps: float, scale: float, input_ids: torch.Tensor,
               positions: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
               cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, max_query_len: int,
               limits: tuple[int, int, int, int]) -> torch.Tensor:
    """Final-norm hidden states ``[T, hidden]`` float32 of one flat batch (``ForwardBatch``'s tensors).

    ``limits``: (vocabulary rows, rotary positions, cache blocks, cache slots): every index is
    checked against them before the kernel runs (a ValueError, as the per-layer kernels raise)."""
    lib = native_library()
    if lib is None:
        raise RuntimeError("llama_step needs the native CPU library")
    vocab, n_pos, n_blocks, n_slots = limits
    t, b = input_ids.shape[0], context_lens.shape[0]
    hidden = torch.empty(t, int(cfg[1]), dtype=torch.float32)
    if t == 0:
        return hidden
    ids = input_ids.to(torch.int64).contiguous()
    lo, hi = int(ids.numpy().min()), int(ids.numpy().max())
    if lo < 0 or hi >= vocab:
        raise ValueError(f"token id {lo if lo < 0 else hi} is outside the vocabulary's {vocab} rows")
    pos = positions.to(torch.int64).contiguous()
    check_positions(pos, t, n_pos)
    slots = slot_mapping.to(torch.int64).contiguous()
    check_slots(slots, t, n_slots)
    tables = block_tables.to(torch.int32).contiguous()
    ctx = context_lens.to(torch.int32).contiguous()
    cu = None
    if max_query_len != 1:
        cu = cu_seqlens_q.to(torch.int32).contiguous()
        check_query_rows(cu, ctx, t)
    elif t != b:
        raise ValueError(f"a decode step has one token per sequence: {t} tokens for {b} sequences")
    if tables.dim() != 2 or tables.shape[0] != b:
        raise ValueError(f"block_tables must be [{b}, max_blocks], got {tuple(tables.shape)}")
    check_paged_indices(tables, ctx, cu, n_blocks, int(cfg[11]))
    rc = lib.llama_step_f32(cfg.data_ptr(), layers.data_ptr(), float(eps), float(scale), ids.data_ptr(),
                            pos.data_ptr(), slots.data_ptr(), t, tables.data_ptr(), tables.stride(0),
                            cu.data_ptr() if cu is not None else None, ctx.data_ptr(), b, hidden.data_ptr())
    check_status(rc, "llama_step_f32")
    return hidden
