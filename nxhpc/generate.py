"""``python -m nxhpc.generate`` (``nxhpc-generate``, ``nxhpc generate``): a prompt -> a PNG on
nxhpc's kernels, without torch: the Qwen3 text encoder, Z-Image sampling, the FLUX decoder.

Owns the composition only (the CLI layer composes the model families): parse -> open the three
models once (the denoiser and the autoencoder first: their files are checked before any work;
neither builds its arena yet) -> encode every prompt (and the negative prompt) -> release the
text encoder -> sample every image with ``nxhpc.dit.sampler`` (initial noise as
``nxhpc.sample`` draws it from a seed) -> release the denoiser -> decode and write each PNG
atomically with the generation parameters in text chunks -> report (seconds per stage, peak
RSS). With no model arguments it runs on the built-in tiny components (``tiny-dit``,
``tiny-te``, ``tiny-vae``: random weights, so a noise picture). Must not: compute model
arithmetic, change the schedule or update rule, define an exit code, or import another CLI.

Classifier-free guidance (``--guidance-scale G > 0``, for the non-Turbo Z-Image) is
diffusers' ``ZImagePipeline``'s: each step runs the prompt and the negative prompt and uses
``pos + G * (pos - neg)`` as the raw output.

Under ``mpirun -n R`` (:func:`nxhpc.cli.frame.run_ranked`): rank 0 alone reads ``--prompts`` /
``--noise``, checks the outputs and broadcasts what it read; every rank then opens its own
copies of the three models, whose files (and the arguments) are checked alike on every rank
before any work. One image: every rank encodes the prompt itself (the text encoder's plan
splits nothing, so every rank holds the same features without a broadcast), the denoiser's
calls are split across the ranks by the engine, and rank 0 alone decodes (on its own: the
autoencoder's engine is built outside the world) and writes. Several images: image ``k`` is
rank ``k % R``'s whole (its prompts encoded, sampled, decoded, each engine on its rank alone);
rank 0 gathers one round of R images at a time and writes them in order. Every PNG has the
bytes of one process.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from nxhpc.cli import args as types   # first: nxhpc.cli repairs a shadowed package
from nxhpc.api import DEFAULT_PX, TINY, TINY_PX   # the tiny fallback, the library's
from nxhpc.cli.codes import Exit, InputError, OutputError, UsageError, codes_epilog
from nxhpc.cli.frame import on_every_rank, run_ranked
from nxhpc.cli.progress import Progress
from nxhpc.cli.report import peak_rss_mb, png_text, print_report
from nxhpc.nn.conv import decoder_precision
from nxhpc.nn.linear import attention_kernel
from nxhpc.runtime.checks import load_npy
from nxhpc.runtime.outfile import check_cli_output_path

__all__ = ["main", "build_parser", "EXIT_CODES", "TINY", "TINY_PX", "Job"]

PROG = "generate"

RANDOM_NOTE = "random weights: a noise picture (the built-in tiny components)"
#: The note when only some of the components are the built-in tiny ones (named after it).
SOME_RANDOM_NOTE = "random weights in the built-in"

#: The codes generate returns, in its words (the numbers are nxhpc.cli.codes.Exit's).
EXIT_CODES = {
    Exit.PASS: "every PNG was written",
    Exit.FAIL: "the denoiser returned NaN/inf at some step (no PNG was written)",
    Exit.USAGE: "usage error: bad arguments (--height/--width not a positive multiple of 16, "
                "--steps 0, both --seed/--seeds and --noise, only some of --model/"
                "--text-encoder/--vae, an empty prompt list, several images but --out not a "
                "folder, an --out that cannot be written or is one of the inputs, a missing "
                "--prompts/--noise file, a prompt that is not text: a NUL character, bytes "
                "that are not UTF-8; --negative-prompt without --guidance-scale > 0)",
    Exit.NOT_FOUND: "a model was not found (id, directory or file), or a built-in id of "
                    "another kind",
    Exit.BAD_INPUT: "bad input: a malformed or unsupported model file, models that do not fit "
                    "each other (the text encoder's width vs the denoiser's cap_dim, the "
                    "autoencoder's latent channels vs the denoiser's), a prompt longer than "
                    "the text encoder's context length, or --noise that does not fit ([16, H/8, "
                    "W/8], float, finite)",
    Exit.MISSING: "a tensor is missing from a model file",
    Exit.WORKER: "a worker process failed (raised, crashed, was killed, or exceeded "
                 "--stage-timeout)",
    Exit.SHM: "not enough shared memory or memory for an arena (in a container use --shm-size)",
    Exit.OUTPUT: "a PNG could not be written (e.g. disk full): an existing file at that path "
                 "is unchanged; the PNGs written before it are complete",
    Exit.MODELS_DIR: "the models directory cannot take a built-in component",
    Exit.INTERNAL: None,
    Exit.SIGHUP: None,
    Exit.SIGINT: None,
    Exit.SIGTERM: None,
}


def _fill(text: str) -> str:
    return textwrap.fill(text, 92, break_on_hyphens=False)


def build_parser() -> argparse.ArgumentParser:
    p = types.Parser(
        prog="python -m nxhpc.generate",
        description=_fill(
            "Text to image on nxhpc's CPU kernels, without torch: the prompt through the Qwen3 "
            "text encoder (a llama.cpp GGUF), Z-Image-Turbo sampling on the Z-Image transformer "
            "(a ComfyUI-GGUF / stable-diffusion.cpp GGUF; flow-matching Euler, static shift), "
            "the latents through the FLUX autoencoder's decoder (ae.safetensors or a diffusers "
            "vae/ directory). Writes each PNG atomically with the parameters in PNG text "
            "chunks. With none of --model/--text-encoder/--vae it runs on the built-in tiny "
            "components (tiny-dit, tiny-te, tiny-vae: random weights, a noise picture; "
            f"{TINY_PX}x{TINY_PX} by default), generated on first use."),
        epilog=_fill("noise from a seed: numpy.random.default_rng(seed).standard_normal "
                     "(float32) [16, H/8, W/8], as nxhpc.sample draws it (not torch's "
                     "generator: pass diffusers' noise with --noise to compare).") + "\n"
               + _fill("several images (--prompts with more than one line, --seeds with more "
                       "than one seed): --out must be an existing folder; each image is "
                       "NNN-seedS.png there (NNN counts prompts x seeds, prompt-major).") + "\n"
               + _fill("under mpirun -n R: one image's denoiser calls are split across the "
                       "ranks; several images are made whole, image k by rank k % R, and "
                       "rank 0 writes every PNG (the bytes of one process).") + "\n\n"
               + codes_epilog(EXIT_CODES),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", metavar="TEXT", help="the prompt")
    src.add_argument("--prompts", metavar="FILE",
                     help="a UTF-8 text file of prompts, one per line (blank lines skipped; "
                          "- reads standard input)")
    p.add_argument("--model", metavar="DIT", default=None,
                   help="the Z-Image transformer: a .gguf, a directory holding one (its "
                        "model.gguf, else its only .gguf), or a built-in id")
    p.add_argument("--text-encoder", metavar="TE", default=None,
                   help="the Qwen3 text encoder: a llama.cpp-layout .gguf (Qwen3-4B), a "
                        "directory holding one, or a built-in id (tiny-te)")
    p.add_argument("--vae", metavar="VAE", default=None,
                   help="the autoencoder: ae.safetensors, a diffusers vae/ directory, or a "
                        "built-in id (tiny-vae)")
    p.add_argument("--height", type=types.pixels, default=None, metavar="PX",
                   help=f"image height, a multiple of 16 (default {DEFAULT_PX}; {TINY_PX} when "
                        f"no model argument is given: the built-in tiny components)")
    p.add_argument("--width", type=types.pixels, default=None, metavar="PX",
                   help=f"image width, a multiple of 16 (default {DEFAULT_PX}; {TINY_PX} when "
                        f"no model argument is given: the built-in tiny components)")
    p.add_argument("--steps", type=types.positive_int, default=8,
                   help="transformer calls per image (default 8)")
    p.add_argument("--shift", type=types.positive_float, default=3.0,
                   help="static timestep shift (default 3.0, Z-Image-Turbo's)")
    noise = p.add_mutually_exclusive_group()
    noise.add_argument("--seed", type=types.seed, default=None, help="noise seed (default 0)")
    noise.add_argument("--seeds", type=types.seed_list, default=None, metavar="A,B,...",
                       help="one image per seed (per prompt)")
    noise.add_argument("--noise", metavar="N.npy", default=None,
                       help="start from this float [16, H/8, W/8] noise (sets the size)")
    p.add_argument("--guidance-scale", type=_guidance, default=0.0, metavar="G",
                   help="classifier-free guidance scale: pos + G * (pos - neg) (default 0: off, "
                        "as Z-Image-Turbo runs; each step then costs two transformer calls)")
    p.add_argument("--negative-prompt", metavar="TEXT", default=None,
                   help="the negative prompt of classifier-free guidance (default empty)")
    types.add_precision(p, "matmul precision: f32 (default); bf16 (bf16-rounded activations, "
                           "float32 sums; every model); q8 (Q8_0 activations x the weights' "
                           "integer codes in the text encoder's and the denoiser's "
                           "projections; the autoencoder then runs bf16 where that is faster "
                           "-- AMX, a fast AVX-512 BF16 dot --, else f32: reported as "
                           "vae_precision)")
    types.add_q8_float_weights(p)
    p.add_argument("--workers", type=types.workers, default=None, metavar="N",
                   help=types.workers_help())
    p.add_argument("--out", required=True, metavar="IMG.png",
                   help="the PNG (written atomically; never over an input), or an existing "
                        "folder for several images")
    types.add_models_dir(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    types.add_stage_timeout(p, ranks=True)
    types.add_json(p)
    return p


def _guidance(s: str) -> float:
    """A guidance scale: a finite number >= 0 (0 = off)."""
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {s!r}") from None
    if not np.isfinite(v) or v < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0 (0 = off), got {s!r}")
    return v


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (see ``--help``)."""
    return run_ranked(PROG, build_parser(), argv, _run)


