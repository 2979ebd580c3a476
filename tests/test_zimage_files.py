"""Z-Image GGUF layouts (nxhpc.models.zimage_files): per-tensor types, names, exact read-back.

Independent checks: BF16 against torch's bfloat16 rounding (round to nearest even), Q8_0
against its definition (per 32-value block, scale d = amax/127 stored as float16, q = round(x/d):
|error| <= d/2 + 127 * (float16 rounding of d)), F32 bit-exact; the file's tensor table and metadata read back by
``gguf.GGUFReader``.
"""
from __future__ import annotations

import re

import gguf
import numpy as np
import pytest

from nxhpc.dit.config import PREFIX, DenoiserConfig
from nxhpc.formats.layouts import LAYOUTS as ALL_LAYOUTS
from nxhpc.formats.layouts import FileLayout, get_layout
from nxhpc.formats.layouts import Rule as TypeRule
from nxhpc.models.zimage_files import read_zimage_gguf, write_zimage_gguf

LAYOUTS = ("comfyui-q8_0", "sdcpp-q8_0")          # the two converters' layouts
COMFYUI_Q8_0, SDCPP_Q8_0 = (ALL_LAYOUTS[n] for n in LAYOUTS)

CFG = DenoiserConfig(dim=384, n_heads=6, n_kv_heads=6, head_dim=64, ffn_dim=1024, n_layers=2,
                     n_noise_refiner=2, n_context_refiner=2, in_channels=16, patch=2,
                     cap_dim=320)


@pytest.fixture(scope="module")
def weights():
    rng = np.random.default_rng(0)
    return {n: (rng.standard_normal(s) * 0.05).astype(np.float64) for n, s in
            CFG.tensor_shapes(norm_final=True).items()}


@pytest.fixture(scope="module")
def files(weights, tmp_path_factory):
    d = tmp_path_factory.mktemp("zf")
    return {lay: read_zimage_gguf(write_zimage_gguf(d / f"{lay}.gguf", weights, lay))
            for lay in LAYOUTS}


def _expected_type(layout: str, name: str, ndim: int) -> str:
    block = re.match(r"(layers|noise_refiner|context_refiner)\.", name)
    if layout == "comfyui-q8_0":
        if name.startswith("layers.") and ndim == 2:
            return "Q8_0"
        return "F32" if ndim == 1 else "BF16"
    return "Q8_0" if block and ndim == 2 else "F32"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_types_names_and_metadata(files, layout):
    f = files[layout]
    assert len(f.tensors) == len(CFG.tensor_shapes()) + 1        # norm_final written too
    for name, stored in zip(f.tensors, f.stored_names):
        shape, t = f.tensors[name]
        assert t == _expected_type(layout, name, len(shape)), name
        assert stored == (PREFIX + name if layout == "sdcpp-q8_0" else name)
    pad = f.tensors["x_pad_token"]
    if layout == "comfyui-q8_0":
        assert pad == ((1, CFG.dim), "BF16")
        assert f.metadata.get("general.architecture") == "lumina2"
        assert f.type_counts() == {"Q8_0": 12, "BF16": 30, "F32": 48}
    else:
        assert pad == ((CFG.dim,), "F32")
        assert "general.architecture" not in f.metadata
        assert f.type_counts() == {"Q8_0": 34, "F32": 56}


def test_real_dimension_type_counts():
    # the policies applied to the real 453-tensor model (no data written)
    shapes = DenoiserConfig.zimage().tensor_shapes()
    for lay, want in ((COMFYUI_Q8_0, {"Q8_0": 180, "BF16": 30, "F32": 243}),
                      (SDCPP_Q8_0, {"Q8_0": 202, "F32": 251})):
        got: dict[str, int] = {}
        for n, s in shapes.items():
            t = lay.type_for(n, lay.stored_shape(n, s))
            got[t] = got.get(t, 0) + 1
        assert got == want, lay.name


