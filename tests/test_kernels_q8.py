"""Tests of the Q8_0 kernel family: quantize, dequantize, Q8_0 x float32 matmul, adaLN linear.

Independent references only: the ``gguf`` package's quantizer/dequantizer (bit-exact ggml
reference), a plain float64 numpy evaluation that decodes the block bytes itself, the bounds of
floating-point error analysis, and hand-derived exact results of the documented summation order.
Variant checks compare every ISA level with the generic (scalar) spec, bit for bit, because the
kernels promise one fixed two-level sum per output (128-step fma chains, chunk sums added in
order; csrc/nx_q8_0.h) whatever the ISA.
"""
import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from hypothesis import given
from hypothesis import strategies as st
from kernelutil import (CHAIN, EPS32, ISAS, assert_error_names, band_edges, bits, expected_variant,
                        matmul_bound)

import nxhpc
from nxhpc import _kernels as K

Q8 = gguf.GGMLQuantizationType.Q8_0
MATMUL_FAMILIES = ("q8_0_quantize", "dequantize[Q8_0]", "q8_0_matmul", "matmul")


# ----------------------------------------------------------------------------- helpers

def decode_q8_0_f64(w):
    """Plain float64 decode of raw Q8_0 bytes [N, nb*34] -> [N, nb*32], sharing nothing with C."""
    n, nbytes = w.shape
    nb = nbytes // 34
    blocks = w.reshape(n * nb, 34)
    d = blocks[:, :2].copy().view("<f2").astype(np.float64)          # [n*nb, 1]
    q = blocks[:, 2:].view(np.int8).astype(np.float64)               # [n*nb, 32]
    return (d * q).reshape(n, nb * 32)


def matmul_ref(x, w):
    """float64 out = x @ dequant(w).T and the magnitude sum_k |x||w| per output."""
    w64 = decode_q8_0_f64(w)
    x64 = x.astype(np.float64)
    return x64 @ w64.T, np.abs(x64) @ np.abs(w64).T


def assert_within_bound(out, ref, mag, K):
    err = np.abs(out.astype(np.float64) - ref)
    bound = matmul_bound(K, mag)
    bad = ~(err <= bound)
    assert not bad.any(), (f"{bad.sum()} outputs exceed the fma-chain bound; worst ratio "
                           f"{np.max(err / bound):.3g}")


def rand_q8(rng, n, k, scale=1.0):
    w = (rng.standard_normal((n, k)) * scale).astype(np.float32)
    return gguf_quantize(w, Q8)


def rand_x(rng, t, k):
    return rng.standard_normal((t, k)).astype(np.float32)


def _case(seed, T, Kd, N):
    """(rng, x [T, Kd] float32, Q8_0 w [N, Kd]) drawn from ``seed`` in that order."""
    rng = np.random.default_rng(seed)
    return rng, rand_x(rng, T, Kd), rand_q8(rng, N, Kd)


# ----------------------------------------------------------------------------- layout

def test_block_dtype_pins_the_layout():
    dt = K.Q8_0_BLOCK_DTYPE
    assert dt.itemsize == 34 == K.Q8_0_BLOCK_BYTES
    assert dt.fields["d"][1] == 0 and dt.fields["qs"][1] == 2
    assert dt.fields["d"][0] == np.dtype("<f2") and dt.fields["qs"][0].shape == (32,)
    # Viewing gguf's bytes through the dtype gives gguf's own dequantization.
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 96)).astype(np.float32)
    raw = gguf_quantize(x, Q8)
    blocks = raw.reshape(-1).view(dt)
    assert blocks.shape == (9,)
    mine = (blocks["d"].astype(np.float32)[:, None] * blocks["qs"].astype(np.float32)).reshape(3, 96)
    np.testing.assert_array_equal(mine, gguf_dequantize(raw, Q8))


# ----------------------------------------------------------------------------- quantize

def _check_quantize(x):
    ref = gguf_quantize(x, Q8)
    for isa in ISAS:
        got = K.q8_0_quantize(x, isa=isa)
        assert got.dtype == np.uint8 and got.shape == ref.shape
        if not np.array_equal(got, ref):
            i = np.argwhere(got != ref)[0]
            raise AssertionError(f"isa={isa}: byte {tuple(i)} differs: {got[tuple(i)]} vs gguf "
                                 f"{ref[tuple(i)]}")


@pytest.mark.parametrize("shape", [(1, 32), (4, 64), (3, 4096 + 32), (2, 3, 96)])
def test_quantize_random_matches_gguf(shape):
    rng = np.random.default_rng(2)
    _check_quantize(rng.standard_normal(shape).astype(np.float32))


