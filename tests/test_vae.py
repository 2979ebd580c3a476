"""The FLUX autoencoder's decoder (nxhpc.vae) against diffusers' AutoencoderKL in float64.

Small random FLUX-style VAEs (block channels 32/32/64/64, every parameter random, norms
included) stored both ways (a diffusers ``vae/`` directory; a BFL single file with LDM names,
whose mapping tests/vae_util checks against diffusers' ``convert_ldm_vae_checkpoint``) in each
dtype; the reference is diffusers' decode in float64 over the same (rounded) weights.
Tolerance: f32 within 1e-4 of max|ref| (the issue's bound; measured ~1e-6); bf16 measured
(~1e-2) and bounded at 4e-2. Negative controls must fail the same bound: a wrong GroupNorm eps,
conv-then-upsample, no shift factor, the BFL up blocks read unreversed, 8-group norms read as 32.
"""
import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
from vae_util import diffusers_decode, make_vae, rounded, write_vae

import nxhpc
from nxhpc.formats.gguf_io import MissingTensorError, ModelFileError
from nxhpc.runtime.checks import CheckError
from nxhpc.runtime.outfile import OutputPathError
from nxhpc.vae import config as vcfg
from nxhpc.vae import to_uint8, write_png
from nxhpc.vae.files import bind, open_vae_file
from nxhpc.vae.reference import decode_ref

F32_TOL = 1e-4
BF16_TOL = 4e-2
LATENTS = np.random.default_rng(0).standard_normal((16, 4, 6)).astype(np.float32)


def rel(out, ref):
    return float(np.max(np.abs(np.asarray(out, np.float64) - ref)) / np.max(np.abs(ref)))


@pytest.fixture(scope="module")
def vaes():
    """diffusers layout: 8-group norms (config.json says so); LDM: FLUX's 32 groups (the file
    carries no config)."""
    return {"diffusers": make_vae(1, norm_num_groups=8), "ldm": make_vae(2, norm_num_groups=32)}


@pytest.fixture(scope="module")
def files(vaes, tmp_path_factory):
    root = tmp_path_factory.mktemp("vae")
    out = {}
    for layout, vae in vaes.items():
        for dt in ("F32", "F16", "BF16"):
            out[layout, dt] = write_vae(vae, root / f"{layout}-{dt}", layout, dt)
    return out


@pytest.fixture(scope="module")
def refs(vaes):
    return {(layout, dt): diffusers_decode(rounded(vae, dt), LATENTS)
            for layout, vae in vaes.items() for dt in ("F32", "F16", "BF16")}


@pytest.mark.parametrize("layout", ["diffusers", "ldm"])
@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16"])
def test_decode_matches_diffusers(files, refs, layout, dtype):
    with nxhpc.load_vae(files[layout, dtype], workers=1) as vae:
        assert vae.file.layout == layout and vae.file.dtype == dtype
        out = vae.decode(LATENTS)
    ref = refs[layout, dtype]
    assert out.dtype == np.float32 and out.shape == ref.shape == (3, 32, 48)
    assert rel(out, ref) < F32_TOL, rel(out, ref)


def test_config_inferred(files):
    with open_vae_file(files["diffusers", "F32"]) as f:
        assert f.config.block_out_channels == (32, 32, 64, 64)
        assert (f.config.latent_channels, f.config.layers_per_block) == (16, 2)
        assert f.config.norm_num_groups == 8          # from config.json
        assert (f.config.scaling_factor, f.config.shift_factor) == (0.3611, 0.1159)
    with open_vae_file(files["ldm", "BF16"]) as f:
        assert f.layout == "ldm" and f.config.norm_num_groups == 32
        assert f.config.block_out_channels == (32, 32, 64, 64)


def test_weights_zero_copy(files):
    """F32/F16/BF16 convolution weights are views of the file's map, not copies."""
    for dt in ("F32", "F16", "BF16"):
        with open_vae_file(files["ldm", dt]) as f:
            mods = bind(f)
            w = mods["decoder.up_blocks.0.resnets.0.conv1"].w
            base = w.data
            while isinstance(base, np.ndarray) and not isinstance(base, np.memmap):
                base = base.base
            assert isinstance(base, np.memmap), dt
            assert w.type_name == dt


def test_reference_and_negative_controls(vaes, files, refs):
    """The float64 reference equals diffusers (1e-12); each deliberate bug breaks the 1e-4
    bound the decoder is held to."""
    ref = refs["ldm", "F32"]
    with open_vae_file(files["ldm", "F32"]) as f:
        w = {n: f.float64(n) for n in vcfg.tensor_names(f.config)}
        cfg = f.config
    assert rel(decode_ref(w, cfg, LATENTS), ref) < 1e-12
    for knob in (dict(eps=1e-2), dict(upsample_first=False), dict(shift=0.0)):
        assert rel(decode_ref(w, cfg, LATENTS, **knob), ref) > 10 * F32_TOL, knob
    # the group count matters: the 32-group file's weights normed in 8 groups
    cfg8 = vcfg.VaeConfig(norm_num_groups=8, block_out_channels=(32, 32, 64, 64))
    assert rel(decode_ref(w, cfg8, LATENTS), ref) > 10 * F32_TOL


