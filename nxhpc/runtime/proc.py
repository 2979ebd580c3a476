"""Process helpers shared by the worker pool and the data-parallel trainer (``nxhpc.train``).

Owns: holding off asynchronous signals while a resource is acquired or released *and recorded*
(:class:`deferred_signals`, :func:`fork_section`), the die-with-parent lifeline
(:func:`lifeline`, :func:`die_with_parent`), the registry of parent-side file descriptors that
no forked child may keep (:func:`register_fd`, :func:`close_fd`), reaping with a grace period
(:func:`reap`), the text of an exit status (:func:`describe_exit`), and a CLI's signal ->
exception mapping that remembers what arrived (:class:`cli_signals`). Must not: import numpy
or the compiled kernels, start threads, or touch a descriptor or pid it was not given.

**Interrupt safety.** A ``KeyboardInterrupt`` (Ctrl-C, a notebook's "interrupt kernel", a
``SIGALRM`` handler that raises) can surface between any two bytecodes, including right after
``os.pipe()`` or ``os.fork()`` returned and before the result is stored. Every such step runs
inside :class:`deferred_signals`: asynchronous signals are blocked for the calling thread, the
resource is acquired and recorded, and a signal that arrived meanwhile is delivered (its Python
handler runs) when the block ends -- after the record exists. Releasing works the same way:
forget the record, then close/unlink/reap, in one deferred block, so nothing is released twice.
With other threads alive (``import torch``, a Jupyter kernel) blocking the signal in the main
thread is not enough -- another thread receives it and Python runs the handler in the main thread
anyway -- so the outermost main-thread block also swaps Python-level handlers for a recorder and
re-sends what it recorded after the block (details in :class:`deferred_signals`).

**Die with the parent, whichever thread forked.** ``PR_SET_PDEATHSIG`` fires when the *thread*
that forked exits, so a pool first used from a worker thread (a thread pool, a web request)
lost its workers when that thread ended. Instead this process holds the write end of one pipe,
the *lifeline*, for its whole life and never writes to it; an ``os.fork`` hook closes that end
in every forked child. A worker reopens the read end as an open file of its own
(``/proc/self/fd/N``) and asks the kernel for SIGKILL when it becomes readable
(``F_SETOWN`` + ``F_SETSIG`` + ``O_ASYNC``) -- which happens exactly when the last write end
closes, i.e. when the parent process ends, however it ends (exit, crash, SIGKILL). A worker forked
from the main thread also sets ``PR_SET_PDEATHSIG`` (the main thread lives as long as the process).

**Inherited descriptors.** Pipe ends a pool keeps in the parent are registered here; the same
fork hook closes every registered descriptor in every forked child (a later pool's workers, a
trainer's workers, a user's ``os.fork``), so end-of-file on a pipe really means its owner is
gone. Descriptors are created close-on-exec, so an exec'd program never holds them either.
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["deferred_signals", "fork_section", "lifeline", "die_with_parent", "register_fd",
           "close_fd", "reap", "describe_exit", "signal_name", "ASYNC_SIGNALS", "cli_signals",
           "Terminated", "check_owner", "ProcessLimitError", "limited_fork", "soft_limit"]

#: Signals held off by :class:`deferred_signals`: every catchable signal except those raised
#: synchronously by a fault in the running code (blocking those would hide a crash).
ASYNC_SIGNALS = frozenset(signal.valid_signals()) - {
    signal.SIGKILL, signal.SIGSTOP, signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL,
    signal.SIGTRAP, signal.SIGSYS, signal.SIGABRT}

_F_SETSIG = getattr(fcntl, "F_SETSIG", 10)       # Linux value; Python < 3.12 may not export it
_PR_SET_PDEATHSIG = 1


class _Held:
    """The Python-level handlers a main-thread :class:`deferred_signals` block replaced with
    :func:`_record`, and the signals recorded meanwhile (see :class:`deferred_signals`)."""

    __slots__ = ("owner", "pid", "saved", "pending")

    def __init__(self, owner: "deferred_signals") -> None:
        self.owner = owner
        self.pid = os.getpid()
        self.saved: dict[int, Any] = {}
        self.pending: list[int] = []


_held: _Held | None = None            # the outermost main-thread block's record (main thread only)
_SIGNAL_ORDER = tuple(sorted(ASYNC_SIGNALS))


def _record(signum: int, frame: object) -> None:
    """Stand-in Python handler while a block holds signals off: note the signal for later."""
    h = _held
    if h is not None and h.pid == os.getpid():
        h.pending.append(signum)
    elif signal.getsignal(signum) is not _record:     # restored meanwhile: deliver it now
        signal.raise_signal(signum)


def _hold_handlers(owner: "deferred_signals") -> None:
    """Replace every Python-level handler of an asynchronous signal with :func:`_record`,
    recording each one (and the record itself) before it is replaced."""
    global _held
    h = _Held(owner)
    _held = h
    for sig in _SIGNAL_ORDER:
        cur = signal.getsignal(sig)
        if callable(cur) and cur is not _record:
            h.saved[sig] = cur
            signal.signal(sig, _record)


def _release_handlers(h: _Held) -> list[int]:
    """Put back the handlers ``h`` replaced (those still replaced: a handler installed inside
    the block stays) and forget ``h``; returns the signals recorded meanwhile, once each."""
    global _held
    try:
        for sig, old in h.saved.items():
            if signal.getsignal(sig) is _record:
                signal.signal(sig, old)
    finally:
        if _held is h:
            _held = None
    return list(dict.fromkeys(h.pending)) if h.pid == os.getpid() else []


class deferred_signals:
    """``with deferred_signals():`` -- asynchronous signals wait for the block's end.

    Nestable (the outer mask is restored). A signal arriving inside is delivered, and its Python
    handler runs, right after the block: an exception it raises comes out of the ``with``
    statement once the block's bookkeeping is complete. :meth:`restore` puts the mask back early
    (a forked child calls it after its own signal setup).

    Two layers. The signals are blocked for the calling thread, which covers a single-threaded
    process exactly. With other threads alive the kernel hands a process-directed signal to one
    of them, and Python then runs the handler in the main thread between any two bytecodes --
    inside the block. So the outermost block entered from the main thread also replaces every
    Python-level handler of :data:`ASYNC_SIGNALS` by a recorder (record first, then replace),
    and on leaving puts them back, restores the mask and re-sends each recorded signal to
    itself (``signal.raise_signal``), so its real handler runs after the block. (A block in
    another thread needs no more: Python never runs a handler in a thread other than main.)
    """

    __slots__ = ("_old",)

    def __init__(self) -> None:
        self._old: set | None = None

    def __enter__(self) -> "deferred_signals":
        old = signal.pthread_sigmask(signal.SIG_BLOCK, ())      # read the mask, change nothing
        self._old = old
        try:
            signal.pthread_sigmask(signal.SIG_BLOCK, ASYNC_SIGNALS)
            if _held is None and threading.current_thread() is threading.main_thread():
                _hold_handlers(self)
        except BaseException:
            self.restore()
            raise
        return self

    def restore(self) -> None:
        if self._old is None:
            return
        old, self._old = self._old, None
        h = _held
        pending: list[int] = []
        try:
            if h is not None and h.owner is self:
                pending = _release_handlers(h)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
        for sig in pending:                 # its real handler runs now (or stays pending, if
            signal.raise_signal(sig)        # an outer mask blocks it)

    def __exit__(self, *exc: object) -> None:
        self.restore()


# Serializes the pipe+fork+close steps of every pool in this process, so that a child forked by
# one thread never inherits another thread's half-made worker pipes (which are not registered).
_fork_lock = threading.Lock()


class fork_section:
    """``with fork_section() as ds:`` = the process-wide fork lock + :class:`deferred_signals`.

    For the steps "make pipes, record them, fork, record the pid, close the child's ends". In the
    child, call ``ds.restore()`` after setting up its signal handlers (the child inherits the
    blocked mask and must never leave the block: it ends with ``os._exit``).
    """

    __slots__ = ("_ds",)

    def __enter__(self) -> deferred_signals:
        self._ds = deferred_signals()
        self._ds.__enter__()
        try:
            _fork_lock.acquire()
        except BaseException:
            self._ds.restore()
            raise
        return self._ds

    def __exit__(self, *exc: object) -> None:
        if os.getpid() == _lock_owner_pid:
            _fork_lock.release()
        self._ds.restore()


_lock_owner_pid = os.getpid()
_owned_fds: set[int] = set()          # parent-side fds of this process that children must not keep
_life_r = -1                          # this process's lifeline (read end, handed to children)
_life_w = -1                          # ... and its write end (held by this process only)
_parent_life_r = -1                   # in a forked child: the parent's lifeline read end
_watch_fd = -1                        # in a worker: its own open file on the parent's lifeline
_forked_from_main = True              # set in the parent just before each fork


class ProcessLimitError(BlockingIOError):
    """``fork()`` refused for the process limit (EAGAIN: ``ulimit -u`` / RLIMIT_NPROC, or a
    container's pids.max): the environment's limit, not a bug (the CLIs: a usage error)."""

    def __str__(self) -> str:
        return str(self.strerror)


def limited_fork(start: Callable[[], Any] = os.fork) -> Any:
    """``start()`` (``os.fork`` by default, or a ``Process.start``); a refusal for the process
    limit becomes :class:`ProcessLimitError`, its message naming the limit."""
    try:
        return start()
    except BlockingIOError as e:
        if e.errno != errno.EAGAIN:
            raise
        raise ProcessLimitError(
            errno.EAGAIN, f"cannot start a worker process ({e.strerror or e}): the limit on "
            f"processes (ulimit -u) is {soft_limit('RLIMIT_NPROC')}, or a container's pids "
            f"limit was reached; each worker is a process -- raise the limit or run fewer "
            f"workers") from None


def soft_limit(name: str) -> str:
    """This process's soft limit ``resource.<name>`` (e.g. ``"RLIMIT_NOFILE"``) in words: a
    number, ``"unlimited"`` or ``"unknown"``."""
    try:
        import resource
        soft = resource.getrlimit(getattr(resource, name))[0]
        return "unlimited" if soft == resource.RLIM_INFINITY else str(soft)
    except (ImportError, AttributeError, OSError, ValueError):
        return "unknown"


def register_fd(fd: int) -> None:
    """Record ``fd`` as this process's own: every child forked from now on closes its copy."""
    _owned_fds.add(fd)


def close_fd(fds: list[int], i: int = -1) -> None:
    """Forget ``fds[i]`` (pop it), then close it -- in that order, signals deferred -- so a
    descriptor is never closed twice, even when an interrupt lands in between."""
    with deferred_signals():
        fd = fds.pop(i)
        _owned_fds.discard(fd)
        try:
            os.close(fd)
        except OSError:
            pass


def check_owner(owner: int, what: str, kind: str) -> None:
    """Refuse the use of an object with workers and shared memory (``kind``: "Denoiser", ...)
    from a process other than the one that opened it (``owner``, its pid), before any lock or
    buffer is touched: after a fork the child shares the parent's arena (its writes would land
    in the parent's running call) and a lock a parent thread held at the fork is never released
    in the child. RuntimeError naming ``what`` (``"Denoiser.forward"``, ...)."""
    if os.getpid() != owner:
        raise RuntimeError(f"{what}: this {kind} belongs to process {owner}; a forked child "
                           f"must open its own")


def lifeline() -> int:
    """This process's lifeline read end (created on first use). Call before forking a child
    that will call :func:`die_with_parent`."""
    global _life_r, _life_w
    with deferred_signals():
        with _fork_lock:
            if _life_w < 0:
                r, w = os.pipe()                 # close-on-exec both ends
                _life_r, _life_w = r, w
    return _life_r


def _before_fork() -> None:
    global _forked_from_main
    _forked_from_main = threading.current_thread() is threading.main_thread()


def _after_fork_in_child() -> None:
    """In every child forked by ``os.fork``: drop the parent's private descriptors."""
    global _fork_lock, _lock_owner_pid, _life_r, _life_w, _parent_life_r
    _fork_lock = threading.Lock()        # a copy held by the forking thread would never open
    if _held is not None:                # single-threaded now: the inherited mask is exact
        _release_handlers(_held)
    _lock_owner_pid = os.getpid()
    for fd in list(_owned_fds):
        try:
            os.close(fd)
        except OSError:
            pass
    _owned_fds.clear()
    if _life_w >= 0:
        try:
            os.close(_life_w)
        except OSError:
            pass
    if _parent_life_r >= 0 and _parent_life_r != _life_r:    # the grandparent's lifeline
        try:
            os.close(_parent_life_r)
        except OSError:
            pass
    _parent_life_r = _life_r
    _life_r = _life_w = -1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)

