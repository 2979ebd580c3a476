"""Mixed-type model files (issue 10): ``models make --types POLICY``, ``models show``'s type
counts, a whole block run on a Q4_K_M-style file, and fuzzing of the new block types in files.

Owns: the policies' per-tensor types (nxhpc.formats.layouts) checked on the written files
through the gguf package's reader (independent of nxhpc's); that the stored float64 reference
is the float64 oracle on exactly ``gguf.quants.dequantize`` of the file's tensors; the block on
such a file graded against it with blockrun's default tolerance (the one Q8_0 models use) and
bit-identical for 1/2/3 workers and for the fixture weights; malformed K-quant/legacy tensors ->
ModelFileError naming file and tensor. Must not: take expected types or values from the code
under test (types come from the policy text in the docstring of nxhpc.formats.layouts, written out here).
"""
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_gguf_io import raw_gguf, write_bytes
from testutil import open_and_decode_all

from nxhpc.dit.config import tensor_names
from nxhpc.dit.reference import adaln_f64, block_forward_f64, dequantize_layer
from nxhpc.formats.gguf_io import GGUFFile, ModelFileError
from nxhpc.models import SyntheticSpec, make_synthetic, open_model
from nxhpc.formats.layouts import POLICY_NAMES as POLICIES
from nxhpc.formats.layouts import get_layout


def tensor_type(policy, name, shape):
    return get_layout(policy, policy=True).type_for(name, shape)

ROOT = Path(__file__).resolve().parents[1]
GT = gguf.GGMLQuantizationType
# D = 256 and F = 768: every matrix fills 256-blocks, so Q4_K_M's K-quants apply as named.
SPEC = SyntheticSpec(variant="zimage", dim=256, n_heads=2, ffn_dim=768, n_layers=2,
                     n_caption=5, grid=(1, 2, 4), seed=5, types="q4_k_m", include_weights=True)


def gguf_types(path):
    """{canonical name: type name} read by gguf.GGUFReader."""
    r = gguf.GGUFReader(os.fspath(path), "r")
    return {t.name.removeprefix("model.diffusion_model."): t.tensor_type.name for t in r.tensors}


@pytest.fixture(scope="module")
def qkm(tmp_path_factory):
    return make_synthetic(tmp_path_factory.mktemp("qkm") / "m", SPEC)


# ----------------------------------------------------------------------------- policies

def test_policy_types_and_fallbacks():
    t = tensor_type
    L = "layers.3."
    # Q4_K_M: qkv Q5_K, w2 Q6_K, other main-layer matrices Q4_K, other 2-D BF16, 1-D F32
    assert t("q4_k_m", L + "attention.qkv.weight", (768, 256)) == "Q5_K"
    assert t("q4_k_m", L + "feed_forward.w2.weight", (256, 768)) == "Q6_K"
    for k in ("attention.out.weight", "feed_forward.w1.weight", "adaLN_modulation.0.weight"):
        assert t("q4_k_m", L + k, (256, 256)) == "Q4_K", k
    assert t("q4_k_m", "noise_refiner.0.attention.qkv.weight", (768, 256)) == "BF16"
    assert t("q4_k_m", "final_layer.linear.weight", (64, 256)) == "BF16"
    assert t("q4_k_m", L + "attention.q_norm.weight", (128,)) == "F32"
    # rows that do not fill 256-blocks: llama.cpp's fallbacks
    assert t("q4_k_m", L + "attention.qkv.weight", (1152, 384)) == "Q5_1"
    assert t("q4_k_m", L + "attention.out.weight", (384, 384)) == "Q5_0"
    assert t("q4_k_m", L + "feed_forward.w2.weight", (384, 1056)) == "Q8_0"
    assert t("q3_k", L + "attention.out.weight", (384, 384)) == "Q4_0"
    assert t("q4_0", L + "attention.out.weight", (8, 40)) == "F32"        # no 32-blocks
    # the fallback follows the row length (the second dim), whatever the row count: rows of 96
    # or 384 cannot be Q4_K even when the count is a multiple of 256
    assert t("q4_k_m", L + "feed_forward.w1.weight", (256, 96)) == "Q5_0"
    assert t("q4_k_m", L + "feed_forward.w1.weight", (512, 384)) == "Q5_0"
    assert t("q4_k_m", L + "feed_forward.w1.weight", (96, 256)) == "Q4_K"
    # sdcpp Q4_0: layers + refiners Q4_0, their adaLN Q8_0, the rest F32
    assert t("sdcpp-q4_0", L + "feed_forward.w3.weight", (768, 256)) == "Q4_0"
    assert t("sdcpp-q4_0", "context_refiner.1.attention.out.weight", (256, 256)) == "Q4_0"
    assert t("sdcpp-q4_0", L + "adaLN_modulation.0.weight", (1024, 256)) == "Q8_0"
    assert t("sdcpp-q4_0", "x_embedder.weight", (256, 64)) == "F32"
    for single in ("q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k",
                   "q8_0", "bf16", "f16"):
        assert t(single, L + "attention.out.weight", (256, 256)) == single.upper()
        assert t(single, L + "attention.k_norm.weight", (128,)) == "F32"
    with pytest.raises(ValueError, match="unknown --types policy 'q4_k_x'"):
        t("q4_k_x", L + "attention.out.weight", (256, 256))
    assert {"q4_k_m", "sdcpp-q4_0", "q8_0"} <= set(POLICIES)


