"""Argument checks at the public boundary, one rule each (scikit-learn's ``check_*`` style).

Owns the rules for what a caller may pass to a public entry point (``WorkerPool``,
``BlockEngine``/``run_block``/``run_layers``, ``Denoiser``, ``sample``, the CLIs' argparse types):
counts (:func:`check_count`), worker counts (:func:`check_workers`: an int in ``[1,
max_workers()]``, None = the usable CPUs), seconds (:func:`check_seconds`), choices
(:func:`check_choice`), floating-point arrays of a shape, finite, as C-contiguous float32
(:func:`check_float_array`), input files (:func:`check_input_file`) and ``.npy`` inputs
(:func:`load_npy`), and the one error for a
model output that is not finite (:class:`NonFiniteOutputError`). Each check raises
:class:`CheckError` (a ValueError) or TypeError with a message naming the argument, the rule and
the value. Internal hops below an entry point trust what it checked and say so.
Must not: import numpy at import time (the worker pool imports this module), the compiled
kernels or model code; print; or decide exit codes (``nxhpc.cli`` maps these errors to codes).
"""
from __future__ import annotations

import math
import numbers
import os
from collections.abc import Iterable
from typing import Any

from nxhpc.runtime.workers import as_index, max_workers, usable_cpus   # (workers imports us lazily)

__all__ = ["CheckError", "InputFileMissing", "SettingError", "NonFiniteOutputError",
           "check_input_file", "file_kind",
           "check_bool", "check_count", "check_workers", "check_seconds",
           "check_positive", "check_choice", "check_float_array", "load_npy"]


class CheckError(ValueError):
    """An argument or input array that breaks its rule (the message names it)."""


class InputFileMissing(CheckError):
    """An input file that does not exist (or is a directory): a usage error, not a bad file."""


class SettingError(CheckError):
    """An ``NXHPC_*`` environment setting with a value it does not take (e.g. an unknown
    ``NXHPC_MAX_ISA``): a usage error, raised before any work."""


class NonFiniteOutputError(ArithmeticError):
    """A model returned NaN/inf outputs from finite inputs (an overflow inside the model).

    ``count`` of ``size`` values are not finite; ``output`` is the array itself (None where the
    raiser does not keep it), for a caller that reports or inspects it."""

    def __init__(self, message: str, *, count: int | None = None, size: int | None = None,
                 output: Any = None) -> None:
        super().__init__(message)
        self.count, self.size, self.output = count, size, output


def check_finite_output(out: Any, what: str, why: str, noun: str = "output values") -> Any:
    """``out`` (a numpy array) if every value is finite, else :class:`NonFiniteOutputError`
    with ``out`` attached: "``what``: N of M ``noun`` are NaN/inf (``why``)" -- for a model whose
    inputs were checked finite, so that an overflow inside it is an error, never a silent NaN
    result."""
    import numpy as np                     # not at import time (the module's rule)
    bad = int(out.size - np.count_nonzero(np.isfinite(out)))
    if bad:
        raise NonFiniteOutputError(f"{what}: {bad} of {out.size} {noun} are NaN/inf ({why})",
                                   count=bad, size=out.size, output=out)
    return out