_libc = None


def _set_pdeathsig() -> None:
    global _libc
    if not sys.platform.startswith("linux"):
        return
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
        _libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def die_with_parent(parent_pid: int, exit_code: int = 70) -> bool:
    """In a freshly forked child: arrange to be SIGKILLed by the kernel when the parent process
    ends, whichever of its threads forked (see the module docstring). Exits at once (``exit_code``)
    if the parent is already gone. Returns True when the lifeline watch is armed (False: only
    ``PR_SET_PDEATHSIG``, and only when forked from the main thread)."""
    global _watch_fd
    armed = False
    r = _parent_life_r
    if r >= 0 and _watch_fd < 0:
        try:
            fd = os.open(f"/proc/self/fd/{r}", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            fd = -1
        if fd >= 0:
            try:
                fcntl.fcntl(fd, fcntl.F_SETOWN, os.getpid())
                fcntl.fcntl(fd, _F_SETSIG, int(signal.SIGKILL))
                fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_ASYNC)
                armed = True
                _watch_fd = fd                      # kept open for the life of the worker
            except OSError:
                os.close(fd)
        if armed:
            # The parent may have ended before the watch was armed: no write end is left, so the
            # pipe already reads as end-of-file (POLLHUP) and no signal will come.
            p = select.poll()
            p.register(_watch_fd, select.POLLIN | select.POLLHUP)
            if p.poll(0):
                os._exit(exit_code)
    elif _watch_fd >= 0:
        armed = True
    if _forked_from_main:
        _set_pdeathsig()
    if os.getppid() != parent_pid:                  # parent died before any of this took effect
        os._exit(exit_code)
    return armed


