"""SharedArena: every stage buffer of a block run in ONE POSIX shared-memory segment.

Owns: the layout (named, packed, 64-byte aligned buffers; float32 unless a buffer asks for another
fixed-size dtype), the named numpy views, the segment's reservation and its lifetime. Must not:
compute anything, or let a segment outlive the run.

Reservation. The segment's memory is reserved up front with ``posix_fallocate``: on tmpfs an
``ftruncate``'d segment is sparse, and a page that cannot be backed when first touched kills the
process with SIGBUS (Docker's default ``/dev/shm`` is 64 MiB; a real-size block needs ~1 GiB).
A shortage is a :class:`ShmSpaceError` naming the bytes needed and free, raised before anything
is mapped. Memory is checked too (:func:`memory_available_bytes`): a ``/dev/shm`` as large as RAM
or larger (tmpfs takes any size it is mounted with) would let a segment bigger than the memory
left be reserved, and the kernel's out-of-memory killer would then end this or another process.

Lifetime policy. By default (``named=False``) the name is unlinked from ``/dev/shm`` in the same
step that creates it (before the memory is even reserved): the open descriptor, then the mapping,
keep the memory; forked workers inherit the mapping, nobody needs the name, and nothing can leak
whatever happens afterwards (exception, Ctrl-C, SIGTERM, even SIGKILL of the parent).
``named=True`` keeps the name visible (for attaching from another process, for inspection, for
the trainer's ring); such a segment is registered with ``multiprocessing``'s resource tracker
(which unlinks it even after a SIGKILL) and unlinked by :meth:`SharedArena.close`, by the context
manager, by a CLI call's frame (:func:`cleanup_since`: the arenas that call made, in its
thread) and by :func:`cleanup_all` from an ``atexit`` hook, always only in the process that
created it (never in forked workers).

Interrupts. Each step records before it acts, in one deferred-signal block
(:class:`nxhpc.runtime.proc.deferred_signals`): the name to unlink is recorded before the
segment is created, the descriptor is forgotten before it is closed (it is closed right after
mapping; the mapping needs no descriptor), and the name is unlinked *by name*, so an interrupt at
any point of ``__init__`` or :meth:`close` leaves nothing behind and never closes a descriptor
twice. What must be released lives in a small record owned by a ``weakref.finalize``, created
before any resource: an arena dropped without ``close()`` (or half-built) is released when it is
collected or at exit; ``close()`` is idempotent, resumes an interrupted attempt, and detaches the
finalizer once nothing is left (a closed arena runs no code when collected).
"""
from __future__ import annotations

import atexit
import errno
import mmap
import os
import secrets
import sys
import threading
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from nxhpc.runtime.proc import deferred_signals

try:                                   # the same primitives multiprocessing.shared_memory uses
    import _posixshmem
except ImportError:                    # pragma: no cover - non-POSIX
    _posixshmem = None

__all__ = ["SharedArena", "BufferSpec", "ShmSpaceError", "arena_bytes", "check_room",
           "cleanup_all", "cleanup_since", "arena_mark", "live_segments",
           "memory_available_bytes", "memory_room", "populate", "shm_free_bytes",
           "SHM_PREFIX", "SHM_DIR", "ALIGN"]

#: Every segment name starts with this, then the creating pid: ``nxhpc_<pid>_<random>``.
SHM_PREFIX = "nxhpc_"
#: Where POSIX shared memory lives on Linux (glibc's ``shm_open``).
SHM_DIR = "/dev/shm"
#: Byte alignment of every buffer (one cache line; also AVX-512 vector width).
ALIGN = 64

_LOCK = threading.Lock()
# id -> named arenas still linked, owned by this process. Weak: an arena dropped without close()
# is released (and unlinked) by its finalizer; cleanup_all() closes those still alive.
_LIVE: "weakref.WeakValueDictionary[int, SharedArena]" = weakref.WeakValueDictionary()
# the serial of the newest named arena; each arena keeps (serial, creating thread) as ``born``:
# cleanup_since() closes only those a call made (a CLI run in-process must not close its
# caller's arenas, nor another thread's)
_SERIAL = [0]


