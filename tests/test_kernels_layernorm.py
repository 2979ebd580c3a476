"""Tests of layernorm_mod: out[t] = (x[t] - mean) / sqrt(var + eps) * mod (LayerNorm without
affine, population variance), the denoiser's final-layer norm.

Oracles: plain float64 numpy written from the formula, and torch.nn.functional.layer_norm in
float64 (two independent implementations). The contract (csrc/nx_ops.h) fixes the float32
operation order, so every ISA variant must give the generic spec's bits, for any band split and
in place. Tolerance, derived from that order (u = 2^-24):
  out = ((fl32(x - mean) * r) * mod) with r = fl32(1/sqrt(var + eps)): four float32 roundings
  of the exact value, relative <= (1+u)^4 - 1 < 4.01u of |ref|; the float64 statistics add an
  absolute error <= |r*mod| * gamma64_{D+2} * (|mean| + max|x|) via the mean and a relative
  gamma64_{D+4} via the variance -- both ~1e-12 of u at these sizes but kept for honesty.
"""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernelutil import EPS32, EPS64, ISAS, assert_bitwise

from nxhpc import _kernels as K

SIZES = [1, 7, 31, 33, 256, 3840, 4097]


def ref_layernorm_mod(x, mod, eps):
    x = x.astype(np.float64)
    mean = x.mean(axis=1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=1, keepdims=True)
    return (x - mean) / np.sqrt(var + float(eps)) * mod.astype(np.float64)


def bound(x, mod, eps):
    x = x.astype(np.float64)
    D = x.shape[1]
    ref = ref_layernorm_mod(x, mod, eps)
    r = 1.0 / np.sqrt(x.var(axis=1, keepdims=True) + float(eps))
    g = lambda n: n * EPS64 / (1 - n * EPS64)
    stats = np.abs(r * mod) * g(D + 2) * (np.abs(x.mean(axis=1, keepdims=True))
                                           + np.abs(x).max(axis=1, keepdims=True))
    return ref, 4.01 * EPS32 * np.abs(ref) * (1 + g(D + 4)) + stats + 2.0 ** -140


def run(x, mod, eps, isa, r0=0, r1=None, out=None):
    if out is None:
        out = np.full(x.shape, np.nan, np.float32)
    assert K.layernorm_mod(x, mod, out, eps, r0, r1, isa=isa) is out
    return out


def inputs(rng, T, D, offset=0.0, scale=1.0):
    x = (offset + rng.standard_normal((T, D)) * scale).astype(np.float32)
    mod = (1.0 + rng.standard_normal(D) * 0.5).astype(np.float32)
    return x, mod


def check(out, x, mod, eps, what):
    ref, b = bound(x, mod, eps)
    err = np.abs(out.astype(np.float64) - ref)
    bad = ~(err <= b)
    assert not bad.any(), f"{what}: {bad.sum()} beyond the bound, worst {np.max(err / b):.3g}"


@settings(max_examples=30)
@given(T=st.sampled_from([1, 3, 17]), D=st.sampled_from(SIZES), seed=st.integers(0, 2**32 - 1),
       offset=st.sampled_from([0.0, 3.0, -1e3]), log_scale=st.floats(-6, 6),
       eps=st.sampled_from([1e-6, 1e-5, 0.5]))
def test_vs_float64_and_variants_bit_identical(T, D, seed, offset, log_scale, eps):
    """Random scales and mean offsets (|mean| >> std at offset -1e3, small scales)."""
    rng = np.random.default_rng(seed)
    x, mod = inputs(rng, T, D, offset, 10.0 ** log_scale)
    gen = run(x, mod, eps, "generic")
    check(gen, x, mod, eps, "generic")
    for isa in ISAS:
        assert_bitwise(run(x, mod, eps, isa), gen, f"isa={isa} D={D}")


def test_vs_torch_layer_norm():
    rng = np.random.default_rng(1)
    x, mod = inputs(rng, 64, 3840, 0.3, 2.0)
    t = torch.nn.functional.layer_norm(torch.from_numpy(x).double(), (3840,), eps=1e-6)
    ref_torch = (t * torch.from_numpy(mod).double()).numpy()
    ref, b = bound(x, mod, 1e-6)
    np.testing.assert_allclose(ref_torch, ref, rtol=1e-12, atol=1e-12)  # the two oracles agree
    for isa in ISAS:
        out = run(x, mod, 1e-6, isa)
        assert (np.abs(out - ref_torch) <= b + 1e-12 * np.abs(ref)).all(), isa


