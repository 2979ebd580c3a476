"""``python -m nxhpc.sample``: the Z-Image-Turbo sampling loop on the nxhpc denoiser, from
caption features to denoised latents (and, optionally, a PNG through diffusers' VAE).

Owns: the library entry :func:`sample` (checks the inputs against the model, runs
:func:`nxhpc.dit.sampler.euler_sample` over ONE open ``Denoiser`` — the same mapped weights,
worker pool and shared-memory arena for every step), :func:`decode_png` (the FLUX VAE decode,
``latents / scaling_factor + shift_factor`` = ``/ 0.3611 + 0.1159``, through
``diffusers.AutoencoderKL``; torch and diffusers are imported only there), and the CLI
(arguments, progress bar, report, atomic outputs, exit codes). Must not: compute the transformer
(``nxhpc.dit.denoiser`` does), change the schedule or update rule (``nxhpc.dit.sampler`` owns
them), or import torch unless ``--decode`` is given. Exit codes and argument helpers are
``nxhpc.blockrun``'s.

Sign and time: the denoiser returns the raw output r in the diffusers convention (t = 1 -
sigma, r ~ x0 - noise, not negated); step i is ``x += (sigma_i - sigma_{i+1}) * r_i``, which is
diffusers' ``ZImagePipeline`` + ``FlowMatchEulerDiscreteScheduler(shift=3.0,
use_dynamic_shifting=False)`` without classifier-free guidance.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import textwrap
import time
import traceback
from collections.abc import Callable

import numpy as np

from nxhpc.blockrun import (EXIT_BAD_FILE, EXIT_FAIL, EXIT_INTERNAL, EXIT_MISSING,
                            EXIT_MODELS_DIR, EXIT_NOT_FOUND, EXIT_OUTPUT, EXIT_PASS, EXIT_SHM,
                            EXIT_SIGINT, EXIT_SIGTERM, EXIT_USAGE, EXIT_WORKER, _positive_float,
                            _positive_int, _workers_arg, cli_main)
from nxhpc.dit.grade import json_safe
from nxhpc.dit.sampler import euler_sample, initial_noise, latent_shape, turbo_sigmas
from nxhpc.runtime.outfile import OutputPathError, check_output_path, write_atomic
from nxhpc.runtime.proc import cli_signals

__all__ = ["EXIT_CODES", "NonFiniteOutputError", "SampleInputError", "build_parser",
           "decode_png", "load_array", "main", "sample", "VAE_SCALING", "VAE_SHIFT"]

VAE_SCALING, VAE_SHIFT = 0.3611, 0.1159
"""The FLUX VAE's latent normalization (``DENOISER.md``): pixels = decode(latents / 0.3611 +
0.1159). Used when the VAE's config does not carry ``scaling_factor`` / ``shift_factor``."""

EXIT_CODES = {
    EXIT_PASS: "the latents (and the PNG) were written",
    EXIT_FAIL: "the denoiser returned NaN/inf at some step (nothing was written)",
    EXIT_USAGE: "usage error: bad arguments (--height/--width not a positive multiple of 16, "
                "--steps 0, both --seed and --noise, a missing --cap-feats/--noise file, "
                "--png without --decode, --decode without torch/diffusers, an output path that "
                "cannot be written or is one of the inputs)",
    EXIT_NOT_FOUND: "model not found (id, directory or GGUF path), or --decode VAE_DIR missing",
    EXIT_BAD_FILE: "bad input: a malformed model file, or --cap-feats/--noise that do not fit "
                   "the model ([L, cap_dim] caption features; [16, H/8, W/8] noise; float, "
                   "finite), or a VAE that cannot be loaded or decode",
    EXIT_MISSING: "a tensor is missing from the model file",
    EXIT_WORKER: "a worker process failed (raised, crashed or was killed)",
    EXIT_SHM: "not enough shared memory for the arena (in a container use --shm-size)",
    EXIT_OUTPUT: "--out or --png could not be written (e.g. disk full); an existing file at "
                 "that path is unchanged (the latents are written before the PNG)",
    EXIT_MODELS_DIR: "the models directory ($NXHPC_MODELS / --models-dir) cannot take a "
                     "built-in model: not a directory, not writable, or full",
    EXIT_INTERNAL: "internal error (a bug: please report the traceback)",
    EXIT_SIGINT: "interrupted by Ctrl-C / SIGINT (workers stopped, shared memory released)",
    EXIT_SIGTERM: "terminated by SIGTERM (workers stopped, shared memory released)",
}


