"""``Forwarded``: a read-only attribute that is another object's attribute, for the engine's faces
that only pass a value through (AsyncEngine reads its engine's, LLMEngine its post-processor's
counters), declared in one line instead of a property each."""

from __future__ import annotations

from collections.abc import Callable
from operator import attrgetter
from typing import Any, Generic, TypeVar, overload

T = TypeVar("T")


class Forwarded(Generic[T]):
    """``x = Forwarded("engine.x")``: reading ``obj.x`` reads ``obj.engine.x`` (a dotted path, read
    afresh each time), passed through ``convert`` when given; there is no setter."""

    def __init__(self, path: str, convert: Callable[[Any], T] | None = None) -> None:
        self.path = path
        self.name = path
        self._get = attrgetter(path)
        self._convert = convert

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, objtype: type | None = None) -> Forwarded[T]: ...
    @overload
    def __get__(self, obj: object, objtype: type | None = None) -> T: ...

    def __get__(self, obj: object | None, objtype: type | None = None) -> T | Forwarded[T]:
        if obj is None:
            return self
        value = self._get(obj)
        return value if self._convert is None else self._convert(value)

    def __set__(self, obj: object, value: Any) -> None:  # read-only, as a property without a setter
        raise AttributeError(f"property {self.name!r} of {type(obj).__name__!r} object has no setter")
