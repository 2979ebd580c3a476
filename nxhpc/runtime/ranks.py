"""Ranks: the MPI world one call is split across, when ``mpirun`` / ``srun`` started us.

Owns :class:`Ranks` (an mpi4py communicator seen as ``rank`` of ``size``, the rank band of an
extent, the exchanges the engine makes after a split stage -- in-place ``Allgatherv`` of row
bands or column bands of an arena buffer -- the startup broadcasts and agreement checks, the
gather of whole results to rank 0, and the failure protocol below), :func:`world` /
:func:`init_world` (the active world: None on one rank, and then mpi4py is never imported),
:func:`mpi_launched` and :func:`file_fingerprint`.
Must not: compute model arithmetic, pickle arrays in the hot path (exchanges move the arena's
bytes with MPI datatypes), or import compiled or model code.

Failure protocol (every wait polls, so signals are seen and a peer's failure ends it):

* A rank that fails (a worker error, a bad input on rank 0, an exchange past the stage timeout)
  prints its one error, then :meth:`Ranks.fail` sends ``(rank, exit code, message)`` to every
  peer on a side communicator and waits (briefly) for their acknowledgements.
* A rank waiting in an exchange or a broadcast that receives such a notice raises
  :class:`RankFailedError` carrying the failed rank's code; the CLI frame acknowledges it,
  prints nothing more and exits with that same code: one error, one exit code on every
  surviving rank.
* A rank that dies outright (SIGKILL, a crash) cannot tell anyone: ``mpirun`` sees it and
  sends SIGTERM to the others, which their poll loops turn into :class:`~nxhpc.runtime.proc.
  Terminated` (exit 143 on every surviving rank; mpirun names the rank that died).
* A rank that hangs is caught by the waits' timeout (``--stage-timeout``): the first rank to
  time out fails as above. The startup waits before any model work (the command-line check,
  the arguments' and kernels' agreement) are bounded by it too (:attr:`Ranks.timeout`); the
  waits that follow work a rank does alone or unevenly (opening its models, which may
  generate a built-in; rank 0 reading the inputs; its own images; rank 0's decode before the
  exit code) are not: those ranks' own stages are.

Nothing leaks either way: the arena is unlinked when it is created and workers die with their
rank (:mod:`nxhpc.runtime.shm`, :mod:`nxhpc.runtime.proc`).
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
import struct
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from nxhpc.runtime.workers import bands

__all__ = ["Ranks", "world", "init_world", "alone", "mpi_launched", "file_fingerprint",
           "RankMismatchError", "RankFailedError", "ExchangeTimeoutError"]

_NOTICE_TAG, _ACK_TAG, _PRINTED_TAG = 71, 72, 73
_NOTICE = struct.Struct("<ii")          # failed rank, exit code; then the message (utf-8)
_NOTICE_BYTES = 4096
#: Seconds a failing rank waits for its peers to acknowledge its notice.
ACK_TIMEOUT_S = 20.0
#: Seconds a peer that acknowledged a failure waits for the failed rank to print its error:
#: mpirun ends every rank once one exits with an error, so a peer that left at once took the
#: failed rank's line with it (5 of 6 runs under Open MPI's default kill timing printed only
#: "terminated").
PRINT_WAIT_S = ACK_TIMEOUT_S + 3.0       # the failed rank may wait ACK_TIMEOUT_S on a slow peer
_SPIN = 64                              # Test() calls before a wait starts sleeping
_SLEEP_MAX_S = 1e-3


class RankMismatchError(ValueError):
    """The ranks disagree on what they run (model file size / fingerprint, command line).
    Raised on every rank at once (``collective``): only rank 0 needs to say it."""
    collective = True


class RankFailedError(RuntimeError):
    """Another rank failed; ``rank`` and ``code`` (its exit code) are that rank's."""

    def __init__(self, rank: int, code: int, message: str) -> None:
        self.rank, self.code, self.message = rank, code, message
        super().__init__(f"MPI rank {rank} failed (exit {code}): {message}")


class ExchangeTimeoutError(RuntimeError):
    """An exchange between ranks did not complete within the stage timeout."""


