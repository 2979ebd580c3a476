"""Quantizers for synthetic models: float32 rows -> raw GGML blocks of Q4_0..Q8_0 and Q2_K..Q6_K.

Owns: ``quantize(x, wtype)``. Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 are the ``gguf`` package's own
quantizers (byte-identical to ggml's reference by construction). The K-quants (Q2_K, Q3_K, Q4_K,
Q5_K, Q6_K) have no quantizer in ``gguf``; the encoders here are written in numpy after the
scheme of llama.cpp's ``quantize_row_q*_K_ref`` (not its code): per sub-block a scale (and for
Q2_K/Q4_K/Q5_K a min) chosen by a search over candidate scales with a least-squares refit of
each candidate's codes (llama.cpp's make_qx_quants / make_qkx2_quants in spirit, unit weights);
then the sub-block scales are themselves quantized against a float16 super-block scale (4, 6 or
8 bits) and the codes recomputed from the *decoded* scales. They produce valid blocks for every
finite input, but are not byte-identical to llama.cpp: the decoder (``nxhpc.kernels
.dequantize_blocks``, byte-identical to ``gguf.quants.dequantize``) is what must be exact.
Must not: import the compiled kernels (pure numpy), or accept non-finite input.

Reconstruction error, measured against ``gguf.quants.dequantize`` of these blocks (RMS error /
RMS(x), float64 accumulation; x ~ N(0, 1), 64 rows x 3840; reproduce with
``python -m nxhpc.formats.quants``):

    type   bits/w   rel. RMS error   reference on the same data (gguf's own quantizers)
    Q8_0   8.5      0.0054
    Q6_K   6.56     0.0173
    Q5_K   5.5      0.0358           Q5_1 (6.0 bits) 0.0379, Q5_0 (5.5 bits) 0.0428
    Q4_K   4.5      0.0714           Q4_1 (5.0 bits) 0.0783, Q4_0 (4.5 bits) 0.0861
    Q3_K   3.44     0.1436
    Q2_K   2.625    0.2697

The error follows the bit budget, and each K-quant beats the gguf legacy type of the same or
more bits (Q4_K < Q4_1 < Q4_0, Q5_K < Q5_1 < Q5_0), as llama.cpp's K-quants do; for scale, 3- and
4-bit Lloyd-Max quantizers of N(0, 1) (optimal non-uniform levels, no per-block scales) reach
0.186 and 0.0975. The gauge llama.cpp applies to its own quantizers (tests/test-quantize-fns.cpp:
x[i] = 0.1 + 2 cos(i), n = 4096, sqrt(sum (x - x')^2) / n must stay below 0.0075 for Q2_K,
0.0040 for Q3_K and 0.002 for the others) reads here Q2_K 0.00450, Q3_K 0.00239, Q4_K 0.00098,
Q5_K 0.00053, Q6_K 0.00025 (gguf's Q4_0: 0.00112). tests/test_quants.py checks both gauges.
Scale invariance holds while the float16 super-block scales stay normal: measured unchanged from
RMS(x) = 1e4 down to 1e-3; below that the scales (d ~ RMS/1400 for Q6_K, ~RMS/400 for Q5_K)
reach float16's subnormals and the error grows (Q6_K 0.054 at RMS 1e-4; every type decodes to ~0
by RMS 1e-7, never worse than all zeros), a limit of the format, whose scales ggml stores alike.
Positive offsets are not modelled (mins are clamped to <= 0, as make_qkx2_quants does).
"""
from __future__ import annotations

import numpy as np

from nxhpc.formats.ggml_blocks import BLOCK_DTYPES, QK_K, QUANT_BLOCKS, block_of

__all__ = ["K_QUANTS", "LEGACY", "QUANTIZABLE", "quantize"]

LEGACY = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
K_QUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
QUANTIZABLE = LEGACY + K_QUANTS
_CHUNK = 2048            # super-blocks encoded at once (bounds the search's temporaries)


