"""``python -m nxhpc.blockrun``: run DiT blocks end to end from the block input and the weights,
then grade the output.

Owns the CLI only: argument parsing, exit codes, signal -> exit-code mapping and printing. The
work is done by ``nxhpc.models`` (files), ``nxhpc.dit.block`` (the pipeline) and ``nxhpc.dit.grade``.
"""
from __future__ import annotations

import argparse
from collections.abc import Callable
import json
import math
import os
import sys
import time
import traceback

import numpy as np

from nxhpc.dit.grade import DEFAULT_TOL, count_exceeding, error_row, fmt_value, grade, json_safe
from nxhpc.nn.linear import DEFAULT_PRECISION, PRECISIONS
from nxhpc.runtime.outfile import OutputPathError, check_output_path, write_atomic
from nxhpc.runtime.proc import Terminated, cli_signals
from nxhpc.runtime.shm import ShmSpaceError
from nxhpc.runtime.workers import DEFAULT_SPAWN, SPAWN_MODES, WorkerError, max_workers, usable_cpus

__all__ = ["main", "build_parser", "EXIT_CODES", "PRECISION_TOL"]

#: Default --tol per --precision (max_rel of the graded output). f32 keeps DEFAULT_TOL. bf16 / q8:
#: about 2x the max_rel measured for one block vs the float64 reference (docs/kernels.md,
#: "Precisions through the block"): bf16 1.2e-2 / 1.5e-2 / 1.7e-2 and q8 3.3e-2 / 4.4e-2 /
#: 5.1e-2 on tiny / mid / zimage-1l (max_rel grows slowly with the element count: it is the
#: tail of ~T*D errors whose RMS is 0.2% (bf16) / 0.6% (q8) of the output's).
PRECISION_TOL = {"f32": DEFAULT_TOL, "bf16": 3e-2, "q8": 1e-1}

