"""``python -m nxhpc.denoise`` (``nxhpc-denoise``, ``nxhpc denoise``): one call of the whole
Z-Image transformer from a GGUF.

Owns the CLI only: parse -> ``Denoiser.forward`` (``nxhpc.dit.denoiser``) -> grade
(``nxhpc.dit.grade``) -> report. Exit codes, the signal frame, the argparse types, the ``.npy``
input checks and the report writer are :mod:`nxhpc.cli`'s and :mod:`nxhpc.runtime.checks`'.
Must not: compute anything of the model, define an exit code of its own, or import another CLI.

Under ``mpirun -n R`` (``nxhpc.cli.frame.run_ranked``) every rank maps the model and runs its
own workers; the call's stages are split across the ranks by the engine
(``nxhpc.nn.engine``); rank 0 reads the inputs (broadcast to the others), grades, writes
``--out`` and prints the one report, which then has ``ranks`` and each rank's bands. The ranks
first check they run the same model file (size and fingerprint) and arguments.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from nxhpc.cli import args as types   # first: nxhpc.cli repairs a shadowed package
from nxhpc.cli.codes import Exit, InputError, NotFound, UsageError
from nxhpc.cli.frame import on_every_rank, run_ranked
from nxhpc.cli.report import emit_graded, save_npy
from nxhpc.dit.grade import grade
from nxhpc.dit.stackrun import PRECISION_TOL
from nxhpc.runtime.checks import check_input_file, load_npy
from nxhpc.nn.linear import attention_kernel
from nxhpc.runtime.outfile import check_cli_output_path

__all__ = ["main", "build_parser", "DEFAULT_TOL", "DENOISE_TOL", "EXIT_CODES"]

PROG = "denoise"

#: Default pass/fail tolerance on max_rel against a float64 reference on the same weights:
#: a float32 run sits near 1e-6 (max_rel, rms floor; tests bound it at 1e-5 x max|ref|), a
#: real mistake (pad rows masked, patch order, a missing SiLU) near 1e-1.
DEFAULT_TOL = 1e-4
#: Default --tol per --precision. bf16 / q8 are blockrun's per-block tolerances: the whole
#: call measured max_rel 8.1e-3 (bf16) and 1.3e-2 (q8) on tiny-dit, below one block's
#: 1.2e-2 / 3.3e-2 on tiny (the refiners and layers' errors do not simply add up).
DENOISE_TOL = {"f32": DEFAULT_TOL, "bf16": PRECISION_TOL["bf16"], "q8": PRECISION_TOL["q8"]}

#: The codes denoise returns, in its words (the numbers are nxhpc.cli.codes.Exit's).
EXIT_CODES = {
    Exit.PASS: "pass: the output is within tolerance of the reference, or UNGRADED (no "
               "reference); --out was written when given",
    Exit.FAIL: "graded fail: max_rel above the tolerance; or non-finite outputs, graded or "
               "not (counted as non_finite; --out is not written)",
    Exit.USAGE: "usage error (bad arguments, e.g. n_workers 'abc' or 0, only some of "
                "--latents/--timestep/--cap-feats, a missing input file or one that is not a "
                "regular file, an --out path that cannot be written or is one of the inputs or "
                "a file of the model; the open-files limit reached)",
    Exit.NOT_FOUND: "model not found (id, directory or GGUF path), or a built-in id of another "
                    "kind (a block model, a text encoder, an autoencoder)",
    Exit.BAD_INPUT: "bad input: a malformed/unsupported GGUF, or latents/caption features/"
                    "reference that are not readable float arrays or do not fit the model",
    Exit.MISSING: "a tensor is missing from the GGUF, or a model without stored inputs was "
                  "given none",
    Exit.WORKER: "a worker process failed (raised, crashed, was killed, or exceeded "
                 "--stage-timeout)",
    Exit.SHM: None,
    Exit.OUTPUT: "--out could not be written (e.g. disk full): the report was printed, an "
                 "existing file at that path is unchanged",
    Exit.MODELS_DIR: None,
    Exit.INTERNAL: None,
    Exit.SIGHUP: None,
    Exit.SIGINT: None,
    Exit.SIGTERM: None,
}

_HELP = """\
inputs:
  Give all of --latents, --timestep and --cap-feats, or none: with none, a model that stores
  inputs (the built-ins tiny-dit, zimage-dit-<N>l) runs on its stored deterministic inputs and
  is graded against its stored float64 reference when it has one (tiny-dit does).
  latents: float [16, H, W] or [16, 1, H, W] (H, W even: a 1024x1024 image has 128x128);
  timestep: t = 1 - sigma in [0, 1] (0 = pure noise); cap-feats: float [L, cap_dim]
  (Qwen3-4B hidden states for Z-Image: cap_dim 2560). Output: float32, the shape of the
  latents, the raw model output in the diffusers convention (not negated).

