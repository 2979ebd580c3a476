"""Input checks shared by the families' plans: float32 narrowing with a finiteness check, and
the norm epsilon's range.

Owns :func:`narrow_finite` (an array as C-contiguous float32, checked finite after narrowing),
:func:`finite_vector` and :func:`check_eps` with :data:`EPS_RANGE`. Each raises ValueError
naming the argument. Must not: import the compiled kernels or a model family.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["narrow_finite", "finite_vector", "check_eps", "EPS_RANGE"]


def narrow_finite(name: str, a: np.ndarray) -> np.ndarray:
    """``a`` as C-contiguous float32, checked finite *after* narrowing (a float64 1e300 passes
    a float64 check and becomes inf); ValueError naming ``name``, the count and the first index."""
    a = np.asarray(a)
    with np.errstate(over="ignore"):
        a32 = np.ascontiguousarray(a, dtype=np.float32).reshape(a.shape)  # 0-d stays 0-d
    fin = np.isfinite(a32)
    if not fin.all():
        bad = np.argwhere(~fin) if a32.ndim else np.zeros((1, 0), dtype=np.intp)
        where = tuple(int(i) for i in bad[0])
        if np.isfinite(a[where]):
            why = (f"beyond float32's range |v| <= {float(np.finfo(np.float32).max):.4g}: "
                   f"finite as {a.dtype}, inf once narrowed to float32, the kernels' type")
        else:
            why = "NaN/inf"
        raise ValueError(f"{name} has {len(bad)} non-finite values ({why}), first at index "
                         f"{where}; refusing to run")
    return a32


def finite_vector(name: str, a: Any, n: int) -> np.ndarray:
    """A floating-point vector of shape ``(n,)`` as finite float32; ValueError naming ``name``."""
    if not isinstance(a, np.ndarray) or a.dtype.kind != "f" or a.shape != (n,):
        got = f"{a.dtype} {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
        raise ValueError(f"{name} must be a floating-point array of shape ({n},), got {got}")
    return narrow_finite(name, a)


#: The range of ``eps`` the kernels accept: positive normal float32 values. Below the smallest
#: normal it is subnormal or 0 once narrowed (a zero row -- padding -- then turns NaN); from
#: float32's largest value up it rounds to inf.
EPS_RANGE = (float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max))


def check_eps(eps: Any) -> float:
    """``eps`` as a float if float32 holds it as a positive normal number (:data:`EPS_RANGE`);
    else ValueError naming the range. (The value itself is passed on unchanged.)"""
    if isinstance(eps, bool) or not isinstance(eps, (int, float, np.integer, np.floating)):
        raise ValueError(f"eps must be a positive finite number, got {eps!r}")
    try:
        e = float(eps)
    except OverflowError:
        raise ValueError(f"eps must be a positive finite number, got an integer of "
                         f"{int(eps).bit_length()} bits (beyond float32's range)") from None
    if not math.isfinite(e) or e <= 0:
        raise ValueError(f"eps must be a positive finite number, got {eps!r}")
    with np.errstate(over="ignore", under="ignore"):
        e32 = np.float32(e)
    lo, hi = EPS_RANGE
    if not np.isfinite(e32):
        raise ValueError(f"eps {e:g} is inf in float32 (the kernels' type): it must lie in "
                         f"[{lo:.4g}, {hi:.4g}]")
    if e32 < lo:
        why = "0 (a zero row -- padding -- would turn NaN)" if e32 == 0 else "subnormal"
        raise ValueError(f"eps {e:g} is {why} in float32 (the kernels' type): it must lie in "
                         f"[{lo:.4g}, {hi:.4g}]")
    return e
