"""Batch invariance checks the kernel tests share: a row's result must not depend on the batch around it."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def assert_rows_invariant(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, row_counts: Sequence[int],
                          probe_rows: Sequence[int]) -> torch.Tensor:
    """Row r of fn(x[:m]) for every m in ``row_counts``, and fn(x[r:r+1]) for every r in ``probe_rows``,
    equal row r of fn(x) bit for bit; returns fn(x)."""
    full = fn(x)
    for m in row_counts:
        out = fn(x[:m])
        bad = [r for r in range(m) if not torch.equal(out[r], full[r])]
        assert not bad, f"rows {bad[:5]} of a {m}-row product differ from the {x.shape[0]}-row product"
    for r in probe_rows:
        assert torch.equal(fn(x[r:r + 1])[0], full[r]), f"row {r} alone differs from row {r} of the full product"
    return full
