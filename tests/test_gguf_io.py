"""GGUF reading/writing (nxhpc.formats.gguf_io): round trips against the gguf package, each named
malformed-file case, and fuzzing (truncation, byte corruption) where every failure must be a
ModelFileError naming the file."""
import atexit
import os
import shutil
import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import gguf
from nxhpc.formats.gguf_io import (PREFIX, Q8_0_BLOCK, GGUFFile, MissingTensorError, ModelFileError,
                           Q8_0Tensor, dequantize_q8_0, quantize_q8_0, should_quantize,
                           write_gguf)
from nxhpc.models import SyntheticSpec, make_synthetic
from testutil import open_and_decode_all

Q8 = gguf.GGMLQuantizationType.Q8_0


# ----------------------------------------------------------------------------- a raw writer
# Independent of nxhpc's writer: builds GGUF bytes field by field so tests can break any field.

def _s(b):
    b = b.encode() if isinstance(b, str) else b
    return struct.pack("<Q", len(b)) + b


def raw_gguf(tensors, kv=(), version=3, magic=b"GGUF", alignment=32, offsets=None,
             n_tensors=None, n_kv=None, pad_data=True):
    """tensors: list of (name, ne (innermost first), ggml type, data bytes); kv: list of
    (key, value type, packed value bytes)."""
    out = bytearray(magic + struct.pack("<I", version))
    out += struct.pack("<QQ", len(tensors) if n_tensors is None else n_tensors,
                       len(kv) if n_kv is None else n_kv)
    for key, vt, val in kv:
        out += _s(key) + struct.pack("<I", vt) + val
    offs, o = [], 0
    for _, _, _, data in tensors:
        offs.append(o)
        o += -(-len(data) // alignment) * alignment
    offs = offsets or offs
    for (name, ne, t, _), off in zip(tensors, offs):
        out += _s(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<Q", d) for d in ne)
        out += struct.pack("<IQ", t, off)
    out += b"\0" * (-len(out) % alignment)
    for _, _, _, data in tensors:
        out += data
        if pad_data:
            out += b"\0" * (-len(data) % alignment)
    return bytes(out)


def f32_tensor(name, arr):
    arr = np.ascontiguousarray(arr, np.float32)
    return (name, list(reversed(arr.shape)), 0, arr.tobytes())


def write_bytes(tmp_path, data, name="m.gguf"):
    p = Path(tmp_path) / name
    p.write_bytes(data)
    return p


# ----------------------------------------------------------------------------- round trips

def test_write_policy_and_bit_exact_q8_0(tmp_path):
    rng = np.random.default_rng(0)
    big = rng.standard_normal((64, 96)).astype(np.float32)      # 2-D, rows % 32 == 0 -> Q8_0
    odd = rng.standard_normal((40, 50)).astype(np.float32)      # row 50 -> F32
    small = rng.standard_normal((16, 32)).astype(np.float32)    # 512 elements -> F32
    vec = rng.standard_normal(96).astype(np.float32)            # 1-D -> F32
    p = write_gguf(tmp_path / "a.gguf", {"layers.0.big.weight": big, "odd": odd,
                                          "small": small, "vec": vec}, prefix=True)
    with GGUFFile(p) as g:
        assert g.architecture == "lumina2"
        assert g.prefix == PREFIX
        assert g.names() == ["layers.0.big.weight", "odd", "small", "vec"]
        assert [g.type_name(n) for n in g.names()] == ["Q8_0", "F32", "F32", "F32"]
        np.testing.assert_array_equal(g.q8_0("layers.0.big.weight"), gguf.quants.quantize(big, Q8))
        np.testing.assert_array_equal(g.q8_0(PREFIX + "layers.0.big.weight"),
                                      gguf.quants.quantize(big, Q8))
        np.testing.assert_array_equal(g.load_f32("odd"), odd)
        np.testing.assert_array_equal(g.load_f32("vec"), vec)
        assert g.shape("layers.0.big.weight") == (64, 96)
        np.testing.assert_array_equal(g.load_f32("layers.0.big.weight"),
                                      gguf.quants.dequantize(gguf.quants.quantize(big, Q8), Q8))
    # the gguf package's own reader sees the prefixed names and Q8_0 type
    r = gguf.GGUFReader(p)
    assert {t.name for t in r.tensors} == {PREFIX + n for n in
                                           ("layers.0.big.weight", "odd", "small", "vec")}
    assert bytes(r.fields["general.architecture"].parts[-1]) == b"lumina2"


def test_prefix_off_and_lookup_both_ways(tmp_path):
    p = write_gguf(tmp_path / "b.gguf", {"x.weight": np.ones(8, np.float32)}, prefix=False)
    with GGUFFile(p) as g:
        assert g.prefix == ""
        assert g.info("x.weight").name == "x.weight"
        assert g.has(PREFIX + "x.weight") and g.has("x.weight")
        with pytest.raises(MissingTensorError, match="'y.weight'"):
            g.info("y.weight")


def test_q8_0_views_are_zero_copy_and_read_only(tmp_path):
    w = np.random.default_rng(1).standard_normal((64, 64)).astype(np.float32)
    p = write_gguf(tmp_path / "c.gguf", {"w": w})
    with GGUFFile(p) as g:
        v = g.q8_0("w")
        assert v.dtype == np.uint8 and v.shape == (64, 2 * 34)
        assert np.shares_memory(v, g.mapping)
        assert not v.flags.writeable and not v.flags.owndata
        with pytest.raises(ValueError):
            v[0, 0] = 1
        assert Q8_0_BLOCK.itemsize == 34


def test_f16_bf16_decoding(tmp_path):
    """Files written by the gguf package's own writer with F16 and BF16 tensors."""
    rng = np.random.default_rng(2)
    a = rng.standard_normal((4, 32)).astype(np.float32)
    w = gguf.GGUFWriter(tmp_path / "d.gguf", "lumina2")
    w.add_tensor("h", a.astype(np.float16))
    bf = gguf.quants.quantize(a, gguf.GGMLQuantizationType.BF16)
    w.add_tensor("b", bf, raw_dtype=gguf.GGMLQuantizationType.BF16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with GGUFFile(tmp_path / "d.gguf") as g:
        assert g.type_name("h") == "F16" and g.type_name("b") == "BF16"
        np.testing.assert_array_equal(g.load_f32("h"), a.astype(np.float16).astype(np.float32))
        # BF16 = the top 16 bits of float32 (gguf rounds to nearest even)
        ref = gguf.quants.dequantize(bf, gguf.GGMLQuantizationType.BF16)
        np.testing.assert_array_equal(g.load_f32("b"), ref)
        assert np.abs(g.load_f32("b") - a).max() <= np.abs(a).max() * 2 ** -8


@settings(max_examples=60)
@given(st.integers(1, 8), st.integers(1, 4), st.floats(1e-3, 1e3), st.integers(0, 2**31))
def test_requantizing_dequantized_q8_0_is_identity(rows, blocks, scale, seed):
    x = (np.random.default_rng(seed).standard_normal((rows, 32 * blocks)) * scale
         ).astype(np.float32)
    q = quantize_q8_0(x)
    np.testing.assert_array_equal(q, gguf.quants.quantize(x, Q8))
    np.testing.assert_array_equal(quantize_q8_0(dequantize_q8_0(q)), q)


def test_quantize_rejects_bad_input():
    with pytest.raises(ValueError, match="NaN"):
        quantize_q8_0(np.full((1, 32), np.nan, np.float32), "w")
    with pytest.raises(ValueError, match="float16 scale"):
        quantize_q8_0(np.full((1, 32), 1e9, np.float32), "w")
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_q8_0(np.zeros((2, 33), np.float32), "w")
    assert should_quantize((64, 64)) and not should_quantize((64,)) and \
        not should_quantize((8, 32)) and not should_quantize((64, 48))


def test_write_is_deterministic_and_accepts_prequantized(tmp_path):
    w = np.random.default_rng(3).standard_normal((64, 64)).astype(np.float32)
    a = write_gguf(tmp_path / "e1.gguf", {"w": w, "n": np.ones(64)}, metadata={"k": 1.5})
    b = write_gguf(tmp_path / "e2.gguf", {"w": Q8_0Tensor(quantize_q8_0(w)),
                                          "n": np.ones(64)}, metadata={"k": 1.5})
    assert a.read_bytes() == b.read_bytes()
    assert not list(tmp_path.glob(".*tmp*"))
    with GGUFFile(a) as g:
        assert g.metadata["k"] == 1.5


# ----------------------------------------------------------------------------- named cases

def _valid_tensors():
    w = np.random.default_rng(4).standard_normal((4, 64)).astype(np.float32)
    q = gguf.quants.quantize(w, Q8).tobytes()
    return [f32_tensor("a", np.arange(8, dtype=np.float32)), ("q", [64, 4], 8, q)]


def test_raw_writer_makes_valid_files(tmp_path):
    p = write_bytes(tmp_path, raw_gguf(_valid_tensors()))
    with GGUFFile(p) as g:
        np.testing.assert_array_equal(g.load_f32("a"), np.arange(8))
        assert g.q8_0("q").shape == (4, 68)


CASES = {
    "bad magic": (lambda: raw_gguf(_valid_tensors(), magic=b"GGUG"), "not a GGUF file"),
    "version 1": (lambda: raw_gguf(_valid_tensors(), version=1), "unsupported GGUF version 1"),
    "version 99": (lambda: raw_gguf(_valid_tensors(), version=99), "version 99"),
    "big endian": (lambda: raw_gguf(_valid_tensors(), version=3 << 24), "big-endian"),
    "short header": (lambda: b"GGUF\x03\0\0\0", "truncated"),
    "empty file": (lambda: b"", "truncated"),
    "absurd counts": (lambda: raw_gguf(_valid_tensors(), n_tensors=2**60), "more than"),
    "kv truncated": (lambda: raw_gguf([], kv=[("general.name", 8, _s("x" * 40))])[:-20],
                     "truncated"),
    "unknown kv type": (lambda: raw_gguf([], kv=[("k", 77, b"\0" * 8)]), "unknown value type"),
    "huge array": (lambda: raw_gguf([], kv=[("k", 9, struct.pack("<IQ", 4, 2**61))]),
                   "runs past the end"),
    "huge string": (lambda: raw_gguf([], kv=[("k", 8, struct.pack("<Q", 2**40))]),
                    "implausible|truncated"),
    "bad utf8 key": (lambda: raw_gguf([], kv=[(b"\xff\xfe", 4, b"\0" * 4)]), "UTF-8"),
    "duplicate key": (lambda: raw_gguf([], kv=[("k", 4, b"\0" * 4)] * 2), "duplicate"),
    "alignment not pow2": (lambda: raw_gguf([], kv=[("general.alignment", 4,
                                                     struct.pack("<I", 24))]), "power of two"),
    "alignment wrong type": (lambda: raw_gguf([], kv=[("general.alignment", 10,
                                                       struct.pack("<Q", 32))]), "uint32"),
    "unknown tensor type": (lambda: raw_gguf([("a", [8], 99, b"\0" * 32)]),
                            "'a' has unknown GGML type 99"),
    "zero dims": (lambda: raw_gguf([("a", [], 0, b"\0" * 32)]), "'a' has 0 dims"),
    "five dims": (lambda: raw_gguf([("a", [1] * 5, 0, b"\0" * 32)]), "'a' has 5 dims"),
    "empty dimension": (lambda: raw_gguf([("a", [8, 0], 0, b"")]), "empty dimension"),
    "q8_0 row not multiple of 32": (lambda: raw_gguf([("q", [48, 1], 8, b"\0" * 64)]),
                                    "'q' of type Q8_0 has row length 48"),
    "tensor data truncated": (lambda: raw_gguf(_valid_tensors())[:-40],
                              "'q' data .* beyond the end"),
    "offset beyond file": (lambda: raw_gguf(_valid_tensors(), offsets=[0, 1 << 40]),
                           "'q' data .* beyond the end"),
    "misaligned offset": (lambda: raw_gguf(_valid_tensors(), offsets=[0, 40]),
                          "'q' data offset 40 is not a multiple"),
    "overlapping tensors": (lambda: raw_gguf(_valid_tensors(), offsets=[0, 0]), "overlap"),
    # I8 tensors of 33 and 32 bytes at 0 and 32: one byte shared
    "overlapping by one byte": (lambda: raw_gguf([("a", [33], 24, bytes(range(33))),
                                                  ("b", [32], 24, bytes(32))], offsets=[0, 32]),
                                "'a' and 'b' overlap"),
    # more tensor infos than the file's bytes could describe (each takes at least 32 bytes),
    # though fewer than its bytes: refused by the header's count, not at the first empty info
    "counts beyond a small file": (lambda: raw_gguf([], kv=[("general.name", 8, _s("x" * 150))],
                                                    n_tensors=100),
                                   "header claims 100 tensors"),
    "duplicate tensor": (lambda: raw_gguf([f32_tensor("a", np.ones(8))] * 2),
                         "duplicate tensor 'a'"),
    "prefixed and bare": (lambda: raw_gguf([f32_tensor("a", np.ones(8)),
                                            f32_tensor(PREFIX + "a", np.ones(8))]),
                          "both with and without"),
    "dims product too large": (lambda: raw_gguf([("a", [2**30, 2**30], 0, b"")]),
                               "claims|beyond the end"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_file_named_cases(tmp_path, case):
    make, pattern = CASES[case]
    p = write_bytes(tmp_path, make())
    with pytest.raises(ModelFileError, match=pattern) as ei:
        GGUFFile(p)
    assert str(p) in str(ei.value)


def test_unsupported_type_fails_on_use_naming_the_tensor(tmp_path):
    data = bytes(144)  # one Q4_K block of 256 values
    p = write_bytes(tmp_path, raw_gguf([("k4", [256], 12, data), f32_tensor("a", np.ones(8))]))
    with GGUFFile(p) as g:
        np.testing.assert_array_equal(g.load_f32("a"), np.ones(8))
        with pytest.raises(ModelFileError, match="'k4' has type Q4_K"):
            g.load_f32("k4")
        with pytest.raises(ModelFileError, match="'k4' is Q4_K"):
            g.q8_0("k4")


def test_not_found_and_not_a_file(tmp_path):
    with pytest.raises(ModelFileError, match="not found"):
        GGUFFile(tmp_path / "nope.gguf")
    with pytest.raises(ModelFileError, match="not a regular file"):
        GGUFFile(tmp_path)


# ----------------------------------------------------------------------------- fuzzing

_SMALL = SyntheticSpec(variant="zimage", dim=64, n_heads=2, ffn_dim=128, n_layers=1,
                       adaln_in=64, n_caption=3, grid=(1, 2, 2), seed=9, include_weights=False)
_FUZZ_DIR = Path(tempfile.mkdtemp(prefix="nxhpc-fuzz-"))
atexit.register(shutil.rmtree, _FUZZ_DIR, True)


def _small_valid() -> bytes:
    d = _FUZZ_DIR / "src"
    if not d.exists():
        make_synthetic(d, _SMALL)
    return (d / "model.gguf").read_bytes()


def _open_everything(data: bytes) -> str:
    """Open bytes as a model and touch every layer; 'ok' or 'error' (ModelFileError only)."""
    fd, name = tempfile.mkstemp(suffix=".gguf", dir=_FUZZ_DIR)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        return open_and_decode_all(name)
    finally:
        os.unlink(name)


def _data_end(data: bytes) -> int:
    p = _FUZZ_DIR / "probe.gguf"
    p.write_bytes(data)
    with GGUFFile(p) as g:
        return max(g.info(n).offset + g.info(n).n_bytes for n in g.names())


def test_fuzz_truncation_at_every_header_length():
    data = _small_valid()
    end = _data_end(data)
    with GGUFFile(_FUZZ_DIR / "probe.gguf") as g:
        header_end = g.data_start
    lengths = list(range(0, header_end + 1)) + list(range(header_end, len(data), 997))
    for n in lengths:
        assert _open_everything(data[:n]) == "error", n
    assert _open_everything(data[:end]) == "ok"      # the trailing padding is optional
    assert _open_everything(data) == "ok"


def test_fuzz_flip_every_header_byte():
    data = _small_valid()
    with GGUFFile(_FUZZ_DIR / "probe.gguf") as g:
        header_end = g.data_start
    outcomes = [_open_everything(data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1:])
                for i in range(header_end)]
    # most header bytes are structural (lengths, counts, types, dims, offsets) ...
    assert outcomes.count("error") > header_end // 2
    # ... but not all: a flipped metadata value (the seed, a float) still opens. Negative
    # control that the validation is not simply rejecting every changed file.
    assert outcomes.count("ok") > 0


_HEADER_END = 2048  # about the small file's header size; half the positions land there


@settings(max_examples=1000)
@given(st.data())
def test_fuzz_random_corruption(data):
    src = _small_valid()
    n = data.draw(st.integers(1, 8), label="n_bytes")
    buf = bytearray(src)
    anywhere = st.integers(0, len(src) - 1)
    for _ in range(n):
        pos = data.draw(st.one_of(st.integers(0, _HEADER_END - 1), anywhere), label="pos")
        buf[pos] = data.draw(st.integers(0, 255), label="value")
    _open_everything(bytes(buf))


@settings(max_examples=300)
@given(st.integers(0, 10**6))
def test_fuzz_random_truncation(cut):
    src = _small_valid()
    n = cut % len(src)
    out = _open_everything(src[:n])
    if n < _data_end(src):
        assert out == "error"


def test_views_equal_the_gguf_readers_for_every_stored_type(tmp_path):
    """GGUFFile views tensors from its own scan; the gguf package's reader is the reference
    (same dtype, shape and bytes) for element types, BF16 and block quants, 1-D to 3-D."""
    rng = np.random.default_rng(7)
    path = tmp_path / "types.gguf"
    w = gguf.GGUFWriter(str(path), "test")
    qt = gguf.GGMLQuantizationType
    shapes = {"f32": ((3, 5), qt.F32), "f16": ((4, 64), qt.F16), "i32": ((7,), qt.I32),
              "bf16": ((2, 3, 32), qt.BF16), "q8_0": ((6, 64), qt.Q8_0),
              "q4_k": ((2, 256), qt.Q4_K), "q6_k": ((1, 512), qt.Q6_K)}
    for name, (shape, t) in shapes.items():
        if t == qt.I32:
            w.add_tensor(name, rng.integers(-9, 9, shape).astype(np.int32))
            continue
        x = rng.standard_normal(shape).astype(np.float32)
        if t in (qt.F32, qt.F16):
            w.add_tensor(name, x.astype(np.float16) if t == qt.F16 else x)
        else:  # stored bytes (only views are compared: random bytes will do)
            nbytes = gguf.quants.quant_shape_to_byte_shape(shape, t)
            w.add_tensor(name, rng.integers(0, 256, nbytes, dtype=np.uint8), raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ref = {t.name: t.data for t in gguf.GGUFReader(str(path), "r").tensors}
    with GGUFFile(path) as g:
        assert sorted(g.names()) == sorted(shapes)
        for name, r in ref.items():
            v = g.raw(name)
            assert (v.dtype, v.shape) == (r.dtype, r.shape), name
            assert np.array_equal(v.view(np.uint8), r.view(np.uint8)), name
            assert not v.flags.writeable
    with pytest.raises(ModelFileError, match="closed"):
        g.field("general.architecture")
