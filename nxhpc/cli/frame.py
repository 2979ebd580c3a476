"""The frame every nxhpc CLI's ``main`` runs in: parse, call under the signal frame, map errors.

Owns :func:`run_cli`: argparse's exits (``--help`` 0, usage 2) returned, not raised; SIGINT ->
130 and SIGTERM -> 143 with one line (via :class:`nxhpc.runtime.proc.cli_signals`, so a Ctrl-C
that C code turned into another exception still exits as the interrupt); an expected library
exception -> its code from :func:`nxhpc.cli.codes.code_for` with one ``PROG: error: ...`` line;
stdout closed by its reader (``| head``) -> 8, quietly; stdout that cannot be written -> 8
with one line; the process limit, a removed working directory -> 2; anything else -> a
traceback and 70; the named arenas this call made, in its thread, released on every path (not
the caller's, nor another thread's call's), the caller's signal dispositions kept or restored.
:func:`run_ranked` is the same frame for a command that may run as several MPI ranks
(``mpirun -n R``): one error, one exit code on every rank (:mod:`nxhpc.runtime.ranks`).
Must not: parse arguments of its own, print reports, or import the compiled kernels before the
arguments are parsed (``--help`` runs without a built extension).
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from nxhpc.cli.codes import (Exit, OutOfMemory, OutputError, UsageError, code_for,
                             too_many_open_files)
from nxhpc.runtime.proc import Terminated, cli_signals, soft_limit
from nxhpc.runtime.outfile import written_end, written_mark, written_since

__all__ = ["run_cli", "run_ranked", "error_printer", "signal_exit"]


def error_printer(prog: str) -> Callable[[str], None]:
    """``err(msg)``: one ``PROG: error: msg`` line on stderr, flushed; nothing where stderr is
    closed or cannot be written (the exit code still says what happened)."""
    def err(msg: str) -> None:
        if sys.stderr is None:            # print(file=None) would write to stdout
            return
        try:
            print(f"{prog}: error: {msg}", file=sys.stderr, flush=True)
        except (OSError, ValueError):
            pass
    return err


def _argparse_code(e: SystemExit) -> int:
    """The exit code of argparse's ``SystemExit``: ``--help`` 0, a usage error 2."""
    return int(e.code or 0) if not isinstance(e.code, str) else int(Exit.USAGE)


def _ranked_parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None,
                  intermixed: bool, ranks: Any, prog: str) -> argparse.Namespace | int:
    """Parse on one of several MPI ranks: the namespace, or the exit code every rank returns,
    with argparse's text printed once for the job. Every rank parses, then all exchange what
    argparse said (one ``allgather``, which every rank reaches first thing): if no rank's
    parse ended, each goes on; else each rank returns the highest code (a usage error, 2,
    over ``--help``, 0) and each distinct message is printed by the lowest rank that has it.
    So the same bad arguments on every rank print one usage and one error, not one a rank; a
    usage error of one rank's arguments alone is printed, by that rank; and ``--help`` on
    some ranks only ends the job (it hung: the others waited for those ranks). The exchange
    is bounded by the rank's own ``--stage-timeout`` where the command has one (a peer that
    never reaches it: exit 6, this rank's error)."""
    import contextlib
    import io

    from nxhpc.runtime.ranks import ExchangeTimeoutError
    out, errs = io.StringIO(), io.StringIO()
    args, code = None, None
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(errs):
            args = parser.parse_intermixed_args(argv) if intermixed else parser.parse_args(argv)
    except SystemExit as e:
        code = _argparse_code(e)
    said = None if code is None else (code, out.getvalue(), errs.getvalue())
    if args is not None:                      # the startup waits from here on: this rank's
        ranks.timeout = getattr(args, "stage_timeout", None)     # --stage-timeout
    try:
        every = ranks.allgather(said, "the command-line check")
    except ExchangeTimeoutError as e:         # a peer never reached it (stuck, stopped)
        return _ranked_failure(e, ranks, _ranked_printer(prog, ranks, error_printer(prog)),
                               None)
    ended = [s for s in every if s is not None]
    if not ended:
        return args
    if said is not None and every.index(said) == ranks.rank:
        _write_all([(sys.stdout, said[1]), (sys.stderr, said[2])])
    return max(c for c, _, _ in ended)