def test_bound_is_not_vacuous():
    """Negative controls: the sample variance (D-1), eps added outside the sqrt, or the mean
    rounded to float32 before the difference (at a large offset) all fail the check."""
    rng = np.random.default_rng(2)
    x, mod = inputs(rng, 4, 256, 0.0, 1.0)
    eps = 1e-5
    x64 = x.astype(np.float64)
    mean, var = x64.mean(1, keepdims=True), x64.var(1, keepdims=True)
    sample = ((x64 - mean) / np.sqrt(x64.var(1, ddof=1, keepdims=True) + eps) * mod).astype(np.float32)
    outside = ((x64 - mean) / (np.sqrt(var) + eps) * mod).astype(np.float32)
    for bad in (sample, outside):
        with pytest.raises(AssertionError):
            check(bad, x, mod, eps, "bad")
    xo, modo = inputs(rng, 4, 256, 3000.0, 1.0)
    xo64 = xo.astype(np.float64)
    m32 = xo64.mean(1, keepdims=True).astype(np.float32)
    rounded = ((xo - m32) * (1 / np.sqrt(xo64.var(1, keepdims=True) + eps)).astype(np.float32)
               * modo).astype(np.float32)
    with pytest.raises(AssertionError):
        check(rounded, xo, modo, eps, "mean rounded to float32")
    check(run(xo, modo, eps, "generic"), xo, modo, eps, "ours at a large offset")


@pytest.mark.parametrize("isa", ISAS)
def test_band_invariance_in_place_and_untouched(isa):
    rng = np.random.default_rng(3)
    T, D = 29, 331
    x, mod = inputs(rng, T, D, 1.0, 3.0)
    full = run(x, mod, 1e-6, isa)
    out = np.full((T, D), np.nan, np.float32)
    for a, b in ((0, 1), (1, 11), (11, 11), (11, T)):
        run(x, mod, 1e-6, isa, a, b, out)
    assert_bitwise(out, full, "bands")
    sentinel = rng.standard_normal((T, D)).astype(np.float32)
    o = sentinel.copy()
    run(x, mod, 1e-6, isa, 5, 9, o)
    assert_bitwise(o[:5], sentinel[:5])
    assert_bitwise(o[9:], sentinel[9:])
    assert_bitwise(o[5:9], full[5:9])
    y = x.copy()
    assert K.layernorm_mod(y, mod, y, 1e-6, isa=isa) is y  # in place
    assert_bitwise(y, full, "in place")


def test_special_rows():
    """A constant row normalizes to exact zeros (sign of mod); a row with inf or NaN gives NaN;
    every ISA gives the same bits."""
    D = 100
    x = np.zeros((4, D), np.float32)
    x[0] = 2.5
    x[1] = np.linspace(-1, 1, D)
    x[2, 7] = np.inf
    x[3, 3] = np.nan
    mod = np.ones(D, np.float32)
    mod[::2] = -2.0
    gen = run(x, mod, 1e-6, "generic")
    assert (gen[0] == 0).all() and (np.signbit(gen[0]) == (mod < 0)).all()
    assert np.isnan(gen[2]).all() and np.isnan(gen[3]).all()
    check(gen[1:2], x[1:2], mod, 1e-6, "ramp")
    for isa in ISAS:
        assert_bitwise(run(x, mod, 1e-6, isa), gen, isa)


def _readonly(a):
    a = a.copy()
    a.flags.writeable = False
    return a


def test_bad_input_battery():
    f = np.float32
    T, D = 5, 8
    x, mod, out = np.ones((T, D), f), np.ones(D, f), np.zeros((T, D), f)
    good = {"x": x, "mod": mod, "out": out, "eps": 1e-6}
    cases = [
        ("x", x.astype(np.float64), TypeError), ("x", x.tolist(), TypeError), ("x", None, TypeError),
        ("x", np.ones(D, f), ValueError), ("x", np.ones((T, 2 * D), f)[:, ::2], ValueError),
        ("x", np.ones((T, 0), f), ValueError),
        ("mod", np.ones(D + 1, f), ValueError), ("mod", np.ones(D, np.float16), TypeError),
        ("mod", None, TypeError), ("mod", np.ones((1, D), f), ValueError),
        ("out", np.zeros((T, D + 1), f), ValueError), ("out", _readonly(out), ValueError),
        ("out", np.zeros((T, D)), TypeError), ("out", np.zeros((T, 2 * D), f)[:, ::2], ValueError),
        ("out", None, TypeError),
        ("eps", -1.0, ValueError), ("eps", float("nan"), ValueError), ("eps", float("inf"), ValueError),
        ("eps", "1e-6", TypeError), ("eps", None, TypeError), ("eps", True, TypeError),
        ("r0", -1, ValueError), ("r1", T + 1, ValueError), ("r0", 2.5, TypeError),
        ("isa", "sse9", ValueError),
    ]
    for arg, bad, exc in cases:
        kw = dict(good, **{arg: bad})
        before = out.copy()
        with pytest.raises(exc) as info:
            K.layernorm_mod(kw.pop("x"), kw.pop("mod"), kw.pop("out"), kw.pop("eps"), **kw)
        msg = str(info.value)
        assert "layernorm_mod" in msg, (arg, msg)
        assert arg in msg or arg in ("r0", "r1"), (arg, msg)
        assert_bitwise(out, before, "out untouched on error")
    with pytest.raises(ValueError, match="band"):
        K.layernorm_mod(x, mod, out, 1e-6, 4, 2)
    buf = np.zeros((T + 1, D), f)  # out overlapping x without being x
    with pytest.raises(ValueError, match="overlaps x"):
        K.layernorm_mod(buf[:T], mod, buf[1:], 1e-6)
    m2 = np.zeros((T, D), f)
    with pytest.raises(ValueError, match="overlaps mod"):
        K.layernorm_mod(x, m2[0], m2, 1e-6)