def test_quantize_many_scales_matches_gguf():
    """100k blocks, each at its own magnitude (1e-12 .. 1e12): exercises every float16 rounding
    regime of the scale (zero, subnormal, normal, overflow to inf) and the q rounding."""
    rng = np.random.default_rng(3)
    scale = 10.0 ** rng.uniform(-12, 12, size=(100_000, 1))
    x = (rng.standard_normal((100_000, 32)) * scale).astype(np.float32)
    with np.errstate(all="ignore"):
        _check_quantize(x)


def test_quantize_half_way_values_match_gguf():
    """x = (j + 1/2) * d exactly representable: round-half-away must match, incl. negatives."""
    j = np.arange(-127, 127, dtype=np.float32)
    vals = np.concatenate([j + 0.5, j, j + 0.49999997, j + 0.50000006])
    vals = np.clip(vals, -127, 127).astype(np.float32)
    vals = vals[: len(vals) // 31 * 31].reshape(-1, 31)
    x = np.concatenate([vals, np.full((len(vals), 1), 127.0, np.float32)], axis=1)
    for s in (1.0, 0.25, 3.0e-3, 7.0e4):
        with np.errstate(all="ignore"):
            _check_quantize((x * np.float32(s)).astype(np.float32))


def _edge_blocks():
    f32 = np.finfo(np.float32)
    blocks = {
        "zeros": np.zeros(32),
        "neg_zero": np.full(32, -0.0),
        "max": np.where(np.arange(32) % 2 == 0, f32.max, -f32.max),
        "max_and_small": np.r_[f32.max, np.linspace(-1e30, 1e30, 31)],
        "inf_scale_f16": np.r_[1.0e7, np.linspace(-1e6, 1e6, 31)],      # d > 65504 -> inf half
        "half_max_edge": np.r_[65504.0 * 127, np.zeros(31)],
        "half_overflow_tie": np.r_[65520.0 * 127, np.ones(31)],
        "subnormal_half_scale": np.r_[1e-4, np.linspace(-1e-5, 1e-5, 31)],  # d ~ 8e-7
        "zero_half_scale": np.r_[2e-6, np.linspace(-1e-6, 1e-6, 31)],   # d ~ 1.6e-8 -> half 0
        "f32_subnormal_x": np.r_[1e-39, -3e-40, np.zeros(30)],            # 1/d overflows
        "f32_tiny_normal": np.r_[1e-37, -5e-38, np.zeros(30)],
        "one_hot": np.r_[np.zeros(31), -2.5],
        "pos_inf": np.r_[np.inf, np.ones(31)],
        "neg_inf": np.r_[np.ones(31), -np.inf],
        "nan": np.r_[1.0, np.nan, np.ones(30)],
        "ramp": np.linspace(-1, 1, 32),
    }
    return {k: np.asarray(v, dtype=np.float32) for k, v in blocks.items()}


@pytest.mark.parametrize("name", sorted(_edge_blocks()))
def test_quantize_edge_blocks_match_gguf(name):
    block = _edge_blocks()[name]
    x = np.stack([block, block[::-1].copy(), np.linspace(-3, 3, 32, dtype=np.float32)])
    with np.errstate(all="ignore"):
        _check_quantize(np.ascontiguousarray(x))
    # A long row (K = 4096 + 32) holding the edge block in its last position.
    row = np.random.default_rng(4).standard_normal(4096 + 32).astype(np.float32)
    row[-32:] = block
    with np.errstate(all="ignore"):
        _check_quantize(row[None, :])


@given(rows=st.integers(1, 5), nb=st.integers(1, 9), log_scale=st.floats(-30, 30),
       seed=st.integers(0, 2**32 - 1))
def test_quantize_hypothesis_matches_gguf(rows, nb, log_scale, seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, nb * 32)) * 10.0 ** log_scale).astype(np.float32)
    with np.errstate(all="ignore"):
        _check_quantize(x)


def test_quantize_writes_into_out():
    x = np.random.default_rng(5).standard_normal((2, 64)).astype(np.float32)
    out = np.zeros((2, 68), np.uint8)
    assert K.q8_0_quantize(x, out=out) is out
    np.testing.assert_array_equal(out, gguf_quantize(x, Q8))


# ----------------------------------------------------------------------------- dequantize

