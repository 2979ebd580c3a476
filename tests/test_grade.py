"""Grading that cannot lie (issue 12, item 9): figures at any scale, undefined figures as null,
strict JSON.

Reference: the documented formula ``rel_i = |out_i - ref_i| / max(|ref_i|, rms(ref))`` evaluated
here in exact decimal arithmetic (every float64 converts to a Decimal exactly; 60 significant
digits and an unbounded exponent range, so nothing overflows or underflows), independent of the
power-of-two scaling the implementation uses. Tolerance 1e-12 relative: the implementation's only
rounding is float64's (~1e-16 per operation over a few dozen operations per figure).
"""
import json
import math
from decimal import Decimal, getcontext

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nxhpc.dit.grade import grade, rel_errors

getcontext().prec = 60


def _exact_rel(out: np.ndarray, ref: np.ndarray) -> list[Decimal]:
    o = [Decimal(float(v)) for v in out.ravel()]
    r = [Decimal(float(v)) for v in ref.ravel()]
    rms = (sum(x * x for x in r) / len(r)).sqrt()
    return [abs(a - b) / max(abs(b), rms) for a, b in zip(o, r)]


def _strict_loads(text: str):
    def bad(name):
        raise ValueError(f"not strict JSON: {name}")
    return json.loads(text, parse_constant=bad)


@pytest.mark.parametrize("scale", [1e308, 1e-300, 1.0])
def test_figures_right_at_extreme_scales(scale):
    """A float64 reference of ~1e308 overflowed rms(ref) to inf, every rel_i became 0 and any
    output PASSed; at ~1e-300 rms(ref) underflowed and a float32 floor took over. scale=1 is the
    negative control (the old code was right there)."""
    rng = np.random.default_rng(5)
    u = rng.uniform(0.1, 1.0, 64) * rng.choice([-1.0, 1.0], 64)
    ref = u * scale
    delta = rng.uniform(-0.05, 0.05, 64)
    out = ref * (1.0 + delta)
    assert np.isfinite(out).all() and np.isfinite(ref).all()
    g = grade(out, ref, tol=1e-2)
    exact = _exact_rel(out, ref)
    assert g.max_rel == pytest.approx(float(max(exact)), rel=1e-12)
    assert g.fails["fail_1e2"] == sum(1 for e in exact if e > Decimal("0.01"))
    assert not g.passed and g.why.startswith("max_rel")          # 5% errors must FAIL
    np.testing.assert_allclose(rel_errors(out, ref), [float(e) for e in exact], rtol=1e-12)
    ok = grade(ref * (1 + delta * 1e-6), ref, tol=1e-2)           # and tiny errors PASS
    assert ok.passed and ok.max_rel < 1e-7


@settings(max_examples=30)
@given(k=st.integers(-1000, 1000), seed=st.integers(0, 2**32 - 1))
def test_figures_do_not_depend_on_the_scale(k, seed):
    """Multiplying both arrays by 2**k (exact) leaves every ratio figure unchanged and scales
    max_abs / rms_err / ref_rms by exactly 2**k, as long as nothing is denormal."""
    rng = np.random.default_rng(seed)
    ref = rng.standard_normal(40)
    out = ref + rng.standard_normal(40) * 10.0 ** rng.uniform(-8, 0)
    c = math.ldexp(1.0, k)
    a, b = grade(out, ref), grade(out * c, ref * c)
    assert (b.max_rel, b.rel_rms_err, b.cosine, b.fails) == (a.max_rel, a.rel_rms_err,
                                                            a.cosine, a.fails)
    for name in ("max_abs", "rms_err", "ref_rms"):
        assert getattr(b, name) == getattr(a, name) * c, name


def test_all_nan_output_reports_null_figures_not_a_perfect_match():
    """An all-NaN output printed max_abs=0 max_rel=0 cosine=1 beside FAIL."""
    ref = np.linspace(-1, 1, 12)
    g = grade(np.full(12, np.nan), ref)
    assert not g.passed and g.non_finite == 12 and "12 non-finite" in g.why
    assert (g.max_abs, g.max_rel, g.rms_err, g.rel_rms_err, g.cosine) == (None,) * 5
    assert g.fails == {"fail_1e2": 12, "fail_1e3": 12, "fail_1e4": 12, "fail_1e5": 12}
    lines = g.lines()
    for key in ("max_abs", "max_rel", "rms_err", "rel_rms_err", "cosine"):
        assert f"{key}=null" in lines, lines
    d = _strict_loads(json.dumps(g.as_dict(), allow_nan=False))
    assert d["cosine"] is None and d["verdict"] == "FAIL"
    part = ref.copy()                             # control: with some finite elements, figures
    part[3] = np.nan                              # are over those (documented), not null
    p = grade(part, ref)
    assert p.max_rel == 0.0 and p.cosine == pytest.approx(1.0) and not p.passed


def test_beyond_float64_and_undefined_figures_are_strict_json():
    """|out - ref| beyond float64 (2e308) makes max_abs inf: true, but not JSON; a relative RMS
    against an all-zero reference was inf too (emitted as ``Infinity``)."""
    ref = np.full(8, 1e308)
    g = grade(-ref, ref)
    assert g.max_abs == math.inf and g.max_rel == 2.0 and not g.passed   # |-r - r| / |r| = 2
    assert "max_abs=inf" in g.lines()
    d = _strict_loads(json.dumps(g.as_dict(), allow_nan=False))
    assert d["max_abs"] is None and d["max_rel"] == 2.0
    z = grade(np.ones(4), np.zeros(4))
    assert z.rel_rms_err is None and not z.passed
    _strict_loads(json.dumps(z.as_dict(), allow_nan=False))
    from nxhpc.dit.grade import json_safe
    assert json_safe({"a": [np.float64("nan"), 1.5, {"b": float("-inf")}]}) == \
        {"a": [None, 1.5, {"b": None}]}
