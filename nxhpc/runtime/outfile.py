"""Result files written the safe way, for the CLIs (``blockrun --save-output``, ``ddp --json``).

Owns: the up-front check that a path can take a result (:func:`check_output_path`: not a
directory, an existing directory to write in that really accepts a new file, not one of the
run's own input files) and the write itself (:func:`write_atomic`: a temporary sibling, flushed
and fsync'ed, renamed over the target only when complete -- a full disk or an interrupt leaves
the old file as it was and no temporary behind). Must not: decide exit codes or print.
"""
from __future__ import annotations

import errno
import os
import secrets
import stat
import sys
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, Any

__all__ = ["OutputPathError", "check_output_path", "check_cli_output_path", "write_atomic",
           "written_mark", "written_since", "written_end"]

#: The paths this thread's :func:`write_atomic` calls completed, in order: what a CLI
#: interrupted after some of its outputs names as written (the exit code alone said "nothing").
_WRITTEN = threading.local()


def _written() -> list[str]:
    if not hasattr(_WRITTEN, "paths"):
        _WRITTEN.paths = []
        _WRITTEN.depth = 0
    return _WRITTEN.paths


def _record(path: str) -> None:
    """Note a completed write, only inside a CLI frame (a library loop must not grow a list)."""
    paths = _written()
    if _WRITTEN.depth > 0:
        paths.append(path)


def written_mark() -> int:
    """A mark of this thread's completed writes, for :func:`written_since`; starts recording
    until the matching :func:`written_end`."""
    paths = _written()
    _WRITTEN.depth += 1
    return len(paths)


def written_since(mark: int) -> list[str]:
    """The paths this thread's :func:`write_atomic` completed since ``mark`` (and forgets
    them: the record holds one CLI call's writes at a time)."""
    paths = _written()
    done = paths[mark:]
    del paths[mark:]
    return done


def written_end(mark: int) -> None:
    """End the recording :func:`written_mark` started (once per mark)."""
    written_since(mark)
    _WRITTEN.depth = max(0, _WRITTEN.depth - 1)


class OutputPathError(ValueError):
    """The path cannot take the result (the message says why); raised before any work is done."""


def _in_place(path: str) -> bool:
    """Written in place, not replaced: an existing non-regular file (a device, a FIFO), and
    anything under /dev or /proc (``/dev/stdout`` is a link to whatever fd 1 is) but the
    folders of the /dev/shm tmpfs (a scratch folder: replaced atomically as anywhere)."""
    if path.startswith(("/dev/", "/proc/")) and not path.startswith("/dev/shm/"):
        return True
    try:
        return not stat.S_ISREG(os.stat(path).st_mode)      # follows symlinks
    except OSError:
        return False


def _is_stderr(path: str, progress: bool = True) -> bool:
    """Whether ``path`` is the file ``sys.stderr`` writes to and writing it would spoil one
    of the two: a regular file (``2> FILE``; ``/dev/stderr`` reopens and truncates it) always,
    a pipe or socket only where the run's ``progress`` bar is printed there (``ddp --json
    /dev/stderr 2>&1 >/dev/null | jq`` mixes nothing). A terminal or the null device never."""
    try:
        a, b = os.stat(path), os.fstat(sys.stderr.fileno())
    except (OSError, ValueError, AttributeError):
        return False
    if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino) or stat.S_ISCHR(a.st_mode):
        return False
    return stat.S_ISREG(a.st_mode) or progress


