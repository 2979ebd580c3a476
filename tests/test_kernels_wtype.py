"""Tests of the weight-type seam: the traits table, dequantize, and matmul / adaln_linear over
every weight type the kernels run (F32, F16, BF16, Q8_0 and the nine block types Q4_0 .. Q6_K;
``kernelutil.WEIGHT_TYPES``, which a guard holds equal to the C traits table).

Independent references only: weights are written by the `gguf` package where it has an encoder
(quants.quantize for BF16, Q8_0, Q4_0 .. Q5_1; numpy's astype for F16) and otherwise (the
K-quants) by nxhpc.formats.quants' encoders or as random blocks with finite scales -- only the
bytes matter: every reference decodes them with gguf.quants.dequantize. Products are checked
against float64 numpy `x @ W.T` with the bound of the documented summation order
(kernelutil.matmul_bound, derived there). Bit-identity is checked where the contract promises
it: dequantize against gguf, and the matmul across ISAs, column bands, token batchings, the two
panel packers, and -- since every type dequantizes exactly -- against the same matmul over the
float32 dequantization stored as F32.
"""
import itertools
import os
import subprocess
import sys
import textwrap

import gguf
import numpy as np
import pytest
from kernelutil import (
    EPS32,
    GGML,
    ISAS,
    SIMD_ISAS,
    WEIGHT_TYPES,
    assert_bitwise,
    gguf_bytes,
    gguf_values,
    matmul_bound,
    random_weight,
)
from test_quants import edge_blocks, finite_blocks

from nxhpc import _kernels as K
from nxhpc.formats import ggml_blocks
from nxhpc.formats.ggml_blocks import QUANT_BLOCKS
from nxhpc.formats.quants import quantize
from nxhpc.formats.weights import RUNNABLE_TYPES

#: The nine block types (a row of ggml_blocks.QUANT_BLOCKS each; Q8_0 is a table row too).
BLOCK_TYPES = tuple(t for t in WEIGHT_TYPES if t in QUANT_BLOCKS and t != "Q8_0")
#: Types the gguf package cannot write (its quantize lacks the K-quant encoders).
NO_GGUF_ENCODER = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


def _elems(wtype):
    return gguf.GGML_QUANT_SIZES[GGML[wtype]][0]