@dataclass
class Job:
    """One image: its prompt (index into the prompts), seed (None: --noise), output path, and
    what the run fills in (latents, seconds per step)."""
    prompt: int
    seed: int | None
    out: Path
    latents: np.ndarray | None = None
    in_folder: bool = False         # a name the run made up in --out's folder: never replaced
    step_s: list[float] = field(default_factory=list)


def _prompts(args: argparse.Namespace) -> list[str]:
    if args.prompt is not None:
        return [types.check_prompt(args.prompt, "--prompt")]
    p = args.prompts
    # lines end at \n alone (the file's \r\n and \r were read as \n): str.splitlines() would also
    # split at U+2028, U+0085, \v, \f, ... inside a prompt, and count its line numbers so
    lines = types.read_text_file(p, "--prompts", "a text file, one prompt a line").split("\n")
    out = [s for s in lines if s.strip()]
    if not out:
        raise UsageError(f"--prompts {p}: no prompt in it (every line is blank)")
    for i, s in enumerate(lines):
        if s.strip():
            types.check_prompt(s, f"--prompts {p}, line {i + 1}")
    return out



def _models(args: argparse.Namespace) -> tuple[dict[str, str], bool]:
    """The three model arguments (the tiny built-ins when none is given) and whether the
    fallback is used."""
    given = {"model": args.model, "text_encoder": args.text_encoder, "vae": args.vae}
    if all(v is None for v in given.values()):
        return dict(TINY), True
    missing = [f"--{k.replace('_', '-')}" for k, v in given.items() if v is None]
    if missing:
        raise UsageError(f"give all of --model, --text-encoder and --vae, or none (the built-in "
                         f"tiny components); missing: {', '.join(missing)} (a built-in id such "
                         f"as {', '.join(TINY[k] for k, v in given.items() if v is None)} may "
                         f"be given explicitly)")
    return given, False  # type: ignore[return-value]


