"""Shared by the training-kernel tests: run a function forward and backward, compare with an oracle.

Inputs go to ``DEVICE`` (CUDA when present: the compiled kernels; else CPU: the interpreter)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch

from tests.kernels.conftest import HAS_CUDA
from tests.kernels.tolerances import assert_train_close_scaled

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")

PATHS = ["triton", "torch"]  # TOKENFAB_KERNELS: the Triton kernels (interpreter on CPU) / the torch twins


@pytest.fixture(params=PATHS)
def kernel_path(request, monkeypatch) -> str:
    monkeypatch.setenv("TOKENFAB_KERNELS", request.param)
    return request.param


def forward_backward(fn: Callable, inputs: Sequence[torch.Tensor | None], upstream: Sequence[torch.Tensor],
                     ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """Outputs of ``fn(*inputs)`` and the gradients of every input given the upstream gradients."""
    leaves = [None if t is None else t.detach().to(DEVICE).clone().requires_grad_() for t in inputs]
    upstream = [u.to(DEVICE) for u in upstream]
    outs = fn(*leaves)
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    assert len(outs) == len(upstream)
    wanted = [t for t in leaves if t is not None]
    grads = iter(torch.autograd.grad(outs, wanted, upstream))
    return [o.detach() for o in outs], [None if t is None else next(grads) for t in leaves]


def check_against(fn: Callable, ref: Callable, inputs: Sequence[torch.Tensor | None],
                  upstream: Sequence[torch.Tensor], dtype: torch.dtype | None = None) -> None:
    """Every output and every input's gradient of ``fn`` equals the oracle's (scaled training tolerance)."""
    outs, grads = forward_backward(fn, inputs, upstream)
    ref_outs, ref_grads = forward_backward(ref, inputs, upstream)
    for i, (o, r) in enumerate(zip(outs, ref_outs)):
        try:
            assert_train_close_scaled(o, r, dtype)
        except AssertionError as e:
            raise AssertionError(f"output {i}: {e}") from None
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        if r is None:
            assert g is None
            continue
        try:
            assert_train_close_scaled(g, r, dtype)
        except AssertionError as e:
            raise AssertionError(f"gradient of input {i}: {e}") from None


def saved_tensors(fn: Callable, *args) -> list[torch.Tensor]:
    """The tensors autograd keeps for the backward of ``fn(*args)``."""
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return saved


def opcheck(op, args: tuple) -> None:
    """``torch.library.opcheck``: schema, fake impl and AOT dispatch of a registered custom op."""
    res = torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
    assert all(v == "SUCCESS" for v in res.values()), res


def assert_compiled_matches_eager(fn: Callable, x: torch.Tensor, module: torch.nn.Module) -> None:
    """``fn`` eagerly and under ``torch.compile(fullgraph=True, backend="aot_eager")``: the same output and
    the same gradient of ``module.weight`` (loss: the output's sum of squares)."""
    results = []
    for f in (fn, torch.compile(fn, fullgraph=True, backend="aot_eager")):
        module.zero_grad()
        out = f(x)
        out.pow(2).sum().backward()
        results.append((out.detach(), module.weight.grad.clone()))
    for a, b in zip(*results):
        assert_train_close_scaled(a, b)
