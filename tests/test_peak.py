"""Tests of the peak loops (csrc/nx_peak.h, nxhpc._kernels.peak) and their timing helper
(nxhpc.runtime.peak).

The loops exist to be timed, so what is tested is that they run the instructions their kind
names, on every accumulator, for exactly the iterations asked: after a random number of
iterations on random operands, each kind's accumulators equal an independent evaluation of its
recurrence (nx_peak.h): the FMA chains against exact rational arithmetic rounded once to
float32 (a separate multiply and add would differ: a negative control shows it does); the int8
dot products against numpy int64 closed forms (wrapping mod 2^32 like the instructions); the
bfloat16 ones on small integers, where every partial sum is exact. AMX tiles are checked in
their documented B layout (k quads / pairs of a column side by side), with the plain
row-major reading as the negative control. Under NXHPC_DISABLE_SIMD=1 every kind is
unsupported, which the tests assert instead. No speed is asserted.
"""
import os
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nxhpc import _kernels as K
from nxhpc.runtime import peak as P

SUPPORTED = K.peak_supported()
DISABLED = K.cpu_features()["simd_disabled"]
# The contract of nx_peak.h: kind -> (ISA, operations per iteration).
CONTRACT = {"fma_ymm": ("avx2", 12 * 8 * 2), "i8_ymm": ("avx2", 12 * 16 * 2 * 2), "fma_zmm": ("avx512", 16 * 16 * 2),
            "vnni_zmm": ("avx512", 16 * 16 * 4 * 2), "bf16_zmm": ("avx512bf16", 16 * 16 * 2 * 2),
            "amx_int8": ("amx", 4 * 16 * 16 * 64 * 2), "amx_bf16": ("amx", 4 * 16 * 16 * 32 * 2),
            "vnni_ymm": ("avxvnni", 12 * 8 * 4 * 2)}
SEEDS = st.integers(0, 2 ** 32 - 1)


def need(kind):
    """Skip unless `kind` runs here; where it does not, first check that it raises."""
    if kind not in SUPPORTED:
        with pytest.raises(ValueError, match="not supported"):
            K.peak(kind, 1)
        pytest.skip(f"{kind} is not supported here" + (" (NXHPC_DISABLE_SIMD)" if DISABLED else ""))


def wrap32(v):
    """int64 values reduced to int32 two's complement (the instructions' wrap-around)."""
    return ((np.asarray(v, np.int64) + 2 ** 31) % 2 ** 32 - 2 ** 31).astype(np.int32)


def bf16_bits(v):
    """bfloat16 bits of float32 values that bfloat16 holds exactly (small integers here)."""
    bits = np.asarray(v, np.float32).view(np.uint32)
    assert (bits & 0xFFFF == 0).all()
    return (bits >> 16).astype(np.uint16)


def round_f32(q: Fraction) -> float:
    """q rounded once to the nearest float32, ties to even (normal range, as the tests keep)."""
    if q == 0:
        return 0.0
    sign, q = (-1 if q < 0 else 1), abs(q)
    e = q.numerator.bit_length() - q.denominator.bit_length()
    if Fraction(2) ** e > q:
        e -= 1                                 # now 2^e <= q < 2^(e+1)
    assert -126 <= e <= 127, q
    m = q / Fraction(2) ** (e - 23)            # in [2^23, 2^24)
    n = m.numerator // m.denominator
    r = m - n
    if r > Fraction(1, 2) or (r == Fraction(1, 2) and n % 2):
        n += 1
    return sign * float(Fraction(n) * Fraction(2) ** (e - 23))


# ------------------------------------------------------------------ the table


def test_kinds_and_their_isas():
    assert K.PEAK_KINDS == P.KINDS == tuple(CONTRACT)
    info = K.peak_kinds()
    isas = K.cpu_features()["isas"]
    for kind, (isa, ops) in CONTRACT.items():
        assert info[kind]["isa"] == isa and info[kind]["ops_per_iter"] == ops
        expect = isas[isa]["supported"] and not DISABLED
        assert info[kind]["supported"] == expect == (kind in SUPPORTED), kind
    assert P.supported() == SUPPORTED