def typed_weight(rng, n, k, wtype, scale=1.0, kind="encoded"):
    """(raw uint8 [n, row bytes], float64 [n, k] values per gguf.quants.dequantize) of a random
    weight stored as ``wtype``. ``kind="encoded"``: Gaussian values times ``scale``, written by
    the gguf package (kernelutil.random_weight) or, for the K-quants, nxhpc.formats.quants;
    ``"random"`` (block types): random blocks with finite float16 scales (every code random)."""
    if kind == "random":
        raw = finite_blocks(rng, wtype, n * (k // _elems(wtype))).reshape(n, -1)
    elif wtype in NO_GGUF_ENCODER:
        raw = quantize((rng.standard_normal((n, k)) * scale).astype(np.float32), wtype)
    else:
        return random_weight(rng, n, k, wtype, scale)
    raw = np.ascontiguousarray(raw)
    return raw, gguf_values(raw, wtype).astype(np.float64)


def _mm(x, raw, wtype, isa, n0=0, n1=None, bias=None, fn=None):
    out = np.full((x.shape[0], raw.shape[0]), np.nan, np.float32)
    (fn or K.matmul)(x, raw, wtype, out, n0, n1, bias=bias, isa=isa)
    return out


def _x(rng, t, k, scale=1.0):
    return (rng.standard_normal((t, k)) * scale).astype(np.float32)


def assert_matmul_close(out, x, w64, what, bias=None):
    x64 = x.astype(np.float64)
    ref, mag = x64 @ w64.T, np.abs(x64) @ np.abs(w64).T
    bound = matmul_bound(x.shape[1], mag)
    if bias is not None:               # one more float32 rounding of the biased sum
        ref = ref + bias.astype(np.float64)
        bound = bound + EPS32 * (np.abs(ref) + bound)
    err = np.abs(out.astype(np.float64) - ref)
    bad = ~(err <= bound)
    assert not bad.any(), f"{what}: {bad.sum()} outputs beyond the bound, worst {np.max(err / bound):.3g}"


# ----------------------------------------------------------------------------- the traits table

def test_every_type_the_kernels_run_is_tested():
    """Guard: the tests walk kernelutil.WEIGHT_TYPES, which must be every type of the C traits
    table -- a type added to the kernels without being added there fails here -- and the types
    the Python side lets a block hold (formats.weights.RUNNABLE_TYPES)."""
    assert len(set(WEIGHT_TYPES)) == len(WEIGHT_TYPES)
    assert set(WEIGHT_TYPES) == set(K.weight_types()), sorted(set(K.weight_types()) ^
                                                              set(WEIGHT_TYPES))
    assert set(RUNNABLE_TYPES) == set(K.weight_types())


def test_weight_types_match_gguf_geometry():
    wt = K.weight_types()
    for name, info in wt.items():
        q = GGML[name]
        assert info["ggml_type"] == int(q), name
        assert (info["block_elems"], info["block_bytes"]) == gguf.GGML_QUANT_SIZES[q], name


def test_every_type_is_a_table_row():
    wt = K.weight_types()
    for n in BLOCK_TYPES:
        b = QUANT_BLOCKS[n]
        assert wt[n] == {"ggml_type": b.ggml_type, "block_elems": b.elems,
                         "block_bytes": b.nbytes}, n
    assert K.quant_block_sizes() == {n: (wt[n]["ggml_type"], wt[n]["block_elems"],
                                         wt[n]["block_bytes"]) for n in BLOCK_TYPES}


def _python_block_itemsize(name):
    """Bytes of one block of `name` per nxhpc.formats.ggml_blocks (its <NAME>_BLOCK_DTYPE or a
    BLOCK_DTYPES mapping), or for the element types the numpy dtype GGUF stores them in."""
    dt = getattr(ggml_blocks, f"{name}_BLOCK_DTYPE", None)
    if dt is None:
        dt = getattr(ggml_blocks, "BLOCK_DTYPES", {}).get(name)
    if dt is None:
        dt = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}.get(name)
    return None if dt is None else np.dtype(dt).itemsize


def test_c_block_structs_match_ggml_blocks_dtypes():
    """block_bytes is sizeof the C block struct (nx_wtype.c); ggml_blocks pins the same layout
    on the Python side. Every table type must have a Python layout (not vacuous: Q8_0 does)."""
    assert ggml_blocks.Q8_0_BLOCK_DTYPE.itemsize == 34
    for name, info in K.weight_types().items():
        size = _python_block_itemsize(name)
        assert size is not None, f"{name}: no block dtype in nxhpc.formats.ggml_blocks"
        assert size == info["block_bytes"], (name, size, info)


def test_matmul_packer_reports():
    for name in K.weight_types():
        assert K._matmul_packer(name, isa="generic") == "spec"
        for isa in SIMD_ISAS:
            want = "fused" if name == "Q8_0" else "dequantize"
            assert K._matmul_packer(name, isa=isa) == want, (name, isa)


# ----------------------------------------------------------------------------- dequantize

#: Reduction lengths per block size: element types hit the vector tails (K % 16, % 8), blocks of
#: 32 a K > 1024 (two k-blocks), K-quants K > 1024 with a partial last k-block.
K_LENGTHS = {1: (1, 7, 16, 33, 289, 1040), 32: (32, 96, 288, 1056), 256: (256, 512, 1280)}


@pytest.mark.parametrize("wtype", WEIGHT_TYPES)
def test_dequantize_and_matmul_match_gguf_and_float64(wtype):
    """Every weight type, through the table's entry points.

    dequantize: random bytes (every bit-pattern class: subnormal, inf, quiet and signalling NaN
    values or scales; 1 .. 4097 blocks, so the vector tails run the spec) and, for the block
    types, the edge battery of test_quants -- bit for bit gguf.quants.dequantize, at every ISA
    (and through dequantize_blocks for the nine block types).
    matmul: T x N x K over a grid with tails; the output within the float64 bound of
    ``x @ W.T``, W the gguf-dequantized weight; every ISA and the generic packer give the generic
    spec's bits, and so does the weight stored as its float32 dequantization (F32)."""
    E, B = gguf.GGML_QUANT_SIZES[GGML[wtype]]
    rng = np.random.default_rng(WEIGHT_TYPES.index(wtype))
    raws = [rng.integers(0, 256, size=(3, nb * B), dtype=np.uint8) for nb in (1, 7, 31, 33, 4097)]
    if wtype in BLOCK_TYPES:
        raws.append(edge_blocks(wtype))
    for raw in raws:
        with np.errstate(all="ignore"):
            ref = gguf_values(raw, wtype)
        for isa in ISAS:
            got = K.dequantize(raw, wtype, isa=isa)
            assert got.shape == ref.shape
            assert_bitwise(got, ref, f"{wtype} dequantize {raw.shape} isa={isa}")
            if wtype in BLOCK_TYPES:
                assert_bitwise(K.dequantize_blocks(raw, wtype, isa=isa), ref,
                               f"{wtype} dequantize_blocks {raw.shape} isa={isa}")
    kinds = ("encoded", "random") if wtype in BLOCK_TYPES else ("encoded",)
    grid = itertools.product((1, 7, 33), (1, 17, 65), K_LENGTHS[E])
    for case, (T, N, Kd) in enumerate(grid):
        kind = kinds[case % len(kinds)]
        x = _x(rng, T, Kd)
        raw, w64 = typed_weight(rng, N, Kd, wtype, scale=10.0 ** rng.uniform(-3, 3), kind=kind)
        what = f"{wtype} T={T} N={N} K={Kd} {kind}"
        gen = _mm(x, raw, wtype, "generic")
        assert_matmul_close(gen, x, w64, f"{what} generic")
        as_f32 = gguf_bytes(w64.astype(np.float32), "F32")
        for isa in ISAS:
            assert_bitwise(_mm(x, raw, wtype, isa), gen, f"{what} isa={isa}")
            assert_bitwise(_mm(x, raw, wtype, isa, fn=K._matmul_dequant_pack), gen,
                           f"{what} isa={isa} generic packer")
            assert_bitwise(_mm(x, as_f32, "F32", isa), gen, f"{what} vs F32 dequant isa={isa}")


@pytest.mark.parametrize("wtype", ["F16", "BF16"])
def test_dequantize_every_16_bit_pattern(wtype):
    """All 65536 patterns, incl. the NaNs (2046 for F16, 254 for BF16) whose payloads and
    signalling bit numpy (and gguf) keep -- the F16C instruction alone would quiet them."""
    w = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.uint8).reshape(4, -1)
    ref = gguf_values(w, wtype)
    assert np.isnan(ref).sum() == {"F16": 2046, "BF16": 254}[wtype]
    for isa in ISAS:
        assert_bitwise(K.dequantize(w, wtype, isa=isa), ref, f"{wtype} isa={isa}")


