"""Z-Image denoiser config inference (nxhpc.dit.config) from tensor tables.

Tables come from files written by ``nxhpc.models.zimage_files`` in both published layouts
(read back by the ``gguf`` package), and from the real Z-Image dimensions, whose tensor and
parameter counts are checked against the numbers published in docs/denoiser.md (453 tensors,
6,154,908,736 parameters). Every bad table must raise the formats' ModelFileError (or its
MissingTensorError) naming the tensor, in the message and in its ``tensor`` attribute.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from nxhpc.dit.config import PREFIX, DenoiserConfig, infer_config
from nxhpc.formats.gguf_io import MissingTensorError, ModelFileError


def infer_denoiser_config(tensors, **kw):
    """The whole-denoiser form of the one inference (as ``nxhpc.dit.denoiser.Denoiser``
    calls it)."""
    kw.setdefault("where", "tensors")
    where = kw.pop("where")
    norm_eps = kw.pop("norm_eps", None)
    return infer_config(tensors, where, norm_eps, whole=True, **kw)[0]

SMALL = dict(dim=384, n_heads=6, n_kv_heads=6, head_dim=64, ffn_dim=1024, n_layers=2,
             n_noise_refiner=2, n_context_refiner=2, in_channels=16, patch=2, cap_dim=320)


@pytest.fixture(scope="module")
def cfg() -> DenoiserConfig:
    return DenoiserConfig(**SMALL)


@pytest.fixture(scope="module")
def file_tables(cfg, tmp_path_factory):
    """Tensor tables of random-weight files in both layouts, as the gguf reader reports them
    (comfyui: pad tokens [1, D] BF16, no prefix; sdcpp: prefixed names, pad tokens [D])."""
    from nxhpc.models.zimage_files import read_zimage_gguf, write_zimage_gguf
    rng = np.random.default_rng(0)
    w = {n: rng.standard_normal(s).astype(np.float32) * 0.1 for n, s in
         cfg.tensor_shapes().items()}
    out = {}
    d = tmp_path_factory.mktemp("cfg")
    for lay in ("comfyui-q8_0", "sdcpp-q8_0"):
        f = read_zimage_gguf(write_zimage_gguf(d / f"{lay}.gguf", w, lay))
        out[lay] = ({s: f.tensors[n] for n, s in zip(f.tensors, f.stored_names)}, f)
    return out


def table(cfg, gtype="F32", **kw):
    return {n: (s, gtype) for n, s in cfg.tensor_shapes(**kw).items()}


# ----------------------------------------------------------------------------- good tables

@pytest.mark.parametrize("layout", ["comfyui-q8_0", "sdcpp-q8_0"])
def test_infers_config_from_both_layouts(cfg, file_tables, layout):
    stored, f = file_tables[layout]
    if layout == "sdcpp-q8_0":
        assert all(n.startswith(PREFIX) for n in stored)
        assert f.tensors["x_pad_token"][0] == (cfg.dim,)
    else:
        assert not any(n.startswith(PREFIX) for n in stored)
        assert f.tensors["x_pad_token"] == ((1, cfg.dim), "BF16")
    assert infer_denoiser_config(stored) == cfg          # names as stored (prefix stripped)
    assert infer_denoiser_config(f.tensors) == cfg       # names stripped by the caller


def test_real_zimage_dimensions_match_published_counts():
    real = DenoiserConfig.zimage()
    shapes = real.tensor_shapes()
    assert len(shapes) == 453                             # docs/denoiser.md
    assert real.n_params() == 6_154_908_736               # docs/denoiser.md
    assert real.axes_dims == (32, 48, 48)
    assert real.ffn_dim == int(3840 / 3 * 8)
    got = infer_denoiser_config({PREFIX + n: v for n, v in table(real).items()})
    assert got == real
    assert infer_denoiser_config(table(real, norm_final=True)) == real
    assert len(real.tensor_shapes(norm_final=True)) == 454


def test_optional_tensor_and_pad_shapes(cfg):
    t = table(cfg, norm_final=True)
    t["x_pad_token"] = ((cfg.dim,), "F32")
    assert infer_denoiser_config(t) == cfg
    t = table(cfg)
    t["cap_pad_token"] = ((1, cfg.dim), "BF16")
    assert infer_denoiser_config(t) == cfg


def test_declared_counts_and_gqa(cfg):
    assert infer_denoiser_config(table(cfg), n_layers=2, n_refiner=2) == cfg
    gqa = dataclasses.replace(cfg, n_kv_heads=2)
    got = infer_denoiser_config(table(gqa))
    assert got.n_kv_heads == 2 and got.qkv_width == (6 + 4) * 64
    with pytest.raises(ValueError, match="GQA"):
        got.diffusers_kwargs()


def test_patch_resolves_ambiguity(cfg):
    # x_embedder [D, 64] is 2x2x16 with patch 2 and 1x1x64 with patch 1: the caller decides
    t = table(cfg)
    c1 = infer_denoiser_config({**t, "final_layer.linear.weight": ((64, cfg.dim), "F32")},
                               patch=1)
    assert (c1.patch, c1.in_channels) == (1, 64)


def test_config_errors_are_value_errors():
    with pytest.raises(ValueError, match="n_heads\\*head_dim"):
        DenoiserConfig(**{**SMALL, "n_heads": 5})
    with pytest.raises(ValueError, match="give all of"):
        DenoiserConfig(**{**SMALL, "cap_dim": None})
    with pytest.raises(ValueError, match="axes_dims"):
        DenoiserConfig(**SMALL, axes_dims=(16, 24, 22))
    for bad in (float("inf"), float("nan"), 0.0, -1.0):   # inf made every RoPE angle 0 / NaN
        with pytest.raises(ValueError, match="rope_theta .* must be positive and finite"):
            DenoiserConfig(**{**SMALL, "rope_theta": bad})
    assert DenoiserConfig(**{**SMALL, "rope_theta": 256.0}).rope_theta == 256.0   # control


# ----------------------------------------------------------------------------- bad tables

def _without(t, *names):
    return {n: v for n, v in t.items() if n not in names}


def _drop_block(t, prefix):
    return {n: v for n, v in t.items() if not n.startswith(prefix)}


def _bad_cases(cfg):
    D = cfg.dim
    t = table(cfg)
    t3 = table(dataclasses.replace(cfg, n_layers=3))
    return {
        "missing refiner tensor": (_without(t, "noise_refiner.1.feed_forward.w2.weight"),
                                   {}, "noise_refiner.1.feed_forward.w2.weight"),
        "missing noise-refiner adaLN": (_without(t, "noise_refiner.0.adaLN_modulation.0.bias"),
                                        {}, "noise_refiner.0.adaLN_modulation.0.bias"),
        "refiner counts disagree": (_drop_block(t, "noise_refiner.1."), {},
                                    "noise_refiner.1.attention.qkv.weight"),
        "no noise refiner": (_drop_block(t, "noise_refiner."), {},
                             "noise_refiner.0.attention.qkv.weight"),
        "declared refiner count": (t, {"n_refiner": 3},
                                   "noise_refiner.2.attention.qkv.weight"),
        "layer gap": (_drop_block(t3, "layers.1."), {}, "layers.1.attention.qkv.weight"),
        "declared layer count": (t, {"n_layers": 4}, "layers.2.attention.qkv.weight"),
        "no layers": (_drop_block(t, "layers."), {}, "layers.0.attention.qkv.weight"),
        "context refiner with adaLN": (
            {**t, "context_refiner.1.adaLN_modulation.0.weight": ((4 * D, 256), "F32")},
            {}, "context_refiner.1.adaLN_modulation.0.weight"),
        "layer shape": ({**t, "layers.1.feed_forward.w1.weight": ((1000, D), "F32")}, {},
                        "layers.1.feed_forward.w1.weight"),
        "final layer vs x_embedder": ({**t, "final_layer.linear.weight": ((60, D), "F32")}, {},
                                      "final_layer.linear.weight"),
        "x_embedder columns": ({**t, "x_embedder.weight": ((D, 66), "F32")}, {},
                               "x_embedder.weight"),
        "t_embedder widths": ({**t, "t_embedder.mlp.2.weight": ((256, 512), "F32")}, {},
                              "t_embedder.mlp.2.weight"),
        "adaLN width": ({**t, "layers.1.adaLN_modulation.0.weight": ((4 * D, 128), "F32")}, {},
                        "layers.1.adaLN_modulation.0.weight"),
        "cap_embedder norm": ({**t, "cap_embedder.0.weight": ((321,), "F32")}, {},
                              "cap_embedder.0.weight"),
        "pad token shape": ({**t, "x_pad_token": ((2, D), "F32")}, {}, "x_pad_token"),
        "qkv rows": ({**t, "layers.0.attention.qkv.weight": ((3 * D + 64, D), "F32")}, {},
                     "layers.0.attention.qkv.weight"),
        # 6 query heads of 64 and rows for 4 kv heads: 4 does not divide 6
        "kv heads do not divide the heads": (
            {**t, "layers.0.attention.qkv.weight": (((6 + 2 * 4) * 64, D), "F32")}, {},
            "layers.0.attention.qkv.weight"),
        "odd head_dim": ({**t, "layers.0.attention.q_norm.weight": ((63,), "F32")}, {},
                         "layers.0.attention.q_norm.weight"),
        "norm is 2-D": ({**t, "layers.0.attention_norm1.weight": ((1, D), "F32")}, {},
                        "layers.0.attention_norm1.weight"),
        "Lumina-2 adaLN": ({**_without(t, "layers.0.adaLN_modulation.0.weight"),
                            "layers.0.adaLN_modulation.1.weight": ((4 * D, 1024), "F32")}, {},
                           "layers.0.adaLN_modulation.1.weight"),
        "unexpected tensor": ({**t, "siglip_embedder.0.weight": ((D,), "F32")}, {},
                              "siglip_embedder.0.weight"),
        # an Arabic-Indic 1: a decimal to regex \d and int(), not a block index of a file
        "non-ASCII block index": ({**t, "layers.\u0661.attention.qkv.weight":
                                   t["layers.1.attention.qkv.weight"]}, {},
                                  "layers.\u0661.attention.qkv.weight"),
        # a leading zero would alias layers.1; 5000 digits made int() raise (exit 70)
        "zero-led block index": ({**t, "layers.01.attention.qkv.weight":
                                  t["layers.1.attention.qkv.weight"]}, {},
                                 "layers.01.attention.qkv.weight"),
        "block index of 5000 digits": ({**t, f"layers.{'9' * 5000}.attention.qkv.weight":
                                        t["layers.1.attention.qkv.weight"]}, {},
                                       f"layers.{'9' * 5000}.attention.qkv.weight"),
        "duplicate with prefix": ({**t, PREFIX + "x_embedder.bias": ((D,), "F32")}, {},
                                  "x_embedder.bias"),
        "unknown type": ({**t, "x_embedder.bias": ((D,), "Q9_9")}, {}, "x_embedder.bias"),
        "Q8_0 row length": ({**t, "x_embedder.weight": ((D, 64), "Q8_0"),
                             "t_embedder.mlp.0.weight": ((1024, 256), "Q8_0"),
                             "cap_embedder.0.weight": ((320,), "Q4_K")}, {},
                            "cap_embedder.0.weight"),
    }


@pytest.mark.parametrize("case", list(_bad_cases(DenoiserConfig(**SMALL))))
def test_bad_table_names_the_tensor(cfg, case):
    tensors, kw, name = _bad_cases(cfg)[case]
    with pytest.raises(ModelFileError) as ei:
        infer_denoiser_config(tensors, where="f.gguf", **kw)
    assert ei.value.tensor == name, str(ei.value)
    assert isinstance(ei.value, MissingTensorError) == ("missing" in case or case in (
        "no layers", "layer gap")), (case, type(ei.value))
    assert repr(name) in str(ei.value) and str(ei.value).startswith("f.gguf: ")


_HUGE_INDEX_CHILD = """
import resource, sys
from nxhpc.dit.config import infer_config
from nxhpc.formats.gguf_io import MissingTensorError
# a regression: MemoryError, not the OOM killer; 1 GiB above what the child maps now (that
# depends on the machine: each BLAS thread maps tens of MB)
size = next(int(ln.split()[1]) << 10 for ln in open("/proc/self/status")
            if ln.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (size + (1 << 30), size + (1 << 30)))
