"""``python -m nxhpc.decode`` (``nxhpc-decode``, ``nxhpc decode``): latents -> a PNG through the
FLUX autoencoder's decoder on nxhpc's kernels.

Owns the CLI only: parse -> ``VaeDecoder.decode`` (``nxhpc.vae.model``, opened by
``nxhpc.models.registry.open_vae``) -> ``nxhpc.vae.image.to_uint8`` -> an atomic PNG with the
run's parameters in text chunks -> report. Exit codes, the signal frame, the argparse types,
the ``.npy`` input checks and the report writer are :mod:`nxhpc.cli`'s and
:mod:`nxhpc.runtime`'s. Must not: compute anything of the model, define an exit code of its
own, or import another CLI.
"""
from __future__ import annotations

import argparse
import os
import sys
import textwrap
import time

import numpy as np

from nxhpc.cli import args as types   # first: nxhpc.cli repairs a shadowed package
from nxhpc.cli.codes import Exit, InputError, OutputError, codes_epilog
from nxhpc.cli.frame import run_cli
from nxhpc.cli.report import peak_rss_mb, png_text, print_report
from nxhpc.runtime.checks import load_npy
from nxhpc.runtime.outfile import check_cli_output_path

__all__ = ["main", "build_parser", "EXIT_CODES"]

PROG = "decode"

#: The codes decode returns, in its words (the numbers are nxhpc.cli.codes.Exit's).
EXIT_CODES = {
    Exit.PASS: "the PNG was written",
    Exit.USAGE: "usage error: bad arguments (n_workers 'abc' or 0, a missing --latents file, "
                "an --out path that cannot be written -- a directory, a missing or read-only "
                "folder -- or that is one of the inputs: the latents or the model's files)",
    Exit.FAIL: "finite latents gave NaN/inf pixels (an overflow inside the decoder); nothing "
               "is written",
    Exit.NOT_FOUND: "autoencoder not found (file, directory or built-in id), or a built-in id "
                    "of another kind",
    Exit.BAD_INPUT: "bad input: a malformed or unsupported autoencoder file (a truncated "
                    "tensor, an absurd header, an unknown dtype), or latents that do not fit it "
                    "(not a float [C, h, w] / [1, C, h, w] array, C not the decoder's latent "
                    "channels, NaN/inf)",
    Exit.MISSING: "a tensor is missing from the autoencoder file",
    Exit.WORKER: "a worker process failed (raised, crashed, was killed, or exceeded "
                 "--stage-timeout)",
    Exit.SHM: None,
    Exit.OUTPUT: "--out could not be written (e.g. disk full); an existing file at that path "
                 "is unchanged",
    Exit.MODELS_DIR: "the models directory cannot take the built-in tiny-vae",
    Exit.INTERNAL: None,
    Exit.SIGHUP: None,
    Exit.SIGINT: None,
    Exit.SIGTERM: None,
}


