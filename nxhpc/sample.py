"""``python -m nxhpc.sample`` (``nxhpc-sample``, ``nxhpc sample``): the Z-Image-Turbo sampling
loop on the nxhpc denoiser, from caption features to denoised latents (and, optionally, a PNG
through diffusers' VAE).

Owns the CLI only: parse -> :func:`nxhpc.dit.sampler.sample` (and
:func:`~nxhpc.dit.sampler.decode_png`) -> report (progress bar, key=value / ``--json``, atomic
outputs). The sampler, its input checks and the decode are library code in
``nxhpc.dit.sampler``; exit codes, the signal frame, the argparse types and the writer are
:mod:`nxhpc.cli`'s. Must not: compute the transformer, change the schedule or update rule,
import torch unless ``--decode`` is given, or import another CLI.

Sign and time: the denoiser returns the raw output r in the diffusers convention (t = 1 -
sigma, r ~ x0 - noise, not negated); step i is ``x += (sigma_i - sigma_{i+1}) * r_i``, which is
diffusers' ``ZImagePipeline`` + ``FlowMatchEulerDiscreteScheduler(shift=3.0,
use_dynamic_shifting=False)`` without classifier-free guidance.

Several seeds (``--seeds A,B,...``, ``--out`` naming ``{seed}``): one image per seed; under
``mpirun -n R`` each rank samples whole images of its own (seed band ``[r*n//R, (r+1)*n//R)``,
no exchange) and rank 0 gathers and writes them all and prints the one report. One seed under
``mpirun`` (``--seed S`` or ``--seeds S``): each call is split across the ranks
(``nxhpc.nn.engine``), rank 0 writes. The report's ``split`` says which (``call`` /
``images``). Either way every image has the bytes a single process makes.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import textwrap
import time

import numpy as np

from nxhpc.cli import args as types   # first: nxhpc.cli repairs a shadowed package
from nxhpc.cli.codes import Exit, NotFound, OutputError, UsageError, codes_epilog
from nxhpc.cli.frame import on_every_rank, run_ranked
from nxhpc.cli.progress import Progress
from nxhpc.cli.report import png_text, print_report, save_bytes, save_npy
from nxhpc.dit.sampler import (MAX_STEPS, SampleInputError, check_cap_feats, check_noise,
                               decode_png,
                               initial_noise, latent_shape,
                               require_decode_deps, sample, turbo_sigmas)
from nxhpc.runtime.checks import load_npy
from nxhpc.runtime.outfile import check_cli_output_path

__all__ = ["EXIT_CODES", "build_parser", "main"]

PROG = "sample"

#: The codes sample returns, in its words (the numbers are nxhpc.cli.codes.Exit's).
EXIT_CODES = {
    Exit.PASS: "the latents (and the PNG) were written",
    Exit.FAIL: "the denoiser returned NaN/inf at some step, or the latents left float32's "
               "range (nothing was written)",
    Exit.USAGE: "usage error: bad arguments (--height/--width not a positive multiple of 16 "
                "up to 16384, --steps 0 or above 1000000, a --shift with no strictly falling "
                "schedule, both --seed and --noise, a missing --cap-feats/--noise file, "
                "--png without --decode, --decode without torch/diffusers, an output path that "
                "cannot be written or is one of the inputs or a file of the model; the "
                "open-files limit reached)",
    Exit.NOT_FOUND: "model not found (id, directory or GGUF path), a built-in id of another "
                    "kind, or --decode VAE_DIR missing",
    Exit.BAD_INPUT: "bad input: a malformed model file, or --cap-feats/--noise that do not fit "
                    "the model ([L, cap_dim] caption features; [16, H/8, W/8] noise; float, "
                    "finite), or a VAE that cannot be loaded or decode",
    Exit.MISSING: "a tensor is missing from the model file",
    Exit.WORKER: "a worker process failed (raised, crashed, was killed, or exceeded "
                 "--stage-timeout)",
    Exit.SHM: "not enough shared memory or memory for the arena (in a container use --shm-size)",
    Exit.OUTPUT: "--out or --png could not be written (e.g. disk full); an existing file at "
                 "that path is unchanged (the latents are written before the PNG)",
    Exit.MODELS_DIR: None,
    Exit.INTERNAL: None,
    Exit.SIGHUP: None,
    Exit.SIGINT: None,
    Exit.SIGTERM: None,
}


def _fill(text: str) -> str:
    return textwrap.fill(text, 92)


def build_parser() -> argparse.ArgumentParser:
    p = types.Parser(
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
                       "noise with --noise.") + "\n\n" + codes_epilog(EXIT_CODES),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="built-in id (e.g. tiny-dit), a model directory, or a GGUF file")
    p.add_argument("n_workers", nargs="?", type=types.workers, default=None,
                   help="worker processes (same as --workers; default: the usable CPUs)")
    p.add_argument("--workers", type=types.workers, default=None, metavar="N",
                   help="worker processes (default: the usable CPUs)")
    p.add_argument("--cap-feats", required=True, metavar="C.npy",
                   help="caption features, float [L, cap_dim]")
    p.add_argument("--height", type=types.pixels, default=None, metavar="PX",
                   help="image height in pixels, a multiple of 16 (required unless --noise)")
    p.add_argument("--width", type=types.pixels, default=None, metavar="PX",
                   help="image width in pixels, a multiple of 16 (required unless --noise)")
    p.add_argument("--steps", type=types.positive_int, default=8, help="transformer calls (default 8)")
    p.add_argument("--shift", type=types.positive_float, default=3.0,
                   help="static timestep shift (default 3.0, Z-Image-Turbo's)")
    types.add_precision(p, "the transformer blocks' matmul precision, as python -m "
                           "nxhpc.denoise's (f32 default: the exact reference; bf16, q8; the "
                           "attention follows it)")
    types.add_q8_float_weights(p)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--seed", type=types.seed, default=None,
                     help="seed for the starting noise (default 0)")
    src.add_argument("--seeds", type=types.seed_list, default=None, metavar="A,B,...",
                     help="one image per seed (--out must contain {seed}); under mpirun each "
                          "rank samples whole images, rank 0 writes them all (one seed: its "
                          "calls are split across the ranks)")
    src.add_argument("--noise", metavar="N.npy", default=None,
                     help="start from this float [16, PX/8, PX/8] noise instead of drawing it")
    p.add_argument("--out", required=True, metavar="LATENTS.npy",
                   help="where the final latents go (float32 .npy, written atomically; with "
                        "--seeds a pattern with {seed}, e.g. out/lat_{seed}.npy; one seed fills "
                        "{seed} too)")
    p.add_argument("--decode", metavar="VAE_DIR", default=None,
                   help="a diffusers AutoencoderKL directory (the FLUX VAE) to decode with; "
                        "needs torch and diffusers (pip install 'nxhpc[diffusers]')")
    p.add_argument("--png", metavar="OUT.png", default=None,
                   help="where the decoded image goes (with --decode; written atomically)")
    types.add_models_dir(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    types.add_stage_timeout(p, ranks=True)
    types.add_json(p)
    return p


def _open_denoiser(model: str, *, workers: int, models_dir: str | None,
                   stage_timeout: float | None = None):
    """The one place the CLI opens the model (tests may stand in for it)."""
    from nxhpc.models.registry import open_denoiser
    return open_denoiser(model, workers=workers, models_dir=models_dir,
                         stage_timeout=stage_timeout)


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (see ``--help``). n_workers may follow the options."""
    return run_ranked(PROG, build_parser(), argv, _run, intermixed=True)