def test_q8_0_policy_is_todays_file(tmp_path):
    """The default policy writes the same bytes as a spec that never names one, with the same
    fingerprint (built-in directories stay current)."""
    small = SyntheticSpec(dim=64, n_heads=2, ffn_dim=128, n_layers=1, adaln_in=64,
                          n_caption=3, grid=(1, 2, 2), seed=3)
    import dataclasses
    named = dataclasses.replace(small, types="q8_0")
    assert named.fingerprint() == small.fingerprint()
    assert dataclasses.replace(small, types="q4_0").fingerprint() != small.fingerprint()
    a, b = make_synthetic(tmp_path / "a", small), make_synthetic(tmp_path / "b", named)
    assert (a / "model.gguf").read_bytes() == (b / "model.gguf").read_bytes()


# ----------------------------------------------------------------------------- the file

def test_q4_k_m_file_types_and_exact_reference(qkm):
    types = gguf_types(qkm / "model.gguf")
    want = {}
    for i in range(SPEC.n_layers):
        p = f"layers.{i}."
        want |= {p + "attention.qkv.weight": "Q5_K", p + "feed_forward.w2.weight": "Q6_K",
                 **{p + k: "Q4_K" for k in ("attention.out.weight", "feed_forward.w1.weight",
                                            "feed_forward.w3.weight",
                                            "adaLN_modulation.0.weight")}}
    for n, tname in types.items():
        assert tname == want.get(n, "F32"), n
    assert len(want) == 12 and sum(v != "F32" for v in types.values()) == 12
    # fixture weights are the file's values exactly; the reference is the float64 oracle on them
    from safetensors.numpy import load_file
    fx = load_file(qkm / "fixtures.safetensors")
    r = gguf.GGUFReader(os.fspath(qkm / "model.gguf"), "r")
    w = {}
    for t in r.tensors:
        n = t.name.removeprefix("model.diffusion_model.")
        v = np.asarray(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type), np.float32)
        v = v.reshape(fx[n].shape)
        assert np.array_equal(fx[n], v), n
        w[n] = v.astype(np.float64)
    with open_model(qkm) as m:
        cfg = m.config
        for i in range(SPEC.n_layers):
            lw = dequantize_layer(m.layer_weights(i))
            for k, name in tensor_names("layers", i, cfg.variant).items():   # the loader's values
                assert np.array_equal(lw[k], w[name].reshape(lw[k].shape)), (i, k)
            mod = adaln_f64(fx["t_emb"], lw["adaln_w"], lw["adaln_b"], silu=cfg.adaln_silu)
            ref = block_forward_f64(fx[f"layers.{i}.blk_in"], lw, cfg, adaln_m=mod, pe=fx["pe"])
            assert np.array_equal(ref.astype(np.float32), fx[f"layers.{i}.ref_out"]), i


def test_show_lists_type_counts(qkm):
    r = subprocess.run([sys.executable, "-m", "nxhpc.models", "show", str(qkm)],
                       capture_output=True, text=True, cwd=ROOT, check=True)
    counts = {}
    for t in gguf_types(qkm / "model.gguf").values():
        counts[t] = counts.get(t, 0) + 1
    line = ", ".join(f"{t} {n}" for t, n in sorted(counts.items()))
    assert line == "F32 14, Q4_K 8, Q5_K 2, Q6_K 2"
    assert f"({line})" in r.stdout, r.stdout


# ----------------------------------------------------------------------------- running it