def reap(pid: int, grace_s: float, forget=None) -> int | None:
    """Wait up to ``grace_s`` for child ``pid`` to exit (polling ``wait4``), then SIGKILL it and
    wait. Returns the wait status (None if ``pid`` is not a child of ours). ``forget()`` is called
    in the same deferred block as the successful wait, so the caller's record of ``pid`` never
    outlives the process (a reaped pid may be reused: it must never be signalled again)."""
    if pid <= 0:
        return None
    end = time.monotonic() + grace_s
    while True:
        with deferred_signals():
            try:
                wpid, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                wpid, status = pid, None
            if wpid == pid:
                if forget is not None:
                    forget()
                return status
        if time.monotonic() >= end:
            break
        time.sleep(0.001)
    with deferred_signals():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            status = os.waitpid(pid, 0)[1]
        except ChildProcessError:
            status = None
        if forget is not None:
            forget()
        return status


def signal_name(sig: int) -> str:
    """``9 -> 'SIGKILL'``; an unknown number -> ``'signal N'``."""
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


_CRASH_SIGNALS = (signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT)


def describe_exit(status: int | None = None, *, exitcode: int | None = None,
                  brief: bool = False) -> str:
    """How a child ended, in words, from a wait status (``os.waitpid``) or a
    ``multiprocessing`` exit code (negative = killed by that signal).

    ``"crashed by SIGSEGV (signal 11)"``, ``"was killed by SIGKILL (signal 9)"``,
    ``"exited with status 3"``; with ``brief=True`` the trainer's wording:
    ``"killed by signal SIGKILL"``, ``"exited with code 3"``. No status -> ``"disappeared
    without reporting"``.
    """
    sig = code = None
    if exitcode is not None:
        sig, code = (-exitcode, None) if exitcode < 0 else (None, exitcode)
    elif status is not None:
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
        elif os.WIFEXITED(status):
            code = os.WEXITSTATUS(status)
        else:
            return f"ended with wait status {status}"
    if sig is not None:
        name = signal_name(sig)
        if brief:
            return f"killed by signal {name}"
        what = "crashed" if sig in _CRASH_SIGNALS else "was killed"
        hint = ("; a mapped file lost its pages: a model file truncated or replaced in place "
                "during the run?") if sig == signal.SIGBUS else ""
        return f"{what} by {name} (signal {sig}{hint})"
    if code is not None:
        return f"exited with code {code}" if brief else f"exited with status {code}"
    return "disappeared without reporting"