def _is_stdout(path: str) -> bool:
    """Whether ``path`` is the file ``sys.stdout`` writes to (``/dev/stdout`` when that is
    fd 1, the file or pipe it is redirected to), the null device aside (``--out /dev/null >
    /dev/null`` mixes nothing). A ``sys.stdout`` without a file (a caller's StringIO) is no
    file."""
    try:
        a, b = os.stat(path), os.fstat(sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):   # no fileno (io.UnsupportedOperation: both)
        return False
    if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
        return False
    try:
        null = os.stat(os.devnull)
    except OSError:
        return True
    return not (stat.S_ISCHR(a.st_mode) and a.st_rdev == null.st_rdev)


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def check_output_path(path: str | os.PathLike, *, what: str = "output",
                      inputs: Iterable[str | os.PathLike] = (),
                      model_files: Iterable[str | os.PathLike] = (),
                      example: str | None = None, report_on_stdout: bool = False,
                      progress_on_stderr: bool = False) -> Path:
    """Check, before the run, that ``path`` can be written as a result file; returns the path
    to write (symlinks followed). Raises :class:`OutputPathError` naming ``what`` and the reason:
    a directory (or a path ending in '/'), a missing directory, a directory that refuses a new
    file (read-only, no permission), or the same file as one of ``inputs`` or of
    ``model_files`` (the files of the model the run opened; hard and symbolic links resolved);
    with ``report_on_stdout`` (a CLI, whose report goes to ``sys.stdout``), also that stream's
    file (:func:`check_cli_output_path`).
    An existing non-regular file (``/dev/null``, a FIFO) and an existing path under /dev or
    /proc (``/dev/stdout``) are written in place if writable. ``example``: the file name the
    message suggests inside a directory given (default by ``what``: ``out.png`` for a PNG,
    ``report.json`` for JSON, else ``out.npy``)."""
    given = str(path)
    if given == "":
        raise OutputPathError(f"{what}: empty path")
    try:
        os.path.abspath(given)
    except FileNotFoundError:        # a relative path with the working directory removed
        raise OutputPathError(f"{what} {given}: the current directory no longer exists (it was "
                              f"removed after this process entered it), so a relative path "
                              f"cannot be resolved: give an absolute path") from None
    try:                             # a name too long, or a loop of symlinks: nothing could be
        os.stat(given)               # written there (a loop's link would be replaced by a file)
    except OSError as e:
        if e.errno in (errno.ENAMETOOLONG, errno.ELOOP):
            shown = given if len(given) <= 120 else f"{given[:80]}... ({len(given)} characters)"
            raise OutputPathError(f"{what} {shown}: {e.strerror}; give another path") from None
    p = Path(given)
    if given.endswith("/") and not p.is_dir():    # Path() drops the slash: a file would be
        #                                             written under the directory's name
        raise OutputPathError(f"{what} {given}: ends with '/', a directory, and there is no "
                              f"such directory; give a file path")
    if report_on_stdout and _is_stdout(given):
        raise OutputPathError(f"{what} {given} is this run's standard output, where its report "
                              f"is printed: the two would mix into one corrupt stream; give a "
                              f"file path")
    if report_on_stdout and _is_stderr(given, progress_on_stderr):
        raise OutputPathError(f"{what} {given} is this run's standard error, where its progress "
                              f"and messages are printed: the two would mix into one corrupt "
                              f"file; give a file path")
    if p.is_dir():
        if example is None:
            low = what.lower()
            example = ("out.png" if "png" in low else "report.json" if "json" in low
                       else "out.npy")
        raise OutputPathError(f"{what} {given} is a directory; give a file path "
                              f"(e.g. {p / example})")
    for src in inputs:
        if src is not None and p.exists() and _same_file(given, str(src)):
            raise OutputPathError(f"{what} {given} is an input of this run ({src}); refusing "
                                  f"to overwrite it")
    for src in model_files:
        if src is not None and p.exists() and _same_file(given, str(src)):
            raise OutputPathError(f"{what} {given} is an input of this run (a file of the "
                                  f"model it opened: {src}); refusing to overwrite it")
    if _in_place(given):
        if p.exists() and not os.access(given, os.W_OK):
            raise OutputPathError(f"{what} {given}: not writable")
        if p.exists():
            return p
    real = Path(os.path.realpath(p))
    parent = real.parent
    if not parent.is_dir():
        raise OutputPathError(f"{what} {given}: directory {parent} does not exist")
    probe = parent / f".{real.name}.probe-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise OutputPathError(f"{what} {given}: cannot create a file in {parent}: "
                              f"{e.strerror}") from None
    os.close(fd)
    os.unlink(probe)
    return real


