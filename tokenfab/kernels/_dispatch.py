"""The one rule that chooses a kernel's implementation: Triton, the native C CPU kernel, or the
plain PyTorch reference (ARCHITECTURE.md, kernel rule 3).

``backend(t, native)`` answers for an op whose first tensor argument is ``t``:

- ``TOKENFAB_KERNELS=triton``: "triton" for every op (the interpreter on CPU, ``TRITON_INTERPRET=1``).
- ``TOKENFAB_KERNELS=torch``: "reference" for every op: no Triton kernel and no C kernel runs.
- ``auto`` (default): CUDA tensors "triton"; CPU tensors "native" when the op has a C kernel
  (``native=True``, ``kernels/cpu``) and the C kernels are enabled (``TOKENFAB_CPU_NATIVE``), else
  "reference". A C wrapper that cannot take the tensors (dtype, layout, no compiler) returns None
  and the reference runs.

Every op follows it: the registered custom ops (``torch.ops.tokenfab.*``, what ``torch.compile``
traces) in their bodies, and the eager entry points (``eager_op``: what layers call, skipping the
custom-op dispatcher on CPU).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Literal

import torch

from tokenfab.kernels.cpu import enabled as native_enabled
from tokenfab.kernels.cpu import getenv

Backend = Literal["triton", "native", "reference"]
MODES = ("auto", "triton", "torch")
_last: tuple[str, str] = ("auto", "auto")  # (raw TOKENFAB_KERNELS, its mode): skip re-parsing


def kernel_mode() -> str:
    """``TOKENFAB_KERNELS`` (auto, triton or torch), read on every call (tests change it) but cheaply:
    ``backend`` runs ~700 times a decoded token."""
    global _last
    raw = getenv("TOKENFAB_KERNELS", "auto")
    if raw == _last[0]:
        return _last[1]
    mode = raw.lower()
    if mode not in MODES:
        raise ValueError(f"TOKENFAB_KERNELS must be auto, triton or torch, not {mode!r}")
    _last = (raw, mode)
    return mode


def backend(t: torch.Tensor, native: bool = False) -> Backend:
    """The implementation of an op on tensor ``t``; ``native``: the op has a C CPU kernel."""
    mode = kernel_mode()
    if mode == "triton":
        return "triton"
    if mode == "torch":
        return "reference"
    if t.is_cuda:
        return "triton"
    return "native" if native and native_enabled() else "reference"


def use_triton(t: torch.Tensor) -> bool:
    """``backend(t) == "triton"`` (the registered ops' bodies: Triton or the reference)."""
    return backend(t) == "triton"


def choose(t: torch.Tensor, triton_fn: Callable, native_fn: Callable | None, ref_fn: Callable, *args, **kwargs):
    """Run the implementation ``backend(t)`` picks on ``args``; a native function that returns None
    (it cannot take these tensors) falls back to the reference."""
    choice = backend(t, native=native_fn is not None)
    if choice == "triton":
        return triton_fn(*args, **kwargs)
    if choice == "native":
        out = native_fn(*args, **kwargs)  # type: ignore[misc]
        if out is not None:
            return out
    return ref_fn(*args, **kwargs)


def eager_op(op: Callable, ref: Callable, native_op: Callable | None = None,
             triton_fn: Callable | None = None) -> Callable:
    """An op's eager entry point (what layers call), dispatched by ``backend`` on its first argument.

    ``op`` is the registered custom op (Triton inside its body), which is also what runs under
    ``torch.compile``; ``native_op`` (same signature) returns None for tensors it cannot take.
    On CPU this skips the custom-op dispatcher (tens of microseconds a call, which adds up to
    milliseconds a step over a model's ~200 op calls). ``triton_fn``: the Triton launcher, called
    directly instead of through ``op`` (skipping the dispatcher on GPU too).
    """

    @functools.wraps(ref)
    def call(first: torch.Tensor, *args, **kwargs):
        if torch.compiler.is_compiling():
            return op(first, *args, **kwargs)
        return choose(first, triton_fn or op, native_op, ref, first, *args, **kwargs)

    call.op = op  # type: ignore[attr-defined]
    call.ref = ref  # type: ignore[attr-defined]
    return call


def kernel_op(
    name: str,
    triton_fn: Callable,
    ref: Callable,
    fake: Callable,
    *,
    native: Callable | None = None,
    signature: Callable | None = None,
    mutates_args: Sequence[str] = (),
    doc: str | None = None,
) -> torch.library.CustomOpDef:
    """Register ``tokenfab::<name>``, the op ``torch.compile`` traces, from one declaration.

    Its schema is the signature of ``signature`` (default: ``ref``, the plain-PyTorch reference
    of the same signature, kernel rule 2), so the parameter list is written for the reference and
    the Triton launcher only. Its body runs ``choose`` on the first argument (Triton, the native
    C kernel when ``native`` is given, else the reference); ``fake`` computes the output's shape
    and dtype (it may take ``(*args)``: trailing arguments left at their defaults can be omitted).
    """

    def body(*args, **kwargs):
        first = args[0] if args else next(iter(kwargs.values()))
        return choose(first, triton_fn, native, ref, *args, **kwargs)

    body.__signature__ = inspect.signature(signature or ref, eval_str=True)  # type: ignore[attr-defined]
    body.__name__ = body.__qualname__ = name
    body.__module__ = (signature or ref).__module__
    body.__doc__ = doc or (signature or ref).__doc__
    op = torch.library.custom_op(f"tokenfab::{name}", body, mutates_args=tuple(mutates_args))
    op.register_fake(fake)
    return op


def checked(ref: Callable, check: Callable) -> Callable:
    """``ref`` after ``check``, which gets every argument (defaults applied) by keyword: the argument
    checks a Triton launcher makes, run on the reference path of an op too."""
    sig = inspect.signature(ref)

    @functools.wraps(ref)
    def call(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        check(**bound.arguments)
        return ref(*args, **kwargs)

    return call
