"""Ring all-reduce (reduce-scatter + all-gather) over shared memory and over MPI.

Owns the chunk schedule of a flat vector across D ranks and the two ring algorithms. It knows
nothing about models: the element-wise ``add`` is supplied by the caller (checked exact int64 add
for Q16, plain float32 add for the contrast run). The chunking is the runtime's one band split
(:func:`nxhpc.runtime.workers.bands`, re-exported as :func:`chunk_bounds`) and the segment is the
runtime's :class:`~nxhpc.runtime.shm.SharedArena` (:class:`ShmSegment` = a named arena with the
ring's prefix): this module must not re-implement either, nor import the compiled kernels.

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

from typing import Callable

import numpy as np

from nxhpc.runtime.shm import SharedArena
from nxhpc.runtime.workers import bands

__all__ = ["chunk_bounds", "ShmSegment", "ring_allreduce_shm", "ring_allreduce_mpi",
           "SHM_PREFIX"]

SHM_PREFIX = "nxring_"

AddFn = Callable[[np.ndarray, np.ndarray], np.ndarray]

#: The deterministic split of ``range(length)`` into ``parts`` bands ``[c*L//D, (c+1)*L//D)``:
#: the runtime's :func:`~nxhpc.runtime.workers.bands` itself, under the ring's name.
chunk_bounds = bands


class ShmSegment(SharedArena):
    """A :class:`~nxhpc.runtime.shm.SharedArena` with the ring's prefix.

    ``with ShmSegment({"grads": ((D, L), np.int64), ...}, prefix=...) as seg: seg["grads"]``.
    ``named=True`` (the default): the segment stays visible in /dev/shm while it lives and is
    registered with the resource tracker (a SIGKILL of the driver alone still unlinks it); the
    creating process unlinks it on ``close()`` / context exit, whatever happened.
    ``named=False``: unlinked as soon as it is made, so nothing can be left behind even when
    the whole process group is killed (tracker included: a closed terminal, ``timeout -s
    KILL``); the training run uses this. Forked children inherit the mapping either way and
    never unlink it.
    """

    def __init__(self, layout: dict[str, tuple[tuple[int, ...], np.dtype]],
                 prefix: str = SHM_PREFIX, *, named: bool = True) -> None:
        super().__init__(layout, named=named, prefix=prefix)

    @property
    def size(self) -> int:
        """Bytes in the segment's layout."""
        return self.nbytes


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