def _outputs(out: str, n_prompts: int, seeds: list[int | None]) -> list[Job]:
    """The jobs (prompt-major) and their output paths; --out a file for one image, an existing
    folder for any number."""
    pairs = [(i, s) for i in range(n_prompts) for s in seeds]
    p = Path(out)
    if p.is_dir():
        jobs = [Job(i, s, p / f"{k:03d}-seed{'noise' if s is None else s}.png", in_folder=True)
                for k, (i, s) in enumerate(pairs)]
        taken = [j.out.name for j in jobs if os.path.lexists(j.out)]
        if taken:                # names this run makes up: never over an earlier run's images
            more = f" and {len(taken) - 1} more" if len(taken) > 1 else ""
            raise UsageError(f"--out {out}: the folder already holds {taken[0]}{more} (an "
                             f"earlier run's?); give another folder or move them away")
        return jobs
    if out.endswith("/"):            # Path() drops the slash: a file named after the folder
        raise UsageError(f"--out {out}: ends with '/', a folder, and there is no such folder "
                         f"(create it first, or give a file path)")
    if len(pairs) > 1:
        raise UsageError(f"--out {out}: {len(pairs)} images ({n_prompts} prompt(s) x "
                         f"{len(seeds)} seed(s)) need an existing folder, not a file path")
    types.check_png_name(out, "--out")
    return [Job(pairs[0][0], pairs[0][1], p)]


