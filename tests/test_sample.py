"""The Turbo sampler on the nxhpc denoiser (nxhpc.dit.sampler.sample) vs diffusers' scheduler loop.

Oracle: diffusers' ``FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=False)``
stepping exactly as ``ZImagePipeline`` does (``sample_util.diffusers_turbo_loop``), driving
diffusers' ``ZImageTransformer2DModel`` in float32 that holds exactly the dequantized weights
of the GGUF the nxhpc denoiser opens (a random model, every parameter randomized, written in
the ComfyUI-GGUF layout: layers Q8_0, the rest BF16), from the same torch noise, 8 steps.
Caption L=19 and 16x12x10 latents (30 image tokens): both are padded to 32.

Tolerance: final latents within 1e-4 of max |x| (the requirement). What differs: the two
transformers' float32 arithmetic (each ~1e-6 of max|out| per call against float64; the
denoiser tests bound nxhpc's at 1e-5) and float32-vs-float64 sigma/t arithmetic (~1e-7); over
8 Euler steps with step sizes summing to 1 that stays ~1e-5. Negative controls (the pipeline's
sign flip forgotten, shift 1 instead of 3, t = sigma instead of 1 - sigma) miss by > 100x.
"""
from __future__ import annotations

import numpy as np
import pytest
from pipeline_fixtures import pipeline_config, zimage_file_case
from sample_util import child_pids, diffusers_turbo_loop, open_test_denoiser, shm_entries
from testutil import rel_err

from nxhpc.dit.sampler import turbo_sigmas
from nxhpc.dit.sampler import NonFiniteOutputError, SampleInputError, sample

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

REL_TOL = 1e-4
CAP_DIM = 320
LAT = (16, 12, 10)
pytestmark = pytest.mark.usefixtures("torch_threads")    # conftest: 2 intra-op threads


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    return zimage_file_case(tmp_path_factory.mktemp("zs"), pipeline_config(cap_dim=CAP_DIM),
                            "comfyui-q8_0", seed=11)


@pytest.fixture(scope="module")
def den(case):
    with open_test_denoiser(case.path, workers=2) as d:
        yield d


@pytest.fixture(scope="module")
def inputs():
    cap = np.random.default_rng(12).standard_normal((19, CAP_DIM)).astype(np.float32)
    noise = torch.randn((1,) + LAT, generator=torch.Generator().manual_seed(13))
    return cap, noise


@pytest.fixture(scope="module")
def oracle(case, inputs):
    from nxhpc.dit.oracle import diffusers_zimage
    cap, noise = inputs
    model32 = diffusers_zimage(case.cfg, case.file.weights, dtype=torch.float32)
    return diffusers_turbo_loop(model32, cap, noise, steps=8, shift=3.0)


class _Wrap:
    """The denoiser's API around another one, with a change for negative controls and a log."""

    def __init__(self, inner, fn=None):
        self.inner, self.fn, self.ts = inner, fn, []
        self.config = inner.config

    def forward(self, x, t, cap):
        self.ts.append(t)
        if self.fn is None:
            return self.inner.forward(x, t, cap)
        return self.fn(self.inner, x, t, cap)


def test_eight_steps_match_diffusers_scheduler(den, inputs, oracle):
    cap, noise = inputs
    w = _Wrap(den)
    x = sample(w, cap, noise[0].numpy(), steps=8, shift=3.0)
    assert x.dtype == np.float32 and x.shape == LAT
    np.testing.assert_allclose(w.ts, 1.0 - turbo_sigmas(8, 3.0)[:-1], rtol=0, atol=1e-12)
    err = rel_err(x, oracle)
    assert err <= REL_TOL, err
    assert rel_err(x, noise[0].numpy()) > 0.1                       # the loop moved x

    controls = {
        "sign flipped": (_Wrap(den, lambda d, x, t, c: -d.forward(x, t, c)), 3.0),
        "shift 1": (_Wrap(den), 1.0),
        "t = sigma": (_Wrap(den, lambda d, x, t, c: d.forward(x, 1.0 - t, c)), 3.0),
    }
    for name, (wrapped, shift) in controls.items():
        bad = sample(wrapped, cap, noise[0].numpy(), steps=8, shift=shift)
        assert rel_err(bad, oracle) > 100 * REL_TOL, name


def test_sampler_is_deterministic_and_reuses_one_denoiser(den, inputs):
    cap, noise = inputs
    kids, segs = [], []

    def on_step(i, n, s):
        kids.append(child_pids())
        segs.append(shm_entries())

    a = sample(den, cap, noise[0].numpy(), steps=4, on_step=on_step)
    b = sample(den, cap, noise[0].numpy(), steps=4)
    np.testing.assert_array_equal(a, b)
    assert len(kids) == 4
    # the same worker processes and the same shared memory for every step: no re-fork, no
    # new segment per step (kids[0] non-empty: the denoiser does run in forked workers)
    assert kids[0] and all(k == kids[0] for k in kids) and all(s == segs[0] for s in segs)


def test_bad_inputs_are_refused_before_any_call(den):
    w = _Wrap(den)
    ok_cap = np.zeros((5, CAP_DIM), np.float32)
    ok_noise = np.zeros(LAT, np.float32)
    nan_cap = ok_cap.copy()
    nan_cap[2, 3] = np.nan
    cases = [
        (np.zeros((5, CAP_DIM + 1), np.float32), ok_noise, r"cap_feats: shape \[5, 321\]"),
        (np.zeros(CAP_DIM, np.float32), ok_noise, "expected \\[L, 320\\]"),
        (np.zeros((0, CAP_DIM), np.float32), ok_noise, "L >= 1"),
        (nan_cap, ok_noise, "1 of 1600 values are NaN"),
        (np.zeros((5, CAP_DIM), np.int32), ok_noise, "floating-point"),
        (ok_cap, np.zeros((8, 12, 10), np.float32), r"noise: shape \[8, 12, 10\]"),
        (ok_cap, np.zeros((16, 11, 10), np.float32), "multiples of 2"),
        (ok_cap, np.zeros((16, 12, 11), np.float32), "multiples of 2"),     # the width alone
        (ok_cap, np.zeros((16, 12, 0), np.float32), "multiples of 2"),
        (ok_cap, np.full(LAT, np.inf, np.float32), "NaN or inf"),
    ]
    for cap, noise, msg in cases:
        with pytest.raises(SampleInputError, match=msg):
            sample(w, cap, noise)
    assert w.ts == []
    with pytest.raises(ValueError, match="steps must be"):
        sample(w, ok_cap, ok_noise, steps=0)
    # [1, C, H, W] noise (diffusers' latents with the batch axis) is accepted
    x = sample(w, ok_cap, ok_noise[None], steps=1)
    assert x.shape == LAT


def test_non_finite_model_output_names_the_step(den):
    w = _Wrap(den, lambda d, x, t, c: d.forward(x, t, c) * (np.nan if len(w.ts) == 3 else 1))
    with pytest.raises(NonFiniteOutputError, match=r"step 2 \(t=0\.1"):
        sample(w, np.ones((3, CAP_DIM), np.float32), np.ones(LAT, np.float32), steps=8)
