"""``python -m nxhpc.blockrun`` (``nxhpc-blockrun``, ``nxhpc blockrun``): run DiT blocks end to
end from the block input and the weights, then grade the output.

Owns the CLI only: parse -> :func:`nxhpc.dit.stackrun.run_stack` -> report. Exit codes, the
signal frame, the argparse types and the report writer are :mod:`nxhpc.cli`'s; the model is
opened by ``nxhpc.models``. Must not: run or grade anything itself, or import another CLI.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from nxhpc.cli import args as types   # first: nxhpc.cli repairs a shadowed package
from nxhpc.cli.codes import Exit
from nxhpc.cli.frame import run_ranked
from nxhpc.cli.report import emit_graded, fmt_value, save_npy
from nxhpc.dit.grade import DEFAULT_TOL
from nxhpc.dit.stackrun import PRECISION_TOL
from nxhpc.formats.gguf_io import ModelNotFoundError
from nxhpc.models.modeldir import FIXTURES_FILE
from nxhpc.runtime.checks import check_input_file
from nxhpc.runtime.outfile import check_cli_output_path
from nxhpc.runtime.workers import DEFAULT_SPAWN, SPAWN_MODES

__all__ = ["main", "build_parser", "EXIT_CODES", "PRECISION_TOL", "DEFAULT_TOL"]

PROG = "blockrun"

#: The codes blockrun returns, in its words (the numbers are nxhpc.cli.codes.Exit's).
EXIT_CODES = {
    Exit.PASS: "pass: the output is within tolerance of the reference",
    Exit.FAIL: "graded fail: max_rel above the tolerance, or non-finite outputs (then "
               "--save-output is not written)",
    Exit.USAGE: "usage error (bad arguments, e.g. n_workers 'abc' or 0, --layers beyond the model, "
                "a --save-output path that cannot be written or is one of the model's files)",
    Exit.NOT_FOUND: "model not found (id, directory or gguf_path), or a built-in text "
                    "encoder's or autoencoder's id",
    Exit.BAD_INPUT: "bad model file (malformed/unsupported GGUF or fixtures, NaN/inf in an input "
                    "or a .npy reference, weights a Q8_0 scale cannot hold)",
    Exit.MISSING: "missing fixture or tensor (e.g. layers.0.blk_in, the reference)",
    Exit.WORKER: "a worker process failed (raised, crashed, was killed, or exceeded "
                 "--stage-timeout)",
    Exit.SHM: None,
    Exit.OUTPUT: "--save-output could not be written (e.g. disk full): the report was printed, "
                 "an existing file at that path is unchanged",
    Exit.MODELS_DIR: None,
    Exit.INTERNAL: None,
    Exit.SIGHUP: None,
    Exit.SIGINT: None,
    Exit.SIGTERM: None,
}

_GRADING_HELP = """\
grading:
  rel_i = |out_i - ref_i| / max(|ref_i|, rms(ref))   (float64; rms(ref) = sqrt(mean(ref^2)))
  i.e. each element's error relative to its own magnitude, with the reference's RMS as a floor
  for elements near zero. fail_1e2..fail_1e5 count elements with rel_i above 1e-2..1e-5;
  max_abs, max_rel, rms_err (and rel_rms_err = rms_err / rms(ref)), cosine, non_finite follow.
  Verdict PASS iff no output is NaN/inf and max_rel <= --tol (default %(tol)s).
  Default reference: layers.{L+1}.blk_in (the next layer's tapped input) when present, else
  layers.{L}.ref_out, where L is the last layer run. With --layers N every layer is also graded
  against its own reference and a per-layer error table is printed (error growth with depth).
  adaln_gguf_vs_fixture_fail_1e3 (printed when the model has a GGUF, t_emb and
  layers.0.adaln_m): elements of layer 0's adaLN recomputed from the GGUF with rel_i > 1e-3.

"""


def build_parser() -> argparse.ArgumentParser:
    p = types.cli_parser(
        "blockrun",
        description="Run a DiT block (or --layers consecutive blocks) of a model end to end on "
                    "nxhpc's C kernels in forked workers, from only the block input "
                    "(layers.0.blk_in) and the weights, and grade the output against a "
                    "reference. Prints key=value lines (or one JSON object) and a verdict.",
        epilog=_GRADING_HELP % {"tol": ", ".join(f"{k} {v:g}" for k, v in PRECISION_TOL.items())},
        exit_codes=EXIT_CODES)
    p.add_argument("model_id", nargs="?", default="tiny",
                   help="built-in model id (e.g. tiny, mid, zimage-1l), a directory under "
                        "--models-dir / $NXHPC_MODELS, or a model directory path (default tiny: "
                        "the built-in default model, generated on first use)")
    types.add_workers(p)
    p.add_argument("reference_name", nargs="?", default=None,
                   help="fixture to grade the final output against (default: see grading "
                        "below); a path to a .npy file also works")
    p.add_argument("gguf_path", nargs="?", default=None,
                   help="GGUF weights to use instead of the model directory's model.gguf")
    p.add_argument("--layers", type=types.layers, default=1, metavar="N|all",
                   help="run N consecutive layers from layer 0 (each with its own adaLN); "
                        "'all' = every layer of the model (default 1)")
    p.add_argument("--spawn", choices=SPAWN_MODES, default=DEFAULT_SPAWN,
                   help=f"worker scheme: 'pool' forks once and dispatches stages over pipes; "
                        f"'stage' forks per parallel stage (default {DEFAULT_SPAWN}, the faster)")
    p.add_argument("--eps", type=types.eps, default=None,
                   help="RMSNorm eps (default: the model's, 1e-5 for Z-Image; the source "
                        "runner used 1e-6)")
    types.add_precision(p, "matmul precision of the projections: f32 (default, exact "
                           "dequantized weights), bf16 (bfloat16 inputs, float32 accumulation), "
                           "q8 (Q8_0 activations x the weights' integer codes; float weights: the "
                           "option below). Norms, RoPE, residuals and adaLN stay float32")
    types.add_q8_float_weights(p)
    types.add_tol(p, PRECISION_TOL)
    p.add_argument("--source", choices=("auto", "gguf", "fixtures"), default="auto",
                   help="where the weights come from (default auto: the GGUF when present)")
    p.add_argument("--adaln", choices=("auto", "t_emb", "fixture"), default="auto",
                   help="modulation: computed from t_emb with each layer's adaLN weights, or the "
                        "tapped layers.N.adaln_m (default auto: t_emb when present)")
    types.add_models_dir(p)
    types.add_stage_timeout(p, ranks=True)
    p.add_argument("--repeat", type=types.positive_int, default=1, metavar="N",
                   help="run the block(s) N times on the same workers and report the fastest "
                        "time of each stage (the first run pays page faults and cold caches; "
                        "the output is the same bits every run; default 1)")
    p.add_argument("--save-output", metavar="PATH", default=None,
                   help="write the final block output as a float32 .npy array")
    p.add_argument("--roofline", action="store_true",
                   help="also report each stage's time against its limit on this machine: "
                        "frac_<stage> (the projections' or the attention's work at the "
                        "per-core peak of the unit that runs it, measured now, ~0.3 s a kind, "
                        "over the stage's time: 1 is the peak), limit_us / x_limit for the "
                        "block, and machine_limit_us / x_machine_limit on the machine's fastest "
                        "units (nxhpc.dit.roofline)")
    types.add_json(p)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (see ``--help``)."""
    return run_ranked(PROG, build_parser(), argv, _run)


def _run(args: argparse.Namespace, ranks=None) -> int:
    """One run; under mpirun (``ranks``) every rank runs the slice's stages split across the
    ranks (``nxhpc.nn.engine``) on its own copy of the model (checked to be the same files),
    and rank 0 alone saves and reports."""
    from nxhpc.dit.stackrun import check_slice, run_stack
    from nxhpc.models import open_model
    if args.gguf_path is not None and os.path.exists(args.gguf_path):   # missing: exit 3
        # a FIFO or /dev/null is not "no such file"
        check_input_file(args.gguf_path, "gguf_path", "a .gguf file")
    lead = ranks is None or ranks.rank == 0
    if not lead:
        args.save_output = None
    if args.save_output is not None:           # up front: not after the whole run
        check_cli_output_path(args.save_output, what="--save-output")
    try:
        model = open_model(args.model_id, models_dir=args.models_dir, gguf_path=args.gguf_path)
    except ModelNotFoundError as e:
        if not args.model_id.isdecimal() or os.path.exists(args.model_id):
            raise
        raise ModelNotFoundError(f"{e} (the model id comes first: blockrun tiny "
                                 f"{args.model_id} for {args.model_id} workers)") from None
    with model:
        n_layers = check_slice(model, args.layers)
        if ranks is not None:
            from nxhpc.runtime.ranks import file_fingerprint
            files = sorted(p.name for p in model.path.iterdir() if p.is_file()) \
                if model.path and model.path.is_dir() else []
            ranks.same("the model files (name, size, fingerprint)",
                       [(n, *file_fingerprint(model.path / n)) for n in files]
                       + ([file_fingerprint(args.gguf_path)] if args.gguf_path else []),
                       bounded=False)
            ranks.same_args({"--layers": n_layers, "--precision": args.precision,
                             "--q8-float-weights": args.q8_float_weights,
                             "--source": args.source, "--adaln": args.adaln, "--eps": args.eps,
                             "--tol": args.tol, "--repeat": args.repeat, "--json": args.json})
            ranks.same_kernels(args.precision)
        if args.save_output is not None:       # never overwrite what this run reads
            from nxhpc.models.registry import opened_model_files
            main = model.gguf.path if model.gguf is not None else model.path / FIXTURES_FILE
            check_cli_output_path(args.save_output, what="--save-output",
                              inputs=[p for p in (args.reference_name,) if p],
                              model_files=opened_model_files(main, model.path))
        t_start = time.monotonic()

        def progress(row: dict, n: int) -> None:
            if n < 2 or not lead:
                return
            el = time.monotonic() - t_start
            extra = (f", max_rel {row['max_rel']:.2e}" if row.get("max_rel") is not None
                     else ", max_rel null" if "max_rel" in row else "")
            print(f"{PROG}: layer {row['layer'] + 1}/{n} done ({row['block_us'] / 1e6:.2f} s, "
                  f"{el:.1f} s elapsed{extra})", file=sys.stderr, flush=True)

        res = run_stack(model, layers=n_layers, workers=args.n_workers, spawn=args.spawn,
                        eps=args.eps, precision=args.precision, source=args.source,
                        q8_float_weights=args.q8_float_weights,
                        adaln=args.adaln, reference=args.reference_name, tol=args.tol,
                        stage_timeout=args.stage_timeout, repeat=args.repeat,
                        on_layer=progress, grade_output=lead)   # rank 0 reads the reference
        if args.roofline and lead:
            from nxhpc.dit.config import block_view
            from nxhpc.dit.roofline import report_fields
            r = res.report
            res.report.update(report_fields(
                r, block_view(model.config), r["tokens"], r["precision"],
                r["workers"] * (ranks.size if ranks is not None else 1), layers=n_layers))
    if not lead:
        return Exit.PASS
    if ranks is not None:
        res.report["ranks"] = ranks.size
    save = None
    bad = res.grade.non_finite
    if args.save_output is not None and not bad:    # a NaN/inf output is never written
        save = lambda: save_npy(args.save_output, res.output, "--save-output")  # noqa: E731
    rows = [" ".join(f"{k}={fmt_value(v)}" for k, v in row.items()) for row in res.per_layer]
    save_error = emit_graded(res.report, as_json=args.json, grade=res.grade,
                             verdict=res.grade.verdict_line(), text_lines=rows,
                             json_extra={"per_layer": res.per_layer} if n_layers > 1 else None,
                             save=save, saved_path=args.save_output)
    if args.save_output is not None and bad:
        print(f"{PROG}: error: --save-output {args.save_output} not written: {bad} of "
              f"{res.grade.n} output values are NaN/inf", file=sys.stderr, flush=True)
    if save_error:
        print(f"{PROG}: error: {save_error}", file=sys.stderr, flush=True)
        return Exit.OUTPUT
    return Exit.PASS if res.grade.passed else Exit.FAIL


if __name__ == "__main__":
    sys.exit(main())