def build_parser() -> argparse.ArgumentParser:
    p = types.Parser(
        prog="python -m nxhpc.decode",
        usage="python -m nxhpc.decode VAE [n_workers] --latents L.npy --out IMG.png "
              "[--precision f32|bf16|auto] [--json]",
        description=textwrap.fill(
            "Decode latents [16, h, w] (the sampler's space: the decoder reads latents / "
            "scaling_factor + shift_factor: a diffusers directory's config.json values as "
            "diffusers reads them, an ae.safetensors file FLUX's 0.3611 and 0.1159; the report "
            "names them) into an 8h x 8w RGB PNG with the "
            "FLUX autoencoder's decoder on nxhpc's C kernels (3x3 convolutions fed to the "
            "matmul from im2col rows, no whole im2col matrix; "
            "tiled mid attention; worker processes over shared memory when n_workers > 1). The "
            "picture is made as diffusers' VaeImageProcessor makes it: round(clamp(x / 2 + "
            "0.5, 0, 1) * 255). The PNG is written atomically, with the latents' and the "
            "autoencoder's names in text chunks.", 92),
        epilog=codes_epilog(EXIT_CODES), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("vae", metavar="VAE",
                   help="a BFL/ComfyUI ae.safetensors, a diffusers VAE directory (or a pipeline "
                        "directory holding vae/), or a built-in id (tiny-vae: random weights, "
                        "generated on first use)")
    p.add_argument("n_workers", nargs="?", type=types.workers, default=None,
                   help=types.workers_help())
    p.add_argument("--latents", required=True, metavar="L.npy",
                   help="float latents [16, h, w] or [1, 16, h, w] (any h, w >= 1)")
    p.add_argument("--out", required=True, metavar="IMG.png",
                   help="where the PNG goes (written atomically; never over an input)")
    types.add_precision(p, "convolution precision: f32 (default) or bf16 (activations and "
                           "weights rounded to bfloat16, float32 sums)", allowed=("f32", "bf16"))
    types.add_models_dir(p)
    types.add_stage_timeout(p)
    types.add_json(p)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (see ``--help``). n_workers may follow the options."""
    return run_cli(PROG, build_parser(), argv, _run, intermixed=True)


def _latents(path: str) -> np.ndarray:
    """A float array from ``path``, [1, C, h, w] squeezed to [C, h, w] (the decoder checks the
    rest: channels, finiteness)."""
    a = load_npy(path, "--latents", error=InputError)
    if a.dtype.kind != "f":
        raise InputError(f"--latents {path}: expected a floating-point array, got {a.dtype}")
    if a.ndim == 4 and a.shape[0] == 1:
        a = a[0]
    if a.ndim != 3:
        raise InputError(f"--latents {path}: shape {list(a.shape)}, expected [C, h, w] or "
                         f"[1, C, h, w]")
    return a


def _run(args: argparse.Namespace) -> int:
    from nxhpc.models.registry import open_vae, opened_model_files
    from nxhpc.runtime.checks import CheckError
    from nxhpc.vae.image import load_png_writer, to_uint8, write_png

    types.refuse_mpi_ranks(PROG)
    load_png_writer()                 # Pillow mapped before the decode, not after it
    out = args.out
    types.check_png_name(out, "--out")
    check_cli_output_path(out, what="--out", inputs=[args.latents], example="out.png")
    z = _latents(args.latents)
    t0 = time.perf_counter()
    with open_vae(args.vae, workers=args.n_workers, precision=args.precision,
                  models_dir=args.models_dir, stage_timeout=args.stage_timeout) as vae:
        # never over a file of the model (its own files, however it was named); an earlier
        # output beside it may be written again
        files = opened_model_files(vae.file.path)
        check_cli_output_path(out, what="--out", inputs=[args.latents], model_files=files)
        open_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        try:
            img = vae.decode(z)
        except CheckError as e:
            raise InputError(f"--latents {args.latents}: {e}") from None
        decode_s = time.perf_counter() - t1
        cfg, vae_path, workers = vae.config, vae.file.path, vae.workers
    pixels = to_uint8(img)
    text = png_text(latents=os.path.basename(args.latents), vae=vae_path.name,
                    precision=args.precision)
    try:
        write_png(out, pixels, text)
    except OSError as e:
        raise OutputError(f"--out {out}: could not write the PNG: {e.strerror or e}; an "
                          f"existing file at that path is unchanged") from None
    report = {"vae": str(vae_path), "channels": list(cfg.block_out_channels),
              "latent_channels": cfg.latent_channels, "scaling_factor": cfg.scaling_factor,
              "shift_factor": cfg.shift_factor, "latents": list(z.shape),
              "image": [int(pixels.shape[0]), int(pixels.shape[1])],
              "precision": args.precision, "workers": workers,
              "open_s": round(open_s, 6), "decode_s": round(decode_s, 6),
              "out_of_range": round(float(np.mean(np.abs(img) > 1.0)), 6),
              **peak_rss_mb(), "out": str(out)}
    print_report(report, args.json)
    return Exit.PASS


if __name__ == "__main__":
    sys.exit(main())
