"""Tests of the `q8` precision on the quantized weight types besides Q8_0 (matmul_q8 wtype=...:
Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K).

Owns: the proof that each type's result lies inside the error bound of its arithmetic contract
(csrc/nx_lowp.h) against float64 x @ dequant(w).T with gguf's dequantize, that the bound is not
vacuous (a wrong sub-block scale order, a dropped min term, swapped element halves all fail it),
that the Q4_K and Q6_K generic specs compute the contract exactly (a numpy model on a numpy
decoding of the block bytes, itself checked against gguf's dequantize), that every SIMD variant
reproduces the spec bit for bit (tile, band and token-batch tails), and that bad shapes fail
clearly. Must not: use the code under test to produce expected values.

Weights: Q4_0/Q4_1/Q5_0/Q5_1 by gguf.quants.quantize on random data; the K-quants (gguf's Python
quantizer does not implement them) as random valid blocks built byte by byte: random code and
scale bytes, float16 d/dmin fields overwritten with values in a sane range.
"""
import gguf
import numpy as np
import pytest
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from hypothesis import given, settings
from hypothesis import strategies as st

from kernelutil import bits
from nxhpc import _kernels as K
from nxhpc.formats.weights import WeightTensor
from nxhpc.nn import linear

GT = gguf.GGMLQuantizationType
Q8_VARIANTS = K.lowp_variants("q8")
SIMD_Q8 = Q8_VARIANTS[1:]
EPS32, EPS64 = 2.0 ** -24, 2.0 ** -53
Q8_FLUSH = 2.0 ** -126
# type -> (parts per 32-group H, has a min, float16 fields (byte offsets) of d / dmin or m)
SHAPE = {"Q4_0": (1, False, (0,)), "Q5_0": (1, False, (0,)), "Q4_1": (1, True, (0, 2)),
         "Q5_1": (1, True, (0, 2)), "Q4_K": (1, True, (0, 2)), "Q5_K": (1, True, (0, 2)),
         "Q6_K": (2, False, (208,)), "Q3_K": (2, False, (108,)), "Q2_K": (2, True, (80, 82))}
TYPES = list(SHAPE)
LEGACY = ("Q4_0", "Q4_1", "Q5_0", "Q5_1")


def elems(t):
    return gguf.GGML_QUANT_SIZES[GT[t]][0]


