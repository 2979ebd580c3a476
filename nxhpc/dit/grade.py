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
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

__all__ = ["TOLERANCES", "DEFAULT_TOL", "Grade", "grade", "rel_errors", "count_exceeding",
           "error_row", "tol_key", "fmt_value"]

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


def rel_errors(out, ref, what: str = "reference") -> np.ndarray:
    """Per-element ``|out-ref| / max(|ref|, rms(ref))`` in float64 (NaN/inf where out is)."""
    return _rel(*_as_pair(out, ref, what))


def _rel(o: np.ndarray, r: np.ndarray) -> np.ndarray:
    rms = math.sqrt(float(np.mean(r * r))) if r.size else 0.0
    floor = max(rms, np.finfo(np.float32).tiny)
    with np.errstate(invalid="ignore", over="ignore"):
        return np.abs(o - r) / np.maximum(np.abs(r), floor)


def count_exceeding(out, ref, tol: float, what: str = "reference") -> int:
    """How many elements have ``rel_i > tol`` (non-finite outputs count as exceeding)."""
    e = rel_errors(out, ref, what)
    return int(np.count_nonzero(~(e <= tol)))


def _cosine(o: np.ndarray, r: np.ndarray) -> float:
    no, nr = float(np.linalg.norm(o)), float(np.linalg.norm(r))
    if no == 0.0 and nr == 0.0:
        return 1.0
    if no == 0.0 or nr == 0.0:
        return 0.0
    return float(np.dot(o.ravel(), r.ravel()) / (no * nr))


@dataclass
class Grade:
    """The figures of one comparison; ``passed`` applies the documented rule."""
    reference: str
    n: int
    fails: dict[str, int]
    max_abs: float
    max_rel: float
    rms_err: float
    rel_rms_err: float
    cosine: float
    non_finite: int
    ref_rms: float
    tol: float
    passed: bool
    why: str = ""
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        d = {"reference": self.reference, "elements": self.n, **self.fails,
             "max_abs": self.max_abs, "max_rel": self.max_rel, "rms_err": self.rms_err,
             "rel_rms_err": self.rel_rms_err, "cosine": self.cosine,
             "non_finite": self.non_finite, "ref_rms": self.ref_rms, "tol": self.tol,
             "verdict": "PASS" if self.passed else "FAIL"}
        return d

    def lines(self) -> list[str]:
        """``key=value`` lines (no verdict line)."""
        out = []
        for k, v in self.as_dict().items():
            if k == "verdict":
                continue
            out.append(f"{k}={fmt_value(v)}")
        return out

    def verdict_line(self) -> str:
        if self.passed:
            return (f"PASS: max_rel {self.max_rel:.3e} <= tol {self.tol:g} vs {self.reference} "
                    f"({self.n} elements, cosine {self.cosine:.9f})")
        return f"FAIL: {self.why} vs {self.reference}"


def fmt_value(v) -> str:
    """A report value as printed in ``key=value`` lines (floats: 9 significant digits, or
    scientific notation when tiny or huge)."""
    if isinstance(v, float):
        return f"{v:.6e}" if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e6) else f"{v:.9g}"
    return str(v)


def grade(out, ref, *, tol: float = DEFAULT_TOL, reference: str = "reference") -> Grade:
    """Compare ``out`` with ``ref`` (same shape; ``ref`` finite). See the module docstring."""
    if not (isinstance(tol, (int, float)) and math.isfinite(tol) and tol > 0):
        raise ValueError(f"grade: tol must be a positive finite number, got {tol!r}")
    o, r = _as_pair(out, ref, reference)
    n = int(o.size)
    finite = np.isfinite(o)
    non_finite = int(n - np.count_nonzero(finite))
    e = _rel(o, r)
    fails = {tol_key(t): int(np.count_nonzero(~(e <= t))) for t in TOLERANCES}
    of, rf = o[finite], r[finite]
    diff = of - rf
    max_abs = float(np.max(np.abs(diff))) if diff.size else 0.0
    max_rel = float(np.max(e[finite])) if diff.size else 0.0
    rms_err = math.sqrt(float(np.mean(diff * diff))) if diff.size else 0.0
    ref_rms = math.sqrt(float(np.mean(r * r))) if n else 0.0
    rel_rms = rms_err / ref_rms if ref_rms > 0 else (0.0 if rms_err == 0 else math.inf)
    cos = _cosine(of, rf)
    why = ""
    if non_finite:
        why = f"{non_finite} non-finite output elements"
    elif max_rel > tol:
        why = (f"max_rel {max_rel:.3e} > tol {tol:g} "
               f"({int(np.count_nonzero(e > tol))} of {n} elements)")
    return Grade(reference, n, fails, max_abs, max_rel, rms_err, rel_rms, cos, non_finite,
                 ref_rms, float(tol), passed=(why == ""), why=why)


def error_row(out, ref) -> dict:
    """One row of the per-layer error table: max_abs, rms_err, cosine, max_rel, non_finite."""
    g = grade(out, ref)
    return {"max_abs": g.max_abs, "rms_err": g.rms_err, "cosine": g.cosine,
            "max_rel": g.max_rel, "non_finite": g.non_finite}
