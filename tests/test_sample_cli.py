"""``python -m nxhpc.sample`` end to end: outputs, reports, exit codes, atomicity, no leaks.

The numbers are proved in test_sample.py (the library vs diffusers' scheduler loop); here the
CLI must produce exactly the library's result (bit-identical: same denoiser, same workers, same
noise), ``--seed S`` must be ``--noise`` of ``initial_noise(S)``, and every bad argument must
get its documented exit code and a clear message, before any work and without touching an
existing output. Runs use the built-in ``tiny-dit`` (D=384, 2 layers + 2+2 refiners, ComfyUI
types) on the real nxhpc denoiser, as subprocesses.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from sample_util import open_test_denoiser, shm_entries

from nxhpc.dit.sampler import initial_noise
from nxhpc.dit.sampler import sample

ROOT = Path(__file__).resolve().parents[1]


def _env(models_dir) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["NXHPC_MODELS"] = str(models_dir)
    return env


def run_subprocess(args, models_dir, timeout=300):
    p = subprocess.run([sys.executable, "-m", "nxhpc.sample", *map(str, args)], cwd=ROOT,
                       env=_env(models_dir), capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout, p.stderr


@dataclass
class CliModel:
    """``model`` to pass on the command line, its config, ``run(args)`` -> (rc, out, err)."""
    model: str
    cfg: object
    models_dir: Path

    def run(self, args):
        return run_subprocess(args, self.models_dir)

    def open(self):
        return open_test_denoiser(self.model, workers=2, models_dir=str(self.models_dir))


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    models_dir = tmp_path_factory.mktemp("models")
    with open_test_denoiser("tiny-dit", workers=2, models_dir=str(models_dir)) as d:
        cfg = d.config                                  # generates tiny-dit once
    return CliModel("tiny-dit", cfg, models_dir)


@pytest.fixture
def files(tmp_path, cli):
    rng = np.random.default_rng(1)
    cap = tmp_path / "cap.npy"
    np.save(cap, rng.standard_normal((7, cli.cfg.cap_dim)).astype(np.float32))
    noise = tmp_path / "noise.npy"
    np.save(noise, rng.standard_normal((16, 6, 4)).astype(np.float32))    # 48 x 32 px
    return tmp_path, cap, noise


def _no_temporaries(d: Path):
    left = [p.name for p in d.iterdir() if ".tmp-" in p.name or ".probe-" in p.name]
    assert not left, left


# ----------------------------------------------------------------------------- runs

def test_noise_run_is_the_library_result(cli, files):
    d, cap, noise = files
    before = shm_entries()
    out = d / "lat.npy"
    rc, so, se = cli.run([cli.model, "2", "--cap-feats", cap, "--noise", noise, "--out", out,
                          "--steps", "3", "--json"])
    assert rc == 0, se
    lat = np.load(out)
    assert lat.dtype == np.float32 and lat.shape == (16, 6, 4)
    with cli.open() as den:
        ref = sample(den, np.load(cap), np.load(noise), steps=3)
    np.testing.assert_array_equal(lat, ref)
    rep = json.loads(so)
    assert rep["steps"] == 3 and rep["latent_shape"] == [16, 6, 4] and rep["seed"] is None
    assert rep["precision"] == "f32" and rep["q8_float_weights"] is None   # q8's only
    assert (rep["height"], rep["width"]) == (48, 32) and rep["workers"] == 2
    assert len(rep["step_s"]) == 3 and rep["caption_tokens"] == 7 and rep["png"] is None
    assert rep["sigmas"][0] == 1.0 and rep["sigmas"][-1] == 0.0
    assert "sample" in se and "step" in se                          # the progress bar
    assert shm_entries() == before
    _no_temporaries(d)


@pytest.mark.parametrize("precision", ["bf16", "q8"])
def test_precision_run_is_the_library_result(cli, files, precision):
    """``--precision`` runs the denoiser at that precision: the library's bits at it, not the
    f32 run's (negative control), and the report says which."""
    d, cap, noise = files
    out = d / f"lat-{precision}.npy"
    rc, so, se = cli.run([cli.model, "2", "--cap-feats", cap, "--noise", noise, "--out", out,
                          "--steps", "2", "--precision", precision, "--q8-float-weights", "bf16",
                          "--json", "--no-progress"])
    assert rc == 0, se
    rep = json.loads(so)
    assert rep["precision"] == precision
    assert rep["q8_float_weights"] == ("bf16" if precision == "q8" else None)
    with cli.open() as den:
        f32 = sample(den, np.load(cap), np.load(noise), steps=2)
        den.precision, den.q8_float_weights = precision, "bf16"
        ref = sample(den, np.load(cap), np.load(noise), steps=2)
    lat = np.load(out)
    np.testing.assert_array_equal(lat, ref)
    assert np.abs(lat - f32).max() > 0


