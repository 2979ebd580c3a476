"""Bit-reproducible data-parallel training on the Q16 tape: forked workers over shared memory, or MPI.

Owns the workload (a 2-layer relu MLP regressing sklearn's bundled diabetes data), the per-shard
gradient on the exact-integer tape (:mod:`nxhpc.train.q16`), the data-parallel driver (D forked workers,
shards and gradients in one shared-memory segment, ring all-reduce from :mod:`nxhpc.train.ring`, SGD on
every replica), the MPI driver, the float32 contrast and the CLI::

    python -m nxhpc.ddp --workers 4 --steps 300 [--backend shm|mpi]
    mpirun -n 4 python -m nxhpc.ddp --backend mpi --steps 300

Why the bits cannot depend on D: every rounding in the tape touches one data row only, batch
reductions are exact integer sums, and the all-reduce adds integers exactly -- so the summed
gradient, hence every update, is the same integer vector for any split of the rows. The float32
path runs the same model through the same ring and does depend on D (the contrast).
It must not touch the inference kernels; it spawns no threads (BLAS is limited to 1 thread in
workers) and leaves no shared-memory segment behind, whatever happens. The segment is the
runtime's arena (via :class:`nxhpc.train.ring.ShmSegment`); die-with-parent (whichever thread
started the run) and the words for a worker's exit come from :mod:`nxhpc.runtime.proc`.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import wait as mp_wait

import numpy as np

from nxhpc.runtime import proc
from nxhpc.runtime.outfile import OutputPathError, check_output_path, write_atomic
from nxhpc.runtime.shm import ShmSpaceError
from nxhpc.train import q16
from nxhpc.train.q16 import Tape, from_q16, q16_add, sgd_step, to_q16
from nxhpc.train.ring import ShmSegment, ring_allreduce_mpi, ring_allreduce_shm

__all__ = [
    "MLPConfig", "Dataset", "TrainResult", "DDPWorkerError", "DDPTimeoutError", "SHM_PREFIX",
    "load_diabetes", "init_params", "param_layout", "q16_shard_grad", "f32_shard_grad",
    "train_full_batch", "train_shm", "train_mpi", "weights_sha256", "main",
]

SHM_PREFIX = "nxddp_"


class DDPWorkerError(RuntimeError):
    """A worker died or raised; ``rank`` names it (the first primary failure)."""

    def __init__(self, rank: int, message: str) -> None:
        self.rank = rank
        super().__init__(message)


class DDPTimeoutError(TimeoutError):
    """The run exceeded its deadline; the message names the workers still running."""


# ----------------------------------------------------------------------------------------------
# workload
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MLPConfig:
    """``y = relu(x @ W1 + b1) @ W2 + b2``; loss = SSE; SGD on the mean gradient (lr / rows)."""

    hidden: int = 16
    lr: float = 0.05
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.hidden, bool) or not isinstance(self.hidden, (int, np.integer)) \
                or self.hidden < 1:
            raise ValueError(f"MLPConfig: hidden must be an integer >= 1, got {self.hidden!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)) \
                or self.seed < 0:
            raise ValueError(f"MLPConfig: seed must be a non-negative integer (numpy's "
                             f"default_rng), got {self.seed!r}")
        if not (0.0 < self.lr < 1e6) or not np.isfinite(self.lr):
            raise ValueError(f"MLPConfig: lr must be a positive finite number, got {self.lr}")

    @property
    def lr_q16(self) -> int:
        """The learning rate as a Q16 integer (rounded half to even, like every conversion)."""
        v = int(to_q16(self.lr, "lr"))
        if v <= 0:
            raise ValueError(f"MLPConfig: lr {self.lr} rounds to 0 in Q16 (resolution 2**-16)")
        return v


@dataclass(frozen=True)
class Dataset:
    """Standardized features ``x [n, f]`` and target ``y [n, 1]`` as float64 and as Q16."""

    x: np.ndarray
    y: np.ndarray
    name: str

    @property
    def xq(self) -> np.ndarray:
        return to_q16(self.x, f"{self.name}.x")

    @property
    def yq(self) -> np.ndarray:
        return to_q16(self.y, f"{self.name}.y")


def load_diabetes() -> Dataset:
    """sklearn's bundled diabetes data (442 x 10, no download), each column and y standardized."""
    try:
        from sklearn.datasets import load_diabetes as _load
    except ImportError as e:  # an optional dependency: say how to get it
        raise ImportError("the diabetes data set comes with scikit-learn: "
                          "pip install 'nxhpc[train]' (or scikit-learn)") from e
    x, y = _load(return_X_y=True)
    x = (x - x.mean(axis=0)) / x.std(axis=0)
    y = (y - y.mean()) / y.std()
    return Dataset(np.ascontiguousarray(x), np.ascontiguousarray(y[:, None]), "diabetes")


