"""The Z-Image-Turbo sampler: static-shift flow-matching sigmas, the Euler loop, and the
sampling entry over an open denoiser.

Owns the sigma schedule and the update rule (``docs/denoiser.md``, "The sampler"), driving any
callable ``model(x [C, H, W], t) -> raw output`` in the diffusers convention (t = 1 - sigma;
r ~ x0 - noise, not negated) (:func:`euler_sample`); the public entry :func:`sample` (checks the
caption features and noise against the model once -- :func:`check_cap_feats`,
:func:`check_noise` on :mod:`nxhpc.runtime.checks` -- then runs every step on ONE open
``Denoiser``: the same mapped weights, worker pool and shared-memory arena); and
:func:`decode_png` (the FLUX VAE decode through ``diffusers.AutoencoderKL``).
Must not: compute the transformer (``nxhpc.dit.denoiser`` does), or import torch or the kernels
outside :func:`decode_png`.

Sign: diffusers' ``ZImagePipeline`` negates the transformer output and its
``FlowMatchEulerDiscreteScheduler`` steps ``x += (sigma_{i+1} - sigma_i) * (-r)``, which is
``x += (sigma_i - sigma_{i+1}) * r`` here.
"""
from __future__ import annotations

import importlib.util
import os
import time
from collections.abc import Callable

import numpy as np

from nxhpc.runtime.checks import CheckError, check_float_array
from nxhpc.runtime.checks import NonFiniteOutputError as _NonFinite
from nxhpc.vae.config import FLUX_SCALING, FLUX_SHIFT

__all__ = ["euler_sample", "checked_euler", "initial_noise", "latent_shape", "turbo_sigmas",
           "sample", "guided", "check_guidance_scale",
           "check_cap_feats", "check_noise", "decode_png", "require_decode_deps",
           "SampleInputError", "NonFiniteOutputError", "VAE_SCALING", "VAE_SHIFT",
           "MAX_STEPS", "MAX_PIXELS"]

#: The FLUX VAE's latent normalization (``docs/denoiser.md``): pixels = decode(latents / 0.3611
#: + 0.1159): ``nxhpc.vae.config``'s constants; a file's own values are read there.
VAE_SCALING, VAE_SHIFT = FLUX_SCALING, FLUX_SHIFT


class SampleInputError(CheckError):
    """Caption features or noise that do not fit the model (shape, dtype, NaN/inf)."""


NonFiniteOutputError = _NonFinite
"""The denoiser returned NaN/inf at a step, or the latents left float32's range (names the
step and t): :class:`nxhpc.runtime.checks.NonFiniteOutputError`, the denoiser's own."""

Model = Callable[[np.ndarray, float], np.ndarray]


#: The most steps a schedule may have: far beyond any use (Turbo takes 8, flow-matching
#: schedulers train on 1000; the schedule is then 8 MB), where a mistyped 1e12 would allocate
#: terabytes.
MAX_STEPS = 1_000_000
#: The largest image side taken (CLIs, ``nxhpc.generate_image``): 16384 px is 1M image tokens
#: at 16384 x 16384 (beyond that even the noise no longer fits a machine's memory: 1.6e16 px
#: asked for exabytes).
MAX_PIXELS = 16384


def turbo_sigmas(steps: int = 8, shift: float = 3.0) -> np.ndarray:
    """float64 ``[steps + 1]``: ``s_i = 1 - i/steps`` (i < steps),
    ``sigma_i = shift*s / (1 + (shift - 1)*s)``, then ``sigma_steps = 0``.
    For 8 steps at shift 3: [1, .954545, .9, .833333, .75, .642857, .5, .3, 0].
    ValueError for steps outside [1, MAX_STEPS], a shift that is not a positive finite
    number, or a shift so extreme that the sigmas do not fall strictly in float64 (1e300:
    all 1; 1e-300: the first one inf)."""
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1 \
            or steps > MAX_STEPS:
        raise ValueError(f"turbo_sigmas: steps must be an int in [1, {MAX_STEPS}], got "
                         f"{steps!r}")
    if isinstance(shift, bool) or not isinstance(shift, (int, float, np.integer, np.floating)) \
            or not (np.isfinite(shift) and shift > 0):
        raise ValueError(f"turbo_sigmas: shift must be a positive number, got {shift!r}")
    s = 1.0 - np.arange(int(steps), dtype=np.float64) / int(steps)
    with np.errstate(all="ignore"):
        sig = np.concatenate([shift * s / (1.0 + (shift - 1.0) * s), [0.0]])
    if not np.isfinite(sig).all() or sig[0] > 1.0 or np.any(np.diff(sig) >= 0):
        raise ValueError(f"turbo_sigmas: shift {shift:g} gives no strictly falling schedule of "
                         f"{steps} steps in float64 (sigmas start {sig[:3].tolist()}); use a "
                         f"shift nearer 1 (Z-Image-Turbo: 3.0)")
    return sig


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


