"""Tests of the nine block types Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K through the
weight-type seam: K.dequantize, K.matmul, K.adaln_linear (the rows of the traits table).

Owns: dequantize byte-identity with gguf at every ISA through the table's entry point, and the
matmul / adaln_linear contract per type (csrc/nx_matmul.h, docs/kernels.md "Weight types"):
within the float64 bound of the documented summation order (kernelutil.matmul_bound), and bit
for bit the same across ISAs, the two panel packers, column bands, token batchings, and against
the same matmul over the float32 dequantization stored as F32. Must not: produce expected values
with nxhpc -- references are gguf.quants.dequantize of the very bytes multiplied, and float64
numpy products.

Data: random blocks with finite float16 scales (every code and scale byte random; test_quants'
builders) and blocks from nxhpc.formats.quants' encoders on Gaussian data (realistic weights;
only the bytes matter, the reference decodes them with gguf).
"""
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kernelutil import EPS32, ISAS, SIMD_ISAS, assert_bitwise, matmul_bound
from test_quants import TYPES, edge_blocks, finite_blocks, random_blocks, ref_gguf

from nxhpc import _kernels as K
from nxhpc.formats.ggml_blocks import QUANT_BLOCKS
from nxhpc.formats.quants import quantize

ELEMS = {n: QUANT_BLOCKS[n].elems for n in TYPES}