def test_seed_run_is_noise_run_of_initial_noise(cli, files):
    d, cap, _ = files
    np.save(d / "n5.npy", initial_noise(5, (16, 4, 6)))
    runs = {}
    for name, extra in (("seed", ["--seed", "5", "--height", "32", "--width", "48"]),
                        ("noise", ["--noise", d / "n5.npy", "--height", "32", "--width", "48"]),
                        ("other", ["--seed", "6", "--height", "32", "--width", "48"])):
        rc, so, se = cli.run([cli.model, "--workers", "2", "--cap-feats", cap, "--steps", "2",
                              "--out", d / f"{name}.npy", "--no-progress", *extra])
        assert rc == 0, se
        assert se.strip() == "" or "sample:" not in se             # --no-progress: no bar
        runs[name] = np.load(d / f"{name}.npy")
    assert runs["seed"].shape == (16, 4, 6)
    np.testing.assert_array_equal(runs["seed"], runs["noise"])
    assert np.abs(runs["seed"] - runs["other"]).max() > 1e-2
    assert "seed=6" in so and "latent_shape=16,4,6" in so          # key=value report (last run)


@pytest.mark.parametrize("seeds", [[4], [1, 2], [7, 0, 3]])
def test_seeds_write_one_file_per_seed(cli, files, seeds):
    """``--seeds`` with an ``{seed}`` pattern: one latents file per seed, each the library's
    sample from ``initial_noise(seed)`` (two seeds once crashed: their two outputs were taken
    for --out plus --png)."""
    d, cap, _ = files
    pattern = str(d / "s_{seed}.npy")
    rc, so, se = cli.run([cli.model, "2", "--cap-feats", cap, "--height", "32", "--width", "48",
                          "--steps", "2", "--seeds", ",".join(map(str, seeds)), "--out", pattern,
                          "--no-progress"])
    assert rc == 0, se
    assert sorted(p.name for p in d.glob("s_*.npy")) == sorted(f"s_{v}.npy" for v in seeds)
    with cli.open() as den:
        for v in seeds:
            ref = sample(den, np.load(cap), initial_noise(v, (16, 4, 6)), steps=2)
            np.testing.assert_array_equal(np.load(d / f"s_{v}.npy"), ref)
    _no_temporaries(d)


def test_one_seed_fills_the_seed_pattern(cli, files):
    """``--out l_{seed}.npy`` without ``--seeds`` wrote a file literally named
    ``l_{seed}.npy`` (the CLI helper's find): one seed (``--seed``, or the default 0) fills it
    now, and with ``--noise`` (no seed) such a pattern is refused, exit 2, nothing written.
    Control: the file is the library's sample from that seed."""
    d, cap, noise = files
    for extra, seed in ((["--seed", "7"], 7), ([], 0)):
        rc, so, se = cli.run([cli.model, "2", "--cap-feats", cap, "--height", "16", "--width",
                              "16", "--steps", "1", "--out", d / "l_{seed}.npy", "--no-progress",
                              *extra])
        assert rc == 0, se
        assert f"out={d / f'l_{seed}.npy'}" in so.splitlines(), so
        with cli.open() as den:
            ref = sample(den, np.load(cap), initial_noise(seed, (16, 2, 2)), steps=1)
        np.testing.assert_array_equal(np.load(d / f"l_{seed}.npy"), ref)
    assert not (d / "l_{seed}.npy").exists()
    _expect(cli.run([cli.model, "2", "--cap-feats", cap, "--noise", noise, "--steps", "1",
                     "--out", d / "m_{seed}.npy"]), 2, "names {seed}, but --noise gives the start")
    assert not list(d.glob("m_*"))