def test_disable_simd_makes_every_kind_unsupported():
    code = ("from nxhpc import _kernels as K; from nxhpc.runtime import peak as P\n"
            "assert K.peak_supported() == [] and P.peaks() == {}, K.peak_supported()\n"
            "for k in K.PEAK_KINDS:\n"
            "    try: K.peak(k, 1)\n"
            "    except ValueError as e: assert 'NXHPC_DISABLE_SIMD' in str(e), e\n"
            "    else: raise AssertionError(k)\n"
            "print(sorted(K.peak_supported()))")
    env = dict(os.environ, NXHPC_DISABLE_SIMD="1")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    # negative control: "0" means enabled, and then the kinds the CPU has are back
    env["NXHPC_DISABLE_SIMD"] = "0"
    r = subprocess.run([sys.executable, "-c", "from nxhpc import _kernels as K; "
                        "print(K.peak_supported())"], env=env, capture_output=True, text=True,
                       timeout=60)
    isas = K.cpu_features()["isas"]
    assert eval(r.stdout) == [k for k, (isa, _) in CONTRACT.items() if isas[isa]["supported"]]


# ------------------------------------------------------------------ argument checks


def test_unknown_and_unsupported_kinds_raise():
    with pytest.raises(ValueError, match="fma_zmm"):
        K.peak("fma_xmm", 1)
    with pytest.raises(ValueError, match="kind must be one of"):
        K.peak(None, 1)
    for kind in CONTRACT:
        if kind not in SUPPORTED:
            with pytest.raises(ValueError, match=r"supported: \["):
                K.peak(kind, 1)
            with pytest.raises(ValueError, match="not supported"):
                P.measure(kind, 0.01)


@pytest.mark.parametrize("kind", list(CONTRACT))
def test_iters_and_operands_are_validated(kind):
    need(kind)
    for bad in (-1, K.PEAK_MAX_ITERS + 1):
        with pytest.raises(ValueError, match="iters must be in"):
            K.peak(kind, bad)
    for bad in (1.0, "3", True, None):
        with pytest.raises(TypeError, match="iters must be an int"):
            K.peak(kind, bad)
    lay = K.peak_kinds()[kind]
    dt, shape = lay["acc"]
    with pytest.raises(ValueError, match="shape"):
        K.peak(kind, 1, acc=np.zeros(shape[:-1] + (shape[-1] + 1,), dt))
    other = np.float64 if dt != "float64" else np.float32
    with pytest.raises(TypeError, match=f"must be {lay['a'][0]}"):
        K.peak(kind, 1, a=np.zeros(lay["a"][1], other))
    with pytest.raises(TypeError, match="numpy.ndarray"):
        K.peak(kind, 1, b=[0] * int(np.prod(lay["b"][1])))
    with pytest.raises(ValueError, match="seconds"):
        P.measure(kind, 0)


@pytest.mark.parametrize("kind", list(CONTRACT))
@settings(max_examples=5)
@given(seed=SEEDS)
def test_ops_count_and_acc_copy(kind, seed):
    need(kind)
    rng = np.random.default_rng(seed)
    dt, shape = K.peak_kinds()[kind]["acc"]
    acc = rng.integers(-1000, 1000, shape).astype(dt)
    keep = acc.copy()
    n = int(rng.integers(0, 50))
    ops, out = K.peak(kind, n, acc=acc)
    assert ops == n * CONTRACT[kind][1]
    assert (acc == keep).all() and out is not acc          # the caller's array is not written
    ops, out = K.peak(kind, 0, acc=acc)
    assert ops == 0 and (out == keep).all()                 # zero iterations: acc unchanged


# ------------------------------------------------------------------ recurrences