#: Arguments every rank must agree on under mpirun (model paths may differ between machines:
#: the model files are compared by size and fingerprint instead; only rank 0 reads --prompts
#: and --noise and writes --out).
_SAME_ARGS = ("prompt", "steps", "shift", "height", "width", "seed", "seeds", "guidance_scale",
              "negative_prompt", "precision", "q8_float_weights", "json")


@dataclass
class _Setup:
    """What rank 0 makes of the arguments before any model work (broadcast to the others)."""
    prompts: list[str]
    names: dict[str, str]
    tiny: bool
    negative: str | None
    noise: np.ndarray | None
    jobs: list[Job]


def _setup(args: argparse.Namespace) -> _Setup:
    """Every check that needs no model, the inputs read, the built-ins generated and the
    outputs checked against every file the run reads (rank 0's part under mpirun)."""
    from nxhpc.dit.sampler import MAX_STEPS, SampleInputError, turbo_sigmas
    from nxhpc.models.registry import opened_model_files, resolve_model, resolve_vae

    prompts = _prompts(args)
    names, tiny = _models(args)
    cfg_on = args.guidance_scale > 0
    if args.negative_prompt is not None and not cfg_on:
        raise UsageError("--negative-prompt needs --guidance-scale G > 0 (guidance is off)")
    negative = (args.negative_prompt or "") if cfg_on else None
    if negative:
        negative = types.check_prompt(negative, "--negative-prompt")
    noise_raw = None
    if args.noise is not None:
        noise_raw = load_npy(args.noise, "--noise", error=SampleInputError)
    seeds: list[int | None] = [None] if noise_raw is not None else \
        (args.seeds if args.seeds is not None else [0 if args.seed is None else args.seed])
    if (args.height is None) != (args.width is None):
        raise UsageError("give both --height and --width (or neither)")
    if args.steps > MAX_STEPS:
        raise UsageError(f"--steps {args.steps}: at most {MAX_STEPS}")
    try:
        turbo_sigmas(args.steps, args.shift)
    except ValueError as e:
        raise UsageError(f"--shift {args.shift:g}: {e}") from None
    jobs = _outputs(args.out, len(prompts), seeds)
    outs = [str(j.out) for j in jobs]
    if len(set(map(os.path.realpath, outs))) != len(outs):       # pragma: no cover - by naming
        raise UsageError("two images would go to the same file")

    # resolve every model (built-ins are generated here) and check the outputs against every
    # file this run reads, before any model work
    # (the model's own files, however it was named; not the user's other files beside it)
    dit_d, dit_gguf = resolve_model(names["model"], args.models_dir)
    vae_path = resolve_vae(names["vae"], args.models_dir)
    te_d, te_g = resolve_model(names["text_encoder"], args.models_dir)
    reads = [r for r in (args.prompts, args.noise) if r is not None and r != "-"]
    files = [*opened_model_files(dit_gguf, dit_d), *opened_model_files(te_g, te_d),
             *opened_model_files(vae_path)]
    for o in outs:
        check_cli_output_path(o, what="--out", inputs=reads, model_files=files, example="out.png",
                              progress_on_stderr=not args.no_progress)
    return _Setup(prompts, names, tiny, negative, noise_raw, jobs)