class Terminated(BaseException):
    """Raised by :class:`cli_signals`' SIGTERM and SIGHUP handlers (a BaseException, like
    KeyboardInterrupt, so every ``finally`` / ``with`` cleanup runs on the way out);
    ``signum`` says which."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__(signum)
        self.signum = signum


class cli_signals:
    """``with cli_signals() as sig:`` -- a CLI's ``main``: SIGINT raises KeyboardInterrupt,
    SIGTERM and SIGHUP (a closed terminal or ssh session: its default action killed the run
    with no cleanup, leaving a half-written temporary file beside the output) raise
    :class:`Terminated`, and every arrival is recorded in ``sig.received``.

    The record is what lets the CLI exit as the interrupt even when the exception that reaches
    it is another one: C code that calls back into Python can swallow the KeyboardInterrupt
    raised there and report a failure of its own instead (numpy's ``tofile`` turns it into a
    TypeError or an OSError about its file). :meth:`interrupt` gives the exception to raise in
    place of such a failure (None when no signal arrived). SIGINT is taken over only from
    Python's default handler (a shell that set it to ignored, ``nohup``, keeps it ignored),
    SIGTERM and SIGHUP only from the default action (a caller that ignores it -- ``nohup`` --
    or handles it keeps its own); installed from the main thread only, and restored on exit.
    """

    def __init__(self) -> None:
        self.received: list[int] = []
        self._old: dict[int, Any] = {}

    def _on_int(self, signum: int, frame: object) -> None:
        self.received.append(signum)
        raise KeyboardInterrupt

    def _on_term(self, signum: int, frame: object) -> None:
        self.received.append(signum)
        raise Terminated(signum)

    def __enter__(self) -> "cli_signals":
        if threading.current_thread() is threading.main_thread():
            if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
                self._old[signal.SIGINT] = signal.signal(signal.SIGINT, self._on_int)
            for signum in (signal.SIGTERM, signal.SIGHUP):
                if signal.getsignal(signum) == signal.SIG_DFL:
                    self._old[signum] = signal.signal(signum, self._on_term)
        return self

    def interrupt(self) -> BaseException | None:
        """KeyboardInterrupt / :class:`Terminated` for the first signal recorded, or None."""
        if not self.received:
            return None
        first = self.received[0]
        return KeyboardInterrupt() if first == signal.SIGINT else Terminated(first)

    def __exit__(self, *exc: object) -> None:
        while self._old:
            signum, old = self._old.popitem()
            signal.signal(signum, old)