def _write_all(texts: list) -> None:
    """Each ``(stream, text)`` written and flushed; nothing where a stream is closed or full."""
    for stream, value in texts:
        if value and stream is not None:
            try:
                stream.write(value)
                stream.flush()
            except (OSError, ValueError):
                pass


def _print_traceback() -> None:
    """The current exception's traceback on stderr; nothing where stderr is closed or full."""
    if sys.stderr is None:
        return
    try:
        traceback.print_exc(file=sys.stderr)
    except (OSError, ValueError):
        pass


def run_cli(prog: str, parser: argparse.ArgumentParser, argv: Sequence[str] | None,
            call: Callable[[argparse.Namespace], int], *, intermixed: bool = False,
            describe: Callable[[BaseException, Exit], str] | None = None,
            ranks: Any = None, parse_ranks: Any = None) -> int:
    """``call(args)`` for the parsed ``argv``, returning the exit code (see the module
    docstring). ``describe(e, code)`` words an expected failure (default ``str(e)``; a worker
    failure is prefixed ``worker failure:``). ``ranks``: the MPI world (see
    :func:`run_ranked`). ``parse_ranks``: a world for the argument check only (a command that
    runs MPI its own way, ``ddp``): argparse's text once for the job, the rest as one process."""
    if ranks is not None or parse_ranks is not None:
        args = _ranked_parse(parser, argv, intermixed,
                             ranks if ranks is not None else parse_ranks, prog)
        if isinstance(args, int):
            _flush_or_drop_both()
            return args
    else:
        try:
            args = parser.parse_intermixed_args(argv) if intermixed else parser.parse_args(argv)
        except SystemExit as e:                   # argparse: --help -> 0, usage errors -> 2
            _flush_or_drop_both()                 # `--help | head`: quiet, exit 0
            return _argparse_code(e)
    err = error_printer(prog)
    if ranks is not None:
        err = _ranked_printer(prog, ranks, err)
    mark, bus = _arena_mark(), False
    out_mark = written_mark()
    with cli_signals() as sig, _guarded_stdout():
        try:
            try:
                bus = _sigbus_exit(prog)     # in here: a bad NXHPC_* setting met on import is mapped
                code = call(args)
                _flush_stdout()              # buffered output's errors (`| head`, a full disk)
                #                              surface here, not in the interpreter's flush at exit
            except Exception as e:       # KeyboardInterrupt / Terminated are not Exceptions
                interrupt = sig.interrupt()
                if interrupt is not None:  # a Ctrl-C that C code (numpy's tofile) turned into e
                    raise interrupt from e
                if isinstance(e, BrokenPipeError) and _stdout_closed():
                    return int(Exit.OUTPUT)  # the reader went away (`| head`): nothing to say
                e = _environment_error(e)
                if ranks is not None:
                    return _ranked_failure(e, ranks, err, describe)
                known = code_for(e)
                if known is None:
                    _print_traceback()
                    err("internal error (see the traceback above)")
                    return int(Exit.INTERNAL)
                if getattr(e, "said_by_rank_0", False):   # a job's error rank 0 prints
                    return int(known)
                if too_many_open_files(e):
                    err(_open_files_text(e))
                elif describe is not None:
                    err(describe(e, known))
                else:
                    err(f"worker failure: {e}" if known == Exit.WORKER else str(e))
                return int(known)
            interrupt = sig.interrupt()     # a signal C code turned into a failure it returned
            if code not in (Exit.PASS, Exit.FAIL) and interrupt is not None:
                raise interrupt
            return int(code)
        except (KeyboardInterrupt, Terminated) as e:
            code, what = signal_exit(e)
            err(f"{what}; workers stopped, shared memory released{_written_before(out_mark)}")
            return int(code)
        finally:
            written_end(out_mark)          # forget this call's writes, stop recording
            _sigbus_exit(None, bus)
            _cleanup(mark)
            _flush_or_drop_both()         # every path (an error after a print, Ctrl-C): the
            #                               code above stands, not the exit flush's 120


