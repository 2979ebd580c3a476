"""The Turbo sampler (nxhpc.dit.sampler) vs diffusers' FlowMatchEulerDiscreteScheduler.

The oracle loop is ZImagePipeline's (diffusers 0.42 ``pipeline_z_image.py``), written out:
sigmas ``linspace(1, 1/N, N)`` shifted by the scheduler (shift 3.0, static), the transformer
called at ``t = (1000 - timestep) / 1000``, its output NEGATED, then ``scheduler.step``. Both
loops drive the same random diffusers transformer from the same noise, 8 steps.

Tolerances: final latents within 1e-4 of max |x| (the requirement). With the same float32
transformer in both loops the only differences are float32 vs float64 sigma/t arithmetic
(~1e-7 relative per step); with the float64 reference forward in ours it adds the float32
transformer's own error (~1e-6 relative per call). Negative controls (the sign the pipeline
flips, a different shift) must miss by far (x100).
"""
from __future__ import annotations

import numpy as np
import pytest

from nxhpc.dit.sampler import euler_sample, initial_noise, latent_shape, turbo_sigmas

try:
    import diffusers  # noqa: F401
    import torch
except ImportError:                  # the pure tests still run
    torch = None
needs_diffusers = pytest.mark.skipif(torch is None, reason="needs torch and diffusers")

DESIGN_SIGMAS_8 = [1.0, 0.954545, 0.9, 0.833333, 0.75, 0.642857, 0.5, 0.3, 0.0]  # docs/denoiser.md
REL_TOL = 1e-4


def rel_err(a, ref) -> float:
    return float(np.abs(np.asarray(a, np.float64) - ref).max() / np.abs(ref).max())


def test_sigmas_match_design():
    s = turbo_sigmas(8, 3.0)
    assert s.dtype == np.float64 and s.shape == (9,)
    np.testing.assert_allclose(s, DESIGN_SIGMAS_8, rtol=0, atol=5e-7)   # printed to 6 digits
    np.testing.assert_array_equal(turbo_sigmas(1, 3.0), [1.0, 0.0])
    assert np.all(np.diff(turbo_sigmas(50, 3.0)) < 0)


# ----------------------------------------------------------------------------- vs diffusers

def _scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0,
                                           use_dynamic_shifting=False)


def _pipeline_timesteps(sch, steps):
    # exactly the pipeline's call (mu is passed but unused without dynamic shifting)
    sig = torch.linspace(1.0, 1 / steps, steps).tolist()
    sch.set_timesteps(steps, sigmas=sig, mu=0.5)
    sch.set_begin_index(0)
    return sch.timesteps


@needs_diffusers
@pytest.mark.parametrize("steps", [1, 4, 8, 50])
def test_sigmas_and_timesteps_match_diffusers(steps):
    sch = _scheduler()
    ts = _pipeline_timesteps(sch, steps)
    s = turbo_sigmas(steps, 3.0)
    np.testing.assert_allclose(sch.sigmas.double().numpy(), s, rtol=0, atol=2e-7)  # float32
    t_model = ((1000 - ts) / 1000).double().numpy()     # what the transformer is given
    np.testing.assert_allclose(t_model, 1.0 - s[:-1], rtol=0, atol=1e-6)


CFG_KW = dict(dim=384, n_heads=6, n_kv_heads=6, head_dim=64, ffn_dim=1024, n_layers=2,
              n_noise_refiner=2, n_context_refiner=2, in_channels=16, patch=2, cap_dim=320)


@pytest.fixture(scope="module")
def setup():
    from nxhpc.dit.config import DenoiserConfig
    from nxhpc.dit.oracle import random_zimage_model
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    cfg = DenoiserConfig(**CFG_KW)
    model32, w = random_zimage_model(cfg, seed=5, dtype=torch.float32)
    rng = np.random.default_rng(6)
    cap = rng.standard_normal((19, 320)).astype(np.float32)
    noise = torch.randn((1, 16, 12, 10), generator=torch.Generator().manual_seed(7))
    yield cfg, model32, w, cap, noise
    torch.set_num_threads(old)