def _check_args(args, lead: bool = True) -> tuple[int, tuple[int, int] | None]:
    """Everything that needs no model: exit 2/3 before any work. The files rank 0 alone
    writes or reads (``--out``, ``--png``, ``--decode``) are checked where ``lead`` (under
    mpirun: on rank 0; another rank's disk need not hold their folders)."""
    if args.n_workers is not None and args.workers is not None \
            and args.n_workers != args.workers:
        raise UsageError(f"n_workers {args.n_workers} and --workers {args.workers} disagree; "
                         f"give one")
    from nxhpc.runtime.workers import usable_cpus
    workers = args.workers or args.n_workers or usable_cpus()
    if (args.height is None) != (args.width is None):
        raise UsageError("give both --height and --width (or neither, with --noise)")
    if args.height is None and args.noise is None:
        raise UsageError("--height and --width are required unless --noise is given")
    px = None if args.height is None else (args.height, args.width)
    if args.steps > MAX_STEPS:
        raise UsageError(f"--steps {args.steps}: at most {MAX_STEPS}")
    try:
        turbo_sigmas(args.steps, args.shift)
    except ValueError as e:
        raise UsageError(f"--shift {args.shift:g}: {e}") from None
    if args.png is not None and args.decode is None:
        raise UsageError("--png needs --decode VAE_DIR (the VAE to decode with)")
    if args.decode is not None and args.png is None:
        raise UsageError("--decode needs --png OUT.png (where the image goes)")
    if args.png is not None:
        types.check_png_name(args.png, "--png")
    if args.decode is not None and lead:        # rank 0 decodes
        try:
            require_decode_deps()
        except ImportError as e:
            raise UsageError(str(e)) from None
    inputs = [args.cap_feats] + ([args.noise] if args.noise else [])
    if os.path.isfile(args.model):
        inputs.append(args.model)
    if args.seeds is None and "{seed}" in args.out:     # one image: the pattern names its seed
        if args.noise is not None:
            raise UsageError(f"--out {args.out!r} names {{seed}}, but --noise gives the start "
                             f"(no seed): give a file name")
        args.out = args.out.replace("{seed}", str(args.seed if args.seed is not None else 0))
    outs = [("--out", args.out)] + ([("--png", args.png)] if args.png else [])
    if args.seeds is not None:
        if "{seed}" not in args.out:
            raise UsageError(f"--seeds needs an --out pattern with {{seed}} (one file per seed), "
                             f"got {args.out!r}")
        if args.png is not None:
            raise UsageError("--seeds writes latents only: decode them one by one (no --png)")
        outs = [("--out", args.out.replace("{seed}", str(v))) for v in args.seeds]
    if args.png is not None and os.path.realpath(args.out) == os.path.realpath(args.png):
        raise UsageError(f"--out and --png are the same file ({args.out})")
    for what, path in outs if lead else ():
        check_cli_output_path(path, what=what, inputs=inputs,
                              progress_on_stderr=not args.no_progress)
    if args.decode is not None and lead:
        if os.path.exists(args.decode) and not os.path.isdir(args.decode):
            raise NotFound(f"--decode {args.decode}: a file, not a directory: --decode takes a "
                           f"diffusers AutoencoderKL directory (config.json and its weights); "
                           f"an ae.safetensors file decodes with python -m nxhpc.decode")
        if not os.path.isdir(args.decode):
            raise NotFound(f"--decode {args.decode}: no such directory (a diffusers "
                           f"AutoencoderKL directory with config.json)")
        if not os.path.isfile(os.path.join(args.decode, "config.json")):
            raise NotFound(f"--decode {args.decode}: no config.json there (expected a "
                           f"diffusers AutoencoderKL directory)")
    return workers, px