#: What a memory refusal advises running less of, unless its caller says otherwise.
_FEWER_TOKENS = "run fewer tokens (a smaller image)"


class ShmSpaceError(OSError):
    """Not enough shared memory (``/dev/shm``) for a segment, or not enough memory left for it.
    Attributes: ``needed`` and ``free`` (bytes), ``where`` (the directory), ``limit`` (the
    file-size limit, when that is what refused it), ``memory`` (the most the memory left lets
    a segment take, when that is what refused it: :func:`memory_room`), ``unusable`` (why no
    segment can be made there at all: no such directory, read-only, not permitted),
    ``vm_limit`` (the bytes the address-space limit leaves this process to map, when that is
    what refused it). ``advice``: what to run less of, in the memory and address-space
    sentences (default: fewer tokens, a smaller image)."""

    def __init__(self, needed: int, free: int | None, where: str = SHM_DIR,
                 what: str = "SharedArena", limit: int | None = None,
                 memory: int | None = None, unusable: OSError | None = None,
                 shared: bool = True, vm_limit: int | None = None,
                 advice: str = _FEWER_TOKENS) -> None:
        self.needed, self.free, self.where, self.limit = needed, free, where, limit
        self.memory, self.unusable, self.vm_limit = memory, unusable, vm_limit
        need = "the segment needs" if shared else "its buffers need"
        if vm_limit is not None:
            self.message = (f"{what}: not enough address space: {need} {needed} bytes "
                            f"({_mib(needed)}) but the address-space limit "
                            f"(ulimit -v, RLIMIT_AS) leaves {vm_limit} bytes ({_mib(vm_limit)}) "
                            f"to map. Raise the limit or {advice}")
            super().__init__(errno.ENOMEM, self.message)
            return
        if unusable is not None:
            self.message = (f"{what}: cannot create a shared-memory segment in {where}: "
                            f"{unusable.strerror or unusable} (nxhpc's workers share their "
                            f"buffers there; in a container mount a writable tmpfs at {where}, "
                            f"e.g. docker run --shm-size=2g)")
            super().__init__(unusable.errno or errno.EACCES, self.message)
            return
        free_txt = ("an unknown amount free" if free is None
                    else f"{free} bytes free ({_mib(free)})")
        if memory is not None:     # a segment, or (not shared) a process's own buffers
            it, most, keep = (
                ("it", "at most ", ", less an eighth kept for the rest of the run") if shared
                else ("them", "", ""))
            self.message = (f"{what}: not enough memory: {need} {needed} bytes ({_mib(needed)}) "
                            f"but {most}{memory} bytes ({_mib(memory)}) can go to {it} "
                            f"(MemAvailable + SwapFree within the cgroup's limit{keep}); making "
                            f"{it} would call in the out-of-memory killer. "
                            f"{advice[:1].upper()}{advice[1:]} or free memory")
            super().__init__(errno.ENOMEM, self.message)
            return
        if limit is not None:
            why = (f"the process's file-size limit (ulimit -f, RLIMIT_FSIZE) is {limit} bytes; "
                   f"{where} has {free_txt}. Raise the limit")
        else:
            why = (f"{where} has {free_txt}. In a container, start it with a larger "
                   f"/dev/shm (docker run --shm-size=2g ..., or the pod's emptyDir medium: "
                   f"Memory); else free {where} or run fewer tokens")
        self.message = (f"{what}: not enough shared memory: the segment needs {needed} bytes "
                        f"({_mib(needed)}) but {why}")
        super().__init__(errno.ENOSPC if limit is None else errno.EFBIG, self.message)

    def __str__(self) -> str:
        return self.message


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def shm_free_bytes(where: str = SHM_DIR) -> int | None:
    """Bytes an unprivileged process may still allocate in ``where`` (None if unknown)."""
    try:
        st = os.statvfs(where)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None       # "max" (cgroup v2): no limit


