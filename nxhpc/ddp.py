"""``python -m nxhpc.ddp`` (``nxhpc-ddp``, ``nxhpc ddp``): bit-reproducible data-parallel training
of a small MLP on the Q16 tape, over forked workers or MPI::

    python -m nxhpc.ddp --workers 4 --steps 300 [--backend shm|mpi]
    mpirun -n 4 python -m nxhpc.ddp --backend mpi --steps 300

Owns the CLI only: parse -> :mod:`nxhpc.train.ddp` (the trainer, the ring, the Q16 tape) ->
print the per-step loss, the SHA-256 of the final weights, the ``--sweep`` table and the float32
contrast, and write the ``--json`` report atomically. Exit codes, the signal frame, the argparse
types and the writer are :mod:`nxhpc.cli`'s. Must not: train anything itself, touch the
inference kernels, or import another CLI.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys

import numpy as np

from nxhpc.cli import args as types   # first: nxhpc.cli repairs a shadowed package
from nxhpc.cli.codes import Exit, UsageError, codes_epilog
from nxhpc.cli.frame import run_cli, signal_exit
from nxhpc.cli.report import save_bytes
from nxhpc.runtime.outfile import OutputPathError, check_cli_output_path
from nxhpc.runtime.proc import Terminated
from nxhpc.runtime.ranks import mpi_launched
from nxhpc.runtime.workers import max_workers, usable_cpus
from nxhpc.train import ddp as train

__all__ = ["main", "build_parser", "EXIT_CODES"]

PROG = "ddp"

#: The codes this CLI returns, in its words (the numbers are nxhpc.cli.codes.Exit's).
EXIT_CODES = {
    Exit.PASS: "ok (and, with --sweep, every worker count gave the full-batch bytes)",
    Exit.FAIL: "a --sweep worker count gave other bytes than the full batch, or the Q16 tape "
               "overflowed",
    Exit.USAGE: "bad arguments (including an unwritable --json path, more workers than data "
                "rows or than the worker cap, a missing scikit-learn / mpi4py)",
    Exit.BAD_INPUT: "the MPI ranks (--backend mpi) disagree on --steps, --hidden, --lr or "
                    "--seed",
    Exit.WORKER: "a worker (or MPI rank) died, raised or hung (--timeout)",
    Exit.SHM: "not enough shared memory or memory for the segment (in a container use --shm-size)",
    Exit.OUTPUT: "the --json report could not be written (the printed results stand)",
    Exit.INTERNAL: None,
    Exit.SIGHUP: None,
    Exit.SIGINT: None,
    Exit.SIGTERM: None,
}


def _worker_counts(a: argparse.Namespace) -> list[tuple[str, list[int]]]:
    """Each option's worker counts the run would use: ``--workers``, ``--sweep``, and
    ``--contrast`` unless skipped (``--no-contrast``) or not run (MPI)."""
    contrast = [] if a.no_contrast or a.backend == "mpi" else (a.contrast or [])
    return [("--workers", [a.workers] if a.workers else []), ("--sweep", a.sweep or []),
            ("--contrast", contrast)]


def _writes_report(a: argparse.Namespace) -> bool:
    """Whether this process writes ``--json``: under ``--backend mpi`` rank 0 alone (another
    rank's disk need not hold its folder)."""
    if a.backend != "mpi":
        return True
    from nxhpc.runtime import ranks
    w = ranks.world()
    return w is None or w.rank == 0


class _Parser(types.Parser):
    """argparse plus the rules between options (usage errors, exit 2, before any training)."""

    def parse_args(self, args=None, namespace=None):
        a = super().parse_args(args, namespace)
        if not 1 <= a.steps <= train.MAX_STEPS:      # a huge count was an "out of memory"
            self.error(f"--steps must be in [1, {train.MAX_STEPS}], got {a.steps}")
        if a.workers is not None and a.workers < 1:
            self.error(f"--workers must be >= 1, got {a.workers}")
        for opt, ds in (("--sweep", a.sweep), ("--contrast", a.contrast)):
            if ds and len(set(ds)) != len(ds):
                self.error(f"{opt} lists a worker count twice: {','.join(map(str, ds))}")
        if a.backend == "shm" and mpi_launched():
            self.error("started as one of several MPI ranks (mpirun -n N): give --backend mpi; "
                       "with shm every rank would run the whole training on its own")
        if a.backend == "shm":   # forked processes: the pools' one cap (MPI: mpirun's world)
            top = max_workers()
            for opt, ds in _worker_counts(a):
                too_many = [d for d in ds if d > top]
                if too_many:
                    self.error(f"{opt}: {too_many} exceeds {top}, the most worker processes a "
                               f"run forks here (8x the {usable_cpus()} usable CPUs, at least 64)")
        if a.log_every < 1:
            self.error(f"--log-every must be >= 1, got {a.log_every}")
        if not a.timeout > 0:
            self.error(f"--timeout must be > 0 seconds, got {a.timeout}")
        if a.json is not None and _writes_report(a):   # up front, not after the whole run
            try:                                            # ("" too)
                check_cli_output_path(a.json, what="--json")
            except OutputPathError as e:
                self.error(str(e))
        try:
            cfg = train.MLPConfig(hidden=a.hidden, lr=a.lr, seed=a.seed)
            cfg.lr_q16
        except ValueError as e:
            self.error(str(e))
        a.cfg = cfg
        return a


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(
        prog="python -m nxhpc.ddp",
        description="Bit-reproducible data-parallel training of a 2-layer relu MLP on sklearn's "
                    "diabetes data with the exact-integer Q16.16 tape. Prints the per-step loss "
                    "and the SHA-256 of the final weights (identical for every worker count and "
                    "backend), then the float32 data-parallel contrast.",
        epilog=codes_epilog(EXIT_CODES),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=None,
                    help="number of data-parallel workers D (shm: forked processes, default 4; at "
                         "most the 442 data rows and the worker cap, 8x the usable CPUs or 64, "
                         "whichever is larger; mpi: must equal the MPI world size if given)")
    ap.add_argument("--steps", type=int, default=300,
                    help=f"SGD steps (default 300, at most {train.MAX_STEPS})")
    ap.add_argument("--backend", choices=["shm", "mpi"], default="shm",
                    help="shm: forked workers over shared memory; mpi: run under mpirun")
    ap.add_argument("--hidden", type=int, default=16,
                    help=f"hidden width (default 16, at most {train.MAX_HIDDEN})")
    ap.add_argument("--lr", type=float, default=0.05, help="learning rate on the mean loss, in (0, 1e6) (default 0.05)")
    ap.add_argument("--seed", type=int, default=0, help="init seed (default 0)")
    ap.add_argument("--log-every", type=int, default=1, help="print the loss every N steps (default 1)")
    con = ap.add_mutually_exclusive_group()       # the counts of a contrast, or none at all
    con.add_argument("--contrast", type=types.int_list, default=[1, 2, 3, 4, 5, 8],
                     metavar="D,D,...",
                     help="worker counts for the float32 contrast (default 1,2,3,4,5,8; shm only; "
                          "each within --workers' limits)")
    con.add_argument("--no-contrast", action="store_true", help="skip the float32 contrast")
    ap.add_argument("--sweep", type=types.int_list, default=None, metavar="D,D,...",
                    help="also train the Q16 model with each of these worker counts (shm; each "
                         "within --workers' limits) and print a hash table, checked against the "
                         "single-process full batch")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds without progress (no step's "
                    "gradient or all-reduce finished by the slowest worker) before a shm run is "
                    "declared hung (default 600; inf: no limit)")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON here")
    return ap


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit code (:data:`EXIT_CODES`). No traceback for any of
    them."""
    from nxhpc.runtime import ranks
    world = None
    if ranks.mpi_launched():             # under mpirun: bad arguments printed once, not a rank
        with contextlib.suppress(ImportError):   # `--backend mpi` names what to install
            world = ranks.init_world()
    return run_cli(PROG, build_parser(), argv, _run, describe=lambda e, code: str(e),
                   parse_ranks=world)


def _print_run(res, head: str, every: int, out, report: dict) -> None:
    """Print one Q16 run (header, loss every `every` steps and the last, endpoints, SHA-256)
    and record it in `report`."""
    print(f"{head}; backend={res.backend}, workers={res.workers}", file=out)
    n = len(res.losses)
    for i, v in enumerate(res.losses):
        if every <= 1 or i % every == 0 or i == n - 1:
            print(f"step {i + 1:5d}  loss {v:.6f}", file=out)
    print(f"loss {res.losses[0]:.6f} -> {res.losses[-1]:.6f}", file=out)
    print(f"weights sha256 {res.sha256}  (q16, backend={res.backend}, workers={res.workers}, "
          f"{res.seconds:.2f}s)", file=out)
    report.update(backend=res.backend, workers=res.workers, sha256=res.sha256,
                  losses=res.losses.tolist())


def _write_json(path: str | None, report: dict) -> int:
    """Write the report atomically (the path was checked up front): 0, or 8 with one line."""
    if not path:
        return Exit.PASS
    err = save_bytes(path, lambda f: f.write(json.dumps(report, indent=1).encode()), "--json",
                     "the report")
    if err:
        print(f"{PROG}: error: {err}", file=sys.stderr, flush=True)
        return Exit.OUTPUT
    return Exit.PASS
def _run_shm(args, workers: int, cfg, data, head: str, out,
             report: dict) -> int:
    """The shm backend's runs (main, --sweep, float32 contrast), printed and recorded."""
    res = train.train_shm(workers, args.steps, cfg=cfg, data=data, timeout=args.timeout)
    _print_run(res, head, args.log_every, out, report)
    rc = Exit.PASS

    if args.sweep:
        ref = train.train_full_batch(args.steps, cfg=cfg, data=data)
        print(f"\nQ16 sweep ({args.steps} steps): single-process full batch sha256 {ref.sha256}",
              file=out)
        sweep = {}
        for d in args.sweep:
            r = res if d == workers else train.train_shm(d, args.steps, cfg=cfg, data=data,
                                                   timeout=args.timeout)
            same = r.sha256 == ref.sha256
            rc = rc if same else Exit.FAIL
            sweep[d] = r.sha256
            print(f"  D={d}: sha256 {r.sha256}  {'== full batch' if same else 'DIFFERS'}  "
                  f"({r.seconds:.2f}s)", file=out)
        report["sweep"] = {"full_batch": ref.sha256, **{str(k): v for k, v in sweep.items()}}

    if not args.no_contrast:
        print(f"\nfloat32 contrast: the same model, data, init and ring in numpy float32 "
              f"({args.steps} steps)", file=out)
        fres = {d: train.train_shm(d, args.steps, arith="float32", cfg=cfg, data=data,
                             timeout=args.timeout) for d in args.contrast}
        base_d = args.contrast[0]
        base = fres[base_d].params.astype(np.float64)
        contrast = {}
        for d, r in fres.items():
            diff = float(np.max(np.abs(r.params.astype(np.float64) - base)))
            contrast[d] = {"sha256": r.sha256, "max_abs_diff": diff,
                           "final_loss": float(r.losses[-1])}
            print(f"  D={d}: sha256 {r.sha256[:16]}..  max|W_D - W_{base_d}| = {diff:.3e}  "
                  f"final loss {r.losses[-1]:.6f}", file=out)
        distinct = len({r.sha256 for r in fres.values()})
        print(f"  float32: {distinct} distinct weight vectors over D in {args.contrast}; "
              f"max difference {max(c['max_abs_diff'] for c in contrast.values()):.3e}", file=out)
        report["float32_contrast"] = {str(k): v for k, v in contrast.items()}
    return rc


def _setup(args: argparse.Namespace) -> tuple:
    """The data (UsageError where scikit-learn is missing or a worker count exceeds its
    rows), the run's header line and the report's first fields."""
    cfg = args.cfg
    try:
        data = train.load_diabetes()
    except ImportError as e:
        if str(e) != train.SKLEARN_TEXT:   # installed but not loadable (a library the
            raise                          # address-space limit left no room to map: exit 7)
        raise UsageError(str(e)) from None
    n_rows = data.x.shape[0]
    for opt, ds in _worker_counts(args):
        too_many = [d for d in ds if d > n_rows]
        if too_many:   # a shard would be empty
            raise UsageError(f"{opt}: {too_many} exceeds the {n_rows} data rows (at most one "
                             f"worker per row)")
    head = (f"Q16.16 MLP {data.x.shape[1]}-{cfg.hidden}-1 (relu), SSE loss, SGD lr={cfg.lr} "
            f"(Q16 {cfg.lr_q16}/65536, mean over {data.x.shape[0]} rows), diabetes data "
            f"{data.x.shape[0]}x{data.x.shape[1]} standardized")
    report: dict = {"steps": args.steps, "hidden": cfg.hidden, "lr": cfg.lr, "seed": cfg.seed}
    return data, head, report


def _run_mpi(args: argparse.Namespace) -> int:
    """``--backend mpi``: this rank's part of the ring. The checks every rank makes alike come
    first (each rank returns the code; rank 0 prints). From the data load on, a rank that
    fails or is interrupted aborts the job (``comm.Abort``): its peers would wait in the ring
    forever, and it in ``MPI_Finalize`` for them."""
    try:
        from mpi4py import MPI
    except ImportError:
        raise UsageError("--backend mpi needs mpi4py (pip install mpi4py) and an MPI "
                         "runtime") from None
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    if args.sweep:
        raise UsageError("--sweep runs worker counts in this process (shm); under MPI the "
                         "world size is the one count: run mpirun -n D once per D")
    if args.workers is not None and args.workers != comm.Get_size():
        if rank == 0:
            print(f"{PROG}: error: --workers {args.workers} but the MPI world has "
                  f"{comm.Get_size()} ranks (start with mpirun -n D)", file=sys.stderr)
        return Exit.USAGE
    from nxhpc.runtime import ranks as _ranks
    world = _ranks.world()
    if world is not None:            # what the ring computes: every rank the same, or exit 4
        try:                         # (other --steps hung the ring; --hidden truncated it)
            world.same_args(types.option_values(args, ("steps", "hidden", "lr", "seed")))
        except _ranks.RankMismatchError as e:
            if rank == 0:
                print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
            return Exit.BAD_INPUT
    import importlib.util
    if importlib.util.find_spec("sklearn") is None:   # every rank alike: no abort, one code
        raise UsageError(train.SKLEARN_TEXT)
    try:
        data, head, report = _setup(args)
        res = train.train_mpi(comm, args.steps, cfg=args.cfg, data=data)
    except (KeyboardInterrupt, Terminated) as e:   # peers block in Sendrecv: abort the job
        code, what = signal_exit(e)
        print(f"{PROG}: error: MPI rank {rank} {what}", file=sys.stderr, flush=True)
        comm.Abort(int(code))
        return code
    except Exception as e:  # noqa: BLE001 - peers block in Sendrecv: abort the whole job
        print(f"{PROG}: error: MPI rank {rank} of {comm.Get_size()} failed: "
              f"{str(e) if isinstance(e, UsageError) else f'{type(e).__name__}: {e}'}",
              file=sys.stderr, flush=True)
        code = Exit.FAIL if isinstance(e, train.Q16OverflowError) else \
            Exit.USAGE if isinstance(e, UsageError) else Exit.WORKER
        comm.Abort(int(code))        # an overflow is the run's arithmetic (1), as in shm
        return code
    if rank != 0:
        return Exit.PASS
    _print_run(res, head, args.log_every, sys.stdout, report)
    return _write_json(args.json, report)


def _run(args: argparse.Namespace) -> int:
    if args.backend == "mpi":
        return _run_mpi(args)
    data, head, report = _setup(args)
    workers = 4 if args.workers is None else args.workers
    import multiprocessing
    if multiprocessing.current_process().daemon:
        raise UsageError(train.DAEMON_TEXT)
    rc = _run_shm(args, workers, args.cfg, data, head, sys.stdout, report)   # nxhpc.cli.codes
    return _write_json(args.json, report) or rc


if __name__ == "__main__":
    sys.exit(main())
