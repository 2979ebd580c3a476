"""Ring all-reduce (reduce-scatter + all-gather) over shared memory and over MPI.

Owns the chunking of a flat vector across D ranks, the two ring algorithms, and the
shared-memory segment lifetime (:class:`ShmSegment`, always unlinked). It knows nothing about
models: the element-wise ``add`` is supplied by the caller (checked exact int64 add for Q16,
plain float32 add for the contrast run).

Algorithm (both transports, same chunk schedule). The vector of length L is split into D
chunks, chunk c = ``[c*L//D, (c+1)*L//D)``. Rank r's left neighbour is ``r-1 mod D``.
Reduce-scatter, steps s = 0..D-2: rank r receives chunk ``(r-1-s) mod D`` from its left
neighbour and adds it into its own copy; afterwards rank r holds the full sum of chunk
``(r+1) mod D``. All-gather, steps s = 0..D-2: rank r copies chunk ``(r-s) mod D`` from its left
neighbour. On shared memory "receive" is a read of the neighbour's row of a ``[D, L]`` array and
every step ends with a barrier (a rank only reads a chunk its neighbour finished in the previous
step, and never one being written in the current step).
"""
from __future__ import annotations

import os
import secrets
from multiprocessing import shared_memory
from typing import Callable

import numpy as np

__all__ = ["chunk_bounds", "ShmSegment", "ring_allreduce_shm", "ring_allreduce_mpi",
           "SHM_PREFIX"]

SHM_PREFIX = "nxring_"

AddFn = Callable[[np.ndarray, np.ndarray], np.ndarray]


