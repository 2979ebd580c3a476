"""Grading: compare an output with a reference -> tolerance tallies, error figures, a verdict.

Owns: the definition of "relative error" used everywhere in nxhpc's reports, the tallies and
the pass/fail rule. Must not: load files or run models (callers hand in arrays).

Relative error (per element, computed in float64)::

    rel_i = |out_i - ref_i| / max(|ref_i|, rms(ref))        rms(ref) = sqrt(mean(ref^2))

i.e. an element's error relative to its own magnitude, with the reference's RMS as a floor so
that elements near zero are judged against the tensor's typical scale instead of dividing by
~0. ``fail_1e2 .. fail_1e5`` count elements with ``rel_i`` above 1e-2 .. 1e-5; ``max_rel`` is
the largest ``rel_i``. Verdict: PASS iff shapes match, no output element is NaN/inf, and
``max_rel <= tol`` (default ``DEFAULT_TOL`` = 1e-2). A float32 run of a block against its float64
reference sits near 1e-6 (worst element ~1e-5); a reference tapped from a run that quantizes
activations to 8 bits differs by ~1e-3, hence the default of 1e-2.

Honest figures at any scale: both arrays are first divided by one power of two (exact), so
``rms(ref)``, differences and squares never overflow or underflow (a reference of 1e308 once
passed every output). Figures are taken over the finite output elements; one over none (an
all-NaN output) is None -- ``null`` in ``key=value`` lines and JSON -- never 0 or a cosine of 1.
:func:`json_safe` turns any non-finite figure into None, for strict JSON.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

__all__ = ["TOLERANCES", "DEFAULT_TOL", "Grade", "grade", "rel_errors", "count_exceeding",
           "error_row", "tol_key", "fmt_value", "one_line", "json_safe"]

TOLERANCES = (1e-2, 1e-3, 1e-4, 1e-5)
DEFAULT_TOL = 1e-2


def tol_key(tol: float) -> str:
    """1e-3 -> 'fail_1e3' (the report's key for the tally at that tolerance)."""
    return f"fail_1e{round(-math.log10(tol))}"


def _as_pair(out, ref, what: str) -> tuple[np.ndarray, np.ndarray]:
    out = np.asarray(out)
    ref = np.asarray(ref)
    if out.shape != ref.shape:
        raise ValueError(f"grade: output shape {out.shape} does not match {what} shape {ref.shape}")
    if not np.all(np.isfinite(ref)):
        bad = int(np.size(ref) - np.count_nonzero(np.isfinite(ref)))
        raise ValueError(f"grade: {what} has {bad} non-finite elements (NaN/inf); "
                         f"it cannot serve as a reference")
    return out.astype(np.float64, copy=False), ref.astype(np.float64, copy=False)


def _scaled(o: np.ndarray, r: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """``(o/s, r/s, s)`` with ``s`` the power of two that puts the largest finite magnitude of
    either array in [1, 2).

    Dividing by a power of two is exact (short of underflow in elements ~2**-1000 times smaller
    than the largest, far below any floor used here), so every ratio below -- ``rel_i``, the
    relative RMS, the cosine -- is the same number it would be in exact arithmetic, and no square
    or difference can overflow: a reference of 1e308 no longer makes ``rms(ref)`` infinite (which
    made every ``rel_i`` 0 and passed any output), and one of 1e-300 no longer squares to 0.
    """
    fo = np.abs(o[np.isfinite(o)])
    m = max(float(np.max(np.abs(r))) if r.size else 0.0, float(np.max(fo)) if fo.size else 0.0)
    if m == 0.0:
        return o, r, 1.0
    s = math.ldexp(1.0, math.frexp(m)[1] - 1)
    return o / s, r / s, s


def _rms(x: np.ndarray) -> float:
    return math.sqrt(float(np.mean(x * x))) if x.size else 0.0


def rel_errors(out, ref, what: str = "reference") -> np.ndarray:
    """Per-element ``|out-ref| / max(|ref|, rms(ref))`` in float64 (NaN/inf where out is)."""
    return _rel(*_scaled(*_as_pair(out, ref, what)))


_TINY = float(np.finfo(np.float32).tiny)   # the floor (unscaled) for an all-zero reference


def _rel(o: np.ndarray, r: np.ndarray, s: float) -> np.ndarray:
    """``rel_i`` from the scaled arrays (``s`` = the scale, for the absolute float32-tiny floor)."""
    rms = _rms(r)
    floor = rms if rms > 0 else _TINY / s             # all-zero reference: float32's tiny
    with np.errstate(invalid="ignore", over="ignore"):
        return np.abs(o - r) / np.maximum(np.abs(r), floor)


def count_exceeding(out, ref, tol: float, what: str = "reference") -> int:
    """How many elements have ``rel_i > tol`` (non-finite outputs count as exceeding)."""
    e = rel_errors(out, ref, what)
    return int(np.count_nonzero(~(e <= tol)))


def _cosine(o: np.ndarray, r: np.ndarray) -> float | None:
    """Cosine of two (scaled, finite) vectors; None when there is nothing to compare."""
    if o.size == 0:
        return None
    no, nr = float(np.linalg.norm(o)), float(np.linalg.norm(r))
    if no == 0.0 and nr == 0.0:
        return 1.0
    if no == 0.0 or nr == 0.0:
        return 0.0
    return float(np.dot(o.ravel(), r.ravel()) / (no * nr))


def _strict(v):
    """A figure as strict JSON holds it: non-finite floats (beyond float64, or undefined) -> None."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _strict(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_strict(x) for x in v]
    return v


def json_safe(obj):
    """``obj`` with every non-finite float replaced by None, recursively (dicts, lists), so that
    ``json.dumps(json_safe(obj), allow_nan=False)`` is valid JSON (no ``NaN``/``Infinity``)."""
    if isinstance(obj, np.floating):
        obj = float(obj)
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return _strict(obj)


@dataclass
class Grade:
    """The figures of one comparison; ``passed`` applies the documented rule.

    A figure is None when it is undefined: over no finite output element (an all-NaN output has
    no ``max_abs``, ``max_rel``, ``rms_err`` or ``cosine``), or a relative RMS against an all-zero
    reference. ``max_abs`` / ``rms_err`` can be ``inf`` only when the true value exceeds float64.
    """
    reference: str
    n: int
    fails: dict[str, int]
    max_abs: float | None
    max_rel: float | None
    rms_err: float | None
    rel_rms_err: float | None
    cosine: float | None
    non_finite: int
    ref_rms: float
    tol: float
    passed: bool
    why: str = ""
    extra: dict = field(default_factory=dict)

    def as_dict(self, strict: bool = True) -> dict:
        """The figures by report key; ``strict`` (default) turns non-finite figures into None,
        so the dict dumps as strict JSON."""
        d = {"reference": self.reference, "elements": self.n, **self.fails,
             "max_abs": self.max_abs, "max_rel": self.max_rel, "rms_err": self.rms_err,
             "rel_rms_err": self.rel_rms_err, "cosine": self.cosine,
             "non_finite": self.non_finite, "ref_rms": self.ref_rms, "tol": self.tol,
             "verdict": "PASS" if self.passed else "FAIL"}
        return _strict(d) if strict else d

    def lines(self) -> list[str]:
        """``key=value`` lines (no verdict line); undefined figures print as ``null``."""
        out = []
        for k, v in self.as_dict(strict=False).items():
            if k == "verdict":
                continue
            out.append(f"{k}={one_line(fmt_value(v))}")
        return out

    def verdict_line(self) -> str:
        """The one last line: PASS / FAIL, why, against what (a reference path holding a line
        break quoted, :func:`one_line`)."""
        ref = one_line(str(self.reference))
        if self.passed:
            if self.max_rel is None:
                return f"PASS: no elements to compare vs {ref}"
            return (f"PASS: max_rel {self.max_rel:.3e} <= tol {self.tol:g} vs {ref} "
                    f"({self.n} elements, cosine {self.cosine:.9f})")
        return f"FAIL: {self.why} vs {ref}"


def one_line(text: str) -> str:
    """A report value on its one line: one holding a line break (a path may) is printed as a
    quoted Python string literal instead, so that it cannot forge a ``key=value`` line."""
    return repr(text) if ("\n" in text or "\r" in text) else text


def fmt_value(v) -> str:
    """A report value as printed in ``key=value`` lines (floats: 9 significant digits, or
    scientific notation when tiny or huge; None -> ``null``)."""
    if v is None:
        return "null"
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        return f"{v:.6e}" if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e6) else f"{v:.9g}"
    return str(v)


def grade(out, ref, *, tol: float = DEFAULT_TOL, reference: str = "reference") -> Grade:
    """Compare ``out`` with ``ref`` (same shape; ``ref`` finite). See the module docstring."""
    if isinstance(tol, bool) or not (isinstance(tol, (int, float)) and math.isfinite(tol)
                                     and tol > 0):
        raise ValueError(f"grade: tol must be a positive finite number, got {tol!r}")
    o, r = _as_pair(out, ref, reference)
    n = int(o.size)
    finite = np.isfinite(o)
    non_finite = int(n - np.count_nonzero(finite))
    o, r, s = _scaled(o, r)
    e = _rel(o, r, s)
    fails = {tol_key(t): int(np.count_nonzero(~(e <= t))) for t in TOLERANCES}
    of, rf = o[finite], r[finite]
    diff = of - rf                                  # |.| < 4 after scaling: no overflow
    some = diff.size > 0
    with np.errstate(over="ignore"):
        max_abs = float(np.max(np.abs(diff))) * s if some else None
        rms_err = _rms(diff) * s if some else None
    max_rel = float(np.max(e[finite])) if some else None
    ref_rms_s = _rms(r)
    ref_rms = ref_rms_s * s
    if not some:
        rel_rms = None
    elif ref_rms_s > 0:
        rel_rms = _rms(diff) / ref_rms_s
    else:
        rel_rms = 0.0 if _rms(diff) == 0 else None  # error against an all-zero reference
    cos = _cosine(of, rf)
    why = ""
    if non_finite:
        why = f"{non_finite} non-finite output elements"
    elif max_rel is not None and max_rel > tol:
        why = (f"max_rel {max_rel:.3e} > tol {tol:g} "
               f"({int(np.count_nonzero(e > tol))} of {n} elements)")
    return Grade(reference, n, fails, max_abs, max_rel, rms_err, rel_rms, cos, non_finite,
                 ref_rms, float(tol), passed=(why == ""), why=why)


def error_row(out, ref) -> dict:
    """One row of the per-layer error table: max_abs, rms_err, cosine, max_rel, non_finite
    (None for a figure over no finite element)."""
    g = grade(out, ref)
    return {"max_abs": g.max_abs, "rms_err": g.rms_err, "cosine": g.cosine,
            "max_rel": g.max_rel, "non_finite": g.non_finite}