def quantize(x, wtype) -> np.ndarray:
    """Raw GGML blocks of `x`: float [..., K] (K a multiple of the type's block) -> uint8 [..., K//elems*bytes].

    wtype: a name in QUANTIZABLE (case-insensitive) or its GGML type id / gguf enum.
    """
    b = block_of(wtype)
    if b.name not in QUANTIZABLE:
        raise ValueError(f"quantize: wtype must be one of {QUANTIZABLE}, got {wtype!r}")
    x = np.asarray(x)
    if x.dtype.kind != "f":
        raise TypeError(f"quantize: x must be a floating-point array, got dtype={x.dtype}")
    if x.ndim < 1 or x.shape[-1] % b.elems != 0:
        raise ValueError(f"quantize: {b.name} rows must be a multiple of {b.elems} values, "
                         f"got shape {x.shape}")
    x = np.ascontiguousarray(x, dtype=np.float32)
    if not np.isfinite(x).all():
        raise ValueError("quantize: x must be finite (got inf or NaN)")
    oshape = x.shape[:-1] + (x.shape[-1] // b.elems * b.nbytes,)
    if b.name in LEGACY:
        import gguf
        from gguf.quants import quantize as gguf_quantize
        return gguf_quantize(x, gguf.GGMLQuantizationType[b.name]).reshape(oshape)
    flat = x.reshape(-1, QK_K)
    out = np.empty((flat.shape[0], b.nbytes), np.uint8)
    enc = _ENCODERS[b.name]
    for i in range(0, flat.shape[0], _CHUNK):
        out[i:i + _CHUNK] = enc(flat[i:i + _CHUNK].astype(np.float64)).view(np.uint8).reshape(-1, b.nbytes)
    return out.reshape(oshape)


# ----------------------------------------------------------------------------- helpers

def _f16(v):
    """float16 bits of v (round to nearest even) and the float64 value the decoder will see."""
    with np.errstate(over="ignore"):
        h = np.asarray(v, np.float32).astype(np.float16)
    if not np.isfinite(h).all():
        raise ValueError("quantize: values too large for a float16 block scale")
    return h, h.astype(np.float64)


def _round(v):
    return np.floor(v + 0.5)


def _fit_asym(x, nmax):
    """Per row of x [..., L]: scale s >= 0 and offset m >= 0 with x ~ s*q - m, q in [0, nmax].

    Candidate inverse scales (nmax + r)/(max - min) for r in -1, -0.9, ..., +1 (and r = 0);
    each candidate's codes are refitted by least squares for (s, m) (m clamped to >= 0, the
    block format's mins are non-negative); the lowest squared error wins.
    """
    n = x.shape[-1]
    lo = np.minimum(x.min(-1, keepdims=True), 0.0)
    hi = x.max(-1, keepdims=True)
    rng = hi - lo
    best_err = np.full(x.shape[:-1], np.inf)
    best_s = np.zeros(x.shape[:-1])
    best_m = -lo[..., 0]                             # rng == 0: every value equals the offset
    live = rng[..., 0] > 0
    safe = np.where(rng > 0, rng, 1.0)
    for r in np.concatenate([[0.0], np.linspace(-1.0, 1.0, 21)]):
        q = np.clip(_round((nmax + r) / safe * (x - lo)), 0, nmax)
        sq, sq2, sx, sqx = q.sum(-1), (q * q).sum(-1), x.sum(-1), (q * x).sum(-1)
        det = n * sq2 - sq * sq
        ok = det > 0
        dsafe = np.where(ok, det, 1.0)
        s = np.where(ok, (n * sqx - sq * sx) / dsafe, 0.0)
        off = np.where(ok, (sq2 * sx - sq * sqx) / dsafe, sx / n)
        pos = off > 0                                # offset must be <= 0: refit s alone
        s = np.where(pos, np.where(sq2 > 0, sqx / np.where(sq2 > 0, sq2, 1.0), 0.0), s)
        off = np.where(pos, 0.0, off)
        s = np.maximum(s, 0.0)
        err = ((s[..., None] * q + off[..., None] - x) ** 2).sum(-1)
        better = live & (err < best_err)
        best_err = np.where(better, err, best_err)
        best_s = np.where(better, s, best_s)
        best_m = np.where(better, -off, best_m)
    return best_s, np.maximum(best_m, 0.0)


def _fit_sym(x, nmax):
    """Per row of x [..., L]: signed scale s with x ~ s*q, q in [-nmax, nmax-1].

    The element of largest magnitude maps near -nmax (the wide end, as ggml does); candidate
    inverse scales -(nmax + r)/amax for r in -0.9..0.9 step 0.1, each refitted by least
    squares s = sum(q x)/sum(q^2); the lowest squared error wins.
    """
    idx = np.abs(x).argmax(-1)[..., None]
    amax = np.take_along_axis(x, idx, -1)
    live = amax[..., 0] != 0
    safe = np.where(amax != 0, amax, 1.0)
    best_err = np.full(x.shape[:-1], np.inf)
    best_s = np.zeros(x.shape[:-1])
    for r in np.linspace(-0.9, 0.9, 19):
        q = np.clip(_round(-(nmax + r) / safe * x), -nmax, nmax - 1)
        sq2, sqx = (q * q).sum(-1), (q * x).sum(-1)
        s = np.where(sq2 > 0, sqx / np.where(sq2 > 0, sq2, 1.0), 0.0)
        err = ((s[..., None] * q - x) ** 2).sum(-1)
        better = live & (err < best_err)
        best_err = np.where(better, err, best_err)
        best_s = np.where(better, s, best_s)
    return best_s


def _scales_unsigned(s, bits):
    """Sub-block scales s [nb, nsub] >= 0 -> (float16 super scale, its value, codes 0..2^bits-1)."""
    top = (1 << bits) - 1
    h, d = _f16(s.max(-1) / top)
    dsafe = np.where(d > 0, d, 1.0)[:, None]
    codes = np.where(d[:, None] > 0, np.clip(_round(s / dsafe), 0, top), 0).astype(np.int64)
    return h, d, codes


def _scales_signed(s, lo, hi):
    """Signed sub-block scales [nb, nsub] -> (float16 super scale, value, codes in [lo, hi]).

    The scale of largest magnitude maps to `lo` (the wide end: -32 or -128, as ggml does)."""
    idx = np.abs(s).argmax(-1)[:, None]
    smax = np.take_along_axis(s, idx, -1)[:, 0]
    h, d = _f16(np.where(smax != 0, smax / lo, 0.0))
    dsafe = np.where(d != 0, d, 1.0)[:, None]
    codes = np.where(d[:, None] != 0, np.clip(_round(s / dsafe), lo, hi), 0).astype(np.int64)
    return h, d, codes


def _flat_mins(x, ls, dmin, lm, bits):
    """Where a sub-block's scale code is 0 (its scale underflowed the float16 super scale), all
    its values decode to -ml: pick the min code nearest to -mean(x) instead (>= 0)."""
    zero = ls == 0
    if not zero.any():
        return lm
    top = (1 << bits) - 1
    dsafe = np.where(dmin > 0, dmin, 1.0)[:, None]
    best = np.where(dmin[:, None] > 0, np.clip(_round(np.maximum(-x.mean(-1), 0.0) / dsafe), 0, top), 0)
    return np.where(zero, best, lm).astype(np.int64)


def _codes_asym(x, dl, ml, nmax):
    """Codes of x [..., L] for decoded sub-block scale dl and min ml [..., 1]: round((x+ml)/dl)."""
    safe = np.where(dl > 0, dl, 1.0)
    return np.where(dl > 0, np.clip(_round((x + ml) / safe), 0, nmax), 0).astype(np.uint8)


def _codes_sym(x, dl, nmax):
    safe = np.where(dl != 0, dl, 1.0)
    return np.where(dl != 0, np.clip(_round(x / safe), -nmax, nmax - 1), 0).astype(np.int64)


def _f32(v):
    return np.asarray(v, np.float32).astype(np.float64)


# ----------------------------------------------------------------------------- K-quant encoders
# Element orders below are those of nxhpc/csrc/nx_quants.h (ggml's layouts).

def _enc_q2_k(x):
    nb = x.shape[0]
    xs = x.reshape(nb, 16, 16)                       # 16 sub-blocks of 16
    s, m = _fit_asym(xs, 3)
    dh, d, ls = _scales_unsigned(s, 4)
    mh, dmin, lm = _scales_unsigned(m, 4)
    lm = _flat_mins(xs, ls, dmin, lm, 4)
    dl = _f32(d[:, None] * ls)[..., None]            # the decoder's float32 products
    ml = _f32(dmin[:, None] * lm)[..., None]
    q = _codes_asym(xs, dl, ml, 3).reshape(nb, 2, 4, 32)   # e = 128h + 32s + l
    blk = np.zeros(nb, BLOCK_DTYPES["Q2_K"])
    blk["scales"] = (ls | lm << 4).astype(np.uint8)
    blk["qs"] = (q << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]).sum(2, dtype=np.uint8).reshape(nb, 64)
    blk["d"], blk["dmin"] = dh, mh
    return blk


