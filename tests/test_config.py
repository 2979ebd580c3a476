"""The config authority (nxhpc.dit.config) and the typed weight tensor (nxhpc.formats.weights).

Names, shapes and modulation per stack prefix are checked against docs/denoiser.md's table (13
tensors per modulated block, 11 for the context refiner, optional ``model.diffusion_model.``
prefix); geometry against the ``gguf`` package's table; every refusal names the tensor.
"""
import gguf
import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES

from nxhpc.dit import config as C
from nxhpc.dit.binding import LayerWeights, check_finite_weight
from nxhpc.dit.config import BlockConfig, check_stack, infer_config, tensor_names
from nxhpc.formats.gguf_io import GGUFFile, MissingTensorError, ModelFileError
from nxhpc.formats.weights import WeightTensor, as_weight_tensor, block_geometry, row_bytes
from nxhpc.models import open_model
from testutil import draw_layer_floats, stack_tensors, stored, weight, write_gguf_typed

CFG = BlockConfig(dim=128, n_heads=2, n_kv_heads=1, head_dim=64, ffn_dim=352, n_layers=2,
                  adaln_in=64, variant="zimage", adaln_silu=False)


# ----------------------------------------------------------------------------- names, shapes
def test_tensor_names_per_stack_match_denoiser_table():
    mod = tensor_names("noise_refiner", 3, "zimage")
    assert len(mod) == 13 and all(n.startswith("noise_refiner.3.") for n in mod.values())
    assert mod["adaln_w"] == "noise_refiner.3.adaLN_modulation.0.weight"
    cr = tensor_names("context_refiner", 1, "zimage")
    assert len(cr) == 11 and "adaln_w" not in cr and "adaln_b" not in cr
    assert set(cr.values()) == {n.replace("noise_refiner.3", "context_refiner.1")
                                for k, n in mod.items() if not k.startswith("adaln")}
    lum = tensor_names("layers", 0, "lumina2")
    assert lum["adaln_b"] == "layers.0.adaLN_modulation.1.bias"
    pre = CFG.tensor_names(2, model_prefix=True)
    assert pre["qkv"] == "model.diffusion_model.layers.2.attention.qkv.weight"
    assert CFG.tensor_names(0, "context_refiner", modulated=True)["adaln_w"] \
        == "context_refiner.0.adaLN_modulation.0.weight"
    with pytest.raises(ValueError, match="unknown block stack prefix 'final_layer'"):
        tensor_names("final_layer", 0, "zimage")


def test_shapes_and_qkv_width():
    assert CFG.qkv_width == (2 + 2 * 1) * 64
    s = CFG.shapes()
    assert s["qkv"] == (256, 128) and s["out"] == (128, 128) and s["w2"] == (128, 352)
    assert s["adaln_w"] == (512, 64) and s["q_norm"] == (64,)
    assert set(CFG.shapes(modulated=False)) == set(s) - {"adaln_w", "adaln_b"}


@pytest.mark.parametrize("field, value, pattern", [
    ("n_heads", 3, r"n_heads\*head_dim = 192 != dim 128"),
    ("n_kv_heads", 3, "not a multiple of n_kv_heads"),
    ("ffn_dim", 350, "ffn_dim 350 is not a multiple of 32"),
    ("head_dim", 63, "n_heads"),
    ("variant", "sd3", "variant 'sd3'"),
    ("norm_eps", 0.0, "norm_eps"),
    ("dim", 0, "positive"),
])
def test_validate_names_the_rule(field, value, pattern):
    import dataclasses
    with pytest.raises(ValueError, match=pattern):
        dataclasses.replace(CFG, **{field: value}).validate()


