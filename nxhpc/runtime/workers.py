"""WorkerPool: forked worker processes running deterministic bands of a stage.

Owns: the band split (worker ``i`` of ``n`` takes ``[i*m//n, (i+1)*m//n)``, :func:`bands`, the
one split used by inference and training alike), process lifetime (fork, dispatch, wait4, kill,
reap) and crash detection. Must not: compute anything itself, run threads in workers, or leave
a worker process, a zombie or a descriptor behind.

Two spawn modes, with bit-identical results (a band's arithmetic never depends on who runs it):

* ``"stage"`` -- fork ``n`` workers for every stage and ``wait4`` them all (the source runner's
  scheme). Each child runs its band and ``_exit``s.
* ``"pool"``  -- fork ``n`` workers once (after the weights are mapped and the arena exists), then
  dispatch stages over pipes: a few bytes per command, one status message back.

Tasks are plain callables ``task(lo, hi, arg)`` registered by name *before* the fork, so workers
reach the arena and the memory-mapped weights through inherited memory (copy-on-write; Q8_0 data
is never copied). ``arg`` is a small picklable value (e.g. a layer index).

Failure: a worker that raises, segfaults, is killed or exits early closes its status pipe; the
parent sees EOF at once, kills and reaps every worker and raises :class:`WorkerError` naming the
stage, the worker and the reason. A worker that hangs without exiting is caught by the optional
per-stage timeout (``stage_timeout``): past it, every worker is killed and reaped and the error
names the stage and the first unfinished worker. A worker that is *stopped* (SIGSTOP, SIGTSTP:
it neither runs nor exits, so no EOF comes) is seen with ``waitid(WSTOPPED | WNOWAIT)`` while
the parent waits; one still stopped after :data:`STOP_GRACE_S` fails the stage the same way, with
or without a timeout (a stop of the whole process group, Ctrl-Z then ``fg``, resumes every
process at once and is not a failure). A parent interrupted mid-stage (Ctrl-C, SIGTERM
turned into an exception) also kills and reaps its workers before the exception propagates.
Workers ignore SIGINT (the parent decides), die with the parent process -- whichever thread
forked them -- through the lifeline of :mod:`nxhpc.runtime.proc`, and exit on a ``stop``
message or when their command pipe closes, so none is ever orphaned.

Scheduling: workers run under ``SCHED_BATCH`` where the OS has it (:func:`batch_policy`), so
that waking one for a stage never preempts the parent before it has dispatched the others. A
resident worker that has sent its result polls its command pipe for :data:`POOL_SPIN_S` before
it blocks on it, yielding the CPU to any runnable process between polls, so that a block's next
stage need not wait for a sleeping process to be woken (only when the pool has no more workers
than usable CPUs).

Lifetime and interrupts: every pid and pipe end is recorded on the pool, in the same deferred-
signal block that creates it (:func:`nxhpc.runtime.proc.fork_section`), and forgotten in the same
block that releases it. :meth:`WorkerPool.close` (also run by ``__exit__``, ``__del__`` and at
exit) is idempotent and resumes where an interrupted attempt stopped; a pool whose ``__init__``
was interrupted is torn down by its ``__del__``. Pipe ends the parent keeps are registered with
:mod:`nxhpc.runtime.proc`, so no later child (another pool's worker) holds them: closing one pool
while another is open takes milliseconds, not a second per worker.
"""
from __future__ import annotations

import functools
import operator
import os
import pickle
import select
import signal
import struct
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from nxhpc.runtime.proc import (close_fd, deferred_signals, describe_exit, die_with_parent,
                                fork_section, lifeline, limited_fork, reap, register_fd,
                                signal_name)

__all__ = ["bands", "WorkerPool", "WorkerError", "SPAWN_MODES", "DEFAULT_SPAWN", "usable_cpus",
           "check_timeout", "batch_policy", "stop_signal"]

#: Spawn modes. "pool" is the default: it measured faster than "stage" (see benchmarks/bench_block.py).
SPAWN_MODES = ("pool", "stage")
DEFAULT_SPAWN = "pool"