class SampleInputError(ValueError):
    """Caption features or noise that do not fit the model (shape, dtype, NaN/inf)."""


class NonFiniteOutputError(ArithmeticError):
    """The denoiser returned NaN/inf at a step (names the step and t)."""


class _UsageError(Exception):
    pass


class _NotFound(Exception):
    pass


class _OutputError(Exception):
    pass


# ----------------------------------------------------------------------------- library

def _check_float_array(a: np.ndarray, what: str) -> None:
    if a.dtype.kind != "f":
        raise SampleInputError(f"{what}: dtype {a.dtype}, expected a floating-point array")
    bad = int(a.size - np.count_nonzero(np.isfinite(a)))
    if bad:
        raise SampleInputError(f"{what}: {bad} of {a.size} values are NaN or inf")


def check_cap_feats(cap_feats, cfg) -> np.ndarray:
    """``[L >= 1, cfg.cap_dim]`` finite float -> C-contiguous float32, else SampleInputError."""
    a = np.asarray(cap_feats)
    if a.ndim != 2 or a.shape[0] < 1 or a.shape[1] != cfg.cap_dim:
        raise SampleInputError(f"cap_feats: shape {list(a.shape)}, expected [L, {cfg.cap_dim}] "
                               f"(L >= 1 caption tokens x the model's cap_dim {cfg.cap_dim})")
    _check_float_array(a, "cap_feats")
    return np.ascontiguousarray(a, dtype=np.float32)


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
    _check_float_array(a, "noise")
    return np.ascontiguousarray(a, dtype=np.float32)


def sample(denoiser, cap_feats, noise, *, steps: int = 8, shift: float = 3.0,
           on_step: Callable[[int, int, float], None] | None = None) -> np.ndarray:
    """Denoise ``noise [C, H, W]`` into latents with the Turbo sampler on ``denoiser`` (an open
    ``nxhpc.dit.denoiser.Denoiser``: ``config`` and ``forward(latents, t, cap_feats)``), caption
    features ``cap_feats [L, cap_dim]``, ``steps`` calls, static ``shift``. Every call goes to
    the same ``denoiser`` (its weights, pool and arena are reused). ``on_step(i, n, seconds)``
    after each call. Returns float32 ``[C, H, W]``.

    Raises :class:`SampleInputError` (ValueError) for inputs that do not fit the model, before
    any call; :class:`NonFiniteOutputError` when the model returns NaN/inf."""
    cfg = denoiser.config
    cap = check_cap_feats(cap_feats, cfg)
    x0 = check_noise(noise, cfg)
    sigmas = turbo_sigmas(steps, shift)
    calls = [0]

    def model(x: np.ndarray, t: float) -> np.ndarray:
        i, calls[0] = calls[0], calls[0] + 1
        r = np.asarray(denoiser.forward(x, t, cap))
        if not np.isfinite(r).all():
            raise NonFiniteOutputError(f"step {i} (t={t:.6g}): the denoiser returned NaN/inf")
        return r

    return euler_sample(model, x0, sigmas, on_step=on_step)