def test_dequantize_names_ids_and_element_arrays():
    rng = np.random.default_rng(1)
    w32 = rng.standard_normal((5, 64)).astype(np.float32)
    for wtype in WEIGHT_TYPES:
        raw, _ = typed_weight(rng, 5, 256, wtype)
        ref = gguf_values(raw, wtype)
        for spec in (wtype, wtype.lower(), int(GGML[wtype]), GGML[wtype], np.int64(int(GGML[wtype]))):
            assert_bitwise(K.dequantize(raw, spec), ref, f"{wtype} as {spec!r}")
    # F32 / F16 as gguf's reader hands them out (float32 / float16 arrays)
    assert_bitwise(K.dequantize(w32, "F32"), w32)
    h = w32.astype(np.float16)
    assert_bitwise(K.dequantize(h, "F16"), h.astype(np.float32))
    out = np.empty((5, 64), np.float32)
    assert K.dequantize(gguf_bytes(w32, "BF16"), "BF16", out=out) is out


# ----------------------------------------------------------------------------- matmul

@pytest.mark.parametrize("wtype", WEIGHT_TYPES)
def test_matmul_crosses_every_blocking_level(wtype):
    """T > MC (264), K > KC (1024 / 512) with a partial last k-block (for the element types of
    a length no multiple of 16), N > NC (128 / 256) with a partial panel: the SIMD drivers and
    both packers give the spec's bits."""
    rng = np.random.default_rng(2)
    E = _elems(wtype)
    T, N = 270, 300
    Kd = 1093 if E == 1 else -(-1040 // E) * E
    x = _x(rng, T, Kd)
    raw, w64 = typed_weight(rng, N, Kd, wtype)
    gen = _mm(x, raw, wtype, "generic")
    assert_matmul_close(gen, x, w64, wtype)
    for isa in SIMD_ISAS:
        assert_bitwise(_mm(x, raw, wtype, isa), gen, f"{wtype} isa={isa}")
        assert_bitwise(_mm(x, raw, wtype, isa, fn=K._matmul_dequant_pack), gen,
                       f"{wtype} isa={isa} deq")


@pytest.mark.parametrize("wtype", WEIGHT_TYPES)
@pytest.mark.parametrize("isa", ISAS)
def test_matmul_band_and_batch_invariance_with_bias(wtype, isa):
    rng = np.random.default_rng(3)
    T, N = 29, 101
    Kd = 320 if _elems(wtype) <= 32 else 512
    x = _x(rng, T, Kd)
    raw, w64 = typed_weight(rng, N, Kd, wtype)
    bias = rng.standard_normal(N).astype(np.float32)
    full = _mm(x, raw, wtype, isa, bias=bias)
    assert_matmul_close(full, x, w64, f"{wtype} bias", bias=bias)
    # the bias is one float32 add after the sum
    assert_bitwise(full, _mm(x, raw, wtype, isa) + bias, "bias add")
    out = np.full((T, N), np.nan, np.float32)
    edges = [0, 1, 17, 50, 51, N]
    for a, b in itertools.pairwise(edges):
        K.matmul(x, raw, wtype, out, a, b, bias=bias, isa=isa)
    assert_bitwise(out, full, "bands")
    for a, b in ((0, 1), (1, 13), (13, T)):
        assert_bitwise(_mm(np.ascontiguousarray(x[a:b]), raw, wtype, isa, bias=bias), full[a:b],
                       f"tokens {a}:{b}")
    # columns outside the band untouched
    sentinel = rng.standard_normal((T, N)).astype(np.float32)
    o = sentinel.copy()
    K.matmul(x, raw, wtype, o, 20, 70, bias=bias, isa=isa)
    assert_bitwise(o[:, :20], sentinel[:, :20])
    assert_bitwise(o[:, 70:], sentinel[:, 70:])
    assert_bitwise(o[:, 20:70], full[:, 20:70])


def test_matmul_bound_is_not_vacuous():
    """Negative controls: the float64 check rejects a kernel that read a BF16 weight as F16, one
    that dropped the low half of F32 values, and one quant off by one."""
    rng = np.random.default_rng(4)
    x = _x(rng, 5, 256)
    raw, w64 = random_weight(rng, 9, 256, "BF16")
    out = _mm(x, raw, "BF16", "generic")
    assert_matmul_close(out, x, w64, "ok")
    with pytest.raises(AssertionError), np.errstate(all="ignore"):
        assert_matmul_close(_mm(x, raw, "F16", "generic"), x, w64, "bf16 read as f16")
    _, w32 = random_weight(rng, 9, 256, "F32")
    trunc = gguf_bytes(gguf_values(gguf_bytes(w32.astype(np.float32), "BF16"), "BF16"), "F32")
    with pytest.raises(AssertionError):
        assert_matmul_close(_mm(x, trunc, "F32", "generic"), x, w32, "f32 truncated")
    rq, wq = random_weight(rng, 9, 256, "Q8_0")
    rq[4, 2 + 5] = np.uint8((int(rq[4, 2 + 5]) + 1) % 256)
    with pytest.raises(AssertionError):
        assert_matmul_close(_mm(x, rq, "Q8_0", "generic"), x, wq, "one quant off")


def test_matmul_bound_is_not_vacuous_for_k_quants():
    """Negative controls: one Q4_K 4-bit code off by one, and a decoder that dropped the
    "- dmin * min" term (the mins zeroed), both fail the float64 check."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((5, 512)).astype(np.float32)
    raw, w64 = typed_weight(rng, 9, 512, "Q4_K")
    assert_matmul_close(_mm(x, raw, "Q4_K", "generic"), x, w64, "ok")
    bad = raw.copy()
    bad[4, 16 + 40] ^= np.uint8(0x01)             # qs byte of block 0 of row 4
    with pytest.raises(AssertionError):
        assert_matmul_close(_mm(x, bad, "Q4_K", "generic"), x, w64, "one code off")
    nomin = raw.copy()
    blk = nomin.reshape(-1).view(QUANT_BLOCKS["Q4_K"].dtype)
    blk["dmin"] = 0
    with pytest.raises(AssertionError):
        assert_matmul_close(_mm(x, nomin, "Q4_K", "generic"), x, w64, "mins dropped")


@pytest.mark.parametrize("wtype", ["F16", "BF16", "F32"])
def test_matmul_non_finite_weights_propagate_identically(wtype):
    rng = np.random.default_rng(5)
    x = _x(rng, 4, 96)
    raw, _ = random_weight(rng, 37, 96, wtype)
    B = raw.shape[1] // 96
    nan = {"F16": [0x01, 0x7c], "BF16": [0x81, 0x7f], "F32": [0x01, 0x00, 0x80, 0x7f]}[wtype]
    inf = {"F16": [0x00, 0x7c], "BF16": [0x80, 0x7f], "F32": [0x00, 0x00, 0x80, 0x7f]}[wtype]
    raw[3, 10 * B:11 * B] = nan      # a signalling NaN
    raw[20, 50 * B:51 * B] = inf
    gen = _mm(x, raw, wtype, "generic")
    assert np.isnan(gen[:, 3]).all() and not np.isnan(gen[:, 0]).any()
    for isa in SIMD_ISAS:
        assert_bitwise(_mm(x, raw, wtype, isa), gen, f"isa={isa}")
        assert_bitwise(_mm(x, raw, wtype, isa, fn=K._matmul_dequant_pack), gen, f"isa={isa} deq")


@pytest.mark.parametrize("wtype", WEIGHT_TYPES)
def test_matmul_reads_read_only_unaligned_maps(tmp_path, wtype):
    """Weights straight from a read-only memory map at an odd file offset (GGUF data is only
    32-byte aligned per tensor, rows may be at any byte): same bits, file unchanged."""
    rng = np.random.default_rng(6)
    Kd = 130 if _elems(wtype) == 1 else 512
    x = _x(rng, 5, Kd)
    raw, _ = typed_weight(rng, 41, Kd, wtype)
    path = tmp_path / f"{wtype}.bin"
    path.write_bytes(b"\x07" + raw.tobytes())
    wm = np.memmap(path, dtype=np.uint8, mode="r", offset=1, shape=raw.shape)
    assert not wm.flags.writeable
    ref = _mm(x, raw, wtype, "generic")
    for isa in ISAS:
        assert_bitwise(_mm(x, wm, wtype, isa), ref, f"{wtype} map isa={isa}")
    del wm
    assert path.read_bytes()[1:] == raw.tobytes()


def test_matmul_converts_panel_by_panel_no_float32_copy(tmp_path):
    """RSS while multiplying by a 32 MiB BF16 map grows by the mapped pages touched (32 MiB) and
    the panel scratch (< 1 MiB), not by a 64 MiB float32 copy of the matrix."""
    n = k = 4096
    path = tmp_path / "w.bin"
    rng = np.random.default_rng(7)
    gguf_bytes(rng.standard_normal((n, k)).astype(np.float32) * 0.01, "BF16").tofile(path)
    # VmHWM (peak RSS of this address space; ru_maxrss would carry the parent's over exec)
    code = textwrap.dedent(f"""
        import numpy as np
        from nxhpc import _kernels as K
        def kib(key):
            return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key))
        w = np.memmap({str(path)!r}, dtype=np.uint8, mode="r", shape=({n}, {2 * k}))
        x = np.ones((4, {k}), np.float32); out = np.empty((4, {n}), np.float32)
        K.matmul(x[:, :32].copy(), np.zeros((1, 64), np.uint8), "BF16", np.empty((4, 1), np.float32))
        before = kib("VmHWM:")
        K.matmul(x, w, "BF16", out)
        print(kib("VmHWM:") - before)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env=dict(os.environ))
    grew_kib = int(r.stdout.strip())
    map_kib, copy_kib = n * k * 2 // 1024, n * k * 4 // 1024
    assert grew_kib < map_kib + 8 * 1024, f"RSS grew {grew_kib} KiB (map {map_kib}, f32 copy {copy_kib})"
    assert grew_kib > map_kib // 2, "negative control: the map itself must show up in RSS"