def make_w(rng, t, N, Kd, dlo=2.0 ** -12, dhi=2.0 ** -7):
    """Random weights of type t, raw bytes uint8 [N, rowbytes]."""
    if t in LEGACY:
        return gguf_quantize((rng.standard_normal((N, Kd)) * 0.05).astype(np.float32), GT[t])
    e, b = gguf.GGML_QUANT_SIZES[GT[t]]
    nb = N * Kd // e
    raw = rng.integers(0, 256, (nb, b), dtype=np.uint8)
    for off in SHAPE[t][2]:
        raw[:, off:off + 2] = rng.uniform(dlo, dhi, nb).astype("<f2").view(np.uint8).reshape(nb, 2)
    return raw.reshape(N, Kd // e * b)


def dequant(w, t):
    with np.errstate(all="ignore"):
        return gguf_dequantize(w, GT[t]).astype(np.float64)


def zero_field(w, t, which, Kd):
    """w with the float16 field `which` (0: d, 1: dmin / m) of every block set to +0."""
    e, b = gguf.GGML_QUANT_SIZES[GT[t]]
    blocks = w.copy().reshape(-1, b)
    off = SHAPE[t][2][which]
    blocks[:, off:off + 2] = 0
    return blocks.reshape(w.shape)


def q8_act(x):
    """x~ = qx * dx in float64 (gguf's Q8_0 codes of x, the float32 scale max|x|/127 of nx_lowp.h)."""
    T, Kd = x.shape
    qb = gguf_quantize(x, GT.Q8_0).reshape(T, Kd // 32, 34)
    qx = qb[:, :, 2:].view(np.int8).astype(np.float64)
    d = np.abs(x.reshape(T, Kd // 32, 32)).max(axis=2) / np.float32(127)
    d = np.where(d < Q8_FLUSH, np.float32(0), d).astype(np.float32)
    return (qx * d[:, :, None].astype(np.float64)).reshape(T, Kd)


def q8_bound(x, w, t):
    """The contract's error bound (nx_lowp.h) of every output, with ref = x @ dequant(w).T:
    sum|x - x~||w| + gamma_{n+2} sum|x~| |w|' + [min] 2^-24 sum|x~ w| + 2n 2^-130, |w|' = |sw qw|
    + |mw| read back from gguf's dequantize of w with the min field zeroed (sw*qw, exact) and with
    d zeroed (mw); plus the float64 reference's own rounding."""
    H, has_min, _ = SHAPE[t]
    Kd = x.shape[1]
    wd = np.abs(dequant(w, t))
    xt = q8_act(x)
    if has_min:
        wabs = np.abs(dequant(zero_field(w, t, 1, Kd), t)) + np.abs(dequant(zero_field(w, t, 0, Kd), t))
    else:
        wabs = wd
    n = Kd // 32 * (1 + H * has_min)
    g = (n + 2) * EPS32 / (1 - (n + 2) * EPS32)
    x64 = x.astype(np.float64)
    b = np.abs(x64 - xt) @ wd.T + g * (np.abs(xt) @ wabs.T) + 2 * n * 2.0 ** -130
    if has_min:
        b += EPS32 * (np.abs(xt) @ wd.T)
    return b + 3 * Kd * EPS64 * (np.abs(x64) @ wd.T)


def run_q8(x, w, t, isa, n0=0, n1=None, bias=None):
    out = np.full((x.shape[0], w.shape[0]), np.nan, np.float32)
    assert K.matmul_q8(x, w, out, n0, n1, wtype=t, bias=bias, isa=isa) is out
    return out


def same(a, b):
    """Bit equality, except that any two NaNs compare equal (payloads are not promised)."""
    return bool(np.all((bits(a) == bits(b)) | (np.isnan(a) & np.isnan(b))))


# ----------------------------------------------------------------------------- error bound


def _rand_case(t, seed):
    rng = np.random.default_rng(seed)
    e = elems(t)
    T, N = int(rng.integers(1, 12)), int(rng.integers(1, 70))
    Kd = e * int(rng.integers(1, 2304 // e + 1))
    x = (rng.standard_normal((T, Kd)) * 10.0 ** rng.uniform(-3, 3)).astype(np.float32)
    return x, make_w(rng, t, N, Kd)


@pytest.mark.parametrize("isa", Q8_VARIANTS)
@pytest.mark.parametrize("t", TYPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_error_bound_vs_float64(t, isa, seed):
    x, w = _rand_case(t, 100 * seed + TYPES.index(t))
    got = run_q8(x, w, t, isa).astype(np.float64)
    ref = x.astype(np.float64) @ dequant(w, t).T
    bound = q8_bound(x, w, t)
    assert np.isfinite(got).all()
    assert (np.abs(got - ref) <= bound).all(), (t, (np.abs(got - ref) / bound).max())


def _mutations(t, w):
    """Wrong decodings of w (as gguf-dequantizable bytes) the bound must reject."""
    e, b = gguf.GGML_QUANT_SIZES[GT[t]]
    out = {}
    blocks = w.copy().reshape(-1, b)
    if t in LEGACY:                                   # element halves 0..15 <-> 16..31 swapped
        qs = {"Q4_0": 2, "Q4_1": 4, "Q5_0": 6, "Q5_1": 8}[t]
        v = blocks[:, qs:qs + 16]
        blocks[:, qs:qs + 16] = (v >> 4) | (v << 4)
        out["halves swapped"] = blocks
    else:                                             # scales of parts 0 and 1 swapped
        sc = {"Q4_K": 4, "Q5_K": 4, "Q6_K": 192, "Q3_K": 96, "Q2_K": 0}[t]
        blocks[:, [sc, sc + 1]] = blocks[:, [sc + 1, sc]]
        out["sub-block scales swapped"] = blocks
    if SHAPE[t][1]:
        out["min dropped"] = zero_field(w, t, 1, None)
    return {k: v.reshape(w.shape) for k, v in out.items()}


@pytest.mark.parametrize("t", TYPES)
def test_error_bound_is_not_vacuous(t):
    """The bound rejects a wrong scale order (or element order) and a dropped min term."""
    rng = np.random.default_rng(7 + TYPES.index(t))
    Kd = 512
    x = rng.standard_normal((6, Kd)).astype(np.float32)
    x[:, :32] += 3.0                                  # a nonzero mean: the min term matters
    w = make_w(rng, t, 40, Kd)
    got = run_q8(x, w, t, None).astype(np.float64)
    bound = q8_bound(x, w, t)
    assert (np.abs(got - x.astype(np.float64) @ dequant(w, t).T) <= bound).all()
    for name, wrong in _mutations(t, w).items():
        ref = x.astype(np.float64) @ dequant(wrong, t).T
        assert not (np.abs(got - ref) <= bound).all(), (t, name)


# ----------------------------------------------------------------------------- exact models


def _np_codes_scales(w, t):
    """Q4_K / Q6_K codes qw [rows, K] and per-part sw, mw [rows, K/32*H], decoded in numpy from
    the layout comments of csrc/nx_quants.h (ggml's block layouts)."""
    e, b = gguf.GGML_QUANT_SIZES[GT[t]]
    blk = w.reshape(-1, b).astype(np.int64)
    nb = blk.shape[0]
    f16 = lambda o: blk[:, o:o + 2].astype(np.uint8).copy().view("<f2")[:, 0].astype(np.float32)
    if t == "Q4_K":
        d, dmin, s, qs = f16(0), f16(2), blk[:, 4:16], blk[:, 16:144]
        q = np.stack([(qs[:, 32 * c:32 * c + 32] >> (4 * h)) & 15
                      for c in range(4) for h in range(2)], 1).reshape(nb, 256)
        sc = np.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 15) | ((s[:, 0:4] >> 6) << 4)], 1)
        mn = np.concatenate([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], 1)
        sw = d[:, None] * sc.astype(np.float32)
        mw = -(dmin[:, None] * mn.astype(np.float32))
    else:  # Q6_K
        ql, qh, sc, d = blk[:, :128], blk[:, 128:192], blk[:, 192:208], f16(208)
        sc = np.where(sc > 127, sc - 256, sc)
        parts = []
        for h in range(2):
            for r in range(4):
                lo = (ql[:, 64 * h + 32 * (r % 2):64 * h + 32 * (r % 2) + 32] >> (4 * (r // 2))) & 15
                hi = (qh[:, 32 * h:32 * h + 32] >> (2 * r)) & 3
                parts.append((lo | hi << 4) - 32)
        q = np.stack(parts, 1).reshape(nb, 256)
        sw = d[:, None] * sc.astype(np.float32)
        mw = np.zeros_like(sw)
    rows = w.shape[0]
    return q.reshape(rows, -1), sw.reshape(rows, -1).astype(np.float32), mw.reshape(rows, -1)


def _fma32(p, c):
    """float32 fma: the exact float64 product p plus float32 c, rounded once (TwoSum: exact
    unless S lands on a float32 midpoint with a nonzero error term)."""
    c64 = c.astype(np.float64)
    S = p + c64
    bp = S - p
    e = (p - (S - bp)) + (c64 - bp)
    r = S.astype(np.float32)
    r64 = r.astype(np.float64)
    nb = np.nextafter(r, np.where(S > r64, np.inf, -np.inf).astype(np.float32))
    at_mid = (S != r64) & (S == (r64 + nb.astype(np.float64)) / 2) & (e != 0)
    return np.where(at_mid & ((nb.astype(np.float64) > S) == (e > 0)), nb, r).astype(np.float32)


def q8_model(x, w, t, order="right"):
    """The contract of nx_lowp.h for Q4_K / Q6_K in numpy, int64 dots per part. Q4_K (H = 1):
    s = dx*sw rounded to float32, acc = fma32(isum*s, acc), then acc = fma32((dx*xsum)*mw, acc).
    Q6_K (H = 2): y = float32(isum_0*sw_0), y = fma32(isum_1*sw_1, y), acc = fma32(y*dx, acc)."""
    T, Kd = x.shape
    H = SHAPE[t][0]
    P = 32 // H
    qb = gguf_quantize(x, GT.Q8_0).reshape(T, Kd // 32, 34)
    qx = qb[:, :, 2:].view(np.int8).astype(np.int64).reshape(T, Kd)
    dx = np.abs(x.reshape(T, Kd // 32, 32)).max(axis=2) / np.float32(127)
    dx = np.where(dx < Q8_FLUSH, np.float32(0), dx).astype(np.float32)
    qw, sw, mw = _np_codes_scales(w, t)
    if order == "parts swapped":
        sw = sw.reshape(sw.shape[0], -1, 2)[:, :, ::-1].reshape(sw.shape)
    acc = np.zeros((T, w.shape[0]), np.float32)
    f64 = lambda a: np.asarray(a, np.float64)
    for b in range(Kd // 32):
        d = dx[:, b, None]
        isum = [qx[:, 32 * b + P * h:32 * b + P * (h + 1)] @ qw[:, 32 * b + P * h:32 * b + P * (h + 1)].T
                for h in range(H)]
        if H == 1:
            s = (d * sw[None, :, b]).astype(np.float32)
            acc = _fma32(f64(isum[0]) * f64(s), acc)
            a = (d * qx[:, 32 * b:32 * b + 32].sum(1, keepdims=True).astype(np.float32))
            acc = _fma32(f64(a.astype(np.float32)) * f64(mw[None, :, b]), acc)
        else:
            y = (f64(isum[0]) * f64(sw[None, :, 2 * b])).astype(np.float32)     # exact product
            y = _fma32(f64(isum[1]) * f64(sw[None, :, 2 * b + 1]), y)
            acc = _fma32(f64(y) * f64(d), acc)
    return acc


@pytest.mark.parametrize("t", ["Q4_K", "Q6_K"])
def test_numpy_decoding_matches_gguf(t):
    """The test's own decoding (codes, scales, mins) rebuilds gguf's dequantize exactly:
    float32(sw*qw + mw) per element (sw*qw exact; one rounding of the sum)."""
    rng = np.random.default_rng(21)
    w = make_w(rng, t, 9, 768)
    qw, sw, mw = _np_codes_scales(w, t)
    P = 32 // SHAPE[t][0]
    swe, mwe = np.repeat(sw, P, axis=1), np.repeat(mw, P, axis=1)
    v = (swe * qw.astype(np.float32)).astype(np.float32)
    v = (v + mwe).astype(np.float32) if SHAPE[t][1] else v
    assert np.array_equal(bits(v), bits(gguf_dequantize(w, GT[t]).astype(np.float32)))


@pytest.mark.parametrize("t", ["Q4_K", "Q6_K"])
def test_generic_matches_exact_model(t):
    rng = np.random.default_rng(22 + (t == "Q6_K"))
    x = (rng.standard_normal((5, 512)) * 3).astype(np.float32)
    w = make_w(rng, t, 23, 512)
    got = run_q8(x, w, t, "generic")
    assert same(got, q8_model(x, w, t))
    if t == "Q6_K":                                   # the part order is exercised by the data
        assert not same(got, q8_model(x, w, t, order="parts swapped"))


# ----------------------------------------------------------------------------- bit identity


def _cases(t):
    e = elems(t)
    # tails of the 6 x 32 (VNNI) and 16 x 16 (AMX) tiles; two token blocks (T > 9/8 MC, MC 264
    # VNNI, 512 AMX); N > NC (128 VNNI, 256 AMX); K > KC (2048)
    ks = [32, 96, 2080] if e == 32 else [256, 2304]
    return [(1, ks[0], 1), (7, ks[0], 33), (13, ks[1], 97), (300, ks[0], 20), (6, ks[-1], 45),
            (4, ks[-1], 130), (600, ks[0], 275)]


@pytest.mark.skipif(not SIMD_Q8, reason="no SIMD q8 variant on this CPU")
@pytest.mark.parametrize("isa", SIMD_Q8)
@pytest.mark.parametrize("t", TYPES)
def test_simd_bit_identical_to_generic(t, isa):
    for T, Kd, N in _cases(t):
        rng = np.random.default_rng(T * 1000 + Kd + N)
        x = (rng.standard_normal((T, Kd))).astype(np.float32)
        w = make_w(rng, t, N, Kd)
        b = rng.standard_normal(N).astype(np.float32)
        assert same(run_q8(x, w, t, isa, bias=b), run_q8(x, w, t, "generic", bias=b)), (T, Kd, N)


@pytest.mark.skipif(not SIMD_Q8, reason="no SIMD q8 variant on this CPU")
@pytest.mark.parametrize("isa", SIMD_Q8)
@pytest.mark.parametrize("t", TYPES)
def test_simd_extreme_codes_and_specials(t, isa):
    """All-ones / all-zero code bytes (the largest |isum| and the offsets), float16 subnormal,
    huge, inf (min field where there is one) and NaN scales, tiny and NaN / inf activations: the
    SIMD variant keeps the spec's bits (NaN payloads aside); a NaN or inf activation turns its
    output row NaN (as for Q8_0), a NaN scale its column."""
    e = elems(t)
    Kd, N = 2 * e if e == 256 else 128, 35
    rng = np.random.default_rng(5)
    w = make_w(rng, t, N, Kd)
    b = gguf.GGML_QUANT_SIZES[GT[t]][1]
    blocks = w.reshape(N, -1, b)
    fields = [o for f in SHAPE[t][2] for o in (f, f + 1)]
    codes = [i for i in range(b) if i not in fields]
    blocks[0][:, codes] = 0xFF
    blocks[1][:, codes] = 0x00
    blocks[2][:, SHAPE[t][2][0]:SHAPE[t][2][0] + 2] = np.array([1], "<u2").view(np.uint8)
    blocks[3][:, SHAPE[t][2][0]:SHAPE[t][2][0] + 2] = np.array([60000], "<f2").view(np.uint8)
    blocks[4][:, SHAPE[t][2][-1]:SHAPE[t][2][-1] + 2] = np.array([np.inf], "<f2").view(np.uint8)
    blocks[5][:, SHAPE[t][2][0]:SHAPE[t][2][0] + 2] = np.array([np.nan], "<f2").view(np.uint8)
    x = np.ones((9, Kd), np.float32)
    x[1] = -1.0
    x[2, ::2] = -1.0
    x[3] = np.linspace(-3, 3, Kd, dtype=np.float32)
    x[4] = 1e-30
    x[5, 7] = np.nan
    x[6, 40] = np.inf
    x[7] = 1e-38 * np.sign(np.sin(np.arange(Kd))).astype(np.float32)
    x[8] = 2.0e7 * np.sin(np.arange(Kd)).astype(np.float32)
    got, want = run_q8(x, w, t, isa), run_q8(x, w, t, "generic")
    assert same(got, want)
    assert np.isnan(want[5]).all() and np.isnan(want[6]).all()
    assert np.isnan(want[:, 5]).all()
    keep = [0, 1, 2, 3, 4, 7, 8]
    cols = [c for c in range(N) if c not in (4, 5)]
    assert np.isfinite(want[np.ix_(keep, cols)]).all()
    assert not np.isfinite(want[:, 4]).all()


@pytest.mark.parametrize("isa", Q8_VARIANTS)
@pytest.mark.parametrize("t", ["Q4_K", "Q6_K", "Q2_K", "Q4_1"])
def test_band_and_batch_invariance(t, isa):
    rng = np.random.default_rng(9)
    T, N = 20, 140
    Kd = 2304 if elems(t) == 256 else 2080
    x, w = rng.standard_normal((T, Kd)).astype(np.float32), make_w(rng, t, N, Kd)
    full = run_q8(x, w, t, isa)
    out = np.full((T, N), np.nan, np.float32)
    for a, b in zip([0, 3, 32, 33, 129], [3, 32, 33, 129, 140]):
        K.matmul_q8(x, w, out, a, b, wtype=t, isa=isa)
    assert same(out, full)
    part = np.full((T, N), -7.0, np.float32)
    K.matmul_q8(x, w, part, 33, 129, wtype=t, isa=isa)
    assert (part[:, :33] == -7).all() and (part[:, 129:] == -7).all()
    assert same(part[:, 33:129], full[:, 33:129])
    rows = np.concatenate([run_q8(x[a:b].copy(), w, t, isa) for a, b in [(0, 6), (6, 7), (7, 20)]])
    assert same(rows, full)


@pytest.mark.skipif(not SIMD_Q8, reason="no SIMD q8 variant on this CPU")
@settings(max_examples=40, deadline=None)
@given(t=st.sampled_from(TYPES), T=st.integers(1, 20), N=st.integers(1, 70),
       nb=st.integers(1, 3), seed=st.integers(0, 2 ** 31 - 1), log_s=st.floats(-4, 4))
def test_simd_matches_generic_on_random_shapes(t, T, N, nb, seed, log_s):
    rng = np.random.default_rng(seed)
    Kd = nb * (256 if elems(t) == 256 else 32 * int(rng.integers(1, 9)))
    x = (rng.standard_normal((T, Kd)) * 10.0 ** log_s).astype(np.float32)
    w = make_w(rng, t, N, Kd)
    n0 = int(rng.integers(0, N))
    n1 = int(rng.integers(n0, N + 1))
    for isa in SIMD_Q8:
        assert same(run_q8(x, w, t, isa, n0, n1), run_q8(x, w, t, "generic", n0, n1)), isa


def test_q8_0_unchanged_by_wtype_keyword():
    """The old positional call and wtype="Q8_0" / the gguf id are the same kernel."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 96)).astype(np.float32)
    w = gguf_quantize(rng.standard_normal((7, 96)).astype(np.float32), GT.Q8_0)
    a = np.zeros((5, 7), np.float32)
    K.matmul_q8(x, w, a)
    for wt in ("Q8_0", "q8_0", GT.Q8_0, 8):
        assert np.array_equal(bits(run_q8(x, w, wt, None)), bits(a))


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("t", ["Q4_K", "Q6_K", "Q5_K", "Q2_K", "Q3_K"])
def test_k_quants_need_k_multiple_of_256(t):
    b = gguf.GGML_QUANT_SIZES[GT[t]][1]
    x = np.ones((2, 384), np.float32)
    out = np.full((2, 3), 5.0, np.float32)
    with pytest.raises(ValueError, match="matmul_q8.*multiple of 256"):
        K.matmul_q8(x, np.zeros((3, b * 2), np.uint8), out, wtype=t)
    assert (out == 5).all()


def test_bad_wtype_and_weights_raise_clear_errors():
    x = np.ones((2, 256), np.float32)
    out = np.zeros((2, 3), np.float32)
    for wt, exc in (("F16", ValueError), ("BF16", ValueError), ("F32", ValueError),
                    ("Q9_9", ValueError), (None, TypeError), (2.0, TypeError)):
        with pytest.raises(exc, match="matmul_q8"):
            K.matmul_q8(x, np.zeros((3, 144), np.uint8), out, wtype=wt)
    with pytest.raises(ValueError, match="matmul_q8.*144"):
        K.matmul_q8(x, np.zeros((3, 145), np.uint8), out, wtype="Q4_K")
    with pytest.raises(TypeError, match="matmul_q8"):
        K.matmul_q8(x, np.zeros((3, 72), np.uint16), out, wtype="Q4_K")
    with pytest.raises(ValueError, match="matmul_q8.*multiple of 32"):
        K.matmul_q8(np.ones((2, 48), np.float32), np.zeros((3, 27), np.uint8), out, wtype="Q4_0")


# ----------------------------------------------------------------------------- the seam


def test_linear_q8_types_match_kernels():
    """nn.linear's list of q8 types is the kernels' (the C table nx_q8w), and holds no float type."""
    assert set(linear.Q8_WEIGHT_TYPES) == set(K.Q8_WEIGHT_TYPES) == set(SHAPE) | {"Q8_0"}
    assert not {"F32", "F16", "BF16"} & set(K.Q8_WEIGHT_TYPES)


@pytest.mark.parametrize("t", ["Q4_K", "Q6_K", "Q4_0"])
def test_linear_runs_q8_on_quantized_types(t):
    """precision q8 on a Q4_K / Q6_K / Q4_0 weight is matmul_q8 (not bf16's bits), band only."""
    rng = np.random.default_rng(4)
    N, Kd = 48, 512
    raw = make_w(rng, t, N, Kd)
    wt = WeightTensor(f"blk.{t}", int(GT[t]), (N, Kd), raw)
    x = rng.standard_normal((9, Kd)).astype(np.float32)
    assert linear.effective_precision(wt, "q8") == "q8"
    assert linear.effective_precision(wt, "bf16") == "bf16"
    got = np.full((9, N), -3.0, np.float32)
    linear.matmul(K, x, wt, got, 5, 40, "q8")
    want = np.full((9, N), -3.0, np.float32)
    K.matmul_q8(x, raw, want, 5, 40, wtype=t)
    assert np.array_equal(bits(got), bits(want))
    bf = np.full((9, N), -3.0, np.float32)
    K.matmul_bf16(x, raw, t, bf, 5, 40)
    assert not np.array_equal(got, bf)