@pytest.mark.parametrize("shape", [(1, 34), (5, 68), (2, (4096 + 32) // 32 * 34), (2, 2, 34)])
def test_dequantize_random_bytes_match_gguf(shape):
    """Random bytes: the float16 scale takes every kind of value (subnormal, inf, NaN)."""
    rng = np.random.default_rng(6)
    w = rng.integers(0, 256, size=shape, dtype=np.uint8)
    with np.errstate(all="ignore"):
        ref = gguf_dequantize(w, Q8)
    for isa in ISAS:
        got = K.q8_0_dequantize(w, isa=isa)
        assert got.shape == ref.shape
        np.testing.assert_array_equal(bits(got), bits(ref), err_msg=f"isa={isa}")


def test_dequantize_all_half_scales():
    """Every one of the 65536 float16 bit patterns as a scale, q = -128..127 pattern."""
    h = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    w = np.empty((65536, 34), np.uint8)
    w[:, :2] = h.view(np.uint8).reshape(-1, 2)
    w[:, 2:] = (np.arange(32) * 8 + np.arange(65536)[:, None]).astype(np.uint8)
    with np.errstate(all="ignore"):
        ref = gguf_dequantize(w, Q8)
    for isa in ISAS:
        np.testing.assert_array_equal(bits(K.q8_0_dequantize(w, isa=isa)), bits(ref))


def test_dequantize_read_only_input_and_roundtrip():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((3, 128)).astype(np.float32)
    w = gguf_quantize(x, Q8)
    w.flags.writeable = False
    before = w.copy()
    out = np.empty((3, 128), np.float32)
    assert K.q8_0_dequantize(w, out=out) is out
    np.testing.assert_array_equal(w, before)
    # Round trip error of Q8_0 is at most half a quantum (d/2) per value, plus d's float16 error.
    d = np.abs(x).reshape(3, 4, 32).max(axis=2, keepdims=True) / 127
    err = np.abs(out - x).reshape(3, 4, 32)
    assert (err <= d * 0.5 * (1 + 2 ** -9) + d * 127 * 2 ** -11).all()


# ----------------------------------------------------------------------------- matmul

def _matmul(x, w, isa, n0=0, n1=None, out=None):
    if out is None:
        out = np.full((x.shape[0], w.shape[0]), np.nan, np.float32)
    K.q8_0_matmul(x, w, out, n0, n1, isa=isa)
    return out


def test_matmul_bound_is_not_vacuous():
    """Negative controls: the float64 check rejects a wrong result of realistic size."""
    rng = np.random.default_rng(8)
    x, w = rand_x(rng, 5, 256), rand_q8(rng, 9, 256)
    out = _matmul(x, w, "generic")
    ref, mag = matmul_ref(x, w)
    assert_within_bound(out, ref, mag, 256)
    # (a) one output off by one float32 quantum more than its bound allows
    bad = out.copy()
    bad[2, 3] = np.float32(ref[2, 3] + 2 * matmul_bound(256, mag[2, 3]))
    with pytest.raises(AssertionError):
        assert_within_bound(bad, ref, mag, 256)
    # (b) a kernel that forgot the scales (d = 1) or used one wrong quant
    w_nod = w.copy()
    w_nod.reshape(-1, 34)[:, :2] = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)
    with pytest.raises(AssertionError):
        assert_within_bound(_matmul(x, w_nod, "generic"), ref, mag, 256)
    w_q = w.copy()
    w_q[4, 2 + 5] = np.uint8((int(w_q[4, 2 + 5]) + 1) % 256)     # q[4, 5] changes by +-1
    with pytest.raises(AssertionError):
        assert_within_bound(_matmul(x, w_q, "generic"), ref, mag, 256)


def _ones_q8(n, k):
    """Q8_0 bytes of an all-ones [n, k] weight: every block d = 1.0 (float16 0x3C00), q = 1."""
    blk = np.zeros(34, np.uint8)
    blk[:2] = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)
    blk[2:] = 1
    return np.tile(blk, (n, k // 32))


@pytest.mark.parametrize("Kd,expected", [
    (128, 1.0),                               # one chunk: every 2^-25 is lost against 1
    (160, 1.0 + 2.0 ** -20),                  # chunk 1: 32 * 2^-25, exact from +0
    (256, 1.0 + 2.0 ** -18),                  # chunk 1: 128 * 2^-25
    (416, 1.0 + 2.0 ** -17 + 2.0 ** -20),     # chunks 1, 2: 2^-18 each; chunk 3: 2^-20
])
def test_matmul_two_level_order_exact(Kd, expected):
    """The documented order, checked against values derived by hand (no code under test).

    x = [1, 2^-25, 2^-25, ...], w = 1: inside chunk 0 each 1 + 2^-25 rounds back to 1 (below half
    an ulp of 1), while every later chunk sums its 2^-25 terms exactly from +0 and the chunk sums
    are then added exactly. A single K-long chain would give 1.0, float64 1 + (K-1) 2^-25: both
    differ from `expected` for K > 128 (negative controls below), so the order is pinned.
    """
    x = np.full((2, Kd), 2.0 ** -25, np.float32)
    x[:, 0] = 1.0
    x[1] *= -2.0                                              # exact scaling: -2 * expected
    N = 33                                                    # one full 32-column tile + a tail
    w = _ones_q8(N, Kd)
    if Kd > CHAIN:
        assert expected != 1.0 and expected != 1.0 + (Kd - 1) * 2.0 ** -25
    want = np.array([[expected] * N, [-2 * expected] * N], np.float32)
    for isa in ISAS:
        np.testing.assert_array_equal(bits(_matmul(x, w, isa)), bits(want), err_msg=f"isa={isa}")
        out = np.full(N, np.nan, np.float32)                  # adaLN runs the same order
        K.adaln_linear(x[0], w, "Q8_0", None, out, isa=isa)
        np.testing.assert_array_equal(bits(out), bits(want[0]), err_msg=f"adaln isa={isa}")
        K.adaln_linear(x[0], np.ones((N, Kd), np.float32), "F32", None, out, isa=isa)
        np.testing.assert_array_equal(bits(out), bits(want[0]), err_msg=f"adaln f32 isa={isa}")


TS = [1, 2, 7, 12, 13, 31, 33]
KS = [32, 64, 96, 288, 4096 + 32]
NS = [1, 7, 16, 17, 31, 32, 33, 65, 257]


@given(T=st.sampled_from(TS), Kd=st.sampled_from(KS), N=st.sampled_from(NS),
       seed=st.integers(0, 2**32 - 1))
def test_matmul_vs_float64_and_variants_bit_identical(T, Kd, N, seed):
    if Kd > 1000:
        N = min(N, 33)
    rng = np.random.default_rng(seed)
    x, w = rand_x(rng, T, Kd), rand_q8(rng, N, Kd, scale=10.0 ** rng.uniform(-3, 3))
    ref, mag = matmul_ref(x, w)
    gen = _matmul(x, w, "generic")
    assert_within_bound(gen, ref, mag, Kd)
    for isa in ISAS:
        got = _matmul(x, w, isa)
        assert_within_bound(got, ref, mag, Kd)
        np.testing.assert_array_equal(bits(got), bits(gen), err_msg=f"isa={isa} vs generic")


@pytest.mark.parametrize("T,Kd,N", [(300, 1088, 300), (2, 3840, 640), (1, 3840, 3 * 128)])
def test_matmul_crosses_every_blocking_level(T, Kd, N):
    """T > MC (264 tokens), K > KC (1024 avx512 / 512 avx2, with a partial last k-block),
    N > NC (128 / 256 columns, with a partial panel): every loop level runs, plus Z-Image's real
    K = 3840 with whole attention heads (hd = 128) of columns."""
    rng = np.random.default_rng(9)
    x, w = rand_x(rng, T, Kd), rand_q8(rng, N, Kd)
    ref, mag = matmul_ref(x, w)
    gen = _matmul(x, w, "generic")
    assert_within_bound(gen, ref, mag, Kd)
    for isa in ISAS:
        np.testing.assert_array_equal(bits(_matmul(x, w, isa)), bits(gen), err_msg=f"isa={isa}")


@pytest.mark.parametrize("isa", ISAS)
def test_matmul_band_invariance(isa):
    """Any split of the columns into bands gives the same bits; columns outside a band untouched."""
    T, Kd, N = 13, 320, 301
    rng, x, w = _case(10, T, Kd, N)
    full = _matmul(x, w, isa)
    for trial in range(6):
        edges = band_edges(rng, N, 12)
        out = np.full((T, N), np.nan, np.float32)
        for a, b in zip(edges[:-1], edges[1:]):
            K.q8_0_matmul(x, w, out, a, b, isa=isa)
        np.testing.assert_array_equal(bits(out), bits(full), err_msg=f"bands {edges}")
    # single columns, in a scrambled order
    out = np.full((T, N), np.nan, np.float32)
    for n in rng.permutation(N):
        K.q8_0_matmul(x, w, out, int(n), int(n) + 1, isa=isa)
    np.testing.assert_array_equal(bits(out), bits(full))


@pytest.mark.parametrize("isa", ISAS)
def test_matmul_leaves_columns_outside_band_untouched(isa):
    T, Kd, N = 7, 96, 70
    rng, x, w = _case(11, T, Kd, N)
    sentinel = rng.standard_normal((T, N)).astype(np.float32)
    out = sentinel.copy()
    K.q8_0_matmul(x, w, out, 17, 50, isa=isa)
    np.testing.assert_array_equal(bits(out[:, :17]), bits(sentinel[:, :17]))
    np.testing.assert_array_equal(bits(out[:, 50:]), bits(sentinel[:, 50:]))
    # negative control: inside the band every value was written (sentinel is replaced)
    assert not np.any(bits(out[:, 17:50]) == bits(sentinel[:, 17:50]))
    ref, mag = matmul_ref(x, w)
    assert_within_bound(out[:, 17:50], ref[:, 17:50], mag[:, 17:50], Kd)


@pytest.mark.parametrize("isa", ISAS)
def test_matmul_token_invariance(isa):
    """A token's output does not depend on how many tokens share the call (T=1 .. T > MC)."""
    T, Kd, N = 290, 320, 45
    rng, x, w = _case(12, T, Kd, N)
    full = _matmul(x, w, isa)
    for t in (0, 5, 11, 12, 263, 264, 289):
        one = _matmul(np.ascontiguousarray(x[t:t + 1]), w, isa)
        np.testing.assert_array_equal(bits(one[0]), bits(full[t]), err_msg=f"token {t}")
    for a, b in ((0, 7), (7, 40), (40, 289), (100, 290)):
        part = _matmul(np.ascontiguousarray(x[a:b]), w, isa)
        np.testing.assert_array_equal(bits(part), bits(full[a:b]))


def test_matmul_reads_read_only_memory_map(tmp_path):
    rng = np.random.default_rng(13)
    x, w = rand_x(rng, 5, 128), rand_q8(rng, 40, 128)
    path = tmp_path / "w.bin"
    w.tofile(path)
    wm = np.memmap(path, dtype=np.uint8, mode="r", shape=w.shape)
    assert not wm.flags.writeable
    for isa in ISAS:
        np.testing.assert_array_equal(bits(_matmul(x, wm, isa)), bits(_matmul(x, w, "generic")))
    np.testing.assert_array_equal(np.fromfile(path, np.uint8).reshape(w.shape), w)


def test_matmul_unaligned_weight_rows():
    """Weight bytes at an odd address (a slice of a bigger buffer): scales read unaligned."""
    rng = np.random.default_rng(14)
    x, w = rand_x(rng, 3, 64), rand_q8(rng, 33, 64)
    buf = np.zeros(w.size + 1, np.uint8)
    buf[1:] = w.reshape(-1)
    wu = buf[1:].reshape(w.shape)
    assert wu.ctypes.data % 2 == 1
    for isa in ISAS:
        np.testing.assert_array_equal(bits(_matmul(x, wu, isa)), bits(_matmul(x, w, "generic")))


def test_matmul_non_finite_activations_propagate_identically():
    rng = np.random.default_rng(15)
    x, w = rand_x(rng, 4, 64), rand_q8(rng, 19, 64)
    x[1, 3] = np.inf
    x[2, 40] = np.nan
    gen = _matmul(x, w, "generic")
    assert np.isnan(gen[2]).all() and np.isfinite(gen[0]).all()
    for isa in ISAS:
        np.testing.assert_array_equal(bits(_matmul(x, w, isa)), bits(gen))


def test_default_isa_runs_the_reported_variant_and_matches_generic():
    """isa=None (the path CI also runs with NXHPC_DISABLE_SIMD=1) gives the generic spec's bits."""
    rng = np.random.default_rng(20)
    x, w = rand_x(rng, 5, 64), rand_q8(rng, 37, 64)
    out = np.full((5, 37), np.nan, np.float32)
    assert K.q8_0_matmul(x, w, out) is out
    np.testing.assert_array_equal(bits(out), bits(_matmul(x, w, "generic")))
    xq = rng.standard_normal((3, 64)).astype(np.float32)
    np.testing.assert_array_equal(K.q8_0_quantize(xq), gguf_quantize(xq, Q8))
    np.testing.assert_array_equal(bits(K.q8_0_dequantize(w)), bits(gguf_dequantize(w, Q8)))


def test_matmul_empty_inputs_return_early():
    w = rand_q8(np.random.default_rng(16), 5, 64)
    out = np.zeros((0, 5), np.float32)
    for isa in ISAS:
        assert K.q8_0_matmul(np.zeros((0, 64), np.float32), w, out, isa=isa) is out
        o = np.full((2, 5), 7.0, np.float32)
        K.q8_0_matmul(np.ones((2, 64), np.float32), w, o, 3, 3, isa=isa)
        assert (o == 7.0).all()
        # K = 0: the empty sum is +0 in the band
        o = np.full((2, 4), 7.0, np.float32)
        K.q8_0_matmul(np.zeros((2, 0), np.float32), np.zeros((4, 0), np.uint8), o, 1, 3, isa=isa)
        np.testing.assert_array_equal(o, [[7, 0, 0, 7], [7, 0, 0, 7]])


# ----------------------------------------------------------------------------- adaLN linear

def _silu64(t):
    t = t.astype(np.float64)
    return t / (1.0 + np.exp(-t))


@pytest.mark.parametrize("silu_input", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_adaln_linear_f32_weights(silu_input, with_bias):
    rng = np.random.default_rng(17)
    Kd, N = 256, 4 * 96 + 5
    t = (rng.standard_normal(Kd) * 3).astype(np.float32)
    w = (rng.standard_normal((N, Kd)) * 0.05).astype(np.float32)
    b = rng.standard_normal(N).astype(np.float32) if with_bias else None
    u = _silu64(t) if silu_input else t.astype(np.float64)
    ref = w.astype(np.float64) @ u + (b.astype(np.float64) if with_bias else 0.0)
    # silu in float32 (expf: a few ulp) perturbs u by <= 4 u |u|; the fma chain adds the matmul
    # bound; the bias add rounds once more.
    mag = np.abs(w.astype(np.float64)) @ np.abs(u)
    tol = (4 * EPS32 + matmul_bound(Kd, 1.0)) * mag + EPS32 * (np.abs(ref) + mag) + 1e-30
    for isa in ISAS:
        out = np.full(N, np.nan, np.float32)
        K.adaln_linear(t, w, "F32", b, out, silu_input=silu_input, isa=isa)
        assert (np.abs(out - ref) <= tol).all(), np.max(np.abs(out - ref) / tol)


@pytest.mark.parametrize("silu_input", [False, True])
def test_adaln_linear_q8_weights(silu_input):
    rng = np.random.default_rng(18)
    Kd, N = 256, 4 * 96 + 7
    t = (rng.standard_normal(Kd) * 3).astype(np.float32)
    w = rand_q8(rng, N, Kd, scale=0.05)
    b = rng.standard_normal(N).astype(np.float32)
    u = _silu64(t) if silu_input else t.astype(np.float64)
    w64 = decode_q8_0_f64(w)
    ref = w64 @ u + b
    mag = np.abs(w64) @ np.abs(u)
    tol = (4 * EPS32 + matmul_bound(Kd, 1.0)) * mag + EPS32 * (np.abs(ref) + mag) + 1e-30
    outs = {}
    for isa in ISAS:
        out = np.full(N, np.nan, np.float32)
        K.adaln_linear(t, w, "Q8_0", b, out, silu_input=silu_input, isa=isa)
        assert (np.abs(out - ref) <= tol).all(), np.max(np.abs(out - ref) / tol)
        outs[isa] = out
    for isa in ISAS:
        np.testing.assert_array_equal(bits(outs[isa]), bits(outs["generic"]))
    # The same weight stored as float32 (exact dequantization) gives the same bits.
    w32 = gguf_dequantize(w, Q8)
    for isa in ISAS:
        out = np.full(N, np.nan, np.float32)
        K.adaln_linear(t, w32, "F32", b, out, silu_input=silu_input, isa=isa)
        np.testing.assert_array_equal(bits(out), bits(outs["generic"]), err_msg=f"f32 {isa}")
    # Q8_0 path equals the matmul with T=1 plus the bias, bit for bit.
    uu = (t / (1 + np.exp(-t))).astype(np.float32) if silu_input else t
    mm = _matmul(np.ascontiguousarray(uu[None, :], np.float32), w, "generic")[0]
    if not silu_input:
        np.testing.assert_array_equal(bits(outs["generic"]), bits(mm + b))


# ----------------------------------------------------------------------------- bad input

def _bad_cases():
    f = np.float32
    x = np.ones((4, 64), f)
    w = rand_q8(np.random.default_rng(19), 6, 64)
    out = np.zeros((4, 6), f)
    ro = np.zeros((4, 6), f)
    ro.flags.writeable = False
    t = np.ones(64, f)
    wf = np.ones((6, 64), f)
    o6 = np.zeros(6, f)
    mm = K.q8_0_matmul
    cases = [
        # q8_0_matmul
        ("mm x float64", lambda: mm(x.astype(np.float64), w, out), TypeError),
        ("mm x list", lambda: mm(x.tolist(), w, out), TypeError),
        ("mm x None", lambda: mm(None, w, out), TypeError),
        ("mm w None", lambda: mm(x, None, out), TypeError),
        ("mm out None", lambda: mm(x, w, None), TypeError),
        ("mm w int8", lambda: mm(x, w.view(np.int8), out), TypeError),
        ("mm w float32", lambda: mm(x, np.ones((6, 64), f), out), TypeError),
        ("mm out float64", lambda: mm(x, w, out.astype(np.float64)), TypeError),
        ("mm x 1-D", lambda: mm(np.ones(64, f), w, out), ValueError),
        ("mm x 3-D", lambda: mm(np.ones((1, 4, 64), f), w, out), ValueError),
        ("mm w 1-D", lambda: mm(x, w.reshape(-1), out), ValueError),
        ("mm x non-contiguous", lambda: mm(np.ones((4, 128), f)[:, ::2], w, out), ValueError),
        ("mm x fortran", lambda: mm(np.asfortranarray(np.ones((4, 64), f)), w, out), ValueError),
        ("mm w non-contiguous", lambda: mm(x, np.ones((12, 68), np.uint8)[::2], out), ValueError),
        ("mm out non-contiguous", lambda: mm(x, w, np.zeros((4, 12), f)[:, ::2]), ValueError),
        ("mm out read-only", lambda: mm(x, w, ro), ValueError),
        ("mm out wrong shape", lambda: mm(x, w, np.zeros((4, 7), f)), ValueError),
        ("mm out transposed shape", lambda: mm(x, w, np.zeros((6, 4), f)), ValueError),
        ("mm K not multiple of 32", lambda: mm(np.ones((4, 48), f), np.ones((6, 34), np.uint8),
                                               out), ValueError),
        ("mm w row bytes % 34", lambda: mm(x, np.ones((6, 67), np.uint8), out), ValueError),
        ("mm K mismatch", lambda: mm(np.ones((4, 96), f), w, out), ValueError),
        ("mm n0 < 0", lambda: mm(x, w, out, -1, 3), ValueError),
        ("mm n1 > N", lambda: mm(x, w, out, 0, 7), ValueError),
        ("mm n0 > n1", lambda: mm(x, w, out, 4, 2), ValueError),
        ("mm n0 str", lambda: mm(x, w, out, "a", 2), TypeError),
        ("mm n1 float", lambda: mm(x, w, out, 0, 2.5), TypeError),
        ("mm isa bogus", lambda: mm(x, w, out, isa="sse9"), ValueError),
        ("mm isa int", lambda: mm(x, w, out, isa=2), ValueError),
        # q8_0_quantize
        ("qz x float64", lambda: K.q8_0_quantize(np.ones((2, 32))), TypeError),
        ("qz x list", lambda: K.q8_0_quantize([[1.0] * 32]), TypeError),
        ("qz x None", lambda: K.q8_0_quantize(None), TypeError),
        ("qz x 0-D", lambda: K.q8_0_quantize(np.ones((), f)), ValueError),
        ("qz K % 32", lambda: K.q8_0_quantize(np.ones((2, 33), f)), ValueError),
        ("qz non-contiguous", lambda: K.q8_0_quantize(np.ones((2, 64), f)[:, ::2]), ValueError),
        ("qz out shape", lambda: K.q8_0_quantize(np.ones((2, 32), f), out=np.zeros((2, 35), np.uint8)),
         ValueError),
        ("qz out dtype", lambda: K.q8_0_quantize(np.ones((2, 32), f), out=np.zeros((2, 34), np.int8)),
         TypeError),
        ("qz out read-only", lambda: K.q8_0_quantize(np.ones((2, 32), f), out=_ro(np.zeros((2, 34), np.uint8))),
         ValueError),
        ("qz isa bogus", lambda: K.q8_0_quantize(np.ones((2, 32), f), isa="avx9000"), ValueError),
        # q8_0_dequantize
        ("dq w float32", lambda: K.q8_0_dequantize(np.ones((2, 34), f)), TypeError),
        ("dq w list", lambda: K.q8_0_dequantize([[0] * 34]), TypeError),
        ("dq w bytes % 34", lambda: K.q8_0_dequantize(np.ones((2, 35), np.uint8)), ValueError),
        ("dq w non-contiguous", lambda: K.q8_0_dequantize(np.ones((2, 68), np.uint8)[:, ::2]),
         ValueError),
        ("dq out shape", lambda: K.q8_0_dequantize(np.ones((2, 34), np.uint8), out=np.zeros((2, 33), f)),
         ValueError),
        ("dq out read-only", lambda: K.q8_0_dequantize(np.ones((2, 34), np.uint8), out=_ro(np.zeros((2, 32), f))),
         ValueError),
        ("dq out float64", lambda: K.q8_0_dequantize(np.ones((2, 34), np.uint8), out=np.zeros((2, 32))),
         TypeError),
        # adaln_linear
        ("ad t float64", lambda: K.adaln_linear(t.astype(np.float64), wf, "F32", None, o6), TypeError),
        ("ad t 2-D", lambda: K.adaln_linear(t[None], wf, "F32", None, o6), ValueError),
        ("ad w float64", lambda: K.adaln_linear(t, wf.astype(np.float64), "F32", None, o6), TypeError),
        ("ad w list", lambda: K.adaln_linear(t, wf.tolist(), "F32", None, o6), TypeError),
        ("ad w K mismatch", lambda: K.adaln_linear(t, np.ones((6, 32), f), "F32", None, o6), ValueError),
        ("ad w q8 K mismatch", lambda: K.adaln_linear(t, np.ones((6, 34), np.uint8), "Q8_0", None, o6),
         ValueError),
        ("ad w q8 bytes % 34", lambda: K.adaln_linear(t, np.ones((6, 67), np.uint8), "Q8_0", None, o6),
         ValueError),
        ("ad q8 K % 32", lambda: K.adaln_linear(np.ones(48, f), np.ones((6, 51), np.uint8), "Q8_0", None, o6),
         ValueError),
        ("ad bias shape", lambda: K.adaln_linear(t, wf, "F32", np.ones(5, f), o6), ValueError),
        ("ad bias float64", lambda: K.adaln_linear(t, wf, "F32", np.ones(6), o6), TypeError),
        ("ad out shape", lambda: K.adaln_linear(t, wf, "F32", None, np.zeros(5, f)), ValueError),
        ("ad out None", lambda: K.adaln_linear(t, wf, "F32", None, None), TypeError),
        ("ad out read-only", lambda: K.adaln_linear(t, wf, "F32", None, _ro(np.zeros(6, f))), ValueError),
        ("ad silu not bool", lambda: K.adaln_linear(t, wf, "F32", None, o6, silu_input="yes"), TypeError),
        ("ad out aliases t", lambda: K.adaln_linear(t[:64], np.ones((64, 64), f), "F32", None,
                                                    t[:64]), ValueError),
    ]
    return cases


def _ro(a):
    a.flags.writeable = False
    return a


@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_bad_input_raises_clear_error(case):
    assert_error_names(case, ("q8_0_matmul", "q8_0_quantize", "q8_0_dequantize", "adaln_linear"))


def test_matmul_rejects_out_aliasing_x():
    buf = np.zeros((4, 64), np.float32)
    w = np.zeros((64, 68), np.uint8)
    with pytest.raises(ValueError, match="overlap"):
        K.q8_0_matmul(buf, w, buf[:, :64].reshape(4, 64))


# ----------------------------------------------------------------------------- dispatch

def test_kernel_variants_report_the_family():
    v = nxhpc.kernel_variants()
    for fam in MATMUL_FAMILIES:
        assert v[fam] in ("generic", "avx2", "avx512")
    if os.environ.get("NXHPC_DISABLE_SIMD", "0") not in ("", "0"):
        assert all(v[f] == "generic" for f in MATMUL_FAMILIES), v
    else:
        assert v["q8_0_matmul"] == expected_variant({"avx2", "avx512"}, ISAS[-1])


def test_disable_simd_env_forces_generic():
    code = ("import nxhpc, json; v = nxhpc.kernel_variants(); "
            "print(json.dumps({f: v[f] for f in %r}))" % (MATMUL_FAMILIES,))
    env = dict(os.environ, NXHPC_DISABLE_SIMD="1")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    assert set(eval(res.stdout).values()) == {"generic"}
    env["NXHPC_DISABLE_SIMD"] = "0"                  # negative control: "0" means enabled
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    assert eval(res.stdout)["q8_0_matmul"] == expected_variant({"avx2", "avx512"}, ISAS[-1])