def check_cap_feats(cap_feats, cfg, what: str = "cap_feats") -> np.ndarray:
    """``[L >= 1, cfg.cap_dim]`` finite float -> C-contiguous float32, else SampleInputError
    (naming ``what``)."""
    a = np.asarray(cap_feats)
    if a.ndim != 2 or a.shape[0] < 1 or a.shape[1] != cfg.cap_dim:
        raise SampleInputError(f"{what}: shape {list(a.shape)}, expected [L, {cfg.cap_dim}] "
                               f"(L >= 1 caption tokens x the model's cap_dim {cfg.cap_dim})")
    return check_float_array(a, what, error=SampleInputError)


def check_noise(noise, cfg, shape: tuple[int, int, int] | None = None) -> np.ndarray:
    """``[C, H, W]`` (or ``[1, C, H, W]``) finite float noise, C = ``cfg.in_channels``, H, W
    positive multiples of ``cfg.patch`` (and equal to ``shape`` when given) -> float32 [C,H,W]."""
    a = np.asarray(noise)
    if a.ndim == 4 and a.shape[0] == 1:
        a = a[0]
    C, p = cfg.in_channels, cfg.patch
    if a.ndim != 3 or a.shape[0] != C or min(a.shape[1:]) < p or a.shape[1] % p \
            or a.shape[2] % p:
        raise SampleInputError(f"noise: shape {list(np.shape(noise))}, expected [{C}, H, W] "
                               f"with H, W positive multiples of {p} (image pixels / 8)")
    if shape is not None and tuple(a.shape) != tuple(shape):
        raise SampleInputError(f"noise: shape {list(a.shape)} does not match --height/--width "
                               f"(latents {list(shape)})")
    return check_float_array(a, "noise", error=SampleInputError)


def sample(denoiser, cap_feats, noise, *, steps: int = 8, shift: float = 3.0,
           on_step: Callable[[int, int, float], None] | None = None,
           guidance_scale: float = 0.0, negative_feats=None) -> np.ndarray:
    """Denoise ``noise [C, H, W]`` into latents with the Turbo sampler on ``denoiser`` (an open
    ``nxhpc.dit.denoiser.Denoiser``: ``config`` and ``forward(latents, t, cap_feats)``), caption
    features ``cap_feats [L, cap_dim]``, ``steps`` calls, static ``shift``. Every call goes to
    the same ``denoiser`` (its weights, pool and arena are reused). ``on_step(i, n, seconds)``
    after each step. Returns float32 ``[C, H, W]``.

    ``guidance_scale`` G > 0 turns on classifier-free guidance as diffusers' ``ZImagePipeline``
    computes it (:func:`guided`: ``pos + G * (pos - neg)``, two calls a step), with
    ``negative_feats [L', cap_dim]`` the negative prompt's features (an empty prompt's
    features for none); G = 0 (the default, as the Turbo model runs) is one call a step.

    The public boundary: the inputs are checked here, once, before any call; the denoiser's
    forward and :func:`euler_sample` trust them. Raises :class:`SampleInputError` (ValueError)
    for inputs that do not fit the model (and for ``negative_feats`` without G > 0 or G > 0
    without them); :class:`NonFiniteOutputError` when the model returns NaN/inf."""
    cfg = denoiser.config
    cap = check_cap_feats(cap_feats, cfg)
    x0 = check_noise(noise, cfg)
    sigmas = turbo_sigmas(steps, shift)
    if on_step is not None and not callable(on_step):    # not after the first step has run
        raise TypeError(f"sample: on_step must be callable (i, n, seconds), got {on_step!r}")
    g = check_guidance_scale(guidance_scale)
    if g == 0:
        if negative_feats is not None:
            raise SampleInputError("negative_feats given with guidance_scale 0 (guidance off): "
                                   "give guidance_scale > 0, or no negative_feats")
        return checked_euler(lambda x, t: denoiser.forward(x, t, cap), x0, sigmas,
                             on_step=on_step)
    if negative_feats is None:
        raise SampleInputError(f"guidance_scale {g:g} needs negative_feats (the negative "
                               f"prompt's caption features; an empty prompt's for none)")
    neg = check_cap_feats(negative_feats, cfg, "negative_feats")
    return checked_euler(guided(denoiser, cap, neg, g), x0, sigmas, on_step=on_step,
                         what="the guided output")