def _diffusers_loop(model32, cap, noise, steps=8):
    """ZImagePipeline's denoising loop at batch 1, no CFG (guidance_scale 0)."""
    sch = _scheduler()
    ts = _pipeline_timesteps(sch, steps)
    latents = noise.clone()
    capt = torch.from_numpy(cap)
    with torch.no_grad():
        for t in ts:
            timestep = (1000 - t.expand(1)) / 1000
            out = model32([latents.to(torch.float32).unsqueeze(2)[0]], timestep, [capt],
                          return_dict=False)[0]
            noise_pred = -torch.stack([o.float() for o in out], dim=0).squeeze(2)
            latents = sch.step(noise_pred.to(torch.float32), t, latents, return_dict=False)[0]
    return latents[0].double().numpy()


@pytest.fixture(scope="module")
def diffusers_result(setup):
    _, model32, _, cap, noise = setup
    return _diffusers_loop(model32, cap, noise)


@needs_diffusers
def test_euler_matches_diffusers_scheduler_same_transformer(setup, diffusers_result):
    from nxhpc.dit.oracle import run_diffusers_zimage
    _, model32, _, cap, noise = setup
    calls = []

    def model(x, t):
        calls.append(t)
        assert x.dtype == np.float32 and x.shape == (16, 12, 10)
        return run_diffusers_zimage(model32, x, t, cap).astype(np.float32)

    x = euler_sample(model, noise[0].numpy(), steps=8, shift=3.0)
    assert x.dtype == np.float32
    np.testing.assert_allclose(calls, 1.0 - turbo_sigmas(8, 3.0)[:-1], atol=1e-12)
    assert rel_err(x, diffusers_result) <= REL_TOL
    assert rel_err(x, noise[0].numpy()) > 0.1                  # the loop moved x

    # negative controls: the pipeline's sign flip forgotten, a different shift
    flipped = euler_sample(lambda x, t: -model(x, t), noise[0].numpy(), steps=8)
    assert rel_err(flipped, diffusers_result) > 100 * REL_TOL
    shift1 = euler_sample(model, noise[0].numpy(), steps=8, shift=1.0)
    assert rel_err(shift1, diffusers_result) > 100 * REL_TOL


@needs_diffusers
def test_euler_with_reference_forward_matches_diffusers(setup, diffusers_result):
    from nxhpc.dit.denoiser_ref import denoiser_forward_f64
    cfg, _, w, cap, noise = setup
    x = euler_sample(lambda x, t: denoiser_forward_f64(x, t, cap, w, cfg).astype(np.float32),
                     noise[0].numpy(), steps=8, shift=3.0)
    assert rel_err(x, diffusers_result) <= REL_TOL


# ----------------------------------------------------------------------------- bad input

def test_sampler_rejects_bad_input():
    x0 = np.zeros((16, 4, 4), np.float32)
    with pytest.raises(ValueError, match="step 0: model returned"):
        euler_sample(lambda x, t: x[:8], x0, steps=2)
    with pytest.raises(ValueError, match="step 1 .*NaN"):
        euler_sample(lambda x, t: x + (np.nan if t > 0 else 0), x0 + 1, steps=2)
    for sig in ([1.0, 0.5], [1.0, 0.5, 0.6, 0.0], [1.5, 0.0], [1.0]):
        with pytest.raises(ValueError, match="sigmas must decrease"):
            euler_sample(lambda x, t: x, x0, sigmas=np.array(sig))
    with pytest.raises(ValueError, match="noise contains NaN"):
        euler_sample(lambda x, t: x, np.full((16, 4, 4), np.nan))
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="steps must be"):
            turbo_sigmas(bad)
    with pytest.raises(ValueError, match="shift must be"):
        turbo_sigmas(8, 0.0)


def test_latent_shape_and_noise():
    assert latent_shape(1024, 1024) == (16, 128, 128)
    assert latent_shape(512, 768) == (16, 64, 96)
    for h in (1000, 0, 8):
        with pytest.raises(ValueError, match="multiple of 16 pixels"):
            latent_shape(h, 512)
    n = initial_noise(3, (16, 8, 8))
    assert n.dtype == np.float32 and n.shape == (16, 8, 8)
    np.testing.assert_array_equal(n, initial_noise(3, (16, 8, 8)))
    assert abs(float(n.std()) - 1.0) < 0.1
    steps = []
    euler_sample(lambda x, t: x, n, steps=3, on_step=lambda i, k, s: steps.append((i, k)))
    assert steps == [(0, 3), (1, 3), (2, 3)]
