"""Tests of the low-precision matmuls (`bf16`: matmul_bf16, round_bf16; `q8`: matmul_q8).

Owns: the proof that each generic (scalar) spec computes exactly the arithmetic contract of
csrc/nx_lowp.h, that every SIMD variant reproduces its spec bit for bit, that bands and token
batches do not change a bit, that the error against float64 stays inside the derived bounds, and
that bad input fails clearly. Must not: use the code under test to produce expected values.

Independent references: bfloat16 rounding written out in numpy bit operations; weights decoded by
numpy views (F32/F16/BF16) or by hand (Q8_0 block bytes); the vdpbf16ps pair chain emulated in
float64 (exact: see bf16_model); Q8_0 activation quantization by gguf.quants.quantize, int32 block
dots in numpy int64, and the float32 fma emulated exactly with TwoSum (fma32). Negative controls
show that the models' distinguishing details (odd-first order, FTZ, the fused multiply-add) are
exercised by the data, and that the error bounds are not vacuous.
"""
import itertools
import os
import subprocess
import sys
import zlib

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from hypothesis import given, settings
from hypothesis import strategies as st

import nxhpc
from kernelutil import ISAS, assert_error_names, bits, expected_variant, finite_scale_blocks
from nxhpc import _kernels as K
from nxhpc.formats.ggml_blocks import BLOCK_DTYPES, QUANT_BLOCKS

Q8 = gguf.GGMLQuantizationType.Q8_0
WTYPES = ("F32", "F16", "BF16", "Q8_0")
BF16_VARIANTS = K.lowp_variants("bf16")   # ISAs with their own matmul_bf16, generic first
Q8_VARIANTS = K.lowp_variants("q8")       # ISAs with their own matmul_q8 (VNNI at avx512)
SIMD_BF16 = BF16_VARIANTS[1:]
# the bf16 variants whose bits are the spec's (every one but AMX's: nx_lowp.h, its own clause)
BF16_SPEC_VARIANTS = [i for i in BF16_VARIANTS if i != "amx"]
SIMD_BF16_SPEC = BF16_SPEC_VARIANTS[1:]
AMX_BF16 = [i for i in BF16_VARIANTS if i == "amx"]
SIMD_Q8 = Q8_VARIANTS[1:]
U32 = np.uint32
U16 = np.uint16
EPS32 = 2.0 ** -24
EPS64 = 2.0 ** -53
UBF = 2.0 ** -8              # unit roundoff of bfloat16 (8-bit significand, round to nearest)


# ----------------------------------------------------------------------------- helpers


