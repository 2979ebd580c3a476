"""Tests of ``K.embed_rows(w, wtype, ids, out, r0, r1, *, isa)``: out[i] = the float32 values of
row ids[i] of a typed [N, K] matrix (the text encoder's token embedding, often Q4_K / Q6_K).

Oracle: ``gguf.quants.dequantize`` of the whole matrix (the test may decode it all; the kernel
must not), indexed with numpy; compared as bit patterns (NaN payloads, signed zeros). Data:
random bytes for every type of ``weight_types()`` (random float16 scales, NaN and inf
included, so every code path of the decoders runs), and gguf-written float weights. Also: band
splits, repeated / edge ids, read-only unaligned maps, memory O(rows asked), bad input.
"""
import os
import subprocess
import sys
import textwrap

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize as gguf_dequantize

from kernelutil import ISAS, assert_bitwise, band_edges, gguf_bytes
from nxhpc import _kernels as K

TYPES = sorted(K.weight_types())


def blocks_per_row(name):
    """A row length with a tail for each block size: K = 33 (1-value types), 96, 512."""
    e = K.weight_types()[name]["block_elems"]
    return {1: 33, 32: 3, 256: 2}[e]


def random_matrix(rng, name, n):
    """Random bytes of an [n, K] matrix of `name` (uint8 [n, rowbytes]) and gguf's values."""
    t = K.weight_types()[name]
    nb = blocks_per_row(name)
    raw = rng.integers(0, 256, (n, nb * t["block_bytes"]), dtype=np.uint8)
    with np.errstate(all="ignore"):
        ref = np.asarray(gguf_dequantize(raw, gguf.GGMLQuantizationType[name]), np.float32)
    assert ref.shape == (n, nb * t["block_elems"])
    return raw, ref


def row_len(w, name):
    """K of a weight given as raw bytes [N, rowbytes] or as an element array [N, K]."""
    t = K.weight_types()[name]
    return w.shape[1] // t["block_bytes"] * t["block_elems"] if w.dtype == np.uint8 else w.shape[1]


def gather(w, name, ids, isa, r0=0, r1=None, fill=np.nan):
    out = np.full((len(ids), row_len(w, name)), fill, np.float32)
    return K.embed_rows(w, name, ids, out, r0, r1, isa=isa)


def id_sets(rng, n):
    """int32 and int64 ids: the edges 0 and N-1, repeats, a random order, one id alone."""
    base = np.array([0, n - 1, 5, 5, 0, n - 1, *rng.integers(0, n, 20)], np.int64)
    return [base, base.astype(np.int32), np.array([n - 1], np.int32), rng.permutation(n)]