EXIT_PASS, EXIT_FAIL, EXIT_USAGE = 0, 1, 2
EXIT_NOT_FOUND, EXIT_BAD_FILE, EXIT_MISSING, EXIT_WORKER = 3, 4, 5, 6
EXIT_SHM, EXIT_OUTPUT, EXIT_MODELS_DIR = 7, 8, 9
EXIT_INTERNAL = 70
EXIT_SIGINT, EXIT_SIGTERM = 130, 143
EXIT_CODES = {
    EXIT_PASS: "pass: the output is within tolerance of the reference",
    EXIT_FAIL: "graded fail: max_rel above the tolerance, or non-finite outputs",
    EXIT_USAGE: "usage error (bad arguments, e.g. n_workers 'abc' or 0, --layers beyond the model, "
                "a --save-output path that cannot be written or is one of the model's files)",
    EXIT_NOT_FOUND: "model not found (id, directory or gguf_path)",
    EXIT_BAD_FILE: "bad model file (malformed/unsupported GGUF or fixtures, NaN/inf in an input "
                   "or a .npy reference, weights a Q8_0 scale cannot hold)",
    EXIT_MISSING: "missing fixture or tensor (e.g. layers.0.blk_in, the reference)",
    EXIT_WORKER: "a worker process failed (raised, crashed, was killed, or exceeded "
                 "--stage-timeout)",
    EXIT_SHM: "not enough shared memory: /dev/shm cannot hold the arena (the message gives the "
              "bytes needed and free; in a container use --shm-size)",
    EXIT_OUTPUT: "--save-output could not be written (e.g. disk full): the report was printed, "
                 "an existing file at that path is unchanged",
    EXIT_MODELS_DIR: "the models directory ($NXHPC_MODELS / --models-dir) cannot take a built-in "
                     "model: not a directory, not writable, or full (the message names it; "
                     "nothing is left behind)",
    EXIT_INTERNAL: "internal error (a bug: please report the traceback)",
    EXIT_SIGINT: "interrupted by Ctrl-C / SIGINT (shared memory released)",
    EXIT_SIGTERM: "terminated by SIGTERM (shared memory released)",
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

exit codes:
%(codes)s
"""


_Terminated = Terminated          # raised from the SIGTERM handler: every cleanup runs


def _positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {s!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {s!r}")
    return v


def _workers_arg(s: str) -> int:
    v = _positive_int(s)
    if v > max_workers():
        raise argparse.ArgumentTypeError(
            f"at most {max_workers()} (8x the {usable_cpus()} usable CPUs, at least 64), got {v}")
    return v


def _layers_arg(s: str):
    if s == "all":
        return "all"
    return _positive_int(s)


def _positive_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {s!r}") from None
    if not math.isfinite(v) or v <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {s!r}")
    return v


def _eps_arg(s: str) -> float:
    from nxhpc.dit.plan import check_eps
    v = _positive_float(s)
    try:
        return check_eps(v)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    codes = "\n".join(f"  {k:>3}  {v}" for k, v in EXIT_CODES.items())
    p = argparse.ArgumentParser(
        prog="python -m nxhpc.blockrun",
        description="Run a DiT block (or --layers consecutive blocks) of a model end to end on "
                    "nxhpc's C kernels in forked workers, from only the block input "
                    "(layers.0.blk_in) and the weights, and grade the output against a "
                    "reference. Prints key=value lines (or one JSON object) and a verdict.",
        epilog=_GRADING_HELP % {"tol": ", ".join(f"{k} {v:g}" for k, v in PRECISION_TOL.items()),
                                "codes": codes},
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_id", help="built-in model id (e.g. tiny, mid, zimage-1l), a directory "
                                    "under --models-dir / $NXHPC_MODELS, or a model directory path")
    p.add_argument("n_workers", nargs="?", type=_workers_arg, default=None,
                   help="worker processes (default: the usable CPUs, here %d)" % usable_cpus())
    p.add_argument("reference_name", nargs="?", default=None,
                   help="fixture to grade the final output against (default: see grading "
                        "below); a path to a .npy file also works")
    p.add_argument("gguf_path", nargs="?", default=None,
                   help="GGUF weights to use instead of the model directory's model.gguf")
    p.add_argument("--layers", type=_layers_arg, default=1, metavar="N|all",
                   help="run N consecutive layers from layer 0 (each with its own adaLN); "
                        "'all' = every layer of the model (default 1)")
    p.add_argument("--spawn", choices=SPAWN_MODES, default=DEFAULT_SPAWN,
                   help=f"worker scheme: 'pool' forks once and dispatches stages over pipes; "
                        f"'stage' forks per parallel stage (default {DEFAULT_SPAWN}, the faster)")
    p.add_argument("--eps", type=_eps_arg, default=None,
                   help="RMSNorm eps (default: the model's, 1e-5 for Z-Image; the source "
                        "runner used 1e-6)")
    p.add_argument("--precision", choices=PRECISIONS, default=DEFAULT_PRECISION,
                   help="matmul precision of the projections: f32 (default, exact dequantized "
                        "weights), bf16 (bfloat16 inputs, float32 accumulation), q8 (Q8_0 "
                        "activations x Q8_0 weights; other weight types run bf16). Norms, RoPE, "
                        "attention, residuals and adaLN stay float32")
    p.add_argument("--tol", type=_positive_float, default=None,
                   help="pass/fail tolerance on max_rel (default per --precision: "
                        + ", ".join(f"{k} {v:g}" for k, v in PRECISION_TOL.items()) + ")")
    p.add_argument("--source", choices=("auto", "gguf", "fixtures"), default="auto",
                   help="where the weights come from (default auto: the GGUF when present)")
    p.add_argument("--adaln", choices=("auto", "t_emb", "fixture"), default="auto",
                   help="modulation: computed from t_emb with each layer's adaLN weights, or the "
                        "tapped layers.N.adaln_m (default auto: t_emb when present)")
    p.add_argument("--models-dir", default=None,
                   help="where model ids are looked up / built-ins generated "
                        "(default $NXHPC_MODELS or ~/.cache/nxhpc/models)")
    p.add_argument("--stage-timeout", type=_positive_float, default=None, metavar="SECONDS",
                   help="kill the workers and fail (exit 6) when one parallel stage takes longer "
                        "than this, e.g. a hung worker (default: no limit)")
    p.add_argument("--repeat", type=_positive_int, default=1, metavar="N",
                   help="run the block(s) N times on the same workers and report the fastest "
                        "time of each stage (the first run pays page faults and cold caches; "
                        "the output is the same bits every run; default 1)")
    p.add_argument("--save-output", metavar="PATH", default=None,
                   help="write the final block output as a float32 .npy array")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object instead of key=value lines")
    return p


def _err(msg: str) -> None:
    print(f"blockrun: error: {msg}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (see ``--help``)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:                   # argparse: --help -> 0, usage errors -> 2
        return int(e.code or 0)
    return cli_main(_err, lambda sig: _run(args, sig))


def cli_main(err: Callable[[str], None], run: Callable[[cli_signals], int]) -> int:
    """The frame every nxhpc CLI's ``main`` runs ``run(sig)`` in: SIGINT -> 130 and SIGTERM ->
    143 with one line through ``err``, shared memory released on every path."""
    with cli_signals() as sig:
        try:
            return run(sig)
        except KeyboardInterrupt:
            err("interrupted (SIGINT); workers stopped, shared memory released")
            return EXIT_SIGINT
        except Terminated:
            err("terminated (SIGTERM); workers stopped, shared memory released")
            return EXIT_SIGTERM
        finally:
            from nxhpc.runtime.shm import cleanup_all
            cleanup_all()


class _InputError(Exception):
    """An input fixture is unusable (e.g. the wrong shape for the model)."""


class _UsageError(Exception):
    """Arguments that do not fit the model (e.g. --layers beyond its depth)."""


def _exit_code(e: Exception) -> int | None:
    """The documented exit code for an expected failure, None for anything else (a bug)."""
    from nxhpc.models import MissingTensorError, ModelError, ModelNotFoundError, ModelsDirError
    for cls, code in ((ModelsDirError, EXIT_MODELS_DIR),
                      (ModelNotFoundError, EXIT_NOT_FOUND), (MissingTensorError, EXIT_MISSING),
                      (ModelError, EXIT_BAD_FILE), (_InputError, EXIT_BAD_FILE),
                      (WorkerError, EXIT_WORKER), (_UsageError, EXIT_USAGE),
                      (ShmSpaceError, EXIT_SHM)):
        if isinstance(e, cls):
            return code
    return None


def _run(args: argparse.Namespace, sig: cli_signals) -> int:
    from nxhpc.models import open_model

    try:
        if args.save_output is not None:           # up front: not after the whole run
            try:
                check_output_path(args.save_output, what="--save-output")
            except OutputPathError as e:
                raise _UsageError(str(e)) from None
        workers = args.n_workers if args.n_workers is not None else usable_cpus()
        with open_model(args.model_id, models_dir=args.models_dir,
                        gguf_path=args.gguf_path) as model:
            return _run_model(args, model, workers)
    except Exception as e:            # KeyboardInterrupt / Terminated are not Exceptions
        interrupt = sig.interrupt()
        if interrupt is not None:     # a Ctrl-C that C code (numpy's tofile) turned into e
            raise interrupt from e
        code = _exit_code(e)
        if code is None:
            traceback.print_exc()
            _err("internal error (see the traceback above)")
            return EXIT_INTERNAL
        _err(f"worker failure: {e}" if code == EXIT_WORKER else str(e))
        return code


def _has(model, name: str) -> bool:
    return model.fixtures is not None and model.fixtures.has(name)


def _reference_for(model, layer: int) -> str | None:
    for name in (f"layers.{layer + 1}.blk_in", f"layers.{layer}.ref_out"):
        if _has(model, name):
            return name
    return None


def _load_ref(model, name: str, shape: tuple[int, int]) -> np.ndarray:
    """A fixture by name, or a ``.npy`` file (kept at its own float precision)."""
    from nxhpc.models import MissingTensorError, ModelFileError
    if name.endswith(".npy") and os.path.isfile(name):
        try:
            a = np.load(name, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise ModelFileError(f"reference {name}: cannot read: {e}") from None
        if a.shape != shape or a.dtype.kind != "f":
            raise ModelFileError(f"reference {name}: {a.dtype} {a.shape}, expected a "
                                 f"floating-point array of shape {shape}")
        bad = int(a.size - np.count_nonzero(np.isfinite(a)))
        if bad:
            raise ModelFileError(f"reference {name}: {bad} of {a.size} elements are NaN or "
                                 f"inf; a reference must be finite")
        return a
    if not _has(model, name):
        raise MissingTensorError(f"reference {name!r}: no such fixture in "
                                 f"{model.fixtures.path if model.fixtures else model.path}")
    return model.fixtures.load(name, shape)


def _run_model(args, model, workers: int) -> int:
    from nxhpc.dit.block import adaln, check_config, run_layers, validate_inputs
    from nxhpc.models import MissingTensorError
    cfg = model.config
    try:
        check_config(cfg)
    except ValueError as e:
        raise _InputError(f"{model.path}: {e}") from None
    n_layers = cfg.n_layers if args.layers == "all" else args.layers
    if n_layers > cfg.n_layers:
        raise _UsageError(f"--layers {n_layers}: the model has only {cfg.n_layers} layers")
    layers = list(range(n_layers))
    eps = cfg.norm_eps if args.eps is None else args.eps
    if args.eps is None:                        # --eps is checked when parsed (exit 2)
        from nxhpc.dit.plan import check_eps
        try:
            check_eps(eps)
        except ValueError as e:
            raise _InputError(f"{model.path}: the model's norm eps: {e}") from None
    if model.fixtures is None or not model.fixtures.has("layers.0.blk_in"):
        raise MissingTensorError(f"{model.path}: missing fixture 'layers.0.blk_in' "
                                 f"(the block input)")
    if args.save_output is not None:               # never overwrite what this run reads
        inputs = [f for f in (model.path.iterdir() if model.path and model.path.is_dir() else ())]
        inputs += [p for p in (args.gguf_path, args.reference_name) if p]
        try:
            check_output_path(args.save_output, what="--save-output", inputs=inputs)
        except OutputPathError as e:
            raise _UsageError(str(e)) from None
    x = model.blk_in(0)
    T = x.shape[0]
    pe = model.pe()
    mask = model.mask()

    report: dict = {"model": str(model.path), "variant": cfg.variant, "dim": cfg.dim,
                    "tokens": T, "heads": cfg.n_heads, "kv_heads": cfg.n_kv_heads,
                    "head_dim": cfg.head_dim, "qkv_width": cfg.qkv_width,
                    "ffn_dim": cfg.ffn_dim, "workers": workers, "spawn": args.spawn,
                    "layers": n_layers, "repeat": args.repeat, "eps": eps,
                    "precision": args.precision,
                    "mask": mask is not None,
                    "gguf_tensors": len(model.gguf.names()) if model.gguf is not None else 0}

    # modulation source
    use_t = args.adaln in ("auto", "t_emb") and _has(model, "t_emb")
    if args.adaln == "t_emb" and not use_t:
        raise MissingTensorError(f"{model.path}: --adaln t_emb but fixture 't_emb' is missing")
    t_emb = model.t_emb() if use_t else None
    adaln_ms = None
    if not use_t:
        missing = [f"layers.{i}.adaln_m" for i in layers if not _has(model, f"layers.{i}.adaln_m")]
        if missing:
            raise MissingTensorError(f"{model.path}: need fixture 't_emb' or {', '.join(missing)}")
        adaln_ms = {i: model.adaln_m(i) for i in layers}
    report["adaln"] = "t_emb" if use_t else "fixture"
    try:                                  # the fixtures against the model's config
        validate_inputs(cfg, x, pe, mask, t_emb=t_emb,
                        adaln_m=None if use_t else adaln_ms[layers[0]])
    except (ValueError, TypeError) as e:
        raise _InputError(f"{model.path}: {e}") from None

    weights = {i: model.layer_weights(i, args.source) for i in layers}
    report["weights"] = weights[0].source

    # self-check of the source runner: layer 0's adaLN from the GGUF vs the tapped fixture
    if model.gguf is not None and _has(model, "t_emb") and _has(model, "layers.0.adaln_m"):
        g0 = weights[0] if weights[0].source == "gguf" else model.layer_weights(0, "gguf")
        calc = adaln(cfg, g0, model.t_emb())
        report["adaln_gguf_vs_fixture_fail_1e3"] = count_exceeding(calc, model.adaln_m(0), 1e-3,
                                                                   "layers.0.adaln_m")

    # references
    final_ref = args.reference_name or _reference_for(model, layers[-1])
    if final_ref is None:
        raise MissingTensorError(f"{model.path}: no reference for layer {layers[-1]}: neither "
                                 f"'layers.{layers[-1] + 1}.blk_in' nor "
                                 f"'layers.{layers[-1]}.ref_out' exists (name one as "
                                 f"reference_name)")
    ref_final = _load_ref(model, final_ref, (T, cfg.dim))
    per_refs = {}
    if n_layers > 1:
        for i in layers:
            name = _reference_for(model, i)
            if name is not None:
                per_refs[i] = name

    table: list[dict] = []
    progress = n_layers > 1
    t_start = time.monotonic()

    def on_layer(i, out, timings):
        row = {"layer": i, "block_us": timings["block_us"]}
        if i in per_refs:
            ref = model.fixtures.load(per_refs[i], (T, cfg.dim))
            row.update(error_row(out, ref))
            row["reference"] = per_refs[i]
        table.append(row)
        if progress:
            el = time.monotonic() - t_start
            extra = (f", max_rel {row['max_rel']:.2e}" if row.get("max_rel") is not None
                     else ", max_rel null" if "max_rel" in row else "")
            print(f"blockrun: layer {i + 1}/{n_layers} done ({timings['block_us'] / 1e6:.2f} s, "
                  f"{el:.1f} s elapsed{extra})", file=sys.stderr, flush=True)

    res = run_layers(model, layers, x, pe, t_emb=t_emb, adaln_ms=adaln_ms, mask=mask,
                     workers=workers, spawn=args.spawn, eps=eps, on_layer=on_layer,
                     weights=weights, stage_timeout=args.stage_timeout, repeat=args.repeat,
                     precision=args.precision)
    out = res.output
    for k, v in res.timings.items():
        if k != "per_layer":
            report[k] = v
    tol = PRECISION_TOL[args.precision] if args.tol is None else args.tol
    g = grade(out, ref_final, tol=tol, reference=final_ref)
    code = EXIT_PASS if g.passed else EXIT_FAIL

    def save() -> str | None:
        """Write the output (atomically, exactly this path: np.save would add .npy); the error
        text, or None."""
        try:
            write_atomic(args.save_output, lambda f: np.save(f, out.astype(np.float32)))
        except OSError as e:
            return (f"--save-output {args.save_output}: could not write the output: "
                    f"{e.strerror or e}; an existing file at that path is unchanged")
        return None

    # The report comes first and always: a failing save cannot cost the verdict.
    save_error = None
    if args.json:
        obj = dict(report)
        if args.save_output is not None:
            save_error = save()
            obj["saved_output"] = None if save_error else str(args.save_output)
            if save_error:
                obj["save_error"] = save_error
        obj.update(g.as_dict())
        if n_layers > 1:
            obj["per_layer"] = table
        obj["verdict_line"] = g.verdict_line()
        print(json.dumps(json_safe(obj), allow_nan=False))   # strict JSON: no NaN/Infinity
    else:
        for k, v in report.items():
            print(f"{k}={fmt_value(v)}")
        if n_layers > 1:
            for row in table:
                print(" ".join(f"{k}={fmt_value(v)}" for k, v in row.items()))
        for line in g.lines():
            print(line)
        sys.stdout.flush()
        if args.save_output is not None:
            save_error = save()
            if save_error is None:
                print(f"saved_output={args.save_output}")
        print(g.verdict_line())
    sys.stdout.flush()
    if save_error:
        _err(save_error)
        return EXIT_OUTPUT
    return code


if __name__ == "__main__":
    sys.exit(main())
