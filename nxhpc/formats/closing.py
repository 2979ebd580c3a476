"""The ``with`` statement for every nxhpc object that holds a map, an arena or workers.

Owns :class:`Closing`, a mixin: ``with obj:`` gives ``obj`` and calls ``obj.close()`` on the
way out, whatever ended the block; and :class:`MapHolder`, a closable object whose lifetime
ends with the file map it holds as ``gguf`` (``closed`` once that is dropped). They live in
``formats`` because that is the layer every other one may import (the files here use them
first). Must not: hold state of its own, swallow an exception, or import any other part of
nxhpc.
"""
from __future__ import annotations

from typing import Any, TypeVar

__all__ = ["Closing", "MapHolder"]

_C = TypeVar("_C", bound="Closing")


class Closing:
    """Mixin for a class with an idempotent ``close()``: ``__enter__`` returns the object and
    ``__exit__`` closes it (an exception from the block propagates); pickling or copying one is
    a TypeError saying why."""

    __slots__ = ()

    def close(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} must define close()")

    def __enter__(self: _C) -> _C:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce_ex__(self, protocol: Any) -> Any:
        # pickle, copy.copy and copy.deepcopy: what such an object holds (a file map, a
        # shared-memory arena, worker processes) belongs to this process and cannot travel
        raise TypeError(f"{type(self).__name__} cannot be pickled or copied: it holds this "
                        f"process's open files, shared memory or workers; open one in each "
                        f"process instead")


class MapHolder(Closing):
    """Mixin for a closable object holding one file map as ``self.gguf`` (None once closed):
    ``closed`` says whether it was dropped; ``_drop_map()`` closes it once."""

    __slots__ = ()
    gguf: Any

    @property
    def closed(self) -> bool:
        return self.gguf is None

    def _drop_map(self) -> None:
        if self.gguf is not None:
            self.gguf.close()
            self.gguf = None