def _sym16(x, nmax, smin, smax):
    """Q3_K/Q6_K: 16 sub-blocks of 16 with signed scale codes in [smin, smax] -> (fp16 super
    scale, scale codes [nb, 16], value codes + nmax in [0, 2 nmax) [nb, 16, 16])."""
    nb = x.shape[0]
    xs = x.reshape(nb, 16, 16)
    s = _fit_sym(xs, nmax)
    dh, d, ls = _scales_signed(s, smin, smax)
    dl = _f32(d[:, None] * ls)[..., None]
    return dh, ls, _codes_sym(xs, dl, nmax) + nmax


def _enc_q3_k(x):
    nb = x.shape[0]
    dh, ls, code = _sym16(x, 4, -32, 31)
    code = code.reshape(nb, 2, 4, 32)                # 0..7, e = 128h + 32s + l
    lo, hi = (code & 3).astype(np.uint8), (code >> 2).astype(np.uint8)
    sc6 = (ls + 32).astype(np.uint8)                 # 16 6-bit codes
    scales = np.zeros((nb, 12), np.uint8)
    scales[:, :8] = (sc6[:, :8] & 15) | (sc6[:, 8:] & 15) << 4
    hi2 = (sc6 >> 4).reshape(nb, 4, 4)               # i = 4*k + j -> byte 8 + j, bits 2k
    scales[:, 8:] = (hi2 << (2 * np.arange(4, dtype=np.uint8))[None, :, None]).sum(1, dtype=np.uint8)
    blk = np.zeros(nb, BLOCK_DTYPES["Q3_K"])
    blk["qs"] = (lo << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]).sum(2, dtype=np.uint8).reshape(nb, 64)
    hb = hi.reshape(nb, 8, 32)                       # bit b = 4h + s of hmask[l]
    blk["hmask"] = (hb << np.arange(8, dtype=np.uint8)[None, :, None]).sum(1, dtype=np.uint8)
    blk["scales"] = scales
    blk["d"] = dh
    return blk