def signal_exit(e: BaseException) -> tuple[Exit, str]:
    """The exit code and words of a signal's exception: KeyboardInterrupt (SIGINT) or
    :class:`~nxhpc.runtime.proc.Terminated` (SIGTERM, SIGHUP)."""
    if not isinstance(e, Terminated):
        return Exit.SIGINT, "interrupted (SIGINT)"
    if e.signum == signal.SIGHUP:
        return Exit.SIGHUP, "hung up (SIGHUP: the terminal or session closed)"
    return Exit.SIGTERM, "terminated (SIGTERM)"


def _written_before(mark: int) -> str:
    """``; written before it: PATHS`` for the outputs a call completed before a signal ended it
    (the exit code says interrupted; those files are whole and new), or nothing."""
    done = written_since(mark)
    if not done:
        return ""
    shown = ", ".join(done[:5]) + (f" and {len(done) - 5} more" if len(done) > 5 else "")
    return f"; written before it (complete): {shown}"


def _stdout_closed() -> bool:
    """Whether stdout's reader has gone (a pipe whose other end closed, as ``| head`` does);
    if so, stdout is pointed at /dev/null, so that the interpreter's flush at exit does not
    fail again with a second traceback."""
    try:                                      # a pipe whose reader closed polls as an error
        import select
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        if not any(ev & select.POLLERR for _, ev in poller.poll(0)):
            return False                      # another pipe broke (e.g. a worker's)
    except (OSError, ValueError, AttributeError):
        return False
    _to_devnull(sys.stdout)
    return True


def _flush_stdout() -> None:
    """Flush stdout (the guarded stream: its errors raised as in a write); a stdout that is
    None or already closed has nothing to flush."""
    flush = getattr(sys.stdout, "flush", None)   # None, or a caller's write-only stream
    try:
        if flush is not None:
            flush()
    except ValueError:                        # flush of closed file
        pass


#: errnos of a momentarily full non-blocking pipe: not a stream that is gone
_TRANSIENT = (errno.EAGAIN, errno.EWOULDBLOCK)


def _or_drop(stream: Any, act: Callable[[], object]) -> None:
    """``act()`` (a write or flush of ``stream``), never raising. A stream that cannot take it
    (a reader gone, a full disk, an I/O error; not a momentarily full non-blocking pipe) is
    pointed at /dev/null, so that the interpreter's flush at exit does not fail again
    ("Exception ignored ...", exit 120) after the frame has answered; its error was reported
    (stdout: exit 8) or is unreportable (stderr)."""
    try:
        act()
    except OSError as e:
        if e.errno not in _TRANSIENT:
            _to_devnull(stream)
    except Exception:  # noqa: BLE001 - a closed file (ValueError), a caller's odd stream
        pass


def _flush_or_drop(stream: Any) -> None:
    """Flush ``stream`` at the end of a call (:func:`_or_drop`). A stream without flush,
    closed, or None is left alone."""
    flush = getattr(stream, "flush", None)
    if flush is not None:
        _or_drop(stream, flush)


def write_or_drop(stream: Any, text: str) -> None:
    """Write ``text`` to ``stream`` and flush it, never raising (:func:`_or_drop`): what a
    command prints before any work (the ``nxhpc`` command table) into a reader that is gone or
    a full disk is dropped as argparse's ``--help`` is in :func:`run_cli`, and the caller's
    exit code stands."""
    _or_drop(stream, lambda: stream.write(text))
    _flush_or_drop(stream)


def _flush_or_drop_both() -> None:
    _flush_or_drop(sys.stdout)
    _flush_or_drop(sys.stderr)


