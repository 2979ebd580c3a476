"""The gated matmuls (``matmul`` / ``matmul_bf16`` / ``matmul_q8`` with ``up=``): a SwiGLU
feed-forward's first projection, ``silu(x @ W_gate^T) * (x @ W_up^T)`` in one call.

What is promised (csrc/nx_matmul.h, nx_mm_call's w_up): the bits of the plain call for each
weight and then ``swiglu`` at the same isa -- so this file checks the gated call against that
composition bit for bit on every ISA, weight type, band and a k-range crossing the drivers'
k-blocks, against a float64 evaluation from gguf's decoder (an independent reference), and
the argument checks; plus ``nxhpc.nn.linear.matmul_glu``'s path for two weights that run
different kernels. The plain kernels themselves are tested in test_kernels_lowp.py,
test_kernels_q8*.py and test_kernels_wtype.py, swiglu in test_kernels_ops.py.
"""
import numpy as np
import pytest

from kernelutil import ISAS, finite_scale_blocks, gguf_bytes, gguf_values
from nxhpc import _kernels as K
from nxhpc.formats.weights import WeightTensor
from nxhpc.nn import linear

# (T, K, N, n0, n1): one token; K over several k-blocks of every driver (AMX bf16 KC 512, f32
# 512 / 1024) and N over their column blocks (128 .. 512) and the split path's chunk (512),
# with a band inside it; T over the f32 drivers' token block (264)
SHAPES = [(1, 256, 37, 0, 37), (33, 1280, 700, 5, 690), (300, 512, 96, 40, 96)]
TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
PRECISIONS = {"f32": K.matmul, "bf16": K.matmul_bf16, "q8": K.matmul_q8}


def weight(rng, wtype, N, Kd):
    """Raw bytes of a random [N, Kd] weight of `wtype` (K-quants: random codes and sub-scales,
    f16 scales over 2^-14 .. 2^2; the rest written by gguf from normal values)."""
    if wtype.endswith("_K"):
        return finite_scale_blocks(rng, wtype, N, Kd)
    return gguf_bytes(rng.standard_normal((N, Kd)).astype(np.float32) * 0.1, wtype)


def call(prec, x, w, wtype, out, n0, n1, isa, up=None):
    if prec == "q8":
        return K.matmul_q8(x, w, out, n0, n1, wtype=wtype, isa=isa, up=up)
    return PRECISIONS[prec](x, w, wtype, out, n0, n1, isa=isa, up=up)


def cases():
    for prec in PRECISIONS:
        for wtype in TYPES:
            if prec == "q8" and wtype in ("F32", "F16", "BF16"):
                continue
            yield prec, wtype


def silu64(g):
    with np.errstate(over="ignore"):                     # exp(-g) = inf: silu = -0
        return g / (1.0 + np.exp(-g))


@pytest.mark.parametrize("prec,wtype", list(cases()))
def test_gated_matmul_is_the_two_matmuls_then_swiglu(prec, wtype):
    """Bit for bit the plain call for the gate and for the up weight, then swiglu at the same
    isa, on every ISA; columns outside the band untouched. Against float64 (gguf's decoder):
    within the precision's input error carried through silu(g) * u. Negative control: the two
    weights swapped give other bits and miss the float64 reference."""
    rng = np.random.default_rng(sum(map(ord, prec + wtype)))
    for T, Kd, N, n0, n1 in SHAPES:
        wg, wu = weight(rng, wtype, N, Kd), weight(rng, wtype, N, Kd)
        x = rng.standard_normal((T, Kd))
        # scaled so that the gate's outputs are O(1): silu is then far from x and from 0
        x = (x / np.median(np.abs(x @ gguf_values(wg, wtype).astype(np.float64).T))).astype(
            np.float32)
        for isa in ISAS:
            g = np.full((T, N), np.nan, np.float32)
            u = np.full((T, N), np.nan, np.float32)
            call(prec, x, wg, wtype, g, n0, n1, isa)
            call(prec, x, wu, wtype, u, n0, n1, isa)
            want = g.copy()
            K.swiglu(g[:, n0:n1].copy(), u[:, n0:n1].copy(), s := np.empty((T, n1 - n0),
                                                                            np.float32), isa=isa)
            want[:, n0:n1] = s
            got = np.full((T, N), np.nan, np.float32)
            assert call(prec, x, wg, wtype, got, n0, n1, isa, up=wu) is got
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (isa, T, Kd, N)
            swapped = np.full((T, N), np.nan, np.float32)
            call(prec, x, wu, wtype, swapped, n0, n1, isa, up=wg)
            assert not np.array_equal(swapped[:, n0:n1], got[:, n0:n1])
        # float64 reference from gguf's decoded values
        g64 = x.astype(np.float64) @ gguf_values(wg, wtype).astype(np.float64)[n0:n1].T
        u64 = x.astype(np.float64) @ gguf_values(wu, wtype).astype(np.float64)[n0:n1].T
        ax = np.abs(x.astype(np.float64))
        mg = ax @ np.abs(gguf_values(wg, wtype).astype(np.float64)[n0:n1]).T
        mu = ax @ np.abs(gguf_values(wu, wtype).astype(np.float64)[n0:n1]).T
        # input rounding: bf16 2u (x and w) plus the chain; q8: x to 8 bits per 32-block (its
        # step <= max|x| / 127, half of it per element); f32: the chain
        rel = {"f32": 2.0 ** -17, "bf16": 2.0 ** -6, "q8": 1.0 / 127}[prec]
        eg, eu = rel * mg, rel * mu
        ref = silu64(g64) * u64
        bound = 1.1 * eg * np.abs(u64) + np.abs(silu64(g64)) * eu + 1.1 * eg * eu + 1e-30
        err = np.abs(got[:, n0:n1].astype(np.float64) - ref)
        assert (err <= bound).all(), (err / bound).max()
        miss = np.abs(swapped[:, n0:n1].astype(np.float64) - ref) > bound
        assert miss.mean() > 0.05        # bf16's worst-case bound is the loosest: 8-17% miss


