"""The exit codes of every nxhpc CLI: one enum, one exception -> code table, the help text.

Owns :class:`Exit` (one number per condition, the same in ``blockrun``, ``denoise``,
``sample``, ``models`` and ``ddp``), the CLI-side error classes (:class:`UsageError`,
:class:`NotFound`, :class:`InputError`, :class:`OutputError`), :func:`code_for` (the
exception -> code table) and :func:`codes_epilog` (the "exit codes:" block of a ``--help``,
listing only the codes that CLI can return, each in that CLI's words).
Must not: import the compiled kernels, numpy or any model code (the table names library
exception classes by module and name, and only consults modules already imported).
"""
from __future__ import annotations

import enum
import sys
import textwrap
from collections.abc import Mapping

__all__ = ["Exit", "DEFAULT_TEXT", "UsageError", "NotFound", "InputError", "OutputError",
           "OutOfMemory", "code_for", "codes_epilog", "too_many_open_files"]


class Exit(enum.IntEnum):
    """One number per condition, in every CLI."""
    PASS = 0            # ok / within tolerance / written
    FAIL = 1            # graded fail, NaN/inf outputs, a --sweep mismatch, Q16 overflow
    USAGE = 2           # bad arguments (argparse's own code)
    NOT_FOUND = 3       # model (or VAE directory) not found
    BAD_INPUT = 4       # malformed / unsupported model file or input array
    MISSING = 5         # a fixture or tensor is missing
    WORKER = 6          # a worker process failed (raised, crashed, killed, hung)
    SHM = 7             # not enough shared memory (or memory: an allocation failed)
    OUTPUT = 8          # a result file could not be written (the old file is unchanged)
    MODELS_DIR = 9      # the models directory cannot take the model
    INTERNAL = 70       # a bug (EX_SOFTWARE)
    SIGHUP = 129        # 128 + SIGHUP
    SIGINT = 130        # 128 + SIGINT
    SIGTERM = 143       # 128 + SIGTERM


#: The generic wording of each code (a CLI's ``--help`` may say it in its own terms).
DEFAULT_TEXT: dict[Exit, str] = {
    Exit.PASS: "ok",
    Exit.FAIL: "graded fail: an output above the tolerance, or NaN/inf outputs",
    Exit.USAGE: "usage error (bad arguments; also the open-files limit, ulimit -n, reached)",
    Exit.NOT_FOUND: "model not found (id, directory or file), or a built-in id of another kind",
    Exit.BAD_INPUT: "bad input: a malformed or unsupported model file, or an input array that "
                    "does not fit the model (shape, dtype, NaN/inf)",
    Exit.MISSING: "a fixture or tensor is missing from the model",
    Exit.WORKER: "a worker process failed (raised, crashed, was killed, or hung)",
    Exit.SHM: "not enough shared memory: /dev/shm cannot hold the arena, or the memory left "
              "cannot (the message gives the bytes needed and free; in a container use "
              "--shm-size); or an allocation failed (the address-space limit, ulimit -v, or "
              "the machine's memory)",
    Exit.OUTPUT: "a result file could not be written (e.g. disk full); an existing file at "
                 "that path is unchanged",
    Exit.MODELS_DIR: "the models directory ($NXHPC_MODELS / --models-dir) cannot take the "
                     "model: not a directory, not writable, or full (the message names it; "
                     "nothing is left behind)",
    Exit.INTERNAL: "internal error (a bug: please report the traceback)",
    Exit.SIGHUP: "hung up: SIGHUP, the terminal or ssh session closed (workers stopped, shared "
                 "memory released)",
    Exit.SIGINT: "interrupted by Ctrl-C / SIGINT (workers stopped, shared memory released)",
    Exit.SIGTERM: "terminated by SIGTERM (workers stopped, shared memory released)",
}


class UsageError(Exception):
    """Arguments that cannot work (found after parsing, e.g. --layers beyond the model)."""


class NotFound(Exception):
    """A named input that does not exist (e.g. a --decode VAE directory)."""


class InputError(Exception):
    """An input that exists but is unusable (e.g. a fixture of the wrong shape)."""