def _to_devnull(stream: Any) -> None:
    """Point ``stream``'s file descriptor at /dev/null (nothing if it has none): what is still
    buffered for a stream that cannot take it (a reader gone, a full disk) is dropped at exit
    instead of failing the interpreter's flush there ("Exception ignored ...", exit 120) after
    the error was reported."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


class StdoutError(OSError):
    """Writing or flushing stdout failed (a full disk, /dev/full, an I/O error): raised in
    place of that OSError while a CLI call runs, so that it is told apart from the others."""


class _GuardedStdout:
    """stdout as a CLI call sees it: the same stream, its write / flush errors (a reader gone
    aside: ``| head`` is told apart by :func:`_stdout_closed`) raised as :class:`StdoutError`."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def write(self, s: str) -> int:
        try:
            try:
                return self._inner.write(s)
            except UnicodeEncodeError:      # a path the stream's encoding cannot hold
                enc = getattr(self._inner, "encoding", None) or "utf-8"
                return self._inner.write(s.encode(enc, "backslashreplace").decode(enc))
        except BrokenPipeError:
            raise
        except OSError as e:
            raise StdoutError(e.errno, e.strerror) from None

    def flush(self) -> None:
        flush = getattr(self._inner, "flush", None)   # a caller's write-only stream: nothing
        if flush is None:
            return
        try:
            flush()
        except BrokenPipeError:
            raise
        except OSError as e:
            raise StdoutError(e.errno, e.strerror) from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


_STDOUT_LOCK = threading.Lock()
_STDOUT_USERS: list[Any] = [0, None]    # calls inside the frame, the stream they wrapped


class _guarded_stdout:
    """``with _guarded_stdout():`` -- ``sys.stdout`` wrapped in :class:`_GuardedStdout` while
    any CLI call (of any thread) runs, the caller's stream put back when the last one leaves
    (if nothing else replaced it meanwhile)."""

    def __enter__(self) -> None:
        with _STDOUT_LOCK:
            if _STDOUT_USERS[0] == 0 and sys.stdout is not None \
                    and not isinstance(sys.stdout, _GuardedStdout):
                _STDOUT_USERS[1] = sys.stdout
                sys.stdout = _GuardedStdout(sys.stdout)
            _STDOUT_USERS[0] += 1

    def __exit__(self, *exc: object) -> None:
        with _STDOUT_LOCK:
            _STDOUT_USERS[0] -= 1
            if _STDOUT_USERS[0] == 0 and _STDOUT_USERS[1] is not None:
                if isinstance(sys.stdout, _GuardedStdout) and \
                        sys.stdout._inner is _STDOUT_USERS[1]:
                    sys.stdout = _STDOUT_USERS[1]
                _STDOUT_USERS[1] = None


def _import_out_of_memory(e: Exception) -> bool:
    """An ImportError of a compiled module the loader could not map for want of memory (PIL's
    or tokenizers' under ``ulimit -v``: "failed to map segment from shared object"), not a
    module that is missing."""
    text = str(e)
    if not isinstance(e, ImportError) or "failed to map segment" not in text:
        return False
    if "Cannot allocate memory" in text:
        return True
    # no errno text (newer glibc): only where an address-space / data limit is set; a noexec
    # mount ("Operation not permitted") is not memory
    return ": " not in text.split("failed to map segment", 1)[1] and (
        soft_limit("RLIMIT_AS") != "unlimited" or soft_limit("RLIMIT_DATA") != "unlimited")


def _environment_error(e: Exception) -> Exception:
    """``e``, or the usage / output error it stands for when the cause is the environment:
    stdout that cannot be written (exit 8), memory that could not be had (a MemoryError or
    ENOMEM: exit 7, with the address-space limit), a working directory removed under a
    relative path or a path too long to look up (ENAMETOOLONG; exit 2)."""
    if isinstance(e, StdoutError):
        if e.errno not in _TRANSIENT:
            _to_devnull(sys.stdout)
        return OutputError(f"standard output could not be written ({e.strerror or e})")
    from nxhpc.runtime.shm import ShmSpaceError
    if isinstance(e, ShmSpaceError):     # its own message already names what, needed and free
        return e
    if isinstance(e, MemoryError) or (isinstance(e, OSError) and e.errno == errno.ENOMEM) \
            or _import_out_of_memory(e):
        what = str(e).strip() or type(e).__name__
        return OutOfMemory(f"out of memory ({what[:200]}): the address-space limit (ulimit -v) "
                           f"is {_as_limit('RLIMIT_AS')}, the data limit (ulimit -d) "
                           f"{_as_limit('RLIMIT_DATA')}; use a smaller image or model, fewer "
                           f"workers, or raise the limit (or free the machine's memory)")
    if isinstance(e, OSError) and e.errno == errno.ENAMETOOLONG:   # a path given, too long to
        name = os.fsdecode(e.filename) if e.filename is not None else None    # look up at all
        shown = ("a path" if not name else name if len(name) <= 120
                 else f"{name[:80]}... ({len(os.fsencode(name))} bytes)")
        return UsageError(f"{shown}: {e.strerror} (a name in a path holds at most 255 bytes, "
                          f"a whole path 4095); give a shorter path")
    if isinstance(e, FileNotFoundError) and e.filename is None:
        try:
            os.getcwd()
        except FileNotFoundError:
            return UsageError("the current directory no longer exists (it was removed after "
                              "this process entered it), so a relative path cannot be "
                              "resolved: give absolute paths, or run from an existing "
                              "directory")
    return e


