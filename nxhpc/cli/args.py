"""The argparse types every nxhpc CLI shares: one spelling of each rule, one message.

Owns the ``type=`` callables (:func:`positive_int`, :func:`workers`, :func:`layers`,
:func:`positive_float`, :func:`seconds`, :func:`eps`, :func:`unit_interval`, :func:`pixels`,
:func:`seed`, :func:`int_list`, :func:`grid`): each turns a string into a value or raises
``argparse.ArgumentTypeError`` (exit 2) naming the rule and the text given; the rules themselves
are :mod:`nxhpc.runtime.checks`'. Must not: import the compiled kernels or model code at import
time (the ``models`` CLI runs in an unbuilt tree).
"""
from __future__ import annotations

import argparse
import math

from nxhpc.runtime import checks

__all__ = ["positive_int", "workers", "layers", "positive_float", "seconds", "eps",
           "unit_interval", "pixels", "seed", "int_list", "grid", "workers_help"]


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


#: The largest image side a CLI takes: 16384 px is 1M image tokens at 16384 x 16384 (beyond
#: that even the noise no longer fits a machine's memory: 1.6e16 px asked for exabytes).
MAX_PIXELS = 16384


def pixels(s: str) -> int:
    """An image side in pixels: a positive multiple of 16 (the VAE's 8x times the 2x2 patch),
    at most :data:`MAX_PIXELS`."""
    v = positive_int(s)
    if v > MAX_PIXELS:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_PIXELS} pixels (1M image tokens "
                                         f"at {MAX_PIXELS} x {MAX_PIXELS}), got {v}")
    if v % 16:
        raise argparse.ArgumentTypeError(f"must be a positive multiple of 16 pixels (the VAE's "
                                         f"8x times the 2x2 patch), got {v}; e.g. "
                                         f"{max(16, (v // 16) * 16)} or {(v // 16 + 1) * 16}")
    return v


def seed(s: str) -> int:
    """An integer >= 0."""
    v = _int(s, "an integer >= 0")
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {s!r}")
    return v


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