def chunk_bounds(length: int, parts: int) -> list[tuple[int, int]]:
    """Deterministic split of ``range(length)`` into `parts` bands: ``[c*L//D, (c+1)*L//D)``."""
    if parts < 1:
        raise ValueError(f"chunk_bounds: parts must be >= 1, got {parts}")
    if length < 0:
        raise ValueError(f"chunk_bounds: length must be >= 0, got {length}")
    return [(c * length // parts, (c + 1) * length // parts) for c in range(parts)]


class ShmSegment:
    """One ``multiprocessing.shared_memory`` segment carved into named numpy arrays.

    ``with ShmSegment({"grads": ((D, L), np.int64), ...}, prefix=...) as seg: seg["grads"]``.
    The creating process unlinks the segment on ``close()`` / context exit, whatever happened;
    forked children inherit the mapping and must not close or unlink it.
    """

    def __init__(self, layout: dict[str, tuple[tuple[int, ...], np.dtype]],
                 prefix: str = SHM_PREFIX) -> None:
        self._offsets: dict[str, tuple[int, tuple[int, ...], np.dtype]] = {}
        off = 0
        for key, (shape, dtype) in layout.items():
            dt = np.dtype(dtype)
            shape = tuple(int(s) for s in shape)
            if any(s < 0 for s in shape):
                raise ValueError(f"ShmSegment: array {key!r} has a negative dimension {shape}")
            off = (off + 63) // 64 * 64
            self._offsets[key] = (off, shape, dt)
            off += int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        self.size = max(off, 1)
        self.name = f"{prefix}{os.getpid()}_{secrets.token_hex(4)}"
        self._owner = os.getpid()
        self._shm: shared_memory.SharedMemory | None = shared_memory.SharedMemory(
            name=self.name, create=True, size=self.size)
        self._arrays = {
            key: np.ndarray(shape, dtype=dt, buffer=self._shm.buf, offset=o)
            for key, (o, shape, dt) in self._offsets.items()}
        for a in self._arrays.values():
            a.fill(0)

    def __getitem__(self, key: str) -> np.ndarray:
        if self._shm is None:
            raise RuntimeError(f"ShmSegment {self.name}: already closed")
        return self._arrays[key]

    def close(self) -> None:
        """Drop the arrays, close and unlink (only in the creating process; idempotent)."""
        if self._shm is None or os.getpid() != self._owner:
            return
        shm, self._shm = self._shm, None
        self._arrays = {}
        try:
            shm.close()
        except BufferError:     # a view escaped; the unlink below still removes the name
            pass
        try:
            shm.unlink()
        except FileNotFoundError:
            pass

    def __enter__(self) -> "ShmSegment":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def ring_allreduce_shm(rank: int, bufs: np.ndarray, add: AddFn, barrier,
                       timeout: float | None = None) -> None:
    """In place: afterwards ``bufs[rank]`` is the element-wise sum of ``bufs[0..D-1]``.

    Called by all D ranks at once (each with its own `rank`), `bufs` a shared ``[D, L]`` array,
    `barrier` a ``multiprocessing.Barrier(D)``. The caller must have passed a barrier after
    writing its row (so every row is complete before the first read).
    """
    if bufs.ndim != 2:
        raise ValueError(f"ring_allreduce_shm: bufs must be a [D, L] array, got shape {bufs.shape}")
    D, L = bufs.shape
    if not 0 <= rank < D:
        raise ValueError(f"ring_allreduce_shm: rank {rank} outside [0, {D})")
    parties = getattr(barrier, "parties", D)
    if parties != D:
        raise ValueError(f"ring_allreduce_shm: barrier has {parties} parties but bufs has {D} rows")
    bounds = chunk_bounds(L, D)
    left = (rank - 1) % D
    mine, theirs = bufs[rank], bufs[left]
    for s in range(D - 1):                       # reduce-scatter
        lo, hi = bounds[(rank - 1 - s) % D]
        mine[lo:hi] = add(mine[lo:hi], theirs[lo:hi])
        barrier.wait(timeout)
    for s in range(D - 1):                       # all-gather
        lo, hi = bounds[(rank - s) % D]
        mine[lo:hi] = theirs[lo:hi]
        barrier.wait(timeout)


def ring_allreduce_mpi(comm, vec: np.ndarray, add: AddFn) -> np.ndarray:
    """Ring all-reduce of a 1-D contiguous `vec` over an mpi4py communicator; returns the sum.

    Same chunk schedule as :func:`ring_allreduce_shm`, with ``Sendrecv`` to the right
    neighbour / from the left one. Integer vectors are added with the caller's checked `add`
    (MPI's own SUM would wrap int64 silently). Collective: if one rank raises instead of
    calling it, its peers block in ``Sendrecv`` -- the caller must ``comm.Abort`` on error (the
    CLI does).
    """
    D, rank = comm.Get_size(), comm.Get_rank()
    buf = np.array(vec, copy=True)
    if buf.ndim != 1:
        raise ValueError(f"ring_allreduce_mpi: vec must be 1-D, got shape {buf.shape}")
    bounds = chunk_bounds(buf.shape[0], D)
    right, left = (rank + 1) % D, (rank - 1) % D
    for s in range(D - 1):                       # reduce-scatter
        slo, shi = bounds[(rank - s) % D]
        rlo, rhi = bounds[(rank - 1 - s) % D]
        tmp = np.empty(rhi - rlo, dtype=buf.dtype)
        comm.Sendrecv(np.ascontiguousarray(buf[slo:shi]), dest=right, sendtag=s,
                      recvbuf=tmp, source=left, recvtag=s)
        buf[rlo:rhi] = add(buf[rlo:rhi], tmp)
    for s in range(D - 1):                       # all-gather
        slo, shi = bounds[(rank + 1 - s) % D]
        rlo, rhi = bounds[(rank - s) % D]
        tmp = np.empty(rhi - rlo, dtype=buf.dtype)
        comm.Sendrecv(np.ascontiguousarray(buf[slo:shi]), dest=right, sendtag=D + s,
                      recvbuf=tmp, source=left, recvtag=D + s)
        buf[rlo:rhi] = tmp
    return buf