def _as_limit(name: str) -> str:
    """This process's soft limit ``name`` (RLIMIT_AS, RLIMIT_DATA) in words: bytes as GiB, or
    unlimited."""
    v = soft_limit(name)
    return f"{int(v) / 2 ** 30:.2f} GiB" if v.isdigit() else v


def _open_files_text(e: OSError) -> str:
    return (f"too many open files ({e.strerror or e}): the limit on open files (ulimit -n) is "
            f"{soft_limit('RLIMIT_NOFILE')}; each worker takes two pipes -- raise it (e.g. ulimit -n 4096) or run "
            f"fewer workers")


def _ranked_printer(prog: str, ranks: Any, err: Callable[[str], None]) -> Callable[[str], None]:
    """``err`` of a rank: a signal's line from rank 0 only (every rank got the signal)."""
    def ranked_err(msg: str) -> None:
        if msg.startswith("terminated"):
            if ranks.rank == 0:
                err(f"{ranks.label}: terminated (SIGTERM: mpirun ends every rank when one dies "
                    f"or the job is cancelled); workers stopped, shared memory released"
                    + (msg[msg.index("; written before it"):]
                       if "; written before it" in msg else ""))
        elif ranks.rank == 0 or not msg.startswith(("interrupted", "hung up")):
            err(msg)
    return ranked_err


@contextlib.contextmanager
def on_every_rank(ranks: Any, *kinds: type[BaseException]) -> Iterator[None]:
    """Errors (of ``kinds``; any by default) raised inside come from values every rank holds
    alike (checked model files, broadcast inputs, the same bits of a split call), so every
    rank raises them at once: marked ``collective``, rank 0 alone prints the one error and no
    rank waits for another."""
    try:
        yield
    except Exception as e:
        if ranks is not None and isinstance(e, kinds or (Exception,)):
            e.collective = True          # type: ignore[attr-defined]
        raise


def _ranked_failure(e: Exception, ranks: Any, err: Callable[[str], None],
                    describe: Callable[[BaseException, Exit], str] | None) -> int:
    """The code of a rank's failure: a peer's (nothing printed; acknowledged), a failure
    every rank saw at once (printed by rank 0), or this rank's own (printed here, naming the
    rank, then sent to every peer)."""
    from nxhpc.runtime.ranks import RankFailedError
    if isinstance(e, RankFailedError):
        ranks.acknowledge(e)
        return int(e.code)
    known = code_for(e)
    if known is None:
        _print_traceback()
        msg = f"internal error: {type(e).__name__}: {e} (see the traceback above)"
        known = Exit.INTERNAL
    elif describe is not None:
        msg = describe(e, known)
    else:
        own = known == Exit.WORKER and type(e).__module__ != "nxhpc.runtime.ranks"
        msg = f"worker failure: {e}" if own else str(e)
    if getattr(e, "collective", False):
        if ranks.rank == 0:
            err(msg)
        return int(known)
    # this rank's own failure: sent to every peer first; a lower rank that failed the same way
    # at the same time (a model every rank misses) has printed it already
    also = ranks.fail(int(known), f"{ranks.label}: {msg}")
    if not any(k < ranks.rank and m.split(": ", 1)[-1] == msg for k, m in also):
        err(f"{ranks.label}: {msg}")
        try:                                # out before any peer may leave (mpirun ends us)
            sys.stderr.flush()
        except (OSError, ValueError, AttributeError):
            pass
    ranks.printed(also)                     # the peers waiting for this line may leave now
    return int(known)