def _pack_k4_scales(sc, mn):
    """Q4_K/Q5_K 12-byte packing of 8 6-bit scales and mins (inverse of nx_quants.h's rule)."""
    nb = sc.shape[0]
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    out = np.zeros((nb, 12), np.uint8)
    out[:, 0:4] = (sc[:, :4] & 63) | (sc[:, 4:] >> 4) << 6
    out[:, 4:8] = (mn[:, :4] & 63) | (mn[:, 4:] >> 4) << 6
    out[:, 8:12] = (sc[:, 4:] & 15) | (mn[:, 4:] & 15) << 4
    return out


def _enc_q45_k(x, name, nmax):
    nb = x.shape[0]
    xs = x.reshape(nb, 8, 32)                        # 8 sub-blocks of 32
    s, m = _fit_asym(xs, nmax)
    dh, d, ls = _scales_unsigned(s, 6)
    mh, dmin, lm = _scales_unsigned(m, 6)
    lm = _flat_mins(xs, ls, dmin, lm, 6)
    dl = _f32(d[:, None] * ls)[..., None]
    ml = _f32(dmin[:, None] * lm)[..., None]
    q = _codes_asym(xs, dl, ml, nmax)                # [nb, 8, 32], sub-block j = 2c + s
    blk = np.zeros(nb, BLOCK_DTYPES[name])
    blk["d"], blk["dmin"] = dh, mh
    blk["scales"] = _pack_k4_scales(ls, lm)
    q4 = (q & 15).reshape(nb, 4, 2, 32)
    blk["qs"] = (q4[:, :, 0] | q4[:, :, 1] << 4).reshape(nb, 128)
    if name == "Q5_K":
        hb = (q >> 4).astype(np.uint8)               # bit j of qh[l]
        blk["qh"] = (hb << np.arange(8, dtype=np.uint8)[None, :, None]).sum(1, dtype=np.uint8)
    return blk


