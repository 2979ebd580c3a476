"""Tests of the Q16.16 tape (nxhpc.train.q16) against independent references.

References: Python's exact ``fractions.Fraction`` and ``round`` (which rounds half to even) for
the rounding rule, conversions and exact integer matmuls; plain float64 numpy forward/backward
written here for gradients (with an error bound propagated op by op); and integer values
derived by hand for a tiny graph whose rounding ties tell half-to-even from half-away-from-zero.
"""
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, strategies as st

import nxhpc.train.q16 as q16mod
from nxhpc.train.q16 import (Q16_MAX, Q16_ONE, Q16OverflowError, Tape, from_q16,
                       q16_add, q16_matmul, q16_mul, round_div, round_shift, sgd_step, to_q16)

U = 1.0 / Q16_ONE          # one Q16 step in real units


def ref_round(num: int, den: int) -> int:
    """Exact num/den rounded half to even (Python's round on a Fraction)."""
    return round(Fraction(num, den))


# ------------------------------------------------------------------------------------------
# the rounding rule and conversions
# ------------------------------------------------------------------------------------------

def test_round_shift_ties_go_to_even_hand_values():
    # x / 65536 = -1.5, -0.5, 0.5, 1.5, 2.5, 3/65536, 2**24 + 0.5, -(2**24) - 0.5
    x = np.array([-98304, -32768, 32768, 98304, 163840, 3, 2**40 + 32768, -(2**40) - 32768],
                 dtype=np.int64)
    assert round_shift(x).tolist() == [-2, 0, 0, 2, 2, 0, 2**24, -(2**24)]
    # half-away-from-zero would give 1 for 0.5: the rule is not that one
    assert int(round_shift(np.array([32768], dtype=np.int64))[0]) != 1


@given(st.lists(st.integers(-(2**63) + 1, 2**63 - 1), min_size=1, max_size=30),
       st.integers(1, 2**62))
def test_round_div_matches_fraction_int64(xs, d):
    got = round_div(np.array(xs, dtype=np.int64), d)
    assert [int(v) for v in got] == [ref_round(x, d) for x in xs]


@given(st.lists(st.integers(-(2**100), 2**100), min_size=1, max_size=20),
       st.integers(1, 2**70))
def test_round_div_matches_fraction_python_ints(xs, d):
    got = round_div(np.array(xs, dtype=object), d)
    assert [int(v) for v in got] == [ref_round(x, d) for x in xs]
    assert all(round_div(x, d) == ref_round(x, d) for x in xs)


