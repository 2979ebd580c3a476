"""The argparse types every nxhpc CLI shares: one spelling of each rule, one message.

Owns the ``type=`` callables (:func:`positive_int`, :func:`workers`, :func:`layers`,
:func:`positive_float`, :func:`seconds`, :func:`eps`, :func:`unit_interval`, :func:`pixels`,
:func:`seed`, :func:`int_list`, :func:`grid`): each turns a string into a value or raises
``argparse.ArgumentTypeError`` (exit 2) naming the rule and the text given; the rules themselves
are :mod:`nxhpc.runtime.checks`'. Also the arguments several commands share, spelled once
(:func:`cli_parser`, :func:`add_workers`, :func:`add_precision`, :func:`add_tol`,
:func:`add_models_dir`,
:func:`add_stage_timeout`, :func:`add_json`), and the prompt inputs of ``encode`` and
``generate`` (:func:`read_text_file`, :func:`check_prompt`). Must not: import the compiled
kernels or model code at import time (the ``models`` CLI runs in an unbuilt tree).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from nxhpc.cli.codes import UsageError
from nxhpc.dit.sampler import MAX_PIXELS   # the largest image side (the library's too)
from nxhpc.runtime import checks

__all__ = ["positive_int", "workers", "layers", "positive_float", "seconds", "eps",
           "unit_interval", "pixels", "seed", "int_list", "grid", "workers_help", "cli_parser",
           "add_workers", "precision", "add_precision", "add_q8_float_weights", "add_tol",
           "add_models_dir", "add_stage_timeout", "add_json"]


def _int(s: str, rule: str) -> int:
    try:
        return int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {rule}, got {s!r}") from None


def positive_int(s: str) -> int:
    """An integer >= 1."""
    v = _int(s, "an integer >= 1")
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {s!r}")
    return v


def workers(s: str) -> int:
    """A worker count: :func:`nxhpc.runtime.checks.check_workers`' rule."""
    v = positive_int(s)
    try:
        return checks.check_workers(v, "n_workers")
    except checks.CheckError as e:
        raise argparse.ArgumentTypeError(str(e).replace("n_workers must be ", "")) from None


def workers_help(what: str = "worker processes") -> str:
    from nxhpc.runtime.workers import usable_cpus
    return f"{what} (default: the usable CPUs, here {usable_cpus()})"


def layers(s: str):
    """``all`` or an integer >= 1."""
    return "all" if s == "all" else positive_int(s)


def positive_float(s: str) -> float:
    """A positive finite number."""
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {s!r}") from None
    if not math.isfinite(v) or v <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {s!r}")
    return v


seconds = positive_float
"""Seconds (a positive finite number): the argparse face of ``checks.check_seconds``."""


def eps(s: str) -> float:
    """An RMSNorm eps that float32 holds as a positive normal number."""
    from nxhpc.dit.plan import check_eps
    v = positive_float(s)
    try:
        return check_eps(v)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def unit_interval(s: str) -> float:
    """A number in [0, 1] (a timestep t = 1 - sigma)."""
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {s!r}") from None
    if not (math.isfinite(v) and 0.0 <= v <= 1.0):
        raise argparse.ArgumentTypeError(f"must be in [0, 1] (t = 1 - sigma), got {s!r}")
    return v




