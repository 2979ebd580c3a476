"""WorkerPool: forked worker processes running deterministic bands of a stage.

Owns: the band split (worker ``i`` of ``n`` takes ``[i*m//n, (i+1)*m//n)``), process lifetime
(fork, dispatch, wait4, kill, reap) and crash detection. Must not: compute anything itself, run
threads in workers, or leave a worker process behind.

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
names the stage and the first unfinished worker. A parent interrupted mid-stage (Ctrl-C, SIGTERM turned into an
exception) also kills and reaps its workers before the exception propagates. Workers ignore
SIGINT (the parent decides), die with the parent (``PR_SET_PDEATHSIG``) and exit when their
command pipe closes, so none is ever orphaned.
"""
from __future__ import annotations

import atexit
import ctypes
import math
import os
import pickle
import select
import signal
import struct
import time
import traceback
import weakref
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["bands", "WorkerPool", "WorkerError", "SPAWN_MODES", "DEFAULT_SPAWN", "usable_cpus",
           "check_timeout"]

#: Spawn modes. "pool" is the default: it measured faster than "stage" (see benchmarks/bench_block.py).
SPAWN_MODES = ("pool", "stage")
DEFAULT_SPAWN = "pool"

_HDR = struct.Struct("<I")
_MAX_ERR = 8000             # characters of a worker's traceback sent back
_POLL_S = 0.05              # select timeout while waiting (EOF wakes us immediately anyway)
_REAP_S = 1.0               # grace period for a worker to exit before SIGKILL

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
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) \
            or not math.isfinite(timeout) or timeout <= 0:
        raise ValueError(f"{what} must be None or a positive number of seconds, got {timeout!r}")
    return float(timeout)