def _cgroup_room(proc_cgroup: str = "/proc/self/cgroup",
                 fs: str = "/sys/fs/cgroup") -> int | None:
    """Bytes this process's memory cgroup may still charge, or None where there is no limit or
    it cannot be read: the limit less the usage, the usage less its file cache (the kernel
    reclaims that before it calls the out-of-memory killer: ``active_file`` + ``inactive_file``
    of memory.stat, which leave out tmpfs and shared memory). cgroup v2 (``0::/path``,
    memory.max / memory.current) or v1 (``N:memory:/path``, memory.limit_in_bytes /
    memory.usage_in_bytes, memory.stat's ``total_`` fields); the path as seen from inside a
    namespace may not exist, then the mount's root files are read."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            root, files = fs, ("memory.max", "memory.current")
        elif "memory" in parts[1].split(","):
            root, files = fs + "/memory", ("memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        for base in (root + parts[2].rstrip("/"), root):
            limit, usage = (_read_int(os.path.join(base, n)) for n in files)
            if limit is not None and usage is not None:
                if limit >= 1 << 60:                     # v1's "no limit"
                    return None
                return max(limit - usage + _file_cache(os.path.join(base, "memory.stat")), 0)
    return None


def _file_cache(stat_path: str) -> int:
    """``active_file + inactive_file`` (v1: their ``total_`` forms) of a cgroup's memory.stat,
    at most 0 where it cannot be read."""
    vals: dict[str, int] = {}
    try:
        with open(stat_path) as f:
            for line in f:
                key, _, val = line.partition(" ")
                if val.strip().isdigit():
                    vals[key] = int(val)
    except OSError:
        return 0
    pre = "total_" if "total_active_file" in vals else ""
    return vals.get(pre + "active_file", 0) + vals.get(pre + "inactive_file", 0)


def memory_available_bytes() -> int | None:
    """Bytes of memory a new shared-memory segment can take without the out-of-memory killer:
    ``MemAvailable + SwapFree`` of ``/proc/meminfo`` (tmpfs pages can be swapped), at most what
    the memory cgroup's limit leaves. None where neither is known (not Linux)."""
    fields = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("MemAvailable", "SwapFree"):
                    fields[key] = int(rest.split()[0]) * 1024     # kB
    except (OSError, ValueError, IndexError):
        fields = {}
    avail = (fields["MemAvailable"] + fields.get("SwapFree", 0)
             if "MemAvailable" in fields else None)
    room = _cgroup_room()
    if room is not None:
        avail = room if avail is None else min(avail, room)
    return avail


#: Of the memory available, what a segment may not take: the rest of the run (the workers, the
#: model's pages, the caller's arrays) needs some too. An eighth, and at least this much.
MEMORY_KEEP_MIN = 256 << 20