def check_guidance_scale(scale) -> float:
    """A guidance scale as a float: a finite real number >= 0 (0 = off), else
    SampleInputError."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.integer, np.floating)) \
            or not np.isfinite(scale) or scale < 0:
        raise SampleInputError(f"guidance_scale must be a finite number >= 0 (0 = off), got "
                               f"{scale!r}")
    return float(scale)


def guided(denoiser, cap: np.ndarray, neg: np.ndarray, scale: float) -> Model:
    """The raw-output function of classifier-free guidance, as ``ZImagePipeline`` computes it:
    ``pos + scale * (pos - neg)`` in float32, pos and neg the denoiser's outputs for the
    caption features ``cap`` and ``neg`` (both calls on the one open denoiser: it keeps an
    engine for each padded caption length, one for both when they pad alike). Inputs are
    trusted; run it through :func:`checked_euler`, which names the step where an output or
    the latents leave float32's range (:func:`sample` does both)."""
    g = np.float32(scale)

    def model(x: np.ndarray, t: float) -> np.ndarray:
        pos = np.asarray(denoiser.forward(x, t, cap), dtype=np.float32)
        ngt = np.asarray(denoiser.forward(x, t, neg), dtype=np.float32)
        with np.errstate(over="ignore", invalid="ignore"):     # checked by the caller
            return pos + g * (pos - ngt)
    return model


def checked_euler(call: Callable[[np.ndarray, float], np.ndarray], x0: np.ndarray,
                  sigmas: np.ndarray, *, on_step: Callable[[int, int, float], None] | None = None,
                  what: str = "the denoiser") -> np.ndarray:
    """:func:`euler_sample` over ``call(x, t)`` (the denoiser's raw output, or a guided one:
    ``what`` names it) with :func:`sample`'s checks at every step: latents that left float32's
    range, a NaN/inf output, and the final latents -- each a :class:`NonFiniteOutputError`
    naming the step and t. ``x0`` and ``sigmas`` are trusted (checked by the caller)."""
    calls = [0]

    def model(x: np.ndarray, t: float) -> np.ndarray:
        i, calls[0] = calls[0], calls[0] + 1
        if not np.isfinite(x).all():          # the previous update overflowed float32
            raise NonFiniteOutputError(f"step {i} (t={t:.6g}): the latents left float32's "
                                       f"range (NaN/inf after step {i - 1})")
        try:
            r = np.asarray(call(x, t))
        except NonFiniteOutputError as e:
            raise NonFiniteOutputError(f"step {i} (t={t:.6g}): the denoiser returned NaN/inf "
                                       f"({e})", count=e.count, size=e.size) from None
        bad = int(r.size - np.count_nonzero(np.isfinite(r)))
        if bad:
            raise NonFiniteOutputError(f"step {i} (t={t:.6g}): {what} returned NaN/inf "
                                       f"({bad} of {r.size} values)", count=bad, size=r.size)
        return r

    with np.errstate(over="ignore", invalid="ignore"):   # an overflow is reported, not warned
        x = euler_sample(model, x0, sigmas, on_step=on_step)
    bad = int(x.size - np.count_nonzero(np.isfinite(x)))
    if bad:
        raise NonFiniteOutputError(f"the final latents have {bad} of {x.size} values NaN/inf "
                                   f"(the last update left float32's range)", count=bad,
                                   size=x.size)
    return x


def require_decode_deps() -> None:
    """ImportError naming what :func:`decode_png` lacks (torch, diffusers), else nothing."""
    missing = [m for m in ("torch", "diffusers") if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(f"--decode needs {' and '.join(missing)} (not installed): "
                          f"pip install 'nxhpc[diffusers]'")


def decode_png(latents: np.ndarray, vae_dir: str | os.PathLike):
    """Decode ``latents [16, h, w]`` with ``diffusers.AutoencoderKL.from_pretrained(vae_dir)``
    (float32, CPU): ``vae.decode(latents / scaling_factor + shift_factor)`` (FLUX VAE: 0.3611,
    0.1159; read as ``nxhpc.vae`` reads them, ``docs/autoencoder.md``), then diffusers' own
    post-processing to an 8-bit RGB ``PIL.Image`` (what ``ZImagePipeline(output_type="pil")``
    returns). Imports torch and diffusers here only."""
    require_decode_deps()
    import torch
    from diffusers import AutoencoderKL
    from diffusers.image_processor import VaeImageProcessor
    from nxhpc.vae.config import latent_factors
    vae = AutoencoderKL.from_pretrained(os.fspath(vae_dir), torch_dtype=torch.float32).eval()
    # scaling and shift as nxhpc's decoder reads them, from the config diffusers read
    scale, shift = latent_factors(dict(vae.config), f"{vae_dir}")
    z = torch.from_numpy(np.ascontiguousarray(latents, dtype=np.float32))[None]
    with torch.no_grad():
        img = vae.decode(z / scale + shift, return_dict=False)[0]
    factor = 2 ** (len(vae.config.block_out_channels) - 1)
    return VaeImageProcessor(vae_scale_factor=factor * 2).postprocess(img, output_type="pil")[0]