def test_default_seed_is_zero(cli, files):
    d, cap, _ = files
    np.save(d / "n0.npy", initial_noise(0, (16, 2, 2)))
    for name, extra in (("default", []), ("n0", ["--noise", d / "n0.npy"])):
        rc, _, se = cli.run([cli.model, "2", "--cap-feats", cap, "--steps", "1", "--height",
                             "16", "--width", "16", "--out", d / f"{name}-out.npy", *extra])
        assert rc == 0, se
    np.testing.assert_array_equal(np.load(d / "default-out.npy"), np.load(d / "n0-out.npy"))


# ----------------------------------------------------------------------------- bad input

def _expect(rc_se, code, *needles):
    rc, _, se = rc_se
    assert rc == code, (rc, se)
    for n in needles:
        assert n in se, (n, se)
    assert "Traceback" not in se


def test_help_lists_exit_codes(tmp_path):
    rc, so, _ = run_subprocess(["--help"], tmp_path)
    assert rc == 0
    for s in ("--cap-feats", "--noise", "--decode", "multiple of 16", "exit codes", "  4  "):
        assert s in so


@pytest.mark.parametrize("extra, needle", [
    (["--height", "100", "--width", "64"], "multiple of 16 pixels"),
    (["--height", "0", "--width", "64"], "integer >= 1"),
    (["--height", "abc", "--width", "64"], "integer >= 1"),
    (["--height", "64"], "both --height and --width"),
    ([], "required unless --noise"),
    (["--height", "64", "--width", "64", "--steps", "0"], "--steps"),
    (["--height", "64", "--width", "64", "--shift", "-1"], "--shift"),
    (["--height", "64", "--width", "64", "--seed", "1", "--noise", "n.npy"], "not allowed with"),
    (["--height", "64", "--width", "64", "--seed", "-3"], "integer >= 0"),
    (["--height", "64", "--width", "64", "--png", "x.png"], "--png needs --decode"),
    (["--height", "64", "--width", "64", "0"], "argument n_workers: must be an integer >= 1"),
    (["--height", "64", "--width", "64", "2", "--workers", "3"], "disagree"),
    (["--height", "64", "--width", "64", "--noise", "missing.npy"], "no such file"),
    (["--height", "64", "--width", "64", "--precision", "fp8"], "--precision"),
    (["--height", "64", "--width", "64", "--q8-float-weights", "fp8"], "--q8-float-weights"),
])
def test_bad_arguments_exit_2_before_any_work(tmp_path, extra, needle):
    cap = tmp_path / "cap.npy"
    np.save(cap, np.zeros((3, 8), np.float32))
    out = tmp_path / "out.npy"
    res = run_subprocess(["tiny-dit", "--cap-feats", cap, "--out", out, *extra], tmp_path)
    _expect(res, 2, needle)
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cap.npy"]     # nothing generated