def _run(args: argparse.Namespace, ranks: Any = None) -> int:
    """One process, or one of R MPI ranks (``ranks``). One image under mpirun: every rank
    runs every model, the denoiser's calls split across the ranks (``nxhpc.nn.engine``), and
    rank 0 alone decodes and writes. Several: image ``k`` is rank ``k % R``'s whole (its own
    prompts encoded, sampled, decoded; no exchange), and rank 0 gathers each round of R
    images and writes them in order."""
    from nxhpc.dit.sampler import (NonFiniteOutputError, SampleInputError, check_noise,
                                   initial_noise, latent_shape, sample, turbo_sigmas)
    from nxhpc.models.registry import open_denoiser, open_vae, resolve_model
    from nxhpc.runtime import ranks as _ranks
    from nxhpc.runtime.workers import usable_cpus
    from nxhpc.vae.image import load_png_writer, to_uint8

    t_start = time.perf_counter()
    lead = ranks is None or ranks.rank == 0        # reads inputs, writes the PNGs, reports
    if lead:              # Pillow mapped now, before the run and its memory checks, not after
        load_png_writer()
    if ranks is not None:
        given = ("prompts", "noise", "model", "text_encoder", "vae")
        ranks.same_args(types.option_values(args, _SAME_ARGS)
                        | {f"{k} given": v is not None
                           for k, v in types.option_values(args, given).items()})
        ranks.same_kernels(args.precision)
    setup = _setup(args) if lead else None
    if ranks is not None:       # rank 0's reading (stdin, built-ins generated): not a stage
        setup = ranks.bcast(setup, "the prompts, seeds and noise from rank 0", bounded=False)
    assert setup is not None
    prompts, names, tiny, negative = setup.prompts, setup.names, setup.tiny, setup.negative
    if not lead:                      # this rank's own model arguments (paths per machine)
        names, tiny = _models(args)
    noise_raw, jobs = setup.noise, setup.jobs
    cfg_on = negative is not None
    workers = args.workers or usable_cpus()
    # several images under mpirun: whole images per rank, round-robin, each rank alone
    whole = ranks is not None and len(jobs) > 1
    mine = jobs[ranks.rank::ranks.size] if whole else jobs
    apart = _ranks.alone() if whole else contextlib.nullcontext()

    vae_precision = decoder_precision(args.precision)
    if whole:                     # per CPU (bf16 unit or not): every rank decodes its images
        ranks.same("the decoder precision (under q8, bf16 where this CPU's bf16 matmul is "
                   "faster: every rank decodes some of the images)", vae_precision)
        if vae_precision != args.precision:      # q8's class of bits says nothing of the
            ranks.same_kernels(           # decoder's (f32 on AVX2 and AVX-512 differ)
                vae_precision, "decoders", "the images each rank decodes (one image split "
                "across the ranks is decoded by rank 0 alone and runs)")
    n_encode = len({j.prompt for j in mine}) + (1 if cfg_on else 0)
    progress = Progress(n_encode + len(mine) * (args.steps + 1), not args.no_progress and lead,
                        PROG, "op", stage="open")
    stages: dict[str, float] = {}
    try:
        t0 = time.perf_counter()
        with apart, open_denoiser(names["model"], workers=workers, models_dir=args.models_dir,
                                  precision=args.precision, stage_timeout=args.stage_timeout,
                                  q8_float_weights=args.q8_float_weights) as den, \
                open_vae(names["vae"], workers=workers, precision=vae_precision,
                         models_dir=args.models_dir, stage_timeout=args.stage_timeout) as vae:
            dcfg = den.config
            if ranks is not None:                  # the same model files, before any work
                from nxhpc.runtime.ranks import file_fingerprint
                te_gguf = resolve_model(names["text_encoder"], args.models_dir)[1]
                ranks.same("the model files (size, fingerprint: denoiser, text encoder, "
                           "autoencoder)",
                           [file_fingerprint(p) for p in (den.gguf.path, te_gguf,
                                                          vae.file.path) if p is not None],
                           bounded=False)         # each rank opened (maybe generated) them
            with on_every_rank(ranks):
                if vae.config.latent_channels != dcfg.in_channels:
                    raise InputError(f"--vae {names['vae']}: its decoder reads "
                                     f"{vae.config.latent_channels} latent channels but the "
                                     f"denoiser makes {dcfg.in_channels}")
                if noise_raw is not None:
                    shape = None if args.height is None else latent_shape(
                        args.height, args.width, dcfg.in_channels, vae.config.upscale,
                        dcfg.patch)
                    try:
                        noise_raw = check_noise(noise_raw, dcfg, shape)
                    except SampleInputError as e:
                        raise SampleInputError(f"--noise {args.noise}: {e}") from None
                    height = noise_raw.shape[1] * vae.config.upscale
                    width = noise_raw.shape[2] * vae.config.upscale
                else:
                    px = TINY_PX if tiny else DEFAULT_PX
                    height = args.height or px
                    width = args.width or px
                    shape = latent_shape(height, width, dcfg.in_channels, vae.config.upscale,
                                         dcfg.patch)
            # the decode's buffers, checked before the long part: a 1024x1024 image's take
            # 2.7 GiB (of /dev/shm, with workers), and an image's steps can take an hour; the
            # denoiser's arena, not made yet, is released before the decode. Several images
            # under mpirun: every rank on this host decodes at once. The denoiser's arena too,
            # before the prompts are encoded (it is built at the first step): every rank on
            # this host builds its own
            here = _ranks.local_ranks() if ranks is not None else 1
            if (lead and not whole) or (whole and mine):
                up = vae.config.upscale
                vae.check_room(height // up, width // up,
                               copies=min(here, len(jobs)) if whole else 1)
            lat = shape if shape is not None else noise_raw.shape
            den_copies = min(here, len(jobs)) if whole else here
            arena = den.check_room(lat[1], lat[2], copies=den_copies)
            stages["open_s"] = time.perf_counter() - t0

            # 1. the prompts of this process's images through the text encoder (then released)
            t1 = time.perf_counter()
            progress.stage("encode")
            feats, neg_feats, te_file = _encode(
                names["text_encoder"], prompts, sorted({j.prompt for j in mine}), negative,
                workers, args, dcfg.cap_dim, progress, ranks, beside=arena, copies=den_copies)
            stages["encode_s"] = time.perf_counter() - t1

            # 2. every image's latents on the one denoiser (its arena is built now)
            t2 = time.perf_counter()
            progress.stage("denoise")
            for job in mine:
                x0 = noise_raw if job.seed is None else initial_noise(job.seed, shape)

                def on_step(i: int, n: int, seconds: float, job: Job = job) -> None:
                    job.step_s.append(seconds)
                    progress.step(f"{seconds:.2f} s/step")
                cap = feats[job.prompt]
                # NaN/inf of a call split across the ranks: the same bits on every rank
                with on_every_rank(None if whole else ranks, NonFiniteOutputError):
                    job.latents = sample(den, cap, x0, steps=args.steps, shift=args.shift,
                                         on_step=on_step, guidance_scale=args.guidance_scale
                                         if cfg_on else 0.0, negative_feats=neg_feats)
            den_mem = den.memory()
            stages["denoise_s"] = time.perf_counter() - t2
            exchange = None                   # bytes this rank received from the others
            if ranks is not None and not whole:
                rows = {int(feats[mine[0].prompt].shape[0])} | \
                    ({int(neg_feats.shape[0])} if neg_feats is not None else set())
                lat_hw = mine[0].latents.shape[1:]
                exchange = sum(den.session(*lat_hw, L).engine.exchange_bytes
                               for L in sorted(rows))
            dit_gguf = getattr(getattr(den, "gguf", None), "path", None)
            den.close()                       # the denoiser's arena and workers go first

            # 3. decode and write each picture (rank 0 writes them all)
            t3 = time.perf_counter()
            progress.stage("decode")
            meta = dict(model=_label(Path(dit_gguf)) if dit_gguf else names["model"],
                        text_encoder=te_file,
                        vae=_label(vae.file.path), vae_precision=vae_precision)
            written: list[Job] = []

            def write(job: Job, pixels: np.ndarray) -> None:
                _write(job, pixels, _png_fields(args, prompts[job.prompt], negative, job,
                                                height, width, meta), written)
                written.append(job)
            if not whole:
                if lead:                      # one image under mpirun: rank 0 alone decodes
                    with _ranks.alone() if ranks is not None else contextlib.nullcontext():
                        for job in mine:
                            write(job, to_uint8(vae.decode(job.latents)))
                            progress.step()
            else:
                R = ranks.size
                for first in range(0, len(jobs), R):      # round: images first .. first+R-1
                    k = first + ranks.rank
                    part = None
                    if k < len(jobs):
                        part = (k, to_uint8(vae.decode(jobs[k].latents)), jobs[k].step_s)
                        progress.step()
                    got = ranks.gather(part, f"images {first}..{min(first + R, len(jobs)) - 1}"
                                             f" to rank 0")
                    for item in got or ():
                        if item is not None:
                            jobs[item[0]].step_s = item[2]
                            write(jobs[item[0]], item[1])
            stages["decode_s"] = time.perf_counter() - t3
    finally:
        progress.close(failed=sys.exc_info()[0] is not None)
    stages["total_s"] = time.perf_counter() - t_start
    if not lead:
        return Exit.PASS

    report: dict[str, Any] = {
        "model": names["model"], "text_encoder": names["text_encoder"], "vae": names["vae"],
        "prompts": len(prompts), "images": len(jobs), "height": height, "width": width,
        "steps": args.steps, "shift": args.shift,
        "sigmas": [round(float(s), 9) for s in turbo_sigmas(args.steps, args.shift)],
        "guidance_scale": args.guidance_scale, "precision": args.precision,
        "q8_float_weights": args.q8_float_weights if args.precision == "q8" else None,
        "vae_precision": vae_precision, "attention": attention_kernel(args.precision),
        "workers": workers, "seeds": [j.seed for j in jobs] if args.noise is None else None,
        "noise": args.noise, **{k: round(v, 6) for k, v in stages.items()},
        "s_per_step": round(stages["denoise_s"] / (len(mine) * args.steps), 6),
        "arena_mb": den_mem.get("arena_mb"), **peak_rss_mb(),
        "out": [str(j.out) for j in jobs]}
    if ranks is not None:
        report["ranks"] = ranks.size
        report["split"] = "images" if whole else "call"
        if whole:
            report["rank_of_image"] = [k % ranks.size for k in range(len(jobs))]
        else:
            report["exchange_bytes"] = exchange
    some = [n for n in names.values() if n in TINY.values()]
    if tiny or len(some) == len(TINY):
        report["note"] = RANDOM_NOTE
    elif some:
        report["note"] = f"{SOME_RANDOM_NOTE} {', '.join(some)}: a noise picture"
    if args.json:
        report["prompt_list"] = prompts
        report["step_s"] = [[round(s, 6) for s in j.step_s] for j in jobs]
    print_report(report, args.json)
    return Exit.PASS


