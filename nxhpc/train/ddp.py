"""Bit-reproducible data-parallel training on the Q16 tape: forked workers over shared memory, or MPI.

Owns the workload (a 2-layer relu MLP regressing sklearn's bundled diabetes data), the per-shard
gradient on the exact-integer tape (:mod:`nxhpc.train.q16`), the data-parallel driver (D forked workers,
shards and gradients in one shared-memory segment, ring all-reduce from :mod:`nxhpc.train.ring`, SGD on
every replica), the MPI driver and the float32 contrast. Its CLI is :mod:`nxhpc.ddp`::

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

import hashlib
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import wait as mp_wait

import numpy as np

from nxhpc.runtime import proc
from nxhpc.runtime.workers import stop_signal
from nxhpc.train.q16 import Q16_MAX, Q16OverflowError, Tape, from_q16, q16_add, sgd_step, to_q16
from nxhpc.train.ring import ShmSegment, ring_allreduce_mpi, ring_allreduce_shm

__all__ = [
    "MLPConfig", "Dataset", "TrainResult", "DDPWorkerError", "DDPOverflowError", "DDPTimeoutError",
    "DAEMON_TEXT", "SKLEARN_TEXT",
    "SHM_PREFIX",
    "load_diabetes", "init_params", "param_layout", "q16_shard_grad", "f32_shard_grad",
    "train_full_batch", "train_shm", "train_mpi", "weights_sha256",
]

SHM_PREFIX = "nxddp_"
MAX_HIDDEN = 65536        # the widest hidden layer: ~0.25 GB per rows x hidden int64 array
MAX_STEPS = 10_000_000     # the most SGD steps: the losses, 8 bytes a step, live in the segment


class DDPWorkerError(RuntimeError):
    """A worker died or raised; ``rank`` names it (the first primary failure)."""

    def __init__(self, rank: int, message: str) -> None:
        self.rank = rank
        super().__init__(message)


class DDPOverflowError(DDPWorkerError, Q16OverflowError):
    """A worker's Q16 tape overflowed: the run's arithmetic, not a crash. A DDPWorkerError
    naming the worker (its message carries the worker's Q16OverflowError) that is also a
    Q16OverflowError, so the CLI reports it as one (exit 1, not a worker failure)."""

    def __init__(self, rank: int, message: str, op: str | None = None,
                 magnitude: int = 0) -> None:
        DDPWorkerError.__init__(self, rank, message)
        # the worker's own op and magnitude (0 and "worker N" when not known)
        self.op, self.magnitude, self.limit = op or f"worker {rank}", int(magnitude), Q16_MAX


#: Why the shm backend cannot run in a daemonic process (multiprocessing refuses it children).
SKLEARN_TEXT = ("the diabetes data set comes with scikit-learn: pip install 'nxhpc[train]' "
                "(or scikit-learn)")
DAEMON_TEXT = ("the shm backend forks its workers, and this is a daemonic process (e.g. a "
               "multiprocessing.Pool worker), which multiprocessing allows no children: run it "
               "from a non-daemonic process (a multiprocessing.Process, or the main one)")


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
                or not 1 <= self.hidden <= MAX_HIDDEN:
            raise ValueError(f"MLPConfig: hidden must be an integer in [1, {MAX_HIDDEN}] (the "
                             f"tape holds rows x hidden int64 values several times: 1e8 took "
                             f"the machine's memory), got {self.hidden!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)) \
                or self.seed < 0:
            raise ValueError(f"MLPConfig: seed must be a non-negative integer (numpy's "
                             f"default_rng), got {self.seed!r}")
        if isinstance(self.lr, bool) or not isinstance(self.lr, (int, float, np.integer,
                                                                  np.floating)):
            raise TypeError(f"MLPConfig: lr must be a number, got {self.lr!r} "
                            f"({type(self.lr).__name__})")
        if not (0.0 < self.lr < 1e6) or not np.isfinite(self.lr):
            raise ValueError(f"MLPConfig: lr must be a positive number below 1e6 (a Q16 "
                             f"integer), got {self.lr}")

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

    def __post_init__(self) -> None:
        """Shapes checked here, in the caller (they surfaced as a worker's traceback, or a
        ZeroDivisionError for a feature-less x)."""
        x, y = self.x, self.y
        for what, a in (("x", x), ("y", y)):
            if not isinstance(a, np.ndarray) or a.dtype.kind not in "iuf":
                raise TypeError(f"Dataset {self.name!r}: {what} must be a numeric numpy array, "
                                f"got {type(a).__name__}"
                                + (f" of {a.dtype}" if isinstance(a, np.ndarray) else ""))
        if x.ndim != 2 or x.shape[1] < 1:            # no rows: the trainers say so
            raise ValueError(f"Dataset {self.name!r}: x must be [rows, features] with at "
                             f"least one feature, got shape {list(x.shape)}")
        if y.shape != (x.shape[0], 1):
            raise ValueError(f"Dataset {self.name!r}: y must be [rows, 1] = [{x.shape[0]}, 1] "
                             f"(one target per row of x), got shape {list(y.shape)}")

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
    except ImportError as e:  # an optional dependency: say how to get it, if it is missing
        import importlib.util
        if importlib.util.find_spec("sklearn") is not None:
            raise             # installed, but it could not load (a library the address-space
            #                   limit left no room to map: the CLIs' exit 7 names the limit)
        raise ImportError(SKLEARN_TEXT) from e
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
        if self.n_rows < 1:                  # the mean loss divides by it
            raise ValueError(f"the data set {data.name!r} has no rows")
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
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 0:
        raise ValueError(f"steps must be a non-negative integer, got {steps!r}")


# ----------------------------------------------------------------------------------------------
# shared-memory data parallelism (forked workers)
# ----------------------------------------------------------------------------------------------

def _barrier_timeout(timeout: float) -> float | None:
    """The per-wait barrier timeout of a worker for the run's ``timeout``: ``2 * timeout + 1``
    s, so that the parent, which declares a hang ``timeout`` s after it saw the last progress
    (it looks at least once a second), names the hung worker before a waiting peer's barrier
    breaks (that peer's "barrier broken" would be the report instead); a backstop only. None
    (wait; the parent's deadline still holds) for ``inf`` or anything past what a semaphore
    wait accepts (1e300 fails with EINVAL)."""
    t = 2 * timeout + 1.0
    return None if not t <= threading.TIMEOUT_MAX else t


def _worker_main(rank: int, workers: int, ar: _Arith, seg: ShmSegment, barrier, conn,
                 steps: int, timeout: float, fault, parent_pid: int) -> None:
    """Body of worker `rank` (runs in a forked child): its shard and the initial weights come
    from the segment, its gradient row goes back into it."""
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)      # the parent handles Ctrl-C
        signal.signal(signal.SIGTERM, signal.SIG_DFL)     # (not the CLI's handler, inherited)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)      # a hang-up is the parent's too
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
                elif fault[2] == "kill-in-barrier":  # dies holding the barrier's lock
                    barrier._cond.acquire()
                    os.kill(os.getpid(), signal.SIGKILL)
                elif fault[2] == "hang":
                    time.sleep(3600)
                elif fault[2] == "stop":
                    os.kill(os.getpid(), signal.SIGSTOP)
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
            if isinstance(e, Q16OverflowError):     # the run's arithmetic: one line
                conn.send(("overflow", rank, f"{type(e).__name__}: {e}", e.op, e.magnitude))
            else:                                    # unexpected: with its traceback
                conn.send(("error", rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        finally:
            os._exit(1)


def _describe_exit(code: int | None) -> str:
    """A worker's ``multiprocessing`` exit code in words (the runtime's helper)."""
    return "still running" if code is None else proc.describe_exit(exitcode=code, brief=True)


def _abort_barrier(barrier, wait: float = 1.0) -> bool:
    """``barrier.abort()``, given at most ``wait`` seconds. A worker killed inside
    ``barrier.wait()`` can die holding the barrier's lock; ``abort()`` would then wait for that
    lock forever (and so would every other worker). So it runs in a daemon thread; False if it
    did not get the lock in time (the workers are then stuck too: the caller kills them)."""
    t = threading.Thread(target=barrier.abort, name="nxddp-abort", daemon=True)
    t.start()
    t.join(wait)
    return not t.is_alive()


def _supervise(procs, conns, barrier, timeout: float, progress: np.ndarray) -> None:
    """Wait for all workers; on the first failure abort the barrier and raise naming the worker.
    ``timeout``: seconds without progress -- the slowest worker finishing no phase (a step's
    gradient or its all-reduce) -- before the run is declared hung; a slow healthy run is not
    (the deadline was once the whole run's)."""
    D = len(procs)
    done: set[int] = set()
    failures: list[tuple[int, bool, str]] = []      # (rank, primary?, message)
    overflowed: dict[int, tuple] = {}                # rank -> (op, magnitude) of its overflow
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
            if msg[0] == "overflow":
                overflowed[i] = tuple(msg[3:5])
        open_conns.pop(i, None)

    seen, deadline = -1, time.monotonic() + timeout
    while len(done) < D and not failures:
        now = time.monotonic()
        low = min((int(progress[i]) for i in range(D) if i not in done), default=seen)
        if low > seen:                              # the slowest worker moved: a new deadline
            seen, deadline = low, now + timeout
        remaining = deadline - now
        if remaining <= 0:
            _abort_barrier(barrier)
            running = [i for i in range(D) if i not in done]
            stopped = {i: s for i in running
                       if (s := stop_signal(procs[i].pid)) is not None}
            if stopped:   # a stopped worker may hold the barrier: the counters blame a peer
                names = ", ".join(f"worker {i} (pid {procs[i].pid}) is stopped by "
                                  f"{proc.signal_name(s)}" for i, s in stopped.items())
                raise DDPTimeoutError(
                    f"data-parallel run timed out: no progress for {timeout:g} s (the "
                    f"timeout); {names} (the others wait for it)")
            slowest = min(int(progress[i]) for i in running)
            laggards = [f"worker {i} (pid {procs[i].pid})" for i in running
                        if int(progress[i]) == slowest]
            phase = "computing the gradient of" if slowest % 2 == 0 else "in the all-reduce of"
            waiting = " (the others wait for it)" if len(laggards) < len(running) else ""
            raise DDPTimeoutError(
                f"data-parallel run timed out: no progress for {timeout:g} s (the timeout); "
                f"{', '.join(laggards)} still {phase} step {slowest // 2}{waiting}")
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
        _abort_barrier(barrier)
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
        if rank in overflowed:
            raise DDPOverflowError(rank, msg, *overflowed[rank])
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
    seconds without progress (the slowest worker finishing no step's gradient or all-reduce:
    a hang, not a long run); the segment is unlinked in every case. `fault_injection` = (rank, step, "kill" |
    "kill-in-barrier" | "raise" | "hang" | "stop") is for tests ("kill-in-barrier": the worker dies
    holding the barrier's lock, as a kill during ``barrier.wait()`` can leave it).
    """
    if isinstance(workers, bool) or not isinstance(workers, (int, np.integer)) or workers < 1:
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
    if mp.current_process().daemon:
        raise RuntimeError(DAEMON_TEXT)
    ctx = mp.get_context("fork")
    t0 = time.perf_counter()
    proc.lifeline()                          # before any fork: workers watch it (die with us)
    # multiprocessing's heap (the barrier's state) is a sparse file in /dev/shm, its page taken
    # when first written: made and written before the segment reserves its room, so that a
    # /dev/shm too small for both is the segment's "not enough shared memory" (exit 7), not a
    # SIGBUS when the barrier is first written (taken for a truncated model file, exit 4)
    barrier = ctx.Barrier(workers)
    # unlinked at once: the forked workers inherit the mapping, and a kill of the whole process
    # group (the resource tracker with it) cannot leave the segment in /dev/shm
    with ShmSegment(layout, prefix=shm_prefix, named=False) as seg:
        seg["x"][:], seg["y"][:], seg["init"][:] = ar.x, ar.y, ar.p0
        procs, conns = [], []
        try:
            for r in range(workers):
                rx, tx = ctx.Pipe(duplex=False)
                p = ctx.Process(target=_worker_main, name=f"nxddp-worker-{r}", daemon=True,
                                args=(r, workers, ar, seg, barrier, tx, steps, timeout,
                                      fault_injection, os.getpid()))
                proc.limited_fork(p.start)
                tx.close()
                procs.append(p)
                conns.append(rx)
            _supervise(procs, conns, barrier, timeout, seg["progress"])
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