def test_check_layer_names_the_tensor():
    rng = np.random.default_rng(0)
    f = draw_layer_floats(rng, CFG)
    vals = {k: (weight(k, a, "Q8_0") if a.ndim == 2 else a) for k, a in f.items()}
    lw = LayerWeights(**vals)
    CFG.check_layer(lw)
    q4 = LayerWeights(**{**vals, "w3": weight("layers.0.feed_forward.w3.weight", f["w3"],
                                              "Q4_0")})
    CFG.check_layer(q4)                      # Q4_0 is runnable (issue 10)
    rows, cols = f["w3"].shape               # IQ4_NL is not: refused, naming the tensor
    iq4 = LayerWeights(**{**vals, "w3": WeightTensor.from_raw(
        "layers.0.feed_forward.w3.weight", "IQ4_NL", cols, np.zeros((rows, cols // 32 * 18),
                                                                    np.uint8))})
    with pytest.raises(ValueError, match="layer 0: weight 'w3' has type IQ4_NL.*"
                                         "layers.0.feed_forward.w3.weight"):
        CFG.check_layer(iq4)
    wrong = LayerWeights(**{**vals, "out": weight("o", f["w1"], "BF16")})
    with pytest.raises(ValueError, match=r"weight 'out' must be BF16 uint8 \(128, 256\) "
                                         r"\(torch shape \[128, 128\]\)"):
        CFG.check_layer(wrong)
    with pytest.raises(ValueError, match="weight 'q_norm' must be float32"):
        CFG.check_layer(LayerWeights(**{**vals, "q_norm": f["q_norm"][:3]}))
    unmod = LayerWeights(**{k: v for k, v in vals.items() if not k.startswith("adaln")})
    CFG.check_layer(unmod, "context_refiner.0")
    with pytest.raises(ValueError, match="unmodulated block has no adaLN"):
        CFG.check_layer(lw, "context_refiner.0", modulated=False)


# ----------------------------------------------------------------------------- weight tensor
def test_weight_tensor_geometry_from_gguf():
    for name in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q6_K"):
        qt = gguf.GGMLQuantizationType[name]
        assert block_geometry(name) == block_geometry(int(qt)) == GGML_QUANT_SIZES[qt]
    assert row_bytes("Q8_0", 64) == 68 and row_bytes("BF16", 10) == 20
    # a K-quant row must fill whole 256-value blocks, and the error names the tensor
    with pytest.raises(ValueError, match="'layers.0.w1' .*Q4_K.* 384 values .* blocks of 256"):
        WeightTensor.from_raw("layers.0.w1", "Q4_K", 384, np.zeros((2, 216), np.uint8))
    with pytest.raises(ValueError, match=r"'x' \(Q8_0 \[2, 64\]\): data must be uint8 "
                                         r"\(2, 68\), got \(2, 34\)"):
        WeightTensor("x", 8, (2, 64), np.zeros((2, 34), np.uint8))
    with pytest.raises(ValueError, match="unknown GGML type 'Q9'"):
        row_bytes("Q9", 32)


def test_weight_tensor_zero_copy_and_legacy_arrays():
    rng = np.random.default_rng(1)
    a = rng.standard_normal((4, 64)).astype(np.float32)
    w = WeightTensor.from_array("a", a)
    assert w.type_name == "F32" and np.shares_memory(w.data, a) and w.rowbytes == 256
    np.testing.assert_array_equal(w.dequantize(), a)
    q = gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0)
    lq = as_weight_tensor(q, "q")
    assert lq.type_name == "Q8_0" and lq.shape == (4, 64) and np.shares_memory(lq.data, q)
    assert as_weight_tensor(lq, "other") is lq
    with pytest.raises(ValueError, match="read as Q8_0 rows of 34-byte blocks; got 33"):
        as_weight_tensor(np.zeros((4, 33), np.uint8), "bad")
    with pytest.raises(TypeError, match="expected a WeightTensor"):
        as_weight_tensor([[1.0]], "lst")


@pytest.mark.parametrize("tname, bad", [("F32", np.float32(np.inf)), ("F16", np.float16(np.nan)),
                                        ("BF16", np.float32(-np.inf)), ("Q8_0", None)])
def test_non_finite_stored_values_are_found(tname, bad):
    rng = np.random.default_rng(2)
    a = rng.standard_normal((300, 64)).astype(np.float32)
    raw = np.ascontiguousarray(stored(a, tname)).view(np.uint8).copy()
    w = WeightTensor.from_raw("m", tname, 64, raw)
    check_finite_weight(w, "ok")                                   # finite: no error
    if tname == "Q8_0":
        raw[299, 34:36] = np.frombuffer(np.float16(np.inf).tobytes(), np.uint8)
    elif tname == "BF16":
        raw[299, 6:8] = np.frombuffer(np.float32(bad).tobytes()[2:], np.uint8)
    else:
        raw[299, :bad.itemsize] = np.frombuffer(bad.tobytes(), np.uint8)
    with pytest.raises(ModelFileError, match="where: 1 "):
        check_finite_weight(w, "where")