# ----------------------------------------------------------------------------- adaln_linear

@pytest.mark.parametrize("wtype", WEIGHT_TYPES)
@pytest.mark.parametrize("silu_input", [False, True])
def test_adaln_linear_every_type(wtype, silu_input):
    """Within the float64 bound of ``W u + b`` (u = t or silu(t)); every ISA gives the generic
    spec's bits, and so does the weight stored as its float32 dequantization (F32)."""
    rng = np.random.default_rng(8)
    Kd, N = 256, 4 * 48 + 3
    t = (rng.standard_normal(Kd) * 3).astype(np.float32)
    raw, w64 = typed_weight(rng, N, Kd, wtype, scale=0.05)
    b = rng.standard_normal(N).astype(np.float32)
    u = t.astype(np.float64)
    if silu_input:
        u = u / (1.0 + np.exp(-u))
    ref = w64 @ u + b
    mag = np.abs(w64) @ np.abs(u)
    # silu in float32 (expf: a few ulp) perturbs u by <= 4u|u|; the matmul bound; the bias add.
    tol = (4 * EPS32 + matmul_bound(Kd, 1.0)) * mag + EPS32 * (np.abs(ref) + mag) + 1e-30
    want = np.full(N, np.nan, np.float32)
    K.adaln_linear(t, raw, wtype, b, want, silu_input=silu_input, isa="generic")
    assert (np.abs(want - ref) <= tol).all()
    w32 = gguf_values(raw, wtype)
    for isa in ISAS:
        out = np.full(N, np.nan, np.float32)
        assert K.adaln_linear(t, raw, wtype, b, out, silu_input, isa=isa) is out
        assert_bitwise(out, want, f"{wtype} isa={isa}")
        out2 = np.full(N, np.nan, np.float32)
        K.adaln_linear(t, raw, wtype, bias=b, out=out2, silu_input=silu_input, isa=isa)
        assert_bitwise(out2, want, "keywords")
        K.adaln_linear(t, w32, "F32", b, out2, silu_input=silu_input, isa=isa)
        assert_bitwise(out2, want, f"{wtype} isa={isa} vs F32 dequant")