def pixels(s: str) -> int:
    """An image side in pixels: a positive multiple of 16 (the VAE's 8x times the 2x2 patch),
    at most :data:`MAX_PIXELS`."""
    v = positive_int(s)
    if v > MAX_PIXELS:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_PIXELS} pixels (1M image tokens "
                                         f"at {MAX_PIXELS} x {MAX_PIXELS}), got {v}")
    if v % 16:
        near = sorted({max(16, (v // 16) * 16), (v // 16 + 1) * 16})
        raise argparse.ArgumentTypeError(f"must be a positive multiple of 16 pixels (the VAE's "
                                         f"8x times the 2x2 patch), got {v}; e.g. "
                                         f"{' or '.join(map(str, near))}")
    return v


#: Suffixes of image formats other than PNG: an output named so would hold PNG bytes under a
#: name that promises another format (viewers and uploads go by the name).
OTHER_IMAGE_SUFFIXES = (".jpg", ".jpeg", ".jpe", ".webp", ".gif", ".bmp", ".tif", ".tiff",
                        ".avif", ".heic", ".jxl", ".ppm", ".tga", ".ico")


def check_png_name(path: str | os.PathLike, what: str) -> None:
    """UsageError for an image output named as another format (``fox.jpg``): nxhpc writes PNG
    files (with their text chunks) only."""
    suffix = os.path.splitext(os.fspath(path))[1]
    if suffix.lower() in OTHER_IMAGE_SUFFIXES:
        raise UsageError(f"{what} {os.fspath(path)}: nxhpc writes PNG images; a {suffix} name "
                         f"would hold PNG bytes (give a name ending in .png, and convert "
                         f"afterwards if you need {suffix[1:].upper()})")


def seed(s: str) -> int:
    """An integer >= 0."""
    v = _int(s, "an integer >= 0")
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {s!r}")
    return v


def seed_list(s: str) -> list[int]:
    """Comma-separated distinct seeds, integers >= 0 (an empty item is an error; a seed given
    twice would make the same image twice under two names)."""
    try:
        vals = [seed(v.strip()) for v in s.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 0, got "
                                         f"{s!r}") from None
    if len(set(vals)) != len(vals):
        raise argparse.ArgumentTypeError(f"seeds must be distinct, got {s!r}")
    return vals


def int_list(s: str) -> list[int]:
    """Comma-separated integers >= 1 (an empty item is an error, not skipped)."""
    try:
        vals = [int(v) for v in s.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}")
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {s!r}")
    return vals


def grid(s: str) -> tuple[int, int, int]:
    """A token grid ``FxHxW`` of integers >= 1."""
    try:
        g = tuple(int(v) for v in s.lower().split("x"))
    except ValueError:
        g = ()
    if len(g) != 3 or min(g) < 1:
        raise argparse.ArgumentTypeError(f"grid must look like FxHxW (e.g. 1x4x8), got {s!r}")
    return g  # type: ignore[return-value]


# ------------------------------------------------------------------------------ the parser
class Parser(argparse.ArgumentParser):
    """argparse's parser, with an option's value of exactly ``--`` kept as given.

    Python 3.11's argparse drops a ``--`` from every value list before converting it, so
    ``--prompt=--`` came out as ``[]``: an internal error (exit 70) in ``encode``, and
    ``generate --negative-prompt=--`` ran silently with the empty negative prompt. Here an
    option taking one value (``nargs`` None or ``?``) given ``=--`` gets ``"--"`` (through its
    ``type`` and ``choices``); positionals and the ``--`` separator are argparse's as before.
    Every nxhpc CLI parses with this class."""

    def _get_values(self, action: argparse.Action, arg_strings: list[str]) -> Any:
        if action.option_strings and action.nargs in (None, argparse.OPTIONAL) \
                and arg_strings == ["--"]:
            value = self._get_value(action, "--")
            self._check_value(action, value)
            return value
        return super()._get_values(action, arg_strings)


# ------------------------------------------------------------------------------ shared arguments
def cli_parser(module: str, description: str, epilog: str, exit_codes: Mapping[Any, str | None],
               usage: str | None = None) -> argparse.ArgumentParser:
    """The parser of ``python -m nxhpc.MODULE``: ``epilog`` then the exit-code table of
    ``exit_codes`` (:func:`nxhpc.cli.codes.codes_epilog`), both laid out as written."""
    from nxhpc.cli.codes import codes_epilog
    return Parser(prog=f"python -m nxhpc.{module}", usage=usage, description=description,
                  epilog=epilog + codes_epilog(exit_codes),
                  formatter_class=argparse.RawDescriptionHelpFormatter)


def add_workers(p: argparse.ArgumentParser) -> None:
    """The optional positional ``n_workers`` (:func:`workers`; default: the usable CPUs)."""
    p.add_argument("n_workers", nargs="?", type=workers, default=None, help=workers_help())


def precision(value: str, allowed: tuple[str, ...] | None = None) -> str:
    """argparse type of ``--precision``: one of ``allowed`` (default
    ``nxhpc.nn.linear.PRECISIONS``), or ``"auto"``, resolved here to
    :func:`nxhpc.nn.linear.fastest_precision` (within ``allowed``; where that is ``q8`` and
    ``allowed`` has no ``q8`` -- the decoder's convolutions --,
    :func:`nxhpc.nn.conv.decoder_precision`: ``bf16`` where that is faster, else ``f32``)."""
    from nxhpc.runtime.checks import SettingError
    try:    # "auto" runs the kernels: a bad NXHPC_* setting (SettingError) is the cause to name,
        from nxhpc.nn.linear import PRECISIONS, fastest_precision   # not "invalid value 'auto'"
        allowed = PRECISIONS if allowed is None else allowed
        fast = fastest_precision() if value == "auto" else None
    except SettingError as e:
        raise argparse.ArgumentTypeError(str(e)) from e
    if value == "auto":
        if fast in allowed:
            return fast
        if fast == "q8" and "bf16" in allowed:        # no int8 convolution: generate's rule
            from nxhpc.nn.conv import decoder_precision
            return decoder_precision("q8")
        return "f32"
    if value not in allowed:
        raise argparse.ArgumentTypeError(
            f"invalid choice: {value!r} (choose from {', '.join(allowed)}, auto)")
    return value


def add_precision(p: argparse.ArgumentParser, what: str,
                  allowed: tuple[str, ...] | None = None) -> None:
    """``--precision`` (``nxhpc.nn.linear``'s switch, or ``allowed`` of it; default f32; ``auto``
    resolved by :func:`precision`); ``what``: its help text, to which the meaning of ``auto`` is
    added."""
    from nxhpc.nn.linear import DEFAULT_PRECISION, PRECISIONS
    names = PRECISIONS if allowed is None else allowed
    which = "bf16 with AMX, q8 with AVX2 or AVX-512 VNNI" if "q8" in names else \
        "bf16 with AMX or a fast AVX-512 BF16 dot"
    p.add_argument("--precision", type=lambda v: precision(v, names), default=DEFAULT_PRECISION,
                   metavar="{" + ",".join(names) + ",auto}",
                   help=f"{what}; auto: the precision measured fastest on this CPU's kernels "
                        f"({which}, else f32), resolved at start and reported as such")


def add_q8_float_weights(p: argparse.ArgumentParser) -> None:
    """``--q8-float-weights`` (``nxhpc.nn.linear.Q8_FLOAT_WEIGHTS``; default int8)."""
    from nxhpc.nn.linear import DEFAULT_Q8_FLOAT_WEIGHTS, Q8_FLOAT_WEIGHTS
    p.add_argument("--q8-float-weights", choices=Q8_FLOAT_WEIGHTS,
                   default=DEFAULT_Q8_FLOAT_WEIGHTS,
                   help="how --precision q8 runs F32/F16/BF16 projection weights (e.g. the "
                        "refiners of ComfyUI-layout files): int8 (default: a Q8_0 copy made "
                        "once at load, +1.06 bytes per value) or bf16 (as stored, no copy)")


def add_tol(p: argparse.ArgumentParser, tols: Mapping[str, float]) -> None:
    """``--tol``: the pass/fail bound on max_rel; default None (the caller's per-precision
    ``tols``, named in the help)."""
    p.add_argument("--tol", type=positive_float, default=None,
                   help="pass/fail tolerance on max_rel (default per --precision: "
                        + ", ".join(f"{k} {v:g}" for k, v in tols.items()) + ")")


def directory_path(s: str) -> str:
    """A directory path that is not empty (``""`` would quietly mean the current directory),
    ``~`` expanded as ``$NXHPC_MODELS``'s is (``--models-dir=~/m``: the shell leaves it)."""
    if not s.strip():
        raise argparse.ArgumentTypeError("empty path: give a directory ('.' for this one)")
    return os.path.expanduser(s)


#: The models directory's default, as every --help says it (``registry.models_dir``).
MODELS_DIR_DEFAULT = ("$NXHPC_MODELS, else $XDG_CACHE_HOME/nxhpc/models, else "
                      "~/.cache/nxhpc/models")


def add_models_dir(p: argparse.ArgumentParser) -> None:
    """``--models-dir``: where ids are resolved and built-ins generated."""
    p.add_argument("--models-dir", default=None, type=directory_path,
                   help=f"where model ids are looked up / built-ins generated "
                        f"(default {MODELS_DIR_DEFAULT})")


def add_stage_timeout(p: argparse.ArgumentParser, ranks: bool = False) -> None:
    """``--stage-timeout SECONDS`` (:func:`positive_float`; default None: no limit); ``ranks``:
    the command runs under mpirun, where the startup checks are bounded too."""
    also = ("; under mpirun also the startup checks of the arguments, before any model is "
            "read") if ranks else ""
    p.add_argument("--stage-timeout", type=positive_float, default=None, metavar="SECONDS",
                   help=f"kill the workers and fail (exit 6) when one parallel stage takes longer "
                        f"than this, e.g. a hung worker{also} (default: no limit)")


def add_json(p: argparse.ArgumentParser) -> None:
    """``--json``: one JSON object instead of key=value lines."""
    p.add_argument("--json", action="store_true",
                   help="print one JSON object instead of key=value lines")


def option_values(args: argparse.Namespace, names: Sequence[str]) -> dict[str, Any]:
    """``{"--name": value}`` of the parsed options ``names`` (attribute names): what the MPI
    ranks compare (``Ranks.same_args``), named as the user typed them."""
    return {f"--{a.replace('_', '-')}": getattr(args, a) for a in names}


#: The most bytes a prompt file (or standard input) is read for: a prompt is cut at 512 tokens,
#: and an endless stream (``yes | ...``, ``< /dev/zero``) must not fill the machine's memory.
MAX_TEXT_BYTES = 64 << 20


def read_text_file(path: str, what: str, expected: str) -> str:
    """The text of a prompt file ``path`` (option ``what``; ``-`` is standard input), decoded
    as strict UTF-8 with a leading byte-order mark dropped (the ``utf-8-sig`` codec's rule) and
    ``\\r\\n`` or a lone ``\\r`` read as ``\\n`` (universal newlines, as Python's text mode
    reads them). A usage error (exit 2) when it is not a regular file (a FIFO would block,
    /dev/null reads as nothing; ``expected`` says what a directory should have been), cannot be
    read, or is not UTF-8 (naming the first bad byte and its offset)."""
    if path == "-":
        p = "-"
        if sys.stdin is None:                  # the process was started with it closed
            raise UsageError(f"{what} -: standard input is closed")
        try:
            raw = sys.stdin.buffer.read(MAX_TEXT_BYTES + 1)
        except (OSError, AttributeError, ValueError) as e:   # closed, or no binary buffer
            raise UsageError(f"{what} -: cannot read standard input: {e}") from None
    else:
        try:
            p = checks.check_input_file(path, what, expected)
        except checks.InputFileMissing as e:
            if not os.path.exists(path) or os.path.isdir(path):   # not a FIFO, device, socket
                raise
            raise UsageError(f"{e} (give - to read standard input)") from None
        try:
            with open(p, "rb") as f:
                raw = f.read(MAX_TEXT_BYTES + 1)
        except OSError as e:
            raise UsageError(f"{what} {p}: cannot read: {e.strerror or e}") from None
    if len(raw) > MAX_TEXT_BYTES:
        raise UsageError(f"{what} {p}: more than {MAX_TEXT_BYTES >> 20} MiB of text"
                         + (" (an endless stream?)" if p == "-" else "")
                         + "; give a shorter file, or split it across runs")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"{what} {p}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset "
                         f"{e.start})") from None
    text = text[1:] if text.startswith("\ufeff") else text
    return text.replace("\r\n", "\n").replace("\r", "\n")


def check_prompt(prompt: str, what: str) -> str:
    """The prompt, if the tokenizer takes it (no NUL, no lone surrogate), else a usage error
    naming ``what`` -- before any model is opened or generated. Python decodes a command line's
    bytes that its locale cannot (``surrogateescape``) to U+DC80..U+DCFF: bytes that are UTF-8
    (an ASCII locale, ``LC_ALL=C`` without UTF-8 mode) are read as UTF-8, and returned so;
    those that are not are named as the bytes."""
    from nxhpc.qwen3.tokenizer import template      # not at import time (the module's rule)
    bad = next((i for i, c in enumerate(prompt) if "\udc80" <= c <= "\udcff"), None) \
        if isinstance(prompt, str) else None
    if bad is not None:
        try:                                    # the command line's own bytes, as UTF-8
            prompt = os.fsencode(prompt).decode("utf-8")
        except (UnicodeError, ValueError):
            raise UsageError(f"{what}: byte 0x{ord(prompt[bad]) - 0xDC00:02x} (character "
                             f"{bad}) is not UTF-8: a prompt must be UTF-8 text") from None
    try:
        template(prompt)
    except ValueError as e:
        raise UsageError(f"{what}: {e}".replace("prompt: ", "", 1)) from None
    return prompt


def refuse_mpi_ranks(prog: str) -> None:
    """UsageError for a one-process command started as one of several MPI ranks: every rank
    would run the whole job and write the same output (three writers seen on one --out). Every
    rank raises it; rank 0 alone prints it (``said_by_rank_0`` on the others' error)."""
    from nxhpc.runtime.ranks import launched_rank, mpi_launched
    if mpi_launched():
        e = UsageError(f"{prog} runs in one process, not split across MPI ranks: under "
                       f"mpirun -n N every rank would run the whole job and write the same "
                       f"output; run it without mpirun (the commands that split: blockrun, "
                       f"denoise, sample, generate, ddp --backend mpi)")
        e.said_by_rank_0 = launched_rank() != 0    # type: ignore[attr-defined]  # one line
        raise e