def test_every_weight_type_is_covered():
    # the types the matmul supports, so a type added to the traits table is tested here too
    assert {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q6_K"} <= set(TYPES)


@pytest.mark.parametrize("name", TYPES)
def test_rows_byte_identical_to_gguf(name):
    rng = np.random.default_rng(sum(map(ord, name)))
    N = 37
    raw, ref = random_matrix(rng, name, N)
    for ids in id_sets(rng, N):
        want = ref[ids]
        for isa in ISAS:
            assert_bitwise(gather(raw, name, ids, isa), want, f"{name} {isa} {ids.dtype}")
        assert_bitwise(gather(raw, name, ids, None), want, f"{name} default isa")
    # negative control: another row's values are not accepted
    got = gather(raw, name, np.array([1], np.int64), "generic")
    assert not np.array_equal(bits32(got), bits32(ref[[2]]))


def bits32(a):
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


@pytest.mark.parametrize("name", ["F32", "F16", "BF16", "Q8_0"])
def test_gguf_written_float_weights(name):
    """Real values written by the gguf package (and, for F32 / F16, the element arrays that
    gguf.GGUFReader hands out in place of the bytes)."""
    rng = np.random.default_rng(3)
    w32 = rng.standard_normal((50, 64)).astype(np.float32)
    raw = gguf_bytes(w32, name)
    ref = np.asarray(gguf_dequantize(raw, gguf.GGMLQuantizationType[name]), np.float32)
    ids = np.array([49, 0, 7, 7, 3], np.int64)
    forms = [raw]
    if name == "F32":
        forms.append(w32)
    if name == "F16":
        forms.append(w32.astype(np.float16))
    for w in forms:
        for isa in ISAS:
            assert_bitwise(gather(w, name, ids, isa), ref[ids], f"{name} {w.dtype} {isa}")
    if name == "F32":
        assert_bitwise(ref[ids], w32[ids], "F32 is the stored values")


@pytest.mark.parametrize("name", ["F16", "Q8_0", "Q4_K", "Q6_K", "Q5_1"])
@pytest.mark.parametrize("isa", ISAS)
def test_band_splits_and_untouched_rows(name, isa):
    rng = np.random.default_rng(5)
    raw, ref = random_matrix(rng, name, 29)
    ids = rng.integers(0, 29, 23).astype(np.int32)
    full = gather(raw, name, ids, isa)
    n = len(ids)
    for _ in range(5):
        edges = band_edges(rng, n, 5)
        out = np.full_like(full, 7.0)
        for a, b in zip(edges[:-1], edges[1:]):
            K.embed_rows(raw, name, ids, out, a, b, isa=isa)
        assert_bitwise(out, full, f"bands {edges}")
    out = gather(raw, name, ids, isa, 4, 9, fill=7.0)
    assert np.all(out[:4] == 7.0) and np.all(out[9:] == 7.0)
    assert_bitwise(out[4:9], ref[ids[4:9]], "band [4, 9)")
    out = gather(raw, name, ids, isa, 6, 6, fill=7.0)  # empty band: nothing written
    assert np.all(out == 7.0)


def test_read_only_unaligned_map_and_unaligned_ids(tmp_path):
    rng = np.random.default_rng(6)
    for name in ("Q4_K", "BF16", "Q4_0"):
        raw, ref = random_matrix(rng, name, 17)
        path = tmp_path / f"{name}.bin"
        path.write_bytes(b"\x07" + raw.tobytes())
        wm = np.memmap(path, dtype=np.uint8, mode="r", offset=1, shape=raw.shape)
        assert not wm.flags.writeable
        buf = np.zeros(4 * 6 + 1, np.uint8)
        ids = np.frombuffer(buf.data, dtype=np.int32, count=6, offset=1)  # misaligned by 1
        assert not ids.flags.aligned
        buf[1:].view(np.uint8)[:] = np.array([16, 0, 3, 3, 9, 1], np.int32).view(np.uint8)
        for isa in ISAS:
            assert_bitwise(gather(wm, name, ids, isa), ref[[16, 0, 3, 3, 9, 1]], f"{name} {isa}")
        del wm
        assert path.read_bytes()[1:] == raw.tobytes()


def test_memory_is_per_row_not_per_matrix(tmp_path):
    """Gathering 6 rows of a 70 MiB Q8_0 map touches those rows only: peak RSS grows by far less
    than the map (a whole-matrix decode would need ~250 MiB). Negative control: reading every
    page of the map does show up in the same measurement."""
    n, k = 16384, 4096
    rowbytes = k // 32 * 34
    path = tmp_path / "emb.bin"
    with open(path, "wb") as f:
        f.truncate(n * rowbytes)  # all-zero Q8_0 blocks: d = 0, valid
    code = textwrap.dedent(f"""
        import numpy as np
        from nxhpc import _kernels as K
        def kib(key):
            return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key))
        w = np.memmap({str(path)!r}, dtype=np.uint8, mode="r", shape=({n}, {rowbytes}))
        ids = np.array([0, {n - 1}, 77, 77, 5000, 12345], np.int64)
        out = np.empty((6, {k}), np.float32)
        K.embed_rows(w[:2], "Q8_0", ids[:1], out[:1])  # warm up the code paths
        before = kib("VmHWM:")
        K.embed_rows(w, "Q8_0", ids, out)
        grew = kib("VmHWM:") - before
        assert not out.any()
        w.reshape(-1)[::4096].sum()  # touch every page
        print(grew, kib("VmHWM:") - before)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env=dict(os.environ))
    grew_kib, touched_kib = map(int, r.stdout.split())
    map_kib = n * rowbytes // 1024
    assert grew_kib < 4 * 1024, f"RSS grew {grew_kib} KiB gathering 6 rows (map {map_kib} KiB)"
    assert touched_kib > map_kib // 2, f"negative control: the map must show up ({touched_kib})"


def test_empty_ids_and_zero_width():
    raw, _ = random_matrix(np.random.default_rng(0), "Q8_0", 4)
    out = np.zeros((0, 96), np.float32)
    assert K.embed_rows(raw, "Q8_0", np.zeros(0, np.int64), out) is out
    out = np.full((2, 0), 7.0, np.float32)  # K = 0: rows of zero bytes
    K.embed_rows(np.zeros((3, 0), np.uint8), "F32", np.array([0, 2], np.int32), out)


def _bad_cases():
    """(argument, bad value, exception, message fragment)."""
    rng = np.random.default_rng(1)
    raw, _ = random_matrix(rng, "Q4_K", 10)           # K = 512, rowbytes 288
    good = dict(w=raw, wtype="Q4_K", ids=np.array([0, 9, 3], np.int64),
                out=np.zeros((3, 512), np.float32))
    ro = np.zeros((3, 512), np.float32)
    ro.flags.writeable = False
    cases = [
        ("ids", np.array([0, 10, 3], np.int64), ValueError, "ids[1] = 10 is out of range"),
        ("ids", np.array([0, 1, -1], np.int32), ValueError, "ids[2] = -1 is out of range"),
        ("ids", np.array([2**40, 0, 0], np.int64), ValueError, "N=10"),
        ("ids", np.array([0.0, 1.0, 2.0]), TypeError, "ids must be int32 or int64"),
        ("ids", np.array([0, 1, 2], np.uint32), TypeError, "dtype=uint32"),
        ("ids", np.array([0, 1, 2], np.int16), TypeError, "dtype=int16"),
        ("ids", np.array([True, False, True]), TypeError, "dtype=bool"),
        ("ids", np.array([0, 1, 2], ">i8"), TypeError, "ids must be int32 or int64"),
        ("ids", [0, 1, 2], TypeError, "ids must be a numpy.ndarray"),
        ("ids", None, TypeError, "ids must be a numpy.ndarray"),
        ("ids", np.array([[0, 1, 2]], np.int64), ValueError, "ids must be 1-D"),
        ("ids", np.arange(6, dtype=np.int64)[::2], ValueError, "ids must be C-contiguous"),
        ("out", np.zeros((3, 511), np.float32), ValueError, "out must have shape (3, 512)"),
        ("out", np.zeros((4, 512), np.float32), ValueError, "out must have shape (3, 512)"),
        ("out", np.zeros((3, 512), np.float64), TypeError, "out must be float32"),
        ("out", ro, ValueError, "out is read-only"),
        ("out", None, TypeError, "out must be a float32 array"),
        ("w", raw.astype(np.float32), TypeError, "w must be uint8"),
        ("w", np.ascontiguousarray(raw[:, :287]), ValueError, "multiple of 144 bytes"),
        ("w", raw.reshape(-1), ValueError, "w must be 2-D"),
        ("w", list(raw), TypeError, "w must be a numpy.ndarray"),
        ("wtype", "Q9_9", ValueError, "is not a supported weight type"),
        ("wtype", 3.5, TypeError, "wtype must be"),
        ("wtype", "Q8_0", ValueError, "multiple of 34 bytes"),
        ("r1", 4, ValueError, "band [0, 4)"),
        ("r0", 2, ValueError, "band [2, 1)", dict(r1=1)),
        ("r0", "a", TypeError, "r0 must be an integer"),
        ("isa", "sse9", ValueError, "isa must be None or one of"),
    ]
    return good, cases


def test_bad_input_battery():
    good, cases = _bad_cases()
    K.embed_rows(**good)  # the valid call works, so each failure is due to the one bad argument
    for case in cases:
        arg, val, exc, frag = case[:4]
        kw = dict(good, **(case[4] if len(case) > 4 else {}))
        kw[arg] = val
        outs = [v for v in kw.values() if isinstance(v, np.ndarray) and v.flags.writeable]
        before = [o.copy() for o in outs]
        with pytest.raises(exc) as ei:
            K.embed_rows(**kw)
        msg = str(ei.value)
        assert msg.startswith("embed_rows: "), (arg, msg)
        assert frag in msg, (arg, frag, msg)
        for o, b in zip(outs, before):
            assert np.array_equal(o, b, equal_nan=True), (arg, "output written before the error")


def test_bad_id_anywhere_is_refused_before_any_row_is_written():
    raw, _ = random_matrix(np.random.default_rng(2), "Q6_K", 8)
    ids = np.array([1, 2, 3, 8], np.int32)  # the bad id lies outside the band asked for
    out = np.full((4, 512), 7.0, np.float32)
    with pytest.raises(ValueError, match=r"^embed_rows: ids\[3\] = 8 is out of range .*N=8"):
        K.embed_rows(raw, "Q6_K", ids, out, 0, 2)
    assert np.all(out == 7.0)


def test_output_overlapping_an_input_is_refused():
    w = np.random.default_rng(3).standard_normal((8, 16)).astype(np.float32)
    with pytest.raises(ValueError, match="^embed_rows: out must not overlap w"):
        K.embed_rows(w, "F32", np.array([0, 1], np.int64), w[6:])
    buf = np.zeros(64, np.float32)
    ids = buf[:2].view(np.int64)[:1]
    with pytest.raises(ValueError, match="^embed_rows: out must not overlap ids"):
        K.embed_rows(w, "F32", ids, buf[:16].reshape(1, 16))
