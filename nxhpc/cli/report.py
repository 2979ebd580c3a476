"""The report writer of every nxhpc CLI: ``key=value`` lines or one ``--json`` object, atomic
result files, and the verdict line printed last.

Owns :func:`kv_lines` / :func:`print_kv` (one ``key=value`` per line, values through a
formatter), :func:`print_json` (strict JSON: NaN/inf become null), :func:`save_npy` and
:func:`save_bytes` (atomic writes via :mod:`nxhpc.runtime.outfile`, returning the error text
instead of raising) and :func:`emit_graded` (the graded report of ``blockrun``/``denoise``: the
report comes first and always, so a failing save cannot cost the verdict); for the picture
commands (``decode``, ``generate``) the peak resident sets (:func:`peak_rss_mb`), the PNG text
chunks of a run (:func:`png_text`).
Must not: compute grades (``nxhpc.dit.grade``), choose exit codes, or import the kernels.
"""
from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import IO, Any

from nxhpc.runtime.outfile import write_atomic

__all__ = ["fmt_value", "fmt_compact", "kv_lines", "flush_stdout", "print_kv", "print_json",
           "save_npy", "save_bytes",
           "emit_graded", "peak_rss_mb", "png_text"]


def fmt_value(v) -> str:
    """A report value as printed in ``key=value`` lines (``nxhpc.dit.grade.fmt_value``)."""
    from nxhpc.dit.grade import fmt_value as f
    return f(v)


def fmt_compact(v) -> str:
    """The compact ``key=value`` style of ``sample``: a dict as ``a=b a=b``, a list
    comma-separated (floats ``%g``), a float ``%.6g``, anything else ``str``."""
    if isinstance(v, dict):
        return " ".join(f"{a}={b}" for a, b in v.items())
    if isinstance(v, list):
        return ",".join(f"{x:g}" if isinstance(x, float) else str(x) for x in v)
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def kv_lines(report: Mapping[str, Any], fmt: Callable[[Any], str] = fmt_value) -> list[str]:
    """One ``key=value`` line per entry; a value with a line break in it is quoted
    (``nxhpc.dit.grade.one_line``: an ``--out`` path with a newline forged a line)."""
    from nxhpc.dit.grade import one_line
    return [f"{k}={one_line(fmt(v))}" for k, v in report.items()]


def flush_stdout() -> None:
    """Flush stdout, if there is one (a process started with it closed has ``sys.stdout``
    None: print() writes nothing there, and this does nothing)."""
    if sys.stdout is not None:
        sys.stdout.flush()


def print_kv(report: Mapping[str, Any], fmt: Callable[[Any], str] = fmt_value) -> None:
    for line in kv_lines(report, fmt):
        print(line)


def print_report(report: Mapping[str, Any], as_json: bool) -> None:
    """An ungraded command's report on stdout: one JSON object, or compact key=value lines;
    flushed (a report is the last thing a command prints)."""
    if as_json:
        print_json(report)
    else:
        print_kv(report, fmt_compact)
    flush_stdout()


def print_json(obj: Mapping[str, Any]) -> None:
    """One strict JSON object on stdout (NaN/Infinity -> null)."""
    from nxhpc.dit.grade import json_safe
    print(json.dumps(json_safe(dict(obj)), allow_nan=False))


def save_bytes(path: str | os.PathLike, write: Callable[[IO[bytes]], None], what: str,
               noun: str, keep: str = "an existing file at that path is unchanged") -> str | None:
    """``write_atomic(path, write)``; the error text (``WHAT PATH: could not write NOUN: why;
    KEEP``) or None."""
    try:
        write_atomic(path, write)
    except OSError as e:
        return f"{what} {path}: could not write {noun}: {e.strerror or e}; {keep}"
    return None


def npy_bytes(array) -> bytes:
    """``array`` as float32 ``.npy`` bytes, made in memory: ``np.save`` into a file writes the
    header and then asks the file for its position, which a pipe or FIFO has not ("obtaining
    file position failed" after the whole run, the header alone in the pipe)."""
    import io

    import numpy as np
    buf = io.BytesIO()
    np.save(buf, np.asarray(array).astype(np.float32, copy=False))
    return buf.getvalue()


def save_npy(path: str | os.PathLike, array, what: str, noun: str = "the output",
             **kw) -> str | None:
    """Save ``array`` as float32 ``.npy`` at exactly ``path`` (np.save would add ``.npy``); a
    pipe, a FIFO or a device too (written whole, :func:`npy_bytes`)."""
    data = npy_bytes(array)
    return save_bytes(path, lambda f: f.write(data), what, noun, **kw)


def emit_graded(report: Mapping[str, Any], *, as_json: bool, grade=None, verdict: str,
                text_lines: Iterable[str] = (), json_extra: Mapping[str, Any] | None = None,
                save: Callable[[], str | None] | None = None, saved_path=None) -> str | None:
    """Print ``report`` then the grade (``nxhpc.dit.grade.Grade`` or None = UNGRADED), the
    save's outcome and the ``verdict`` line. key=value: the report, ``text_lines``, the grade
    lines, ``saved_output=`` after ``save()`` succeeded, the verdict. JSON: the report,
    ``saved_output`` / ``save_error``, the grade's fields (or ``verdict: UNGRADED``),
    ``json_extra``, ``verdict_line``. Returns the save's error text, or None."""
    save_error = None
    if as_json:
        obj = dict(report)
        if save is not None:
            save_error = save()
            obj["saved_output"] = None if save_error else str(saved_path)
            if save_error:
                obj["save_error"] = save_error
        if grade is not None:
            obj.update(grade.as_dict())
        else:
            obj["verdict"] = "UNGRADED"
        obj.update(json_extra or {})
        obj["verdict_line"] = verdict
        print_json(obj)
    else:
        unprinted = None
        try:
            print_kv(report)
            for line in text_lines:
                print(line)
            if grade is not None:
                for line in grade.lines():
                    print(line)
            flush_stdout()
        except OSError as e:       # stdout full or gone: the result file is written all the
            unprinted = e          # same (as in JSON mode), then the stdout error stands
        if save is not None:
            save_error = save()
            if save_error is None and unprinted is None:
                print(kv_lines({"saved_output": str(saved_path)})[0])
        if unprinted is not None:
            raise unprinted
        print(verdict)
    flush_stdout()
    return save_error


def peak_rss_mb() -> dict[str, float | None]:
    """MB (10^6 bytes, as :mod:`nxhpc.runtime.memory`): this process's peak resident set
    (``VmHWM``: this program's own, from its exec on) and the largest of its finished
    children's (the workers, once reaped; ``getrusage``'s ``ru_maxrss``, which Linux gives in
    KiB). ``ru_maxrss`` of the process itself is not used: a process started by a larger one
    (``subprocess`` from a test runner or a notebook) inherits that parent's peak in it."""
    import resource

    from nxhpc.runtime.memory import peak_rss_mb as vm_hwm_mb
    own = vm_hwm_mb()
    if own is None:            # no /proc: getrusage's own peak, the best there is
        own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 / 1e6
    return {"peak_rss_mb": round(own, 1), "worker_peak_rss_mb": round(kids, 1) or None}


def png_text(**fields) -> dict[str, str]:
    """The PNG text chunks of a run: every field given (None dropped) as a string, plus
    ``software`` (nxhpc and its version)."""
    import nxhpc
    out = {k: str(v) for k, v in fields.items() if v is not None}
    out["software"] = f"nxhpc {nxhpc.__version__}"
    return out
