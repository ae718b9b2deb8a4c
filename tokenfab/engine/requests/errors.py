"""Errors the engine raises to its callers (the server maps them to HTTP statuses)."""

from __future__ import annotations

import json
from typing import Any


class EngineDeadError(RuntimeError):
    """The engine cannot go on (a device error, or it was shut down): no more requests are served
    (HTTP 503)."""


class RequestFailedError(RuntimeError):
    """One request failed inside an engine step (its constraint raised, its rows of the forward
    failed...). Only that request is affected; the others go on (HTTP 500 for that request)."""


class QueueFullError(RuntimeError):
    """More requests are waiting than ``max_waiting`` allows (HTTP 429)."""


def is_device_fatal(error: BaseException) -> bool:
    """Whether ``error`` means the accelerator is gone (a CUDA error poisons the context: every
    later kernel launch fails too), so no request can be served any more."""
    accel = getattr(__import__("torch"), "AcceleratorError", None)
    if accel is not None and isinstance(error, accel):
        return True
    return "CUDA error" in str(error) or "CUBLAS_STATUS" in str(error)


def raise_if_fatal(error: BaseException) -> None:
    """Re-raise ``error`` as ``EngineDeadError`` when the engine cannot go on (it is one already, or
    the device failed); return when it belongs to the requests at hand (the caller fails only them)."""
    if isinstance(error, EngineDeadError):
        raise error
    if is_device_fatal(error):
        raise EngineDeadError(f"the device failed, the engine cannot go on: {error}") from error


def parse_json_option(text: str, name: str, error: type[ValueError] = ValueError) -> Any:
    """The JSON value of the option ``name`` given as text; ``error`` ("<name> is not valid JSON: ...")
    when it is not JSON."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{name} is not valid JSON: {e}") from None