def check_cli_output_path(path: str | os.PathLike, **kw: Any) -> Path:
    """:func:`check_output_path` for a CLI: its report is printed on stdout, so stdout's own
    file is refused too (``--out /dev/stdout > img.png`` wrote the report over the PNG)."""
    return check_output_path(path, report_on_stdout=True, **kw)


#: Seconds a dead writer's temporary file is left before a later write of the same name
#: removes it (a writer on another host sharing the folder has another pid space).
STALE_TMP_S = 600.0


def _sweep_dead_writers(real: Path) -> None:
    """Remove ``.NAME.tmp-PID-*`` siblings of ``real`` left by writers that died without their
    cleanup (SIGKILL, a crash, power loss): the pid no longer runs here and the file is older
    than :data:`STALE_TMP_S`. Best effort: any error leaves the file."""
    import re
    import time
    shape = re.compile(rf"\.{re.escape(real.name)}\.tmp-([0-9]+)-[0-9a-f]{{8}}")
    try:
        found = [(Path(e.path), m) for e in os.scandir(real.parent)
                 if (m := shape.fullmatch(e.name))]
    except OSError:
        return
    for t, m in found:
        try:
            pid = int(m.group(1))
            st = t.lstat()
            if pid <= 0 or not stat.S_ISREG(st.st_mode) \
                    or time.time() - st.st_mtime < STALE_TMP_S:
                continue
            try:
                os.kill(pid, 0)
                continue                          # a live process (maybe another writer)
            except ProcessLookupError:
                pass
            except PermissionError:
                continue                          # alive, another user's
            t.unlink()
        except (ValueError, OSError):
            continue


def write_atomic(path: str | os.PathLike, write: Callable[[IO[bytes]], None], *,
                 exclusive: bool = False) -> None:
    """``write(f)`` into a temporary sibling of ``path``, fsync, rename over ``path``.

    Any failure (``OSError`` of a full disk, an interrupt) removes the temporary file and
    leaves ``path`` untouched; the temporary files of earlier writers of ``path`` that died
    without that cleanup are removed (:func:`_sweep_dead_writers`). An existing non-regular
    ``path`` (a device, a FIFO) or one under /dev or /proc (``/dev/stdout``) is written in
    place: there is nothing to replace atomically. ``exclusive``: never over an existing
    ``path`` (FileExistsError, the temporary removed): the complete file is linked into place,
    which fails if another process made ``path`` meanwhile (a name a run made up itself).
    """
    if _in_place(str(path)) and os.path.exists(path):
        if exclusive:                     # a device or FIFO there: never written over
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(path))
        with open(path, "wb") as f:
            write(f)
        _record(os.fspath(path))
        return
    real = Path(os.path.realpath(path))
    _sweep_dead_writers(real)
    tmp = real.parent / f".{real.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        with open(tmp, "xb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())          # a full disk must fail here, not after the rename
        if exclusive:
            try:
                os.link(tmp, real)        # EEXIST: another writer took the name meanwhile
            except FileExistsError:
                # NFS: a retried link whose first try succeeded says EEXIST (open(2), O_EXCL):
                # ours if the temporary now has the second link
                if os.stat(tmp).st_nlink != 2:
                    raise
            except OSError:               # no hard links here (vfat, some FUSE): the name
                #                             reserved with O_EXCL (EEXIST as above), then
                #                             replaced: only our own empty placeholder
                os.close(os.open(real, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                                 0o600))
                try:
                    os.replace(tmp, real)
                except BaseException:
                    os.unlink(real)       # the placeholder is ours: nothing left behind
                    raise
        else:
            os.replace(tmp, real)
        _record(os.fspath(path))
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
