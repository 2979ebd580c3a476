"""nxhpc.diffusers.NxhpcZImageTransformer in diffusers' ZImagePipeline vs diffusers' own transformer.

Set-up: a random Z-Image (every parameter randomized) written as a stable-diffusion.cpp-layout
GGUF (prefix, layers and refiners Q8_0, the rest F32); the nxhpc drop-in opens that file; the
oracle is diffusers' ``ZImageTransformer2DModel`` holding exactly the file's dequantized
weights. Both sit in the same tiny offline ``ZImagePipeline`` (tests/pipeline_fixtures.py:
random Qwen3 text encoder, local tokenizer and chat template, tiny random AutoencoderKL, the
Turbo scheduler), same prompt, same starting latents, 8 steps, without and with CFG (B = 2,
prompt and negative prompt of different lengths: run item by item).

Tolerances: one call within 1e-5 of max|ref| against diffusers in float64 (the whole-call
requirement: what is left is diffusers' float32 sinusoid and RoPE table, ~1e-6); final latents
within 1e-4 relative (the sampler requirement); images within 1e-3 in [0, 1] and as uint8 at
most 1 level on 99% of pixels (the pipeline requirement: the VAE maps ~1e-5 latent differences
to far less than one level; rounding at .5 boundaries can still flip a level). Negative
control: a drop-in with the sign flipped fails the same image check.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from pipeline_fixtures import make_tiny_pipeline, pipeline_config, with_transformer
from pipeline_fixtures import zimage_file_case
from sample_util import child_pids, open_test_denoiser
from testutil import rel_err

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from nxhpc.diffusers import NxhpcZImageTransformer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PX = 64                     # latents [16, 8, 8]: 16 image tokens (padded to 32)
STEPS = 8
PROMPT = "a red cube on a table"


pytestmark = pytest.mark.usefixtures("torch_threads")


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    return zimage_file_case(tmp_path_factory.mktemp("dropin"), pipeline_config(),
                            "sdcpp-q8_0", seed=4)


@pytest.fixture(scope="module")
def tiny(case):
    from nxhpc.dit.oracle import diffusers_zimage
    diff32 = diffusers_zimage(case.cfg, case.file.weights, dtype=torch.float32)
    return make_tiny_pipeline(transformer=diff32, seed=0, cfg=case.cfg)


@pytest.fixture(scope="module")
def nx(case):
    with NxhpcZImageTransformer(open_test_denoiser(case.path, workers=2)) as t:
        yield t


def _run(pipe, guidance, noise, keep):
    def on_step(p, i, t, kw):
        if i == STEPS - 1:
            keep.append(kw["latents"][0].double().numpy())
        return kw
    return pipe(PROMPT, height=PX, width=PX, num_inference_steps=STEPS, guidance_scale=guidance,
                latents=noise.clone(), output_type="np", max_sequence_length=64,
                callback_on_step_end=on_step).images[0]


def _uint8(img: np.ndarray) -> np.ndarray:
    return (img * 255).round().astype(int)         # diffusers' numpy_to_pil


def test_attributes_the_pipeline_and_users_read(nx, case):
    assert nx.in_channels == nx.out_channels == 16
    assert nx.dtype == torch.float32 and nx.device == torch.device("cpu")
    c = nx.config
    assert c.in_channels == c["in_channels"] == 16
    assert (c.dim, c.n_layers, c.n_refiner_layers, c.n_heads, c.cap_feat_dim) == \
        (case.cfg.dim, case.cfg.n_layers, case.cfg.n_noise_refiner, case.cfg.n_heads,
         case.cfg.cap_dim)
    assert tuple(c.all_patch_size) == (2,) and tuple(c.all_f_patch_size) == (1,)
    assert list(c.axes_dims) == list(case.cfg.axes_dims)
    # the config keys of diffusers' own class, so code that rebuilds/reads it finds them
    from diffusers.models.transformers.transformer_z_image import ZImageTransformer2DModel
    import inspect
    keys = set(inspect.signature(ZImageTransformer2DModel.__init__).parameters) - {"self"}
    assert keys <= set(c.keys())
    assert nx.to("cpu") is nx and nx.to(torch.float32) is nx and nx.to("cpu", torch.float32) is nx
    assert nx.eval() is nx and nx.cpu() is nx
    with pytest.raises(ValueError, match="CPU only"):
        nx.to("cuda")
    with pytest.raises(ValueError, match="only torch.float32"):
        nx.to(torch.bfloat16)
    # Module.to(tensor): that tensor's dtype and device (it reached torch.device(tensor))
    assert nx.to(torch.zeros(1)) is nx
    with pytest.raises(ValueError, match="only torch.float32"):
        nx.to(torch.zeros(1, dtype=torch.bfloat16))


def test_one_call_matches_diffusers_batch_of_two(nx, case):
    rng = np.random.default_rng(7)
    lats = [torch.from_numpy(rng.standard_normal((16, 1, 8, 6)).astype(np.float32))
            for _ in range(2)]
    caps = [torch.from_numpy(rng.standard_normal((n, case.cfg.cap_dim)).astype(np.float32))
            for n in (19, 5)]
    t = torch.tensor([0.3, 0.9], dtype=torch.float32)
    out = nx(lats, t, caps, joint_attention_kwargs=None, return_dict=False)
    assert isinstance(out, tuple) and len(out) == 1 and isinstance(out[0], list)
    assert len(out[0]) == 2
    for i, o in enumerate(out[0]):
        assert o.shape == (16, 1, 8, 6) and o.dtype == torch.float32
        with torch.no_grad():
            ref = case.diffusers([lats[i].double()], t[i:i + 1].double(), [caps[i].double()],
                                 return_dict=False)[0][0]
        assert rel_err(o.numpy(), ref.numpy()) <= 1e-5
    # the two items really differ (caption and t reach each item), and return_dict=True
    assert rel_err(out[0][0].numpy(), out[0][1].numpy()) > 0.1
    res = nx(lats[:1], t[:1], caps[:1])
    np.testing.assert_array_equal(res.sample[0].numpy(), out[0][0].numpy())
    # a plain float t (here the float32 value exactly) acts as a [B] tensor of it
    res2 = nx(lats[:1], float(t[0]), caps[:1], return_dict=False)[0][0]
    np.testing.assert_array_equal(res2.numpy(), out[0][0].numpy())


@pytest.mark.parametrize("guidance", [0.0, 2.0])
def test_pipeline_images_match_diffusers_transformer(tiny, nx, guidance):
    noise = torch.randn((1, 16, PX // 8, PX // 8), generator=torch.Generator().manual_seed(5))
    lat_d, lat_n = [], []
    img_d = _run(tiny.pipe, guidance, noise, lat_d)
    pipe_nx = with_transformer(tiny, nx)
    assert pipe_nx.transformer is nx
    img_n = _run(pipe_nx, guidance, noise, lat_n)
    assert img_n.shape == (PX, PX, 3) and img_d.std() > 0.02       # a real (not flat) image
    assert rel_err(lat_n[0], lat_d[0]) <= 1e-4
    assert np.abs(img_n - img_d).max() <= 1e-3
    diff = np.abs(_uint8(img_n) - _uint8(img_d))
    assert diff.max() <= 2 and np.mean(diff <= 1) >= 0.99

    class Flipped:                       # negative control: the same image check must fail
        in_channels, dtype = 16, torch.float32

        def __call__(self, *a, **k):
            return ([-o for o in nx(*a, **k)[0]],)
    img_f = _run(with_transformer(tiny, Flipped()), guidance, noise, [])
    assert np.mean(np.abs(_uint8(img_f) - _uint8(img_d)) <= 1) < 0.99


def test_cfg_batches_keep_the_worker_pool(tiny, nx):
    """CFG alternates two caption lengths: both layouts keep their workers across steps, and
    from the second step on each reuses its caption's refined rows (the pipeline passes new
    tensors with the same values each step)."""
    kids, reused = [], []

    class Spy:
        in_channels, dtype = 16, torch.float32

        def __call__(self, *a, **k):
            out = nx(*a, **k)
            kids.append(child_pids())
            reused.append(nx.denoiser.last_caption_reused)
            return out
    noise = torch.randn((1, 16, PX // 8, PX // 8), generator=torch.Generator().manual_seed(5))
    _run(with_transformer(tiny, Spy()), 2.0, noise, [])
    assert len(kids) == STEPS and kids[0] and all(k == kids[0] for k in kids)
    assert reused[1:] == [True] * (STEPS - 1)     # the first: as the tests before left it


def test_pipeline_to_cpu_and_components(tiny, nx):
    pipe = with_transformer(tiny, nx)
    assert pipe.to("cpu") is pipe and pipe.transformer is nx
    assert pipe.components["transformer"] is nx
    assert pipe.device == torch.device("cpu") and pipe._execution_device == torch.device("cpu")


def test_readme_recipe_from_pretrained_without_transformer(tiny, nx, tmp_path):
    from diffusers import ZImagePipeline
    tiny.pipe.save_pretrained(tmp_path / "pipe")
    with pytest.raises(ValueError, match="ModelMixin"):            # what the README warns of
        ZImagePipeline.from_pretrained(tmp_path / "pipe", transformer=nx)
    pipe = ZImagePipeline.from_pretrained(tmp_path / "pipe", transformer=None)
    pipe.transformer = nx
    pipe.set_progress_bar_config(disable=True)
    noise = torch.randn((1, 16, PX // 8, PX // 8), generator=torch.Generator().manual_seed(6))
    kw = dict(height=PX, width=PX, num_inference_steps=2, guidance_scale=0.0,
              latents=noise, output_type="np", max_sequence_length=64)
    img = pipe(PROMPT, **kw).images[0]
    ref = with_transformer(tiny, nx)(PROMPT, **kw).images[0]       # the same parts, in memory
    np.testing.assert_array_equal(img, ref)


def test_unsupported_and_bad_calls_are_clear(nx, case):
    lat = [torch.zeros((16, 1, 4, 4))]
    cap = [torch.zeros((3, case.cfg.cap_dim))]
    t = torch.tensor([0.5])
    with pytest.raises(NotImplementedError, match="controlnet_block_samples"):
        nx(lat, t, cap, controlnet_block_samples={0: torch.zeros(1)})
    with pytest.raises(NotImplementedError, match="omni"):
        nx([[lat[0]]], t, cap)
    with pytest.raises(ValueError, match="patch_size 4"):
        nx(lat, t, cap, patch_size=4)
    with pytest.raises(ValueError, match=r"item 0 is \(16, 4, 4\)"):
        nx([torch.zeros((16, 4, 4))], t, cap)
    with pytest.raises(ValueError, match="batch sizes differ"):
        nx(lat * 2, t, cap)
    nx(lat, t, cap, joint_attention_kwargs={"scale": 1.0})       # no-op scale is fine


def test_lora_scale_and_empty_controlnet_are_no_ops_as_in_diffusers(nx, case):
    """A LoRA scale scales LoRA layers; the drop-in has none, so it warns and computes the same
    output, as diffusers' transformer does without them (it raised NotImplementedError, so a
    pipeline call with joint_attention_kwargs={"scale": s} failed); an empty controlnet dict
    adds nothing, as in diffusers (it was refused). A non-empty one is still refused."""
    rng = np.random.default_rng(3)
    lat = [torch.from_numpy(rng.standard_normal((16, 1, 4, 4)).astype(np.float32))]
    cap = [torch.from_numpy(rng.standard_normal((3, case.cfg.cap_dim)).astype(np.float32))]
    t = torch.tensor([0.5])
    want = nx(lat, t, cap, return_dict=False)[0][0]
    with pytest.warns(UserWarning, match="scale'] = 0.5 has no effect") as rec:
        got = nx(lat, t, cap, return_dict=False, joint_attention_kwargs={"scale": 0.5})[0][0]
    assert torch.equal(got, want)
    assert rec[0].filename == __file__                  # pointed at the caller's line
    got = nx(lat, t, cap, return_dict=False, controlnet_block_samples={})[0][0]
    assert torch.equal(got, want)
    with pytest.raises(NotImplementedError, match="controlnet_block_samples"):
        nx(lat, t, cap, controlnet_block_samples={0: torch.zeros(1)})


def test_close_closes_the_denoiser(case):
    den = open_test_denoiser(case.path, workers=1)
    t = NxhpcZImageTransformer(den)
    t.close()
    t.close()                                                       # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        t([torch.zeros((16, 1, 4, 4))], torch.tensor([0.5]), [torch.zeros((2, case.cfg.cap_dim))])


def test_from_gguf_opens_the_nxhpc_denoiser(case):
    with NxhpcZImageTransformer.from_gguf(case.path, workers=2) as t:
        assert t.config.cap_feat_dim == case.cfg.cap_dim
        assert type(t.denoiser).__module__ == "nxhpc.dit.denoiser"


def test_import_needs_no_torch_and_errors_name_the_extra():
    code = ("import sys; sys.modules['torch'] = None; sys.modules['diffusers'] = None\n"
            "import nxhpc.diffusers as d\n"
            "try:\n    d.NxhpcZImageTransformer(object())\n"
            "except ImportError as e:\n    print('IMPORTERROR', e)\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "IMPORTERROR" in p.stdout and "nxhpc[diffusers]" in p.stdout
    p = subprocess.run([sys.executable, "-c", "import sys, nxhpc.diffusers; "
                        "print('torch' in sys.modules, 'diffusers' in sys.modules)"],
                       cwd=ROOT, capture_output=True, text=True,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=60)
    assert p.stdout.split() == ["False", "False"], p.stderr


def test_inputs_are_validated_before_any_conversion(nx, case):
    """Issue 19, item 9: int64 or bool latents were converted to float32, run, and the output
    cast back (truncated to integers); ``t=True`` was taken as 1.0. The drop-in now refuses
    what ZImageTransformer2DModel could not mean -- non-floating latents or caption features,
    a bool or complex timestep, a float64 value beyond float32 -- before converting anything;
    float16 / bfloat16 / float64 inputs still run (the output in the latents' dtype)."""
    D = case.cfg.cap_dim
    lat = torch.randn((16, 1, 4, 4), generator=torch.Generator().manual_seed(0))
    cap = torch.randn((3, D), generator=torch.Generator().manual_seed(1))
    t = torch.tensor([0.5])
    for bad in (lat.to(torch.int64), lat > 0, lat.to(torch.complex64)):
        with pytest.raises(ValueError, match=r"latents item 0 .*floating"):
            nx([bad], t, [cap])
    for bad in (cap.to(torch.int32), cap > 0):
        with pytest.raises(ValueError, match=r"cap_feats item 0 .*floating"):
            nx([lat], t, [bad])
    for bad in (True, np.bool_(True), torch.tensor([True]), torch.tensor([0.5j])):
        with pytest.raises(ValueError, match="timestep"):
            nx([lat], bad, [cap])
    with pytest.raises(ValueError, match="beyond float32's range"):
        nx([lat.double() * 1e300], t, [cap])
    ref = nx([lat], t, [cap], return_dict=False)[0][0]
    for dt in (torch.float16, torch.bfloat16, torch.float64):
        got = nx([lat.to(dt)], t.to(dt), [cap.to(dt)], return_dict=False)[0][0]
        assert got.dtype == dt
        if dt == torch.float64:
            assert torch.equal(got, ref.double())        # float64 in float32's range: exact
    for good_t in (0.5, 1, np.float32(0.5), torch.tensor(0.5, dtype=torch.float64)):
        nx([lat], good_t, [cap])


def test_nan_output_raises_instead_of_a_black_image(nx, case):
    """Issue 19, item 3: a finite input that overflows inside the model returned NaN tensors
    (a black image). The drop-in raises the denoiser's NonFiniteOutputError."""
    from nxhpc.runtime.checks import NonFiniteOutputError
    cap = torch.zeros((3, case.cfg.cap_dim))
    with pytest.raises(NonFiniteOutputError, match="NaN/inf"):
        nx([torch.full((16, 1, 4, 4), 3e38)], torch.tensor([0.5]), [cap])
    out = nx([torch.ones((16, 1, 4, 4))], torch.tensor([0.5]), [cap], return_dict=False)[0]
    assert torch.isfinite(out[0]).all()                               # control


def test_constructor_repr_pickle_and_from_gguf_options(case):
    """A path given to the constructor (for from_gguf) or a closed Denoiser is refused naming
    it (they failed with AttributeError / TypeError inside); repr says "closed" once its
    Denoiser is; the drop-in cannot be pickled, saying why; from_gguf passes the Denoiser's
    options (precision was out of reach): its bf16 call is the Denoiser's bf16 call, and not
    its f32 one (control)."""
    import pickle
    with pytest.raises(TypeError, match="got str .*use NxhpcZImageTransformer.from_gguf"):
        NxhpcZImageTransformer(str(case.path))
    den = open_test_denoiser(case.path, workers=1)
    t = NxhpcZImageTransformer(den)
    with pytest.raises(TypeError, match="NxhpcZImageTransformer cannot be pickled or copied"):
        pickle.dumps(t)
    den.close()
    assert repr(t).endswith("closed)")
    with pytest.raises(ValueError, match="the Denoiser given is closed"):
        NxhpcZImageTransformer(den)
    lat = torch.randn((16, 1, 4, 4), generator=torch.Generator().manual_seed(1))
    cap = torch.randn((5, case.cfg.cap_dim), generator=torch.Generator().manual_seed(2))
    with NxhpcZImageTransformer.from_gguf(case.path, workers=2, precision="bf16") as t:
        assert t.denoiser.precision == "bf16" and repr(t).endswith("open)")
        got = t([lat], torch.tensor([0.3]), [cap], return_dict=False)[0][0].numpy()
    t32 = float(np.float32(0.3))                        # the tensor's float32 timestep
    with open_test_denoiser(case.path, workers=1) as d:
        d.precision = "bf16"
        want = d.forward(lat.numpy(), t32, cap.numpy())
        d.precision = "f32"
        f32 = d.forward(lat.numpy(), t32, cap.numpy())
    assert np.array_equal(got, want.reshape(got.shape)) and not np.array_equal(want, f32)


def test_close_during_a_batch_and_sigmas_beyond_one(nx, case):
    """A close() between two items of one call (another thread's, mid-batch) ends the call with
    the Denoiser's own "closed" error (it was AttributeError on None); a timestep from sigma > 1
    or < 0 (a pipeline's sigmas=) is refused naming sigma, before any item runs."""
    cap = [torch.zeros((3, case.cfg.cap_dim))] * 2
    lat = [torch.zeros((16, 1, 4, 4))] * 2
    for t in (torch.tensor([-0.0588, 0.5]), torch.tensor([0.5, 1.2]), float("nan")):
        with pytest.raises(ValueError, match=r"sigma = 1 - t = .*the model takes sigma in "
                                             r"\[0, 1\]"):
            nx(lat, t, cap)
    den = open_test_denoiser(case.path, workers=1)
    t = NxhpcZImageTransformer(den)
    real, calls = den.forward, []

    def forward_then_close(*a):
        calls.append(1)
        r = real(*a)
        t.close()                      # what a second thread's close() does between items
        return r
    den.forward = forward_then_close
    with pytest.raises(RuntimeError, match="Denoiser: closed"):
        t(lat, torch.tensor([0.5]), cap)
    assert calls == [1, 1]