def _is_real(v: Any) -> bool:
    """A real number (int, float, numpy's; not bool)."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def check_count(v: Any, what: str, *, minimum: int = 1, maximum: int | None = None) -> int:
    """``v`` as an int in ``[minimum, maximum]`` (bool and float refused), else CheckError."""
    n = as_index(v)
    hi = "" if maximum is None else f" and <= {maximum}"
    if n is None or n < minimum or (maximum is not None and n > maximum):
        raise CheckError(f"{what} must be an integer >= {minimum}{hi}, got {v!r}")
    return n


def check_workers(v: Any, what: str = "workers") -> int:
    """The one worker-count rule: None -> the usable CPUs; else an int in ``[1, max_workers()]``
    (8x the usable CPUs, at least 64: more only add fork, memory and scheduling cost, and a
    mistyped 100000 would fork until the machine runs out of memory)."""
    if v is None:
        return usable_cpus()
    n = as_index(v)
    top = max_workers()
    if n is None or n < 1:
        raise CheckError(f"{what} must be an integer >= 1, got {v!r}")
    if n > top:
        raise CheckError(f"{what} must be at most {top} (8x the {usable_cpus()} usable CPUs, "
                         f"at least 64: more than that only adds fork, memory and scheduling "
                         f"cost), got {n}")
    return n


def check_bool(v: Any, what: str) -> bool:
    """``v`` as a bool when it is one (numpy's too), else TypeError naming ``what`` (the string
    "False" is true, and None is not False)."""
    import numpy as np
    if not isinstance(v, (bool, np.bool_)):
        raise TypeError(f"{what} must be True or False, got {v!r}")
    return bool(v)


def check_positive(v: Any, what: str) -> float:
    """A positive finite number as float (bool refused), else CheckError."""
    if not _is_real(v) or not math.isfinite(float(v)) or float(v) <= 0:
        raise CheckError(f"{what} must be a positive finite number, got {v!r}")
    return float(v)


def check_seconds(v: Any, what: str = "stage_timeout") -> float | None:
    """None (no limit), or a positive finite number of seconds as float, else CheckError."""
    if v is None:
        return None
    if not _is_real(v) or not math.isfinite(float(v)) or float(v) <= 0:
        raise CheckError(f"{what} must be None or a positive number of seconds, got {v!r}")
    return float(v)


def check_choice(v: Any, choices: Iterable[Any], what: str) -> Any:
    """``v`` if it is one of ``choices``, else CheckError listing them."""
    choices = tuple(choices)
    if isinstance(v, (str, int, float, type(None))) and v in choices:
        return v
    raise CheckError(f"{what} must be one of {choices}, got {v!r}")


def check_float_array(a: Any, what: str, *, ndim: int | None = None,
                      shape: tuple[int | None, ...] | None = None,
                      error: type[Exception] = CheckError):
    """``a`` as a C-contiguous float32 array: floating-point dtype, every value finite, of
    ``ndim`` dimensions and of ``shape`` (None entries match any length) when given. Raises
    ``error`` (a CheckError unless a caller names its own ValueError subclass)."""
    import numpy as np
    arr = np.asarray(a)
    if shape is not None:
        ndim = len(shape)
    if ndim is not None and arr.ndim != ndim or shape is not None and any(
            s is not None and s != n for s, n in zip(shape, arr.shape)):
        want = "x".join("*" if s is None else str(s) for s in shape) if shape else f"{ndim}-d"
        raise error(f"{what}: shape {list(arr.shape)}, expected {want}")
    if arr.dtype.kind != "f":
        raise error(f"{what}: dtype {arr.dtype}, expected a floating-point array")
    bad = int(arr.size - np.count_nonzero(np.isfinite(arr)))
    if bad:
        raise error(f"{what}: {bad} of {arr.size} values are NaN or inf")
    with np.errstate(over="ignore"):
        out = np.ascontiguousarray(arr, dtype=np.float32)
    over = int(out.size - np.count_nonzero(np.isfinite(out)))
    if over:
        raise error(f"{what}: {over} of {arr.size} values are beyond float32's range "
                    f"(|x| > 3.4e38; max |x| {float(np.abs(arr).max()):.3g}); the model "
                    f"computes in float32")
    return out


def file_kind(mode: int) -> str:
    """What a file of ``st_mode`` ``mode`` that is not a regular file is, in words ("a FIFO")."""
    import stat
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "a special file"


def check_input_file(path: str | os.PathLike, what: str, expected: str = "a .npy file") -> str:
    """``path`` as a str if it names an existing regular file (symlinks followed); else
    :class:`InputFileMissing` saying what it is: missing, a directory (``expected`` says what
    was wanted), or a FIFO / device / socket (reading one would block or read nothing: never
    opened)."""
    import stat
    p = os.fspath(path)
    try:
        mode = os.stat(p).st_mode
    except FileNotFoundError:
        raise InputFileMissing(f"{what} {p}: no such file") from None
    except OSError as e:
        raise InputFileMissing(f"{what} {p}: cannot stat: {e.strerror or e}") from None
    if stat.S_ISDIR(mode):
        raise InputFileMissing(f"{what} {p}: is a directory, expected {expected}")
    if not stat.S_ISREG(mode):
        raise InputFileMissing(f"{what} {p}: is {file_kind(mode)}, not a regular file")
    return p


def _size(n: int) -> str:
    for unit, k in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << k:
            return f"{n / (1 << k):.1f} {unit}"
    return f"{n} bytes"


def _too_many_files(e: OSError) -> bool:
    import errno
    return e.errno in (errno.EMFILE, errno.ENFILE)


def load_npy(path: str | os.PathLike, what: str, *, error: type[Exception] = CheckError):
    """One array from the ``.npy`` file ``path``, without pickles. A missing path, a directory
    or a non-regular file (a FIFO, ``/dev/null``) is :class:`InputFileMissing` (a usage error);
    a file that does not hold one readable array is ``error`` (a bad input), checked before
    anything is allocated: a zip (``.npz``) or broken zip, a header that is not numpy's, an
    object dtype, or a header whose shape needs more bytes than the file has (a 242-byte file
    claiming 64 TiB). Running out of file descriptors is re-raised as the OSError it is."""
    import numpy as np
    from numpy.lib import format as npf
    p = check_input_file(path, what)
    size = os.path.getsize(p)
    try:
        with open(p, "rb") as f:
            head = f.read(6)
            if head[:2] == b"PK":
                raise error(f"{what} {p}: not a .npy array: a zip archive (an .npz holds "
                            f"several arrays, or is broken); give one array saved by np.save")
            f.seek(0)
            try:
                version = npf.read_magic(f)
                if version == (1, 0):
                    shape, fortran, dtype = npf.read_array_header_1_0(f)
                else:
                    shape, fortran, dtype = npf.read_array_header_2_0(f)
            except (ValueError, EOFError, SyntaxError, TypeError) as e:
                raise error(f"{what} {p}: not a .npy array (cannot read a .npy array: "
                            f"{e})") from None
            if dtype.hasobject:
                raise error(f"{what} {p}: cannot read a .npy array: dtype {dtype} holds Python "
                            f"objects (never unpickled)")
            need = math.prod(shape) * dtype.itemsize
            have = size - f.tell()
            if need > have:
                raise error(f"{what} {p}: cannot read a .npy array: its header claims shape "
                            f"{list(shape)} {dtype} ({_size(need)}) but the file holds "
                            f"{_size(max(have, 0))} of data")
        return np.load(p, allow_pickle=False)
    except OSError as e:
        if _too_many_files(e):
            raise
        raise error(f"{what} {p}: cannot read a .npy array: {e.strerror or e}") from None
    except (ValueError, EOFError) as e:
        if isinstance(e, error):
            raise
        raise error(f"{what} {p}: cannot read a .npy array: {e}") from None