def run_ranked(prog: str, parser: argparse.ArgumentParser, argv: Sequence[str] | None,
               call: Callable[[argparse.Namespace, Any], int], **options: Any) -> int:
    """:func:`run_cli` of ``call(args, ranks)`` for a command that may run as MPI ranks.

    One rank (no MPI launcher): exactly ``run_cli`` with ``ranks`` None, and mpi4py is never
    imported. Several: ``ranks`` is the :class:`~nxhpc.runtime.ranks.Ranks` world; the exit
    code is rank 0's on every rank; a rank's failure is printed once (by that rank, naming
    it) and every other rank exits with its code, printing nothing; a signal's line comes
    from rank 0. A failed rank leaves with ``os._exit`` (its peers may be gone: MPI_Finalize
    could wait for them forever), after the frame released its workers and arena."""
    from nxhpc.runtime import ranks as _ranks
    if not _ranks.mpi_launched():
        return run_cli(prog, parser, argv, lambda args: call(args, None), **options)
    try:
        world = _ranks.init_world()
    except ImportError as e:
        error_printer(prog)(str(e))
        return int(Exit.USAGE)
    if world is None:
        return run_cli(prog, parser, argv, lambda args: call(args, None), **options)

    def ranked_call(args: argparse.Namespace) -> int:
        code = int(call(args, world))
        return int(world.bcast(code, "the exit code", bounded=False))   # rank 0 may decode

    code = run_cli(prog, parser, argv, ranked_call, ranks=world, **options)
    if world.failed or code not in (Exit.PASS, Exit.FAIL, Exit.USAGE):
        for stream in (sys.stdout, sys.stderr):   # os._exit skips the interpreter's flush
            try:
                if stream is not None:
                    stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)
    return code


_SIGBUS_LOCK = threading.Lock()
_SIGBUS_USERS = [0]          # CLI calls (threads) inside the frame with the handler installed


def _sigbus_exit(prog: str | None, installed: bool = True) -> bool:
    """A SIGBUS in this process -- a read of a mapped model file past its end, the file
    truncated or rewritten in place during the run -- becomes one line and exit 4 (C handler:
    ``nxhpc._kernels.sigbus_exit``); it was a silent crash (exit 135 in a shell). Shared memory
    is unlinked as soon as it is made, so nothing is left behind. Skipped where the extension
    is not built (then nothing is mapped either). Returns whether it was installed.
    ``prog=None`` (with the ``installed`` of that call): one call leaves the frame; the action
    from before comes back when the last of overlapping calls (threads) has left."""
    if prog is None:
        loaded = sys.modules.get("nxhpc._kernels")     # not loaded: nothing was installed
        if loaded is not None and installed:
            with _SIGBUS_LOCK:
                _SIGBUS_USERS[0] -= 1
                if _SIGBUS_USERS[0] == 0:
                    loaded.sigbus_exit(None)
        return False
    import nxhpc
    try:
        kernels = nxhpc.kernels()
    except ImportError:
        return False
    with _SIGBUS_LOCK:
        kernels.sigbus_exit(f"{prog}: error: a memory-mapped file lost its pages while the run "
                            f"read it (SIGBUS): a model file was truncated or replaced in place "
                            f"during the run; nothing was written\n", int(Exit.BAD_INPUT))
        _SIGBUS_USERS[0] += 1
    return True


def _arena_mark() -> int | None:
    shm: Any = sys.modules.get("nxhpc.runtime.shm")   # not imported yet: every arena is new
    return shm.arena_mark() if shm is not None else None


def _cleanup(mark: int | None) -> None:
    """Release the named arenas this call made in this thread (``mark``: :func:`_arena_mark`
    at its start) -- never the caller's own, nor another thread's call's."""
    shm: Any = sys.modules.get("nxhpc.runtime.shm")   # never imported -> nothing to release
    if shm is not None:
        shm.cleanup_since(mark or 0, threading.get_ident())