def test_round_div_ties_on_plain_ints_and_arrays_agree():
    """Every x near the ties for small even and odd d, as Python ints (the scalar path) and as
    int64 / object arrays: half-to-even, as ``round(Fraction(x, d))``. The random tests above
    almost never draw a tie for the scalar path, where half-up passed them (a mutation check,
    2026-12-06)."""
    for d in (2, 3, 4, 6, 10, 2 ** 16):
        xs = [k * d + r for k in range(-4, 5) for r in {0, 1, d // 2 - 1, d // 2, d // 2 + 1}]
        want = [round(Fraction(x, d)) for x in xs]
        assert [round_div(x, d) for x in xs] == want, d
        assert [int(v) for v in round_div(np.array(xs, dtype=np.int64), d)] == want, d
        assert [int(v) for v in round_div(np.array(xs, dtype=object), d)] == want, d
    assert round_div(-3, 2) == -2 and round_div(5, 2) == 2 and round_div(7, 2) == 4


@given(st.floats(-1e12, 1e12, allow_nan=False))
def test_to_q16_is_half_even_of_exact_scaling(x):
    assert int(to_q16(np.array([x]))[0]) == round(Fraction(x) * Q16_ONE)


def test_to_q16_ties_and_from_q16_exact():
    # 0.5/65536 and 1.5/65536 are exact float64 ties
    assert to_q16([0.5 * U, 1.5 * U, -0.5 * U, -1.5 * U]).tolist() == [0, 2, 0, -2]
    q = np.array([1, -1, 2**52 - 1, -(2**52) + 3, 123456789], dtype=np.int64)
    assert [Fraction(v) for v in from_q16(q)] == [Fraction(int(v), Q16_ONE) for v in q]


def test_to_q16_rejects_bad_input_by_name():
    with pytest.raises(ValueError, match=r"to_q16: weights has a non-finite value nan at index \(1,\)"):
        to_q16([1.0, np.nan], "weights")
    with pytest.raises(Q16OverflowError, match=r"to_q16\(big\)"):
        to_q16([1e14], "big")
    assert int(to_q16([7e13])[0]) == round(Fraction(7e13) * Q16_ONE)     # just inside


# ------------------------------------------------------------------------------------------
# exact integer arithmetic and overflow
# ------------------------------------------------------------------------------------------

def ref_matmul_q16(a, b):
    """Python-int triple loop, then half-even rounding of acc / 2**16."""
    n, k = len(a), len(a[0])
    m = len(b[0])
    return [[ref_round(sum(int(a[i][t]) * int(b[t][j]) for t in range(k)), Q16_ONE)
             for j in range(m)] for i in range(n)]


@st.composite
def matmul_case(draw):
    n, k, m = draw(st.integers(1, 4)), draw(st.integers(1, 5)), draw(st.integers(1, 4))
    mag = draw(st.sampled_from([2**17, 2**31, 2**40]))   # 2**40: needs the exact fallback
    ints = st.integers(-mag, mag)
    a = draw(st.lists(st.lists(ints, min_size=k, max_size=k), min_size=n, max_size=n))
    b = draw(st.lists(st.lists(ints, min_size=m, max_size=m), min_size=k, max_size=k))
    return a, b


@given(matmul_case())
def test_q16_matmul_exact_against_python_ints(case):
    a, b = case
    ref = ref_matmul_q16(a, b)
    if max(abs(v) for r in ref for v in r) > Q16_MAX:
        with pytest.raises(Q16OverflowError, match="matmul"):
            q16_matmul(np.array(a, dtype=np.int64), np.array(b, dtype=np.int64))
    else:
        got = q16_matmul(np.array(a, dtype=np.int64), np.array(b, dtype=np.int64))
        assert got.dtype == np.int64 and got.tolist() == ref


def test_matmul_that_would_wrap_int64_is_still_exact():
    # the exact accumulator 2**40 * 2**30 + 3 * 5 exceeds int64 (it wraps to 15), but the Q16
    # result after the shift, about 2**54, is well inside the range
    a = np.array([[2**40, 3]], dtype=np.int64)
    b = np.array([[2**30], [5]], dtype=np.int64)
    ref = ref_matmul_q16(a.tolist(), b.tolist())
    plain = round_shift(a @ b)                       # negative control: numpy int64 wraps
    assert plain.tolist() != ref
    assert q16_matmul(a, b).tolist() == ref


def test_overflow_is_raised_with_op_and_magnitude():
    big = to_q16([2.0**40])                          # fine as a value ...
    with pytest.raises(Q16OverflowError) as e:       # ... but its square (2**80) is not
        q16_mul(big, big, "mul")
    assert e.value.op == "mul" and e.value.magnitude == 2**96      # (2**40)**2 real = 2**96 Q16
    assert "mul: Q16 magnitude" in str(e.value)
    t = Tape()
    x = t.leaf(big)
    with pytest.raises(Q16OverflowError, match=r"^mul: "):
        t.mul(x, x)
    with pytest.raises(Q16OverflowError, match="add"):
        q16_add(np.array([Q16_MAX], dtype=np.int64), np.array([1], dtype=np.int64))
    with pytest.raises(Q16OverflowError, match="leaf"):
        Tape().leaf(np.array([Q16_MAX + 1], dtype=np.int64))
    with pytest.raises(Q16OverflowError, match="sgd_step"):
        sgd_step(np.array([0], dtype=np.int64), np.array([2**61], dtype=np.int64), 2**20)
    # just below the limit nothing is raised (the check is not a blanket refusal)
    assert int(q16_add(np.array([Q16_MAX - 1], dtype=np.int64),
                       np.array([1], dtype=np.int64))[0]) == Q16_MAX


def test_weight_gradient_checks_the_full_row_sum_not_partial_sums(monkeypatch):
    # matmul's weight gradient sums per-row rounded terms in chunks of rows. Terms 3*2**60,
    # 3*2**60, -3*2**60: the partial sum 6*2**60 is past Q16_MAX, the full sum 3*2**60 is not,
    # so the result must not depend on the chunking (nor on how rows are sharded).
    monkeypatch.setattr(q16mod, "_TERM_CHUNK", 1)            # one row per chunk
    a = np.array([[2**40]] * 3, dtype=np.int64)
    g = np.array([[3 * 2**36], [3 * 2**36], [-3 * 2**36]], dtype=np.int64)
    ref = sum(ref_round(int(a[i, 0]) * int(g[i, 0]), Q16_ONE) for i in range(3))
    assert ref == 3 * 2**60 <= Q16_MAX < 6 * 2**60
    assert q16mod._rowround_tn(a, g, "matmul.backward(b)").tolist() == [[ref]]
    # negative control: when the full sum is past the range, it raises naming the op
    with pytest.raises(Q16OverflowError, match=r"matmul\.backward\(b\)"):
        q16mod._rowround_tn(a, np.abs(g), "matmul.backward(b)")


def test_relu_gradient_is_zero_at_and_below_the_kink():
    t = Tape()
    a = t.leaf(np.array([-3, 0, 5], dtype=np.int64))
    t.backward(t.sum(t.relu(a)))
    assert t.grad(a).tolist() == [0, 0, Q16_ONE]


def test_training_style_overflow_raises_not_wraps():
    # a value driven past the range by repeated squaring: 2**16 -> 2**32 -> 2**64 (real units)
    t = Tape()
    v = t.leaf(to_q16([2.0**16]))
    v = t.mul(v, v)                                   # 2**32, fine
    assert from_q16(v.value).tolist() == [2.0**32]
    with pytest.raises(Q16OverflowError, match="mul"):
        t.mul(v, v)


@given(st.lists(st.integers(-(2**40), 2**40), min_size=1, max_size=8),
       st.lists(st.integers(-(2**40), 2**40), min_size=1, max_size=8),
       st.integers(1, 2**20), st.integers(1, 500))
def test_sgd_step_matches_fraction(ws, gs, lr, denom):
    n = min(len(ws), len(gs))
    ws, gs = ws[:n], gs[:n]
    got = sgd_step(np.array(ws, dtype=np.int64), np.array(gs, dtype=np.int64), lr, denom)
    assert got.tolist() == [w - ref_round(lr * g, Q16_ONE * denom) for w, g in zip(ws, gs)]


def test_bad_inputs_are_named():
    t = Tape()
    with pytest.raises(TypeError, match=r"leaf\(w\).*float64.*to_q16"):
        t.leaf(np.zeros(3), name="w")
    a, b = t.leaf(np.zeros((2, 3), np.int64)), t.leaf(np.zeros((2, 3), np.int64))
    with pytest.raises(ValueError, match=r"matmul: a is \(2, 3\), b is \(2, 3\)"):
        t.matmul(a, b)
    with pytest.raises(ValueError, match=r"add: a is \(2, 3\), b is \(2,\)"):
        t.add(a, t.leaf(np.zeros(2, np.int64)))
    with pytest.raises(TypeError, match="Node of this tape"):
        Tape().relu(a)
    with pytest.raises(RuntimeError, match="backward"):
        t.grad(a)
    d = t.leaf(np.zeros((2, 3), np.int64), requires_grad=False)
    t.backward(t.sum(t.add(a, d)))
    with pytest.raises(ValueError, match="requires_grad=False"):
        t.grad(d)


def test_other_integer_dtypes_convert_exactly_and_floats_are_refused():
    """uint64 values past int64 stay exact (Python ints: the range check then names the true
    magnitude; astype(int64) wrapped 2**64 - 1 to -1, silently), and the ops that took floats
    by truncation refuse them as the rest do (q16_mul(98304.7, ...) was 98304; sgd_step(...,
    lr_q16=0.9) was an update of 0; round_div(x, 2.9) divided by 2). to_q16 of a float past
    ~2.7e303 is a Q16OverflowError (it was numpy's overflow warning, then OverflowError from
    int(inf)). Controls: small unsigned values and integer lr / divisors work as before."""
    import warnings
    big = np.array([2**64 - 1], np.uint64)
    with pytest.raises(Q16OverflowError, match=r"magnitude 18446744073709551615 "):
        Tape().leaf(big)
    assert round_div(np.array([2**64 - 2], np.uint64), 2).tolist() == [2**63 - 1]
    assert from_q16(np.array([2**63], np.uint64)).tolist() == [2.0**47]
    with pytest.raises(Q16OverflowError, match=r"add: Q16 magnitude 9223372036854775809 "):
        q16_add(np.array([2**63 + 1], np.uint64), np.array([0]))
    assert Tape().leaf(np.array([5], np.uint8)).value.tolist() == [5]          # control
    with pytest.raises(TypeError, match=r"mul: a: .*float64.*to_q16"):
        q16_mul(np.array([98304.7]), np.array([65536]))
    with pytest.raises(TypeError, match=r"sgd_step: lr_q16: expected an integer, got 0.9"):
        sgd_step(np.array([0]), np.array([Q16_ONE]), 0.9)
    with pytest.raises(TypeError, match=r"round_div: d: expected an integer, got 2.9"):
        round_div(np.array([5]), 2.9)
    assert sgd_step(np.array([0]), np.array([Q16_ONE]), np.int64(3277)).tolist() == [-3277]
    assert round_div(np.array([5]), np.int32(2)).tolist() == [2]               # 2.5 -> even
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for x in (1.7e308, -1e305):
            with pytest.raises(Q16OverflowError, match=r"to_q16\(x\): .* \(~\d\.\d{3}e\+30\d in real"):
                to_q16([x], "x")


def test_object_arrays_must_hold_ints_and_to_q16_takes_real_numbers_only():
    """An object array of floats went through every op as if it held Q16 integers, truncated
    at the end (leaf 2.9 -> 2, sgd_step with g 0.7 -> no update, round_div returned floats:
    the QA helper's find); to_q16 took '1.5' and complex values (imaginary part dropped) and
    gave a bare OverflowError for 10**400. Controls: object arrays of Python ints (past int64
    too) stay exact, and to_q16 of ints and floats is unchanged."""
    for bad in (np.array([2.9], dtype=object), np.array([1, True], dtype=object),
                np.array([1, "2"], dtype=object)):
        with pytest.raises(TypeError, match=r"object array holding .*to_q16"):
            Tape().leaf(bad)
        with pytest.raises(TypeError, match=r"round_div: x: expected Q16 integers"):
            round_div(bad, 2)
        with pytest.raises(TypeError, match=r"sgd_step: g: expected Q16 integers"):
            sgd_step(np.array([0, 0]), np.resize(bad, 2), Q16_ONE)
    for bad in ("1.5", np.array([1 + 2j]), True, np.array([True]), [object()]):
        with pytest.raises(TypeError, match=r"to_q16: x must be real numbers"):
            to_q16(bad, "x")
    with pytest.raises(Q16OverflowError, match=r"to_q16\(x\)"):
        to_q16(10**400, "x")
    exact = np.array([2**70, -3], dtype=object)                       # controls
    assert round_div(exact, 2).tolist() == [2**69, -2]
    assert to_q16(np.array([1, 2**40], dtype=object)).tolist() == [Q16_ONE, 2**56]
    assert to_q16([1, 2.5]).tolist() == [Q16_ONE, 5 * Q16_ONE // 2]
    assert to_q16(np.float32(1.5)).tolist() == 3 * Q16_ONE // 2


# ------------------------------------------------------------------------------------------
# gradients: exact hand-derived integers
# ------------------------------------------------------------------------------------------

def test_hand_derived_integer_gradients_with_ties():
    # a = [5, -5, 3] (units of 2**-16), b = 0.5, c = 1.5
    # m = round(a*b / 2**16) = round([2.5, -2.5, 1.5]) = [2, -2, 2]       (ties to even)
    # L = sum(round(m*c / 2**16)) = round(3) + round(-3) + round(3) = 3
    # dL/dm = round(65536 * 98304 / 65536) = 98304 ;  dL/dc = round(65536 * m / 65536) = m
    # dL/db = round(98304 * a / 65536) = round([7.5, -7.5, 4.5]) = [8, -8, 4]   (ties to even)
    # dL/da = round(98304 * 32768 / 65536) = 49152
    t = Tape()
    a = t.leaf(np.array([5, -5, 3], dtype=np.int64))
    b = t.leaf(np.array([32768] * 3, dtype=np.int64))
    c = t.leaf(np.array([98304] * 3, dtype=np.int64))
    m = t.mul(a, b)
    L = t.sum(t.mul(m, c))
    t.backward(L)
    assert m.value.tolist() == [2, -2, 2]
    assert int(L.value) == 3
    assert t.grad(c).tolist() == [2, -2, 2]
    assert t.grad(b).tolist() == [8, -8, 4]
    assert t.grad(a).tolist() == [49152] * 3


def test_hand_derived_linear_sse():
    # X = [[1.5, -2], [0.5, 1]], w = [3, -1] (units 2**-16), y = [65542, -65536]
    # p = round([1.5*3 + 2, 0.5*3 - 1]) = round([6.5, 0.5]) = [6, 0]              (ties)
    # d = p - y = [-65536, 65536] (= -1.0, 1.0);  SSE = 65536 + 65536 = 131072 (2.0)
    # dL/dp = 2d = [-131072, 131072]
    # dL/dw0 = round(98304 * -131072 / 65536) + round(32768 * 131072 / 65536) = -196608 + 65536
    # dL/dw1 = round(-131072 * -131072 / 65536) + round(65536 * 131072 / 65536) = 262144 + 131072
    t = Tape()
    X = t.leaf(np.array([[98304, -131072], [32768, 65536]], dtype=np.int64), requires_grad=False)
    w = t.leaf(np.array([[3], [-1]], dtype=np.int64))
    y = t.leaf(np.array([[65542], [-65536]], dtype=np.int64), requires_grad=False)
    p = t.matmul(X, w)
    L = t.sse(p, y)
    t.backward(L)
    assert p.value.ravel().tolist() == [6, 0]
    assert int(L.value) == 131072
    assert t.grad(w).ravel().tolist() == [-131072, 393216]
    assert t.grad(p).ravel().tolist() == [-131072, 131072]


def test_matvec_and_mse_hand_values():
    # W = [[1, 2], [0.5, -1]], x = [0.25, 0.75]: Wx = [1.75, -0.625]; t = [1, 0]
    # mse = ((0.75)**2 + (0.625)**2) / 2 = (0.5625 + 0.390625) / 2 = 0.4765625 = 31232 / 65536
    # dmse/dWx = 2 (Wx - t) / 2 = [0.75, -0.625] ; dW = outer(g, x) = [[0.1875, 0.5625],
    #   [-0.15625, -0.46875]] ; dx = W^T g = [0.75 - 0.3125, 1.5 + 0.625] = [0.4375, 2.125]
    t = Tape()
    W = t.leaf(to_q16([[1, 2], [0.5, -1]]))
    x = t.leaf(to_q16([0.25, 0.75]))
    tgt = t.leaf(to_q16([1, 0]), requires_grad=False)
    L = t.mse(t.matvec(W, x), tgt)
    t.backward(L)
    assert int(L.value) == 31232
    assert t.grad(W).tolist() == to_q16([[0.1875, 0.5625], [-0.15625, -0.46875]]).tolist()
    assert t.grad(x).tolist() == to_q16([0.4375, 2.125]).tolist()


# ------------------------------------------------------------------------------------------
# gradients: float64 reference of the MLP with a propagated error bound
# ------------------------------------------------------------------------------------------

def mlp_f64(x, y, W1, b1, W2, b2, use_mask=True):
    """Plain float64 forward + hand-written backward of SSE(relu(x W1 + b1) W2 + b2, y)."""
    z = x @ W1 + b1
    h = np.maximum(z, 0)
    p = h @ W2 + b2
    d = p - y
    gp = 2 * d
    gh = gp @ W2.T
    gz = gh * (z > 0) if use_mask else gh
    return dict(L=float((d * d).sum()), W1=x.T @ gz, b1=gz.sum(0), W2=h.T @ gp, b2=gp.sum(0),
                z=z, h=h, d=d, gp=gp)


def mlp_q16(xq, yq, params):
    t = Tape()
    x, y = t.leaf(xq, requires_grad=False), t.leaf(yq, requires_grad=False)
    nodes = {k: t.leaf(v, name=k) for k, v in params.items()}
    h = t.relu(t.add(t.matmul(x, nodes["W1"]), nodes["b1"]))
    L = t.sse(t.add(t.matmul(h, nodes["W2"]), nodes["b2"]), y)
    t.backward(L)
    return {"L": int(L.value), **{k: t.grad(v) for k, v in nodes.items()}}


def error_bounds(r, x, W2):
    """Worst-case |Q16 - float64| per gradient, from u/2 per rounding, propagated op by op."""
    h, gp = np.abs(r["h"]), np.abs(r["gp"])
    n = x.shape[0]
    e_h = U / 2                                        # one rounding in x@W1 (+b1 exact, relu 1-Lip)
    e_p = np.abs(W2).sum() * e_h + U / 2               # h@W2: propagated + one rounding
    e_gp = 2 * e_p                                     # 2(p - y), exact from Q16 d
    e_gh = np.abs(W2).ravel() * e_gp + U / 2           # [H], one rounding per element
    gh = gp @ np.abs(W2).T + e_gh                      # |gh| upper bound (per row/col)
    return dict(
        W2=(h.T @ (np.ones_like(gp) * e_gp) + (np.ones_like(h).T @ (gp + e_gp)) * e_h
            + n * U / 2),
        b2=np.array([n * e_gp]),
        W1=np.abs(x).T @ np.ones_like(gh) * e_gh + n * U / 2,
        b1=n * e_gh,
        L=n * (2 * float(np.abs(r["d"]).max()) * e_p + e_p**2 + U / 2),
    )


@pytest.mark.parametrize("seed,n,f,hid", [(0, 40, 5, 8), (1, 97, 10, 16), (2, 7, 3, 2)])
def test_mlp_gradients_within_propagated_bound_of_float64(seed, n, f, hid):
    rng = np.random.default_rng(seed)
    params_q = {"W1": to_q16(rng.standard_normal((f, hid)) / np.sqrt(f)),
                "b1": to_q16(rng.standard_normal(hid) * 0.1),
                "W2": to_q16(rng.standard_normal((hid, 1)) / np.sqrt(hid)),
                "b2": to_q16([0.1])}
    xq, yq = to_q16(rng.standard_normal((n, f))), to_q16(rng.standard_normal((n, 1)))
    pf = {k: from_q16(v) for k, v in params_q.items()}        # the exact same numbers
    ref = mlp_f64(from_q16(xq), from_q16(yq), **pf)
    # precondition: no pre-activation within 2u of the relu kink (the mask is then the same)
    assert np.min(np.abs(ref["z"])) > 2 * U, "pick another seed: a pre-activation sits on the kink"
    got = mlp_q16(xq, yq, params_q)
    bounds = error_bounds(ref, from_q16(xq), pf["W2"])
    for k in ("W1", "b1", "W2", "b2"):
        err = np.abs(from_q16(got[k]) - ref[k].reshape(got[k].shape))
        bound = np.asarray(bounds[k]).reshape(got[k].shape)
        assert np.all(err <= bound), (k, float((err - bound).max()))
        # the bound is tight enough to mean something: a few u per reduced row, not a blanket
        assert float(bound.max()) < 20 * n * U
    assert abs(from_q16(np.asarray(got["L"])) - ref["L"]) <= bounds["L"]
    # negative control: a reference without the relu mask is far outside the same bound
    wrong = mlp_f64(from_q16(xq), from_q16(yq), use_mask=False, **pf)
    assert np.any(ref["z"] < 0)                       # some units are masked ...
    assert np.any(np.abs(from_q16(got["W1"]) - wrong["W1"]) > bounds["W1"])


# ------------------------------------------------------------------------------------------
# the property data parallelism relies on
# ------------------------------------------------------------------------------------------

@given(st.integers(0, 2**31), st.lists(st.integers(1, 30), min_size=1, max_size=6))
def test_shard_gradients_sum_exactly_to_full_batch(seed, sizes):
    rng = np.random.default_rng(seed)
    n, f, hid = sum(sizes), 4, 5
    params = {"W1": to_q16(rng.standard_normal((f, hid))), "b1": to_q16(rng.standard_normal(hid)),
              "W2": to_q16(rng.standard_normal((hid, 1))), "b2": to_q16(rng.standard_normal(1))}
    xq, yq = to_q16(rng.standard_normal((n, f))), to_q16(rng.standard_normal((n, 1)))
    full = mlp_q16(xq, yq, params)
    acc = {k: 0 for k in full}
    lo = 0
    for s in sizes:
        part = mlp_q16(xq[lo:lo + s], yq[lo:lo + s], params)
        acc = {k: acc[k] + part[k] for k in full}
        lo += s
    for k in full:
        assert np.array_equal(np.asarray(acc[k]), np.asarray(full[k])), k


def test_round_once_after_batch_sum_would_not_be_shard_additive():
    """Negative control for the test above: rounding A^T g once after the batch sum (instead of
    per row) breaks exact additivity -- which is why the tape rounds per row."""
    rng = np.random.default_rng(3)
    a = rng.integers(-(2**17), 2**17, size=(64, 4))
    g = rng.integers(-(2**17), 2**17, size=(64, 3))
    once_full = q16_matmul(a.T.copy(), g)
    once_split = q16_matmul(a[:32].T.copy(), g[:32]) + q16_matmul(a[32:].T.copy(), g[32:])
    assert not np.array_equal(once_full, once_split)