def weight(rng, name, n, k, kind="encoded"):
    """(raw uint8 [n, k/elems*nbytes], its gguf float32 values [n, k])."""
    if kind == "encoded":
        w32 = (rng.standard_normal((n, k)) * 10.0 ** rng.uniform(-2, 1)).astype(np.float32)
        raw = quantize(w32, name)
    else:
        raw = finite_blocks(rng, name, n * (k // ELEMS[name])).reshape(n, -1)
    return np.ascontiguousarray(raw), ref_gguf(raw, name).reshape(n, k)


def _mm(x, raw, wtype, isa, n0=0, n1=None, bias=None, fn=None):
    out = np.full((x.shape[0], raw.shape[0]), np.nan, np.float32)
    (fn or K.matmul)(x, raw, wtype, out, n0, n1, bias=bias, isa=isa)
    return out


def assert_close(out, x, w32, what, bias=None):
    """|out - x @ w.T| <= matmul_bound(K) * |x| @ |w|.T (+ one rounding of the bias add)."""
    x64, w64 = x.astype(np.float64), w32.astype(np.float64)
    ref, mag = x64 @ w64.T, np.abs(x64) @ np.abs(w64).T
    bound = matmul_bound(x.shape[1], mag)
    if bias is not None:
        ref = ref + bias.astype(np.float64)
        bound = bound + EPS32 * (np.abs(ref) + bound)
    err = np.abs(out.astype(np.float64) - ref)
    bad = ~(err <= bound)
    assert not bad.any(), f"{what}: {bad.sum()} beyond the bound, worst {np.max(err / bound):.3g}"


# ----------------------------------------------------------------------------- dequantize

def test_every_type_is_a_table_row():
    wt = K.weight_types()
    for n in TYPES:
        b = QUANT_BLOCKS[n]
        assert wt[n] == {"ggml_type": b.ggml_type, "block_elems": b.elems,
                         "block_bytes": b.nbytes}, n
    assert K.quant_block_sizes() == {n: (wt[n]["ggml_type"], wt[n]["block_elems"],
                                         wt[n]["block_bytes"]) for n in TYPES}


def test_runnable_types_are_the_table():
    """The Python side's list of types a block may hold is exactly the C traits table's."""
    from nxhpc.formats.weights import RUNNABLE_TYPES
    assert set(RUNNABLE_TYPES) == set(K.weight_types())
    assert set(TYPES) <= set(RUNNABLE_TYPES)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", TYPES)
def test_dequantize_byte_identical_to_gguf(name, isa):
    """Random bytes (NaN/inf/subnormal scales included) and the edge battery (zero, max,
    negative, subnormal, inf, NaN scales; all-min/all-max codes and scales), via K.dequantize."""
    rng = np.random.default_rng(len(name) * 31 + ISAS.index(isa))
    for raw in (random_blocks(rng, name, (3, 17)), random_blocks(rng, name, (2,)),
                edge_blocks(name)):
        want = ref_gguf(raw, name)
        assert_bitwise(K.dequantize(raw, name, isa=isa), want, f"{name} {isa} {raw.shape}")
        assert_bitwise(K.dequantize_blocks(raw, name, isa=isa), want, f"{name} {isa} blocks")


# ----------------------------------------------------------------------------- matmul

@settings(max_examples=30)
@given(name=st.sampled_from(TYPES), T=st.sampled_from([1, 3, 13, 33]),
       N=st.sampled_from([1, 7, 16, 17, 33, 65]), kb=st.integers(1, 5),
       kind=st.sampled_from(["encoded", "random"]), seed=st.integers(0, 2**32 - 1))
def test_matmul_vs_float64_bit_identical_everywhere(name, T, N, kb, kind, seed):
    """K = kb blocks of the type (32 .. 1280 values; K > 128 crosses chunks, > 1024 a k-block).
    Within the bound; every isa and the generic packer give the spec's bits; the float32
    dequantization stored as F32 gives the same bits (the decoded values are the operands)."""
    rng = np.random.default_rng(seed)
    Kd = kb * ELEMS[name] * (1 if ELEMS[name] == 256 else 8)
    x = (rng.standard_normal((T, Kd))).astype(np.float32)
    raw, w32 = weight(rng, name, N, Kd, kind)
    gen = _mm(x, raw, name, "generic")
    assert_close(gen, x, w32, f"{name} generic")
    deq = K.dequantize(raw, name)
    for isa in ISAS:
        assert_bitwise(_mm(x, raw, name, isa), gen, f"{name} isa={isa}")
        assert_bitwise(_mm(x, raw, name, isa, fn=K._matmul_dequant_pack), gen, f"{name} {isa} deq")
        assert_bitwise(_mm(x, deq, "F32", isa), gen, f"{name} vs F32 dequant isa={isa}")


@pytest.mark.parametrize("name", TYPES)
def test_matmul_crosses_every_blocking_level(name):
    """T > MC (264), K > KC (1024) with a partial last k-block, N > NC (128) with a partial
    panel: the SIMD drivers give the spec's bits."""
    rng = np.random.default_rng(2)
    T, N, Kd = 270, 150, 1280
    x = rng.standard_normal((T, Kd)).astype(np.float32)
    raw, w32 = weight(rng, name, N, Kd)
    gen = _mm(x, raw, name, "generic")
    assert_close(gen, x, w32, name)
    for isa in SIMD_ISAS:
        assert_bitwise(_mm(x, raw, name, isa), gen, f"isa={isa}")


@pytest.mark.parametrize("name", TYPES)
def test_matmul_band_and_batch_invariance_with_bias(name):
    rng = np.random.default_rng(3)
    T, Kd, N = 21, 512, 75
    x = rng.standard_normal((T, Kd)).astype(np.float32)
    raw, w32 = weight(rng, name, N, Kd)
    bias = rng.standard_normal(N).astype(np.float32)
    for isa in ISAS:
        full = _mm(x, raw, name, isa, bias=bias)
        assert_close(full, x, w32, f"{name} bias", bias=bias)
        assert_bitwise(full, _mm(x, raw, name, isa) + bias, "bias add")
        out = np.full((T, N), np.nan, np.float32)
        for a, b in itertools.pairwise([0, 1, 17, 40, 41, N]):
            K.matmul(x, raw, name, out, a, b, bias=bias, isa=isa)
        assert_bitwise(out, full, f"{name} {isa} bands")
        for a, b in ((0, 1), (1, 13), (13, T)):
            assert_bitwise(_mm(np.ascontiguousarray(x[a:b]), raw, name, isa, bias=bias),
                           full[a:b], f"{name} {isa} tokens {a}:{b}")


def test_matmul_reads_read_only_unaligned_maps(tmp_path):
    rng = np.random.default_rng(6)
    x = rng.standard_normal((5, 512)).astype(np.float32)
    for name in TYPES:
        raw, _ = weight(rng, name, 19, 512)
        path = tmp_path / f"{name}.bin"
        path.write_bytes(b"\x07" + raw.tobytes())
        wm = np.memmap(path, dtype=np.uint8, mode="r", offset=1, shape=raw.shape)
        ref = _mm(x, raw, name, "generic")
        for isa in ISAS:
            assert_bitwise(_mm(x, wm, name, isa), ref, f"{name} map isa={isa}")
        del wm
        assert path.read_bytes()[1:] == raw.tobytes()


def test_bound_is_not_vacuous():
    """Negative controls: one Q4_K 4-bit code off by one, and a decoder that dropped the
    "- dmin * min" term (the mins zeroed), both fail the float64 check."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((5, 512)).astype(np.float32)
    raw, w32 = weight(rng, "Q4_K", 9, 512)
    assert_close(_mm(x, raw, "Q4_K", "generic"), x, w32, "ok")
    bad = raw.copy()
    bad[4, 16 + 40] ^= np.uint8(0x01)             # qs byte of block 0 of row 4
    with pytest.raises(AssertionError):
        assert_close(_mm(x, bad, "Q4_K", "generic"), x, w32, "one code off")
    nomin = raw.copy()
    blk = nomin.reshape(-1).view(QUANT_BLOCKS["Q4_K"].dtype)
    blk["dmin"] = 0
    with pytest.raises(AssertionError):
        assert_close(_mm(x, nomin, "Q4_K", "generic"), x, w32, "mins dropped")


# ----------------------------------------------------------------------------- adaln_linear

@pytest.mark.parametrize("name", TYPES)
def test_adaln_linear_every_type(name):
    rng = np.random.default_rng(8)
    Kd, N = 512, 99
    t = (rng.standard_normal(Kd) * 3).astype(np.float32)
    raw, w32 = weight(rng, name, N, Kd)
    b = rng.standard_normal(N).astype(np.float32)
    u = t.astype(np.float64)
    u = u / (1.0 + np.exp(-u))
    w64 = w32.astype(np.float64)
    ref = w64 @ u + b
    mag = np.abs(w64) @ np.abs(u)
    # silu in float32 (expf: a few ulp) perturbs u by <= 4u|u|; the matmul bound; the bias add
    tol = (4 * EPS32 + matmul_bound(Kd, 1.0)) * mag + EPS32 * (np.abs(ref) + mag) + 1e-30
    gen = np.full(N, np.nan, np.float32)
    K.adaln_linear(t, raw, name, b, gen, silu_input=True, isa="generic")
    assert (np.abs(gen - ref) <= tol).all(), name
    deq = K.dequantize(raw, name)
    for isa in ISAS:
        o = np.full(N, np.nan, np.float32)
        K.adaln_linear(t, raw, name, b, o, silu_input=True, isa=isa)
        assert_bitwise(o, gen, f"{name} {isa}")
        K.adaln_linear(t, deq, "F32", b, o, silu_input=True, isa=isa)
        assert_bitwise(o, gen, f"{name} {isa} vs F32 dequant")


# ----------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("name", TYPES)
def test_k_not_a_multiple_of_the_block_is_refused(name):
    E, B = ELEMS[name], QUANT_BLOCKS[name].nbytes
    Kd = E + 16                                   # not whole blocks
    x = np.zeros((2, Kd), np.float32)
    w = np.zeros((3, B * 2), np.uint8)
    out = np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError, match=rf"matmul: x has K={Kd}, which is not a multiple of "
                                         rf"{E} \(the {name} block size"):
        K.matmul(x, w, name, out)
    with pytest.raises(ValueError, match=rf"adaln_linear: t_emb has K={Kd}, which is not a "
                                         rf"multiple of {E}"):
        K.adaln_linear(np.zeros(Kd, np.float32), w, name, None, np.zeros(3, np.float32))
    with pytest.raises(ValueError, match=rf"rows must be a multiple of {B} bytes \({name}"):
        K.dequantize(np.zeros((2, B + 1), np.uint8), name)
    # whole blocks but a weight of the wrong row length: named with the expected shape
    with pytest.raises(ValueError, match=rf"expected w of shape \(3, {B}\) uint8"):
        K.matmul(np.zeros((2, E), np.float32), w, name, out)
    assert not out.any()