t = eval(sys.stdin.read())
try:
    infer_config(t, "f.gguf", None, whole=True)
except MissingTensorError as e:
    print(e.tensor, "|", str(e))
"""


@pytest.mark.parametrize("index", [12, 10 ** 11, 10 ** 17], ids=["12", "1e11", "1e17"])
def test_block_index_of_any_size_is_a_gap_found_at_once(cfg, index):
    """A file naming ``layers.<huge>.*`` has every block between missing: the first is named at
    once (the gap search built ``set(range(huge))``: gigabytes, a MemoryError or the OOM
    killer, exit 70). The child runs under an address-space limit 1 GiB above its size and a
    deadline."""
    import subprocess
    import sys
    t = {**table(cfg), f"layers.{index}.attention.qkv.weight":
         table(cfg)["layers.0.attention.qkv.weight"]}
    import os
    r = subprocess.run([sys.executable, "-c", _HUGE_INDEX_CHILD], input=repr(t),
                       capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-800:]
    name, _, msg = r.stdout.partition(" | ")
    assert name == f"layers.{cfg.n_layers}.attention.qkv.weight", r.stdout
    assert f"layers.{index} is present" in msg and len(msg) < 400, msg


def test_unexpected_tensor_allowed_when_asked(cfg):
    t = {**table(cfg), "siglip_embedder.0.weight": ((cfg.dim,), "F32")}
    assert infer_denoiser_config(t, allow_extra=True) == cfg
    # the context refiner's adaLN is never "extra": it contradicts the model
    t["context_refiner.0.adaLN_modulation.0.bias"] = ((4 * cfg.dim,), "F32")
    with pytest.raises(ModelFileError, match="unmodulated"):
        infer_denoiser_config(t, allow_extra=True)


def test_removed_file_tensor_is_named(file_tables):
    stored, _ = file_tables["sdcpp-q8_0"]
    name = PREFIX + "context_refiner.0.attention.k_norm.weight"
    with pytest.raises(MissingTensorError) as ei:
        infer_denoiser_config(_without(stored, name))
    assert ei.value.tensor == "context_refiner.0.attention.k_norm.weight"