def mpi_launched() -> bool:
    """Whether an MPI launcher started this process as one of several ranks (Open MPI's
    ``OMPI_COMM_WORLD_SIZE``, MPICH/Hydra and Slurm's PMI ``PMI_SIZE``; no MPI import)."""
    for key in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MPI_LOCALNRANKS"):
        v = os.environ.get(key)
        if v is not None:
            try:
                return int(v) > 1
            except ValueError:
                return False
    return False


def launched_rank() -> int:
    """This process's rank as its MPI launcher gave it (Open MPI's ``OMPI_COMM_WORLD_RANK``,
    PMI's ``PMI_RANK``; no MPI import), 0 when none is given."""
    for key in ("OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        v = os.environ.get(key)
        if v is not None:
            try:
                return int(v)
            except ValueError:
                return 0
    return 0


def local_ranks() -> int:
    """How many ranks of this job run on this host, as the launcher says (Open MPI's
    ``OMPI_COMM_WORLD_LOCAL_SIZE``, MPICH/Hydra's ``MPI_LOCALNRANKS``, Slurm's
    ``SLURM_NTASKS_PER_NODE``); 1 when it does not."""
    for key in ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE"):
        try:
            return max(int(os.environ[key]), 1)
        except (KeyError, ValueError):
            continue
    return 1


_WORLD: "Ranks | None" = None


def world() -> "Ranks | None":
    """The active world (set by :func:`init_world`), or None: one rank, no MPI."""
    return _WORLD


def init_world() -> "Ranks | None":
    """The world of this job: imports mpi4py only when an MPI launcher started several ranks
    (:func:`mpi_launched`); None otherwise. Idempotent. ImportError names what to install."""
    global _WORLD
    if _WORLD is None and mpi_launched():
        try:
            from mpi4py import MPI
        except ImportError as e:
            raise ImportError(f"this process was started by mpirun/srun as one of several "
                              f"ranks, which needs mpi4py (pip install mpi4py): {e}") from None
        comm = MPI.COMM_WORLD
        if comm.Get_size() > 1:
            _WORLD = Ranks(comm)
    return _WORLD


@contextlib.contextmanager
def alone() -> Iterator[None]:
    """``with alone():`` engines built inside run on this rank alone (:func:`world` is None),
    e.g. a rank sampling whole images of its own; the world is back afterwards."""
    global _WORLD
    saved, _WORLD = _WORLD, None
    try:
        yield
    finally:
        _WORLD = saved


def file_fingerprint(path: str | os.PathLike, *, sample: int = 1 << 16,
                     pieces: int = 64) -> tuple[int, str]:
    """``(size, sha256)`` of a file's size, first and last MiB and ``pieces`` evenly spaced
    ``sample``-byte pieces: cheap on a 12 GB model (5 MB read), and different for files that
    differ in size, header, tensor table or any sampled piece. Not a full-content hash."""
    size = os.path.getsize(path)
    h = hashlib.sha256(str(size).encode())
    mib = 1 << 20
    reads = [(0, mib), (max(0, size - mib), mib)]
    reads += [(i * max(0, size - sample) // max(1, pieces - 1), sample) for i in range(pieces)]
    with open(path, "rb") as f:
        for off, n in reads:
            f.seek(off)
            h.update(f.read(n))
    return size, h.hexdigest()


def kernel_bits(precision: str) -> str:
    """Which output bits this process's kernels give at ``precision``, as a class name: ranks
    of one class give the bits of one process. Measured on the AMX Xeon under each
    ``NXHPC_MAX_ISA`` (a ``denoise`` of tiny-dit; docs/kernels.md, Arithmetic contracts):
    ``"generic"`` everywhere the scalar spec runs (libm's exp and tanh); for ``f32``,
    ``"avx2"`` (AVX2, AVX-VNNI) or ``"avx512"`` (AVX-512 and up: the float32 attention's
    16-key tiles and polynomials in zmm lanes); for ``bf16`` and ``q8``, ``"simd"`` (AVX2 to
    AVX-512 BF16: one set of bits) or ``"amx"`` (the tiles' own dot sums; q8's attention is
    bf16's)."""
    import nxhpc                          # the compiled code, reached at the call only
    best = nxhpc.kernels().cpu_features()["best_isa"]
    if best == "generic":
        return "generic"
    if precision == "f32":
        return "avx2" if best in ("avx2", "avxvnni") else "avx512"
    return "amx" if best == "amx" else "simd"


class Ranks:
    """``comm`` (an mpi4py intracommunicator, size > 1) as the ranks one call is split over.

    ``band(m)``: this rank's ``[r*m//R, (r+1)*m//R)``. :meth:`gather_rows` /
    :meth:`gather_cols`: every rank's band of a buffer into every rank's copy, in place.
    :meth:`bcast` / :meth:`same`: startup values from rank 0; agreement checks.
    :meth:`gather`: whole results (pickled) to rank 0. Every wait
    polls (signals, peers' failure notices, ``timeout``). :attr:`timeout` (the stage timeout,
    set from ``--stage-timeout`` by the CLI frame; None: no limit) bounds the startup waits:
    :meth:`bcast` and :meth:`allgather` unless called with ``bounded=False``, and so
    :meth:`same` / :meth:`same_args` / :meth:`same_kernels`."""

    def __init__(self, comm: Any) -> None:
        from mpi4py import MPI
        self.MPI = MPI
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.failed = False
        self.timeout: float | None = None
        self._types: dict[int, Any] = {}
        self._scratch = np.empty(0, dtype=np.uint8)
        # notices and acks never meet a collective: their own communicator, made right after
        # the first exchange completes (the same point on every rank), so that a rank stuck
        # before it is met by that exchange's timeout, not by a Dup that blocks forever (an
        # Idup raced later nonblocking collectives in Open MPI 4.1: MPI_ERR_TRUNCATE)
        self._side: Any = None
        self._note = bytearray(_NOTICE_BYTES)
        self._note_req: Any = None

    def __repr__(self) -> str:
        return f"<Ranks {self.rank} of {self.size}>"

    @property
    def label(self) -> str:
        return f"MPI rank {self.rank} of {self.size}"

    def band(self, m: int) -> tuple[int, int]:
        """This rank's band of ``[0, m)``."""
        return bands(m, self.size)[self.rank]

    def bounds(self, m: int) -> list[tuple[int, int]]:
        """Every rank's band of ``[0, m)``."""
        return bands(m, self.size)

    # -- waiting
    def _make_side(self) -> None:
        """The notices' communicator and its notice receive: after the first exchange, which
        every rank has reached (a blocking Dup, the same collective on every rank)."""
        self._side = self.comm.Dup()
        self._note_req = self._side.Irecv([self._note, self.MPI.BYTE],
                                          source=self.MPI.ANY_SOURCE, tag=_NOTICE_TAG)

    def _check_notice(self) -> None:
        if self._side is None:               # before the first exchange: no notices yet
            return
        if self._note_req is not None and self._note_req.Test():
            self._note_req = None
            rank, code = _NOTICE.unpack_from(self._note)
            msg = bytes(self._note[_NOTICE.size:]).rstrip(b"\0").decode("utf-8", "replace")
            raise RankFailedError(rank, code, msg)

    def wait(self, req: Any, what: str, timeout: float | None = None) -> None:
        """Wait for request ``req`` (``what`` names it in errors), polling: a peer's failure
        notice raises :class:`RankFailedError`, ``timeout`` seconds :class:`ExchangeTimeoutError`;
        Python signal handlers run between polls."""
        t0 = time.monotonic()
        sleep, n = 0.0, 0
        while not req.Test():
            self._check_notice()
            if timeout is not None and time.monotonic() - t0 > timeout:
                raise ExchangeTimeoutError(
                    f"{what} did not complete within {timeout:g} s (the stage "
                    f"timeout): another rank is hung, stopped or dead")
            n += 1
            if n > _SPIN:
                sleep = min(_SLEEP_MAX_S, sleep * 2 if sleep else 2e-5)
                time.sleep(sleep)
        if self._side is None:
            self._make_side()

    # -- exchanges (the hot path: no pickling, the buffer's own bytes)
    def _unit(self, nbytes: int) -> Any:
        t = self._types.get(nbytes)
        if t is None:
            t = self.MPI.BYTE.Create_contiguous(nbytes).Commit()
            self._types[nbytes] = t
        return t

    def gather_rows(self, a: np.ndarray, bounds: Sequence[tuple[int, int]], what: str,
                    timeout: float | None = None) -> None:
        """Rows ``bounds[k]`` of C-contiguous ``a`` [n, ...] from rank ``k`` into every rank's
        ``a`` (in place: each rank has written its own rows)."""
        counts = [hi - lo for lo, hi in bounds]
        displs = [lo for lo, _ in bounds]
        if sum(counts) == 0:
            return
        row = a.nbytes // a.shape[0]
        buf = a.reshape(-1).view(np.uint8)
        req = self.comm.Iallgatherv(self.MPI.IN_PLACE, [buf, (counts, displs), self._unit(row)])
        self.wait(req, what, timeout)

    def gather_cols(self, a: np.ndarray, bounds: Sequence[tuple[int, int]], what: str,
                    timeout: float | None = None) -> None:
        """Columns ``bounds[k]`` of C-contiguous ``a`` [n, c] from rank ``k`` into every
        rank's ``a``: each band packed to a contiguous block, gathered, copied back."""
        n, c = a.shape
        counts = [hi - lo for lo, hi in bounds]
        if sum(counts) == 0:
            return
        item = a.itemsize
        need = n * c * item
        if self._scratch.nbytes < need:
            self._scratch = np.empty(need, dtype=np.uint8)
        flat = self._scratch[:need].view(a.dtype)
        lo, hi = bounds[self.rank]
        mine = flat[n * lo:n * hi].reshape(n, hi - lo)
        np.copyto(mine, a[:, lo:hi])
        req = self.comm.Iallgatherv(
            self.MPI.IN_PLACE, [self._scratch[:need], (counts, [b[0] for b in bounds]),
                                self._unit(n * item)])
        self.wait(req, what, timeout)
        for k, (b0, b1) in enumerate(bounds):
            if k != self.rank and b1 > b0:
                np.copyto(a[:, b0:b1], flat[n * b0:n * b1].reshape(n, b1 - b0))

    # -- startup (small values: pickled)
    def bcast(self, obj: Any, what: str, root: int = 0, *, bounded: bool = True) -> Any:
        """``obj`` of rank ``root`` on every rank (pickled: for startup values, not arrays
        of the hot path); each wait bounded by :attr:`timeout` unless not ``bounded``."""
        timeout = self.timeout if bounded else None
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if self.rank == root else b""
        n = np.array([len(data)], dtype=np.int64)
        self.wait(self.comm.Ibcast([n, self.MPI.INT64_T], root=root), what, timeout)
        buf = np.frombuffer(data, dtype=np.uint8).copy() if self.rank == root \
            else np.empty(int(n[0]), dtype=np.uint8)
        self.wait(self.comm.Ibcast([buf, self.MPI.BYTE], root=root), what, timeout)
        return obj if self.rank == root else pickle.loads(buf.tobytes())

    def allgather(self, obj: Any, what: str, *, bounded: bool = True) -> list[Any]:
        """Every rank's ``obj`` (pickled, fixed-size frames: small startup values); each wait
        bounded by :attr:`timeout` unless not ``bounded``."""
        timeout = self.timeout if bounded else None
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        sizes = np.zeros(self.size, dtype=np.int64)
        sizes[self.rank] = len(data)
        self.wait(self.comm.Iallgather(self.MPI.IN_PLACE, [sizes, self.MPI.INT64_T]), what,
                  timeout)
        width = int(sizes.max())
        frames = np.zeros((self.size, width), dtype=np.uint8)
        frames[self.rank, :len(data)] = np.frombuffer(data, dtype=np.uint8)
        self.wait(self.comm.Iallgather(self.MPI.IN_PLACE, [frames, self.MPI.BYTE]), what,
                  timeout)
        return [pickle.loads(frames[k, :int(sizes[k])].tobytes()) for k in range(self.size)]

    def gather(self, obj: Any, what: str, root: int = 0) -> list[Any] | None:
        """Every rank's ``obj`` on rank ``root`` (a list by rank; None on the others): pickled,
        the sizes first, then one ``Gatherv`` of the bytes -- for results a rank made whole
        (an image), not the hot path. At most 2 GiB in all (MPI's int counts)."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        sizes = np.zeros(self.size, dtype=np.int64)
        sizes[self.rank] = len(data)
        self.wait(self.comm.Iallgather(self.MPI.IN_PLACE, [sizes, self.MPI.INT64_T]), what)
        if int(sizes.sum()) > 2**31 - 1:
            raise ValueError(f"{what}: {int(sizes.sum())} bytes from {self.size} ranks in one "
                             f"gather; at most 2 GiB (send fewer results per gather)")
        mine = np.frombuffer(data, dtype=np.uint8)
        if self.rank != root:
            self.wait(self.comm.Igatherv([mine, self.MPI.BYTE], None, root=root), what)
            return None
        counts = [int(n) for n in sizes]
        displs = [sum(counts[:k]) for k in range(self.size)]
        buf = np.empty(max(1, sum(counts)), dtype=np.uint8)
        self.wait(self.comm.Igatherv([mine, self.MPI.BYTE],
                                     [buf, (counts, displs), self.MPI.BYTE], root=root), what)
        return [pickle.loads(buf[d:d + n].tobytes()) for d, n in zip(displs, counts)]

    def same(self, what: str, value: Any, *, bounded: bool = True) -> None:
        """:class:`RankMismatchError` on every rank unless every rank's ``value`` is equal
        (the message lists each rank's); the wait bounded by :attr:`timeout` unless not
        ``bounded`` (a check after each rank opened its models: a built-in may be generated)."""
        listing = self._differ(value, what, bounded)
        if listing:
            raise RankMismatchError(f"the {self.size} MPI ranks disagree on {what} ({listing}); "
                                    f"every rank must run the same files and arguments")

    def same_args(self, values: dict[str, Any]) -> None:
        """:class:`RankMismatchError` on every rank unless every rank gives the same
        ``values`` (option name -> value); the message names only the options that differ,
        with each rank's value."""
        vals = self.allgather(values, "the check of the arguments")
        keys = [k for k in values if any(v.get(k) != vals[0].get(k) for v in vals)]
        if keys:
            listing = "; ".join(f"{k}: " + ", ".join(f"rank {r} {v.get(k)!r}"
                                                     for r, v in enumerate(vals)) for k in keys)
            raise RankMismatchError(f"the {self.size} MPI ranks disagree on the arguments "
                                    f"({listing}); every rank must run the same files and "
                                    f"arguments")

    def _differ(self, value: Any, what: str, bounded: bool = True) -> str:
        """Every rank's ``value`` listed (``"rank 0: a; rank 1: b"``) if they are not all
        equal, else ``""``."""
        vals = self.allgather(value, f"the check of {what}", bounded=bounded)
        if all(v == vals[0] for v in vals):
            return ""
        return "; ".join(f"rank {k}: {v}" for k, v in enumerate(vals))

    def same_kernels(self, precision: str, what: str = "kernels",
                     result: str = "the split result") -> None:
        """:class:`RankMismatchError` on every rank unless every rank's kernels give the same
        output bits at ``precision`` (:func:`kernel_bits`): the split result is bit-identical
        to one process only then. The message names each rank's and the remedy (``what``
        runs at that precision, ``result`` would differ)."""
        listing = self._differ(kernel_bits(precision), "the kernels' bits")
        if listing:
            raise RankMismatchError(
                f"the {self.size} MPI ranks run {what} that give different {precision} bits "
                f"({listing}), so {result} would match no one process; set "
                f"NXHPC_MAX_ISA on every rank to one target all of them run (e.g. avx2, or "
                f"avx512bf16 on AVX-512 BF16 machines with and without AMX)")

    # -- failures
    def fail(self, code: int, message: str,
             ack_timeout: float = ACK_TIMEOUT_S) -> list[tuple[int, str]]:
        """Tell every peer this rank failed with exit ``code`` (``message``: its error), then
        wait up to ``ack_timeout`` s until each peer has stopped: it acknowledged, or it failed
        too (its own notice came; it waits for this rank's acknowledgement, which is sent).
        Returns the ``(rank, message)`` of the peers that failed too. Once per rank. Before
        the first exchange has completed (a peer never reached it) there is no communicator
        for notices: nothing is sent, and the launcher ends the peers when this rank exits."""
        if self.failed:
            return []
        self.failed = True
        if self._side is None:
            return []
        MPI = self.MPI
        note = bytearray(_NOTICE_BYTES)
        _NOTICE.pack_into(note, 0, self.rank, int(code))
        text = message.encode("utf-8", "replace")[:_NOTICE_BYTES - _NOTICE.size - 1]
        note[_NOTICE.size:_NOTICE.size + len(text)] = text
        peers = [k for k in range(self.size) if k != self.rank]
        sends = [self._side.Isend([note, MPI.BYTE], dest=k, tag=_NOTICE_TAG) for k in peers]
        acks = {k: bytearray(1) for k in peers}
        ack_reqs = {k: self._side.Irecv([acks[k], MPI.BYTE], source=k, tag=_ACK_TAG)
                    for k in peers}
        pending, also, replies = set(peers), [], []
        t0 = time.monotonic()
        while (pending or not MPI.Request.Testall(sends + replies)) \
                and time.monotonic() - t0 < ack_timeout:
            for k in [k for k in pending if ack_reqs[k].Test()]:
                pending.discard(k)
            if self._note_req is not None and self._note_req.Test():
                rank, _ = _NOTICE.unpack_from(self._note)
                msg = bytes(self._note[_NOTICE.size:]).rstrip(b"\0").decode("utf-8", "replace")
                also.append((rank, msg))
                pending.discard(rank)
                replies.append(self._side.Isend([bytearray(1), MPI.BYTE], dest=rank,
                                                tag=_ACK_TAG))
                self._note = bytearray(_NOTICE_BYTES)
                self._note_req = self._side.Irecv([self._note, MPI.BYTE],
                                                  source=MPI.ANY_SOURCE, tag=_NOTICE_TAG)
            time.sleep(1e-3)
        return also

    def acknowledge(self, err: RankFailedError, timeout: float = 2.0,
                    print_wait: float = PRINT_WAIT_S) -> None:
        """Tell the failed rank of ``err`` this rank has stopped (it waits for that), and any
        other rank whose notice comes meanwhile; then wait up to ``print_wait`` s until each
        has printed its error (:meth:`printed`): this rank's exit would have mpirun end them
        before their lines are out. ``print_wait`` covers a failed rank's own wait for its
        slowest peer (``ACK_TIMEOUT_S``); a failed rank that died ends this one through mpirun."""
        self.failed = True
        MPI = self.MPI
        acks, waits = [], {}

        def ack(k: int) -> None:
            acks.append(self._side.Isend([bytearray(1), MPI.BYTE], dest=k, tag=_ACK_TAG))
            waits[k] = self._side.Irecv([bytearray(1), MPI.BYTE], source=k, tag=_PRINTED_TAG)
        ack(err.rank)
        if self._note_req is None:
            self._note = bytearray(_NOTICE_BYTES)
            self._note_req = self._side.Irecv([self._note, MPI.BYTE], source=MPI.ANY_SOURCE,
                                              tag=_NOTICE_TAG)
        t0 = time.monotonic()
        while time.monotonic() - t0 < print_wait:
            if self._note_req.Test():          # another rank failed too: it waits for us
                k, _ = _NOTICE.unpack_from(self._note)
                if k not in waits:
                    ack(k)
                self._note = bytearray(_NOTICE_BYTES)
                self._note_req = self._side.Irecv([self._note, MPI.BYTE],
                                                  source=MPI.ANY_SOURCE, tag=_NOTICE_TAG)
            if all(r.Test() for r in waits.values()) and MPI.Request.Testall(acks):
                break
            time.sleep(1e-3)

    def printed(self, failed_too: list[tuple[int, str]] = (), timeout: float = 1.0) -> None:
        """After :meth:`fail` and this rank's error line: let the peers that acknowledged
        (not those in ``failed_too``, which failed themselves) exit now."""
        if self._side is None:
            return
        MPI = self.MPI
        skip = {k for k, _ in failed_too}
        sends = [self._side.Isend([bytearray(1), MPI.BYTE], dest=k, tag=_PRINTED_TAG)
                 for k in range(self.size) if k != self.rank and k not in skip]
        t0 = time.monotonic()
        while not MPI.Request.Testall(sends) and time.monotonic() - t0 < timeout:
            time.sleep(1e-3)
