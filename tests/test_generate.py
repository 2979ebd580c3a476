"""Pixels out as users reach them: the built-in ``tiny-vae``, ``python -m nxhpc.decode`` and
``python -m nxhpc.generate`` (prompt -> PNG on nxhpc's kernels, no torch in the run).

Oracles, independent of the code under test:
- ``tiny-vae``: diffusers' ``AutoencoderKL`` (float64) holding the file's weights through
  diffusers' own ``convert_ldm_vae_checkpoint`` (the BFL -> diffusers key mapping);
- ``decode``: the library's ``VaeDecoder`` + ``to_uint8`` on the same latents (bit equal: the
  decoder is bit-identical for any worker count);
- ``generate``: diffusers' ``ZImagePipeline`` built from the same tiny components --
  transformers' ``Qwen2Tokenizer`` (the file's vocab and merges, Qwen's chat template) and
  float64 ``Qwen3Model`` (``nxhpc.qwen3.oracle``) for ``tiny-te``, the float64 diffusers
  ``ZImageTransformer2DModel`` on ``tiny-dit``'s dequantized weights, the ``AutoencoderKL``
  above, ``FlowMatchEulerDiscreteScheduler(shift=3)`` -- 8 steps from the same initial noise:
  the PNG within 2 levels everywhere (measured: 0-1), with and without CFG. Negative controls:
  another prompt, a flipped guidance sign and another seed must miss that bound.
Bad input: a clear error, the documented exit code, nothing written, no /dev/shm left behind.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import nxhpc
from nxhpc.cli.codes import Exit, UsageError
from nxhpc.dit.sampler import initial_noise
from nxhpc.formats.gguf_io import ModelNotFoundError
from nxhpc.models import registry
from nxhpc.models.vae_files import VaeSpec, make_vae_model
from procutil import models_env, run_cli
from sample_util import shm_entries

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

pytestmark = pytest.mark.usefixtures("torch_threads")

PX = 64
PROMPT = "a red fox in the snow"
#: A change of tiny-vae's identity shows here before it regenerates every user's copy.
PINNED_TINY_VAE = "006087d02757e375"


def _png(path):
    from PIL import Image
    with Image.open(path) as im:
        return np.asarray(im.convert("RGB")).astype(int), dict(im.text)


def _leftovers(d) -> list[str]:
    return sorted(n for n in os.listdir(d) if ".tmp-" in n or ".probe-" in n)


# ------------------------------------------------------------------------------ tiny-vae
@pytest.fixture(scope="module")
def vae_dir(models_root):
    return registry.ensure_builtin("tiny-vae", models_root)


def _diffusers_vae(path, dtype=None):
    """diffusers' AutoencoderKL (float64) of a BFL-layout tiny-vae file, converted by
    diffusers' own LDM mapping; the encoder stays random (unused)."""
    from diffusers import AutoencoderKL
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint
    from safetensors.torch import load_file
    spec = VaeSpec()
    n = len(spec.block_out_channels)
    vae = AutoencoderKL(in_channels=3, out_channels=3,
                        down_block_types=("DownEncoderBlock2D",) * n,
                        up_block_types=("UpDecoderBlock2D",) * n,
                        block_out_channels=spec.block_out_channels,
                        layers_per_block=spec.layers_per_block,
                        latent_channels=spec.latent_channels, norm_num_groups=32,
                        use_quant_conv=False, use_post_quant_conv=False,
                        mid_block_add_attention=True, scaling_factor=0.3611,
                        shift_factor=0.1159).to(dtype or torch.float64).eval()
    sd = convert_ldm_vae_checkpoint(load_file(str(path)), dict(vae.config))
    missing, unexpected = vae.load_state_dict({k: v.to(vae.dtype) for k, v in sd.items()},
                                              strict=False)
    assert not unexpected and all(k.startswith("encoder.") for k in missing), unexpected
    assert len(sd) == len([k for k in vae.state_dict() if k.startswith("decoder.")])
    return vae


def test_tiny_vae_builtin(vae_dir, tmp_path):
    spec = registry.BUILTINS["tiny-vae"]
    assert spec.kind == "vae" and registry.builtin_ids("vae") == ["tiny-vae"]
    assert spec.latent_channels == registry.BUILTINS["tiny-dit"].in_channels == 16
    assert sorted(os.listdir(vae_dir)) == sorted([registry.FILES_MANIFEST, "ae.safetensors",
                                                  "synthetic.json"])
    info = json.loads((vae_dir / "synthetic.json").read_text())
    assert info["kind"] == "vae" and info["fingerprint"] == spec.fingerprint() == PINNED_TINY_VAE
    assert registry.builtin_current(vae_dir, spec)
    from dataclasses import replace
    assert not registry.builtin_current(vae_dir, replace(spec, seed=1))   # negative control
    # the same spec gives the same bytes; a size estimate that is a close lower bound
    again = make_vae_model(tmp_path / "again", spec)
    assert (again / "ae.safetensors").read_bytes() == (vae_dir / "ae.safetensors").read_bytes()
    size = (vae_dir / "ae.safetensors").stat().st_size
    assert 0.98 * size <= spec.disk_bytes() <= size
    with nxhpc.load_vae("tiny-vae", workers=1, models_dir=vae_dir.parent) as vae:
        assert vae.file.layout == "ldm" and vae.file.dtype == "F32"
        assert vae.config.block_out_channels == (32, 32, 64, 64)
        assert vae.config.norm_num_groups == 32 and vae.config.upscale == 8
    with pytest.raises(ValueError, match="multiples of 32"):
        VaeSpec(block_out_channels=(32, 48)).validate()


def test_tiny_vae_matches_diffusers(vae_dir, tmp_path):
    from vae_util import diffusers_decode
    z = np.random.default_rng(5).standard_normal((16, 6, 8)).astype(np.float32)
    ref = diffusers_decode(_diffusers_vae(vae_dir / "ae.safetensors"), z)
    with nxhpc.load_vae(vae_dir / "ae.safetensors", workers=2) as vae:
        out = vae.decode(z)
    rel = np.abs(out - ref).max() / np.abs(ref).max()
    assert out.shape == (3, 48, 64) and rel < 1e-4, rel
    assert 0.05 < np.mean(np.abs(ref) > 0.1) and np.mean(np.abs(ref) > 1) < 0.05  # not flat
    other = make_vae_model(tmp_path / "other", VaeSpec(seed=1))
    ref2 = diffusers_decode(_diffusers_vae(other / "ae.safetensors"), z)
    assert np.abs(out - ref2).max() / np.abs(ref2).max() > 1e-1          # negative control


def test_load_vae_refuses_other_kinds(models_root, tmp_path):
    with pytest.raises(ModelNotFoundError, match="not an autoencoder"):
        nxhpc.load_vae("tiny-dit", models_dir=tmp_path)
    assert not (tmp_path / "tiny-dit").exists()                          # nothing generated
    with pytest.raises(ModelNotFoundError, match="no such file"):
        nxhpc.load_vae(tmp_path / "absent.safetensors")


# ------------------------------------------------------------------------------ decode CLI
@pytest.fixture()
def latents_file(tmp_path):
    z = np.random.default_rng(7).standard_normal((16, 8, 6)).astype(np.float32)
    p = tmp_path / "z.npy"
    np.save(p, z)
    return p, z


def test_decode_cli_matches_the_library(vae_dir, latents_file, tmp_path):
    from nxhpc.vae import to_uint8
    p, z = latents_file
    out = tmp_path / "img.png"
    r = run_cli("nxhpc.decode", ["tiny-vae", "--latents", p, "--out", out, "--json", "2"],
                vae_dir.parent)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["image"] == [64, 48] and rep["workers"] == 2 and rep["out"] == str(out)
    assert rep["peak_rss_mb"] > 0 and rep["decode_s"] > 0
    with nxhpc.load_vae("tiny-vae", workers=1, models_dir=vae_dir.parent) as vae:
        want = to_uint8(vae.decode(z)).astype(int)
    got, text = _png(out)
    np.testing.assert_array_equal(got, want)
    assert text["latents"] == "z.npy" and text["vae"] == "ae.safetensors"
    assert text["software"] == f"nxhpc {nxhpc.__version__}"
    # --precision bf16 reaches the decoder: the library's bf16 bits, not the f32 image
    r = run_cli("nxhpc", ["decode", "tiny-vae", "--latents", p, "--out", out, "--precision",
                          "bf16", "--json"], vae_dir.parent)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["precision"] == "bf16"
    with nxhpc.load_vae("tiny-vae", workers=1, precision="bf16",
                        models_dir=vae_dir.parent) as vae:
        want_bf16 = to_uint8(vae.decode(z)).astype(int)
    got_bf16 = _png(out)[0]
    np.testing.assert_array_equal(got_bf16, want_bf16)
    assert (got_bf16 != want).any()              # negative control: not the f32 image
    assert np.abs(got_bf16 - want).max() <= 3    # measured 2 levels
    assert _leftovers(tmp_path) == []