def _write(job: Job, pixels: np.ndarray, text: dict[str, str], written: list[Job]) -> None:
    """``job``'s PNG, atomically; OutputError naming the images already written."""
    from nxhpc.vae.image import write_png
    try:
        write_png(job.out, pixels, text, exclusive=job.in_folder)
    except OSError as e:
        done = [str(j.out) for j in written]
        why = ("appeared meanwhile (another run writing into the same folder?); it was left as "
               "it is" if isinstance(e, FileExistsError) else
               f"could not write the PNG: {e.strerror or e}; an existing file at that path is "
               f"unchanged")
        raise OutputError(f"--out {job.out}: {why}"
                          + (f"; written: {', '.join(done)}" if done else "")) from None


def _encode(te: str, prompts: list[str], which: list[int], negative: str | None, workers: int,
            args: argparse.Namespace, cap_dim: int, progress: Progress, ranks: Any = None, *,
            beside: int = 0, copies: int = 1
            ) -> tuple[dict[int, np.ndarray], np.ndarray | None, str]:
    """Caption features of the prompts ``which`` (indices into ``prompts``) and of
    ``negative``, then the encoder is closed (opened and checked even when ``which`` is empty:
    every rank checks the models alike). Returns (features by prompt index, negative features
    or None, the encoder's file name).

    Every feature array is kept until the last image is made, beside the denoiser's arena
    (``beside`` bytes, built after the encoder is closed): before the first prompt is encoded
    they are counted from the prompts' token counts (``copies``: processes on this host that
    each hold as many) and a list whose features cannot fit beside the arena is refused
    (:class:`~nxhpc.runtime.shm.ShmSpaceError`), not after hours of encoding."""
    import nxhpc
    with nxhpc.load_text_encoder(te, workers=workers, precision=args.precision,
                                 models_dir=args.models_dir, stage_timeout=args.stage_timeout,
                                 q8_float_weights=args.q8_float_weights) as enc:
        with on_every_rank(ranks):
            if enc.config.dim != cap_dim:
                raise InputError(f"--text-encoder {te}: its features are {enc.config.dim} wide "
                                 f"but the denoiser's cap_dim is {cap_dim}: these models do "
                                 f"not go together")
        from nxhpc.qwen3.model import TextEncoderInputError

        def encode(prompt: str, what: str) -> np.ndarray:
            try:
                return enc.encode(prompt)
            except TextEncoderInputError as e:       # ids beyond the model's context length
                raise InputError(f"--text-encoder {te}: {what}: {e}") from None
        texts = [prompts[i] for i in which] + ([negative] if negative is not None else [])
        _check_features_room(sum(len(enc.tokenize(t)) for t in texts) * cap_dim * 4 * copies,
                             len(texts), beside)
        feats = {}
        for i in which:
            feats[i] = encode(prompts[i], f"prompt {i + 1} of --prompts (blank lines not counted)"
                              if args.prompts is not None else "the prompt")
            progress.step()
        neg = None
        if negative is not None:
            neg = encode(negative, "--negative-prompt")
            progress.step()
        return feats, neg, _label(Path(enc.path))


