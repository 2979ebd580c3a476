"""Column bands of every width: a matmul band call writes exactly the columns [n0, n1) of ``out``
(docs/kernels.md: "only columns [n0, n1) are written"), with the bits of the whole call there.

Workers share one output array and each writes its own band, so a kernel that stores one column
too many overwrites a neighbour's result (or, at the end of a row, the next row's first column;
at the last row, memory past the array). The register tiles are 16 or 32 columns wide, and the
column tails are masked stores: so every band width from 1 to 48 (each residue mod 32 and mod
16), at an aligned and an unaligned start, on every ISA, for each matmul family (f32, bf16, q8;
the gated form too) and a weight of each decoder class. The other band tests use a few widths;
a tail of exactly 15 columns written as 16 passed all of them (mutation checks, 2026-12-06).
Every output is checked against the whole call of the same kernel, whose own arithmetic the
family's test files check against float64 and gguf's decoders.
"""
import sys
import zlib

import numpy as np
import pytest

from kernelutil import ISAS, assert_bitwise, finite_scale_blocks, gguf_bytes
from nxhpc import _kernels as K

T, KD, N = 5, 256, 96
SENTINEL = np.float32(-7.25)
WIDTHS = range(1, 49)
STARTS = (0, 5)
# (family, weight type): F32 and F16 rows go through the float panels, Q4_K through the
# 256-blocks with mins, Q6_K through the two-part (H = 2) q8 shape, Q8_0 the q8 base shape
CASES = [("f32", "F32"), ("f32", "Q4_K"), ("bf16", "F16"), ("bf16", "Q4_K"), ("bf16", "Q6_K"),
         ("q8", "Q8_0"), ("q8", "Q4_K"), ("q8", "Q6_K")]


def _weight(rng, wtype, n):
    if wtype.endswith("_K"):
        return finite_scale_blocks(rng, wtype, n, KD)
    w = (rng.standard_normal((n, KD)) * 0.1).astype(np.float32)
    return w if wtype == "F32" else gguf_bytes(w, wtype)


def _call(fam, x, w, wtype, out, n0, n1, isa, up=None):
    if fam == "q8":
        return K.matmul_q8(x, w, out, n0, n1, wtype=wtype, isa=isa, up=up)
    fn = K.matmul if fam == "f32" else K.matmul_bf16     # both take F32 rows as float32 arrays
    return fn(x, w, wtype, out, n0, n1, isa=isa, up=up)


def _check_bands(fam, wtype, isa, gated):
    rng = np.random.default_rng(zlib.crc32(f"{fam} {wtype} {gated}".encode()))
    x = rng.standard_normal((T, KD)).astype(np.float32)
    w = _weight(rng, wtype, N)
    up = _weight(rng, wtype, N) if gated else None
    full = np.empty((T, N), np.float32)
    _call(fam, x, w, wtype, full, 0, N, isa, up)
    assert np.isfinite(full).all()
    for n0 in STARTS:
        for width in WIDTHS:
            n1 = n0 + width
            out = np.full((T, N), SENTINEL, np.float32)
            _call(fam, x, w, wtype, out, n0, n1, isa, up)
            what = f"{fam} {wtype} gated={gated} isa={isa} band [{n0}, {n1})"
            outside = np.concatenate([out[:, :n0], out[:, n1:]], axis=1)
            assert (outside == SENTINEL).all(), f"{what}: a column outside the band was written"
            assert_bitwise(out[:, n0:n1], full[:, n0:n1], what)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fam,wtype", CASES)
def test_a_band_writes_exactly_its_columns(fam, wtype, isa):
    _check_bands(fam, wtype, isa, gated=False)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fam,wtype", [("f32", "F32"), ("bf16", "Q4_K"), ("q8", "Q8_0")])
def test_a_gated_band_writes_exactly_its_columns(fam, wtype, isa):
    _check_bands(fam, wtype, isa, gated=True)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fam,wtype", CASES)
@pytest.mark.parametrize("n", [15, 47])
def test_a_whole_row_ending_in_a_short_tile_stays_in_its_array(fam, wtype, isa, n):
    """N = 15 / 47 whole (tails of 15 columns): ``out`` is the first T rows of a buffer with one
    more row, which must keep its sentinel (a 16th column stored at the end of the last row
    lands there; at the end of another row it lands on the next row's first column, which the
    whole-call bits against the band-by-band ones would show)."""
    rng = np.random.default_rng(n)
    x = rng.standard_normal((T, KD)).astype(np.float32)
    w = _weight(rng, wtype, n)
    buf = np.full((T + 1, n), SENTINEL, np.float32)
    out = buf[:T]
    _call(fam, x, w, wtype, out, 0, n, isa)
    assert (buf[T] == SENTINEL).all(), f"{fam} {wtype} isa={isa} N={n}: wrote past the array"
    cols = np.full((T, n), SENTINEL, np.float32)
    for c in range(n):                               # one column at a time: no tile tails
        _call(fam, x, w, wtype, cols, c, c + 1, isa)
    assert_bitwise(out, cols, f"{fam} {wtype} isa={isa} N={n}")


def test_the_band_check_fails_a_kernel_that_stores_one_column_too_many(monkeypatch):
    """Negative control: the check above, on a kernel whose 15-column tails store a 16th column
    (the fault it is for, made here in Python around the real kernel), fails."""
    real = _call

    def one_too_many(fam, x, w, wtype, out, n0, n1, isa, up=None):
        real(fam, x, w, wtype, out, n0, n1, isa, up)
        if (n1 - n0) % 16 == 15 and n1 < out.shape[1]:
            out[:, n1] = 0.0
    monkeypatch.setattr(sys.modules[__name__], "_call", one_too_many, raising=True)
    with pytest.raises(AssertionError, match="outside the band"):
        _check_bands("f32", "F32", ISAS[-1], gated=False)