def test_decode_cli_bad_input(vae_dir, latents_file, tmp_path):
    p, z = latents_file
    root = vae_dir.parent
    out = tmp_path / "img.png"
    before = shm_entries()
    bad = {}
    for name, arr in (("wrong_channels", z[:4]), ("nan", np.where(z > 2, np.nan, z)),
                      ("flat", z[0]), ("ints", z.astype(np.int32))):
        bad[name] = tmp_path / f"{name}.npy"
        np.save(bad[name], arr)
    (tmp_path / "trunc").mkdir()
    blob = (vae_dir / "ae.safetensors").read_bytes()
    (tmp_path / "trunc" / "ae.safetensors").write_bytes(blob[:len(blob) // 2])
    (tmp_path / "junk.safetensors").write_bytes((10 ** 15).to_bytes(8, "little") + b"{}")
    (tmp_path / "file").write_text("x")
    cases = [
        (["tiny-vae", "--latents", bad["wrong_channels"]], Exit.BAD_INPUT, "16"),
        (["tiny-vae", "--latents", bad["nan"]], Exit.BAD_INPUT, "NaN"),
        (["tiny-vae", "--latents", bad["flat"]], Exit.BAD_INPUT, "expected [C, h, w]"),
        (["tiny-vae", "--latents", bad["ints"]], Exit.BAD_INPUT, "floating-point"),
        (["tiny-vae", "--latents", tmp_path / "absent.npy"], Exit.USAGE, "no such file"),
        (["tiny-vae", "0", "--latents", p], Exit.USAGE, "n_workers"),
        ([tmp_path / "absent", "--latents", p], Exit.NOT_FOUND, "no such file"),
        (["tiny-dit", "--latents", p], Exit.NOT_FOUND, "not an autoencoder"),
        ([tmp_path / "trunc", "--latents", p], Exit.BAD_INPUT, "ae.safetensors"),
        ([tmp_path / "junk.safetensors", "--latents", p], Exit.BAD_INPUT, "header"),
    ]
    for args, code, msg in cases:
        r = run_cli("nxhpc.decode", [*args, "--out", out], root)
        assert r.returncode == code, (args, r.returncode, r.stderr)
        assert msg in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
        assert not out.exists()
    # outputs that cannot be written, or that are inputs: refused before any work
    for o, msg in ((tmp_path, "is a directory"), (tmp_path / "no" / "x.png", "does not exist"),
                   (tmp_path / "file" / "x.png", "does not exist"), (p, "is an input"),
                   (vae_dir / "ae.safetensors", "is an input"),
                   (tmp_path / "x.jpeg", "a .jpeg name would hold PNG bytes")):
        r = run_cli("nxhpc.decode", ["tiny-vae", "--latents", p, "--out", o], root)
        assert r.returncode == Exit.USAGE and msg in r.stderr, (o, r.stderr)
    # a single file named: its neighbours are not the model's files (the second run refused to
    # overwrite its own first output beside ae.safetensors, as "a file of the model")
    single = tmp_path / "single"
    single.mkdir()
    (single / "ae.safetensors").write_bytes(blob)
    for _ in range(2):
        r = run_cli("nxhpc.decode", [single / "ae.safetensors", "--latents", p, "--out",
                                     single / "fox.png"], root)
        assert r.returncode == Exit.PASS, r.stderr
    r = run_cli("nxhpc.decode", [single / "ae.safetensors", "--latents", p, "--out",
                                 single / "ae.safetensors"], root)
    assert r.returncode == Exit.USAGE and "is an input" in r.stderr, r.stderr
    assert (single / "ae.safetensors").read_bytes() == blob
    assert np.array_equal(np.load(p), z)
    # a write that fails (a full disk): exit 8, an existing file unchanged
    r = run_cli("nxhpc.decode", ["tiny-vae", "--latents", p, "--out", "/dev/full"], root)
    assert r.returncode == Exit.OUTPUT and "could not write" in r.stderr, r.stderr
    out.write_bytes(b"old")
    r = run_cli("nxhpc.decode", ["tiny-vae", "--latents", bad["nan"], "--out", out, "2"], root)
    assert r.returncode == Exit.BAD_INPUT and out.read_bytes() == b"old"
    assert _leftovers(tmp_path) == [] and shm_entries() <= before
    r = run_cli("nxhpc.decode", ["--help"], root)
    assert r.returncode == 0 and "exit codes:" in r.stdout and "  4  bad input" in r.stdout


# ------------------------------------------------------------------------------ generate
def _generate(root, *args, expect=Exit.PASS):
    r = run_cli("nxhpc.generate", [*args, "--no-progress", "--json"], root, timeout=600)
    assert r.returncode == expect, (r.returncode, r.stderr[-3000:])
    return json.loads(r.stdout) if expect == Exit.PASS else r


@pytest.fixture(scope="module")
def pipeline(models_root, tmp_path_factory):
    """diffusers' ZImagePipeline of the tiny built-ins (float64 transformer, text encoder and
    autoencoder; transformers' tokenizer of the tiny-te file)."""
    from dataclasses import replace

    from diffusers import ZImagePipeline
    from pipeline_fixtures import CHAT_TEMPLATE, make_scheduler
    from transformers import Qwen2Tokenizer

    from nxhpc.dit.oracle import diffusers_zimage
    from nxhpc.models.qwen3_files import read_qwen3_gguf
    from nxhpc.models.zimage_files import read_zimage_gguf
    from nxhpc.qwen3.oracle import transformers_model
    from test_qwen3_tokenizer import write_hf_dir
    te_dir = registry.ensure_builtin("tiny-te", models_root)
    f = read_qwen3_gguf(te_dir / "model.gguf")
    vocab = (list(f.metadata["tokenizer.ggml.tokens"]),
             [int(t) for t in f.metadata["tokenizer.ggml.token_type"]],
             list(f.metadata["tokenizer.ggml.merges"]))
    tok = Qwen2Tokenizer.from_pretrained(str(write_hf_dir(tmp_path_factory.mktemp("hf"), vocab,
                                                          CHAT_TEMPLATE)))
    spec = registry.BUILTINS["tiny-te"]
    te_cfg = replace(spec.config(), eps=float(np.float32(spec.eps)),
                     rope_theta=float(np.float32(spec.rope_theta)))
    text_encoder = transformers_model(te_cfg, f.weights)
    dit_dir = registry.ensure_builtin("tiny-dit", models_root)
    dit = diffusers_zimage(registry.BUILTINS["tiny-dit"].config(),
                           read_zimage_gguf(dit_dir / "model.gguf").weights)
    vae_dir = registry.ensure_builtin("tiny-vae", models_root)
    pipe = ZImagePipeline(scheduler=make_scheduler(), vae=_diffusers_vae(vae_dir /
                                                                         "ae.safetensors"),
                          text_encoder=text_encoder, tokenizer=tok, transformer=dit)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _pipeline_png(pipe, prompt, seed, guidance=0.0, negative=None):
    noise = torch.from_numpy(initial_noise(seed, (16, PX // 8, PX // 8)))[None]
    img = pipe(prompt, height=PX, width=PX, num_inference_steps=8, guidance_scale=guidance,
               negative_prompt=negative, latents=noise, output_type="pil").images[0]
    return np.asarray(img).astype(int)


@pytest.mark.parametrize("guidance", [0.0, 2.5])
def test_generate_matches_zimage_pipeline(models_root, pipeline, tmp_path, guidance):
    out = tmp_path / "fox.png"
    extra = ["--guidance-scale", guidance, "--negative-prompt", "blurry"] if guidance else []
    rep = _generate(models_root, "--prompt", PROMPT, "--seed", 3, "--out", out,
                    "--workers", 2, *extra)
    got, text = _png(out)
    ref = _pipeline_png(pipeline, PROMPT, 3, guidance, "blurry" if guidance else None)
    diff = np.abs(got - ref)
    assert got.shape == (PX, PX, 3) and diff.max() <= 2, (diff.max(), np.mean(diff > 0))
    assert ref.std() > 10                                      # a picture, not a flat field
    assert rep["images"] == 1 and rep["height"] == rep["width"] == PX
    print(f"generate vs ZImagePipeline (guidance {guidance}): max {diff.max()} levels, "
          f"{np.mean(diff > 0):.4f} of the values differ")
    # negative controls: the same bound catches another prompt, another seed, swapped roles
    if not guidance:
        assert np.abs(got - _pipeline_png(pipeline, "a blue cube", 3)).max() > 2
        assert np.abs(got - _pipeline_png(pipeline, PROMPT, 4)).max() > 2
    else:
        flipped = _pipeline_png(pipeline, "blurry", 3, guidance, PROMPT)   # roles swapped
        assert np.abs(got - flipped).max() > 2
        assert text["negative_prompt"] == "blurry" and text["guidance_scale"] == str(guidance)


@pytest.mark.parametrize("guidance", [0.0, 2.5])
def test_generate_image_is_the_pipelines_picture(models_root, pipeline, guidance, tmp_path):
    """``nxhpc.generate_image`` (the library's prompt -> pixels) against diffusers'
    ``ZImagePipeline`` on the same tiny components and noise: within 2 levels, with and
    without guidance; another seed misses the bound (negative control); and the CLI's PNG of
    the same arguments, bit for bit."""
    kw = dict(guidance_scale=guidance, negative_prompt="blurry") if guidance else {}
    steps = []
    got = nxhpc.generate_image(PROMPT, seed=3, workers=2, models_dir=models_root,
                               on_step=lambda i, n, s: steps.append((i, n)), **kw)
    assert got.dtype == np.uint8 and got.shape == (PX, PX, 3)
    assert steps == [(i, 8) for i in range(8)]
    ref = _pipeline_png(pipeline, PROMPT, 3, guidance, "blurry" if guidance else None)
    assert np.abs(got.astype(int) - ref).max() <= 2 and ref.std() > 10
    assert np.abs(got.astype(int) - _pipeline_png(pipeline, PROMPT, 4, guidance,
                                                  "blurry" if guidance else None)).max() > 2
    # the given noise is the seed's noise: the same bits
    again = nxhpc.generate_image(PROMPT, noise=initial_noise(3, (16, PX // 8, PX // 8)),
                                 workers=1, models_dir=models_root, **kw)
    np.testing.assert_array_equal(again, got)
    # the CLI's PNG of the same arguments: the same bits
    out = tmp_path / "cli.png"
    extra = ["--guidance-scale", guidance, "--negative-prompt", "blurry"] if guidance else []
    _generate(models_root, "--prompt", PROMPT, "--seed", 3, "--out", out, "--workers", 2,
              *extra)
    np.testing.assert_array_equal(_png(out)[0], got)


def test_generate_image_checks_its_arguments_before_any_model(models_root, monkeypatch):
    """Bad arguments are TypeError/ValueError before a model is opened (nothing generated:
    an empty models directory stays empty); models that do not go together are named."""
    from nxhpc.models import registry as reg

    def no_model(*a, **k):
        raise AssertionError("a model was opened")
    monkeypatch.setattr(reg, "open_denoiser", no_model)
    bad = [({"prompt": 3}, TypeError, "expected str"),
           ({"prompt": "a\x00b"}, ValueError, "NUL"),
           ({"negative_prompt": "x"}, ValueError, "guidance_scale > 0"),
           ({"guidance_scale": -1.0}, ValueError, "guidance_scale"),
           ({"guidance_scale": float("nan")}, ValueError, "guidance_scale"),
           ({"model": "tiny-dit"}, ValueError, "missing: text_encoder, vae"),
           ({"height": 64}, ValueError, "both height and width"),
           ({"seed": 1, "noise": np.zeros((16, 8, 8), np.float32)}, ValueError, "not both"),
           ({"seed": -1}, ValueError, "seed"),
           ({"steps": 0}, ValueError, "steps"),
           ({"shift": 0.0}, ValueError, "shift"),
           ({"height": 72, "width": 64}, ValueError, "multiple of 16"),
           ({"height": 64.0, "width": 64}, ValueError, "multiple of 16"),
           ({"height": 32768, "width": 16}, ValueError, "at most 16384"),
           ({"on_step": 3}, TypeError, "on_step must be callable"),
           ({"workers": 0}, ValueError, "workers must be an integer >= 1"),
           ({"workers": 10**6}, ValueError, "workers must be at most"),    # no million forks
           ({"workers": True}, ValueError, "workers must be an integer"),
           ({"precision": "fp8"}, ValueError, "precision"),
           ({"q8_float_weights": "int4"}, ValueError, "q8_float_weights"),
           ({"model": "tiny-dit", "text_encoder": "no-such-te", "vae": "tiny-vae"},
            ModelNotFoundError, "no-such-te")]
    for extra, exc, words in bad:
        args = {"prompt": PROMPT, **extra}
        with pytest.raises(exc, match=words):
            nxhpc.generate_image(args.pop("prompt"), models_dir=models_root, **args)
    monkeypatch.undo()
    from nxhpc.dit.sampler import SampleInputError
    with pytest.raises(SampleInputError, match="noise"):
        nxhpc.generate_image(PROMPT, noise=np.zeros((4, 8, 8), np.float32),
                             models_dir=models_root, workers=1)


@pytest.mark.parametrize("precision, q8fw", [("bf16", "int8"), ("q8", "int8"), ("q8", "bf16")])
def test_generate_precision_is_the_library_result(models_root, tmp_path, precision, q8fw):
    """``--precision`` / ``--q8-float-weights`` reach all three models: the PNG has the bits of
    the library's encode -> sample -> decode at that precision, not the f32 run's, and the
    report says which. Under q8 (no int8 convolution) the decoder runs bf16 where the bf16
    matmul is faster (AMX, a fast AVX-512 BF16 dot), else f32 (on AVX2 bf16 was no faster and it
    was what q8 ran, undisclosed: the docs QA helper's find); the report and PNG name it."""
    from nxhpc.dit.sampler import sample
    from nxhpc.models.registry import open_denoiser
    from nxhpc.vae import to_uint8
    out = tmp_path / "p.png"
    rep = _generate(models_root, "--prompt", PROMPT, "--seed", 3, "--out", out, "--workers", 2,
                    "--precision", precision, "--q8-float-weights", q8fw)
    assert rep["precision"] == precision and rep["attention"].startswith("bf16")
    got, text = _png(out)
    # the float weights' choice changes q8's pixels: the PNG and the report name it under q8
    assert rep["q8_float_weights"] == (q8fw if precision == "q8" else None)
    assert text.get("q8_float_weights") == (q8fw if precision == "q8" else None)
    v = nxhpc.kernel_variants()["matmul_bf16"]
    bf16_unit = v == "amx" or (v == "avx512bf16" and
                               nxhpc.kernels().attention_bf16_dot() == "vdpbf16ps")
    vae_p = "bf16" if precision == "bf16" or bf16_unit else "f32"
    assert rep["vae_precision"] == text["vae_precision"] == vae_p, (rep, text)
    if precision == "q8":
        assert f"float weights, VAE {vae_p})" in text["parameters"], text["parameters"]

    def library(p, vae_p=vae_p):
        kw = dict(workers=2, models_dir=models_root)
        with nxhpc.load_text_encoder("tiny-te", precision=p, q8_float_weights=q8fw,
                                     **kw) as enc:
            cap = enc.encode(PROMPT)
        with open_denoiser("tiny-dit", precision=p, q8_float_weights=q8fw, **kw) as den:
            lat = sample(den, cap, initial_noise(3, (16, PX // 8, PX // 8)), steps=8, shift=3.0)
        with nxhpc.load_vae("tiny-vae", precision=vae_p, **kw) as vae:
            return to_uint8(vae.decode(lat)).astype(int)

    np.testing.assert_array_equal(got, library(precision))
    assert (got != library("f32", "f32")).any()         # negative control: not the f32 image
    if precision == "q8":                                # nor decoded at the other precision
        assert (got != library("q8", {"f32": "bf16", "bf16": "f32"}[vae_p])).any()


@pytest.mark.parametrize("dot", ["vdpbf16ps", "fma"])
def test_decoder_precision_under_q8_follows_the_bf16_unit(monkeypatch, dot):
    """The rule, on the kernel variants of each CPU class (a spec table, not this CPU's): bf16
    on AMX, and on AVX-512 BF16 only where vdpbf16ps outruns the FMA (Zen 4, not an Intel
    Xeon without its tiles, where it runs at half the rate)."""
    from nxhpc.nn import conv
    monkeypatch.setattr(conv, "_bf16_dot", lambda: dot)
    for variant, want in (("amx", "bf16"), ("avx512bf16", "bf16" if dot == "vdpbf16ps" else
                                            "f32"), ("avx512", "f32"), ("avx2", "f32"),
                          ("generic", "f32")):
        assert conv.decoder_precision("q8", {"matmul_bf16": variant}) == want, variant
        assert conv.decoder_precision("bf16", {"matmul_bf16": variant}) == "bf16"
        assert conv.decoder_precision("f32", {"matmul_bf16": variant}) == "f32"


def test_generate_fresh_machine_defaults(tmp_path):
    """No model arguments: the tiny built-ins are generated into an empty models directory,
    64x64, the report says the weights are random; the PNG carries the parameters."""
    root = tmp_path / "models"
    out = tmp_path / "fox.png"
    r = run_cli("nxhpc.generate", ["--prompt", "a fox", "--out", out], root, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "note=random weights: a noise picture" in r.stdout
    assert sorted(n for n in os.listdir(root) if not n.startswith(".")) == \
        ["tiny-dit", "tiny-te", "tiny-vae"]
    for stage in ("encode_s", "denoise_s", "decode_s", "total_s", "peak_rss_mb"):
        assert f"\n{stage}=" in r.stdout, stage
    assert "generate: decode" in r.stderr and "100%" in r.stderr     # the one progress bar
    got, text = _png(out)
    assert got.shape == (64, 64, 3) and got.std() > 5
    assert text["prompt"] == "a fox" and text["seed"] == "0" and text["steps"] == "8"
    assert text["shift"] == "3.0" and text["model"] == "tiny-dit/model.gguf"
    assert text["text_encoder"] == "tiny-te/model.gguf" and text["vae"] == "tiny-vae/ae.safetensors"
    assert text["software"] == f"nxhpc {nxhpc.__version__}"
    assert text["parameters"].startswith("a fox\nSteps: 8, ") and "Seed: 0" in text["parameters"]
    # other tools' "CFG scale" (neg + cfg (pos - neg)): 1 is no guidance, the Turbo default G = 0
    assert "CFG scale: 1," in text["parameters"] and text["guidance_scale"] == "0.0"
    # the noise is nxhpc.sample's: the same seed's noise given as a file gives the same PNG
    noise = tmp_path / "n.npy"
    np.save(noise, initial_noise(0, (16, 8, 8)))
    rep = _generate(root, "--prompt", "a fox", "--noise", noise, "--out", tmp_path / "n.png")
    assert rep["seeds"] is None and rep["height"] == 64
    got_n, text_n = _png(tmp_path / "n.png")
    np.testing.assert_array_equal(got_n, got)
    # no seed drew it: no Seed entry (other tools read Seed as an int) and no seed chunk
    assert "seed" not in text_n and text_n["noise"] == "n.npy"
    assert "Seed" not in text_n["parameters"] and "Size: 64x64" in text_n["parameters"]


def test_generate_several_images(models_root, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a fox\n\nan owl at night\n")
    outd = tmp_path / "out"
    outd.mkdir()
    rep = _generate(models_root, "--prompts", prompts, "--seeds", "5,6", "--out", outd,
                    "--height", 32, "--width", 48)
    names = ["000-seed5.png", "001-seed6.png", "002-seed5.png", "003-seed6.png"]
    assert sorted(os.listdir(outd)) == names and rep["images"] == 4
    assert rep["prompts"] == 2 and rep["seeds"] == [5, 6, 5, 6]
    imgs = [_png(outd / n) for n in names]
    assert [t["prompt"] for _, t in imgs] == ["a fox", "a fox", "an owl at night",
                                             "an owl at night"]
    assert all(a.shape == (32, 48, 3) for a, _ in imgs)
    # each image is what a run of its own makes (one open denoiser serves them all)
    one = tmp_path / "one.png"
    _generate(models_root, "--prompt", "an owl at night", "--seed", 6, "--out", one,
              "--height", 32, "--width", 48)
    np.testing.assert_array_equal(_png(one)[0], imgs[3][0])
    assert np.abs(imgs[2][0] - imgs[3][0]).max() > 0
    # a second batch into the same folder would make the same names: refused up front, the
    # first batch's images kept byte for byte (they were once silently overwritten)
    before = {n: (outd / n).read_bytes() for n in names}
    r = _generate(models_root, "--prompt", "a cat", "--seeds", "5,7", "--out", outd,
                  "--height", 32, "--width", 48, expect=Exit.USAGE)
    assert "already holds 000-seed5.png" in r.stderr, r.stderr
    assert {n: (outd / n).read_bytes() for n in os.listdir(outd)} == before


def test_note_names_the_tiny_components_a_run_uses(models_root, tmp_path):
    """The report's note says which components have random weights: all three built-ins given
    by id (and, explicitly named, the real default size 1024 would apply: --height/--width
    given here), or only some of them beside another file (it said "the built-in tiny
    components" for a run with its own autoencoder)."""
    other = make_vae_model(tmp_path / "vae", VaeSpec(seed=1))
    common = ["--prompt", "a fox", "--steps", 1, "--height", 32, "--width", 32, "--model",
              "tiny-dit", "--text-encoder", "tiny-te"]
    rep = _generate(models_root, *common, "--vae", "tiny-vae", "--out", tmp_path / "a.png")
    assert rep["note"] == "random weights: a noise picture (the built-in tiny components)"
    rep = _generate(models_root, *common, "--vae", other, "--out", tmp_path / "b.png")
    assert rep["note"] == "random weights in the built-in tiny-dit, tiny-te: a noise picture"


def test_prompt_files_split_at_newlines_only(tmp_path):
    """--prompts: a line ends at \\n, \\r\\n or \\r (Python's universal newlines), never at the
    other characters str.splitlines() takes (U+2028 and the like in text pasted from documents
    once made two prompts of one line); a leading byte-order mark is not part of the first
    prompt; error line numbers count those same lines."""
    import argparse

    from nxhpc.generate import _prompts
    odd = ["\u2028", "\u2029", "\x85", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e"]
    assert all(len(f"a{c}b".splitlines()) == 2 for c in odd)     # what splitlines() would do
    lines = [f"a fox{c}in the snow" for c in odd]
    f = tmp_path / "p.txt"
    f.write_bytes("\ufeff".encode() + "\r\n".join(lines[:4]).encode() + b"\r\r"
                  + "\n".join(lines[4:]).encode() + b"\r\n")
    got = _prompts(argparse.Namespace(prompt=None, prompts=str(f)))
    assert got == lines
    f.write_bytes("one\u2028line\r\ntwo\x00\n".encode())
    with pytest.raises(UsageError, match="line 2: contains a NUL"):
        _prompts(argparse.Namespace(prompt=None, prompts=str(f)))


def test_generate_reads_prompts_from_standard_input(models_root, tmp_path):
    """--prompts - reads standard input (a FIFO path stays refused: it would wait for a
    writer); the PNGs carry the prompts as the file's lines give them."""
    outd = tmp_path / "out"
    outd.mkdir()
    r = run_cli("nxhpc.generate", ["--prompts", "-", "--seed", 3, "--out", outd, "--height", 32,
                                   "--width", 32, "--no-progress", "--json"], models_root,
                timeout=600, input="\ufeffa fox\r\n\r\nan owl\u2028at night\r\n")
    assert r.returncode == Exit.PASS, r.stderr[-3000:]
    texts = [_png(outd / n)[1]["prompt"] for n in sorted(os.listdir(outd))]
    assert texts == ["a fox", "an owl\u2028at night"]


def test_outputs_beside_a_model_named_by_its_path(models_root, tmp_path):
    """A model directory named by its path: the run's own earlier output there may be written
    again (the first fix of the built-ins' protection refused it, "is an input"), while the
    model's files there (its manifest and spec included) are still refused."""
    import shutil

    from nxhpc.models.registry import ensure_builtin
    d = tmp_path / "mydit"
    shutil.copytree(ensure_builtin("tiny-dit", models_root), d)
    args = ["--prompt", "a fox", "--model", d, "--text-encoder", "tiny-te", "--vae", "tiny-vae"]
    for _ in range(2):
        _generate(models_root, *args, "--out", d / "img.png")
    for name in (".nxhpc-files.json", "synthetic.json", "model.gguf", "fixtures.safetensors"):
        r = _generate(models_root, *args, "--out", d / name, expect=Exit.USAGE)
        assert "is an input" in r.stderr, (name, r.stderr)


def test_generate_bad_input(models_root, tmp_path):
    before = shm_entries()
    out = tmp_path / "x.png"
    nan = tmp_path / "nan.npy"
    np.save(nan, np.full((16, 8, 8), np.nan, np.float32))
    wrong = tmp_path / "wrong.npy"
    np.save(wrong, np.zeros((4, 8, 8), np.float32))
    te = tmp_path / "te"
    from nxhpc.models.qwen3_files import TextEncoderSpec, make_text_encoder
    make_text_encoder(te, TextEncoderSpec(dim=128, n_heads=2, n_kv_heads=1, ffn=256))
    short = tmp_path / "te32"                    # tiny-te's weights, a context of 32 tokens
    make_text_encoder(short, TextEncoderSpec(context_length=32))
    (tmp_path / "empty.txt").write_text("\n \n")
    (tmp_path / "p.txt").write_text("a fox\n")
    (tmp_path / "nul.txt").write_bytes(b"a fox\nan \x00owl\n")
    (tmp_path / "latin1.txt").write_bytes(b"a fox\n\xe9t\xe9\n")
    os.mkfifo(tmp_path / "fifo")
    not_utf8 = os.fsdecode(b"a \xff fox")          # an argument's bytes that are not UTF-8
    P = ["--prompt", "a fox"]
    cases = [
        ([*P, "--height", 100, "--width", 64], Exit.USAGE, "multiple of 16"),
        ([*P, "--height", 8, "--width", 64], Exit.USAGE, "got 8; e.g. 16\n"),   # not "16 or 16"
        ([*P, "--height", 64], Exit.USAGE, "both --height and --width"),
        # one image twice under two names (sample refused it already; the one parser now)
        ([*P, "--seeds", "3,1,3"], Exit.USAGE, "seeds must be distinct"),
        ([*P, "--model", "tiny-dit"], Exit.USAGE, "--text-encoder, --vae"),
        ([*P, "--steps", 0], Exit.USAGE, "--steps"),
        ([*P, "--seed", 1, "--noise", nan], Exit.USAGE, "not allowed with"),
        ([*P, "--seeds", "1,,2"], Exit.USAGE, "comma-separated"),
        ([*P, "--negative-prompt", "x"], Exit.USAGE, "--guidance-scale"),
        ([*P, "--guidance-scale", "-1"], Exit.USAGE, ">= 0"),
        ([*P, "--seeds", "1,2"], Exit.USAGE, "need an existing folder"),
        (["--prompts", tmp_path / "empty.txt"], Exit.USAGE, "no prompt"),
        (["--prompts", tmp_path / "absent.txt"], Exit.USAGE, "no such file"),
        # text the tokenizer cannot take, and inputs that are not regular files (README: 2)
        (["--prompt", not_utf8], Exit.USAGE, "--prompt: byte 0xff (character 2) is not UTF-8"),
        ([*P, "--guidance-scale", 1, "--negative-prompt", not_utf8], Exit.USAGE,
         "--negative-prompt: byte 0xff (character 2) is not UTF-8"),
        (["--prompts", tmp_path / "nul.txt"], Exit.USAGE, "line 2: contains a NUL"),
        (["--prompts", tmp_path / "latin1.txt"], Exit.USAGE, "not UTF-8 text (byte 0xe9"),
        (["--prompts", tmp_path / "fifo"], Exit.USAGE,
         "is a FIFO, not a regular file (give - to read standard input)"),
        (["--prompts", "/dev/null"], Exit.USAGE, "is a character device"),
        (["--prompts", tmp_path], Exit.USAGE, "is a directory, expected a text file"),
        ([*P, "--noise", tmp_path / "absent.npy"], Exit.USAGE, "no such file"),
        ([*P, "--noise", nan], Exit.BAD_INPUT, "NaN"),
        ([*P, "--noise", wrong], Exit.BAD_INPUT, "expected [16, H, W]"),
        ([*P, "--model", "tiny-dit", "--text-encoder", te, "--vae", "tiny-vae"],
         Exit.BAD_INPUT, "cap_dim is 320"),
        (["--prompt", "a fox in the snow at dawn with a red tail", "--model", "tiny-dit",
          "--text-encoder", short, "--vae", "tiny-vae"], Exit.BAD_INPUT,
         "the prompt: 33 ids exceed the model's context length 32"),
        ([*P, "--model", "tiny-dit", "--text-encoder", "tiny-te", "--vae", tmp_path / "no"],
         Exit.NOT_FOUND, "no such file"),
        ([*P, "--model", "tiny-dit", "--text-encoder", "tiny-te", "--vae", "tiny-te"],
         Exit.NOT_FOUND, "not an autoencoder"),
    ]
    for args, code, msg in cases:
        r = _generate(models_root, *args, "--out", out, expect=code)
        assert msg in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
        assert not out.exists()
    # every file of a built-in the run opens (its manifest and spec too: they were overwritten
    # with exit 0, and the next run regenerated the model); a trailing '/' names a folder;
    # the run's own stdout, where the report goes
    for o, msg in ((tmp_path / "no" / "x.png", "does not exist"),
                   (models_root / "tiny-vae" / "ae.safetensors", "is an input"),
                   (models_root / "tiny-vae" / "synthetic.json", "is an input"),
                   (models_root / "tiny-dit" / ".nxhpc-files.json", "is an input"),
                   (models_root / "tiny-te" / ".nxhpc-files.json", "is an input"),
                   (f"{tmp_path}/pngs/", "ends with '/'"), (f"{tmp_path}/p.txt/", "ends with '/'"),
                   (tmp_path / "fox.JPG", "nxhpc writes PNG images; a .JPG name"),
                   ("/dev/stdout", "standard output"),
                   (tmp_path / "p.txt", "is an input")):
        extra = ["--prompts", o] if str(o).endswith("p.txt") else P
        r = _generate(models_root, *extra, "--out", o, expect=Exit.USAGE)
        assert msg in r.stderr, (o, r.stderr)
    assert (tmp_path / "p.txt").read_text() == "a fox\n"
    r = _generate(models_root, *P, "--out", "/dev/full", expect=Exit.OUTPUT)
    assert "could not write the PNG" in r.stderr
    assert _leftovers(tmp_path) == [] and shm_entries() <= before
    r = run_cli("nxhpc.generate", ["--help"], models_root)
    assert r.returncode == 0 and "exit codes:" in r.stdout and "tiny-vae" in r.stdout


def test_generate_error_clears_the_progress_bar(models_root, tmp_path):
    """With the progress bar on, an error inside the run (a text encoder whose width does not
    fit the transformer) clears the bar's line before the message, instead of leaving a stale
    bar in front of it; the bar names the stage it is in from the start ("open")."""
    from nxhpc.models.qwen3_files import TextEncoderSpec, make_text_encoder
    te = tmp_path / "te"
    make_text_encoder(te, TextEncoderSpec(dim=128, n_heads=2, n_kv_heads=1, ffn=256))
    short = tmp_path / "te32"                    # tiny-te's weights, a context of 32 tokens
    make_text_encoder(short, TextEncoderSpec(context_length=32))
    out = tmp_path / "x.png"
    # bytes, not text: text mode would turn the bar's carriage returns into newlines
    r = subprocess.run([sys.executable, "-m", "nxhpc.generate", "--prompt", "a fox", "--model",
                        "tiny-dit", "--text-encoder", str(te), "--vae", "tiny-vae", "--out",
                        str(out)], capture_output=True, env=models_env(models_root), timeout=600)
    err = r.stderr.decode()
    assert r.returncode == Exit.BAD_INPUT and "cap_dim is 320" in err, err
    head = err.split("generate: error:")[0]
    assert "generate: open" in head, head              # the bar was shown
    # the last thing before the message: carriage return, blanks, carriage return (tqdm's clear);
    # a bar closed the usual way ends with its last frame and a newline instead
    assert head.endswith("\r") and head[:-1].rsplit("\r", 1)[-1].strip() == "", repr(head[-200:])
    assert not out.exists()


@pytest.mark.parametrize("guidance", ["0", "1"])
@pytest.mark.parametrize("noise, step", [(3.3e38, "step 1 (t=0.0454545): the latents left "
                                                  "float32's range (NaN/inf after step 0)"),
                                         (1e38, "the final latents have 1024 of 1024 values "
                                                "NaN/inf")])
def test_latents_leaving_float32_are_exit_1_with_or_without_guidance(
        models_root, tmp_path, monkeypatch, capsys, guidance, noise, step):
    """A denoiser whose finite outputs push the Euler update past float32 ends the run with
    exit 1 naming the step, with guidance as without (with guidance it was exit 4, "latents:
    ... NaN or inf", blamed on the input: the guided loop skipped the sampler's checks); no
    PNG is written. A NaN from the guided denoiser also names its step."""
    from nxhpc import generate
    from nxhpc.dit import denoiser as D
    real = D.Denoiser.forward

    def huge(self, latents, t, cap):       # finite, as large as float32 holds
        return np.full(np.shape(latents), 3e38, np.float32)
    monkeypatch.setattr(D.Denoiser, "forward", huge)
    np.save(tmp_path / "n.npy", np.full((16, 8, 8), noise, np.float32))
    out = tmp_path / "o.png"
    argv = ["--prompt", "a", "--noise", str(tmp_path / "n.npy"), "--out", str(out),
            "--no-progress", "--guidance-scale", guidance, "--workers", "1", "--models-dir",
            str(models_root)]
    assert generate.main(argv) == Exit.FAIL
    err = capsys.readouterr().err
    assert f"generate: error: {step}" in err, err
    assert not out.exists()
    calls = []

    def nan_at_step_1(self, latents, t, cap):
        calls.append(t)
        r = real(self, latents, t, cap)
        return r * np.float32("nan") if len(calls) > 2 else r    # step 1 (two calls a step)
    monkeypatch.setattr(D.Denoiser, "forward", nan_at_step_1)
    np.save(tmp_path / "n.npy", initial_noise(0, (16, 8, 8)))
    assert generate.main(argv[:8] + ["1"] + argv[9:]) == Exit.FAIL      # guidance 1
    err = capsys.readouterr().err
    assert "step 1 (t=0.0454545): the guided output returned NaN/inf (1024 of 1024 values)" \
        in err, err
    assert not out.exists()


def test_decoder_memory_is_checked_before_the_steps(models_root, tmp_path, monkeypatch, capsys):
    """A /dev/shm too small for the decode's arena (a 1024x1024 image's takes 2.7 GiB; docker
    gives 64 MiB) is exit 7 naming the autoencoder's decode, before the prompt is encoded or a
    step runs -- not after an hour of steps. Control: the same run with the room it needs
    writes its PNG."""
    from nxhpc import generate
    from nxhpc.runtime import shm
    from nxhpc.vae import model as vae_model
    need = []
    real_check = vae_model.VaeDecoder.check_room

    def check_room(self, h, w, **kw):
        need.append(real_check(self, h, w, **kw))
        return need[-1]
    monkeypatch.setattr(vae_model.VaeDecoder, "check_room", check_room)
    encoded = []
    real_encode = generate._encode
    monkeypatch.setattr(generate, "_encode", lambda *a, **k: encoded.append(1) or
                        real_encode(*a, **k))
    out = tmp_path / "o.png"
    argv = ["--prompt", "a", "--height", "256", "--width", "256", "--steps", "1", "--out",
            str(out), "--no-progress", "--workers", "2", "--models-dir", str(models_root)]
    free = [1 << 40]
    monkeypatch.setattr(shm, "shm_free_bytes", lambda where=shm.SHM_DIR: free[0])
    assert generate.main(argv) == Exit.PASS          # control: room enough, the whole run
    assert out.exists() and encoded and need[0] > 8 << 20, need
    out.unlink()
    encoded.clear()
    free[0] = need[0] - 64                           # a little less than the decode needs
    assert generate.main(argv) == Exit.SHM
    err = capsys.readouterr().err
    assert "generate: error: the autoencoder's decode at 256x256: not enough shared memory" \
        in err and f"needs {need[0]} bytes" in err and f"{need[0] - 64} bytes free" in err, err
    assert not encoded and not out.exists()


def test_a_text_encoder_folder_with_its_gguf_under_another_name(models_root, tmp_path, capsys):
    """``--text-encoder DIR`` whose GGUF is not named model.gguf (a download folder: the
    encoder reads its only .gguf) was exit 70 (a TypeError in the output check); it runs, and
    that GGUF is still refused as --out (control)."""
    import shutil

    from nxhpc import generate
    te = tmp_path / "qwen"
    te.mkdir()
    shutil.copy(registry.ensure_builtin("tiny-te", models_root) / "model.gguf",
                te / "Qwen3-4B-Q8_0.gguf")
    argv = ["--prompt", "a fox", "--model", "tiny-dit", "--text-encoder", str(te), "--vae",
            "tiny-vae", "--no-progress", "--workers", "1", "--models-dir", str(models_root),
            "--out"]
    assert generate.main([*argv, str(tmp_path / "x.png")]) == Exit.PASS, capsys.readouterr().err
    assert (tmp_path / "x.png").is_file()
    assert generate.main([*argv, str(te / "Qwen3-4B-Q8_0.gguf")]) == Exit.USAGE
    assert "input of this run" in capsys.readouterr().err


def test_a_transformer_folder_with_its_gguf_under_another_name(models_root, tmp_path, capsys):
    """``--model DIR`` holding one GGUF under its download name was exit 3 ("no model.gguf"),
    where the text encoder's folder and ``models show DIR`` read its only .gguf: the
    transformer does too, with the picture of the built-in it copies, and that GGUF is still
    refused as --out. Controls: a folder of two GGUFs names both and is exit 3; none is exit 3."""
    import shutil

    from nxhpc import generate
    dit = tmp_path / "zimage"
    dit.mkdir()
    src = registry.ensure_builtin("tiny-dit", models_root) / "model.gguf"
    shutil.copy(src, dit / "z_image_turbo-Q8_0.gguf")
    base = ["--prompt", "a fox", "--text-encoder", "tiny-te", "--vae", "tiny-vae",
            "--no-progress", "--workers", "1", "--models-dir", str(models_root), "--out"]
    assert generate.main(["--model", "tiny-dit", *base, str(tmp_path / "a.png")]) == Exit.PASS
    assert generate.main(["--model", str(dit), *base, str(tmp_path / "b.png")]) == Exit.PASS, \
        capsys.readouterr().err
    (a, _), (b, text) = _png(tmp_path / "a.png"), _png(tmp_path / "b.png")
    np.testing.assert_array_equal(a, b)                  # the chunks name the file they read
    assert text["model"] == "z_image_turbo-Q8_0.gguf", text
    assert generate.main(["--model", str(dit), *base, str(dit / "z_image_turbo-Q8_0.gguf")]) \
        == Exit.USAGE and "input of this run" in capsys.readouterr().err
    shutil.copy(src, dit / "other.gguf")
    assert generate.main(["--model", str(dit), *base, str(tmp_path / "c.png")]) == Exit.NOT_FOUND
    assert "2 .gguf files (other.gguf, z_image_turbo-Q8_0.gguf)" in capsys.readouterr().err
    for g in dit.glob("*.gguf"):
        g.unlink()
    assert generate.main(["--model", str(dit), *base, str(tmp_path / "c.png")]) == Exit.NOT_FOUND
    assert "no .gguf file in this directory (a denoiser runs from a GGUF file)" in \
        capsys.readouterr().err
    assert not (tmp_path / "c.png").exists()


# ------------------------------------------------------------------ --stage-timeout everywhere
def _hang_in_pool(monkeypatch, which: int) -> list:
    """Pools made from here on record their ``stage_timeout``; the tasks of the ``which``-th
    (0 = the first) hang in every worker but the parent's band (a stuck worker)."""
    import time

    from nxhpc.runtime import workers as W
    real_init = W.WorkerPool.__init__
    made: list = []

    def hang(fn):
        def task(lo, hi, arg):
            if lo > 0:
                time.sleep(120)
            return fn(lo, hi, arg)
        return task

    def init(self, n, tasks, *a, **k):
        if len(made) == which:
            tasks = {name: hang(fn) for name, fn in tasks.items()}
        made.append(k.get("stage_timeout"))
        real_init(self, n, tasks, *a, **k)
    monkeypatch.setattr(W.WorkerPool, "__init__", init)
    return made


@pytest.mark.parametrize("which, model", [(0, "text encoder"), (1, "transformer"),
                                          (2, "autoencoder")])
def test_generate_stage_timeout_reaches_every_model(models_root, tmp_path, monkeypatch, capsys,
                                                    which, model):
    """``generate`` had no ``--stage-timeout``: a worker stuck in any of its three models hung
    the run for good. Each model's pool now gets it: exit 6 naming the stage timeout, nothing
    written, no shared memory left. Control: the same hang in another model's pool is met
    there (the pools are made in the order text encoder, transformer, autoencoder)."""
    import time

    from nxhpc import generate
    made = _hang_in_pool(monkeypatch, which)
    out = tmp_path / "o.png"
    before = shm_entries()
    t0 = time.monotonic()
    code = generate.main(["--prompt", PROMPT, "--steps", "2", "--workers", "2",
                          "--stage-timeout", "2", "--out", str(out), "--no-progress",
                          "--models-dir", str(models_root)])
    err = capsys.readouterr().err
    assert code == Exit.WORKER, (model, err)
    assert "within the stage timeout of 2 s" in err, err
    assert time.monotonic() - t0 < 60
    assert made == [2.0] * (which + 1), (model, made)     # the hung pool was the last made
    assert not out.exists() and shm_entries() <= before


def test_sample_decode_and_generate_image_take_the_stage_timeout(models_root, latents_file,
                                                                tmp_path, monkeypatch, capsys):
    """``sample`` and ``decode`` take ``--stage-timeout``, ``generate_image`` and ``load_vae``
    ``stage_timeout``: a stuck worker fails the run (exit 6 / WorkerError) instead of hanging
    it; bad values are refused before any model opens."""
    import time

    from nxhpc import decode, sample
    from nxhpc.runtime.workers import WorkerError
    cap = tmp_path / "cap.npy"
    np.save(cap, np.random.default_rng(3).standard_normal((7, 320)).astype(np.float32))
    before = shm_entries()
    runs = [(sample.main, ["tiny-dit", "2", "--cap-feats", str(cap), "--height", "64",
                           "--width", "64", "--steps", "2", "--out", str(tmp_path / "l.npy")]),
            (decode.main, ["tiny-vae", "2", "--latents", str(latents_file[0]),
                           "--out", str(tmp_path / "d.png")])]
    for main, argv in runs:
        made = _hang_in_pool(monkeypatch, 0)
        t0 = time.monotonic()
        code = main([*argv, "--stage-timeout", "2", "--models-dir", str(models_root),
                     "--no-progress"] if main is sample.main else
                    [*argv, "--stage-timeout", "2", "--models-dir", str(models_root)])
        err = capsys.readouterr().err
        assert code == Exit.WORKER and "within the stage timeout of 2 s" in err, err
        assert made == [2.0] and time.monotonic() - t0 < 60
        monkeypatch.undo()
    assert not (tmp_path / "l.npy").exists() and not (tmp_path / "d.png").exists()
    made = _hang_in_pool(monkeypatch, 1)
    with pytest.raises(WorkerError, match="within the stage timeout of 2 s"):
        nxhpc.generate_image(PROMPT, steps=2, workers=2, stage_timeout=2,
                             models_dir=models_root)
    assert made == [2.0, 2.0]
    for bad in (0, -1, float("nan"), "5"):
        with pytest.raises((ValueError, TypeError), match="stage_timeout"):
            nxhpc.generate_image(PROMPT, stage_timeout=bad, models_dir=tmp_path / "none")
        with pytest.raises((ValueError, TypeError), match="stage_timeout"):
            nxhpc.load_vae("tiny-vae", stage_timeout=bad, models_dir=tmp_path / "none")
    assert not (tmp_path / "none").exists()          # refused before a built-in was made
    assert shm_entries() <= before


def test_a_batch_never_replaces_an_image_that_appeared_meanwhile(models_root, tmp_path,
                                                                 monkeypatch, capsys):
    """Two batches into one folder: each checked the names free before its work, then both
    wrote, the later replacing the earlier's images (both exit 0; the environment helper saw
    mixed folders 3 runs in 5). A made-up name is now put in place only if it is still free:
    the run that finds an image there stops, exit 8, naming it and what it wrote, and leaves
    the other run's file as it is. Control: the image before it was written."""
    from nxhpc import generate
    from nxhpc.vae import image
    outd = tmp_path / "out"
    outd.mkdir()
    prompts = tmp_path / "p.txt"
    prompts.write_text("a fox\nan owl\n")
    real = image.write_png

    def racing(path, pixels, text=None, **kw):
        if Path(path).name.startswith("001-"):      # another run's image lands first
            Path(path).write_bytes(b"the other run's image")
        return real(path, pixels, text, **kw)
    monkeypatch.setattr(image, "write_png", racing)
    rc = generate.main(["--prompts", str(prompts), "--seed", "1", "--out", str(outd),
                        "--height", "32", "--width", "32", "--no-progress", "--workers", "1",
                        "--models-dir", str(models_root)])
    err = capsys.readouterr().err
    assert rc == Exit.OUTPUT, err
    assert "appeared meanwhile" in err and "000-seed1.png" in err, err
    assert (outd / "001-seed1.png").read_bytes() == b"the other run's image"
    assert _png(outd / "000-seed1.png")[1]["prompt"] == "a fox"
    assert not _leftovers(outd)


def test_prompts_from_an_endless_stream_are_refused(models_root, tmp_path):
    """``generate --prompts -`` read all of standard input: ``< /dev/zero`` or ``yes |`` grew
    until the kernel's OOM killer ended it (the environment helper's run reached 23.7 GB). At
    most MAX_TEXT_BYTES are read: more is exit 2 before any model work. Control: a little less
    is read whole (its last line, a NUL, is then refused by its line number)."""
    from nxhpc.cli.args import MAX_TEXT_BYTES
    outd = tmp_path / "out"
    outd.mkdir()
    argv = [sys.executable, "-m", "nxhpc.generate", "--prompts", "-", "--out", str(outd),
            "--no-progress"]

    def run(data: bytes) -> subprocess.CompletedProcess:
        return subprocess.run(argv, input=data, capture_output=True, timeout=600,
                              env=models_env(models_root))
    r = run(b"a fox\n" * (MAX_TEXT_BYTES // 6 + 1))
    assert r.returncode == Exit.USAGE, r.stderr[-2000:]
    assert b"--prompts -: more than 64 MiB of text" in r.stderr
    r = run((b"a" * 999_999 + b"\n") * 67 + b"\0")        # 67,000,001 bytes: all read
    assert r.returncode == Exit.USAGE, r.stderr[-2000:]
    assert b"line 68: contains a NUL character" in r.stderr, r.stderr[-2000:]
    assert not list(outd.iterdir())


@pytest.mark.parametrize("setting", [{"TQDM_MININTERVAL": "abc"},      # met on import
                                     {"TQDM_BAR_FORMAT": "{nope}"}])     # on the first draw
def test_a_bad_tqdm_setting_runs_without_the_bar(models_root, tmp_path, setting):
    """``TQDM_MININTERVAL=abc`` made tqdm's import raise ValueError, ``TQDM_BAR_FORMAT='{x}'``
    its first draw a KeyError: exit 70 with a traceback, though the bar must never fail a run
    (the environment helper's and the reviewer's finds). The run goes on without the bar."""
    out = tmp_path / "x.png"
    r = subprocess.run([sys.executable, "-m", "nxhpc.generate", "--prompt", "a fox", "--out",
                        str(out)], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, NXHPC_MODELS=str(models_root), **setting))
    assert r.returncode == Exit.PASS and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert out.is_file()


def test_the_transformers_memory_is_checked_before_the_encoding(models_root, tmp_path,
                                                                monkeypatch, capsys):
    """The transformer's arena is built at the first step: an image whose arena could not fit
    was refused only after the models were opened and the prompt encoded (the memory helper's
    run: 20 s of a 2-layer slice; with Qwen3-4B much longer). It is checked with the
    decoder's now, before the text encoder is opened, exit 7 naming it; the library does the
    same. Controls: ``arena_bytes`` is the size of the arena a call then builds."""
    from nxhpc import generate
    from nxhpc.dit.denoiser import Denoiser
    from nxhpc.models.registry import open_denoiser
    with open_denoiser("tiny-dit", workers=1, models_dir=models_root) as den:
        cap = np.random.default_rng(0).standard_normal((11, den.config.cap_dim)) \
            .astype(np.float32)
        den.forward(initial_noise(0, (16, 6, 4)), 0.5, cap)
        built = den.session(6, 4, 11).engine.arena.nbytes
        assert den.arena_bytes(6, 4, 11) == built and built > 0
        assert den.arena_bytes(6, 4, 100) > built         # more caption rows, more arena
    monkeypatch.setattr(Denoiser, "arena_bytes", lambda self, H, W, L=512: 1 << 50)
    monkeypatch.setattr(nxhpc, "load_text_encoder",
                        lambda *a, **k: pytest.fail("the text encoder was opened"))
    rc = generate.main(["--prompt", "a fox", "--out", str(tmp_path / "x.png"), "--no-progress",
                        "--models-dir", str(models_root)])
    err = capsys.readouterr().err
    assert rc == Exit.SHM and "the denoiser's arena at 8x8 latents" in err, err
    assert not (tmp_path / "x.png").exists()
    with pytest.raises(OSError, match="the denoiser's arena"):
        nxhpc.generate_image("a fox", models_dir=models_root)


def test_prompts_whose_features_cannot_fit_are_refused_before_the_encoding(
        models_root, tmp_path, monkeypatch, capsys):
    """``--prompts`` keeps every prompt's features until the last image (up to 5.2 MB a prompt
    with Qwen3-4B): a list whose features could not fit beside the denoiser's arena was found
    out only when the memory ran out, after the encoding (the memory helper's reading). The
    features are counted from the token counts before the first prompt is encoded, exit 7
    naming them and the advice. The memory available is made 64 MiB and the arena (whose own
    check is not under test here) all of it less 1 MiB; three 512-token prompts' features are
    3 x 512 x 320 x 4 = 1.9 MiB. Control: with 3 MiB to spare the same run makes its images."""
    from nxhpc import generate
    from nxhpc.dit.denoiser import Denoiser
    from nxhpc.qwen3.encoder import TextEncoder
    from nxhpc.runtime import shm
    from nxhpc.vae.model import VaeDecoder
    avail = 64 << 20
    monkeypatch.setattr(shm, "memory_available_bytes", lambda: avail)
    monkeypatch.setattr(shm, "memory_room", lambda a: a)         # the arena may take it all
    monkeypatch.setattr(shm, "shm_free_bytes", lambda: None)
    monkeypatch.setattr(VaeDecoder, "check_room", lambda self, h, w, copies=1: 0)
    words = " ".join(["fox"] * 600)                             # > 512 tokens: cut to 512
    (tmp_path / "p.txt").write_text(f"a {words}\nthe {words}\none {words}\n")
    (tmp_path / "o").mkdir()
    encoded = []
    real_encode = TextEncoder.encode
    monkeypatch.setattr(TextEncoder, "encode",
                        lambda self, p: encoded.append(p) or real_encode(self, p))
    argv = ["--prompts", str(tmp_path / "p.txt"), "--out", str(tmp_path / "o"), "--steps", "1",
            "--no-progress", "--models-dir", str(models_root)]
    monkeypatch.setattr(Denoiser, "arena_bytes", lambda self, H, W, L=512: avail - (1 << 20))
    assert generate.main(argv) == Exit.SHM
    err = capsys.readouterr().err
    assert "the caption features of 3 prompts (1.9 MiB, kept until the last image) beside the " \
           "denoiser's arena (63.0 MiB): not enough memory" in err, err
    assert "Give fewer prompts a run (split --prompts into several files) or free memory" in err
    assert encoded == [] and list((tmp_path / "o").iterdir()) == []
    monkeypatch.setattr(Denoiser, "arena_bytes", lambda self, H, W, L=512: avail - (3 << 20))
    assert generate.main(argv) == Exit.PASS, capsys.readouterr().err
    assert len(encoded) == 3 and len(list((tmp_path / "o").glob("*.png"))) == 3


class _UnmappablePillow:
    """A finder that refuses Pillow as the loader does under an address-space limit (ulimit -v)
    that the run's own mappings left too small for Pillow's shared libraries."""

    def find_spec(self, name, path=None, target=None):
        if name == "PIL" or name.startswith("PIL."):
            raise ImportError("libXau-154567c4.so.6.0.0: failed to map segment from shared "
                              "object: Cannot allocate memory")
        return None


@pytest.mark.parametrize("cli", ["generate", "decode"])
def test_pillow_that_cannot_be_mapped_fails_before_the_work(cli, models_root, latents_file,
                                                            tmp_path, monkeypatch, capsys):
    """Pillow was imported at the PNG's write, after every step and the decode: under ``ulimit
    -v`` near the run's needs its libraries then failed to map and all the work was lost
    (``generate`` on the tiny components at 512x512 under 300000 KiB: exit 7 naming libXau
    after the decode, 6 runs in 6). Pillow is loaded first now: a Pillow the loader cannot
    map stops the run before the prompt is encoded / the latents decoded, exit 7, nothing
    written. Control: with Pillow importable the same run writes its PNG."""
    from nxhpc import decode, generate
    from nxhpc.qwen3.encoder import TextEncoder
    from nxhpc.vae.model import VaeDecoder
    ran = []
    real_encode, real_decode = TextEncoder.encode, VaeDecoder.decode
    monkeypatch.setattr(TextEncoder, "encode", lambda self, p: ran.append("encode")
                        or real_encode(self, p))
    monkeypatch.setattr(VaeDecoder, "decode", lambda self, z: ran.append("decode")
                        or real_decode(self, z))
    out = tmp_path / "x.png"
    if cli == "generate":
        main, argv = generate.main, ["--prompt", "a fox", "--steps", "1", "--no-progress",
                                     "--out", str(out), "--models-dir", str(models_root)]
    else:
        main, argv = decode.main, ["tiny-vae", "--latents", str(latents_file[0]), "--out",
                                   str(out), "--models-dir", str(models_root)]
    with monkeypatch.context() as m:
        for name in [k for k in sys.modules if k == "PIL" or k.startswith("PIL.")]:
            m.delitem(sys.modules, name)
        m.setattr(sys, "meta_path", [_UnmappablePillow(), *sys.meta_path])
        assert main(argv) == Exit.SHM
    err = capsys.readouterr().err
    assert "failed to map segment" in err and "ulimit -v" in err, err
    assert ran == [] and not out.exists()
    assert main(argv) == Exit.PASS, capsys.readouterr().err          # control
    assert ran[-1] == "decode" and _png(out)[0].size > 0


def test_a_memory_refusal_is_printed_whole(models_root, tmp_path):
    """A refusal for memory was cut to 200 characters and followed by advice about ``ulimit
    -v`` (the memory helper's find: an OSError of ENOMEM taken for the address-space limit):
    its own sentence -- what, needed, free, what to do -- is printed whole now, exit 7."""
    r = _generate(models_root, "--prompt", "a fox", "--height", 16384, "--width", 16384,
                  "--out", tmp_path / "x.png", expect=Exit.SHM)
    assert "not enough memory: the segment needs" in r.stderr, r.stderr
    assert r.stderr.rstrip().endswith("Run fewer tokens (a smaller image) or free memory"), \
        r.stderr
    assert "ulimit -v" not in r.stderr and not (tmp_path / "x.png").exists()