def test_block_on_q4_k_m_file_passes_and_is_worker_invariant(qkm):
    """Graded as Q8_0 models are (blockrun's default tolerance), bit-identical for 1/2/3
    workers and for the fixture weights (F32, the same values)."""
    from nxhpc.dit.grade import grade
    from nxhpc.blockrun import DEFAULT_TOL
    outs = []
    with open_model(qkm) as m:
        x, t, pe = m.blk_in(0), m.t_emb(), m.pe()
        for w in (1, 2, 3):
            outs.append(m.block(0).forward(x, t, pe, workers=w)[0])
        ref = m.fixtures.load("layers.0.ref_out")
    for o in outs[1:]:
        assert np.array_equal(o, outs[0])
    g = grade(outs[0], ref, tol=DEFAULT_TOL)
    assert g.passed, g.why
    # the kernels on stored K-quant bytes match the float64 oracle far inside the tolerance
    assert np.max(np.abs(outs[0] - ref)) / np.max(np.abs(ref)) < 1e-4
    r = subprocess.run([sys.executable, "-m", "nxhpc.blockrun", str(qkm), "2", "--layers", "all",
                        "--source", "fixtures"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.rstrip().splitlines()[-1].startswith("PASS"), r.stdout


def test_sdcpp_q4_0_file_runs(tmp_path):
    import dataclasses
    spec = dataclasses.replace(SPEC, types="sdcpp-q4_0", n_layers=1, include_weights=False)
    d = make_synthetic(tmp_path / "sd", spec)
    types = gguf_types(d / "model.gguf")
    assert sorted(set(types.values())) == ["F32", "Q4_0", "Q8_0"]
    assert types["layers.0.adaLN_modulation.0.weight"] == "Q8_0"
    r = subprocess.run([sys.executable, "-m", "nxhpc.blockrun", str(d), "2"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.rstrip().splitlines()[-1].startswith("PASS"), r.stdout


# ----------------------------------------------------------------------------- fuzzing

@pytest.mark.parametrize("gtype, ne0, msg", [
    (12, 384, "'w' of type Q4_K has row length 384, not a multiple of its block size 256"),
    (14, 100, "'w' of type Q6_K has row length 100"),
    (6, 48, "'w' of type Q5_0 has row length 48, not a multiple of its block size 32"),
    (3, 33, "'w' of type Q4_1 has row length 33"),
])
def test_impossible_row_lengths(tmp_path, gtype, ne0, msg):
    p = write_bytes(tmp_path, raw_gguf([("w", [ne0, 2], gtype, b"\0" * 1024)]))
    with pytest.raises(ModelFileError, match=msg) as ei:
        GGUFFile(p)
    assert str(p) in str(ei.value)


@pytest.mark.parametrize("gtype, nbytes", [(12, 144), (13, 176), (14, 210), (10, 84),
                                           (11, 110), (2, 18), (7, 24)])
def test_truncated_block_tensor(tmp_path, gtype, nbytes):
    """Two rows of whole blocks, data one block short: named, never read past the end."""
    elems = 256 if gtype >= 10 else 32
    data = b"\0" * (2 * nbytes - nbytes)
    p = write_bytes(tmp_path, raw_gguf([("w", [elems, 2], gtype, data)], pad_data=False))
    with pytest.raises(ModelFileError, match="'w' data .* beyond the end") as ei:
        GGUFFile(p)
    assert str(p) in str(ei.value)


def test_fuzz_truncating_a_q4_k_m_file(qkm, tmp_path):
    data = (qkm / "model.gguf").read_bytes()
    with GGUFFile(qkm / "model.gguf") as g:
        end = max(g.info(n).offset + g.info(n).n_bytes for n in g.names())
    p = tmp_path / "t.gguf"
    for n in list(range(0, len(data), max(1, len(data) // 97))) + [end - 1]:
        p.write_bytes(data[:n])
        assert open_and_decode_all(p) == "error", n
    p.write_bytes(data[:end])
    assert open_and_decode_all(p) == "ok"


@settings(max_examples=150)
@given(st.data())
def test_fuzz_corrupting_a_q4_k_m_file(qkm, tmp_path_factory, data):
    """Random bytes anywhere (header, K-quant scales, codes): ModelFileError or a clean open,
    never another exception or a crash. A NaN/inf float16 scale is one of the errors."""
    src = (qkm / "model.gguf").read_bytes()
    buf = bytearray(src)
    for _ in range(data.draw(st.integers(1, 6), label="n")):
        pos = data.draw(st.one_of(st.integers(0, 4095), st.integers(0, len(src) - 1)))
        buf[pos] = data.draw(st.integers(0, 255))
    p = tmp_path_factory.mktemp("fz") / "c.gguf"
    p.write_bytes(bytes(buf))
    open_and_decode_all(p)


def test_nan_scale_in_a_k_quant_block_is_named(qkm, tmp_path):
    """A Q4_K block whose float16 d is NaN: ModelFileError naming the tensor (negative control
    for the fuzz test above: the check does fire on the new block types)."""
    with GGUFFile(qkm / "model.gguf") as g:
        name = next(n for n in g.names() if g.type_name(n) == "Q4_K")
        off = g.info(name).offset
    buf = bytearray((qkm / "model.gguf").read_bytes())
    buf[off:off + 2] = np.array([0x7e00], "<u2").tobytes()      # block 0's d = NaN
    p = tmp_path / "nan.gguf"
    p.write_bytes(bytes(buf))
    with pytest.raises(ModelFileError, match=f"{name}.*Q4_K blocks have a NaN/Inf scale"):
        with open_model(p) as m:
            for i in range(m.config.n_layers):
                m.layer_weights(i)
