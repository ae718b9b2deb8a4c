"""Fast/slow tiers for parametrized kernel tests (issue 25).

The interpreter runs every kernel launch in Python, so a parametrization's cross product (path x
dtype x shape) costs seconds per row. ``tiered`` keeps in the fast tier the rows that take a distinct
code path (each dtype, each mask or edge case, each option) and marks the rows that repeat a path at
another size ``@pytest.mark.slow``: ``make test-slow`` still runs the whole product.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence

import pytest
import torch


def _id(value: object) -> str:
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, (list, tuple)):
        return "_".join(map(_id, value))
    if isinstance(value, dict):
        return "-".join(f"{k}={v}" for k, v in value.items())
    return str(value)


def tiered(rows: Iterable[Sequence], slow: Callable[..., bool]) -> list:
    """One ``pytest.param`` a row (its values as the test's arguments, in order, the id their names
    joined by '-'); rows where ``slow(*row)`` holds carry the slow mark."""
    return [pytest.param(*row, id="-".join(map(_id, row)), marks=[pytest.mark.slow] if slow(*row) else [])
            for row in rows]


def tiered_product(*axes: Sequence, slow: Callable[..., bool]) -> list:
    """``tiered`` over the cross product of ``axes`` (the first axis varies slowest)."""
    return tiered(itertools.product(*axes), slow)


def fast_dtypes(dtypes: Sequence[torch.dtype], fast: dict[str, Sequence[torch.dtype]]) -> list:
    """(case name, dtype) rows over ``dtypes``: the fast tier runs the dtypes ``fast[case]`` names,
    the slow tier the others (a pair that repeats a path another fast pair already takes)."""
    return tiered([(name, d) for name in fast for d in dtypes], lambda name, d: d not in fast[name])