def param_layout(n_in: int, hidden: int) -> list[tuple[str, tuple[int, ...]]]:
    """Order and shapes of the parameters in the flat vector (and in the SHA-256)."""
    return [("W1", (n_in, hidden)), ("b1", (hidden,)), ("W2", (hidden, 1)), ("b2", (1,))]


def _unflatten(flat: np.ndarray, layout) -> dict[str, np.ndarray]:
    out, off = {}, 0
    for name, shape in layout:
        n = int(np.prod(shape))
        out[name] = flat[off:off + n].reshape(shape)
        off += n
    if off != flat.shape[0]:
        raise ValueError(f"parameter vector has {flat.shape[0]} elements, layout needs {off}")
    return out


def init_params(n_in: int, cfg: MLPConfig) -> np.ndarray:
    """Deterministic float64 init (He-scaled normal weights, zero biases), flat in layout order."""
    rng = np.random.default_rng(cfg.seed)
    w1 = rng.standard_normal((n_in, cfg.hidden)) * np.sqrt(2.0 / n_in)
    w2 = rng.standard_normal((cfg.hidden, 1)) * np.sqrt(1.0 / cfg.hidden)
    return np.concatenate([w1.ravel(), np.zeros(cfg.hidden), w2.ravel(), np.zeros(1)])


def weights_sha256(flat: np.ndarray) -> str:
    """SHA-256 of the flat parameter vector as little-endian bytes of its dtype (int64 for Q16)."""
    a = np.ascontiguousarray(flat)
    return hashlib.sha256(a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()).hexdigest()


def q16_shard_grad(flat: np.ndarray, xq: np.ndarray, yq: np.ndarray,
                   layout) -> tuple[np.ndarray, int]:
    """(flat SSE gradient, SSE) of the MLP on rows `xq`, `yq`, all Q16 int64, via the tape."""
    p = _unflatten(flat, layout)
    t = Tape()
    x = t.leaf(xq, requires_grad=False, name="x")
    y = t.leaf(yq, requires_grad=False, name="y")
    nodes = {k: t.leaf(v, name=k) for k, v in p.items()}
    h = t.relu(t.add(t.matmul(x, nodes["W1"]), nodes["b1"]))
    pred = t.add(t.matmul(h, nodes["W2"]), nodes["b2"])
    loss = t.sse(pred, y)
    t.backward(loss)
    g = np.concatenate([t.grad(nodes[k]).ravel() for k, _ in layout])
    return g, int(loss.value)


def f32_shard_grad(flat: np.ndarray, x: np.ndarray, y: np.ndarray,
                   layout) -> tuple[np.ndarray, np.float32]:
    """(flat SSE gradient, SSE) of the same MLP in float32 numpy (the contrast path)."""
    p = _unflatten(flat, layout)
    pre = x @ p["W1"] + p["b1"]
    h = np.maximum(pre, np.float32(0))
    d = h @ p["W2"] + p["b2"] - y
    gp = np.float32(2) * d
    gh = (gp @ p["W2"].T) * (pre > 0)
    g = np.concatenate([(x.T @ gh).ravel(), gh.sum(axis=0), (h.T @ gp).ravel(), gp.sum(axis=0)])
    return g.astype(np.float32), np.float32((d * d).sum())


