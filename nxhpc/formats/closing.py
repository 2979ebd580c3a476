"""The ``with`` statement for every nxhpc object that holds a map, an arena or workers.

Owns :class:`Closing`, a mixin: ``with obj:`` gives ``obj`` and calls ``obj.close()`` on the
way out, whatever ended the block. It lives in ``formats`` because that is the layer every
other one may import (the files here use it first). Must not: hold state, swallow an
exception, or import any other part of nxhpc.
"""
from __future__ import annotations

from typing import TypeVar

__all__ = ["Closing"]

_C = TypeVar("_C", bound="Closing")


class Closing:
    """Mixin for a class with an idempotent ``close()``: ``__enter__`` returns the object and
    ``__exit__`` closes it (an exception from the block propagates)."""

    __slots__ = ()

    def close(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} must define close()")

    def __enter__(self: _C) -> _C:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