def test_bfl_up_order_reversed_is_caught(tmp_path, monkeypatch):
    """Reading LDM's up.{k} as diffusers' up_blocks.{k} (not reversed) is caught: wholly, by the
    missing upsampler of LDM's up.0 (or by the shapes, for 32/32/64/64); for the ResNets alone
    (equal widths, so the shapes fit), by a wrong picture."""
    import re

    import nxhpc.vae.files as vfiles
    vae = make_vae(3, block_out_channels=(32, 32, 32, 32), norm_num_groups=32)
    path = write_vae(vae, tmp_path / "eq", "ldm", "F32")
    ref = diffusers_decode(vae, LATENTS)
    with nxhpc.load_vae(path, workers=1) as d:
        assert rel(d.decode(LATENTS), ref) < F32_TOL
    orig = vcfg.ldm_name

    def unreversed(resnets_only):
        def name_of(name, levels):
            m = re.match(r"decoder\.up_blocks\.(\d+)\.(.*)$", name)
            if not m or (resnets_only and not m.group(2).startswith("resnets.")):
                return orig(name, levels)
            return orig(f"decoder.up_blocks.{levels - 1 - int(m.group(1))}.{m.group(2)}", levels)
        return name_of

    for mod in (vcfg, vfiles):
        monkeypatch.setattr(mod, "ldm_name", unreversed(False))
    with pytest.raises(MissingTensorError, match=r"'decoder\.up\.0\.upsample\.conv\.weight'"):
        nxhpc.load_vae(path, workers=1)
    asym = write_vae(make_vae(4, norm_num_groups=32), tmp_path / "asym", "ldm", "F32")
    with pytest.raises(ModelFileError, match="has shape|missing tensor|output channels"):
        nxhpc.load_vae(asym, workers=1)
    for mod in (vcfg, vfiles):
        monkeypatch.setattr(mod, "ldm_name", unreversed(True))
    with nxhpc.load_vae(path, workers=1) as d:
        assert rel(d.decode(LATENTS), ref) > 10 * F32_TOL


def test_bf16_precision_measured(files, refs):
    with nxhpc.load_vae(files["diffusers", "F32"], workers=1, precision="bf16") as vae:
        out = vae.decode(LATENTS)
    err = rel(out, refs["diffusers", "F32"])
    assert 1e-4 < err < BF16_TOL, err           # bf16 is really in use, and within its bound


@pytest.mark.parametrize("precision", ["f32", "bf16"])
def test_workers_bit_identical(files, precision):
    outs = []
    for workers in (1, 2, 3):
        with nxhpc.load_vae(files["ldm", "BF16"], workers=workers, precision=precision) as vae:
            outs.append(vae.decode(LATENTS))
            outs.append(vae.decode(LATENTS[:, :3, :5]))        # a smaller size reuses the arena
    for o in outs[2::2]:
        assert np.array_equal(o.view(np.uint32), outs[0].view(np.uint32))
    for o in outs[3::2]:
        assert np.array_equal(o.view(np.uint32), outs[1].view(np.uint32))


def test_one_decoder_from_several_threads(files):
    """One VaeDecoder shared by threads (a server's pipeline) gives each caller the pixels of
    its own latents, at two sizes that replace each other's buffers (issue 19, item 1, on
    the autoencoder): calls are serialized."""
    from testutil import shared_by_threads
    jobs = [(LATENTS,), (LATENTS[:, :3, :5],), (-LATENTS,)]
    with nxhpc.load_vae(files["ldm", "F32"], workers=2) as vae:
        shared_by_threads(vae.decode, jobs, threads=3, rounds=4)


def test_no_shared_memory_left(files):
    from nxhpc.runtime.shm import live_segments
    before = set(live_segments(os.getpid()))
    vae = nxhpc.load_vae(files["ldm", "F32"], workers=2)
    vae.decode(LATENTS)
    vae.close()
    vae.close()
    assert set(live_segments(os.getpid())) == before