def _enc_q6_k(x):
    nb = x.shape[0]
    dh, ls, code = _sym16(x, 32, -128, 127)
    code = code.astype(np.uint8).reshape(nb, 2, 128)   # e = 128h + r
    lo, hi = code & 15, code >> 4
    blk = np.zeros(nb, BLOCK_DTYPES["Q6_K"])
    lo = lo.reshape(nb, 2, 2, 64)                    # r = 64k + i -> ql[64h + i] nibble k
    blk["ql"] = (lo[:, :, 0] | lo[:, :, 1] << 4).reshape(nb, 128)
    hi = hi.reshape(nb, 2, 4, 32)                    # r = 32k + i -> qh[32h + i] bits 2k
    blk["qh"] = (hi << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]).sum(2, dtype=np.uint8).reshape(nb, 64)
    blk["scales"] = ls.astype(np.int8)
    blk["d"] = dh
    return blk


_ENCODERS = {
    "Q2_K": _enc_q2_k,
    "Q3_K": _enc_q3_k,
    "Q4_K": lambda x: _enc_q45_k(x, "Q4_K", 15),
    "Q5_K": lambda x: _enc_q45_k(x, "Q5_K", 31),
    "Q6_K": _enc_q6_k,
}
assert set(_ENCODERS) | set(LEGACY) == set(QUANTIZABLE) and set(QUANTIZABLE) <= set(QUANT_BLOCKS)


def _error_table(rows=64, cols=3840, seed=0):  # pragma: no cover - documentation helper
    """Print the docstring's table: relative RMS error vs gguf.quants.dequantize per type."""
    import gguf
    from gguf.quants import dequantize
    x = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    ref = np.sqrt(np.mean(x.astype(np.float64) ** 2))
    t = (0.1 + 2 * np.cos(np.arange(4096, dtype=np.float32))).astype(np.float32)
    for name in ("Q8_0", "Q6_K", "Q5_1", "Q5_0", "Q5_K", "Q4_K", "Q4_1", "Q4_0", "Q3_K", "Q2_K"):
        qt = gguf.GGMLQuantizationType[name]
        y = dequantize(quantize(x, name), qt).astype(np.float64)
        yt = dequantize(quantize(t, name), qt).astype(np.float64)
        rel = np.sqrt(np.mean((y - x) ** 2)) / ref
        llama = np.sqrt(np.sum((yt - t) ** 2)) / t.size
        print(f"{name}  rel_rms {rel:.4f}   llama.cpp test-quantize-fns metric {llama:.5f}")


if __name__ == "__main__":  # pragma: no cover
    _error_table()