@pytest.mark.parametrize("kind,lanes,chains", [("fma_ymm", 8, 12), ("fma_zmm", 16, 16)])
@settings(max_examples=8)
@given(seed=SEEDS, iters=st.integers(1, 12))
def test_fma_chains_round_once(kind, lanes, chains, seed, iters):
    """acc := fmaf(acc, a, b): exact rational value rounded once to float32 per step."""
    need(kind)
    rng = np.random.default_rng(seed)
    a = rng.uniform(0.5, 1.0, lanes).astype(np.float32) * rng.choice([-1, 1], lanes)
    a = a.astype(np.float32)
    b = rng.uniform(1.0, 2.0, lanes).astype(np.float32)
    acc = rng.uniform(-4, 4, (chains, lanes)).astype(np.float32)
    ops, out = K.peak(kind, iters, a, b, acc)
    fa, fb = [Fraction(float(v)) for v in a], [Fraction(float(v)) for v in b]
    ref = np.empty((chains, lanes), np.float64)
    two_roundings = np.empty_like(ref)                      # negative control: mul, then add
    for c in range(chains):
        for lane in range(lanes):
            x = y = float(acc[c, lane])
            for _ in range(iters):
                x = round_f32(Fraction(x) * fa[lane] + fb[lane])
                y = round_f32(Fraction(round_f32(Fraction(y) * fa[lane])) + fb[lane])
            ref[c, lane], two_roundings[c, lane] = x, y
    assert ops == iters * chains * lanes * 2
    np.testing.assert_array_equal(out.astype(np.float64), ref)
    assert iters < 3 or (two_roundings != ref).any()        # the check sees a single rounding


@pytest.mark.parametrize("kind,lanes,chains", [("vnni_zmm", 16, 16), ("vnni_ymm", 8, 12)])
@settings(max_examples=10)
@given(seed=SEEDS, iters=st.integers(1, 1 << 16))
def test_vnni_dot_products(kind, lanes, chains, seed, iters):
    """acc[c][l] += sum_i a[4l+i] * b[4l+i] (unsigned x signed bytes), wrapping mod 2^32."""
    need(kind)
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 256, 4 * lanes).astype(np.uint8)
    b = rng.integers(-128, 128, 4 * lanes).astype(np.int8)
    acc = rng.integers(-2 ** 31, 2 ** 31, (chains, lanes)).astype(np.int32)
    _, out = K.peak(kind, iters, a, b, acc)
    dot = (a.astype(np.int64) * b.astype(np.int64)).reshape(lanes, 4).sum(1)
    np.testing.assert_array_equal(out, wrap32(acc.astype(np.int64) + iters * dot[None, :]))
    signed = (a.view(np.int8).astype(np.int64) * b).reshape(lanes, 4).sum(1)  # negative control
    assert (signed != dot).any()                             # (a read as signed bytes differs)


@settings(max_examples=10)
@given(seed=SEEDS, iters=st.integers(1, 100))
def test_i8_ymm_dot_products(seed, iters):
    """acc[c][l] += sat16(a[2l] b[2l] + a[2l+1] b[2l+1]) (unsigned x signed bytes), the add
    wrapping mod 2^16; operands drawn so that some pairs saturate."""
    need("i8_ymm")
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 256, 32).astype(np.uint8)
    b = rng.integers(-128, 128, 32).astype(np.int8)
    a[:2], b[:2] = 255, 127                                  # 2 * 255 * 127 > 2^15 - 1
    acc = rng.integers(-2 ** 15, 2 ** 15, (12, 16)).astype(np.int16)
    _, out = K.peak("i8_ymm", iters, a, b, acc)
    pairs = (a.astype(np.int64) * b.astype(np.int64)).reshape(16, 2).sum(1)
    dot = np.clip(pairs, -2 ** 15, 2 ** 15 - 1)
    want = (acc.astype(np.int64) + iters * dot[None, :] + 2 ** 15) % 2 ** 16 - 2 ** 15
    np.testing.assert_array_equal(out, want.astype(np.int16))
    assert (dot != pairs).any()                              # negative control: saturation seen


@settings(max_examples=10)
@given(seed=SEEDS, iters=st.integers(1, 100))
def test_bf16_dot_products(seed, iters):
    """acc[c][l] += a[2l] b[2l] + a[2l+1] b[2l+1] on bfloat16 integers: exact sums."""
    need("bf16_zmm")
    rng = np.random.default_rng(seed)
    av, bv = rng.integers(-16, 17, 32), rng.integers(-16, 17, 32)
    acc = rng.integers(-2 ** 20, 2 ** 20, (16, 16)).astype(np.float32)
    _, out = K.peak("bf16_zmm", iters, bf16_bits(av), bf16_bits(bv), acc)
    pair = (av * bv).reshape(16, 2).sum(1)
    np.testing.assert_array_equal(out, acc.astype(np.float64) + iters * pair[None, :])
    shifted = (av * np.roll(bv, 1)).reshape(16, 2).sum(1)    # negative control: wrong pairing
    assert (shifted != pair).any()