# ----------------------------------------------------------------------------- bad input

def _ro(a):
    a.flags.writeable = False
    return a


def _bad_cases():
    f = np.float32
    x = np.ones((4, 64), f)
    w16 = gguf_bytes(np.ones((6, 64), f), "F16")
    wq = gguf_bytes(np.ones((6, 64), f), "Q8_0")
    out = np.zeros((4, 6), f)
    t = np.ones(64, f)
    o6 = np.zeros(6, f)
    wsq = np.zeros((2, 2), f)
    mm, dq, ad = K.matmul, K.dequantize, K.adaln_linear
    return [
        # matmul: weight type
        ("mm unknown name", lambda: mm(x, w16, "Q9_9", out), ValueError, ("wtype", "Q9_9")),
        ("mm unknown id", lambda: mm(x, w16, 4, out), ValueError, ("wtype", "4")),
        ("mm negative id", lambda: mm(x, w16, -1, out), ValueError, ("wtype",)),
        ("mm wtype float", lambda: mm(x, w16, 1.0, out), TypeError, ("wtype",)),
        ("mm wtype bool", lambda: mm(x, w16, True, out), TypeError, ("wtype",)),
        ("mm wtype None", lambda: mm(x, w16, None, out), TypeError, ("wtype",)),
        ("mm K not multiple of block", lambda: mm(np.ones((4, 48), f), np.ones((6, 34), np.uint8),
                                                  "Q8_0", out), ValueError, ("K=48", "Q8_0")),
        ("mm row bytes mismatch", lambda: mm(x, w16, "F32", out), ValueError, ("w", "F32")),
        ("mm f16 given as float32", lambda: mm(x, np.ones((6, 64), f), "F16", out), TypeError,
         ("w", "float32")),
        ("mm float16 for Q8_0", lambda: mm(x, np.ones((6, 64), np.float16), "Q8_0", out), TypeError,
         ("w",)),
        ("mm w int8", lambda: mm(x, w16.view(np.int8), "F16", out), TypeError, ("w",)),
        ("mm w 1-D", lambda: mm(x, w16.reshape(-1), "F16", out), ValueError, ("w",)),
        ("mm w list", lambda: mm(x, w16.tolist(), "F16", out), TypeError, ("w",)),
        ("mm w non-contiguous", lambda: mm(x, np.ones((12, 128), np.uint8)[::2], "F16", out),
         ValueError, ("w",)),
        # matmul: other arguments
        ("mm x float64", lambda: mm(x.astype(np.float64), w16, "F16", out), TypeError, ("x",)),
        ("mm out None", lambda: mm(x, w16, "F16", None), TypeError, ("out",)),
        ("mm out shape", lambda: mm(x, w16, "F16", np.zeros((4, 7), f)), ValueError, ("out",)),
        ("mm out read-only", lambda: mm(x, w16, "F16", _ro(np.zeros((4, 6), f))), ValueError,
         ("out",)),
        ("mm bias shape", lambda: mm(x, w16, "F16", out, bias=np.ones(5, f)), ValueError, ("bias",)),
        ("mm bias float64", lambda: mm(x, w16, "F16", out, bias=np.ones(6)), TypeError, ("bias",)),
        ("mm bias list", lambda: mm(x, w16, "F16", out, bias=[1.0] * 6), TypeError, ("bias",)),
        ("mm bias aliases out", lambda: mm(np.ones((1, 64), f), w16, "F16", o6[None, :],
                                           bias=o6), ValueError, ("bias",)),
        ("mm out aliases x", lambda: mm(x, gguf_bytes(np.ones((64, 64), f), "F16"), "F16", x),
         ValueError, ("out", "x")),
        ("mm n1 > N", lambda: mm(x, w16, "F16", out, 0, 7), ValueError, ("band",)),
        ("mm n0 float", lambda: mm(x, w16, "F16", out, 0.5, 3), TypeError, ("n0",)),
        ("mm isa bogus", lambda: mm(x, w16, "F16", out, isa="sse9"), ValueError, ("isa",)),
        ("mm isa positional", lambda: mm(x, w16, "F16", out, 0, 6, None, "generic"), TypeError, ()),
        # dequantize
        ("dq unknown type", lambda: dq(w16, "Q9_9"), ValueError, ("wtype",)),
        ("dq bytes % block", lambda: dq(np.ones((2, 35), np.uint8), "Q8_0"), ValueError, ("w", "34")),
        ("dq bf16 odd bytes", lambda: dq(np.ones((2, 3), np.uint8), "BF16"), ValueError, ("w",)),
        ("dq w float64", lambda: dq(np.ones((2, 4)), "F32"), TypeError, ("w",)),
        ("dq w 0-D", lambda: dq(np.ones((), np.uint8), "F16"), ValueError, ("w",)),
        ("dq out shape", lambda: dq(w16, "F16", out=np.zeros((6, 63), f)), ValueError, ("out",)),
        ("dq out float64", lambda: dq(w16, "F16", out=np.zeros((6, 64))), TypeError, ("out",)),
        ("dq out read-only", lambda: dq(w16, "F16", out=_ro(np.zeros((6, 64), f))), ValueError,
         ("out",)),
        ("dq isa bogus", lambda: dq(w16, "F16", isa="avx9"), ValueError, ("isa",)),
        # adaln_linear
        ("ad unknown type", lambda: ad(t, w16, "Q9_9", None, o6), ValueError, ("wtype",)),
        ("ad K % block", lambda: ad(np.ones(48, f), np.ones((6, 34), np.uint8), "Q8_0", None, o6),
         ValueError, ("t_emb", "Q8_0")),
        ("ad row bytes", lambda: ad(t, wq, "F16", None, o6), ValueError, ("t_emb",)),
        ("ad missing out", lambda: ad(t, w16, "F16", None), TypeError, ("out",)),
        ("ad out None", lambda: ad(t, w16, "F16", None, None), TypeError, ("out",)),
        ("ad bias shape", lambda: ad(t, w16, "F16", np.ones(5, f), o6), ValueError, ("bias",)),
        ("ad silu not bool", lambda: ad(t, w16, "F16", None, o6, "yes"), TypeError, ("silu_input",)),
        ("ad silu twice", lambda: ad(t, np.ones((6, 64), f), "F32", None, o6, True,
                                     silu_input=True), TypeError, ("silu_input",)),
        ("ad no wtype", lambda: ad(t, np.ones((6, 64), np.float16), None, o6),
         TypeError, ("wtype",)),
        ("ad out aliases w", lambda: ad(np.ones(2, f), wsq, "F32", None, wsq[0]), ValueError,
         ("out", "w")),
    ]