def _check_features_room(need: int, n: int, beside: int) -> None:
    """ShmSpaceError unless ``need`` bytes of caption features (``n`` prompts) fit beside
    ``beside`` bytes of the denoiser's arena in the memory available and in the address space
    this process has left to map (:func:`nxhpc.runtime.shm.check_room`, a process's own
    buffers)."""
    from nxhpc.runtime.shm import check_room
    check_room(need + beside,
               f"the caption features of {n} prompt{'s' if n != 1 else ''} "
               f"({need / 2**20:.1f} MiB, kept until the last image) beside the denoiser's "
               f"arena ({beside / 2**20:.1f} MiB)",
               shared=False, advice="give fewer prompts a run (split --prompts into several files)")


def _label(path: Path) -> str:
    """A model file's name as the PNG records it: the file name, with the built-in's id in
    front for a generated built-in (``tiny-dit/model.gguf``)."""
    from nxhpc.models.modeldir import SPEC_FILE
    return f"{path.parent.name}/{path.name}" if (path.parent / SPEC_FILE).is_file() \
        else path.name


def _png_fields(args, prompt: str, negative: str | None, job: Job, height: int, width: int,
                meta: dict[str, str]) -> dict[str, str]:
    """The PNG text chunks: each parameter on its own key, and ``parameters`` in the one-block
    form other image tools write (prompt, ``Negative prompt:`` line, then ``Key: value``).
    Their ``CFG scale`` is ``neg + cfg * (pos - neg)`` (1: no guidance), so it is written as
    ``guidance_scale + 1``: diffusers' ``pos + G * (pos - neg)`` is that with cfg = G + 1; the
    ``guidance_scale`` chunk keeps G."""
    seed = job.seed
    line = ", ".join(f"{k}: {v}" for k, v in (
        ("Steps", args.steps), ("Sampler", "Euler (flow matching)"), ("Shift", args.shift),
        ("CFG scale", f"{args.guidance_scale + 1:g}"),
        *((("Seed", seed),) if seed is not None else ()),    # a readable int, or none (noise)
        ("Size", f"{width}x{height}"), ("Model", meta["model"]),
        ("Text encoder", meta["text_encoder"]), ("VAE", meta["vae"]),
        ("Precision", args.precision + (f" ({args.q8_float_weights} float weights, VAE "
                                         f"{meta['vae_precision']})"
                                         if args.precision == "q8" else ""))))
    block = prompt + (f"\nNegative prompt: {negative}" if negative is not None else "") + \
        "\n" + line
    return png_text(prompt=prompt, negative_prompt=negative, seed=seed,
                    noise=os.path.basename(args.noise) if args.noise else None,
                    steps=args.steps, shift=args.shift, guidance_scale=args.guidance_scale,
                    height=height, width=width, precision=args.precision,
                    q8_float_weights=args.q8_float_weights if args.precision == "q8" else None,
                    parameters=block, **meta)


if __name__ == "__main__":
    sys.exit(main())