# ----------------------------------------------------------------------------- files, stacks
def _denoiser_like(tmp_path, drop=(), prefix=""):
    rng = np.random.default_rng(3)
    t = {}
    for p, n in (("layers", 2), ("noise_refiner", 2), ("context_refiner", 2)):
        t.update(stack_tensors(rng, CFG, p, n))
    for n in drop:
        del t[n]
    types = {n: "Q8_0" for n, a in t.items() if a.ndim == 2}
    return write_gguf_typed(tmp_path / "d.gguf", t, types, prefix=prefix)


@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."])
def test_refiners_bind_from_a_file(tmp_path, prefix):
    p = _denoiser_like(tmp_path, prefix=prefix)
    with open_model(p) as m:
        assert m.config.block == CFG and m.config.stacks["context_refiner"] == 2
        assert [m.stack_size(s) for s in ("layers", "noise_refiner", "context_refiner")] \
            == [2, 2, 2]
        cr = m.layer_weights(1, prefix="context_refiner")
        assert not cr.modulated and cr.adaln_b is None and cr.label == "context_refiner.1"
        nr = m.layer_weights(0, prefix="noise_refiner")
        assert nr.modulated and nr.adaln_w.name == "noise_refiner.0.adaLN_modulation.0.weight"
        assert cr.qkv.name == "context_refiner.1.attention.qkv.weight"
        with pytest.raises(IndexError, match="context_refiner index 2 out of range"):
            m.layer_weights(2, prefix="context_refiner")


def test_missing_refiner_tensor_is_named(tmp_path):
    p = _denoiser_like(tmp_path, drop=["context_refiner.1.ffn_norm2.weight"])
    with open_model(p) as m:                      # the main layers are complete
        m.layer_weights(0)
        with pytest.raises(MissingTensorError, match="'context_refiner.1.ffn_norm2.weight'"):
            m.layer_weights(0, prefix="context_refiner")


@pytest.fixture(scope="module")
def denoiser_shapes(tmp_path_factory):
    with GGUFFile(_denoiser_like(tmp_path_factory.mktemp("den"))) as g:
        return {n: (g.shape(n), g.type_name(n)) for n in g.names()}


def test_check_stack_uses_each_types_geometry(denoiser_shapes):
    """A type with 256-value blocks (a K-quant, once runnable) refuses rows of 352 values,
    naming the tensor; with the runnable types the same stack passes."""
    shapes = dict(denoiser_shapes)
    check_stack(shapes, CFG, "layers", 2, "f")
    k = "layers.1.feed_forward.w3.weight"
    shapes[k] = (shapes[k][0], "IQ4_XS")       # a type without kernels: refused, named
    with pytest.raises(ModelFileError, match=f"'{k}' has type IQ4_XS"):
        check_stack(shapes, CFG, "layers", 2, "f")
    assert "Q4_K" in C.RUNNABLE_TYPES           # runnable since issue 10
    shapes[k] = (shapes[k][0], "Q4_K")
    with pytest.raises(ModelFileError, match=f"'{k}': a Q4_K row of 128 values"):
        check_stack(shapes, CFG, "layers", 2, "f")
    k2 = "layers.0.feed_forward.w2.weight"          # 352 inputs: not whole 256-blocks
    shapes[k], shapes[k2] = (shapes[k][0], "Q8_0"), (shapes[k2][0], "Q4_K")
    with pytest.raises(ModelFileError, match=f"'{k2}': a Q4_K row of 352 values"):
        check_stack(shapes, CFG, "layers", 2, "f")


def test_infer_config_reports_and_checks_every_layer(denoiser_shapes):
    with pytest.raises(MissingTensorError, match="no main-layer tensors"):
        infer_config({}, "w")
    shapes = denoiser_shapes
    cfg, report = infer_config(shapes, "w")
    assert cfg.block == CFG and not cfg.whole and "GQA" in report["n_kv_heads"]
    bad = dict(shapes)
    bad["layers.1.attention.out.weight"] = ((128, 128), "IQ4_NL")     # no kernels for it
    with pytest.raises(ModelFileError, match="'layers.1.attention.out.weight' has type IQ4_NL"):
        infer_config(bad, "w")