def test_to_uint8_is_diffusers_postprocess():
    import torch
    from diffusers.image_processor import VaeImageProcessor
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((3, 17, 23)) * 0.8).astype(np.float32)
    x[0, 0, :6] = [-1.0, 1.0, 2.0, -3.0, 0.0, (0.5 / 255 - 0.5) * 2]   # clamps and a tie
    proc = VaeImageProcessor(vae_scale_factor=8)
    pil = proc.postprocess(torch.from_numpy(x)[None], output_type="pil")[0]
    assert np.array_equal(to_uint8(x), np.asarray(pil))
    # float64 and float16 images: diffusers clamps in the tensor's dtype, then goes to float32
    # (float64 was once rounded to float32 first: 1 level off at the ties). Values within 20
    # float32 ulps of every tie, jittered in float64.
    ties = ((np.arange(255) + 0.5) / 255 - 0.5) * 2
    steps = np.arange(-20, 21)
    x64 = (ties[:, None].astype(np.float32) + steps * np.spacing(np.float32(1))).astype(np.float64)
    x64 = (x64 + rng.uniform(-1e-9, 1e-9, x64.shape)).reshape(3, 85, 41)
    for img in (x64, x64.astype(np.float16), (x * 1.3).astype(np.float64)):
        pil = proc.postprocess(torch.from_numpy(img)[None], output_type="pil")[0]
        assert np.array_equal(to_uint8(img), np.asarray(pil)), img.dtype
    assert not np.array_equal(to_uint8(x64.astype(np.float32)), to_uint8(x64))   # the control
    # a float64 image beyond float32's range is clamped like any other (diffusers does so);
    # NaN/inf and other shapes are refused, naming the image
    big = np.full((3, 2, 2), 1e300)
    big[0, 0, 0] = -1e300
    assert np.array_equal(to_uint8(big)[..., 0], [[0, 255], [255, 255]])
    from nxhpc.runtime.checks import CheckError
    for bad, msg in ((np.full((3, 2, 2), np.nan), "1 of 12|12 of 12 values are NaN"),
                     (np.zeros((2, 2)), "expected a 3-d floating-point"),
                     (np.zeros((3, 2, 2), np.int32), "expected a 3-d floating-point")):
        with pytest.raises(CheckError, match=msg):
            to_uint8(bad)


def test_write_png_round_trip_and_atomic(tmp_path):
    from PIL import Image
    px = np.random.default_rng(4).integers(0, 256, (9, 7, 3), dtype=np.uint8)
    p = tmp_path / "a.png"
    write_png(p, px, {"prompt": "a fox", "seed": "7"})
    im = Image.open(p)
    assert np.array_equal(np.asarray(im), px) and im.text["prompt"] == "a fox"
    with pytest.raises(OutputPathError, match="does not exist"):
        write_png(tmp_path / "no" / "b.png", px)
    with pytest.raises(ValueError, match="uint8"):
        write_png(tmp_path / "c.png", px.astype(np.float32))
    assert sorted(x.name for x in tmp_path.iterdir()) == ["a.png"]


def test_write_png_refuses_text_a_png_cannot_hold(tmp_path):
    """Text keywords PNG does not allow were written without a word (the library-API helper's
    find): ``"a\\0b"`` came back as keyword ``a`` with the rest in the text, ``""`` was
    dropped by the reader, a 100-character keyword broke the format's limit, a non-Latin-1
    one raised a bare UnicodeEncodeError. Each is a ValueError naming it now, nothing written;
    so is a text holding NUL. Controls: the longest allowed keyword and a non-Latin-1 text
    (an iTXt chunk) read back as written, with Pillow's reader."""
    from PIL import Image
    px = np.zeros((4, 4, 3), np.uint8)
    for key in ("a\0b", "", "k" * 80, "k\u00e9\u2713", " k", "k ", "a  b", "tab\there"):
        with pytest.raises(ValueError, match="is not a PNG keyword"):
            write_png(tmp_path / "x.png", px, {key: "v"})
    with pytest.raises(ValueError, match="holds a NUL"):
        write_png(tmp_path / "x.png", px, {"k": "a\0b"})
    assert list(tmp_path.iterdir()) == []
    text = {"k" * 79: "v", "caf\u00e9 prompt": "h\u00e9llo \u2713", "Seed": 7}
    write_png(tmp_path / "ok.png", px, text)
    with Image.open(tmp_path / "ok.png") as im:
        assert im.text == {k: str(v) for k, v in text.items()}


def test_bad_latents(files):
    with nxhpc.load_vae(files["ldm", "F32"], workers=1) as vae:
        with pytest.raises(CheckError, match=r"expected \[16, h, w\]"):
            vae.decode(np.zeros((4, 4, 6), np.float32))
        bad = LATENTS.copy()
        bad[3, 1, 2] = np.nan
        with pytest.raises(CheckError, match="1 of 384 values are NaN or inf"):
            vae.decode(bad)
        with pytest.raises(CheckError, match="positive sizes"):
            vae.decode(np.zeros((16, 0, 6), np.float32))
        with pytest.raises(CheckError, match="shape"):
            vae.decode(np.zeros((16, 6), np.float32))
    with pytest.raises(CheckError, match="precision"):
        nxhpc.load_vae(files["ldm", "F32"], precision="q8")