class OutputError(Exception):
    """A result file that could not be written; the message says what was kept."""


class OutOfMemory(Exception):
    """Memory that could not be had (a MemoryError, a mapping refused with ENOMEM): the
    environment's limit, not a bug."""


# (module, class name, code), most specific first. A class whose module is not imported cannot
# have been raised, so the table never imports anything (the models CLI runs unbuilt).
_TABLE: tuple[tuple[str, str, Exit], ...] = (
    (__name__, "UsageError", Exit.USAGE),
    (__name__, "NotFound", Exit.NOT_FOUND),
    (__name__, "InputError", Exit.BAD_INPUT),
    (__name__, "OutputError", Exit.OUTPUT),
    (__name__, "OutOfMemory", Exit.SHM),
    ("nxhpc.runtime.checks", "InputFileMissing", Exit.USAGE),
    ("nxhpc.runtime.proc", "ProcessLimitError", Exit.USAGE),
    ("nxhpc.runtime.checks", "SettingError", Exit.USAGE),
    ("nxhpc.runtime.outfile", "OutputPathError", Exit.USAGE),
    ("nxhpc.dit.stackrun", "StackRangeError", Exit.USAGE),
    ("nxhpc.runtime.checks", "NonFiniteOutputError", Exit.FAIL),
    ("nxhpc.dit.sampler", "NonFiniteOutputError", Exit.FAIL),
    ("nxhpc.train.q16", "Q16OverflowError", Exit.FAIL),
    ("nxhpc.runtime.checks", "CheckError", Exit.BAD_INPUT),
    ("nxhpc.dit.denoiser", "DenoiserInputError", Exit.BAD_INPUT),
    ("nxhpc.qwen3.model", "TextEncoderInputError", Exit.BAD_INPUT),
    ("nxhpc.models.modeldir", "ModelsDirError", Exit.MODELS_DIR),
    ("nxhpc.formats.gguf_io", "ModelNotFoundError", Exit.NOT_FOUND),
    ("nxhpc.formats.gguf_io", "MissingTensorError", Exit.MISSING),
    ("nxhpc.formats.gguf_io", "ModelError", Exit.BAD_INPUT),
    ("nxhpc.runtime.workers", "WorkerError", Exit.WORKER),
    ("nxhpc.train.ddp", "DDPWorkerError", Exit.WORKER),
    ("nxhpc.train.ddp", "DDPTimeoutError", Exit.WORKER),
    ("nxhpc.runtime.shm", "ShmSpaceError", Exit.SHM),
    ("nxhpc.runtime.ranks", "RankMismatchError", Exit.BAD_INPUT),
    ("nxhpc.runtime.ranks", "ExchangeTimeoutError", Exit.WORKER),
    ("nxhpc.runtime.ranks", "RankFailedError", Exit.WORKER),
)


def too_many_open_files(e: BaseException) -> bool:
    """Whether ``e`` is the process (EMFILE) or system (ENFILE) running out of file
    descriptors: the environment's limit (``ulimit -n``), not a bug -- a usage error."""
    import errno
    return isinstance(e, OSError) and e.errno in (errno.EMFILE, errno.ENFILE)


def code_for(e: BaseException) -> Exit | None:
    """The documented exit code for an expected failure; None for anything else (a bug)."""
    if too_many_open_files(e):
        return Exit.USAGE
    for mod, name, code in _TABLE:
        cls = getattr(sys.modules.get(mod), name, None)
        if isinstance(cls, type) and isinstance(e, cls):
            return code
    return None


def codes_epilog(texts: Mapping[Exit, str | None], width: int = 92) -> str:
    """The ``exit codes:`` block of a CLI's ``--help``: the codes in ``texts`` (None = the
    generic :data:`DEFAULT_TEXT`), in order, wrapped at ``width``."""
    lines = ["exit codes:"]
    for code in sorted(texts):
        text = texts[code] or DEFAULT_TEXT[Exit(code)]
        lines.append(textwrap.fill(text, width, initial_indent=f"  {int(code):>3}  ",
                                   subsequent_indent=" " * 7))
    return "\n".join(lines)