def test_bad_paths_exit_2(tmp_path):
    cap = tmp_path / "cap.npy"
    np.save(cap, np.zeros((3, 8), np.float32))
    px = ["--height", "16", "--width", "16"]
    _expect(run_subprocess(["tiny-dit", "--cap-feats", tmp_path / "nope.npy", "--out",
                            tmp_path / "o.npy", *px], tmp_path), 2, "--cap-feats", "no such file")
    _expect(run_subprocess(["tiny-dit", "--cap-feats", cap, "--out", tmp_path, *px], tmp_path),
            2, "is a directory")
    _expect(run_subprocess(["tiny-dit", "--cap-feats", cap, "--out", cap, *px], tmp_path),
            2, "is an input of this run")
    _expect(run_subprocess(["tiny-dit", "--cap-feats", cap, "--out", tmp_path / "no" / "o.npy",
                            *px], tmp_path), 2, "does not exist")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro_args = ["tiny-dit", "--cap-feats", cap, "--out", ro / "o.npy", *px]
    if os.geteuid() == 0:                # root ignores modes (as CI runs): a read-only mount
        from nsutil import run_with_tmpfs
        p = run_with_tmpfs([sys.executable, "-m", "nxhpc.sample", *map(str, ro_args)], str(ro),
                           "size=64k,ro", cwd=ROOT, env=_env(tmp_path), timeout=300)
        _expect((p.returncode, p.stdout, p.stderr), 2, "cannot create a file")
    else:
        ro.chmod(0o500)
        try:
            _expect(run_subprocess(ro_args, tmp_path), 2, "cannot create a file")
        finally:
            ro.chmod(0o700)
    _expect(run_subprocess(["tiny-dit", "--cap-feats", cap, "--out", tmp_path / "o.npy",
                            "--decode", tmp_path / "novae", "--png", tmp_path / "o.png", *px],
                           tmp_path), 3, "no such directory")
    _expect(run_subprocess(["tiny-dit", "--cap-feats", cap, "--out", tmp_path / "o.npy",
                            "--decode", cap, "--png", tmp_path / "o.png", *px],
                           tmp_path), 3, "a file, not a directory", "python -m nxhpc.decode")
    _expect(run_subprocess(["tiny-dit", "--cap-feats", cap, "--out", tmp_path / "o.npy",
                            "--decode", tmp_path, "--png", tmp_path / "o.npy", *px],
                           tmp_path), 2, "same file")
    _expect(run_subprocess(["tiny-dit", "--cap-feats", cap, "--out", tmp_path / "o.npy",
                            "--decode", tmp_path, "--png", tmp_path / "o.webp", *px],
                           tmp_path), 2, "nxhpc writes PNG images; a .webp name")
    _no_temporaries(tmp_path)


def test_inputs_that_do_not_fit_the_model_exit_4_and_keep_the_old_output(cli, files):
    d, cap, noise = files
    out = d / "keep.npy"
    out.write_bytes(b"old")
    D = cli.cfg.cap_dim
    bad = {
        "wide": (np.zeros((4, D + 1), np.float32), f"expected [L, {D}]"),
        "flat": (np.zeros(D, np.float32), f"expected [L, {D}]"),
        "nan": (np.full((4, D), np.nan, np.float32), "NaN or inf"),
        "int": (np.zeros((4, D), np.int64), "floating-point"),
    }
    for name, (arr, needle) in bad.items():
        np.save(d / f"{name}.npy", arr)
        _expect(cli.run([cli.model, "2", "--cap-feats", d / f"{name}.npy", "--noise", noise,
                         "--out", out]), 4, "--cap-feats", needle)
    (d / "junk.npy").write_bytes(b"not an array")
    _expect(cli.run([cli.model, "2", "--cap-feats", d / "junk.npy", "--noise", noise, "--out",
                     out]), 4, "cannot read a .npy array")
    bad_noise = {
        "odd": (np.zeros((16, 5, 4), np.float32), "multiples of 2"),
        "chan": (np.zeros((8, 6, 4), np.float32), "expected [16, H, W]"),
        "nan": (np.full((16, 6, 4), np.nan, np.float32), "NaN or inf"),
    }
    for name, (arr, needle) in bad_noise.items():
        np.save(d / f"noise-{name}.npy", arr)
        _expect(cli.run([cli.model, "2", "--cap-feats", cap, "--noise", d / f"noise-{name}.npy",
                         "--out", out]), 4, "--noise", needle)
    _expect(cli.run([cli.model, "2", "--cap-feats", cap, "--noise", noise, "--height", "64",
                     "--width", "64", "--out", out]), 4, "does not match --height/--width")
    assert out.read_bytes() == b"old"
    _no_temporaries(d)


def test_nan_from_the_denoiser_exits_1_and_writes_nothing(cli, files, monkeypatch, capsys):
    import nxhpc.sample as ns
    d, cap, noise = files

    class NaNAtStep1:
        def __init__(self, inner):
            self.inner, self.config, self.calls = inner, inner.config, 0

        def forward(self, x, t, c):
            self.calls += 1
            r = self.inner.forward(x, t, c)
            return r * np.float32("nan") if self.calls == 2 else r

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.inner.close()
    monkeypatch.setattr(ns, "_open_denoiser", lambda model, workers, models_dir, **kw:
                        NaNAtStep1(cli.open()))
    out = d / "nan.npy"
    rc = ns.main([cli.model, "2", "--cap-feats", str(cap), "--noise", str(noise), "--out",
                  str(out), "--no-progress", "--models-dir", str(cli.models_dir)])
    err = capsys.readouterr().err
    assert rc == 1 and "step 1" in err and "NaN/inf" in err, err
    assert not out.exists()


