"""Input checks of the native CPU kernels: a scheduler bug becomes a ValueError, not heap corruption.

The C kernels index the paged cache with block ids, slots and positions taken straight from
their index tensors, so an id past the cache reads or writes outside it. Each check here is a
few vectorised reductions over the [B] / [B, max_blocks] / [T] index tensors (no per-element
Python). The kernels run once per layer per step, so the checks must stay in the microseconds:
they reduce numpy views of the (CPU) tensors, which costs about a microsecond a reduction where
a torch op costs several.
"""

from __future__ import annotations

import numpy as np
import torch

from tokenfab.forward_batch import ForwardBatch


def check_dims(name: str, t: torch.Tensor, dim: int) -> None:
    if t.dim() != dim:
        raise ValueError(f"{name} must have {dim} dimensions, got shape {tuple(t.shape)}")


def check_status(rc: int, kernel: str) -> None:
    """A non-zero status from a C kernel (common.h: TF_ENOMEM) as an exception."""
    if rc == 1:
        raise MemoryError(f"native CPU kernel {kernel}: could not allocate its work buffer")
    if rc != 0:
        raise RuntimeError(f"native CPU kernel {kernel} failed with status {rc}")


def check_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    ctx: torch.Tensor,
    cu: torch.Tensor | None,
    sinks: torch.Tensor | None,
) -> None:
    """Shapes agree, and every block a sequence's context reaches is a block of the cache.

    ``tables`` [B, W] and ``ctx`` [B] are the int32 tensors the kernel reads; ``cu`` [B + 1] too
    when given (its end and the row counts are checked by the caller). Only the first
    ceil(ctx / block_size) entries of a row are read, so only those are checked: the padding past
    them may hold anything.
    """
    check_dims("q", q, 3)
    check_dims("k_cache", k_cache, 4)
    check_dims("v_cache", v_cache, 4)
    check_dims("block_tables", tables, 2)
    check_dims("context_lens", ctx, 1)
    t, hq, d = q.shape
    nb, bs, hkv, dk = k_cache.shape
    if tuple(v_cache.shape[:3]) != (nb, bs, hkv):
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} disagree on "
                         "[blocks, block_size, kv heads]")
    if dk != d:
        raise ValueError(f"q has head size {d} but k_cache holds {dk}")
    b, w = tables.shape
    if ctx.shape[0] != b:
        raise ValueError(f"block_tables has {b} rows for {ctx.shape[0]} sequences")
    if sinks is not None and sinks.numel() != hq:
        raise ValueError(f"sinks has {sinks.numel()} entries for {hq} query heads")
    if not indices_checked(tables, ctx, cu, nb, bs, t):
        check_paged_indices(tables, ctx, cu, nb, bs)
        remember_checked(tables, ctx, cu, nb, bs, t)


# The index tensors of the last batch whose indices passed, with their version counters, the
# cache geometry and the query-row count: every layer of a step passes the same (int32,
# contiguous) tensors, so the numpy reductions run once a step, not once a layer. Holding the
# tensors keeps their ids from being reused; an in-place change bumps a version and the next call
# checks again.
_last_checked: tuple | None = None


def _versions(tables: torch.Tensor, ctx: torch.Tensor, cu: torch.Tensor | None) -> tuple[int, ...] | None:
    """The tensors' version counters. Inference tensors (made under torch.inference_mode, as the
    engine's batches are) have none, so an in-place change could not be seen: they are memoized only
    while they are the index tensors of the latest ``ForwardBatch`` (whose tensors are never changed
    in place), i.e. once a step; any other inference tensors are checked every time (None)."""
    if tables.is_inference() or ctx.is_inference() or (cu is not None and cu.is_inference()):
        ref = ForwardBatch.latest
        b = ref() if ref is not None else None
        if b is None or b.block_tables is not tables or b.context_lens is not ctx \
                or (cu is not None and b.cu_seqlens_q is not cu):
            return None
        return (-1, id(b))
    return tables._version, ctx._version, -1 if cu is None else cu._version