grading (with a stored reference or --reference):
  rel_i = |out_i - ref_i| / max(|ref_i|, rms(ref)); PASS iff no output is NaN/inf and
  max_rel <= --tol (default per --precision: %(tols)s).
  Without a reference the verdict is UNGRADED (exit 0), unless an output is NaN/inf: FAIL
  (exit 1) graded or not, and --out is not written.

timings (microseconds): us_embed (timestep MLP, x/cap embedders, pads, adaLN vectors),
  us_noise_refiner, us_context_refiner, us_layers, us_final, us_total; s_per_layer and the
  extrapolated s_per_30_layer_step = everything but the layers + 30 x s_per_layer.

"""


def build_parser() -> argparse.ArgumentParser:
    p = types.cli_parser(
        "denoise",
        usage="python -m nxhpc.denoise MODEL [n_workers] --latents L.npy --timestep T "
              "--cap-feats C.npy --out O.npy [--json] [options]",
        description="One call of the whole Z-Image transformer (embedders, noise and context "
                    "refiners, main layers, final layer) on nxhpc's C kernels in forked "
                    "workers sharing one shared-memory arena, from a GGUF (ComfyUI-GGUF or "
                    "stable-diffusion.cpp layout; each tensor run in its stored type: "
                    "F32/F16/BF16/Q8_0, Q4_0/Q4_1/Q5_0/Q5_1, Q2_K..Q6_K). Prints "
                    "per-segment timings as key=value lines (or one JSON object).",
        epilog=_HELP % {"tols": ", ".join(f"{k} {v:g}" for k, v in DENOISE_TOL.items())},
        exit_codes=EXIT_CODES)
    p.add_argument("model", metavar="MODEL",
                   help="a .gguf file, a model directory, a directory under --models-dir / "
                        "$NXHPC_MODELS, or a built-in id (tiny-dit, zimage-dit-2l, "
                        "zimage-dit-<N>l; generated on first use)")
    types.add_workers(p)
    p.add_argument("--latents", metavar="L.npy", help="latents [16, H, W] or [16, 1, H, W]")
    p.add_argument("--timestep", type=types.unit_interval, metavar="T",
                   help="t = 1 - sigma, in [0, 1]")
    p.add_argument("--cap-feats", metavar="C.npy", help="caption features [L, cap_dim]")
    p.add_argument("--out", metavar="O.npy",
                   help="write the output (float32, the latents' shape) here, atomically")
    p.add_argument("--reference", metavar="R.npy",
                   help="grade against this array (the latents' shape) instead of the stored "
                        "reference")
    types.add_precision(p, "matmul precision of the blocks' projections: f32 (default: exact "
                           "dequantized weights, float32 activations), bf16 (bf16-rounded "
                           "activations, float32 sums), q8 (Q8_0 activations x the "
                           "weights' integer codes; float weights: the option below); "
                           "embedders, final layer, norms, adaLN stay float32")
    types.add_q8_float_weights(p)
    types.add_tol(p, DENOISE_TOL)
    p.add_argument("--repeat", type=types.positive_int, default=1, metavar="N",
                   help="run the call N times on the same workers and arena and report the "
                        "fastest time of each segment (the output is the same bits every run; "
                        "calls after the first reuse its refined caption rows, as a sampler's "
                        "steps do, so the fastest us_context_refiner is then their copy: "
                        "caption_reused in the report counts those calls)")
    types.add_models_dir(p)
    p.add_argument("--gguf", default=None, metavar="PATH",
                   help="GGUF weights to use instead of the model directory's model.gguf")
    types.add_stage_timeout(p, ranks=True)
    types.add_json(p)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (see ``--help``)."""
    return run_ranked(PROG, build_parser(), argv, _run)


def _load_npy(path: str, what: str) -> np.ndarray:
    """A float array from ``path`` (no pickles): missing -> usage error, unreadable or not
    floating-point -> bad input (exit 4)."""
    a = load_npy(path, what, error=InputError)
    if a.dtype.kind != "f":
        raise InputError(f"{what} {path}: expected a floating-point array, got {a.dtype}")
    return a