def same_bits_or_both_nan(a, b):
    """Bit equality, except that any two NaNs compare equal (payloads are not promised)."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return bool(np.all((bits(a) == bits(b)) | (np.isnan(a) & np.isnan(b))))


def f32_of_bits(u):
    return np.asarray(u, U32).view(np.float32)


def np_round_bf16_bits(x):
    """bf() of nx_lowp.h in numpy bit operations -> uint16 bits."""
    u = np.ascontiguousarray(x, np.float32).view(U32).astype(np.uint64)
    mag = u & 0x7FFFFFFF
    rne = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
    out = np.where(mag > 0x7F800000, (u >> 16) | 0x40, rne)          # NaN: quiet, payload kept
    out = np.where((u & 0x7F800000) == 0, (u >> 16) & 0x8000, out)   # zero / subnormal: signed 0
    return out.astype(np.uint16)


def np_bf16_values(x):
    return f32_of_bits(np_round_bf16_bits(x).astype(U32) << 16)


def flush(a):
    """Subnormal float32 values -> the zero of their sign (DAZ on inputs, FTZ on results)."""
    a = np.ascontiguousarray(a, np.float32)
    u = a.view(U32)
    return np.where((u & 0x7F800000) == 0, u & 0x80000000, u).astype(U32).view(np.float32)


def decode_np(w, wtype, N, Kd):
    """Weights' exact float32 values, decoded by numpy (no nxhpc code)."""
    if wtype == "F32":
        return w.view("<f4").reshape(N, Kd).astype(np.float32)
    if wtype == "F16":
        return w.view("<f2").reshape(N, Kd).astype(np.float32)           # exact widening
    if wtype == "BF16":
        return f32_of_bits(w.view("<u2").reshape(N, Kd).astype(U32) << 16)
    blocks = w.reshape(N * (Kd // 32), 34)
    d = blocks[:, :2].copy().view("<f2").astype(np.float32)
    q = blocks[:, 2:].view(np.int8).astype(np.float32)
    with np.errstate(invalid="ignore"):                                   # inf/NaN scales
        return (d * q).reshape(N, Kd)                                     # exact in float32


def make_w(rng, wtype, N, Kd, scale=0.05):
    """Random weights of `wtype` as raw GGML bytes [N, rowbytes]."""
    v = (rng.standard_normal((N, Kd)) * scale).astype(np.float32)
    if wtype == "F32":
        return v.view(np.uint8).reshape(N, 4 * Kd)
    if wtype == "F16":
        return v.astype("<f2").view(np.uint8).reshape(N, 2 * Kd)
    if wtype == "BF16":
        return np_round_bf16_bits(v).astype("<u2").view(np.uint8).reshape(N, 2 * Kd)
    return gguf_quantize(v, Q8)


FTZ_EDGE = 2.0 ** -126 - 2.0 ** -151   # x86 FTZ flushes exact results below this in magnitude


def bf16_model(x, wf, order="odd_first", ftz="x86"):
    """The bf16 contract emulated in numpy; out[t, n] float32 (no bias).

    Exactness: each step is acc + a*b with a, b bfloat16 values, so a*b has <= 16 significant
    bits and is exact in float64. If it lies in float32's range, acc + a*b is a sum of two
    float32 numbers and rounding its float64 value to float32 is correct (double rounding is
    innocuous for +,-,*,/ when 53 >= 2*24 + 2). If a*b is below float32's range, either acc is 0
    (one rounding of an exact value) or the sum is either exact in float64 or lies within 2^-13
    ulp of acc, where no float32 midpoint can be crossed. ftz="x86" is the contract's flush
    (tiny after rounding to 24 bits with an unbounded exponent: the exact sum below FTZ_EDGE in
    magnitude; the float64 sum decides it correctly for the same reasons, FTZ_EDGE not being
    within 2^-13 ulp of any such sum but an exact one). `order`, ftz="fmaf" (a gradual-underflow
    fmaf, then subnormals flushed: the contract as first stated) and ftz=False exist for the
    negative controls only.
    """
    T, Kd = x.shape
    K32 = -(-Kd // 32) * 32
    xb = np.zeros((T, K32), np.float32)
    wb = np.zeros((wf.shape[0], K32), np.float32)
    xb[:, :Kd] = np_bf16_values(x)
    wb[:, :Kd] = np_bf16_values(wf)
    xb, wb = flush(xb), flush(wb)
    acc = np.zeros((T, wf.shape[0]), np.float32)
    first, second = (1, 0) if order == "odd_first" else (0, 1)
    with np.errstate(all="ignore"):
        for k in range(0, K32, 2):
            for e in (first, second):
                prod = xb[:, k + e, None].astype(np.float64) * wb[None, :, k + e].astype(np.float64)
                s = flush(acc).astype(np.float64) + prod
                acc = s.astype(np.float32)
                if ftz == "x86":
                    acc = np.where(np.abs(s) < FTZ_EDGE, np.copysign(np.float32(0), acc), acc)
                elif ftz == "fmaf":
                    acc = flush(acc)
    return acc


def fma32(p, c):
    """float32 fma: p + c rounded once to float32, where p is an exact float64 product and c is
    float32. TwoSum gives S + e == p + c exactly. Rounding to float64 is monotonic, so S cannot
    step past a float32 midpoint; round32(S) is wrong only when S lands exactly on a midpoint
    while e != 0, and then the true value lies on e's side of it."""
    c64 = c.astype(np.float64)
    S = p + c64
    bp = S - p
    e = (p - (S - bp)) + (c64 - bp)
    r = S.astype(np.float32)
    r64 = r.astype(np.float64)
    nb = np.nextafter(r, np.where(S > r64, np.inf, -np.inf).astype(np.float32))
    nb64 = nb.astype(np.float64)
    at_mid = (S != r64) & (S == (r64 + nb64) / 2) & (e != 0)     # (r + nb) / 2 is exact
    take_nb = (nb64 > S) == (e > 0)
    return np.where(at_mid & take_nb, nb, r).astype(np.float32)


def split_q8(b, rows, nb):
    blocks = b.reshape(rows, nb, 34)
    d = blocks[:, :, :2].copy().view("<f2")[..., 0].astype(np.float32)     # [rows, nb]
    q = blocks[:, :, 2:].view(np.int8).astype(np.int64)                      # [rows, nb, 32]
    return d, q


Q8_FLUSH = 2.0 ** -126      # activation scales below float32's smallest normal are flushed


def q8_act_scale(x):
    """The q8 activation scale of each 32-block, written plainly: float32 max|x| / 127 (NaN
    propagates, as numpy's max does), 0 when below 2^-126 (the contract, nx_lowp.h)."""
    T, Kd = x.shape
    with np.errstate(all="ignore"):
        d = np.abs(x.reshape(T, Kd // 32, 32)).max(axis=2) / np.float32(127)
    return np.where(d < Q8_FLUSH, np.float32(0), d).astype(np.float32)


def q8_act_dequant(x):
    """x~ = q * dx in float64: gguf's Q8_0 bytes of x with the float32 activation scale."""
    T, Kd = x.shape
    _, qx = split_q8(gguf_quantize(x, Q8), T, Kd // 32)
    return (qx * q8_act_scale(x)[:, :, None].astype(np.float64)).reshape(T, Kd)


def q8_model(x, w, fused=True, scale="f32"):
    """The q8 contract: gguf's Q8_0 quantization bytes of x, its scale dx kept in float32
    (``scale="f16"``: gguf's stored float16 d instead, the old contract -- a negative control),
    int64 block dots (exact), s = dx*dw rounded once to float32, acc = fma32(isum, s, acc) in
    block order."""
    T, Kd = x.shape
    N, nb = w.shape[0], Kd // 32
    d16, qx = split_q8(gguf_quantize(x, Q8), T, nb)
    dx = q8_act_scale(x) if scale == "f32" else d16
    dw, qw = split_q8(w, N, nb)
    acc = np.zeros((T, N), np.float32)
    with np.errstate(all="ignore"):
        for b in range(nb):
            isum = np.einsum("ti,ni->tn", qx[:, b, :], qw[:, b, :])              # exact int64
            s = dx[:, b, None] * dw[None, :, b]                                 # float32, RN
            p = isum.astype(np.float64) * s.astype(np.float64)                  # exact (< 2^53)
            acc = fma32(p, acc) if fused else (p.astype(np.float32) + acc).astype(np.float32)
    return acc


def run_bf16(x, w, wtype, isa, bias=None, n0=0, n1=None):
    out = np.full((x.shape[0], w.shape[0]), np.nan, np.float32)
    assert K.matmul_bf16(x, w, wtype, out, n0, n1, bias=bias, isa=isa) is out
    return out


def run_q8(x, w, isa, bias=None, n0=0, n1=None):
    out = np.full((x.shape[0], w.shape[0]), np.nan, np.float32)
    assert K.matmul_q8(x, w, out, n0, n1, bias=bias, isa=isa) is out
    return out


def rand_x(rng, T, Kd, scale=1.0):
    return (rng.standard_normal((T, Kd)) * scale).astype(np.float32)


# ----------------------------------------------------------------------------- bf16 rounding

def _rounding_patterns(seed=0):
    hi = np.arange(1 << 16, dtype=U32) << 16
    lows = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x4000, 0xC000], U32)
    rnd = np.random.default_rng(seed).integers(0, 1 << 32, 200_000, dtype=np.uint64).astype(U32)
    return np.concatenate([(hi[:, None] | lows[None, :]).ravel(), rnd]).view(np.float32)


@pytest.mark.parametrize("isa", BF16_VARIANTS)
def test_round_bf16_matches_numpy_bit_model(isa):
    """Every high half with the tie / near-tie low halves, plus random patterns: NaNs, infs,
    subnormals, overflow to inf, ties to even. The SIMD variant is VCVTNEPS2BF16 itself."""
    x = _rounding_patterns()
    got = K.round_bf16(x, isa=isa).view(U32)
    want = np_round_bf16_bits(x).astype(U32) << 16
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("isa", BF16_VARIANTS)
def test_round_bf16_writes_every_element_of_any_length(isa):
    """Every length from 0 to 70 (the masked tails of 16 and 32 lanes), into outputs that were
    garbage before: the test above has one length, a multiple of 16, so a tail store one lane
    short passed it (a mutation check, 2026-12-06)."""
    rng = np.random.default_rng(zlib.crc32(isa.encode()))        # other values per variant
    for n in range(71):
        x = rng.standard_normal(n).astype(np.float32) * 3
        for _ in range(8):   # leave freed buffers of the output's size (n bf16 words) patterned
            np.full(n, 0x7FC1, np.uint16)
        got = K.round_bf16(x, isa=isa).view(U32)
        want = np_round_bf16_bits(x).astype(U32) << 16
        np.testing.assert_array_equal(got, want, err_msg=f"{isa} n={n}")


def test_round_bf16_negative_controls():
    """The patterns distinguish RNE from truncation and from round-half-up, and flushing from
    rounding subnormals -- so the test above would catch any of those."""
    x = _rounding_patterns()
    u = x.view(U32)
    got = K.round_bf16(x, isa="generic").view(U32) >> 16
    finite_normal = ((u & 0x7F800000) != 0) & ((u & 0x7F800000) != 0x7F800000)
    assert (got[finite_normal] != (u[finite_normal] >> 16)).any()                  # not truncation
    half_up = ((u + 0x8000) >> 16) & 0xFFFF
    assert (got[finite_normal] != half_up[finite_normal]).any()                    # ties to even
    sub = ((u & 0x7F800000) == 0) & ((u & 0x7FFFFF) >= 0x7FFF80)                   # round up to 2^-126 ...
    assert sub.any() and (got[sub] & 0x7FFF == 0).all()                            # ... but flushed


# ----------------------------------------------------------------------------- bf16: spec vs model

def test_bf16_model_negative_controls():
    """Data where the contract's details matter: the odd-first pair order, FTZ after each step and
    per-step rounding all change bits, so a wrong generic spec could not match the model."""
    rng = np.random.default_rng(1)
    # bfloat16-exact values over a wide range of magnitudes: the chain rounds at most steps
    x = np_bf16_values(rng.standard_normal((6, 64)) * 2.0 ** rng.integers(-12, 6, (6, 64)))
    wf = np_bf16_values(rng.standard_normal((9, 64)) * 2.0 ** rng.integers(-12, 6, (9, 64)))
    got = run_bf16(x, wf.view(np.uint8), "F32", "generic")
    assert same_bits_or_both_nan(got, bf16_model(x, wf))
    assert not same_bits_or_both_nan(got, bf16_model(x, wf, order="even_first"))
    exact = (np_bf16_values(x).astype(np.float64) @ np_bf16_values(wf).astype(np.float64).T)
    assert (got.astype(np.float64) != exact).any()              # rounding per step is visible
    # tiny products: the chain's results fall in float32's subnormal range
    xs = (rng.standard_normal((4, 32)) * 2.0 ** -64).astype(np.float32)
    ws = (rng.standard_normal((5, 32)) * 2.0 ** -64).astype(np.float32)
    got = run_bf16(xs, ws.view(np.uint8), "F32", "generic")
    assert same_bits_or_both_nan(got, bf16_model(xs, ws))
    assert not same_bits_or_both_nan(got, bf16_model(xs, ws, ftz=False))


@settings(max_examples=40)
@given(T=st.integers(1, 9), N=st.integers(1, 13), kb=st.integers(1, 5), kr=st.integers(0, 31),
       wtype=st.sampled_from(WTYPES), log_x=st.integers(-70, 30), log_w=st.integers(-70, 30),
       bias=st.booleans(), seed=st.integers(0, 2 ** 31 - 1))
def test_bf16_generic_matches_model(T, N, kb, kr, wtype, log_x, log_w, bias, seed):
    """Generic spec == numpy model, bit for bit, over types, shapes (K not a multiple of 32 for the
    one-value types), magnitudes down to the subnormal range (FTZ/DAZ paths) and bias."""
    rng = np.random.default_rng(seed)
    Kd = 32 * kb + (0 if wtype == "Q8_0" else kr)
    x = rand_x(rng, T, Kd, 2.0 ** log_x)
    if wtype in ("F16", "Q8_0"):                        # stay inside float16's range (scales)
        log_w = min(max(log_w, -14), 12)
    w = make_w(rng, wtype, N, Kd, 2.0 ** log_w)
    b = rand_x(rng, 1, N)[0] if bias else None
    got = run_bf16(x, w, wtype, "generic", bias=b)
    want = bf16_model(x, decode_np(w, wtype, N, Kd))
    if b is not None:
        want = (want + b).astype(np.float32)
    assert same_bits_or_both_nan(got, want)


def test_bf16_generic_special_values():
    """NaN and inf in activations and weights: NaN where the model has NaN, infs kept."""
    rng = np.random.default_rng(2)
    x = rand_x(rng, 5, 64)
    x[1, 3] = np.nan
    x[2, 10] = np.inf
    x[3, 0] = 3.0e38                                    # rounds to inf in bfloat16
    wf = rand_x(rng, 7, 64, 0.1)
    wf[4, 5] = -np.inf
    got = run_bf16(x, wf.view(np.uint8), "F32", "generic")
    want = bf16_model(x, wf)
    assert np.isnan(got).any() and np.isinf(got).any()
    assert same_bits_or_both_nan(got, want)


# ----------------------------------------------------------------------------- bf16: variants

def _bf16_cases():
    # (T, K, N, wtype): tails of every tile, two token blocks (T > 9/8 MC, MC 264), N > NC
    # (240), K > KC (1024)
    return [(1, 32, 1, "F32"), (7, 40, 33, "F32"), (9, 96, 49, "F16"), (17, 64, 100, "BF16"),
            (8, 256, 48, "Q8_0"), (300, 64, 20, "Q8_0"), (5, 2080, 30, "F16"),
            (6, 1056, 17, "F32"), (4, 64, 500, "BF16"), (3, 1027, 50, "F32")]


@pytest.mark.skipif(not SIMD_BF16_SPEC, reason="no SIMD bf16 variant on this CPU")
@pytest.mark.parametrize("isa", SIMD_BF16_SPEC)
@pytest.mark.parametrize("T,Kd,N,wtype", _bf16_cases(), ids=str)
def test_bf16_simd_bit_identical_to_generic(isa, T, Kd, N, wtype):
    rng = np.random.default_rng(T * 1000 + Kd + N)
    x = rand_x(rng, T, Kd)
    w = make_w(rng, wtype, N, Kd)
    b = rand_x(rng, 1, N)[0]
    want = run_bf16(x, w, wtype, "generic", bias=b)
    got = run_bf16(x, w, wtype, isa, bias=b)
    assert same_bits_or_both_nan(got, want)


@pytest.mark.skipif(not SIMD_BF16_SPEC, reason="no SIMD bf16 variant on this CPU")
@pytest.mark.parametrize("isa", SIMD_BF16_SPEC)
def test_bf16_simd_edge_values_bit_identical(isa):
    """Tiny (subnormal chains), huge (overflow), NaN/inf and raw BF16/F16 subnormal weights."""
    rng = np.random.default_rng(3)
    x = rand_x(rng, 11, 96) * np.float32(2.0 ** -64)
    x[0] = rand_x(rng, 1, 96)[0] * np.float32(1e30)
    x[1, 5], x[2, 7], x[3, 1] = np.nan, np.inf, 1e-40          # NaN, inf, float32 subnormal
    for wtype in ("F32", "BF16", "F16"):
        w = make_w(rng, wtype, 37, 96, 2.0 ** -60 if wtype != "F16" else 1e-6)
        if wtype == "BF16":
            w.view("<u2")[3, :10] = np.arange(1, 11)              # bfloat16 subnormals
        want = run_bf16(x, w, wtype, "generic")
        got = run_bf16(x, w, wtype, isa)
        assert same_bits_or_both_nan(got, want), wtype


def _ftz_boundary_case(rng, T, N, Kd, k_big, k_tiny):
    """x [T, K], wf [N, K] (bfloat16 values) whose chains end at acc = P + p, P = x[k_big] *
    w[k_big] in [2^-126, 2^-126 (1 + 3/128)] (normal), then p = x[k_tiny] * w[k_tiny] with |p| in
    [2^-153, 2^-149): the exact sums lie just below / around +-2^-126: above FTZ_EDGE (rounded
    up to 2^-126, kept), in (2^-126 - 2^-150, FTZ_EDGE) (tiny after rounding: flushed), below
    (subnormal: flushed). Everything else is 0."""
    x = np.zeros((T, Kd), np.float32)
    wf = np.zeros((N, Kd), np.float32)
    sx = np.where(rng.random(T) < 0.5, -1.0, 1.0)
    x[:, k_big] = sx * 2.0 ** -63
    x[:, k_tiny] = -sx * (1 + rng.integers(0, 128, T) / 128) * 2.0 ** -rng.choice([76, 78], T)
    wf[:, k_big] = (1 + rng.integers(0, 4, N) * (rng.random(N) < 0.3) / 128) * 2.0 ** -63
    wf[:, k_tiny] = (1 + rng.integers(0, 128, N) / 128) * 2.0 ** -75
    return x, wf


@pytest.mark.skipif(not SIMD_BF16_SPEC, reason="no SIMD bf16 variant on this CPU")
@pytest.mark.parametrize("isa", SIMD_BF16_SPEC)
@pytest.mark.parametrize("Kd,k_big,k_tiny", [(64, 1, 0), (96, 33, 32), (1056, 1, 1024)], ids=str)
def test_bf16_simd_ftz_boundary(isa, Kd, k_big, k_tiny):
    """Chains whose last step lands at the underflow boundary, bit for bit as the spec (and the
    model): results of exact sums in (2^-126 - 2^-150, 2^-126 - 2^-151) -- tiny after rounding
    to 24 bits with an unbounded exponent, so x86 FTZ flushes them, while a gradual-underflow
    fmaf rounds them up to 2^-126 -- are flushed; sums just above are kept as +-2^-126; results
    that round to a subnormal are flushed. Negative control below: the data holds cases of the
    first kind, which the contract's first statement (fmaf, then subnormals flushed) keeps.
    (1056, 1, 1024): the big product in the first k-block, the tiny one in the next (C kept
    between them)."""
    rng = np.random.default_rng(Kd + k_tiny)
    T, N = 37, 45
    x, wf = _ftz_boundary_case(rng, T, N, Kd, k_big, k_tiny)
    for wtype, w in (("F32", wf.view(np.uint8)),
                     ("BF16", np_round_bf16_bits(wf).astype("<u2").view(np.uint8))):
        want = bf16_model(x, wf)
        assert same_bits_or_both_nan(run_bf16(x, w, wtype, "generic"), want), wtype
        assert same_bits_or_both_nan(run_bf16(x, w, wtype, isa), want), (wtype, isa)
    exact = x.astype(np.float64) @ wf.astype(np.float64).T          # exact: two terms
    gap = (np.abs(exact) > 2.0 ** -126 - 2.0 ** -150) & (np.abs(exact) < FTZ_EDGE)
    assert gap.sum() > 10 and (exact[gap] < 0).any() and (exact[gap] > 0).any()
    assert (want[gap] == 0).all()
    assert (np.abs(bf16_model(x, wf, ftz="fmaf")[gap]) == np.float32(2.0 ** -126)).all()
    kept = (np.abs(want) == np.float32(2.0 ** -126)) & (np.abs(exact) < 2.0 ** -126)
    assert kept.sum() > 10                       # rounded up to 2^-126 from [FTZ_EDGE, 2^-126)
    flushed = (want == 0) & (exact != 0) & ~gap
    assert flushed.sum() > 10
    assert (np.abs(want) > np.float32(2.0 ** -126)).any()


@pytest.mark.parametrize("isa", BF16_VARIANTS)
def test_bf16_band_and_batch_invariance(isa):
    """Any split of columns into bands and of tokens into batches gives the same bits, and a band
    call leaves the other columns untouched."""
    rng = np.random.default_rng(4)
    T, Kd, N = 21, 1100, 83
    x, w = rand_x(rng, T, Kd), make_w(rng, "F16", N, Kd)
    full = run_bf16(x, w, "F16", isa)
    cuts = [0, 1, 17, 40, 48, 83]
    out = np.full((T, N), np.nan, np.float32)
    for a, b in itertools.pairwise(cuts):
        K.matmul_bf16(x, w, "F16", out, a, b, isa=isa)
    assert same_bits_or_both_nan(out, full)
    part = np.full((T, N), -7.0, np.float32)
    K.matmul_bf16(x, w, "F16", part, 17, 40, isa=isa)
    assert (part[:, :17] == -7).all() and (part[:, 40:] == -7).all()
    assert same_bits_or_both_nan(part[:, 17:40], full[:, 17:40])
    rows = np.concatenate([run_bf16(x[a:b].copy(), w, "F16", isa) for a, b in [(0, 1), (1, 9), (9, 21)]])
    assert same_bits_or_both_nan(rows, full)


@pytest.mark.parametrize("wtype", sorted(K.weight_types()))
def test_bf16_every_traits_type_matches_model(wtype):
    """The bf16 panels decode through the weight-type traits: every type of the table works, and
    each variant equals the bf16 model of gguf's own dequantization (the independent decoder)."""
    rng = np.random.default_rng(len(wtype) * 7 + K.weight_types()[wtype]["ggml_type"])
    T, Kd, N = 5, 512, 19
    x = rand_x(rng, T, Kd)
    if wtype in ("F32", "F16", "BF16"):
        raw = make_w(rng, wtype, N, Kd)
    else:
        # valid blocks from nxhpc's encoders (gguf has no K-quant quantizer); the decoder
        # that makes the reference is gguf's, so the check stays independent
        from nxhpc.formats.quants import quantize as nx_quantize
        raw = nx_quantize((rng.standard_normal((N, Kd)) * 0.05).astype(np.float32), wtype)
    wf = np.asarray(gguf_dequantize(raw, gguf.GGMLQuantizationType[wtype]), np.float32).reshape(N, Kd)
    want = bf16_model(x, wf)
    for isa in BF16_SPEC_VARIANTS:
        assert same_bits_or_both_nan(run_bf16(x, raw, wtype, isa), want), (wtype, isa)
    for isa in AMX_BF16:                  # the tile sums: within the chain's rounding of the model
        assert_amx_bf16_sums(run_bf16(x, raw, wtype, isa), x, wf)


def test_bf16_weight_forms_and_bias_are_consistent():
    """Element-dtype weights == raw bytes; bias is one float32 add after the sum; gguf enum and
    int type ids work; read-only weights are accepted."""
    rng = np.random.default_rng(5)
    x = rand_x(rng, 4, 64)
    wf = rand_x(rng, 9, 64, 0.1)
    b = rand_x(rng, 1, 9)[0]
    raw = run_bf16(x, wf.view(np.uint8), "F32", None)
    assert same_bits_or_both_nan(run_bf16(x, wf, "F32", None), raw)
    assert same_bits_or_both_nan(run_bf16(x, wf, gguf.GGMLQuantizationType.F32, None), raw)
    assert same_bits_or_both_nan(run_bf16(x, wf, 0, None), raw)
    with_b = run_bf16(x, wf, "F32", None, bias=b)
    assert same_bits_or_both_nan(with_b, (raw + b).astype(np.float32))
    h = wf.astype(np.float16)
    assert same_bits_or_both_nan(run_bf16(x, h, "F16", None), run_bf16(x, h.view(np.uint8), "F16", None))
    wq = gguf_quantize(wf, Q8)
    wq.flags.writeable = False
    assert same_bits_or_both_nan(run_bf16(x, wq, "Q8_0", None),
                                 run_bf16(x, decode_np(wq, "Q8_0", 9, 64), "F32", None))


# ----------------------------------------------------------------------------- q8: spec vs model

def rand_q8_raw(rng, N, Kd, full_range=True):
    """Raw Q8_0 rows with arbitrary int8 quants (incl. -128) and finite random fp16 scales."""
    b = rng.integers(0, 256, (N, Kd // 32, 34), dtype=np.uint8)
    d = (rng.standard_normal((N, Kd // 32)) * 1e-3).astype("<f2")
    b[:, :, :2] = d.view(np.uint8).reshape(N, Kd // 32, 2)
    if not full_range:
        b[:, :, 2:] = np.clip(b[:, :, 2:].view(np.int8), -127, 127).view(np.uint8)
    return b.reshape(N, Kd // 32 * 34)


def test_fma32_emulation_is_exact():
    """The test's own fma emulation against exact rational arithmetic, on midpoint-heavy data."""
    from fractions import Fraction
    rng = np.random.default_rng(6)
    c = (rng.standard_normal(3000) * 2.0 ** rng.integers(-20, 20, 3000)).astype(np.float32)
    isum = rng.integers(-2 ** 19, 2 ** 19, 3000)
    s = (rng.standard_normal(3000) * 2.0 ** rng.integers(-30, 0, 3000)).astype(np.float16).astype(np.float32) * \
        (rng.standard_normal(3000)).astype(np.float16).astype(np.float32)
    p = isum.astype(np.float64) * s.astype(np.float64)
    # force exact midpoints: c + p with p = half an ulp of c plus a tiny remainder
    half = np.spacing(c).astype(np.float64) / 2
    p[:1000] = half[:1000] * np.where(rng.random(1000) < 0.5, 1, -1) * (1 + 2.0 ** -40)
    got = fma32(p, c)

    def exact_round(v):
        f = np.float32(float(v))                     # one rounding from the float64 nearest...
        cand = [np.nextafter(f, np.float32(-np.inf)), f, np.nextafter(f, np.float32(np.inf))]
        errs = [abs(Fraction(float(z)) - v) for z in cand]
        m = min(errs)
        best = [z for z, e in zip(cand, errs) if e == m]
        return best[0] if len(best) == 1 else next(z for z in best if (z.view(U32) & 1) == 0)
    want = np.array([exact_round(Fraction(float(pi)) + Fraction(float(ci))) for pi, ci in zip(p, c)],
                    np.float32)
    np.testing.assert_array_equal(got.view(U32), want.view(U32))
    naive = (p + c.astype(np.float64)).astype(np.float32)
    assert (naive.view(U32) != want.view(U32)).any()      # negative control: double rounding bites


@settings(max_examples=40)
@given(T=st.integers(1, 9), N=st.integers(1, 13), nb=st.integers(1, 6),
       log_x=st.integers(-20, 20), full_range=st.booleans(), bias=st.booleans(),
       seed=st.integers(0, 2 ** 31 - 1))
def test_q8_generic_matches_model(T, N, nb, log_x, full_range, bias, seed):
    """Generic spec == numpy model (gguf quantizer, int64 dots, exact fma), bit for bit."""
    rng = np.random.default_rng(seed)
    Kd = 32 * nb
    x = rand_x(rng, T, Kd, 2.0 ** log_x)
    w = rand_q8_raw(rng, N, Kd, full_range)
    b = rand_x(rng, 1, N)[0] if bias else None
    got = run_q8(x, w, "generic", bias=b)
    want = q8_model(x, w)
    if b is not None:
        want = (want + b).astype(np.float32)
    assert same_bits_or_both_nan(got, want)


def test_q8_model_negative_control():
    """The fused multiply-add is visible: rounding isum*s first would change bits."""
    rng = np.random.default_rng(7)
    x, w = rand_x(rng, 8, 256), rand_q8_raw(rng, 40, 256)
    got = run_q8(x, w, "generic")
    assert same_bits_or_both_nan(got, q8_model(x, w))
    assert not same_bits_or_both_nan(got, q8_model(x, w, fused=False))


# ----------------------------------------------------------------------------- bf16: AMX

def amx_chain_bound(xb, wb):
    """What the bf16 contract's chain term allows between an output and the exact float64 sum of
    its bfloat16-rounded products: gamma_K * sum|bf(x) bf(w)| (K roundings of a float32 sum),
    plus the flushed-subnormal term."""
    Kd = xb.shape[1]
    g = Kd * EPS32 / (1 - Kd * EPS32)
    mag = np.abs(xb.astype(np.float64)) @ np.abs(wb.astype(np.float64)).T
    return g * mag + Kd * 2.0 ** -124 * (1 + np.abs(xb).max() + np.abs(wb).max())


def assert_amx_bf16_sums(got, x, wf):
    """AMX's bf16 output is the sum of exactly the contract's bf(x) * bf(w) products, to within
    the float32 chain's roundings -- far tighter than the bf16 input-rounding term, so it pins
    the input rounding to bf() (the negative control in test_bf16_amx_* shows the unrounded
    inputs miss this bound)."""
    xb, wb = np_bf16_values(flush(x)), np_bf16_values(flush(wf))
    exact = xb.astype(np.float64) @ wb.astype(np.float64).T
    err = np.abs(got.astype(np.float64) - exact)
    bound = amx_chain_bound(xb, wb)
    assert (err <= bound).all(), (err / bound).max()


@pytest.mark.skipif(not AMX_BF16, reason="no AMX on this CPU")
@pytest.mark.parametrize("T,Kd,N,wtype",
                         _bf16_cases() + [(40, 300, 70, "F32"), (33, 512, 65, "Q8_0"),
                                          (600, 2336, 70, "Q8_0"), (1200, 320, 40, "Q8_0"),
                                          (1200, 300, 40, "F32"), (2400, 96, 33, "BF16")],
                         ids=str)
def test_bf16_amx_sums_the_contract_products(T, Kd, N, wtype):
    """Every tile tail (32 x 32 blocks), two and three token blocks (T > 9/8 MC: MC 512 for
    quantized weights, 1024 for F32 / F16 / BF16 ones), N > NC, K
    within one KC (512: the tiles stored straight to the output) and across it (the tile sums
    carried between k-blocks in the packed C buffer, reused across token and column blocks), K
    not a multiple of 32: within the chain bound of the exact sum of the bf()-rounded products;
    the whole bf16 error bound vs float64 of the unrounded data holds."""
    rng = np.random.default_rng(T * 1000 + Kd + N + 7)
    x = rand_x(rng, T, Kd)
    w = make_w(rng, wtype, N, Kd)
    wf = decode_np(w, wtype, N, Kd)
    got = run_bf16(x, w, wtype, "amx")
    assert_amx_bf16_sums(got, x, wf)
    ref = x.astype(np.float64) @ wf.astype(np.float64).T
    mag = np.abs(x.astype(np.float64)) @ np.abs(wf.astype(np.float64)).T
    g = Kd * EPS32 / (1 - Kd * EPS32)
    bound = ((2 * UBF + UBF ** 2) + g * (1 + UBF) ** 2) * mag + Kd * 2.0 ** -124 * 3
    assert (np.abs(got - ref) <= bound).all()
    # negative control: the products of the unrounded inputs are not what the tiles summed
    exact_unrounded = x.astype(np.float64) @ wf.astype(np.float64).T
    loose = np.abs(got.astype(np.float64) - exact_unrounded)
    assert (loose > amx_chain_bound(np_bf16_values(x), np_bf16_values(wf))).any()


@pytest.mark.skipif(not AMX_BF16, reason="no AMX on this CPU")
@pytest.mark.parametrize("T,wtype", [(600, "Q8_0"), (1200, "F16")])
def test_bf16_amx_bits_do_not_depend_on_the_token_batch(T, wtype):
    """The same rows give the same bits in a call of two token blocks (600 tokens at MC 512 for
    a quantized type, 1200 at MC 1024 for a float one) and in calls of 1 to 100 (the tile sums
    pass through the packed C buffer exactly, whichever tile and token block a row falls in),
    across k-block edges (K = 2336: four k-blocks of 512 and a partial one)."""
    rng = np.random.default_rng(31)
    Kd, N = 2336, 45
    x = rand_x(rng, T, Kd)
    w = make_w(rng, wtype, N, Kd)
    full = run_bf16(x, w, wtype, "amx")
    for a, b in [(0, 64), (64, 65), (T - 100, T)]:
        assert same_bits_or_both_nan(run_bf16(x[a:b].copy(), w, wtype, "amx"), full[a:b]), (a, b)


@pytest.mark.skipif(not AMX_BF16, reason="no AMX on this CPU")
def test_bf16_amx_bias_specials_and_repeatability():
    """Bias is one float32 add after the sum (== the no-bias output + bias); NaN and inf reach
    the outputs where the model has them; two runs give the same bits."""
    rng = np.random.default_rng(31)
    x = rand_x(rng, 19, 96)
    x[1, 3], x[2, 10] = np.nan, np.inf
    wf = rand_x(rng, 37, 96, 0.1)
    wf[4, 5] = -np.inf
    b = rand_x(rng, 1, 37)[0]
    got = run_bf16(x, wf.view(np.uint8), "F32", "amx")
    model = bf16_model(x, wf)
    assert (np.isnan(got) == np.isnan(model)).all() and (np.isinf(got) == np.isinf(model)).all()
    rows, cols = np.isfinite(x).all(axis=1), np.isfinite(wf).all(axis=1)
    assert_amx_bf16_sums(got[rows][:, cols], x[rows], wf[cols])
    with_b = run_bf16(x, wf.view(np.uint8), "F32", "amx", bias=b)
    assert same_bits_or_both_nan(with_b, (got + b).astype(np.float32))
    assert same_bits_or_both_nan(run_bf16(x, wf.view(np.uint8), "F32", "amx"), got)


@pytest.mark.parametrize("isa", BF16_VARIANTS)
@pytest.mark.parametrize("T,Kd,N", [(7, 600, 5), (40, 1100, 70), (70, 96, 33)])
def test_bf16_bias_is_one_add_after_the_sum(isa, T, Kd, N):
    """At every variant, over one and several k-blocks (the AMX kernel adds the bias as it writes
    its last k-block's tiles), token and column tails: out with bias == (out without) + bias, one
    float32 add, for ordinary, subnormal and signed-zero biases. Negative control: the bias
    added twice is visible."""
    rng = np.random.default_rng([T, Kd, N])
    x = rand_x(rng, T, Kd)
    wf = rand_x(rng, N, Kd, 0.1)
    b = rand_x(rng, 1, N)[0]
    b[0], b[-1] = np.float32(1e-40), np.float32(-0.0)
    plain = run_bf16(x, wf, "F32", isa)
    got = run_bf16(x, wf, "F32", isa, bias=b)
    assert same_bits_or_both_nan(got, (plain + b).astype(np.float32)), isa
    assert not same_bits_or_both_nan(got, (plain + 2 * b).astype(np.float32))


def run_bf16_dequant_pack(x, w, wtype, isa):
    out = np.full((x.shape[0], w.shape[0]), np.nan, np.float32)
    assert K._matmul_bf16_dequant_pack(x, w, wtype, out, isa=isa) is out
    return out


@pytest.mark.parametrize("wtype", sorted(QUANT_BLOCKS))
def test_bf16_fused_weight_decoders_equal_dequantize(wtype):
    """The packers' fused decoders (AMX: every quantized type; avx512bf16 / avx2: Q8_0) give
    the bits of the path that decodes through the type's dequantize (itself checked against
    gguf's decoder in test_kernels_wtype.py), for every code value, random sub-scales and
    scales over 2^-14 .. 2^2 (and inf / NaN scales), K across k-blocks (512) and column tails.
    Negative control: changed codes in one block of one column change that column's outputs
    and no other's."""
    rng = np.random.default_rng(sum(map(ord, wtype)))
    for T, Kd, N, specials in [(5, 768, 19, True), (33, 1280, 70, False), (7, 512, 37, False)]:
        x = rand_x(rng, T, Kd)
        w = finite_scale_blocks(rng, wtype, N, Kd, specials)
        for isa in SIMD_BF16:
            got = run_bf16(x, w, wtype, isa)
            assert same_bits_or_both_nan(got, run_bf16_dequant_pack(x, w, wtype, isa)), (isa, T)
            if specials:
                assert np.isnan(got).any()
            else:
                assert np.isfinite(got).all()
    if SIMD_BF16:              # the last case: all finite
        dt = BLOCK_DTYPES[wtype]
        w2 = w.copy()
        blk = w2[3].reshape(-1, dt.itemsize).view(dt)[1:2, 0]   # column 3, second block
        blk["ql" if "ql" in dt.names else "qs"] ^= 0x11
        got2 = run_bf16(x, w2, wtype, SIMD_BF16[-1])
        assert not same_bits_or_both_nan(got2[:, 3], got[:, 3])
        assert same_bits_or_both_nan(np.delete(got2, 3, 1), np.delete(got, 3, 1))


def float_weight_bits(rng, wtype, N, Kd):
    """Raw F32 / F16 / BF16 rows [N, K*size] of normal values, a fifth of them subnormal (random
    sign and mantissa), and in the first columns one each of +-inf, a signalling and a quiet
    NaN (columns >= 5 finite)."""
    if wtype == "F32":
        v = rng.standard_normal((N, Kd)).astype(np.float32)
        sub = rng.random((N, Kd)) < 0.2
        v[sub] = rng.uniform(-1, 1, sub.sum()) * 2.0 ** -130
        specials = [np.inf, -np.inf, np.float32(np.nan), -np.float32(np.nan), np.nan]
        for i, sp in enumerate(specials):
            v[min(i, N - 1), i % Kd] = sp
        return v.view(np.uint8).reshape(N, 4 * Kd)
    if wtype == "BF16":
        u = (rng.standard_normal((N, Kd)).astype(np.float32).view(np.uint32) >> 16).astype(U16)
        mant, specials = 128, [0x7F80, 0xFF80, 0x7F81, 0xFFC1, 0x7FFF]
    else:
        u = rng.standard_normal((N, Kd)).astype(np.float16).view(U16)
        mant, specials = 1024, [0x7C00, 0xFC00, 0x7C01, 0xFE01, 0x7FFF]
    sub = rng.random((N, Kd)) < 0.2
    u[sub] = (rng.integers(1, mant, sub.sum()) | rng.integers(0, 2, sub.sum()) << 15).astype(U16)
    for i, sp in enumerate(specials):
        u[min(i, N - 1), i % Kd] = sp
    return u.view(np.uint8).reshape(N, 2 * Kd)


@pytest.mark.parametrize("wtype", ["F32", "F16", "BF16"])
def test_bf16_float_panels_equal_dequantize(wtype):
    """F32 / F16 / BF16 weights packed straight from their rows (AMX: 32 values a group, BF16
    words kept with bf()'s subnormal flush and NaN quieting applied) give the bits of the path
    through the type's dequantize, with subnormals, infinities and NaNs, K not a multiple of
    32, across k-blocks, and column tails; the columns without specials are finite. Negative
    control: one changed value in column 6 changes that column's outputs only."""
    rng = np.random.default_rng(sum(map(ord, wtype)) + 1)
    for T, Kd, N in [(40, 31, 6), (5, 300, 37), (33, 1280, 70), (7, 512, 33)]:
        x = rand_x(rng, T, Kd)
        w = float_weight_bits(rng, wtype, N, Kd)
        for isa in SIMD_BF16:
            got = run_bf16(x, w, wtype, isa)
            assert same_bits_or_both_nan(got, run_bf16_dequant_pack(x, w, wtype, isa)), (isa, T)
            assert np.isfinite(got[:, 5:]).all() and not np.isfinite(got[:, :3]).all()
    if SIMD_BF16:
        w2 = w.copy()
        w2[6, :8] ^= 0x40                       # one value's exponent or mantissa bits
        got2 = run_bf16(x, w2, wtype, SIMD_BF16[-1])
        assert not same_bits_or_both_nan(got2[:, 6], got[:, 6])
        assert same_bits_or_both_nan(np.delete(got2, 6, 1), np.delete(got, 6, 1))


# ----------------------------------------------------------------------------- q8: variants

def _q8_cases():
    # tails of the 6 x 32 tile; two token blocks (T > 9/8 MC, MC 264); N > NC (128); K > KC
    # (2048). AMX (16 x 16 block, groups in pipelined rounds of 2): 1, 2, 3 groups; two token
    # blocks (MC 512); N > 256; an odd number of groups in the last k-block
    return [(1, 32, 1), (5, 64, 31), (7, 96, 33), (13, 256, 97), (300, 64, 20), (6, 2080, 45),
            (4, 4128, 130), (11, 32, 300), (16, 64, 16), (17, 96, 17), (600, 32, 260),
            (3, 2144, 19)]


@pytest.mark.skipif(not SIMD_Q8, reason="no SIMD q8 variant on this CPU")
@pytest.mark.parametrize("isa", SIMD_Q8)
@pytest.mark.parametrize("T,Kd,N", _q8_cases(), ids=str)
def test_q8_simd_bit_identical_to_generic(isa, T, Kd, N):
    rng = np.random.default_rng(T * 1000 + Kd + N)
    x = rand_x(rng, T, Kd)
    w = rand_q8_raw(rng, N, Kd)
    b = rand_x(rng, 1, N)[0]
    assert same_bits_or_both_nan(run_q8(x, w, isa, bias=b), run_q8(x, w, "generic", bias=b))


@pytest.mark.skipif(not SIMD_Q8, reason="no SIMD q8 variant on this CPU")
@pytest.mark.parametrize("isa", SIMD_Q8)
def test_q8_simd_extreme_dots_and_specials(isa):
    """The +128 offset at the int8 extremes (qw = -128 / 127 against qx = +-127: |isum| = 32*127*128),
    subnormal fp16 scales, activations beyond a float16 scale, NaN and inf in the activations."""
    Kd, N = 128, 35
    x = np.ones((9, Kd), np.float32)
    x[1] = -1.0
    x[2, ::2] = -1.0
    x[3] = np.linspace(-3, 3, Kd, dtype=np.float32)
    x[4] = 1e-30                                            # tiny blocks: fp16 scale underflows
    x[5, 7] = np.nan
    x[6, 40] = np.inf
    x[7] = 6.0e-5 * np.sign(np.sin(np.arange(Kd))).astype(np.float32)   # subnormal fp16 scale
    x[8] = 2.0e7 * np.sin(np.arange(Kd)).astype(np.float32)     # beyond a float16 scale's range
    w = rand_q8_raw(np.random.default_rng(8), N, Kd)
    blocks = w.reshape(N, Kd // 32, 34)
    blocks[0, :, 2:] = 0x80                                 # qw = -128
    blocks[1, :, 2:] = 0x7F                                 # qw = 127
    blocks[2, :, :2] = np.array([1], "<u2").view(np.uint8)  # subnormal fp16 scale 2^-24
    got, want = run_q8(x, w, isa), run_q8(x, w, "generic")
    assert same_bits_or_both_nan(got, want)
    keep = [0, 1, 2, 3, 4, 7, 8]
    assert same_bits_or_both_nan(want[keep], q8_model(x[keep], w))
    assert np.isnan(got[5]).all() and np.isnan(got[6]).all()


@pytest.mark.parametrize("isa", Q8_VARIANTS)
def test_q8_band_and_batch_invariance(isa):
    rng = np.random.default_rng(9)
    T, Kd, N = 20, 2080, 140
    x, w = rand_x(rng, T, Kd), rand_q8_raw(rng, N, Kd)
    full = run_q8(x, w, isa)
    out = np.full((T, N), np.nan, np.float32)
    for a, b in zip([0, 3, 32, 33, 129], [3, 32, 33, 129, 140]):
        K.matmul_q8(x, w, out, a, b, isa=isa)
    assert same_bits_or_both_nan(out, full)
    part = np.full((T, N), -7.0, np.float32)
    K.matmul_q8(x, w, part, 33, 129, isa=isa)
    assert (part[:, :33] == -7).all() and (part[:, 129:] == -7).all()
    rows = np.concatenate([run_q8(x[a:b].copy(), w, isa) for a, b in [(0, 6), (6, 7), (7, 20)]])
    assert same_bits_or_both_nan(rows, full)


def test_q8_activations_enter_through_gguf_bytes_and_the_float32_scale():
    """matmul_q8 sees x only as gguf's Q8_0 bytes and the float32 scale max|x|/127: moving every
    non-maximal element halfway to its quantization point (same bytes, same max) keeps every
    output bit; changing one block's max by one float32 ulp -- invisible to a float16 scale --
    changes the bits (the scale is not rounded to float16)."""
    rng = np.random.default_rng(10)
    x, w = rand_x(rng, 6, 192), gguf_quantize(rand_x(rng, 20, 192, 0.1), Q8)
    blocks = x.reshape(6, 6, 32)
    top = np.abs(blocks).argmax(axis=2)
    xt = q8_act_dequant(x).reshape(6, 6, 32)
    moved = ((blocks.astype(np.float64) + xt) / 2).astype(np.float32)
    np.put_along_axis(moved, top[..., None], np.take_along_axis(blocks, top[..., None], 2), 2)
    moved = moved.reshape(6, 192)
    assert not np.array_equal(moved, x)
    np.testing.assert_array_equal(gguf_quantize(moved, Q8), gguf_quantize(x, Q8))  # precondition
    np.testing.assert_array_equal(q8_act_scale(moved), q8_act_scale(x))
    assert same_bits_or_both_nan(run_q8(x, w, None), run_q8(moved, w, None))
    nudged = x.copy().reshape(6, 6, 32)
    r, b = 2, 3
    v = nudged[r, b, top[r, b]]
    nudged[r, b, top[r, b]] = np.nextafter(v, np.float32(np.inf) * np.sign(v))
    nudged = nudged.reshape(6, 192)
    d16 = split_q8(gguf_quantize(nudged, Q8), 6, 6)[0]
    assert np.array_equal(d16, split_q8(gguf_quantize(x, Q8), 6, 6)[0])   # same float16 d
    assert not same_bits_or_both_nan(run_q8(x, w, None)[r], run_q8(nudged, w, None)[r])


# ----------------------------------------------------------------------------- accuracy vs float64

def bf16_bound(x, wf, u=UBF):
    """|out - x @ w.T| <= ((2u + u^2) + gamma_K (1+u)^2) sum|x w| + K32 2^-124 (1 + max|x| + max|w|)
    (nx_lowp.h). Input rounding: |bf(v) - v| <= u |v| for normal v (subnormals flushed: absolute
    < 2^-126), so |bf(x)bf(w) - xw| <= (2u + u^2)|xw|. The chain: each product passes <= K
    roundings (padding adds exact zeros): gamma_K sum|bf(x)bf(w)|. FTZ loses < 2^-126 per step
    (K32 steps) and a flushed input < 2^-126 * |other factor|: the absolute term. The float64
    reference (dgemm, any order) adds gamma_2K(2^-53) sum|x w|."""
    Kd = x.shape[1]
    K32 = -(-Kd // 32) * 32
    mag = np.abs(x.astype(np.float64)) @ np.abs(wf.astype(np.float64)).T
    g = Kd * EPS32 / (1 - Kd * EPS32)
    g64 = 2 * Kd * EPS64 / (1 - 2 * Kd * EPS64)
    absterm = K32 * 2.0 ** -124 * (1 + np.abs(x).max() + np.abs(wf).max())
    return ((2 * u + u ** 2) + g * (1 + u) ** 2 + g64) * mag + absterm


def q8_bound(x, wf):
    """|out - x @ w.T| <= sum|x - x~||w| + gamma_{K/32+1} sum|x~ w| + (K/32) 2^-130 (+ float64's
    own gamma_2K), x~ = q * dx (gguf's Q8_0 bytes of x, the float32 scale): block dots are
    exact, s = dx*dw is one rounding, and each block's term passes through <= K/32 fma roundings
    (nx_lowp.h); the absolute term covers s and acc in float32's subnormal range."""
    Kd = x.shape[1]
    xt = q8_act_dequant(x)
    w64 = np.abs(wf.astype(np.float64))
    nb = Kd // 32
    g = (nb + 1) * EPS32 / (1 - (nb + 1) * EPS32)
    g64 = 2 * Kd * EPS64 / (1 - 2 * Kd * EPS64)
    return (np.abs(x - xt) @ w64.T + (g + g64) * (np.abs(xt) @ w64.T)
            + g64 * (np.abs(x.astype(np.float64)) @ w64.T) + nb * 2.0 ** -130)


def q8_elem_bound(x):
    """The a-priori per-element bound of nx_lowp.h: (0.5/127 + 2^-22) amax_b for blocks with
    amax_b >= 127 * 2^-126; |x| itself (flushed) below."""
    T, Kd = x.shape
    amax = np.abs(x.reshape(T, Kd // 32, 32)).max(axis=2, keepdims=True).astype(np.float64)
    b = np.where(amax >= 127 * Q8_FLUSH, (0.5 / 127 + 2.0 ** -22) * amax,
                 np.abs(x.reshape(T, Kd // 32, 32)).astype(np.float64))
    return b.reshape(T, Kd)


def test_q8_activation_error_a_priori_bound():
    """Per element |x - x~| within the stated a-priori bound (nx_lowp.h) on blocks of widely
    varying scale -- float32's whole normal range, the flushed blocks below it included; and not
    vacuous (some element uses > half of it)."""
    rng = np.random.default_rng(11)
    x = rand_x(rng, 64, 256) * np.float32(2.0) ** rng.integers(-130, 120, (64, 1)).astype(
        np.float32)
    assert np.isfinite(x).all()
    err = np.abs(x.astype(np.float64) - q8_act_dequant(x))
    bound = q8_elem_bound(x)
    assert (err <= bound).all(), (err / np.maximum(bound, 1e-300)).max()
    assert (err / np.maximum(bound, 1e-300)).max() > 0.5


def _q8_range_rows(Kd):
    """Activation rows at the edges of the range (issue 19): whole rows and single blocks of max
    |x| around 127 * 65504 (where a float16 scale overflows), near float32's top, around 1e-6
    (where a float16 scale underflows), near the flush point 127 * 2^-126, and mixed."""
    rng = np.random.default_rng(21)
    base = rng.standard_normal((1, Kd)).astype(np.float32)
    base /= np.abs(base).max()
    edge16 = 127.0 * 65504.0
    scales = [edge16 * 0.999, edge16, edge16 * 1.001, 1e7, 1e12, 1e30, 3e36,
              1e-6, 7.6e-6, 1e-9, 1e-20, 127 * 2.0 ** -126 * 1.01, 1e-37]
    rows = [base * np.float32(v) for v in scales]
    mixed = base.copy()
    mixed[0, :32] *= np.float32(1e8)                   # one huge block beside ordinary ones
    mixed[0, 32:64] *= np.float32(1e-6)                # and one tiny block
    rows.append(mixed)
    return np.concatenate(rows).astype(np.float32)


@pytest.mark.parametrize("isa", Q8_VARIANTS)
def test_q8_range_edges_vs_float64(isa):
    """Every finite activation runs: blocks at and beyond 127 * 65504, near 3e36, around 1e-6
    and below the flush point give finite outputs within the q8 bound of float64 numpy (before
    the float32 scale: whole rows NaN above ~8.3e6, zeros below ~7.6e-6)."""
    Kd, N = 256, 24
    x = _q8_range_rows(Kd)
    w = gguf_quantize(rand_x(np.random.default_rng(22), N, Kd, 0.05), Q8)
    wf = decode_np(w, "Q8_0", N, Kd)
    out = run_q8(x, w, isa)
    ref = x.astype(np.float64) @ wf.astype(np.float64).T
    assert np.isfinite(out).all(), np.argwhere(~np.isfinite(out))[:5]
    err = np.abs(out - ref)
    bound = q8_bound(x, wf)
    assert (err <= bound).all(), (err / bound).max()
    # relative to each row's own size, rows down to 1e-20 are as accurate as ordinary ones (below
    # that s = dx*dw leaves float32's normal range: only the absolute term of the bound holds)
    rel = err.max(axis=1) / np.abs(ref).max(axis=1)
    normal = np.abs(x).max(axis=1) >= 1e-20
    assert normal.sum() == 12 and (rel[normal] < 2e-2).all(), rel
    assert same_bits_or_both_nan(out, q8_model(x, w))


def test_q8_range_negative_control():
    """The float16 scale (the old contract) fails the same edges: rows of inf/NaN above
    127 * 65504 and a lost (zero) result at 1e-9, so the edge test exercises the range."""
    Kd, N = 256, 8
    x = _q8_range_rows(Kd)
    w = gguf_quantize(rand_x(np.random.default_rng(22), N, Kd, 0.05), Q8)
    old = q8_model(x, w, scale="f16")
    assert not np.isfinite(old[2]).any() and not np.isfinite(old[5]).any()
    wf = decode_np(w, "Q8_0", N, Kd)
    ref = x.astype(np.float64) @ wf.astype(np.float64).T
    assert (np.abs(old[9] - ref[9]) > 0.5 * np.abs(ref[9])).any()       # 1e-9: lost


@pytest.mark.parametrize("prec", ["bf16", "q8"])
def test_error_vs_float64_within_bound(prec):
    """Measured error of the default variant vs float64 x @ dequant(w).T at K=3840 on random data,
    inside the derived bound (random signs make it far from tight: see the adversarial test)."""
    rng = np.random.default_rng(12)
    T, Kd, N = 32, 3840, 96
    x = rand_x(rng, T, Kd)
    w = gguf_quantize(rand_x(rng, N, Kd, 0.02), Q8)
    wf = decode_np(w, "Q8_0", N, Kd)
    out = run_bf16(x, w, "Q8_0", None) if prec == "bf16" else run_q8(x, w, None)
    ref = x.astype(np.float64) @ wf.astype(np.float64).T
    err = np.abs(out - ref)
    bound = bf16_bound(x, wf) if prec == "bf16" else q8_bound(x, wf)
    assert (err <= bound).all(), (err / bound).max()
    rel = err / np.abs(ref).max()
    print(f"{prec}: max |err|/max|ref| = {rel.max():.2e}, rms = {np.sqrt((rel ** 2).mean()):.2e}, "
          f"worst err/bound = {(err / bound).max():.3f}")


def test_bf16_bound_is_tight_on_adversarial_data():
    """Every input 1 + 2^-8 - 2^-20 rounds down to 1 (error just under u): the error is > 90% of
    the bound, and a bound built with u = 2^-9 is violated (negative control)."""
    Kd = 1024
    x = np.full((3, Kd), 1 + 2.0 ** -8 - 2.0 ** -20, np.float32)
    wf = np.full((5, Kd), 1 + 2.0 ** -8 - 2.0 ** -20, np.float32)
    out = run_bf16(x, wf, "F32", None)
    ref = x.astype(np.float64) @ wf.astype(np.float64).T
    err = np.abs(out - ref)
    assert (err <= bf16_bound(x, wf)).all()
    assert (err / bf16_bound(x, wf)).min() > 0.9
    assert (err > bf16_bound(x, wf, u=2.0 ** -9)).all()


def test_q8_bound_is_tight_on_adversarial_data():
    """Blocks whose elements all quantize downward (k + 0.49 steps) against positive weights: the
    error equals the quantization term of the bound (> 90% of the whole bound)."""
    Kd = 1024
    c = 2.0 ** -4                                       # d = amax/127 = c, exact in fp16
    blk = np.concatenate([[127.0], (np.arange(1, 32) % 100) + 0.49]) * c
    x = np.tile(blk, (3, Kd // 32)).astype(np.float32)
    wf = np.full((5, Kd), 0.5, np.float32)
    w = gguf_quantize(wf, Q8)
    out = run_q8(x, w, None)
    ref = x.astype(np.float64) @ decode_np(w, "Q8_0", 5, Kd).astype(np.float64).T
    err = np.abs(out - ref)
    bound = q8_bound(x, decode_np(w, "Q8_0", 5, Kd))
    assert (err <= bound).all()
    assert (err / bound).min() > 0.9


# ----------------------------------------------------------------------------- dispatch

def test_variants_registered_and_env_forces_generic():
    v = nxhpc.kernel_variants()
    for fam in ("matmul_bf16", "matmul_q8", "round_bf16"):
        assert fam in v
    disabled = os.environ.get("NXHPC_DISABLE_SIMD", "0") not in ("", "0")
    best = K.cpu_features()["best_isa"]
    assert v["matmul_bf16"] == ("generic" if disabled else expected_variant(SIMD_BF16, best))
    assert v["matmul_q8"] == ("generic" if disabled else expected_variant(SIMD_Q8, best))
    assert v["round_bf16"] == ("generic" if disabled else expected_variant(SIMD_BF16_SPEC, best))
    code = ("import nxhpc, json; v = nxhpc.kernel_variants(); "
            "print(json.dumps([v['matmul_bf16'], v['matmul_q8']]))")
    env = dict(os.environ, NXHPC_DISABLE_SIMD="1")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert eval(res.stdout) == ["generic", "generic"]
    env["NXHPC_DISABLE_SIMD"] = "0"                     # negative control
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert eval(res.stdout) == [expected_variant(SIMD_BF16, ISAS[-1]), expected_variant(SIMD_Q8, ISAS[-1])]


def test_lowp_slots_follow_the_isa_chain():
    """The lowp slots live in the per-ISA tables: at every ISA each slot runs the nearest ISA on
    its chain that has its own code (bf16 at avx2 and avx512bf16, q8 at avx2 (vpmaddubsw), at
    avxvnni (VEX vpdpbusd), its VNNI kernel at avx512, whose required features include VNNI,
    and its AMX kernel at amx), else the generic spec; lowp_variants lists exactly those."""
    feats = K.cpu_features()
    assert "avx512vnni" in feats["isas"]["avx512"]["needs"]
    assert "avx512bf16" in feats["isas"]["avx512bf16"]["needs"]
    assert {"amx_int8", "os_amx", "amx_permitted"} <= set(feats["isas"]["amx"]["needs"])
    assert "avxvnni" in feats["isas"]["avxvnni"]["needs"]
    own = {"matmul_bf16": {"avx2", "avx512bf16", "amx"},
           "matmul_q8": {"avx2", "avxvnni", "avx512", "amx"},
           "round_bf16": {"avx2", "avx512bf16"}}
    for isa in K.ISA_NAMES:
        for slot, have in own.items():
            assert K._variant(slot, isa) == expected_variant(have, isa), (slot, isa)
    assert BF16_VARIANTS == ["generic"] + [i for i in ISAS if i in own["matmul_bf16"]]
    assert Q8_VARIANTS == ["generic"] + [i for i in ISAS if i in own["matmul_q8"]]
    if "avx512bf16" in ISAS:   # a request above q8's own ISA runs the inherited VNNI kernel
        rng = np.random.default_rng(15)
        x, w = rand_x(rng, 7, 96), rand_q8_raw(rng, 33, 96)
        assert same_bits_or_both_nan(run_q8(x, w, "avx512bf16"), run_q8(x, w, "generic"))


def test_isa_none_is_default_variant():
    rng = np.random.default_rng(13)
    x, w = rand_x(rng, 3, 64), rand_q8_raw(rng, 10, 64)
    disabled = os.environ.get("NXHPC_DISABLE_SIMD", "0") not in ("", "0")
    best = K.cpu_features()["best_isa"]
    assert same_bits_or_both_nan(run_q8(x, w, None), run_q8(x, w, "generic" if disabled else best))
    assert same_bits_or_both_nan(run_bf16(x, w, "Q8_0", None),
                                 run_bf16(x, w, "Q8_0", "generic" if disabled else best))
    # level names select the best variant at or below that level
    assert same_bits_or_both_nan(run_q8(x, w, "avx2"), run_q8(x, w, "generic"))


# ----------------------------------------------------------------------------- bad input

# A GGML type without traits in this build (the bf16 path decodes every type that has them).
NO_TYPE = next(t for t in gguf.GGMLQuantizationType if t.name not in K.weight_types())


def _bad_cases():
    f = np.float32
    x = np.ones((4, 64), f)
    wq = np.zeros((6, 68), np.uint8)
    wf = np.ones((6, 64), f)
    out = np.zeros((4, 6), f)
    ro = np.zeros((4, 6), f)
    ro.flags.writeable = False
    mb, mq = K.matmul_bf16, K.matmul_q8
    return [
        ("bf x float64", lambda: mb(x.astype(np.float64), wf, "F32", out), TypeError),
        ("bf x 1-D", lambda: mb(x[0], wf, "F32", out), ValueError),
        ("bf x non-contiguous", lambda: mb(np.ones((4, 128), f)[:, ::2], wf, "F32", out), ValueError),
        ("bf x list", lambda: mb(x.tolist(), wf, "F32", out), TypeError),
        ("bf wtype unsupported name", lambda: mb(x, wq, NO_TYPE.name, out), ValueError),
        ("bf wtype unsupported id", lambda: mb(x, wq, int(NO_TYPE), out), ValueError),
        ("bf wtype unsupported gguf", lambda: mb(x, wq, NO_TYPE, out), ValueError),
        ("bf wtype bogus name", lambda: mb(x, wq, "Q9_9", out), ValueError),
        ("bf wtype float", lambda: mb(x, wq, 8.0, out), TypeError),
        ("bf wtype None", lambda: mb(x, wq, None, out), TypeError),
        ("bf w float64", lambda: mb(x, wf.astype(np.float64), "F32", out), TypeError),
        ("bf w float16 for F32", lambda: mb(x, wf.astype(np.float16), "F32", out), TypeError),
        ("bf w float32 for Q8_0", lambda: mb(x, wf, "Q8_0", out), TypeError),
        ("bf w 1-D", lambda: mb(x, wq[0], "Q8_0", out), ValueError),
        ("bf w non-contiguous", lambda: mb(x, np.zeros((6, 136), np.uint8)[:, ::2], "Q8_0", out), ValueError),
        ("bf w K mismatch", lambda: mb(x, np.zeros((6, 102), np.uint8), "Q8_0", out), ValueError),
        ("bf w F32 K mismatch", lambda: mb(x, np.ones((6, 63), f), "F32", out), ValueError),
        ("bf Q8_0 K % 32", lambda: mb(np.ones((4, 48), f), np.zeros((6, 51), np.uint8), "Q8_0", out), ValueError),
        ("bf w list", lambda: mb(x, wf.tolist(), "F32", out), TypeError),
        ("bf out None", lambda: mb(x, wf, "F32", None), TypeError),
        ("bf out shape", lambda: mb(x, wf, "F32", np.zeros((4, 5), f)), ValueError),
        ("bf out float64", lambda: mb(x, wf, "F32", np.zeros((4, 6))), TypeError),
        ("bf out read-only", lambda: mb(x, wf, "F32", ro), ValueError),
        ("bf bias shape", lambda: mb(x, wf, "F32", out, bias=np.ones(5, f)), ValueError),
        ("bf bias float64", lambda: mb(x, wf, "F32", out, bias=np.ones(6)), TypeError),
        ("bf n1 > N", lambda: mb(x, wf, "F32", out, 0, 7), ValueError),
        ("bf n0 > n1", lambda: mb(x, wf, "F32", out, 4, 2), ValueError),
        ("bf n1 float", lambda: mb(x, wf, "F32", out, 0, 2.5), TypeError),
        ("bf isa bogus", lambda: mb(x, wf, "F32", out, isa="sse9"), ValueError),
        ("bf isa q8 variant", lambda: mb(x, wf, "F32", out, isa="avx512vnni"), ValueError),
        ("bf isa int", lambda: mb(x, wf, "F32", out, isa=2), ValueError),
        ("q8 w float32", lambda: mq(x, wf, out), TypeError),
        ("q8 w list", lambda: mq(x, wq.tolist(), out), TypeError),
        ("q8 w bytes % 34", lambda: mq(x, np.zeros((6, 67), np.uint8), out), ValueError),
        ("q8 w K mismatch", lambda: mq(x, np.zeros((6, 102), np.uint8), out), ValueError),
        ("q8 K % 32", lambda: mq(np.ones((4, 48), f), np.zeros((6, 51), np.uint8), out), ValueError),
        ("q8 x float64", lambda: mq(x.astype(np.float64), wq, out), TypeError),
        ("q8 out None", lambda: mq(x, wq, None), TypeError),
        ("q8 out shape", lambda: mq(x, wq, np.zeros((6, 4), f)), ValueError),
        ("q8 out read-only", lambda: mq(x, wq, ro), ValueError),
        ("q8 bias shape", lambda: mq(x, wq, out, bias=np.ones((1, 6), f)), ValueError),
        ("q8 n0 < 0", lambda: mq(x, wq, out, -1, 3), ValueError),
        ("q8 n0 str", lambda: mq(x, wq, out, "a", 3), TypeError),
        ("q8 isa old variant name", lambda: mq(x, wq, out, isa="avx512vnni"), ValueError),
        ("q8 isa bogus", lambda: mq(x, wq, out, isa="avx512_vnni"), ValueError),
        ("round x float64", lambda: K.round_bf16(np.ones(3)), TypeError),
        ("round isa bogus", lambda: K.round_bf16(np.ones(3, f), isa="x"), ValueError),
        ("variants bogus", lambda: K.lowp_variants("f32"), ValueError),
    ]


@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_bad_input_raises_clear_error(case):
    assert_error_names(case, ("matmul_bf16", "matmul_q8", "round_bf16", "lowp_variants"))


def test_errors_leave_out_untouched_and_alias_rejected():
    rng = np.random.default_rng(14)
    x, w = rand_x(rng, 4, 64), rand_q8_raw(rng, 6, 64)
    out = np.full((4, 6), 3.25, np.float32)
    with pytest.raises(ValueError):
        K.matmul_q8(x, w, out, 0, 9)
    with pytest.raises(ValueError):
        K.matmul_bf16(x, w, "Q4_K", out)
    with pytest.raises(TypeError):
        K.matmul_bf16(x, w, "Q8_0", out, bias=np.ones(6))
    assert (out == 3.25).all()
    buf = np.zeros(4 * 64, np.float32)
    xa, oa = buf.reshape(4, 64), buf[:16].reshape(4, 4)     # contiguous, overlapping
    with pytest.raises(ValueError, match="overlap"):
        K.matmul_bf16(xa, np.ones((4, 64), np.float32), "F32", oa)
    with pytest.raises(ValueError, match="overlap"):
        K.matmul_q8(xa, np.zeros((4, 68), np.uint8), oa)
    o2 = np.zeros((1, 6), np.float32)
    with pytest.raises(ValueError, match="overlap"):
        K.matmul_q8(np.ones((1, 64), np.float32), w, o2, bias=o2[0])
    with pytest.raises(ValueError, match="overlap"):
        K.matmul_bf16(np.ones((1, 64), np.float32), w, "Q8_0", o2, bias=o2[0])


def test_empty_shapes():
    x = np.zeros((0, 64), np.float32)
    w = np.zeros((5, 68), np.uint8)
    out = np.zeros((0, 5), np.float32)
    assert K.matmul_q8(x, w, out) is out
    assert K.matmul_bf16(x, w, "Q8_0", out) is out
    x1 = np.ones((2, 64), np.float32)
    o1 = np.full((2, 5), 9.0, np.float32)
    K.matmul_q8(x1, w, o1, 3, 3)
    K.matmul_bf16(x1, w, "Q8_0", o1, 2, 2)
    assert (o1 == 9).all()