@pytest.mark.parametrize("layout", LAYOUTS)
def test_read_back_is_the_exact_decoding(files, weights, layout):
    import torch
    f = files[layout]
    for name, a in weights.items():
        got = f.weights[name].reshape(a.shape)
        t = f.tensors[name][1]
        a32 = a.astype(np.float32)
        if t == "F32":
            np.testing.assert_array_equal(got, a32.astype(np.float64), err_msg=name)
        elif t == "BF16":
            want = torch.from_numpy(a32).to(torch.bfloat16).double().numpy()
            np.testing.assert_array_equal(got, want, err_msg=name)
        else:
            assert t == "Q8_0"
            blocks = a32.reshape(-1, 32)
            d = np.abs(blocks).max(axis=1, keepdims=True) / 127
            err = np.abs(got.reshape(-1, 32) - blocks)
            # q = round(x / d) with the exact d, value = q * f16(d): |err| <= d/2 + 127 |d -
            # f16(d)| <= d (1/2 + 127 * 2^-11) (float16 rounding: half an ulp, 2^-11 relative)
            assert (err <= d * (0.5 + 127 * 2.0 ** -11) * (1 + 1e-6)).all(), name
            assert (err > 0).any(), name                  # really quantized
            # and the file holds exactly what gguf's quantizer produces
            q = gguf.quants.quantize(a32, gguf.GGMLQuantizationType.Q8_0)
            np.testing.assert_array_equal(
                got, gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0), err_msg=name)


def test_policy_table_extends():
    lay = FileLayout("test-q4_0", "", "lumina2", "D",
                     rules=(TypeRule(r"layers\.\d+\.attention\.qkv\.weight", 2, "Q8_0"),
                            TypeRule(r"layers\.\d+\..+", 2, "Q4_K", fallback="Q4_0"),
                            TypeRule(r".+", None, "F32")))
    assert lay.type_for("layers.3.attention.qkv.weight", (1152, 384)) == "Q8_0"
    assert lay.type_for("layers.3.feed_forward.w2.weight", (384, 1024)) == "Q4_K"
    assert lay.type_for("layers.3.feed_forward.w1.weight", (1024, 384)) == "Q4_0"  # 384 % 256
    assert lay.type_for("x_pad_token", (384,)) == "F32"
    with pytest.raises(ValueError, match="'layers.0.out' .* block 32"):
        COMFYUI_Q8_0.type_for("layers.0.out", (384, 100))
    with pytest.raises(ValueError, match="unknown file layout 'q5'"):
        get_layout("q5")


def test_write_refuses_bad_weights(tmp_path, weights):
    with pytest.raises(ValueError, match="'x_embedder.bias' contains NaN"):
        write_zimage_gguf(tmp_path / "a.gguf", {**weights, "x_embedder.bias":
                                                np.full(CFG.dim, np.nan)}, "sdcpp-q8_0")
    # K-quants are encoded by nxhpc's own encoders; a type no encoder has is refused by name
    with pytest.raises(ValueError, match="can quantize to IQ2_XXS .*'layers.0.feed_forward"):
        lay = FileLayout("k", "", "x", "D", (TypeRule(r".+", None, "IQ2_XXS", "F32"),))
        write_zimage_gguf(tmp_path / "b.gguf", {"layers.0.feed_forward.w2.weight":
                                                weights["layers.0.feed_forward.w2.weight"]}, lay)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_nxhpc_reader_sees_the_same_file(files, layout):
    # nxhpc's own validated reader (what the denoiser loader uses) agrees with the gguf
    # package on every name, shape, type and decoded value of both layouts
    from nxhpc.dit.config import infer_config
    from nxhpc.formats.gguf_io import GGUFFile
    f = files[layout]
    with GGUFFile(f.path) as g:
        table = {n: (tuple(g.shape(n)), g.type_name(n)) for n in g.names()}
        assert table == f.tensors
        assert infer_config(table, whole=True)[0] == CFG
        for n in g.names():
            np.testing.assert_array_equal(g.load_f32(n).astype(np.float64), f.weights[n],
                                          err_msg=n)