def bands(m: int, n: int) -> list[tuple[int, int]]:
    """Split ``[0, m)`` into ``n`` deterministic bands ``[i*m//n, (i+1)*m//n)`` (some may be empty)."""
    if isinstance(m, bool) or not isinstance(m, int) or m < 0:
        raise ValueError(f"bands: m must be a non-negative int, got {m!r}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"bands: n must be a positive int, got {n!r}")
    return [(i * m // n, (i + 1) * m // n) for i in range(n)]


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
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    buf = memoryview(_HDR.pack(len(data)) + data)
    while buf:
        n = os.write(fd, buf)
        buf = buf[n:]


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
    if status is None:
        return "disappeared without reporting"
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        what = "crashed" if sig in (signal.SIGSEGV, signal.SIGBUS, signal.SIGILL,
                                    signal.SIGFPE, signal.SIGABRT) else "was killed"
        return f"{what} by {name} (signal {sig})"
    if os.WIFEXITED(status):
        return f"exited with status {os.WEXITSTATUS(status)} without reporting a result"
    return f"ended with wait status {status}"


def _reap(pid: int, deadline_s: float = _REAP_S) -> int | None:
    """Wait for ``pid`` (wait4); SIGKILL it after ``deadline_s``. Returns the wait status."""
    if pid <= 0:
        return None
    end = time.monotonic() + deadline_s
    while True:
        try:
            wpid, status, _ru = os.wait4(pid, os.WNOHANG)
        except ChildProcessError:
            return None
        if wpid == pid:
            return status
        if time.monotonic() >= end:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                return os.wait4(pid, 0)[1]
            except ChildProcessError:
                return None
        time.sleep(0.002)


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _kill_all(pids: list[int]) -> None:
    pids = [p for p in pids if p > 0]   # -1 marks reaped workers; never signal pid <= 0
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in pids:
        _reap(pid, 5.0)


_libc = None


def _child_setup(parent_pid: int, keep_fds: tuple[int, ...], close_fds: list[int]) -> None:
    """In a fresh worker: signals, die-with-parent, drop other workers' pipe ends."""
    global _libc
    signal.signal(signal.SIGINT, signal.SIG_IGN)      # the parent handles Ctrl-C
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
        _libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:                     # parent died before prctl took effect
        os._exit(70)
    _close_fds([fd for fd in close_fds if fd not in keep_fds])


def _error_result(e: BaseException) -> tuple[str, str, str]:
    """("error", one-line reason, traceback tail) for an exception being handled."""
    return ("error", f"raised {type(e).__name__}: {e}"[:500], traceback.format_exc()[-_MAX_ERR:])


def _run_task(tasks: Mapping[str, Task], name: str, lo: int, hi: int, arg: Any) -> tuple:
    """In a worker: run one band; every exception, even KeyboardInterrupt, becomes a report."""
    try:
        tasks[name](lo, hi, arg)
        return ("ok",)
    except BaseException as e:  # noqa: BLE001 - everything is reported to the parent
        return _error_result(e)


# ---------------------------------------------------------------------------------------------
_LIVE_POOLS: "weakref.WeakSet[WorkerPool]" = weakref.WeakSet()


class WorkerPool:
    """Run named tasks over deterministic bands in forked workers.

    ``WorkerPool(n, {"qkv": fn, ...}, mode="pool")``; ``pool.run("qkv", m, arg=layer)`` splits
    ``[0, m)`` into ``min(n, max_workers, m)`` bands and runs ``fn(lo, hi, arg)`` for band ``i``
    in worker ``i``, returning when all are done. With one effective worker and ``inline=True``
    the task runs in the calling process (no fork); its exceptions still come out as
    :class:`WorkerError`. ``stage_timeout`` (seconds, None = wait forever) bounds one stage in
    forked workers; an inline stage cannot be interrupted. Use as a context manager, or call
    :meth:`close`.
    """

    def __init__(self, n_workers: int, tasks: Mapping[str, Task], mode: str = DEFAULT_SPAWN,
                 *, inline: bool = True, stage_timeout: float | None = None) -> None:
        if isinstance(n_workers, bool) or not isinstance(n_workers, int) or n_workers < 1:
            raise ValueError(f"WorkerPool: n_workers must be an int >= 1, got {n_workers!r}")
        if n_workers > max_workers():
            raise ValueError(f"WorkerPool: n_workers={n_workers} is more than {max_workers()} "
                             f"(8x the {usable_cpus()} usable CPUs, at least 64): extra workers "
                             f"only add fork, memory and scheduling cost")
        if mode not in SPAWN_MODES:
            raise ValueError(f"WorkerPool: mode must be one of {SPAWN_MODES}, got {mode!r}")
        if not isinstance(tasks, Mapping) or not all(callable(t) for t in tasks.values()):
            raise TypeError("WorkerPool: tasks must be a mapping name -> callable(lo, hi, arg)")
        self.stage_timeout = check_timeout(stage_timeout)
        self.n_workers = n_workers
        self.mode = mode
        self.inline = inline
        self._tasks = dict(tasks)
        self.owner_pid = os.getpid()
        self._closed = False
        self._broken: str | None = None
        self.pids: list[int] = []            # pool mode: the resident workers
        self.last_pids: list[int] = []       # stage mode: the workers of the last stage
        self._cmd_w: list[int] = []
        self._res_r: list[int] = []
        self._seq = 0
        if mode == "pool" and not (inline and n_workers == 1):
            self._start_pool()
        _LIVE_POOLS.add(self)

    # -- pool mode --------------------------------------------------------------------------
    def _start_pool(self) -> None:
        parent = os.getpid()
        try:
            for i in range(self.n_workers):
                cmd_r, cmd_w = os.pipe()
                res_r, res_w = os.pipe()
                pid = os.fork()
                if pid == 0:  # ---- worker ----
                    code = 1
                    try:
                        _child_setup(parent, (cmd_r, res_w), self._cmd_w + self._res_r
                                     + [cmd_w, res_r])
                        code = self._worker_loop(cmd_r, res_w)
                    finally:
                        os._exit(code)
                os.close(cmd_r)
                os.close(res_w)
                self.pids.append(pid)
                self._cmd_w.append(cmd_w)
                self._res_r.append(res_r)
        except BaseException:
            self._kill_pool()
            raise

    def _worker_loop(self, cmd_r: int, res_w: int) -> int:
        while True:
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

    def _kill_pool(self) -> None:
        _close_fds(self._cmd_w + self._res_r)
        self._cmd_w, self._res_r = [], []
        _kill_all(self.pids)
        self.pids = []

    # -- dispatch ---------------------------------------------------------------------------
    def run(self, stage: str, m: int, *, task: str | None = None, arg: Any = None,
            max_workers: int | None = None) -> int:
        """Run task ``task`` (default: ``stage``) over ``[0, m)``; returns the workers used."""
        if self._closed:
            raise RuntimeError(f"WorkerPool: closed (stage {stage!r})"
                               + (f"; it broke earlier: {self._broken}" if self._broken else ""))
        if os.getpid() != self.owner_pid:
            raise RuntimeError("WorkerPool.run called from a forked child")
        name = stage if task is None else task
        if name not in self._tasks:
            raise KeyError(f"WorkerPool: no task named {name!r} (has: {sorted(self._tasks)})")
        if m <= 0:
            return 0
        n = min(self.n_workers, m, max_workers or self.n_workers)
        bs = bands(m, n)
        if n == 1 and self.inline:
            # In the calling process: Ctrl-C / SIGTERM exceptions (BaseException) pass through
            # untouched for the caller to handle; errors become WorkerError like a worker's.
            try:
                self._tasks[name](0, m, arg)
            except Exception as e:
                _, reason, tb = _error_result(e)
                raise WorkerError(stage, 0, 1, (0, m), reason + " (in process)", tb) from e
            return 1
        if self.mode == "pool":
            self._run_pool(stage, name, bs, arg)
        else:
            self._run_stage(stage, name, bs, arg)
        return n

    def _collect(self, stage: str, bs: list[tuple[int, int]], fds: list[int],
                 pids: list[int], seq: int | None) -> None:
        """Wait for one status message per worker; on EOF, error or timeout raise WorkerError."""
        pending = {fd: i for i, fd in enumerate(fds)}
        n = len(bs)
        deadline = (None if self.stage_timeout is None
                    else time.monotonic() + self.stage_timeout)
        while pending:
            if deadline is not None and time.monotonic() >= deadline:
                late = sorted(pending.values())
                raise WorkerError(stage, late[0], n, bs[late[0]],
                                  f"did not finish within the stage timeout of "
                                  f"{self.stage_timeout:g} s (hung or too slow; unfinished "
                                  f"workers: {', '.join(map(str, late))}); all workers killed")
            ready, _, _ = select.select(list(pending), [], [], _POLL_S)
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
                    continue
                if msg is None:   # EOF: the worker is dead or dying; reap it (grace period)
                    status = _reap(pids[i])
                    pids[i] = -1
                    raise WorkerError(stage, i, n, bs[i], _describe_status(status))
                raise WorkerError(stage, i, n, bs[i], msg[1], msg[2])

    def _run_pool(self, stage: str, name: str, bs: list[tuple[int, int]], arg: Any) -> None:
        self._seq += 1
        seq = self._seq
        n = len(bs)
        try:
            for i, (lo, hi) in enumerate(bs):
                _write_msg(self._cmd_w[i], ("run", seq, name, lo, hi, arg))
            self._collect(stage, bs, self._res_r[:n], self.pids, seq)
        except BrokenPipeError:
            i, status = 0, None
            for j, pid in enumerate(self.pids[:n]):
                st = _poll_status(pid)
                if st is not None:
                    i, status = j, st
                    self.pids[j] = -1
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
        self.pids = [p for p in self.pids if p > 0]
        self._kill_pool()

    def _run_stage(self, stage: str, name: str, bs: list[tuple[int, int]], arg: Any) -> None:
        parent = os.getpid()
        pids: list[int] = []
        fds: list[int] = []
        self.last_pids = pids
        try:
            for i, (lo, hi) in enumerate(bs):
                r, w = os.pipe()
                pid = os.fork()
                if pid == 0:  # ---- worker ----
                    code = 1
                    try:
                        _child_setup(parent, (w,), fds + [r])
                        result = _run_task(self._tasks, name, lo, hi, arg)
                        _write_msg(w, result)
                        code = 0 if result[0] == "ok" else 1
                    finally:
                        os._exit(code)
                os.close(w)
                pids.append(pid)
                fds.append(r)
            self._collect(stage, bs, fds, pids, None)
            for i, pid in enumerate(pids):      # wait4 them all
                if pid > 0:
                    status = _reap(pid)
                    pids[i] = -1
                    if status is None or not os.WIFEXITED(status) or os.WEXITSTATUS(status):
                        raise WorkerError(stage, i, len(bs), bs[i], _describe_status(status))
        finally:
            _close_fds(fds)
            _kill_all([p for p in pids if p > 0])

    # -- lifetime ---------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the workers (pool mode: close their command pipes, reap, SIGKILL stragglers)."""
        if os.getpid() != self.owner_pid:
            return
        self._closed = True
        _close_fds(self._cmd_w)                # workers see EOF and exit
        self._cmd_w = []
        for pid in self.pids:
            if pid > 0:
                _reap(pid)
        self.pids = []
        _close_fds(self._res_r)
        self._res_r = []

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if os.getpid() == self.owner_pid and (self.pids or self._cmd_w):
                self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return (f"<WorkerPool mode={self.mode} n={self.n_workers} "
                f"{'closed' if self._closed else 'open'} pids={self.pids}>")


def _poll_status(pid: int) -> int | None:
    """The wait status of ``pid`` if it has ended (reaping it), else None."""
    try:
        wpid, status, _ = os.wait4(pid, os.WNOHANG)
    except ChildProcessError:
        return None
    return status if wpid == pid else None


def _close_live_pools() -> None:
    for p in list(_LIVE_POOLS):
        p.close()


atexit.register(_close_live_pools)