#: Arguments every rank must agree on (paths may differ between machines; the model file is
#: checked by its size and fingerprint instead).
_SAME_ARGS = ("timestep", "precision", "q8_float_weights", "tol", "repeat", "json")


def _run(args: argparse.Namespace, ranks=None) -> int:
    from nxhpc.models.registry import open_denoiser

    if ranks is not None:
        ranks.same_args(types.option_values(args, _SAME_ARGS))
        ranks.same_kernels(args.precision)
    lead = ranks is None or ranks.rank == 0          # reads inputs, writes outputs, reports

    given = [args.latents is not None, args.timestep is not None, args.cap_feats is not None]
    if any(given) and not all(given):
        raise UsageError("give all of --latents, --timestep and --cap-feats, or none "
                         "(a built-in model's stored inputs)")
    if args.gguf is not None and not os.path.exists(args.gguf):    # not found (exit 3), named
        raise NotFound(f"--gguf {args.gguf}: no such file")          # as the option it is
    if args.gguf is not None:            # a FIFO or /dev/null is not "no such file"
        check_input_file(args.gguf, "--gguf", "a .gguf file")
    out_path = None
    if args.out is not None and lead:
        inputs = [x for x in (args.latents, args.cap_feats, args.reference, args.gguf) if x]
        check_cli_output_path(args.out, what="--out", inputs=inputs)
        out_path = args.out
    inputs = None
    ref = None
    if lead:
        if all(given):
            inputs = (_load_npy(args.latents, "--latents"), args.timestep,
                      _load_npy(args.cap_feats, "--cap-feats"))
        ref = _load_npy(args.reference, "--reference") if args.reference else None
        if ref is not None and not np.isfinite(ref).all():
            raise InputError(f"--reference {args.reference}: has NaN/inf values; a reference "
                             f"must be finite")
    with open_denoiser(args.model, workers=args.n_workers, models_dir=args.models_dir,
                       gguf_path=args.gguf, stage_timeout=args.stage_timeout,
                       precision=args.precision,
                       q8_float_weights=args.q8_float_weights) as den:
        if out_path is not None:              # never overwrite a file of the opened model
            from nxhpc.models.registry import opened_model_files
            check_cli_output_path(out_path, what="--out",
                              model_files=opened_model_files(den.gguf.path,
                                                             den.directory))
        if ranks is not None:
            from nxhpc.runtime.ranks import file_fingerprint
            ranks.same("the model file (size, fingerprint)", file_fingerprint(den.gguf.path),
                       bounded=False)
        return _run_model(args, den, inputs, ref, out_path, ranks)


def _stored(den):
    from nxhpc.formats.fixtures import FIXTURES_FILE
    from nxhpc.models.synthetic import read_denoiser_fixtures
    from nxhpc.models import MissingTensorError
    f = den.directory / FIXTURES_FILE if den.directory is not None else None
    if f is None or not f.is_file():
        raise MissingTensorError(f"{den.directory or den.gguf.path}: no stored inputs "
                                 f"({FIXTURES_FILE}); give --latents, --timestep and "
                                 f"--cap-feats")
    return read_denoiser_fixtures(f)