def test_bad_files(files, tmp_path):
    src = files["ldm", "F32"]
    data = src.read_bytes()
    trunc = tmp_path / "trunc.safetensors"
    trunc.write_bytes(data[:-100])
    with pytest.raises(ModelFileError, match="runs past the end .* truncated"):
        nxhpc.load_vae(trunc)
    absurd = tmp_path / "absurd.safetensors"
    absurd.write_bytes(struct.pack("<Q", 1 << 60) + data[8:200])
    with pytest.raises(ModelFileError, match="header length .* is absurd"):
        nxhpc.load_vae(absurd)
    notjson = tmp_path / "nj.safetensors"
    notjson.write_bytes(struct.pack("<Q", 4) + b"{{{{")
    with pytest.raises(ModelFileError, match="not valid JSON"):
        nxhpc.load_vae(notjson)
    # a decoder tensor missing: named as the file spells it
    from safetensors.numpy import load_file, save_file
    sd = load_file(str(src))
    del sd["decoder.up.1.block.2.conv2.bias"]
    miss = tmp_path / "miss.safetensors"
    save_file(sd, str(miss))
    with pytest.raises(MissingTensorError, match=r"'decoder\.up\.1\.block\.2\.conv2\.bias'"):
        nxhpc.load_vae(miss)
    sd = load_file(str(src))
    sd["decoder.mid.attn_1.q.weight"] = sd["decoder.mid.attn_1.q.weight"][:, :8]
    shp = tmp_path / "shape.safetensors"
    save_file(sd, str(shp))
    with pytest.raises(ModelFileError, match=r"'decoder\.mid\.attn_1\.q\.weight' has shape"):
        nxhpc.load_vae(shp)
    sd = load_file(str(src))
    sd["decoder.conv_out.weight"][0, 0, 0, 0] = np.inf
    nan = tmp_path / "inf.safetensors"
    save_file(sd, str(nan))
    with pytest.raises(ModelFileError, match=r"'decoder\.conv_out\.weight' holds NaN or inf"):
        nxhpc.load_vae(nan)
    enc = tmp_path / "enc.safetensors"
    save_file({k: v for k, v in load_file(str(src)).items() if k.startswith("encoder.")}, str(enc))
    with pytest.raises(MissingTensorError, match="no decoder found"):
        nxhpc.load_vae(enc)
    with pytest.raises(nxhpc.formats.gguf_io.ModelNotFoundError):
        nxhpc.load_vae(tmp_path / "nowhere")


def _header_file(path, header: bytes, data: bytes = b"") -> str:
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return str(path)