def _require_decode_deps() -> None:
    missing = [m for m in ("torch", "diffusers") if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(f"--decode needs {' and '.join(missing)} (not installed): "
                          f"pip install 'nxhpc[diffusers]'")


def decode_png(latents: np.ndarray, vae_dir: str | os.PathLike):
    """Decode ``latents [16, h, w]`` with ``diffusers.AutoencoderKL.from_pretrained(vae_dir)``
    (float32, CPU): ``vae.decode(latents / scaling_factor + shift_factor)`` (FLUX VAE: 0.3611,
    0.1159), then diffusers' own post-processing to an 8-bit RGB ``PIL.Image`` (what
    ``ZImagePipeline(output_type="pil")`` returns). Imports torch and diffusers here only."""
    _require_decode_deps()
    import torch
    from diffusers import AutoencoderKL
    from diffusers.image_processor import VaeImageProcessor
    vae = AutoencoderKL.from_pretrained(os.fspath(vae_dir), torch_dtype=torch.float32).eval()
    scale = getattr(vae.config, "scaling_factor", None) or VAE_SCALING
    shift = getattr(vae.config, "shift_factor", None)
    shift = VAE_SHIFT if shift is None else shift
    z = torch.from_numpy(np.ascontiguousarray(latents, dtype=np.float32))[None]
    with torch.no_grad():
        img = vae.decode(z / scale + shift, return_dict=False)[0]
    factor = 2 ** (len(vae.config.block_out_channels) - 1)
    return VaeImageProcessor(vae_scale_factor=factor * 2).postprocess(img, output_type="pil")[0]


def load_array(path: str, what: str) -> np.ndarray:
    """``np.load`` (no pickles) with clear errors: a missing file is a usage error (exit 2),
    an unreadable one SampleInputError (exit 4)."""
    if not os.path.exists(path):
        raise _UsageError(f"{what} {path}: no such file")
    if os.path.isdir(path):
        raise _UsageError(f"{what} {path}: is a directory, expected a .npy file")
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise SampleInputError(f"{what} {path}: cannot read a .npy array: {e}") from None


# ----------------------------------------------------------------------------- CLI

def _px_arg(s: str) -> int:
    v = _positive_int(s)
    if v % 16:
        raise argparse.ArgumentTypeError(f"must be a positive multiple of 16 pixels (the VAE's "
                                         f"8x times the 2x2 patch), got {v}; e.g. "
                                         f"{max(16, (v // 16) * 16)} or {(v // 16 + 1) * 16}")
    return v


def _seed_arg(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {s!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {s!r}")
    return v


def _fill(text: str) -> str:
    return textwrap.fill(text, 92)


def build_parser() -> argparse.ArgumentParser:
    codes = "\n".join(textwrap.fill(v, 92, initial_indent=f"  {k:>3}  ",
                                     subsequent_indent=" " * 7) for k, v in EXIT_CODES.items())
    p = argparse.ArgumentParser(
        prog="python -m nxhpc.sample",
        description=_fill(
            "Z-Image-Turbo sampling on nxhpc's CPU denoiser: flow-matching Euler with a static "
            "shift, no classifier-free guidance (sigma_i = shift*s/(1+(shift-1)*s), s = 1 - "
            "i/steps; x += (sigma_i - sigma_{i+1}) * r(x, t = 1 - sigma_i)). Starts from --noise "
            "or N(0, 1) noise drawn with --seed, writes the final latents [16, H/8, W/8] as "
            "float32 .npy; --decode VAE_DIR --png OUT.png also decodes them with diffusers' "
            "AutoencoderKL (the FLUX VAE)."),
        epilog=_fill("caption features: Qwen3-4B hidden_states[-2] of the chat-templated prompt, "
                     "real tokens only, float32 [L, cap_dim] (cap_dim 2560 for Z-Image).") + "\n"
               + _fill("noise from --seed: numpy.random.default_rng(seed).standard_normal "
                       "(float32), not torch's generator; to compare with diffusers pass its "
                       "noise with --noise.") + "\n\nexit codes:\n" + codes,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="built-in id (e.g. tiny-dit), a model directory, or a GGUF file")
    p.add_argument("n_workers", nargs="?", type=_workers_arg, default=None,
                   help="worker processes (same as --workers; default: the usable CPUs)")
    p.add_argument("--workers", type=_workers_arg, default=None, metavar="N",
                   help="worker processes (default: the usable CPUs)")
    p.add_argument("--cap-feats", required=True, metavar="C.npy",
                   help="caption features, float [L, cap_dim]")
    p.add_argument("--height", type=_px_arg, default=None, metavar="PX",
                   help="image height in pixels, a multiple of 16 (required unless --noise)")
    p.add_argument("--width", type=_px_arg, default=None, metavar="PX",
                   help="image width in pixels, a multiple of 16 (required unless --noise)")
    p.add_argument("--steps", type=_positive_int, default=8, help="transformer calls (default 8)")
    p.add_argument("--shift", type=_positive_float, default=3.0,
                   help="static timestep shift (default 3.0, Z-Image-Turbo's)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--seed", type=_seed_arg, default=None,
                     help="seed for the starting noise (default 0)")
    src.add_argument("--noise", metavar="N.npy", default=None,
                     help="start from this float [16, PX/8, PX/8] noise instead of drawing it")
    p.add_argument("--out", required=True, metavar="LATENTS.npy",
                   help="where the final latents go (float32 .npy, written atomically)")
    p.add_argument("--decode", metavar="VAE_DIR", default=None,
                   help="a diffusers AutoencoderKL directory (the FLUX VAE) to decode with; "
                        "needs torch and diffusers (pip install 'nxhpc[diffusers]')")
    p.add_argument("--png", metavar="OUT.png", default=None,
                   help="where the decoded image goes (with --decode; written atomically)")
    p.add_argument("--models-dir", default=None,
                   help="where model ids are looked up / built-ins generated "
                        "(default $NXHPC_MODELS or ~/.cache/nxhpc/models)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object instead of key=value lines")
    return p


def _err(msg: str) -> None:
    print(f"sample: error: {msg}", file=sys.stderr, flush=True)


def _open_denoiser(model: str, *, workers: int, models_dir: str | None):
    """The one place the CLI opens the model (tests may stand in for it)."""
    from nxhpc.models.registry import open_denoiser
    return open_denoiser(model, workers=workers, models_dir=models_dir)


def _exit_code(e: BaseException) -> int | None:
    from nxhpc.dit.denoiser import DenoiserInputError
    from nxhpc.dit.config import DenoiserConfigError
    from nxhpc.models import MissingTensorError, ModelError, ModelNotFoundError, ModelsDirError
    from nxhpc.runtime.shm import ShmSpaceError
    from nxhpc.runtime.workers import WorkerError
    for cls, code in ((_UsageError, EXIT_USAGE), (_NotFound, EXIT_NOT_FOUND),
                      (_OutputError, EXIT_OUTPUT), (NonFiniteOutputError, EXIT_FAIL),
                      (SampleInputError, EXIT_BAD_FILE), (DenoiserInputError, EXIT_BAD_FILE),
                      (ModelsDirError, EXIT_MODELS_DIR), (ModelNotFoundError, EXIT_NOT_FOUND),
                      (MissingTensorError, EXIT_MISSING), (ModelError, EXIT_BAD_FILE),
                      (DenoiserConfigError, EXIT_BAD_FILE), (WorkerError, EXIT_WORKER),
                      (ShmSpaceError, EXIT_SHM)):
        if isinstance(e, cls):
            return code
    return None


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (see ``--help``)."""
    parser = build_parser()
    try:
        args = parser.parse_intermixed_args(argv)   # n_workers may follow the options
    except SystemExit as e:                   # argparse: --help -> 0, usage errors -> 2
        return int(e.code or 0)
    return cli_main(_err, lambda sig: _run(args, sig))


def _run(args, sig: cli_signals) -> int:
    try:
        return _run_checked(args)
    except Exception as e:            # KeyboardInterrupt / Terminated are not Exceptions
        interrupt = sig.interrupt()
        if interrupt is not None:     # a Ctrl-C that C code turned into another exception
            raise interrupt from e
        code = _exit_code(e)
        if code is None:
            traceback.print_exc()
            _err("internal error (see the traceback above)")
            return EXIT_INTERNAL
        _err(f"worker failure: {e}" if code == EXIT_WORKER else str(e))
        return code


def _check_args(args) -> tuple[int, tuple[int, int] | None]:
    """Everything that needs no model: exit 2/3 before any work."""
    if args.n_workers is not None and args.workers is not None \
            and args.n_workers != args.workers:
        raise _UsageError(f"n_workers {args.n_workers} and --workers {args.workers} disagree; "
                          f"give one")
    from nxhpc.runtime.workers import usable_cpus
    workers = args.workers or args.n_workers or usable_cpus()
    if (args.height is None) != (args.width is None):
        raise _UsageError("give both --height and --width (or neither, with --noise)")
    if args.height is None and args.noise is None:
        raise _UsageError("--height and --width are required unless --noise is given")
    px = None if args.height is None else (args.height, args.width)
    if args.png is not None and args.decode is None:
        raise _UsageError("--png needs --decode VAE_DIR (the VAE to decode with)")
    if args.decode is not None and args.png is None:
        raise _UsageError("--decode needs --png OUT.png (where the image goes)")
    if args.decode is not None:
        try:
            _require_decode_deps()
        except ImportError as e:
            raise _UsageError(str(e)) from None
    inputs = [args.cap_feats] + ([args.noise] if args.noise else [])
    if os.path.isfile(args.model):
        inputs.append(args.model)
    outs = [("--out", args.out)] + ([("--png", args.png)] if args.png else [])
    if len(outs) == 2 and os.path.realpath(args.out) == os.path.realpath(args.png):
        raise _UsageError(f"--out and --png are the same file ({args.out})")
    for what, path in outs:
        try:
            check_output_path(path, what=what, inputs=inputs)
        except OutputPathError as e:
            raise _UsageError(str(e)) from None
    if args.decode is not None:
        if not os.path.isdir(args.decode):
            raise _NotFound(f"--decode {args.decode}: no such directory (a diffusers "
                            f"AutoencoderKL directory with config.json)")
        if not os.path.isfile(os.path.join(args.decode, "config.json")):
            raise _NotFound(f"--decode {args.decode}: no config.json there (expected a "
                            f"diffusers AutoencoderKL directory)")
    return workers, px


class _Progress:
    """One tqdm bar over the steps on stderr (seconds per step in the postfix); plain lines
    when tqdm is not installed."""

    def __init__(self, n: int, enabled: bool) -> None:
        self.n, self.bar = n, None
        self.enabled = enabled
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self.bar = tqdm(total=n, desc="sample", unit="step", file=sys.stderr,
                            dynamic_ncols=True, leave=True)

    def __call__(self, i: int, n: int, seconds: float) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(f"{seconds:.2f} s/step", refresh=False)
            self.bar.update(1)
        elif self.enabled:
            print(f"sample: step {i + 1}/{n} ({seconds:.2f} s)", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _run_checked(args) -> int:
    workers, px = _check_args(args)
    cap_raw = load_array(args.cap_feats, "--cap-feats")
    noise_raw = load_array(args.noise, "--noise") if args.noise is not None else None
    seed = None if noise_raw is not None else (0 if args.seed is None else args.seed)

    t_open = time.perf_counter()
    with _open_denoiser(args.model, workers=workers, models_dir=args.models_dir) as den:
        cfg = den.config
        try:
            cap = check_cap_feats(cap_raw, cfg)
        except SampleInputError as e:
            raise SampleInputError(f"--cap-feats {args.cap_feats}: {e}") from None
        shape = None if px is None else latent_shape(px[0], px[1], cfg.in_channels, 8, cfg.patch)
        if noise_raw is not None:
            try:
                noise = check_noise(noise_raw, cfg, shape)
            except SampleInputError as e:
                raise SampleInputError(f"--noise {args.noise}: {e}") from None
        else:
            noise = initial_noise(seed, shape)
        height, width = noise.shape[1] * 8, noise.shape[2] * 8
        open_s = time.perf_counter() - t_open

        step_s: list[float] = []
        step_timings: list[dict] = []

        progress = _Progress(args.steps, not args.no_progress)

        def on_step(i, n, seconds):
            step_s.append(seconds)
            step_timings.append(dict(getattr(den, "last_timings", None) or {}))
            progress(i, n, seconds)

        t0 = time.perf_counter()
        try:
            lat = sample(den, cap, noise, steps=args.steps, shift=args.shift, on_step=on_step)
        finally:
            progress.close()
        total_s = time.perf_counter() - t0

    report = {"model": args.model, "config": cfg.summary() if hasattr(cfg, "summary") else None,
              "workers": workers, "height": height, "width": width,
              "latent_shape": list(lat.shape), "caption_tokens": int(cap.shape[0]),
              "steps": args.steps, "shift": args.shift,
              "sigmas": [round(float(s), 9) for s in turbo_sigmas(args.steps, args.shift)],
              "seed": seed, "noise": args.noise, "open_s": round(open_s, 6),
              "step_s": [round(s, 6) for s in step_s], "total_s": round(total_s, 6),
              "s_per_step": round(total_s / args.steps, 6),
              "latents_mean": float(lat.mean()), "latents_std": float(lat.std()),
              "out": str(args.out), "png": None}
    if step_timings and step_timings[-1]:
        report["last_step_timings"] = step_timings[-1]
    try:
        write_atomic(args.out, lambda f: np.save(f, lat.astype(np.float32, copy=False)))
    except OSError as e:
        raise _OutputError(f"--out {args.out}: could not write the latents: {e.strerror or e}; "
                           f"an existing file at that path is unchanged") from None
    if args.decode is not None:
        t1 = time.perf_counter()
        try:
            img = decode_png(lat, args.decode)
        except Exception as e:        # whatever diffusers raises for a VAE it cannot use
            raise SampleInputError(f"--decode {args.decode}: cannot decode with this VAE "
                                   f"(the latents were written to {args.out}): {e}") from None
        try:
            write_atomic(args.png, lambda f: img.save(f, format="PNG"))
        except OSError as e:
            raise _OutputError(f"--png {args.png}: could not write the image: "
                               f"{e.strerror or e}; the latents were written to {args.out}"
                               ) from None
        report["png"] = str(args.png)
        report["decode_s"] = round(time.perf_counter() - t1, 6)
    if args.json:
        print(json.dumps(json_safe(report), allow_nan=False))
    else:
        for k, v in report.items():
            if isinstance(v, dict):
                v = " ".join(f"{a}={b}" for a, b in v.items())
            elif isinstance(v, list):
                v = ",".join(f"{x:g}" if isinstance(x, float) else str(x) for x in v)
            elif isinstance(v, float):
                v = f"{v:.6g}"
            print(f"{k}={v}")
    sys.stdout.flush()
    return EXIT_PASS


if __name__ == "__main__":
    sys.exit(main())