def memory_room(avail: int | None) -> int | None:
    """The largest segment :class:`SharedArena` reserves when ``avail`` bytes are available:
    ``avail`` less an eighth of it (at least :data:`MEMORY_KEEP_MIN`); None for unknown."""
    return None if avail is None else max(avail - max(avail // 8, MEMORY_KEEP_MIN), 0)


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


#: Linux's ``MADV_POPULATE_WRITE`` (kernel 5.14+; Python's ``mmap`` names it only where its
#: build saw it); None off Linux.
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE",
                               23 if sys.platform.startswith("linux") else None)


def populate(mm: mmap.mmap) -> bool:
    """Map every page of the shared mapping ``mm`` into this process, writable, with one
    ``madvise(MADV_POPULATE_WRITE)`` instead of one page fault per page at first touch (a fresh
    2.67 GiB segment: 0.93-0.96 s against 1.27-2.34 s on a 2-core KVM guest; see
    docs/architecture.md). The contents do not change. True if done; False (nothing done)
    where the kernel lacks it or refuses."""
    if _MADV_POPULATE_WRITE is None or not hasattr(mm, "madvise"):
        return False
    try:
        mm.madvise(_MADV_POPULATE_WRITE)
    except OSError:
        return False
    return True


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


def _layout(buffers: Mapping[str, object]) -> tuple[dict[str, BufferSpec], int]:
    """The packed layout of ``buffers`` (each at a multiple of :data:`ALIGN`) and its bytes."""
    layout: dict[str, BufferSpec] = {}
    off = 0
    for name, spec in buffers.items():
        shape, dtype = _parse_spec(name, spec)
        layout[name] = BufferSpec(shape, dtype, off)
        off += -(-layout[name].nbytes // ALIGN) * ALIGN
    return layout, off


def arena_bytes(buffers: Mapping[str, object]) -> int:
    """The bytes ``SharedArena(buffers)`` reserves, without making it (the same layout)."""
    return max(_layout(buffers)[1], ALIGN)


def _address_space_room() -> int | None:
    """Bytes this process may still map under its address-space limit (``ulimit -v``,
    RLIMIT_AS): the soft limit less ``VmSize`` of /proc/self/status; None without a limit."""
    import resource
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit == resource.RLIM_INFINITY:
        return None
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return max(limit - int(line.split()[1]) * 1024, 0)
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_room(size: int, what: str = "SharedArena", *, shared: bool = True,
               copies: int = 1, advice: str = _FEWER_TOKENS) -> None:
    """Raise now the :class:`ShmSpaceError` that reserving ``size`` bytes would meet: a
    segment (``shared``) larger than the memory left lets one take (:func:`memory_room`), than
    ``/dev/shm`` holds free or than the file-size limit (ulimit -f) allows; a process's own
    buffers (not ``shared``) larger than the memory available; either larger than this
    process's address-space limit (ulimit -v) leaves to map. For work that needs them only
    after a long run (the autoencoder after the sampling steps), so that it fails before the
    run rather than after it. Nothing is reserved: the room may still be taken by others
    meanwhile, and the segment's own reservation checks again. ``copies``: processes on this
    host that will each reserve ``size`` at once (MPI ranks): the memory and ``/dev/shm``
    are checked for all of them, the per-process limits for one ``size``. ``advice``: the
    error's (:class:`ShmSpaceError`)."""
    vm_room = _address_space_room()
    if vm_room is not None and size > vm_room:     # ulimit -v: the mapping would be refused
        raise ShmSpaceError(size, shm_free_bytes() if shared else None, what=what,
                            vm_limit=vm_room, shared=shared, advice=advice)
    total = size * copies
    avail = memory_available_bytes()
    if not shared:
        if avail is not None and total > avail:
            raise ShmSpaceError(total, None, what=what, memory=avail, shared=False, advice=advice)
        return
    room = memory_room(avail)
    if room is not None and total > room:
        raise ShmSpaceError(total, shm_free_bytes(), what=what, memory=room, advice=advice)
    free = shm_free_bytes()
    if free is not None and total > free:
        raise ShmSpaceError(total, free, what=what)
    import resource
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY and size > limit:    # per file: each rank's segment
        raise ShmSpaceError(size, free, what=what, limit=limit)


class _Segment:
    """What an arena must release -- its name in /dev/shm, the descriptor until mapped, the
    mapping -- kept apart from the arena so that a ``weakref.finalize`` can own it. Each field is
    set before its resource exists and cleared before the resource is released."""

    __slots__ = ("owner_pid", "name", "to_unlink", "tracked", "fd", "mm")

    def __init__(self) -> None:
        self.owner_pid = os.getpid()
        self.name: str | None = None
        self.to_unlink: str | None = None     # the name while it may exist in /dev/shm
        self.tracked = False                  # registered with multiprocessing's tracker
        self.fd = -1                          # the segment's descriptor, until it is mapped
        self.mm: mmap.mmap | None = None

    def busy(self) -> bool:
        return self.to_unlink is not None or self.tracked or self.fd >= 0 or self.mm is not None

    def unlink(self) -> None:
        """Unlink by name (owner process only), then forget the name; idempotent."""
        if os.getpid() != self.owner_pid:
            return
        with deferred_signals():
            name = self.to_unlink
            if name is not None:
                try:
                    _posixshmem.shm_unlink("/" + name)
                except FileNotFoundError:
                    pass
                self.to_unlink = None
            if self.tracked:
                self.tracked = False
                from multiprocessing import resource_tracker
                resource_tracker.unregister("/" + str(self.name), "shared_memory")

    def release(self) -> None:
        """Unlink (owner only), close the descriptor, drop the mapping. Idempotent."""
        self.unlink()
        with deferred_signals():
            if self.fd >= 0:
                fd, self.fd = self.fd, -1             # forget, then close: never twice
                os.close(fd)
            mm, self.mm = self.mm, None
            if mm is not None:
                try:
                    mm.close()
                except BufferError:
                    # Views handed out are still alive: they keep the mapping (and mmap's own
                    # descriptor) until they are gone, which is memory-safe; the name is already
                    # unlinked, so nothing leaks.
                    pass


class SharedArena(Mapping):
    """Named numpy views into one shared-memory segment, freed/unlinked exactly once.

    ``SharedArena({"x": (T, D), "mask": ((T,), np.uint8)})``: a shape (or an int) means packed
    float32; ``(shape, dtype)`` picks another numeric dtype. Buffers start zero-filled, each at
    a 64-byte aligned offset, never overlapping. ``arena["x"]`` is a C-contiguous writeable view;
    it is shared with processes forked after the arena was created. Raises
    :class:`ShmSpaceError` when ``/dev/shm`` cannot hold it.
    """

    # Defaults at class level: an arena whose __init__ raised (or was interrupted) early still
    # answers every attribute its methods read.
    name = "(unnamed)"
    named = False
    nbytes = 0
    owner_pid = -1
    _layout: dict = {}
    _views: dict = {}
    _closed = True
    _seg: _Segment | None = None
    populated = False

    def __init__(self, buffers: Mapping[str, object], *, named: bool = False,
                 prefix: str = SHM_PREFIX) -> None:
        if not isinstance(buffers, Mapping):
            raise TypeError(f"SharedArena: buffers must be a mapping name -> shape, "
                            f"got {type(buffers).__name__}")
        layout, off = _layout(buffers)
        self._layout = layout
        self.nbytes = off
        self.named = bool(named)
        self.born = (0, 0)                 # (serial, thread) once registered as named
        self.owner_pid = os.getpid()
        # The record and its finalizer exist before any resource does: whatever happens from
        # here on (an exception, an interrupt, the arena simply dropped), the finalizer releases
        # what the record holds, and close() detaches it once everything is released.
        seg = _Segment()
        self._finalizer = weakref.finalize(self, seg.release)
        self._seg = seg
        self._closed = False
        views: dict[str, np.ndarray] = {}
        try:
            reserved = self._create(seg, prefix, max(off, ALIGN))
            # A new segment reads as zeros. Every page is mapped into this process here, once,
            # so first-touch page faults are not charged to the first timed stage that writes a
            # buffer (every buffer is written in a run): by one populate call where the kernel
            # has it, else by writing the zeros.
            populated = reserved and populate(seg.mm)
            self.populated = populated
            base = np.frombuffer(seg.mm, dtype=np.uint8)
            for name, sp in layout.items():
                view = base[sp.offset:sp.offset + sp.nbytes].view(sp.dtype).reshape(sp.shape)
                if not populated:
                    view[...] = 0
                views[name] = view
            del base
            self._views = views
        except BaseException:
            views.clear()
            self.close()
            raise

    def _create(self, seg: _Segment, prefix: str, size: int) -> bool:
        """Create, (unlink,) reserve and map the segment; every step recorded before it acts.
        True if ``posix_fallocate`` reserved the memory (tmpfs), False for a sparse file."""
        if _posixshmem is None:                       # pragma: no cover
            raise OSError(errno.ENOSYS, "SharedArena: POSIX shared memory is not available")
        if self.named:
            from multiprocessing import resource_tracker
            resource_tracker.ensure_running()         # its process starts outside our blocks
        for _attempt in range(8):
            name = f"{prefix}{seg.owner_pid}_{secrets.token_hex(6)}"
            with deferred_signals():
                self.name = seg.name = name
                seg.to_unlink = name                  # recorded before it can exist
                try:
                    seg.fd = _posixshmem.shm_open(
                        "/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
                except FileExistsError:               # not ours: never unlink it
                    seg.to_unlink = None
                    continue
                except OSError as e:                  # no /dev/shm, read-only, not allowed
                    seg.to_unlink = None
                    if e.errno not in (errno.ENOENT, errno.EROFS, errno.EACCES, errno.EPERM,
                                       errno.ENOTDIR):
                        raise                         # EMFILE etc.: the callers map those
                    raise ShmSpaceError(size, None, unusable=e) from None
                if self.named:
                    seg.tracked = True                # SIGKILL of this process still unlinks
                    resource_tracker.register("/" + name, "shared_memory")
                    with _LOCK:
                        _LIVE[id(self)] = self
                        _SERIAL[0] += 1
                        self.born = (_SERIAL[0], threading.get_ident())
                else:
                    seg.unlink()                      # the descriptor keeps the memory
            break
        else:
            raise FileExistsError(f"SharedArena: could not find a free name with prefix "
                                  f"{prefix!r} in {SHM_DIR}")
        room = memory_room(memory_available_bytes())
        if room is not None and size > room:          # before a page of it is reserved
            raise ShmSpaceError(size, shm_free_bytes(), memory=room)
        try:
            os.posix_fallocate(seg.fd, 0, size)       # interruptible; the records are complete
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.ENOMEM):
                raise ShmSpaceError(size, shm_free_bytes()) from None
            if e.errno == errno.EFBIG:
                import resource
                raise ShmSpaceError(size, shm_free_bytes(),
                                    limit=resource.getrlimit(resource.RLIMIT_FSIZE)[0]) from None
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
            os.ftruncate(seg.fd, size)                # no fallocate here (not tmpfs): sparse
            reserved = False
        else:
            reserved = True
        with deferred_signals():
            seg.mm = mmap.mmap(seg.fd, size)
            fd, seg.fd = seg.fd, -1                   # forget, then close: never twice
            os.close(fd)
        return reserved

    def populate(self) -> bool:
        """Map every page of the segment into *this* process in one call (:func:`populate`).
        A forked process maps a shared page at its first touch of it, one fault per page; a
        resident worker calls this once after the fork instead. False if closed or not done."""
        seg = self._seg
        if self._closed or seg is None or seg.mm is None:
            return False
        return populate(seg.mm)

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
        return self._seg is not None and self._seg.to_unlink is not None

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("named" if self.linked else "unlinked")
        return f"<SharedArena {self.name} {len(self._layout)} buffers {self.nbytes} B {state}>"

    # -- lifetime ---------------------------------------------------------------------------
    def close(self) -> None:
        """Unlink the segment (owner process only) and drop the views. Idempotent, and resumes
        an interrupted attempt. In a forked child this only forgets the views: the owner unlinks.
        """
        self._closed = True
        self._views = {}
        seg = self._seg
        if seg is None or os.getpid() != seg.owner_pid:
            return
        seg.release()
        with _LOCK:
            _LIVE.pop(id(self), None)
        if not seg.busy():
            self._finalizer.detach()               # nothing left: no work at collection

    def __enter__(self) -> "SharedArena":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def cleanup_all() -> int:
    """Unlink every named arena this process still owns (the atexit hook). Returns count."""
    return cleanup_since(-1)


def arena_mark() -> int:
    """The serial of the newest named arena so far: :func:`cleanup_since` closes only those
    made after it."""
    with _LOCK:
        return _SERIAL[0]


def cleanup_since(mark: int, thread: int | None = None) -> int:
    """Unlink the named arenas this process made after ``mark`` (:func:`arena_mark`) and still
    owns, in ``thread`` only when given (the caller's own arenas, and another thread's, are left
    alone). Returns the count."""
    with _LOCK:
        arenas = [a for a in list(_LIVE.values())
                  if a.born[0] > mark and (thread is None or a.born[1] == thread)]
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