def test_hostile_headers_are_model_errors(files, tmp_path):
    """Headers Python's json cannot turn into values (nesting past the recursion limit, an
    integer of more digits than int() converts) and byte ranges the safetensors package refuses
    (overlapping, negative) are ModelFileError (CLI exit 4) naming the file; they were a
    RecursionError / ValueError (exit 70) and, for overlaps, accepted. The package itself is
    the oracle for the overlap."""
    from safetensors import safe_open
    deep = _header_file(tmp_path / "deep.safetensors", b"[" * 100_000 + b"]" * 100_000)
    with pytest.raises(ModelFileError, match="deep.safetensors: .*not valid JSON .*Recursion"):
        nxhpc.load_vae(deep)
    huge = _header_file(tmp_path / "huge.safetensors",
                        b'{"a": {"dtype": "F32", "shape": [' + b"9" * 5001 + b'], '
                        b'"data_offsets": [0, 4]}}', b"\0" * 4)
    with pytest.raises(ModelFileError, match="huge.safetensors: .*not valid JSON"):
        nxhpc.load_vae(huge)
    ent = lambda b, e: {"dtype": "F32", "shape": [(e - b) // 4], "data_offsets": [b, e]}
    over = _header_file(tmp_path / "over.safetensors",
                        json.dumps({"a": ent(0, 64), "b": ent(32, 96)}).encode(), b"\0" * 96)
    with pytest.raises(Exception, match="offset"):   # the oracle refuses it
        safe_open(over, "np")
    with pytest.raises(ModelFileError, match=r"'a' \[0, 64\) and 'b' \[32, 96\) overlap"):
        nxhpc.load_vae(over)
    apart = _header_file(tmp_path / "apart.safetensors",   # control: adjacent ranges are fine
                         json.dumps({"a": ent(0, 64), "b": ent(64, 96)}).encode(), b"\0" * 96)
    assert safe_open(apart, "np") is not None
    from nxhpc.formats.safetensors_io import SafetensorsFile
    with SafetensorsFile(apart) as st:
        assert st.names() == ["a", "b"]
    neg = _header_file(tmp_path / "neg.safetensors",
                       json.dumps({"a": {"dtype": "F32", "shape": [64], "data_offsets": [-256, 0]}}
                                  ).encode(), b"\0" * 64)
    with pytest.raises(ModelFileError, match=r"data_offsets \[-256, 0\) are not a byte range"):
        nxhpc.load_vae(neg)


def test_fifo_autoencoder_is_refused_not_opened(tmp_path):
    """A FIFO given as the autoencoder is refused before it is opened (opening blocked for
    good); run in a child with a deadline, so a regression fails instead of hanging the suite."""
    fifo = tmp_path / "ae.safetensors"
    os.mkfifo(fifo)
    code = (f"import nxhpc\ntry:\n    nxhpc.load_vae({str(fifo)!r})\n"
            f"except nxhpc.formats.gguf_io.ModelNotFoundError as e:\n    print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "a FIFO, not a regular file" in r.stdout, r.stderr
    from nxhpc.formats.safetensors_io import SafetensorsFile
    with pytest.raises(ModelFileError, match="not a regular file \\(a FIFO\\)"):
        SafetensorsFile(fifo)
    with pytest.raises(ModelFileError, match="not a regular file \\(a directory\\)"):
        SafetensorsFile(tmp_path)


@pytest.mark.parametrize("key, value", [
    ("norm_num_groups", 0), ("norm_num_groups", -1), ("norm_num_groups", "x"),
    ("norm_num_groups", 8.9), ("norm_num_groups", True), ("latent_channels", "16"),
    ("layers_per_block", [2]), ("block_out_channels", 5), ("block_out_channels", [32, "32"]),
    ("scaling_factor", "abc"), ("shift_factor", False), ("use_post_quant_conv", "false"),
    ("mid_block_add_attention", "no")])
def test_config_json_values_must_have_their_types(files, tmp_path, key, value):
    """config.json's values are taken as JSON types, not coerced: "false" is not false (it was
    read as true), 8.9 is not 8 (the decode ran with 8 groups), and 0 / -1 groups reached the
    kernels' own checks or divided by zero (exit 70). Control: the untouched directory opens."""
    import shutil
    d = tmp_path / "vae"
    shutil.copytree(files["diffusers", "F32"], d)
    cfg = json.loads((d / "config.json").read_text())
    nxhpc.load_vae(d).close()
    cfg[key] = value
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelFileError, match=f"config.json {key} is .*, expected"):
        nxhpc.load_vae(d)


def test_null_shift_factor_is_no_shift(vaes, tmp_path):
    """A diffusers VAE saved with AutoencoderKL's default ``shift_factor=None`` (config.json
    ``null``) decodes ``z / scaling`` as diffusers does (it was decoded with FLUX's 0.1159:
    2e-2 of max|ref| off, the QA helper's finding). Control: the same weights with the shift
    0.1159 written out decode as that."""
    vae = make_vae(1, norm_num_groups=8)
    d = write_vae(vae, tmp_path / "v", "diffusers", "F32")
    cfg = json.loads((d / "config.json").read_text())
    import torch
    for shift in (None, 0.1159):
        cfg["shift_factor"] = shift
        (d / "config.json").write_text(json.dumps(cfg))
        z = torch.from_numpy(np.asarray(LATENTS, dtype=np.float64))[None] / 0.3611
        with torch.no_grad():
            ref = vae.decode(z + (shift or 0.0)).sample[0].numpy()
        with nxhpc.load_vae(d, workers=1) as dec:
            assert dec.config.shift_factor == (shift or 0.0)
            got = dec.decode(LATENTS)
        assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max(), shift


def test_decoder_values_and_shapes_checked_at_load(files, tmp_path):
    """What a file holds is checked when it is opened (CLI exit 4 naming the tensor or key), not
    met in the decode (a wrong "overflowed float32" exit 1, or exit 70; generate ran the encoder
    and the sampler first): NaN in a GroupNorm's beta, an empty dimension, a conv_out of 4
    channels (the PNG writer's ValueError), an SD-style post_quant_conv (was skipped silently),
    a header naming a tensor twice (the second entry ran), and config.json factors float32 does
    not hold. Controls: a 1-channel decoder and a small but normal scaling still open."""
    import shutil

    from safetensors.numpy import load_file, save_file
    src = files["ldm", "F32"]

    def variant(name, edit):
        sd = load_file(str(src))
        edit(sd)
        p = tmp_path / f"{name}.safetensors"
        save_file(sd, str(p))
        return p

    def nan_beta(sd):
        sd["decoder.norm_out.bias"][3] = np.nan
    with pytest.raises(ModelFileError, match=r"'decoder\.norm_out\.bias' holds NaN or inf"):
        nxhpc.load_vae(variant("nanbeta", nan_beta))

    def zero_z(sd):
        sd["decoder.conv_in.weight"] = np.zeros((sd["decoder.conv_in.weight"].shape[0], 0, 3, 3),
                                                np.float32)
    with pytest.raises(ModelFileError, match=r"'decoder\.conv_in\.weight' has shape .*empty"):
        nxhpc.load_vae(variant("zero", zero_z))

    def out_channels(n):
        def edit(sd):
            w, b = sd["decoder.conv_out.weight"], sd["decoder.conv_out.bias"]
            sd["decoder.conv_out.weight"] = np.ascontiguousarray(np.resize(w, (n, *w.shape[1:])))
            sd["decoder.conv_out.bias"] = np.ascontiguousarray(np.resize(b, (n,)))
        return edit
    with pytest.raises(ModelFileError, match=r"'decoder\.conv_out\.weight' .* not 4"):
        nxhpc.load_vae(variant("out4", out_channels(4)))
    with nxhpc.load_vae(variant("out1", out_channels(1))) as v:     # control: grayscale
        assert v.config.out_channels == 1
        # each decode a new array: with one channel the result was a view of the arena,
        # overwritten by the next call
        a = v.decode(LATENTS)
        keep = a.copy()
        b = v.decode(LATENTS * 2)
        assert not np.shares_memory(a, b) and np.array_equal(a, keep)

    def post_quant(sd):
        z = sd["decoder.conv_in.weight"].shape[1]
        sd["post_quant_conv.weight"] = np.eye(z, dtype=np.float32).reshape(z, z, 1, 1)
        sd["post_quant_conv.bias"] = np.zeros(z, np.float32)
    with pytest.raises(ModelFileError, match=r"post_quant_conv .*\(not supported\)"):
        nxhpc.load_vae(variant("pqc", post_quant))

    # a header naming a tensor twice: the text as written, the second entry pointing elsewhere
    data = src.read_bytes()
    n = int.from_bytes(data[:8], "little")
    head = json.loads(data[8:8 + n])
    ent = head["decoder.conv_in.bias"]
    size = ent["data_offsets"][1] - ent["data_offsets"][0]
    end = max(e["data_offsets"][1] for k, e in head.items() if k != "__metadata__")
    dup = dict(ent, data_offsets=[end, end + size])
    text = json.dumps(head)[:-1] + ', "decoder.conv_in.bias": ' + json.dumps(dup) + "}"
    path = _header_file(tmp_path / "dup.safetensors", text.encode(),
                        data[8 + n:8 + n + end] + b"\0" * size)
    with pytest.raises(ModelFileError, match="names the key 'decoder.conv_in.bias' twice"):
        nxhpc.load_vae(path)
    ok = _header_file(tmp_path / "nodup.safetensors", json.dumps(head).encode(),  # control
                      data[8 + n:8 + n + end])
    nxhpc.load_vae(ok).close()

    d = tmp_path / "vae"
    shutil.copytree(files["diffusers", "F32"], d)
    cfg = json.loads((d / "config.json").read_text())
    for key, value in [("scaling_factor", 1e-308), ("scaling_factor", 1e39),
                       ("shift_factor", 1e308)]:
        (d / "config.json").write_text(json.dumps(dict(cfg, **{key: value})))
        with pytest.raises(ModelFileError, match="positive normal float32"):
            nxhpc.load_vae(d)
    (d / "config.json").write_text(json.dumps(dict(cfg, scaling_factor=1e-30)))   # control
    with nxhpc.load_vae(d) as v:
        assert v.config.scaling_factor == 1e-30


def test_check_room_counts_the_buffers_a_decode_makes(files, monkeypatch):
    """``VaeDecoder.check_room`` (generate's check before the steps): one worker's buffers are
    this process's memory, held against the memory available (the shared-memory rule, which
    keeps an eighth and 256 MiB back, refused such runs that then decoded fine: the review's
    finding); with workers, the arena against /dev/shm; ``copies`` decoders at once (several
    images under mpirun, every rank on a host decoding) need that many arenas. The bytes are
    the arena's own layout. Controls: the same calls with the room they need pass."""
    from nxhpc.runtime import ranks, shm
    from nxhpc.vae.model import GN_CHUNK, Program, forward
    with nxhpc.load_vae(files["diffusers", "F32"], workers=1) as dec:
        prog = Program(dec.config, GN_CHUNK)
        forward(prog, 32, 32)
        need = sum(-(-n * (8 if k == "part" else 4) // 64) * 64 for k, n in prog.sizes.items())
        monkeypatch.setattr(shm, "memory_available_bytes", lambda: need + (200 << 20))
        assert dec.check_room(32, 32) == need
        monkeypatch.setattr(shm, "memory_available_bytes", lambda: need - 1)
        with pytest.raises(shm.ShmSpaceError, match=f"its buffers need {need} bytes"):
            dec.check_room(32, 32)
        monkeypatch.undo()
        out = dec.decode(np.zeros((16, 32, 32), np.float32))        # what it checked for
        assert out.shape == (3, 256, 256)
    with nxhpc.load_vae(files["diffusers", "F32"], workers=2) as dec:
        monkeypatch.setattr(shm, "shm_free_bytes", lambda where=shm.SHM_DIR: 2 * need)
        assert dec.check_room(32, 32, copies=2) == 2 * need
        with pytest.raises(shm.ShmSpaceError, match=r"\(3 at once on this host\): not enough "
                                                    r"shared memory"):
            dec.check_room(32, 32, copies=3)
    for env, n in (({"OMPI_COMM_WORLD_LOCAL_SIZE": "3"}, 3), ({"MPI_LOCALNRANKS": "2"}, 2),
                   ({}, 1)):
        for k in ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"):
            monkeypatch.delenv(k, raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        assert ranks.local_ranks() == n


def test_check_room_counts_the_output_picture_beside_the_buffers(files, monkeypatch, tmp_path):
    """``generate`` under ``ulimit -v`` failed after every step, at the decode's copy of its
    output (tiny components at 512x512 under 303000 KiB: "Unable to allocate 3.00 MiB for an
    array with shape (512, 512, 3)", exit 7): ``check_room`` counted the decode's buffers
    only. It now counts the output picture's copies beside them
    (``OUTPUT_BYTES_PER_VALUE`` a value of [C, 8h, 8w], and 1 MiB), before the run, with and
    without workers, and with buffers already held (which need nothing more). Controls: the
    same room less one byte is refused, exactly that room passes; and what a decode,
    ``to_uint8`` and ``write_png`` take (tracemalloc's peak, the buffers already made) is
    within the count."""
    import tracemalloc

    from nxhpc.runtime import shm
    from nxhpc.vae import to_uint8, write_png
    from nxhpc.vae.model import GN_CHUNK, OUTPUT_BYTES_PER_VALUE, Program, forward
    monkeypatch.setattr(shm, "memory_available_bytes", lambda: 1 << 50)
    monkeypatch.setattr(shm, "shm_free_bytes", lambda where=shm.SHM_DIR: 1 << 50)
    z = np.random.default_rng(3).standard_normal((16, 32, 32)).astype(np.float32)
    for workers in (1, 2):
        with nxhpc.load_vae(files["diffusers", "F32"], workers=workers) as dec:
            prog = Program(dec.config, GN_CHUNK)
            forward(prog, 32, 32)
            arena = sum(-(-n * (8 if k == "part" else 4) // 64) * 64
                        for k, n in prog.sizes.items())
            picture = OUTPUT_BYTES_PER_VALUE * 3 * 256 * 256 + (1 << 20)
            for held in (False, True):
                need = picture + (0 if held else arena)
                monkeypatch.setattr(shm, "_address_space_room", lambda: need - 1)
                with pytest.raises(shm.ShmSpaceError, match=r"at 256x256 with its output "
                                                            r"picture: not enough address space"):
                    dec.check_room(32, 32)
                monkeypatch.setattr(shm, "_address_space_room", lambda: need)
                assert dec.check_room(32, 32) == (0 if held else arena)
                dec.decode(z)                                   # the buffers held from here
            monkeypatch.setattr(shm, "_address_space_room", lambda: None)
            tracemalloc.start()
            try:
                write_png(tmp_path / f"w{workers}.png", to_uint8(dec.decode(z)))
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            assert 0 < peak <= OUTPUT_BYTES_PER_VALUE * 3 * 256 * 256, peak


def test_absent_scaling_and_shift_are_what_diffusers_reads(vaes, tmp_path):
    """A config.json without ``scaling_factor`` / ``shift_factor`` decodes as diffusers'
    ``AutoencoderKL.from_pretrained`` reads that directory (0.18215, no shift: the QA helper
    found FLUX's 0.3611 / 0.1159 taken instead, ~1.6x off); a null scaling is refused.
    Control: the same weights with FLUX's values written out decode as those."""
    import torch
    from diffusers import AutoencoderKL
    vae = make_vae(1, norm_num_groups=8)
    d = write_vae(vae, tmp_path / "v", "diffusers", "F32")
    cfg = json.loads((d / "config.json").read_text())
    z = torch.from_numpy(np.asarray(LATENTS, dtype=np.float64))[None]
    for drop in (True, False):
        c = {k: v for k, v in cfg.items() if not (drop and k in ("scaling_factor",
                                                                   "shift_factor"))}
        (d / "config.json").write_text(json.dumps(c))
        hf = AutoencoderKL.from_pretrained(str(d)).double().eval()    # how diffusers reads it
        scale, shift = hf.config.scaling_factor, hf.config.shift_factor or 0.0
        assert (scale, shift) == ((0.18215, 0.0) if drop else (0.3611, 0.1159))
        with torch.no_grad():
            ref = hf.decode(z / scale + shift).sample[0].numpy()
        with nxhpc.load_vae(d, workers=1) as dec:
            assert (dec.config.scaling_factor, dec.config.shift_factor) == (scale, shift)
            assert rel(dec.decode(LATENTS), ref) <= F32_TOL
    (d / "config.json").write_text(json.dumps(dict(cfg, scaling_factor=None)))
    with pytest.raises(ModelFileError, match="scaling_factor is null"):
        nxhpc.load_vae(d)


@pytest.mark.parametrize("layout", ["diffusers", "ldm"])
def test_a_missing_mid_attention_tensor_is_named(files, tmp_path, layout):
    """The mid attention is there when any of its tensors is: a file missing only its query
    weight is MissingTensorError naming it (it was decoded without the attention, exit 0, 25%
    off diffusers; with config.json a wrong "tensors are absent"). Control: the whole file
    opens; a file without any of the ten is a decoder without the attention."""
    import shutil

    from safetensors.numpy import load_file, save_file
    src = files[layout, "F32"]
    d = tmp_path / layout
    if layout == "diffusers":
        shutil.copytree(src, d)
        f, q = d / "diffusion_pytorch_model.safetensors", "decoder.mid_block.attentions.0.to_q"
    else:
        d.mkdir()
        f, q = d / "ae.safetensors", "decoder.mid.attn_1.q"
        shutil.copy(src, f)
    nxhpc.load_vae(d if layout == "diffusers" else f).close()
    sd = load_file(str(f))
    save_file({k: v for k, v in sd.items() if k != f"{q}.weight"}, str(f))
    with pytest.raises(MissingTensorError, match=f"missing tensor '{q}.weight'"):
        nxhpc.load_vae(d if layout == "diffusers" else f)
    if layout == "diffusers":                      # without config.json, as an LDM file reads
        (d / "config.json").unlink()
        with pytest.raises(MissingTensorError, match=f"missing tensor '{q}.weight'"):
            nxhpc.load_vae(d)
    else:
        attn = q.rsplit(".", 1)[0]
        save_file({k: v for k, v in sd.items() if not k.startswith(attn + ".")}, str(f))
        with nxhpc.load_vae(f) as dec:
            assert dec.config.mid_attention is False


def test_decoders_of_another_architecture_are_refused(files, tmp_path):
    """A config.json or tensors describing another decoder than FLUX's are refused by name
    (each was decoded as FLUX's, exit 0: gelu 9.6% off diffusers, attention in the up blocks
    54%): another activation or class, up blocks with attention (their tensors, with or without
    the config's word for them), an out_channels that disagrees with conv_out. Control: the
    untouched directory opens."""
    import shutil

    from safetensors.numpy import load_file, save_file
    d = tmp_path / "vae"
    shutil.copytree(files["diffusers", "F32"], d)
    cfg = json.loads((d / "config.json").read_text())
    nxhpc.load_vae(d).close()
    for key, value, words in [("act_fn", "gelu", "act_fn is \"gelu\""),
                              ("_class_name", "AutoencoderTiny", "_class_name is"),
                              ("up_block_types", ["AttnUpDecoderBlock2D"] * 4,
                               "up_block_types is"),
                              ("out_channels", 1, "out_channels 1 disagrees")]:
        (d / "config.json").write_text(json.dumps(dict(cfg, **{key: value})))
        with pytest.raises(ModelFileError, match=words):
            nxhpc.load_vae(d)
    # controls: diffusers builds SiLU for "swish" too (it was refused); a null norm_num_groups
    # is absent, 32 (it was an internal error, exit 70)
    for key, value in (("act_fn", "swish"), ("norm_num_groups", None)):
        (d / "config.json").write_text(json.dumps(dict(cfg, **{key: value})))
        nxhpc.load_vae(d).close()
    (d / "config.json").write_text(json.dumps(cfg))
    f = d / "diffusion_pytorch_model.safetensors"
    sd = load_file(str(f))
    extra = "decoder.up_blocks.0.attentions.0.to_q.weight"
    save_file(dict(sd, **{extra: np.ones((64, 64), np.float32)}), str(f))
    with pytest.raises(ModelFileError, match=f"tensor '{extra}' is not part of a FLUX-style"):
        nxhpc.load_vae(d)
