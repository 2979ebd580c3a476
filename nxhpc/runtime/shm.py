"""SharedArena: every stage buffer of a block run in ONE ``multiprocessing.shared_memory`` segment.

Owns: the layout (named, packed, 64-byte aligned buffers; float32 unless a buffer asks for another
fixed-size dtype), the named numpy views, and the segment's lifetime. Must not: compute anything,
or let a segment outlive the run.

Lifetime policy. By default (``named=False``) the segment is unlinked from ``/dev/shm`` right
after it is mapped: forked workers inherit the mapping, nobody needs the name, and nothing can
leak whatever happens afterwards (exception, Ctrl-C, SIGTERM, even SIGKILL of the parent).
``named=True`` keeps the name visible (for attaching from another process or for inspection);
such a segment is unlinked by :meth:`SharedArena.close`, by the context manager, by
:func:`cleanup_all` (which ``nxhpc.blockrun`` calls from its signal handlers) and by an
``atexit`` hook, always only in the process that created it (never in forked workers).
"""
from __future__ import annotations

import atexit
import os
import secrets
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from multiprocessing import shared_memory

import numpy as np

__all__ = ["SharedArena", "BufferSpec", "cleanup_all", "live_segments", "SHM_PREFIX", "ALIGN"]

#: Every segment name starts with this, then the creating pid: ``nxhpc_<pid>_<random>``.
SHM_PREFIX = "nxhpc_"
#: Byte alignment of every buffer (one cache line; also AVX-512 vector width).
ALIGN = 64

_LOCK = threading.Lock()
_LIVE: dict[int, "SharedArena"] = {}   # id -> named arenas still linked, owned by this process


@dataclass(frozen=True)
class BufferSpec:
    """One buffer of the arena: its shape, dtype and byte offset inside the segment."""
    shape: tuple[int, ...]
    dtype: np.dtype
    offset: int

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize


def _parse_spec(name: object, spec: object) -> tuple[tuple[int, ...], np.dtype]:
    """``shape`` | ``int`` | ``(shape, dtype)`` -> (shape tuple, dtype), with clear errors."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"SharedArena: buffer names must be non-empty str, got {name!r}")
    dtype = np.dtype(np.float32)
    if (isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[0], (tuple, list))
            and not isinstance(spec[1], (int, np.integer))):
        spec, dtype_arg = spec
        try:
            dtype = np.dtype(dtype_arg)
        except TypeError as e:
            raise TypeError(f"SharedArena: buffer {name!r}: bad dtype {dtype_arg!r}") from e
        if dtype.hasobject or dtype.itemsize == 0 or dtype.kind not in "biuf":
            raise TypeError(f"SharedArena: buffer {name!r}: dtype must be a fixed-size numeric "
                            f"type, got {dtype}")
    if isinstance(spec, (int, np.integer)) and not isinstance(spec, bool):
        shape: tuple = (int(spec),)
    elif isinstance(spec, (tuple, list)):
        shape = tuple(spec)
    else:
        raise TypeError(f"SharedArena: buffer {name!r}: shape must be an int or a tuple of ints, "
                        f"got {spec!r}")
    for s in shape:
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 0:
            raise ValueError(f"SharedArena: buffer {name!r}: shape must hold non-negative ints, "
                             f"got {shape!r}")
    return tuple(int(s) for s in shape), dtype


class SharedArena(Mapping):
    """Named numpy views into one shared-memory segment, freed/unlinked exactly once.

    ``SharedArena({"x": (T, D), "mask": ((T,), np.uint8)})``: a shape (or an int) means packed
    float32; ``(shape, dtype)`` picks another numeric dtype. Buffers start zero-filled, each at
    a 64-byte aligned offset, never overlapping. ``arena["x"]`` is a C-contiguous writeable view;
    it is shared with processes forked after the arena was created.
    """

    def __init__(self, buffers: Mapping[str, object], *, named: bool = False,
                 prefix: str = SHM_PREFIX) -> None:
        if not isinstance(buffers, Mapping):
            raise TypeError(f"SharedArena: buffers must be a mapping name -> shape, "
                            f"got {type(buffers).__name__}")
        layout: dict[str, BufferSpec] = {}
        off = 0
        for name, spec in buffers.items():
            shape, dtype = _parse_spec(name, spec)
            layout[name] = BufferSpec(shape, dtype, off)
            off += -(-layout[name].nbytes // ALIGN) * ALIGN
        self._layout = layout
        self.nbytes = off
        self.named = bool(named)
        self.owner_pid = os.getpid()
        self._closed = False
        self._views: dict[str, np.ndarray] = {}
        self._shm: shared_memory.SharedMemory | None = None
        self._linked = False
        seg_name = f"{prefix}{self.owner_pid}_{secrets.token_hex(6)}"
        # Create, map and (by default) unlink as one step: an exception (KeyboardInterrupt
        # included) between creation and unlink still unlinks.
        try:
            self._shm = shared_memory.SharedMemory(name=seg_name, create=True,
                                                   size=max(off, ALIGN))
            self._linked = True
            self.name = self._shm.name.lstrip("/")
            if not self.named:
                self._unlink()
            else:
                with _LOCK:
                    _LIVE[id(self)] = self
        except BaseException:
            self._teardown()
            raise
        # The kernel zero-fills a new segment already; writing the zeros anyway faults every
        # page in here, once, so first-touch page faults are not charged to the first timed
        # stage that writes a buffer (every buffer is written during a run anyway).
        base = np.frombuffer(self._shm.buf, dtype=np.uint8)
        for name, sp in layout.items():
            view = base[sp.offset:sp.offset + sp.nbytes].view(sp.dtype).reshape(sp.shape)
            view[...] = 0
            self._views[name] = view
        del base

    # -- Mapping interface ------------------------------------------------------------------
    def __getitem__(self, name: str) -> np.ndarray:
        if self._closed:
            raise ValueError(f"SharedArena {self.name}: closed (asked for buffer {name!r})")
        try:
            return self._views[name]
        except KeyError:
            raise KeyError(f"SharedArena {self.name}: no buffer named {name!r} "
                           f"(has: {', '.join(self._layout) or 'none'})") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._layout)

    def __len__(self) -> int:
        return len(self._layout)

    def __contains__(self, name: object) -> bool:
        return name in self._layout

    # -- introspection ----------------------------------------------------------------------
    @property
    def layout(self) -> dict[str, BufferSpec]:
        """name -> BufferSpec(shape, dtype, offset) (a copy)."""
        return dict(self._layout)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def linked(self) -> bool:
        """True while the segment's name is still present in /dev/shm."""
        return self._linked

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("named" if self._linked else "unlinked")
        return f"<SharedArena {self.name} {len(self._layout)} buffers {self.nbytes} B {state}>"

    # -- lifetime ---------------------------------------------------------------------------
    def _unlink(self) -> None:
        if self._linked and self._shm is not None and os.getpid() == self.owner_pid:
            try:
                self._shm.unlink()
            except FileNotFoundError:
                pass
            self._linked = False
        with _LOCK:
            _LIVE.pop(id(self), None)

    def _teardown(self) -> None:
        self._unlink()
        self._views.clear()
        if self._shm is not None:
            try:
                self._shm.close()
            except BufferError:
                # Views handed out are still alive. Their memoryview keeps the mmap object
                # (and so the mapping) alive until they are gone, which is memory-safe; the name
                # is already unlinked, so nothing leaks. Drop SharedMemory's own references so
                # its __del__ does not retry (and warn) later.
                shm = self._shm
                shm._buf = None
                shm._mmap = None
                if getattr(shm, "_fd", -1) >= 0:
                    os.close(shm._fd)
                    shm._fd = -1

    def close(self) -> None:
        """Unlink the segment (owner process only) and drop the views. Idempotent.

        In a forked child this only forgets the views: the owner unlinks.
        """
        if self._closed:
            return
        self._closed = True
        if os.getpid() != self.owner_pid:
            self._views.clear()
            return
        self._teardown()

    def __enter__(self) -> "SharedArena":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:  # last resort; close() is the contract
        try:
            if not self._closed and os.getpid() == self.owner_pid:
                self.close()
        except Exception:
            pass


def cleanup_all() -> int:
    """Unlink every named arena this process still owns (signal handlers, atexit). Returns count."""
    with _LOCK:
        arenas = list(_LIVE.values())
    n = 0
    for a in arenas:
        if a.owner_pid == os.getpid():
            a.close()
            n += 1
    return n


def live_segments(pid: int | None = None, prefix: str = SHM_PREFIX) -> list[str]:
    """Names in /dev/shm created by ``pid`` (any pid if None) with our prefix. For tests and checks."""
    try:
        names = os.listdir("/dev/shm")
    except FileNotFoundError:
        return []
    want = prefix if pid is None else f"{prefix}{pid}_"
    return sorted(n for n in names if n.startswith(want))


atexit.register(cleanup_all)