def _protect_model_files(args, den) -> None:
    """Refuse (exit 2, before sampling) an --out / --png that is a file of the opened model --
    whether MODEL was an id, a directory or a GGUF path (links resolved)."""
    from nxhpc.models.registry import opened_model_files
    gguf = getattr(getattr(den, "gguf", None), "path", None)      # None: a test's stand-in
    files = [] if gguf is None else opened_model_files(gguf,
                                                       getattr(den, "directory", None))
    if args.decode is not None:             # the VAE directory --decode reads (--png too)
        files += opened_model_files(args.decode)
    for what, path in [("--out", args.out)] + ([("--png", args.png)] if args.png else []):
        check_cli_output_path(path, what=what, model_files=files,
                              progress_on_stderr=not args.no_progress)


def _sample_one(den, cap, noise, args, progress_on: bool) -> tuple:
    """One image: (latents, seconds per step, the last step's timings, total seconds)."""
    step_s: list[float] = []
    step_timings: list[dict] = []
    progress = Progress(args.steps, progress_on, "sample", "step")

    def on_step(i, n, seconds):
        step_s.append(seconds)
        step_timings.append(dict(getattr(den, "last_timings", None) or {}))
        progress.step(f"{seconds:.2f} s/step", line=f"sample: step {i + 1}/{n} ({seconds:.2f} s)")

    t0 = time.perf_counter()
    try:
        lat = sample(den, cap, noise, steps=args.steps, shift=args.shift, on_step=on_step)
    finally:
        progress.close(failed=sys.exc_info()[0] is not None)
    return lat, step_s, step_timings[-1] if step_timings else {}, time.perf_counter() - t0