@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_bad_input_raises_clear_error(case):
    name, call, exc, words = case
    with pytest.raises(exc) as info:
        call()
    msg = str(info.value)
    fn = {"mm": "matmul", "dq": "dequantize", "ad": "adaln_linear"}[name[:2]]
    assert fn in msg, f"{name}: error does not name the function: {msg}"
    for w in words:
        assert w in msg, f"{name}: error does not mention {w!r}: {msg}"


def test_dequantize_rejects_out_overlapping_w():
    buf = np.zeros(2 * 64 * 4, np.uint8)
    w = buf.reshape(2, 256)
    with pytest.raises(ValueError, match="dequantize: out must not overlap w"):
        K.dequantize(w, "F32", out=buf.view(np.float32).reshape(2, 64))


def test_bad_input_loses_nothing():
    """A rejected call writes nothing: out and the weight are unchanged."""
    rng = np.random.default_rng(9)
    raw, _ = random_weight(rng, 6, 64, "F16")
    before = raw.copy()
    out = rng.standard_normal((4, 6)).astype(np.float32)
    keep = out.copy()
    with pytest.raises(ValueError):
        K.matmul(np.ones((4, 64), np.float32), raw, "F16", out, 0, 7)
    with pytest.raises(ValueError):
        K.matmul(np.ones((4, 64), np.float32), raw, "Q9_9", out)
    assert_bitwise(out, keep)
    np.testing.assert_array_equal(raw, before)


@pytest.mark.parametrize("name", BLOCK_TYPES)
def test_k_not_a_multiple_of_the_block_is_refused(name):
    E, B = _elems(name), QUANT_BLOCKS[name].nbytes
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