def indices_checked(tables: torch.Tensor, ctx: torch.Tensor, cu: torch.Tensor | None, nb: int, bs: int,
                    t: int) -> bool:
    """Whether exactly these index tensors (unchanged since) already passed for this cache geometry
    (``nb`` blocks of ``bs``) and ``t`` query rows."""
    m = _last_checked
    return (m is not None and m[0] is tables and m[1] is ctx and m[2] is cu
            and m[3] == _versions(tables, ctx, cu) and m[4:] == (nb, bs, t))


def remember_checked(tables: torch.Tensor, ctx: torch.Tensor, cu: torch.Tensor | None, nb: int, bs: int,
                     t: int) -> None:
    global _last_checked
    v = _versions(tables, ctx, cu)
    _last_checked = None if v is None else (tables, ctx, cu, v, nb, bs, t)


def check_paged_indices(tables: torch.Tensor, ctx: torch.Tensor, cu: torch.Tensor | None, nb: int, bs: int) -> None:
    """Contexts in [0, what the table covers], every block a context reaches inside the cache's
    ``nb`` blocks, ``cu`` starting at 0."""
    b, w = tables.shape
    if b == 0:
        return
    if cu is not None and int(cu.numpy()[0]) != 0:
        raise ValueError(f"cu_seqlens_q must start at 0, not {int(cu[0])}")
    c = ctx.numpy()
    lo, hi = int(c.min()), int(c.max())
    if lo < 0:
        raise ValueError(f"context_lens holds a negative length ({lo})")
    if hi > w * bs:
        raise ValueError(f"a context of {hi} tokens is longer than its block table covers "
                         f"({w} blocks of {bs} tokens)")
    if w == 0:
        return
    ids = tables.numpy()
    if int(ids.min()) >= 0 and int(ids.max()) < nb:
        return  # the common case: the whole table, padding included, is in range
    # Only the first ceil(ctx / bs) entries of each row are read: check those alone.
    used = ids[np.arange(w) < ((c + (bs - 1)) // bs)[:, None]]
    if used.size:
        blk_min, blk_max = int(used.min()), int(used.max())
        if blk_min < 0 or blk_max >= nb:
            bad = blk_min if blk_min < 0 else blk_max
            raise ValueError(f"block_tables holds block id {bad}, outside the cache's {nb} blocks")


def check_query_rows(cu: torch.Tensor, ctx: torch.Tensor, t: int) -> None:
    """``cu`` [B + 1] int32 ends at ``t`` query rows and gives every sequence 0 <= rows <= its context."""
    b = ctx.shape[0]
    cu_np = cu.numpy()  # numpy: ~1 us a reduction where a torch op costs several
    if cu.dim() != 1 or cu.shape[0] != b + 1 or int(cu_np.reshape(-1)[-1]) != t:
        raise ValueError(f"cu_seqlens_q must have {b + 1} entries ending at {t} query rows")
    q_lens = np.diff(cu_np)
    if b and (int(q_lens.min()) < 0 or bool((q_lens > ctx.numpy()).any())):
        raise ValueError("every sequence needs 0 <= query rows <= context length")  # keys from ctx - q_len


def check_slots(slots: torch.Tensor, n_tokens: int, n_slots: int) -> None:
    """``slots`` [T]: each -1 (skip) or a slot of the cache."""
    check_dims("slot_mapping", slots, 1)
    if slots.shape[0] != n_tokens:
        raise ValueError(f"slot_mapping has {slots.shape[0]} entries for {n_tokens} tokens")
    if n_tokens == 0:
        return
    s = slots.numpy()
    lo, hi = int(s.min()), int(s.max())
    if lo < -1 or hi >= n_slots:
        raise ValueError(f"slot_mapping holds slot {lo if lo < -1 else hi}, outside the cache's {n_slots} slots "
                         "(-1 skips a token)")


def check_positions(positions: torch.Tensor, n_tokens: int, n_positions: int) -> None:
    """``positions`` [T]: each a row of the cos/sin cache."""
    if positions.dim() != 1 or positions.shape[0] != n_tokens:
        raise ValueError(f"positions must have shape ({n_tokens},), got {tuple(positions.shape)}")
    if n_tokens == 0:
        return
    p = positions.numpy()
    lo, hi = int(p.min()), int(p.max())
    if lo < 0:
        raise ValueError(f"negative position {lo}")
    if hi >= n_positions:
        raise ValueError(f"position {hi} is past the rotary cache's {n_positions} positions")