def _run_model(args, den, inputs, ref, out_path, ranks=None) -> int:
    from nxhpc.dit.denoiser import SEGMENTS, DenoiserInputError, NonFiniteOutputError
    cfg = den.config
    ref_name = args.reference
    lead = ranks is None or ranks.rank == 0
    source = None                             # the stored inputs' file, named in errors
    if args.latents is None:
        from nxhpc.formats.fixtures import FIXTURES_FILE
        source = f"{den.directory / FIXTURES_FILE if den.directory else den.gguf.path} " \
                 f"(the stored inputs)"
    if inputs is None and lead:
        fx = _stored(den)
        inputs = (fx.latents, fx.timestep, fx.cap_feats)
        if ref is None and fx.reference is not None:
            ref, ref_name = fx.reference, f"{fx.path.name}:reference"
    if ranks is not None:                     # rank 0's inputs on every rank (startup only)
        inputs = ranks.bcast(inputs, "the inputs from rank 0", bounded=False)
    lat, t, cap = inputs
    if ref is not None and ref.shape != lat.shape:
        raise InputError(f"reference {ref_name}: shape {list(ref.shape)} is not the latents' "
                         f"{list(lat.shape)}")
    best: dict[str, int] = {}
    out = None
    reused = 0
    for _ in range(args.repeat):
        try:
            out = den.forward(lat, t, cap)
            reused += den.last_caption_reused
        except DenoiserInputError as e:     # rank 0's broadcast inputs: every rank at once
            with on_every_rank(ranks):
                raise InputError(f"{source}: {e}" if source else str(e)) from None
        except NonFiniteOutputError as e:   # reported and failed below, never written
            out = e.output
        for k, v in den.last_timings.items():
            best[k] = min(best.get(k, v), v)
        if not np.isfinite(out).all():
            break                           # the same bits every run: no need to repeat
    s = den.session(*lat.shape[-2:], cap.shape[0])
    mem = den.memory()
    report: dict = {"model": str(den.directory or den.gguf.path), "dim": cfg.dim,
                    "heads": cfg.n_heads, "head_dim": cfg.head_dim, "ffn_dim": cfg.ffn_dim,
                    "layers": cfg.n_layers, "noise_refiner": cfg.n_noise_refiner,
                    "context_refiner": cfg.n_context_refiner, "cap_dim": cfg.cap_dim,
                    "latents": list(lat.shape), "timestep": float(t),
                    "image_tokens": s.n_img, "image_rows": s.Np,
                    "caption_tokens": int(cap.shape[0]), "caption_rows": s.Lp,
                    "joint_rows": s.Np + s.Lp, "workers": den.workers,
                    "precision": den.precision, "attention": attention_kernel(den.precision),
                    "repeat": args.repeat, "caption_reused": reused}
    report.update({f"us_{k}": best[f"us_{k}"] for k in SEGMENTS})
    per_layer = best["us_layers"] / max(1, cfg.n_layers) / 1e6
    rest = (best["us_total"] - best["us_layers"]) / 1e6
    report["s_per_layer"] = per_layer
    report["s_per_30_layer_step"] = rest + 30 * per_layer
    report.update(mem)
    bad = int(out.size - np.count_nonzero(np.isfinite(out)))
    if ref is None:                         # in every report: a grade prints its own
        report["non_finite"] = bad
    if ranks is not None:
        report.update(_rank_report(den, s, ranks))
        if not lead:
            return Exit.PASS

    g = None
    if ref is not None:
        tol = DENOISE_TOL[den.precision] if args.tol is None else args.tol
        g = grade(out, ref, tol=tol, reference=str(ref_name))
    if g is not None:
        verdict = g.verdict_line()
    elif bad:
        verdict = (f"FAIL: {bad} of {out.size} output values are NaN/inf (finite inputs "
                   f"overflowed inside the model; ungraded: no reference)")
    else:
        verdict = "UNGRADED: no reference (the model stores none; pass --reference R.npy to grade)"
    segs = " | ".join(f"{k} {best[f'us_{k}'] / 1e6:.4f} s" for k in SEGMENTS)
    save = None
    if out_path is not None and not bad:    # a NaN/inf output is never written
        save = lambda: save_npy(out_path, out, "--out")  # noqa: E731
    extra: dict = {}
    not_written = f"--out {out_path} not written: {bad} of {out.size} output values are NaN/inf"
    if g is None and bad:
        extra["verdict"] = "FAIL"
    if out_path is not None and bad:
        extra.update(saved_output=None, save_error=not_written)
    save_error = emit_graded(report, as_json=args.json, grade=g, verdict=verdict,
                             text_lines=[f"segments: {segs}"], json_extra=extra, save=save,
                             saved_path=out_path)
    if out_path is not None and bad:
        print(f"{PROG}: error: {not_written}", file=sys.stderr, flush=True)
    if save_error:
        print(f"{PROG}: error: {save_error}", file=sys.stderr, flush=True)
        return Exit.OUTPUT
    return Exit.FAIL if bad or (g is not None and not g.passed) else Exit.PASS


def _rank_report(den, s, ranks) -> dict:
    """``ranks``, each rank's bands of the main layers' split stages (rows: all, on every
    rank) and rank 0's exchange: bytes received and time waited (the whole run)."""
    eng = s.engine
    bands = eng.rank_bands(s.plans["layers"], s.Np + s.Lp)
    split = {"rank_qkv_columns": "qkv", "rank_heads": "sdpa", "rank_dim_columns": "out_proj",
             "rank_ffn_columns": "w13"}
    rep: dict = {"ranks": ranks.size}
    rep.update({k: [list(b) for b in bands[v]] for k, v in split.items() if bands.get(v)})
    rep["rank_rows"] = [[0, s.Np + s.Lp]] * ranks.size
    rep["exchange_bytes"] = eng.exchange_bytes
    rep["us_exchange"] = eng.exchange_us
    return rep


if __name__ == "__main__":
    sys.exit(main())
