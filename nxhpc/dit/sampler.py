"""The Z-Image-Turbo sampler: static-shift flow-matching sigmas and the Euler loop.

Owns the sigma schedule and the update rule (``DENOISER.md``, "The sampler"), driving any
callable ``model(x [C, H, W], t) -> raw output`` in the diffusers convention (t = 1 - sigma;
r ~ x0 - noise, not negated). It knows nothing about what the model runs on and never imports
torch or the kernels.

Sign: diffusers' ``ZImagePipeline`` negates the transformer output and its
``FlowMatchEulerDiscreteScheduler`` steps ``x += (sigma_{i+1} - sigma_i) * (-r)``, which is
``x += (sigma_i - sigma_{i+1}) * r`` here.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

__all__ = ["euler_sample", "initial_noise", "latent_shape", "turbo_sigmas"]

Model = Callable[[np.ndarray, float], np.ndarray]


def turbo_sigmas(steps: int = 8, shift: float = 3.0) -> np.ndarray:
    """float64 ``[steps + 1]``: ``s_i = 1 - i/steps`` (i < steps),
    ``sigma_i = shift*s / (1 + (shift - 1)*s)``, then ``sigma_steps = 0``.
    For 8 steps at shift 3: [1, .954545, .9, .833333, .75, .642857, .5, .3, 0]."""
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
        raise ValueError(f"turbo_sigmas: steps must be an int >= 1, got {steps!r}")
    if not (np.isfinite(shift) and shift > 0):
        raise ValueError(f"turbo_sigmas: shift must be positive, got {shift!r}")
    s = 1.0 - np.arange(int(steps), dtype=np.float64) / int(steps)
    sig = shift * s / (1.0 + (shift - 1.0) * s)
    return np.concatenate([sig, [0.0]])


def latent_shape(height_px: int, width_px: int, channels: int = 16,
                 vae_factor: int = 8, patch: int = 2) -> tuple[int, int, int]:
    """Latent ``[C, H/8, W/8]`` for an image of ``height_px x width_px`` (each a multiple of
    ``vae_factor * patch`` = 16, so the latent splits into 2x2 patches)."""
    m = vae_factor * patch
    for nm, v in (("height", height_px), ("width", width_px)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < m or v % m:
            raise ValueError(f"latent_shape: {nm} must be a positive multiple of {m} pixels, "
                             f"got {v!r}")
    return (channels, height_px // vae_factor, width_px // vae_factor)


def initial_noise(seed: int, shape: tuple[int, ...]) -> np.ndarray:
    """Standard normal float32 noise of ``shape`` from ``numpy.random.default_rng(seed)``.
    (Not diffusers' torch generator: pass its noise explicitly to compare with it.)"""
    return np.random.default_rng(int(seed)).standard_normal(shape, dtype=np.float32)


def euler_sample(model: Model, noise: np.ndarray, sigmas: np.ndarray | None = None, *,
                 steps: int = 8, shift: float = 3.0, dtype=np.float32,
                 on_step: Callable[[int, int, float], None] | None = None) -> np.ndarray:
    """Run the flow-matching Euler loop from ``noise`` and return the last ``x``.

    ``sigmas`` (default :func:`turbo_sigmas` ``(steps, shift)``) must fall from <= 1 to 0.
    Step i calls ``r = model(x, 1 - sigma_i)`` and sets ``x += (sigma_i - sigma_{i+1}) * r``;
    ``x`` is kept in ``dtype`` (float32, as diffusers keeps its latents). ``on_step(i, n,
    seconds)`` is called after each model call. A raw output of the wrong shape or with
    NaN/Inf raises ValueError naming the step.
    """
    sig = turbo_sigmas(steps, shift) if sigmas is None else np.asarray(sigmas, np.float64)
    if sig.ndim != 1 or sig.size < 2 or sig[-1] != 0.0 or not np.isfinite(sig).all() \
            or sig[0] > 1.0 or np.any(np.diff(sig) >= 0):
        raise ValueError(f"euler_sample: sigmas must decrease strictly from <= 1 to 0, got "
                         f"{sig.tolist()}")
    x = np.array(noise, dtype=dtype, copy=True)
    if not np.isfinite(x).all():
        raise ValueError("euler_sample: noise contains NaN/Inf")
    n = sig.size - 1
    for i in range(n):
        t0 = time.perf_counter()
        r = np.asarray(model(x, float(1.0 - sig[i])))
        if r.shape != x.shape:
            raise ValueError(f"euler_sample: step {i}: model returned {r.shape}, expected "
                             f"{x.shape}")
        if not np.isfinite(r).all():
            raise ValueError(f"euler_sample: step {i} (t={1.0 - sig[i]:.6g}): model output "
                             f"contains NaN/Inf")
        x = (x + (sig[i] - sig[i + 1]) * r).astype(dtype, copy=False)
        if on_step is not None:
            on_step(i, n, time.perf_counter() - t0)
    return x