def test_gated_matmul_argument_errors():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 64)).astype(np.float32)
    w = gguf_bytes(rng.standard_normal((8, 64)).astype(np.float32), "Q8_0")
    out = np.zeros((4, 8), np.float32)
    for fn, args in ((K.matmul, (x, w, "Q8_0", out)), (K.matmul_bf16, (x, w, "Q8_0", out))):
        with pytest.raises(ValueError, match="no bias"):
            fn(*args, bias=np.zeros(8, np.float32), up=w)
        with pytest.raises(ValueError, match="up must have w's dtype and shape"):
            fn(*args, up=w[:4])
        with pytest.raises(ValueError, match="up must have w's dtype and shape"):
            fn(*args, up=w.view(np.int8))
        with pytest.raises(TypeError, match="up must be a numpy.ndarray"):
            fn(*args, up=w.tolist())
        with pytest.raises(ValueError, match="up must be C-contiguous"):
            fn(*args, up=np.asfortranarray(w))
    with pytest.raises(ValueError, match="no bias"):
        K.matmul_q8(x, w, out, bias=np.zeros(8, np.float32), up=w)
    # out overlapping up: both views of one byte buffer
    raw = np.zeros(8 * 68, np.uint8)
    up, o = raw.reshape(8, 68), raw[:128].view(np.float32).reshape(4, 8)
    for fn in (K.matmul, K.matmul_bf16):
        with pytest.raises(ValueError, match="must not overlap up"):
            fn(x, w, "Q8_0", o, up=up)
    with pytest.raises(ValueError, match="must not overlap up"):
        K.matmul_q8(x, w, o, up=up)


def test_matmul_glu_of_two_kernels_is_the_composition():
    """nxhpc.nn.linear.matmul_glu where the two weights run different kernels (a Q8_0 gate, a
    Q4_0 up; under q8 an F16 gate on bf16 beside a Q8_0 up): the chunked path gives the bits
    of the two plain projections and swiglu, on a band crossing its chunks; the one-kernel
    path (both Q8_0) the same bits as the gated kernel call."""
    rng = np.random.default_rng(11)
    T, Kd, N, lo, hi = 9, 256, 1100, 3, 1090
    x = rng.standard_normal((T, Kd)).astype(np.float32)
    vals = [rng.standard_normal((N, Kd)).astype(np.float32) * 0.1 for _ in range(2)]
    wt = {t: [WeightTensor(f"w{i}", t, (N, Kd), gguf_bytes(v, t)) for i, v in enumerate(vals)]
          for t in ("Q8_0", "Q4_0", "F16")}
    for prec, gate, up in (("bf16", wt["Q8_0"][0], wt["Q4_0"][1]),
                           ("q8", wt["F16"][0], wt["Q8_0"][1]),
                           ("f32", wt["Q8_0"][0], wt["Q8_0"][1]),
                           ("q8", wt["Q8_0"][0], wt["Q8_0"][1])):
        g = np.zeros((T, N), np.float32)
        u = np.zeros((T, N), np.float32)
        linear.matmul(K, x, gate, g, lo, hi, prec)
        linear.matmul(K, x, up, u, lo, hi, prec)
        K.swiglu(g, u, g)
        got = np.zeros((T, N), np.float32)
        linear.matmul_glu(K, x, gate, up, got, lo, hi, prec)
        want = np.zeros((T, N), np.float32)
        want[:, lo:hi] = g[:, lo:hi]
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (prec, gate, up)
        # and against float64 from gguf's decoder, each weight at the precision it runs under
        # (the rounding model of the test above); outside the band untouched
        assert not got[:, :lo].any() and not got[:, hi:].any()
        rel = {"f32": 2.0 ** -17, "bf16": 2.0 ** -6, "q8": 1.0 / 127}
        x64, ax = x.astype(np.float64), np.abs(x.astype(np.float64))
        gv, uv = (gguf_values(w.data, w.type_name).astype(np.float64)[lo:hi] for w in (gate, up))
        g64, u64 = x64 @ gv.T, x64 @ uv.T
        eg = rel[linear.effective_precision(gate, prec)] * (ax @ np.abs(gv).T)
        eu = rel[linear.effective_precision(up, prec)] * (ax @ np.abs(uv).T)
        ref = silu64(g64) * u64
        bound = 1.1 * eg * np.abs(u64) + np.abs(silu64(g64)) * eu + 1.1 * eg * eu + 1e-30
        assert (np.abs(got[:, lo:hi] - ref) <= bound).all(), (prec, gate, up)
        swapped = silu64(u64) * g64                  # negative control: the roles swapped
        assert (np.abs(swapped - ref) > bound).mean() > 0.05, (prec, gate, up)
