"""The frame every nxhpc CLI's ``main`` runs in: parse, call under the signal frame, map errors.

Owns :func:`run_cli`: argparse's exits (``--help`` 0, usage 2) returned, not raised; SIGINT ->
130 and SIGTERM -> 143 with one line (via :class:`nxhpc.runtime.proc.cli_signals`, so a Ctrl-C
that C code turned into another exception still exits as the interrupt); an expected library
exception -> its code from :func:`nxhpc.cli.codes.code_for` with one ``PROG: error: ...`` line;
anything else -> a traceback and 70; the shared-memory registry swept on every path.
Must not: parse arguments of its own, print reports, or import the compiled kernels.
"""
from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from nxhpc.cli.codes import Exit, code_for, too_many_open_files
from nxhpc.runtime.proc import Terminated, cli_signals

__all__ = ["run_cli", "error_printer"]


def error_printer(prog: str) -> Callable[[str], None]:
    """``err(msg)``: one ``PROG: error: msg`` line on stderr, flushed."""
    def err(msg: str) -> None:
        print(f"{prog}: error: {msg}", file=sys.stderr, flush=True)
    return err


def run_cli(prog: str, parser: argparse.ArgumentParser, argv: Sequence[str] | None,
            call: Callable[[argparse.Namespace], int], *, intermixed: bool = False,
            describe: Callable[[BaseException, Exit], str] | None = None) -> int:
    """``call(args)`` for the parsed ``argv``, returning the exit code (see the module
    docstring). ``describe(e, code)`` words an expected failure (default ``str(e)``; a worker
    failure is prefixed ``worker failure:``)."""
    try:
        args = parser.parse_intermixed_args(argv) if intermixed else parser.parse_args(argv)
    except SystemExit as e:                   # argparse: --help -> 0, usage errors -> 2
        return int(e.code or 0) if not isinstance(e.code, str) else Exit.USAGE
    err = error_printer(prog)
    with cli_signals() as sig:
        try:
            try:
                code = call(args)
            except Exception as e:       # KeyboardInterrupt / Terminated are not Exceptions
                interrupt = sig.interrupt()
                if interrupt is not None:  # a Ctrl-C that C code (numpy's tofile) turned into e
                    raise interrupt from e
                known = code_for(e)
                if known is None:
                    traceback.print_exc()
                    err("internal error (see the traceback above)")
                    return int(Exit.INTERNAL)
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
        except KeyboardInterrupt:
            err("interrupted (SIGINT); workers stopped, shared memory released")
            return int(Exit.SIGINT)
        except Terminated:
            err("terminated (SIGTERM); workers stopped, shared memory released")
            return int(Exit.SIGTERM)
        finally:
            _cleanup()


def _open_files_text(e: OSError) -> str:
    try:
        import resource
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        limit = "unlimited" if soft == resource.RLIM_INFINITY else str(soft)
    except (ImportError, OSError, ValueError):
        limit = "unknown"
    return (f"too many open files ({e.strerror or e}): the limit on open files (ulimit -n) is "
            f"{limit}; each worker takes two pipes -- raise it (e.g. ulimit -n 4096) or run "
            f"fewer workers")


def _cleanup() -> None:
    shm: Any = sys.modules.get("nxhpc.runtime.shm")   # never imported -> nothing to release
    if shm is not None:
        shm.cleanup_all()