def test_model_not_found_exits_3(cli, files):
    d, cap, noise = files
    _expect(cli.run([str(d / "no-such-model.gguf"), "2", "--cap-feats", cap, "--noise", noise,
                     "--out", d / "o.npy"]), 3)
    assert not (d / "o.npy").exists()


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_interrupt_mid_run_stops_cleanly(cli, files, sig, code):
    d, cap, noise = files
    before = shm_entries()
    out = d / "int.npy"
    p = subprocess.Popen([sys.executable, "-m", "nxhpc.sample", cli.model, "2", "--cap-feats",
                          str(cap), "--noise", str(noise), "--steps", "100000", "--out", str(out)],
                         cwd=ROOT, env=_env(cli.models_dir), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        buf = ""
        while "step" not in buf and time.monotonic() < deadline:   # the bar has started
            buf += p.stderr.read(1)
        assert "step" in buf, buf
        time.sleep(0.3)
        p.send_signal(sig)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == code, err
    assert "shared memory released" in err and "Traceback" not in err
    assert not out.exists() and shm_entries() == before
    _no_temporaries(d)


# ----------------------------------------------------------------------------- decode

def test_decode_writes_the_vae_image(cli, files):
    torch = pytest.importorskip("torch")
    pytest.importorskip("diffusers")
    from PIL import Image
    from pipeline_fixtures import make_vae
    d, cap, noise = files
    vae_dir = d / "vae"
    vae = make_vae(seed=3)
    vae.save_pretrained(vae_dir)
    out, png = d / "lat.npy", d / "img.png"
    rc, so, se = cli.run([cli.model, "2", "--cap-feats", cap, "--noise", noise, "--steps", "2",
                          "--out", out, "--decode", vae_dir, "--png", png])
    assert rc == 0, se
    img = np.asarray(Image.open(png))
    assert img.shape == (48, 32, 3) and img.dtype == np.uint8
    # independent decode: docs/denoiser.md's normalization, diffusers' [-1, 1] -> [0, 255]
    lat = torch.from_numpy(np.load(out))[None]
    with torch.no_grad():
        dec = vae.decode(lat / 0.3611 + 0.1159, return_dict=False)[0][0]
    ref = ((dec / 2 + 0.5).clamp(0, 1).permute(1, 2, 0).numpy() * 255).round().astype(int)
    diff = np.abs(img.astype(int) - ref)
    assert diff.max() <= 1 and np.mean(diff == 0) >= 0.99
    # negative control: decoding without the shift/scale is visibly another image
    with torch.no_grad():
        raw = vae.decode(lat, return_dict=False)[0][0]
    raw8 = ((raw / 2 + 0.5).clamp(0, 1).permute(1, 2, 0).numpy() * 255).round().astype(int)
    assert np.mean(np.abs(img.astype(int) - raw8) <= 1) < 0.9
    assert f"png={png}" in so
    # the run's parameters in text chunks, as decode and generate write them (it had none)
    text = Image.open(png).text
    assert text["steps"] == "2" and text["noise"] == noise.name and text["vae"] == "vae"
    assert text["cap_feats"] == cap.name and "seed" not in text
    assert text["software"].startswith("nxhpc ")
    _no_temporaries(d)
    # the VAE's own files are the run's inputs too: --png over its config.json wrote a PNG
    # there (exit 0) and every later decode failed; refused now, the files untouched
    before = {p.name: p.read_bytes() for p in vae_dir.iterdir()}
    for what, path in (("--png", vae_dir / "config.json"),
                       ("--out", vae_dir / "diffusion_pytorch_model.safetensors")):
        args = {"--out": d / "lat2.npy", "--png": d / "img2.png", what: path}
        rc, so, se = cli.run([cli.model, "2", "--cap-feats", cap, "--noise", noise, "--steps",
                              "2", "--decode", vae_dir, *[x for kv in args.items() for x in kv]])
        assert rc == 2 and "input of this run" in se, (what, rc, se)
    assert {p.name: p.read_bytes() for p in vae_dir.iterdir()} == before