class _Arith:
    """The per-arithmetic pieces: data/param encoding, shard gradient, exact or float add, SGD."""

    def __init__(self, kind: str, data: Dataset, cfg: MLPConfig) -> None:
        if kind not in ("q16", "float32"):
            raise ValueError(f"arith must be 'q16' or 'float32', got {kind!r}")
        self.kind, self.cfg = kind, cfg
        self.n_rows, n_in = data.x.shape
        self.layout = param_layout(n_in, cfg.hidden)
        p0 = init_params(n_in, cfg)
        if kind == "q16":
            self.dtype = np.dtype(np.int64)
            self.x, self.y, self.p0 = data.xq, data.yq, to_q16(p0, "init_params")
            self.lr_q16 = cfg.lr_q16
        else:
            self.dtype = np.dtype(np.float32)
            self.x, self.y = data.x.astype(np.float32), data.y.astype(np.float32)
            self.p0 = p0.astype(np.float32)
        self.n_params = self.p0.shape[0]

    def grad(self, flat: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Gradient on the shard (`x`, `y` encoded like ``self.x``) with its SSE appended last."""
        if self.kind == "q16":
            g, sse = q16_shard_grad(flat, x, y, self.layout)
        else:
            g, sse = f32_shard_grad(flat, x, y, self.layout)
        return np.concatenate([g, np.array([sse], dtype=self.dtype)])

    def add(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """The all-reduce add: exact and range-checked for Q16 (a partial sum past Q16_MAX
        raises even if the full sum would fit -- an error, never different bits), float32 else."""
        if self.kind == "q16":
            return q16_add(a, b, "allreduce")
        return a + b

    def update(self, flat: np.ndarray, g: np.ndarray) -> np.ndarray:
        """One SGD step on the summed gradient `g`, applied as a mean over all rows."""
        if self.kind == "q16":
            return sgd_step(flat, g, self.lr_q16, denom=self.n_rows)
        return flat - np.float32(self.cfg.lr / self.n_rows) * g

    def mean_loss(self, sse) -> float:
        """The summed SSE as a float mean over all rows (for printing)."""
        v = float(from_q16(np.asarray(int(sse)))) if self.kind == "q16" else float(sse)
        return v / self.n_rows


@dataclass
class TrainResult:
    """Final flat weights (int64 Q16 or float32), per-step mean loss, SHA-256, how it ran."""

    params: np.ndarray
    losses: np.ndarray
    sha256: str
    workers: int
    backend: str
    arith: str
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)


def train_full_batch(steps: int, *, arith: str = "q16", cfg: MLPConfig = MLPConfig(),
                     data: Dataset | None = None) -> TrainResult:
    """Single process, whole batch per step: the ground truth the data-parallel runs must match."""
    _check_steps(steps)
    data = data or load_diabetes()
    ar = _Arith(arith, data, cfg)
    t0 = time.perf_counter()
    flat, losses = ar.p0.copy(), []
    for _ in range(steps):
        g = ar.grad(flat, ar.x, ar.y)
        losses.append(ar.mean_loss(g[-1]))
        flat = ar.update(flat, g[:-1])
    return TrainResult(flat, np.array(losses), weights_sha256(flat), 1, "single", arith,
                       time.perf_counter() - t0)


def _check_steps(steps: int) -> None:
    if not isinstance(steps, (int, np.integer)) or steps < 0:
        raise ValueError(f"steps must be a non-negative integer, got {steps!r}")


# ----------------------------------------------------------------------------------------------
# shared-memory data parallelism (forked workers)
# ----------------------------------------------------------------------------------------------

def _barrier_timeout(timeout: float) -> float | None:
    """The per-wait barrier timeout of a worker: None (wait; the parent's deadline still holds)
    for ``inf`` or anything past what a semaphore wait accepts (1e300 fails with EINVAL)."""
    return None if not timeout <= threading.TIMEOUT_MAX else timeout


def _worker_main(rank: int, workers: int, ar: _Arith, seg: ShmSegment, barrier, conn,
                 steps: int, timeout: float, fault, parent_pid: int) -> None:
    """Body of worker `rank` (runs in a forked child): its shard and the initial weights come
    from the segment, its gradient row goes back into it."""
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)      # the parent handles Ctrl-C
        signal.signal(signal.SIGTERM, signal.SIG_DFL)     # (not the CLI's handler, inherited)
        proc.die_with_parent(parent_pid, exit_code=3)     # whichever thread forked us
        timeout = _barrier_timeout(timeout)
        try:
            from threadpoolctl import threadpool_limits
            threadpool_limits(1)
        except ImportError:
            pass
        lo, hi = rank * ar.n_rows // workers, (rank + 1) * ar.n_rows // workers
        x, y = seg["x"][lo:hi], seg["y"][lo:hi]         # this worker's shard (shared, read-only)
        bufs = seg["grads"]
        flat = seg["init"].copy()
        for step in range(steps):
            seg["progress"][rank] = 2 * step           # computing its shard gradient
            if fault is not None and fault[0] == rank and fault[1] == step:
                if fault[2] == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                elif fault[2] == "hang":
                    time.sleep(3600)
                else:
                    raise RuntimeError(f"injected fault in worker {rank} at step {step}")
            bufs[rank] = ar.grad(flat, x, y)
            seg["progress"][rank] = 2 * step + 1       # in the all-reduce
            barrier.wait(timeout)                      # every row written before any read
            ring_allreduce_shm(rank, bufs, ar.add, barrier, timeout)
            total = bufs[rank].copy()
            if rank == 0:
                seg["sse"][step] = total[-1]
            flat = ar.update(flat, total[:-1])
        seg["final"][rank] = flat
        seg["progress"][rank] = 2 * steps
        conn.send(("ok", rank))
    except threading.BrokenBarrierError:
        conn.send(("broken", rank, "barrier broken (a peer failed or the parent aborted the step)"))
        os._exit(2)
    except BaseException as e:  # noqa: BLE001 - report everything to the parent, then exit
        try:
            conn.send(("error", rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        finally:
            os._exit(1)


def _describe_exit(code: int | None) -> str:
    """A worker's ``multiprocessing`` exit code in words (the runtime's helper)."""
    return "still running" if code is None else proc.describe_exit(exitcode=code, brief=True)


def _supervise(procs, conns, barrier, deadline: float, progress: np.ndarray) -> None:
    """Wait for all workers; on the first failure abort the barrier and raise naming the worker."""
    D = len(procs)
    done: set[int] = set()
    failures: list[tuple[int, bool, str]] = []      # (rank, primary?, message)
    open_conns = {i: c for i, c in enumerate(conns)}

    def note_message(i: int) -> None:
        try:
            msg = open_conns[i].recv()
        except (EOFError, OSError):
            open_conns.pop(i, None)
            return
        if msg[0] == "ok":
            done.add(i)
        else:
            failures.append((i, msg[0] != "broken", msg[2]))
        open_conns.pop(i, None)

    while len(done) < D and not failures:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            barrier.abort()
            running = [i for i in range(D) if i not in done]
            slowest = min(int(progress[i]) for i in running)
            laggards = [f"worker {i} (pid {procs[i].pid})" for i in running
                        if int(progress[i]) == slowest]
            phase = "computing the gradient of" if slowest % 2 == 0 else "in the all-reduce of"
            waiting = " (the others wait for it)" if len(laggards) < len(running) else ""
            raise DDPTimeoutError(
                f"data-parallel run timed out; {', '.join(laggards)} still {phase} step "
                f"{slowest // 2}{waiting}")
        kinds = {id(procs[i].sentinel): ("exit", i) for i in range(D) if i not in done}
        kinds.update({id(c): ("msg", i) for i, c in open_conns.items()})
        waitables = [procs[i].sentinel for i in range(D) if i not in done] + list(open_conns.values())
        for obj in mp_wait(waitables, timeout=min(remaining, 1.0)):
            kind, i = kinds[id(obj)]
            if kind == "msg":
                if i in open_conns:
                    note_message(i)
                continue
            procs[i].join()
            if i in open_conns and open_conns[i].poll():
                note_message(i)
            if i not in done and not any(f[0] == i for f in failures):
                failures.append((i, True, f"worker {i} (pid {procs[i].pid}) "
                                 f"{_describe_exit(procs[i].exitcode)} before finishing"))
    if failures:
        barrier.abort()
        # a short grace period lets a primary failure arrive if the first one seen was secondary
        grace = time.monotonic() + 2.0
        while not any(f[1] for f in failures) and time.monotonic() < grace:
            for i in list(open_conns):
                if open_conns[i].poll(0.05):
                    note_message(i)
            for i, p in enumerate(procs):
                if p.exitcode not in (None, 0, 2) and not any(f[0] == i for f in failures):
                    failures.append((i, True, f"worker {i} (pid {p.pid}) "
                                     f"{_describe_exit(p.exitcode)} before finishing"))
        primary = next((f for f in failures if f[1]), failures[0])
        rank, _, msg = primary
        if not msg.startswith(f"worker {rank}"):
            msg = f"worker {rank} (pid {procs[rank].pid}) failed: {msg}"
        raise DDPWorkerError(rank, msg)


def train_shm(workers: int, steps: int, *, arith: str = "q16", cfg: MLPConfig = MLPConfig(),
              data: Dataset | None = None, timeout: float = 300.0, shm_prefix: str = SHM_PREFIX,
              fault_injection: tuple[int, int, str] | None = None) -> TrainResult:
    """Train with `workers` forked processes; rows split ``[i*n//D, (i+1)*n//D)``.

    One shared-memory segment holds the encoded data (each worker reads its shard of rows
    from it), the initial weights, the ``[D, P+1]`` gradient rows (the
    ring all-reduce works in place on them; the last column carries each shard's SSE), the loss
    per step and every replica's final weights. All replicas must end byte-identical (checked).
    Raises DDPWorkerError naming a worker that died or raised, DDPTimeoutError after `timeout`
    seconds; the segment is unlinked in every case. `fault_injection` = (rank, step, "kill" |
    "raise" | "hang") is for tests.
    """
    if not isinstance(workers, (int, np.integer)) or workers < 1:
        raise ValueError(f"workers must be a positive integer, got {workers!r}")
    _check_steps(steps)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds (inf: no limit), "
                         f"got {timeout!r}")
    data = data or load_diabetes()
    ar = _Arith(arith, data, cfg)
    if workers > ar.n_rows:
        raise ValueError(f"workers={workers} exceeds the {ar.n_rows} data rows (a shard would be empty)")
    P = ar.n_params
    layout = {"x": (ar.x.shape, ar.x.dtype), "y": (ar.y.shape, ar.y.dtype),
              "init": ((P,), ar.dtype), "grads": ((workers, P + 1), ar.dtype),
              "sse": ((max(steps, 1),), ar.dtype), "final": ((workers, P), ar.dtype),
              "progress": ((workers,), np.int64)}
    ctx = mp.get_context("fork")
    t0 = time.perf_counter()
    proc.lifeline()                          # before any fork: workers watch it (die with us)
    with ShmSegment(layout, prefix=shm_prefix) as seg:
        seg["x"][:], seg["y"][:], seg["init"][:] = ar.x, ar.y, ar.p0
        barrier = ctx.Barrier(workers)
        procs, conns = [], []
        try:
            for r in range(workers):
                rx, tx = ctx.Pipe(duplex=False)
                p = ctx.Process(target=_worker_main, name=f"nxddp-worker-{r}", daemon=True,
                                args=(r, workers, ar, seg, barrier, tx, steps, timeout,
                                      fault_injection, os.getpid()))
                p.start()
                tx.close()
                procs.append(p)
                conns.append(rx)
            _supervise(procs, conns, barrier, time.monotonic() + timeout, seg["progress"])
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(timeout=10)
            for c in conns:
                c.close()
        final = np.array(seg["final"], copy=True)
        sse = np.array(seg["sse"][:steps], copy=True)
    seconds = time.perf_counter() - t0
    hashes = {weights_sha256(final[r]) for r in range(workers)}
    if len(hashes) != 1:
        raise RuntimeError(f"replicas diverged after {steps} steps: {len(hashes)} distinct weight "
                           "vectors across workers (the all-reduce is broken)")
    losses = np.array([ar.mean_loss(s) for s in sse])
    return TrainResult(final[0], losses, hashes.pop(), workers, "shm", arith, seconds,
                       {"shm_name": seg.name})


# ----------------------------------------------------------------------------------------------
# MPI
# ----------------------------------------------------------------------------------------------

def train_mpi(comm, steps: int, *, arith: str = "q16", cfg: MLPConfig = MLPConfig(),
              data: Dataset | None = None) -> TrainResult:
    """The same training over an mpi4py communicator: rank r of D takes rows
    ``[r*n//D, (r+1)*n//D)``; gradients summed by :func:`nxhpc.train.ring.ring_allreduce_mpi`.
    Every rank returns the result; replicas are checked identical via an allgather of hashes."""
    _check_steps(steps)
    data = data or load_diabetes()
    ar = _Arith(arith, data, cfg)
    D, rank = comm.Get_size(), comm.Get_rank()
    if D > ar.n_rows:
        raise ValueError(f"{D} MPI ranks exceed the {ar.n_rows} data rows")
    lo, hi = rank * ar.n_rows // D, (rank + 1) * ar.n_rows // D
    t0 = time.perf_counter()
    flat, losses = ar.p0.copy(), []
    for _ in range(steps):
        total = ring_allreduce_mpi(comm, ar.grad(flat, ar.x[lo:hi], ar.y[lo:hi]), ar.add)
        losses.append(ar.mean_loss(total[-1]))
        flat = ar.update(flat, total[:-1])
    sha = weights_sha256(flat)
    hashes = comm.allgather(sha)
    if len(set(hashes)) != 1:
        raise RuntimeError(f"MPI replicas diverged: hashes per rank {hashes}")
    return TrainResult(flat, np.array(losses), sha, D, "mpi", arith, time.perf_counter() - t0)


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------

def _parse_int_list(text: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",")]     # an empty item is an error, not skipped
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def _build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m nxhpc.ddp",
        description="Bit-reproducible data-parallel training of a 2-layer relu MLP on sklearn's "
                    "diabetes data with the exact-integer Q16.16 tape. Prints the per-step loss "
                    "and the SHA-256 of the final weights (identical for every worker count and "
                    "backend), then the float32 data-parallel contrast.")
    ap.add_argument("--workers", type=int, default=None,
                    help="number of data-parallel workers D (shm: forked processes, default 4; "
                         "mpi: must equal the MPI world size if given)")
    ap.add_argument("--steps", type=int, default=300, help="SGD steps (default 300)")
    ap.add_argument("--backend", choices=["shm", "mpi"], default="shm",
                    help="shm: forked workers over shared memory; mpi: run under mpirun")
    ap.add_argument("--hidden", type=int, default=16, help="hidden width (default 16)")
    ap.add_argument("--lr", type=float, default=0.05, help="learning rate on the mean loss (default 0.05)")
    ap.add_argument("--seed", type=int, default=0, help="init seed (default 0)")
    ap.add_argument("--log-every", type=int, default=1, help="print the loss every N steps (default 1)")
    ap.add_argument("--contrast", type=_parse_int_list, default=[1, 2, 3, 4, 5, 8], metavar="D,D,...",
                    help="worker counts for the float32 contrast (default 1,2,3,4,5,8; shm only)")
    ap.add_argument("--no-contrast", action="store_true", help="skip the float32 contrast")
    ap.add_argument("--sweep", type=_parse_int_list, default=None, metavar="D,D,...",
                    help="also train the Q16 model with each of these worker counts (shm) and "
                         "print a hash table, checked against the single-process full batch")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds before a shm run is "
                    "declared hung (default 600; inf: no limit)")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON here")
    return ap


def _print_run(res: TrainResult, head: str, every: int, out, report: dict) -> None:
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


def _write_json(path: str | None, report: dict) -> str | None:
    """Write the report atomically (the path was checked up front); the error text, or None."""
    if not path:
        return None
    try:
        write_atomic(path, lambda f: f.write(json.dumps(report, indent=1).encode()))
    except OSError as e:
        return f"--json {path}: could not write the report: {e.strerror or e}"
    return None


class _Terminated(BaseException):
    """Raised from the CLI's SIGTERM handler so that every cleanup (finally/with) runs."""


def _on_sigterm(signum, frame):
    raise _Terminated()


#: The CLI's exit codes.
EXIT_CODES = {0: "ok (and, with --sweep, every worker count gave the full-batch bytes)",
              1: "failure: a worker died, raised or hung, Q16 overflow, not enough shared "
                 "memory, a --sweep mismatch, or the --json report could not be written",
              2: "bad arguments (including an unwritable --json path)",
              130: "interrupted by Ctrl-C / SIGINT (workers stopped, shared memory released)",
              143: "terminated by SIGTERM (workers stopped, shared memory released)"}


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit code (:data:`EXIT_CODES`: 0 ok, 1 failure, 2 bad
    arguments, 130 SIGINT, 143 SIGTERM). No traceback for any of them."""
    old_term = signal.signal(signal.SIGTERM, _on_sigterm) \
        if threading.current_thread() is threading.main_thread() else None
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("error: interrupted (SIGINT); workers stopped, shared memory released",
              file=sys.stderr, flush=True)
        return 130
    except _Terminated:
        print("error: terminated (SIGTERM); workers stopped, shared memory released",
              file=sys.stderr, flush=True)
        return 143
    finally:
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)


def _run_shm(args, workers: int, cfg: MLPConfig, data: Dataset, head: str, out,
             report: dict) -> int:
    """The shm backend's runs (main, --sweep, float32 contrast), printed and recorded."""
    res = train_shm(workers, args.steps, cfg=cfg, data=data, timeout=args.timeout)
    _print_run(res, head, args.log_every, out, report)
    rc = 0

    if args.sweep:
        ref = train_full_batch(args.steps, cfg=cfg, data=data)
        print(f"\nQ16 sweep ({args.steps} steps): single-process full batch sha256 {ref.sha256}",
              file=out)
        sweep = {}
        for d in args.sweep:
            r = res if d == workers else train_shm(d, args.steps, cfg=cfg, data=data,
                                                   timeout=args.timeout)
            same = r.sha256 == ref.sha256
            rc = rc if same else 1
            sweep[d] = r.sha256
            print(f"  D={d}: sha256 {r.sha256}  {'== full batch' if same else 'DIFFERS'}  "
                  f"({r.seconds:.2f}s)", file=out)
        report["sweep"] = {"full_batch": ref.sha256, **{str(k): v for k, v in sweep.items()}}

    if not args.no_contrast:
        print(f"\nfloat32 contrast: the same model, data, init and ring in numpy float32 "
              f"({args.steps} steps)", file=out)
        fres = {d: train_shm(d, args.steps, arith="float32", cfg=cfg, data=data,
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


def _main(argv: list[str] | None) -> int:
    ap = _build_parser()
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error(f"--steps must be >= 1, got {args.steps}")
    if args.workers is not None and args.workers < 1:
        ap.error(f"--workers must be >= 1, got {args.workers}")
    if args.log_every < 1:
        ap.error(f"--log-every must be >= 1, got {args.log_every}")
    if not args.timeout > 0:
        ap.error(f"--timeout must be > 0 seconds, got {args.timeout}")
    if args.json:                                  # up front: not after the whole run
        try:
            check_output_path(args.json, what="--json")
        except OutputPathError as e:
            ap.error(str(e))
    try:
        cfg = MLPConfig(hidden=args.hidden, lr=args.lr, seed=args.seed)
        cfg.lr_q16
    except ValueError as e:
        ap.error(str(e))
    out = sys.stdout
    try:
        data = load_diabetes()
    except ImportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    n_rows = data.x.shape[0]
    for opt, ds in (("--workers", [args.workers] if args.workers else []),
                    ("--sweep", args.sweep or []), ("--contrast", args.contrast or [])):
        too_many = [d for d in ds if d > n_rows]
        if too_many:   # a shard would be empty
            ap.error(f"{opt}: {too_many} exceeds the {n_rows} data rows (at most one worker per row)")
    head = (f"Q16.16 MLP {data.x.shape[1]}-{cfg.hidden}-1 (relu), SSE loss, SGD lr={cfg.lr} "
            f"(Q16 {cfg.lr_q16}/65536, mean over {data.x.shape[0]} rows), diabetes data "
            f"{data.x.shape[0]}x{data.x.shape[1]} standardized")
    report: dict = {"steps": args.steps, "hidden": cfg.hidden, "lr": cfg.lr, "seed": cfg.seed}

    if args.backend == "mpi":
        try:
            from mpi4py import MPI
        except ImportError:
            print("error: --backend mpi needs mpi4py (pip install mpi4py) and an MPI runtime",
                  file=sys.stderr)
            return 2
        comm = MPI.COMM_WORLD
        rank = comm.Get_rank()
        if args.workers is not None and args.workers != comm.Get_size():
            if rank == 0:
                print(f"error: --workers {args.workers} but the MPI world has {comm.Get_size()} "
                      "ranks (start with mpirun -n D)", file=sys.stderr)
            return 2
        try:
            res = train_mpi(comm, args.steps, cfg=cfg, data=data)
        except KeyboardInterrupt:       # peers block in Sendrecv: abort the whole job
            print(f"error: MPI rank {rank} interrupted (SIGINT)", file=sys.stderr, flush=True)
            comm.Abort(130)
            return 130
        except Exception as e:  # noqa: BLE001 - peers block in Sendrecv: abort the whole job
            print(f"error: MPI rank {rank} of {comm.Get_size()} failed: {type(e).__name__}: {e}",
                  file=sys.stderr, flush=True)
            comm.Abort(1)
            return 1
        if rank != 0:
            return 0
        _print_run(res, head, args.log_every, out, report)
        err = _write_json(args.json, report)
        if err:
            print(f"error: {err}", file=sys.stderr)
            return 1
        return 0

    workers = 4 if args.workers is None else args.workers
    try:
        rc = _run_shm(args, workers, cfg, data, head, out, report)
    except (DDPWorkerError, DDPTimeoutError, q16.Q16OverflowError, ShmSpaceError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    err = _write_json(args.json, report)
    if err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