def _run(args, ranks=None) -> int:
    lead = ranks is None or ranks.rank == 0        # reads inputs, writes outputs, reports
    workers, px = _check_args(args, lead)
    if ranks is not None:
        ranks.same_args(types.option_values(args, ("steps", "shift", "height", "width", "seed",
                                                    "seeds", "precision", "q8_float_weights",
                                                    "json"))
                        | {"--noise given": args.noise is not None})
        ranks.same_kernels(args.precision)
    cap_raw = noise_raw = None
    if lead:
        cap_raw = load_npy(args.cap_feats, "--cap-feats", error=SampleInputError)
        noise_raw = load_npy(args.noise, "--noise", error=SampleInputError) \
            if args.noise is not None else None
    if ranks is not None:                     # rank 0's inputs on every rank (startup only)
        cap_raw, noise_raw = ranks.bcast((cap_raw, noise_raw), "the inputs from rank 0",
                                         bounded=False)
    seed = None if noise_raw is not None or args.seeds is not None else \
        (0 if args.seed is None else args.seed)
    seeds = args.seeds if args.seeds is not None else [seed]

    t_open = time.perf_counter()
    with _open_denoiser(args.model, workers=workers, models_dir=args.models_dir,
                        stage_timeout=args.stage_timeout) as den:
        if lead:                                   # rank 0 writes the outputs
            _protect_model_files(args, den)
        den.precision, den.q8_float_weights = args.precision, args.q8_float_weights
        cfg = den.config
        if ranks is not None:
            from nxhpc.runtime.ranks import file_fingerprint
            ranks.same("the model file (size, fingerprint)", file_fingerprint(den.gguf.path),
                       bounded=False)
        with on_every_rank(ranks, SampleInputError):   # rank 0's broadcast inputs
            try:
                cap = check_cap_feats(cap_raw, cfg)
            except SampleInputError as e:
                raise SampleInputError(f"--cap-feats {args.cap_feats}: {e}") from None
            shape = None if px is None else latent_shape(px[0], px[1], cfg.in_channels, 8,
                                                         cfg.patch)
            if noise_raw is not None:
                try:
                    noise = check_noise(noise_raw, cfg, shape)
                except SampleInputError as e:
                    raise SampleInputError(f"--noise {args.noise}: {e}") from None
            else:
                noise = initial_noise(seeds[0], shape)
        height, width = noise.shape[1] * 8, noise.shape[2] * 8
        open_s = time.perf_counter() - t_open
        progress_on = not args.no_progress and lead
        if len(seeds) == 1:             # one image (--seeds S too): its calls split across
            runs = {seeds[0]: _sample_one(den, cap, noise, args, progress_on)}    # the ranks
        else:                                   # whole images, a band of the seeds per rank
            from nxhpc.runtime import ranks as _ranks
            lo, hi = (0, len(seeds)) if ranks is None else ranks.band(len(seeds))
            with _ranks.alone() if ranks is not None else contextlib.nullcontext():
                runs = {v: _sample_one(den, cap, initial_noise(v, shape), args, progress_on)
                        for v in seeds[lo:hi]}
    owner = {v: 0 for v in seeds}
    if ranks is not None and len(seeds) > 1:
        got = ranks.allgather(runs, "the images to rank 0", bounded=False)  # whole images
        runs = {}
        for r, part in enumerate(got):
            runs.update(part)
            owner.update({v: r for v in part})
    if not lead:
        return Exit.PASS

    lat, step_s, last, total_s = runs[seeds[0]]
    report = {"model": args.model, "config": cfg.summary(),
              "workers": workers, "height": height, "width": width,
              "latent_shape": list(lat.shape), "caption_tokens": int(cap.shape[0]),
              "steps": args.steps, "shift": args.shift, "precision": args.precision,
              "q8_float_weights": args.q8_float_weights if args.precision == "q8" else None,
              "sigmas": [round(float(s), 9) for s in turbo_sigmas(args.steps, args.shift)],
              "seed": seed, "noise": args.noise, "open_s": round(open_s, 6),
              "step_s": [round(s, 6) for s in step_s], "total_s": round(total_s, 6),
              "s_per_step": round(total_s / args.steps, 6),
              "latents_mean": float(lat.mean()), "latents_std": float(lat.std()),
              "non_finite": int(lat.size - np.count_nonzero(np.isfinite(lat))),
              "out": str(args.out), "png": None}
    if ranks is not None:
        report["ranks"] = ranks.size
        report["split"] = "call" if len(seeds) == 1 else "images"
    if args.seeds is not None:
        report["seeds"] = seeds
        report["outs"] = [args.out.replace("{seed}", str(v)) for v in seeds]
        report["rank_of_seed"] = [owner[v] for v in seeds]
        report["total_s_per_seed"] = [round(runs[v][3], 6) for v in seeds]
    if last:
        report["last_step_timings"] = last
    for v, path in zip(seeds, report.get("outs", [args.out])):
        img = runs[v][0]
        error = save_npy(path, img, "--out", "the latents")
        if error:
            raise OutputError(error)
    if args.decode is not None:
        t1 = time.perf_counter()
        try:
            img = decode_png(lat, args.decode)
        except Exception as e:        # whatever diffusers raises for a VAE it cannot use
            raise SampleInputError(f"--decode {args.decode}: cannot decode with this VAE "
                                   f"(the latents were written to {args.out}): {e}") from None
        from PIL import PngImagePlugin
        info = PngImagePlugin.PngInfo()      # the run's parameters, as decode / generate write
        for k, v in png_text(cap_feats=os.path.basename(args.cap_feats), seed=seed,
                             noise=os.path.basename(args.noise) if args.noise else None,
                             steps=args.steps, shift=args.shift, height=height, width=width,
                             model=os.path.basename(os.path.normpath(args.model)),
                             vae=os.path.basename(os.path.normpath(args.decode)),
                             precision=args.precision).items():
            info.add_text(k, v)
        error = save_bytes(args.png, lambda f: img.save(f, format="PNG", pnginfo=info), "--png",
                           "the image", keep=f"the latents were written to {args.out}")
        if error:
            raise OutputError(error)
        report["png"] = str(args.png)
        report["decode_s"] = round(time.perf_counter() - t1, 6)
    print_report(report, args.json)
    return Exit.PASS


if __name__ == "__main__":
    sys.exit(main())