def _amx_b(b, per):
    """B tile [16 k-groups][16 columns * per] -> its [16 * per k][16 columns] matrix."""
    return b.reshape(16, 16, per).transpose(0, 2, 1).reshape(16 * per, 16)


@settings(max_examples=8)
@given(seed=SEEDS, iters=st.integers(1, 1 << 10))
def test_amx_int8_tiles(seed, iters):
    """C[2i+j] += A[i] . B[j] with B in quads of k: int8 x int8, int32 wrapping."""
    need("amx_int8")
    rng = np.random.default_rng(seed)
    a = rng.integers(-128, 128, (2, 16, 64)).astype(np.int8)
    b = rng.integers(-128, 128, (2, 16, 64)).astype(np.int8)
    acc = rng.integers(-2 ** 31, 2 ** 31, (4, 16, 16)).astype(np.int32)
    ops, out = K.peak("amx_int8", iters, a, b, acc)
    a64, b64 = a.astype(np.int64), b.astype(np.int64)
    ref = [acc[2 * i + j] + iters * (a64[i] @ _amx_b(b64[j], 4)) for i in (0, 1) for j in (0, 1)]
    np.testing.assert_array_equal(out, wrap32(ref))
    plain = wrap32(acc[0] + iters * (a64[0] @ b64[0].reshape(64, 16)))  # negative control
    assert (plain != out[0]).any()
    assert ops == iters * 4 * 16 * 16 * 64 * 2


@settings(max_examples=8)
@given(seed=SEEDS, iters=st.integers(1, 64))
def test_amx_bf16_tiles(seed, iters):
    """C[2i+j] += A[i] . B[j] with B in pairs of k, on bfloat16 integers: exact sums."""
    need("amx_bf16")
    rng = np.random.default_rng(seed)
    av = rng.integers(-8, 9, (2, 16, 32))
    bv = rng.integers(-8, 9, (2, 16, 32))
    acc = rng.integers(-2 ** 20, 2 ** 20, (4, 16, 16)).astype(np.float32)
    _, out = K.peak("amx_bf16", iters, bf16_bits(av), bf16_bits(bv), acc)
    ref = np.stack([acc[2 * i + j] + iters * (av[i] @ _amx_b(bv[j], 2))
                    for i in (0, 1) for j in (0, 1)])
    assert np.abs(ref).max() < 2 ** 24                       # every partial sum exact
    np.testing.assert_array_equal(out.astype(np.float64), ref)
    plain = acc[0] + iters * (av[0] @ bv[0].reshape(32, 16))  # negative control
    assert (plain != out[0]).any()


# ------------------------------------------------------------------ the timing helper


def test_measure_and_peaks():
    for kind in SUPPORTED:
        v = P.measure(kind, seconds=0.01, runs=2)
        assert np.isfinite(v) and v > 0
    got = P.peaks(seconds=0.01, runs=1)
    assert list(got) == SUPPORTED and all(v > 0 for v in got.values())
    with pytest.raises(ValueError, match="runs"):
        P.measure("fma_zmm", 0.01, runs=0)


def test_kind_for():
    with pytest.raises(ValueError, match="precision"):
        P.kind_for("f16")
    have = set(SUPPORTED)
    for prec, kinds in P.PRECISION_KINDS.items():
        best = next((k for k in kinds if k in have), None)
        assert P.kind_for(prec) == P.kind_for(prec, "generic") == best
    if "fma_ymm" in have:
        assert P.kind_for("f32", "avx2") == "fma_ymm"
        assert P.kind_for("bf16", "avx2") == "fma_ymm"    # the bf16 kernel's float32 FMAs
    if "fma_zmm" in have:
        assert P.kind_for("f32", "avx512") == "fma_zmm"
    if "bf16_zmm" in have:
        assert P.kind_for("bf16", "avx512bf16") == "bf16_zmm"
    if "i8_ymm" in have:
        assert P.kind_for("q8", "avx2") == "i8_ymm"
    if "vnni_zmm" in have:
        assert P.kind_for("q8", "avx512") == "vnni_zmm"
    if "vnni_ymm" in have:
        assert P.kind_for("q8", "avxvnni") == "vnni_ymm"
    if "amx_int8" in have:
        assert P.kind_for("q8", "amx") == "amx_int8" and P.kind_for("q8") == "amx_int8"
