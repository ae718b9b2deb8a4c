"""Batch-invariant mode: whether the kernels must give a row the same bits whatever else is in the batch.

Speculative decoding verifies k drafts in one forward of k + 1 query rows per sequence, and its
output is only identical to plain decoding when each verify row gets, bit for bit, what a decode
step at that position gives (else near-ties flip). In this mode:

- linear layers (``layers.linear.linear``): CPU float32 takes the row-invariant C kernel
  (``kernels.cpu.matmul_f32``), CUDA / Triton the fixed-tile persistent matmul
  (``kernels.matmul_invariant``), instead of MKL / cuBLAS (whose kernel choice depends on M);
- Triton paged attention (``kernels.attention``): short extends (<= ``SHORT_EXTEND_ROWS`` query
  rows, i.e. verify rows) run as per-row decode work items through the split-KV decode kernel,
  whose split count is fixed per model and device (not chosen from the batch size); MLA likewise.

The CPU native attention is decode-structured for short extends always (no mode needed).

The mode belongs to the engine that runs the forward, not to the process: ``ModelRunner`` sets it
around its own forward (``batch_invariant_mode``), so two engines in one process (tests, an offline
``LLM`` beside a server) never change each other's numerics. It is a ``ContextVar``: each thread
(the engine's step thread) and each asyncio task sees its own value. ``TOKENFAB_BATCH_INVARIANT=1``
sets the default: the mode of code outside any ``batch_invariant_mode`` block, and of a runner
whose ``batch_invariant`` is None (it inherits its caller's mode).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator

#: extends of at most this many query rows are computed as decode rows in batch-invariant mode
#: (the CPU native kernel's threshold too: ``kernels/cpu/paged_attention.c``)
SHORT_EXTEND_ROWS = 32


def default_batch_invariant() -> bool:
    """``TOKENFAB_BATCH_INVARIANT`` (1/true/yes: on), the mode outside any runner's forward."""
    return os.environ.get("TOKENFAB_BATCH_INVARIANT", "0").lower() in ("1", "true", "yes")


_DEFAULT = default_batch_invariant()
_mode: contextvars.ContextVar[bool] = contextvars.ContextVar("tokenfab_batch_invariant", default=_DEFAULT)


def batch_invariant() -> bool:
    """Whether the forward running in this thread / task is batch-invariant."""
    return _mode.get()


@contextlib.contextmanager
def batch_invariant_mode(on: bool | None = True) -> Iterator[None]:
    """Batch-invariant (or not) for the duration of a ``with`` block, in this thread / task only;
    None leaves the surrounding mode as it is."""
    if on is None:
        yield
        return
    token = _mode.set(bool(on))
    try:
        yield
    finally:
        _mode.reset(token)