_HDR = struct.Struct("<I")
_MAX_ERR = 8000             # characters of a worker's traceback sent back
_POLL_S = 0.05              # select timeout while waiting (EOF wakes us immediately anyway)
_REAP_S = 1.0               # grace period for a worker to exit before SIGKILL
#: Seconds a worker may stay stopped (SIGSTOP/SIGTSTP) during a stage before the stage fails.
STOP_GRACE_S = 1.0
#: Seconds a resident worker polls for its next command (``sched_yield`` between polls) before
#: it blocks on the pipe. Waking a blocked worker is what a short stage mostly costs: AMX Xeon
#: (KVM, 2 cores, 2 workers, benchmarks/bench_pool.py), a no-op stage's round trip took a
#: median of 63-90 us blocking and 24 us polling; the Q4_K_M block at T=256 (10 stages) gains
#: 0-2.5% at the median (50.7-53.0 -> 50.7-52.1 ms), its minimum not at all.
POOL_SPIN_S = 200e-6

Task = Callable[[int, int, Any], None]


def usable_cpus() -> int:
    """CPUs this process may run on (affinity mask), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def max_workers() -> int:
    """The most worker processes a pool accepts: 8x the usable CPUs, at least 64.

    More processes than that only add fork, memory and scheduling cost (every stage is split
    into at most this many bands), and a mistyped count (100000) would otherwise fork until the
    machine runs out of memory.
    """
    return max(64, 8 * usable_cpus())


def check_timeout(timeout: float | None, what: str = "stage_timeout") -> float | None:
    """None, or a positive finite number of seconds (as float); ValueError naming ``what``."""
    from nxhpc.runtime.checks import check_seconds      # the one rule (checks imports us)
    return check_seconds(timeout, what)


def as_index(v: object) -> int | None:
    """An integer (int, numpy integer; not bool, not float), else None (the one such rule:
    ``nxhpc.runtime.checks`` uses it too)."""
    if isinstance(v, bool):
        return None
    try:
        return operator.index(v)
    except TypeError:
        return None


def bands(m: int, n: int) -> list[tuple[int, int]]:
    """Split ``[0, m)`` into ``n`` deterministic bands ``[i*m//n, (i+1)*m//n)`` (some may be
    empty). The one split of the package: worker stages here, the ring's chunks in training."""
    mi, ni = as_index(m), as_index(n)
    if mi is None or mi < 0:
        raise ValueError(f"bands: m must be a non-negative int, got {m!r}")
    if ni is None or ni < 1:
        raise ValueError(f"bands: n must be a positive int, got {n!r}")
    return [(i * mi // ni, (i + 1) * mi // ni) for i in range(ni)]


class WorkerError(RuntimeError):
    """A worker failed during a stage. Attributes: stage, worker, n_workers, band, reason."""

    def __init__(self, stage: str, worker: int, n_workers: int, band: tuple[int, int],
                 reason: str, detail: str = "") -> None:
        self.stage, self.worker, self.n_workers = stage, worker, n_workers
        self.band, self.reason, self.detail = band, reason, detail
        msg = (f"stage {stage!r}: worker {worker} of {n_workers} "
               f"(band [{band[0]}, {band[1]})) {reason}")
        if detail:
            msg += "\n--- worker traceback ---\n" + detail.rstrip()
        super().__init__(msg)


# ---------------------------------------------------------------------------------------------
# low-level helpers
def _write_msg(fd: int, obj: Any) -> None:
    """One message to a pipe. A reader that is gone (a worker that died) is BrokenPipeError,
    also in a process whose SIGPIPE is at its default action (Python ignores it, but an
    embedding program -- or C code, which Python's own record of the disposition does not
    see -- may set it back): SIGPIPE is blocked for the write and a pending one taken back,
    so the dead worker is reported instead of killing this process (two system calls a
    message)."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    buf = memoryview(_HDR.pack(len(data)) + data)
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGPIPE})
    try:
        while buf:
            buf = buf[os.write(fd, buf):]
    except BrokenPipeError:
        if signal.SIGPIPE not in old:         # ours, pending on this thread: take it back
            signal.sigtimedwait({signal.SIGPIPE}, 0)
        raise
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _read_exact(fd: int, n: int) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        b = os.read(fd, n - got)
        if not b:
            return None
        chunks.append(b)
        got += len(b)
    return b"".join(chunks)


def _read_msg(fd: int) -> Any:
    """One message, or None on EOF (the writer exited)."""
    hdr = _read_exact(fd, _HDR.size)
    if hdr is None:
        return None
    body = _read_exact(fd, _HDR.unpack(hdr)[0])
    if body is None:
        return None
    return pickle.loads(body)


def _describe_status(status: int | None) -> str:
    if status is not None and os.WIFEXITED(status):
        return describe_exit(status) + " without reporting a result"
    return describe_exit(status)


def batch_policy() -> bool:
    """Put the calling process under ``SCHED_BATCH`` (Linux; no privilege needed); False where
    the platform has no such policy or refuses it (the process then keeps its policy).

    Workers run under it: a batch process that wakes does not preempt the one running on its
    CPU. With the default policy, the dispatch of a stage woke worker 0 on the parent's CPU,
    which then preempted the parent before it had written worker 1's command: AMX Xeon, 2 cores,
    2 workers, the Q4_K_M block at T=256, 10 runs of 11 stages: the parent's command writes
    took 29-30 ms in all (up to 4 ms for one stage) under the default policy and 7-9 ms (at most
    0.19 ms) with batch workers."""
    setter = getattr(os, "sched_setscheduler", None)
    policy = getattr(os, "SCHED_BATCH", None)
    if setter is None or policy is None:
        return False
    try:
        setter(0, policy, os.sched_param(0))
    except OSError:
        return False
    return True


def _poll_readable(fd: int, seconds: float) -> None:
    """Return when ``fd`` is readable or ``seconds`` have passed, giving the CPU to any runnable
    process between polls (``sched_yield``): the caller then reads without sleeping first."""
    deadline = time.perf_counter() + seconds
    yield_ = getattr(os, "sched_yield", None)
    while True:
        try:
            if select.select([fd], [], [], 0)[0]:
                return
        except (OSError, ValueError):
            return                              # the read reports it
        if time.perf_counter() >= deadline:
            return
        if yield_ is not None:
            yield_()


def _child_init(parent_pid: int, ds: deferred_signals) -> None:
    """In a fresh worker (inside the parent's fork section): signals, then die-with-parent,
    then the batch scheduling policy (:func:`batch_policy`).

    The fork hook of :mod:`nxhpc.runtime.proc` has already closed every pipe end the parent
    keeps (this pool's and every other pool's); only this worker's own ends remain.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)      # the parent handles Ctrl-C
    signal.signal(signal.SIGHUP, signal.SIG_IGN)      # and a hang-up (the lifeline ends us)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    ds.restore()                                      # inherited blocked: unblock after the above
    die_with_parent(parent_pid)
    batch_policy()


def _error_result(e: BaseException) -> tuple[str, str, str]:
    """("error", one-line reason, traceback tail) for an exception being handled."""
    return ("error", f"raised {type(e).__name__}: {e}"[:500], traceback.format_exc()[-_MAX_ERR:])


def _parts(r: Any) -> tuple[int, ...] | None:
    """What a task returned, as its parts' nanoseconds: a tuple of ints, else None."""
    if isinstance(r, tuple) and all(isinstance(v, int) for v in r):
        return r
    return None


def _run_task(tasks: Mapping[str, Task], name: str, lo: int, hi: int, arg: Any) -> tuple:
    """In a worker: run one band; every exception, even KeyboardInterrupt, becomes a report.
    Success is ``("ok", ns, parts)``: the task's own time in nanoseconds (``perf_counter_ns``)
    and what it returned if that is a tuple of ints (a task running several steps times each:
    :attr:`WorkerPool.last_parts_ns`), else None."""
    try:
        t0 = time.perf_counter_ns()
        r = tasks[name](lo, hi, arg)
        return ("ok", time.perf_counter_ns() - t0, _parts(r))
    except BaseException as e:  # noqa: BLE001 - everything is reported to the parent
        return _error_result(e)


# ---------------------------------------------------------------------------------------------
class _Workers:
    """What a pool must release -- worker pids and the parent's pipe ends -- kept apart from the
    pool so that a ``weakref.finalize`` can own it. A pid is recorded in the fork section that
    creates it and marked -1 in the deferred block that reaps it; a descriptor is popped from its
    list before it is closed. Every method is idempotent and resumes an interrupted call."""

    __slots__ = ("owner_pid", "pids", "last_pids", "cmd_w", "res_r", "stage_fds")

    def __init__(self) -> None:
        self.owner_pid = os.getpid()
        self.pids: list[int] = []        # pool mode: the resident workers (-1: reaped)
        self.last_pids: list[int] = []   # stage mode: the workers of the last stage (-1: reaped)
        self.cmd_w: list[int] = []       # pool mode: command pipe, parent's (write) end
        self.res_r: list[int] = []       # pool mode: status pipe, parent's (read) end
        self.stage_fds: list[int] = []   # stage mode: status pipes of the running stage

    def busy(self) -> bool:
        return bool(self.cmd_w or self.res_r or self.stage_fds
                    or any(p > 0 for p in self.pids) or any(p > 0 for p in self.last_pids))

    def kill(self) -> None:
        """Close every pipe end, SIGKILL and reap every worker."""
        if os.getpid() != self.owner_pid:
            return
        with deferred_signals():
            for lst in (self.cmd_w, self.res_r, self.stage_fds):
                while lst:
                    close_fd(lst)
            for lst in (self.pids, self.last_pids):
                _kill_and_reap(lst)
            self.pids.clear()

    def end_stage(self) -> None:
        """Close the last stage's status pipes, kill and reap its workers (stage mode)."""
        if os.getpid() != self.owner_pid:
            return
        with deferred_signals():
            while self.stage_fds:
                close_fd(self.stage_fds)
            _kill_and_reap(self.last_pids)

    def stop(self) -> None:
        """Send ``stop``, close the command pipes, reap (SIGKILL stragglers after a grace
        period), close the status pipes; anything going wrong (an interrupt) -> :meth:`kill`."""
        if os.getpid() != self.owner_pid:
            return
        try:
            with deferred_signals():
                for fd in self.cmd_w:
                    _send_stop(fd)
                while self.cmd_w:
                    close_fd(self.cmd_w)
            for i, pid in enumerate(self.pids):
                if pid > 0:
                    reap(pid, _REAP_S, _forget(self.pids, i))
            with deferred_signals():
                while self.res_r:
                    close_fd(self.res_r)
                self.pids.clear()
            self.end_stage()
        except BaseException:
            self.kill()
            raise


class WorkerPool:
    """Run named tasks over deterministic bands in forked workers.

    ``WorkerPool(n, {"qkv": fn, ...}, mode="pool")``; ``pool.run("qkv", m, arg=layer)`` splits
    ``[0, m)`` into ``min(n, max_workers, m)`` bands and runs ``fn(lo, hi, arg)`` for band ``i``
    in worker ``i``, returning when all are done. With one effective worker and ``inline=True``
    the task runs in the calling process (no fork); its exceptions still come out as
    :class:`WorkerError`. ``stage_timeout`` (seconds, None = wait forever) bounds one stage in
    forked workers (a call running ``stages=k`` of them in turn gets k times it); an inline
    stage cannot be interrupted. Use as a context manager, or call
    :meth:`close`; a pool dropped without ``close()`` is stopped when collected or at exit.
    ``warm`` (pool mode): called once in each resident worker before it serves a stage (the
    engine maps its arena there in one call, :meth:`SharedArena.populate`); its exceptions are
    ignored. ``spin_s`` (pool mode): seconds a worker polls for its next command before it
    blocks (None: :data:`POOL_SPIN_S` when ``n_workers`` <= the usable CPUs, else 0; 0: block
    at once). Threads: :meth:`run` holds a lock, so stages dispatched from several threads run
    one after the other (the workers serve one stage at a time).
    """

    # Defaults at class level: a pool whose __init__ raised (or was interrupted) early still
    # answers every attribute its methods read.
    owner_pid = -1
    mode = DEFAULT_SPAWN
    n_workers = 0
    _closed = True
    _broken: str | None = None
    _w: _Workers | None = None
    _lock: Any = None
    _warm: Callable[[], object] | None = None
    _spin_s = 0.0
    _busy_ns: tuple[int, ...] = ()
    _parts_ns: tuple[tuple[int, ...] | None, ...] = ()

    def __init__(self, n_workers: int, tasks: Mapping[str, Task], mode: str = DEFAULT_SPAWN,
                 *, inline: bool = True, stage_timeout: float | None = None,
                 warm: Callable[[], object] | None = None,
                 spin_s: float | None = None) -> None:
        from nxhpc.runtime.checks import check_workers      # the one worker-count rule
        if n_workers is None:
            raise ValueError("WorkerPool: n_workers must be an integer >= 1, got None")
        n_workers = check_workers(n_workers, "WorkerPool: n_workers")
        if mode not in SPAWN_MODES:
            raise ValueError(f"WorkerPool: mode must be one of {SPAWN_MODES}, got {mode!r}")
        if not isinstance(tasks, Mapping) or not all(callable(t) for t in tasks.values()):
            raise TypeError("WorkerPool: tasks must be a mapping name -> callable(lo, hi, arg)")
        if warm is not None and not callable(warm):
            raise TypeError(f"WorkerPool: warm must be a callable or None, got "
                            f"{type(warm).__name__}")
        self._warm = warm
        if spin_s is None:
            spin_s = POOL_SPIN_S if n_workers <= usable_cpus() else 0.0
        elif (isinstance(spin_s, bool) or not isinstance(spin_s, (int, float))
              or not 0 <= spin_s <= 1):
            raise ValueError(f"WorkerPool: spin_s must be None or seconds in [0, 1], got "
                             f"{spin_s!r}")
        self._spin_s = float(spin_s)
        self.stage_timeout = check_timeout(stage_timeout)
        self.n_workers = n_workers
        self.mode = mode
        self.inline = inline
        self._tasks = dict(tasks)
        self._lock = threading.RLock()
        self._seq = 0
        self.owner_pid = os.getpid()
        # The record and its finalizer exist before any worker does (see _Workers).
        w = _Workers()
        self._finalizer = weakref.finalize(self, w.stop)
        self._w = w
        self._closed = False
        if mode == "pool" and not (inline and n_workers == 1):
            self._start_pool()

    @property
    def last_busy_ns(self) -> tuple[int, ...]:
        """Per band of the last stage that finished, the nanoseconds its task itself ran
        (``perf_counter_ns`` around the call, in the process that ran it); () before any.
        The stage's wall time less the longest of these is the pool's own cost: dispatch,
        wake-ups and result collection (``Engine.last_split`` adds them up per stage)."""
        return self._busy_ns

    @property
    def last_parts_ns(self) -> tuple[tuple[int, ...] | None, ...]:
        """Per band of the last stage that finished, what its task returned when that was a
        tuple of ints (a task running several steps reports each one's nanoseconds), else
        None; () before any stage."""
        return self._parts_ns

    @property
    def spin_s(self) -> float:
        """Seconds a resident worker polls for its next command before it blocks (0: never)."""
        return self._spin_s

    @property
    def pids(self) -> list[int]:
        """Pool mode: the resident workers' pids (-1: reaped)."""
        return self._w.pids if self._w is not None else []

    @property
    def last_pids(self) -> list[int]:
        """Stage mode: the pids of the last stage's workers (-1: reaped)."""
        return self._w.last_pids if self._w is not None else []

    # -- forking ----------------------------------------------------------------------------
    def _fork(self, pipes: list[tuple[list[int], bool]], pids: list[int], body) -> None:
        """Make one pipe per ``(record, parent_reads)``, fork a worker running
        ``body(*child_ends)``, and record everything.

        One fork section: each pipe's parent end is appended to its record (and registered, so
        later children close it) and the pid to ``pids`` before any interrupt can surface; the
        child's ends are closed in the parent before the section ends.
        """
        with fork_section() as ds:
            child_ends: list[int] = []
            try:
                for record, parent_reads in pipes:
                    r, w = os.pipe()
                    mine, theirs = (r, w) if parent_reads else (w, r)
                    record.append(mine)
                    register_fd(mine)
                    child_ends.append(theirs)
                pid = limited_fork()
                if pid == 0:  # ---- worker: never leaves this block ----
                    code = 1
                    try:
                        _child_init(self.owner_pid, ds)
                        code = body(*child_ends)
                    finally:
                        os._exit(code)
                pids.append(pid)
            finally:
                for fd in child_ends:
                    os.close(fd)

    def _start_pool(self) -> None:
        lifeline()
        w = self._w
        try:
            for _ in range(self.n_workers):
                self._fork([(w.cmd_w, False), (w.res_r, True)], w.pids, self._worker_loop)
        except BaseException:
            self._closed = True
            w.kill()
            raise

    def _worker_loop(self, cmd_r: int, res_w: int) -> int:
        if self._warm is not None:
            try:
                self._warm()
            except Exception:                 # noqa: BLE001 - a hint only; stages report errors
                pass
        spin = self._spin_s
        while True:
            if spin:
                _poll_readable(cmd_r, spin)
            try:
                msg = _read_msg(cmd_r)
            except (OSError, EOFError, pickle.UnpicklingError):
                return 2
            if msg is None or msg[0] == "stop":
                return 0
            _, seq, name, lo, hi, arg = msg
            result = _run_task(self._tasks, name, lo, hi, arg)
            try:
                _write_msg(res_w, (seq,) + result)
            except OSError:
                return 3

    # -- dispatch ---------------------------------------------------------------------------
    def run(self, stage: str, m: int, *, task: str | None = None, arg: Any = None,
            max_workers: int | None = None, lo: int = 0, stages: int = 1) -> int:
        """Run task ``task`` (default: ``stage``) over ``[lo, m)`` (``lo``: where this
        process's share of a larger range starts, e.g. an MPI rank's band; the workers split
        ``[lo, m)`` as :func:`bands` splits ``[0, m - lo)``); returns the workers used.
        ``stages``: how many stages the task runs in turn (a row group), each allowed
        ``stage_timeout``. Serialized with other threads' calls (one stage at a time)."""
        if self._lock is None:
            raise RuntimeError(f"WorkerPool: closed (stage {stage!r})")
        if as_index(stages) is None or stages < 1:
            raise ValueError(f"WorkerPool.run: stages must be an int >= 1, got {stages!r}")
        with self._lock:
            return self._run(stage, m, task, arg, max_workers, lo, int(stages))

    def _run(self, stage: str, m: int, task: str | None, arg: Any,
             max_workers: int | None, lo: int = 0, stages: int = 1) -> int:
        if self._closed:
            raise RuntimeError(f"WorkerPool: closed (stage {stage!r})"
                               + (f"; it broke earlier: {self._broken}" if self._broken else ""))
        if os.getpid() != self.owner_pid:
            raise RuntimeError("WorkerPool.run called from a forked child")
        name = stage if task is None else task
        if name not in self._tasks:
            raise KeyError(f"WorkerPool: no task named {name!r} (has: {sorted(self._tasks)})")
        if lo < 0:
            raise ValueError(f"WorkerPool.run: lo must be >= 0, got {lo}")
        if m - lo <= 0:
            return 0
        n = min(self.n_workers, m - lo, max_workers or self.n_workers)
        bs = [(lo + a, lo + b) for a, b in bands(m - lo, n)]
        if n == 1 and self.inline:
            # In the calling process: Ctrl-C / SIGTERM exceptions (BaseException) pass through
            # untouched for the caller to handle; errors become WorkerError like a worker's.
            try:
                t0 = time.perf_counter_ns()
                r = self._tasks[name](lo, m, arg)
                self._busy_ns = (time.perf_counter_ns() - t0,)
                self._parts_ns = (_parts(r),)
            except Exception as e:
                _, reason, tb = _error_result(e)
                raise WorkerError(stage, 0, 1, (lo, m), reason + " (in process)", tb) from e
            return 1
        if self.mode == "pool":
            self._run_pool(stage, name, bs, arg, stages)
        else:
            self._run_stage(stage, name, bs, arg, stages)
        return n

    def _collect(self, stage: str, bs: list[tuple[int, int]], fds: list[int],
                 pids: list[int], seq: int | None, stages: int = 1) -> None:
        """Wait for one status message per worker; on EOF, error or timeout raise WorkerError
        (the timeout: ``stage_timeout`` for each of the task's ``stages``)."""
        pending = {fd: i for i, fd in enumerate(fds)}
        n = len(bs)
        busy = [0] * n
        parts: list[tuple[int, ...] | None] = [None] * n
        limit = None if self.stage_timeout is None else self.stage_timeout * stages
        deadline = None if limit is None else time.monotonic() + limit
        stopped_since: dict[int, float] = {}
        while pending:
            if deadline is not None and time.monotonic() >= deadline:
                late = sorted(pending.values())
                each = (f" for each of its {stages} stages ({limit:g} s)"
                        if stages > 1 else "")
                raise WorkerError(stage, late[0], n, bs[late[0]],
                                  f"did not finish within the stage timeout of "
                                  f"{self.stage_timeout:g} s{each} (hung or too slow; unfinished "
                                  f"workers: {', '.join(map(str, late))}); all workers killed")
            ready, _, _ = select.select(list(pending), [], [], _POLL_S)
            if not ready:               # nothing for a while: is a worker stopped?
                self._check_stopped(stage, bs, sorted(pending.values()), pids, stopped_since)
            for fd in ready:
                i = pending.pop(fd)
                msg = None
                try:
                    msg = _read_msg(fd)
                except (OSError, EOFError, pickle.UnpicklingError):
                    msg = None
                if msg is not None and seq is not None:
                    msg = msg[1:] if msg[0] == seq else None
                if msg is not None and msg[0] == "ok":
                    busy[i] = msg[1]
                    parts[i] = msg[2]
                    continue
                if msg is None:   # EOF: the worker is dead or dying; reap it (grace period)
                    status = reap(pids[i], _REAP_S, _forget(pids, i))
                    raise WorkerError(stage, i, n, bs[i], _describe_status(status))
                raise WorkerError(stage, i, n, bs[i], msg[1], msg[2])
        self._busy_ns = tuple(busy)
        self._parts_ns = tuple(parts)

    def _check_stopped(self, stage: str, bs: list[tuple[int, int]], waiting: list[int],
                       pids: list[int], since: dict[int, float]) -> None:
        """WorkerError for the first of ``waiting`` stopped for :data:`STOP_GRACE_S` or more
        (``since``: worker -> when it was first seen stopped; a resumed one is dropped)."""
        now = time.monotonic()
        for i in waiting:
            sig = stop_signal(pids[i])
            if sig is None:
                since.pop(i, None)
                continue
            if now - since.setdefault(i, now) >= STOP_GRACE_S:
                raise WorkerError(stage, i, len(bs), bs[i],
                                  f"was stopped by {signal_name(sig)} (signal {sig}) and not "
                                  f"resumed within {STOP_GRACE_S:g} s, so the stage could never "
                                  f"finish; all workers killed")

    def _run_pool(self, stage: str, name: str, bs: list[tuple[int, int]], arg: Any,
                  stages: int = 1) -> None:
        self._seq += 1
        seq = self._seq
        n = len(bs)
        w = self._w
        try:
            for i, (lo, hi) in enumerate(bs):
                _write_msg(w.cmd_w[i], ("run", seq, name, lo, hi, arg))
            self._collect(stage, bs, w.res_r[:n], w.pids, seq, stages)
        except BrokenPipeError:
            i, status = 0, None
            for j, pid in enumerate(w.pids[:n]):
                st = _poll_status(pid, _forget(w.pids, j))
                if st is not None:
                    i, status = j, st
                    break
            self._fail(f"a worker was gone before stage {stage!r}")
            raise WorkerError(stage, i, n, bs[i], _describe_status(status)
                              + " (before the stage started)") from None
        except WorkerError as e:
            self._fail(str(e).splitlines()[0])
            raise
        except BaseException:
            self._fail(f"interrupted during stage {stage!r}")
            raise

    def _fail(self, why: str) -> None:
        self._broken = why
        self._closed = True
        self._w.kill()

    def _run_stage(self, stage: str, name: str, bs: list[tuple[int, int]], arg: Any,
                   stages: int = 1) -> None:
        # The records live on the pool's record (not in locals), so an interrupt anywhere --
        # even in the cleanup below -- leaves them for close() / the finalizer to finish.
        w = self._w
        w.end_stage()
        pids: list[int] = []
        w.last_pids = pids
        lifeline()

        def body(lo: int, hi: int, wfd: int) -> int:
            result = _run_task(self._tasks, name, lo, hi, arg)
            _write_msg(wfd, result)
            return 0 if result[0] == "ok" else 1

        try:
            for lo, hi in bs:
                self._fork([(w.stage_fds, True)], pids, functools.partial(body, lo, hi))
            self._collect(stage, bs, w.stage_fds, pids, None, stages)
            for i, pid in enumerate(pids):      # wait4 them all
                if pid > 0:
                    status = reap(pid, _REAP_S, _forget(pids, i))
                    # None: no status left to read (reaped by the kernel under a SIGCHLD of
                    # SIG_IGN, or by the caller's own reaper); every worker reported "ok"
                    if status is None:
                        continue
                    if not os.WIFEXITED(status) or os.WEXITSTATUS(status):
                        raise WorkerError(stage, i, len(bs), bs[i], _describe_status(status))
        finally:
            w.end_stage()

    # -- lifetime ---------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the workers: send ``stop``, close the command pipes, reap (SIGKILL stragglers
        after a grace period), close the status pipes. Idempotent; an interrupted close leaves
        consistent records, and the next call (or the finalizer) finishes the job."""
        self._closed = True
        w = self._w
        if w is None or os.getpid() != w.owner_pid:
            return
        w.stop()
        if not w.busy():
            self._finalizer.detach()               # nothing left: no work at collection

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"<WorkerPool mode={self.mode} n={self.n_workers} "
                f"{'closed' if self._closed else 'open'} pids={self.pids}>")


def _forget(lst: list[int], i: int):
    """A callback marking ``lst[i]`` as reaped (-1), for :func:`nxhpc.runtime.proc.reap`."""
    def forget() -> None:
        lst[i] = -1
    return forget


def _kill_and_reap(pids: list[int]) -> None:
    """SIGKILL every live pid of ``pids`` (all first, so none waits on another), then reap each;
    a reaped pid is forgotten in the list. A pid that is no longer this process's child (reaped
    by the kernel under a SIGCHLD of SIG_IGN, or by the caller's own reaper) is forgotten
    unsignalled: the number may already be another process's. The caller defers signals."""
    for i, pid in enumerate(pids):
        if pid > 0:
            try:
                done = os.waitpid(pid, os.WNOHANG)[0] == pid     # exited: reaped here
            except ChildProcessError:
                done = True
            if done:
                pids[i] = -1
                continue
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for i, pid in enumerate(pids):
        if pid > 0:
            reap(pid, 5.0, _forget(pids, i))


def _send_stop(fd: int) -> None:
    """Best effort, never blocking: the ``stop`` message a worker exits on."""
    data = pickle.dumps(("stop",), protocol=pickle.HIGHEST_PROTOCOL)
    try:
        os.set_blocking(fd, False)
        os.write(fd, _HDR.pack(len(data)) + data)
    except OSError:            # a dead worker (EPIPE), a full pipe: EOF on close does the rest
        pass


def stop_signal(pid: int) -> int | None:
    """The signal that stopped child ``pid`` if it is stopped now, else None. ``WNOWAIT``: the
    report stays pending, so this never reaps and never consumes a status; once the child is
    continued the kernel no longer reports it stopped."""
    if pid <= 0:
        return None
    try:
        r = os.waitid(os.P_PID, pid, os.WSTOPPED | os.WNOHANG | os.WNOWAIT)
    except (ChildProcessError, OSError):
        return None
    if r is None or r.si_pid != pid or r.si_code != os.CLD_STOPPED:
        return None
    return r.si_status


def _poll_status(pid: int, forget=None) -> int | None:
    """The wait status of ``pid`` if it has ended (reaping it), else None."""
    if pid <= 0:
        return None
    with deferred_signals():
        try:
            wpid, status, _ = os.wait4(pid, os.WNOHANG)
        except ChildProcessError:
            return None
        if wpid == pid:
            if forget is not None:
                forget()
            return status
        return None
