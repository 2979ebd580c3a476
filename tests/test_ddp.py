"""Tests of the shared-memory ring all-reduce and the data-parallel Q16 training (nxhpc.train.ring, nxhpc.ddp).

References: exact Python-int sums for the ring; the single-process full-batch run for the
data-parallel weights (bytes); a plain float64 numpy training loop written here for the model;
the float32 path as the negative control showing that worker count *can* change bits.
Every test that forks checks that no segment with its own unique prefix is left in /dev/shm.
"""
import json
import multiprocessing as mp
import os
import secrets
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from nxhpc.train.ddp import (DDPTimeoutError, DDPWorkerError, MLPConfig, load_diabetes, init_params,
                       train_full_batch, train_shm)
from nxhpc.train.q16 import Q16_MAX, Q16OverflowError, from_q16, q16_add, to_q16
from nxhpc.runtime.workers import max_workers
from nxhpc.train.ring import ShmSegment, chunk_bounds, ring_allreduce_shm
from procutil import children_of, wait_until      # /proc helpers (tests/ is on sys.path)

SHM_DIR = "/dev/shm"
TEST_STEPS = 25
LONG_STEPS = 300            # "some hundreds of steps" of the real workload (~0.3-1.5 s per run)
pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="needs /dev/shm (Linux)")


def leftovers(prefix: str) -> list[str]:
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))


def mapped_segments(pid: int, prefix: str) -> list[str]:
    """The /dev/shm segments starting ``prefix`` that ``pid``'s children have mapped, as
    /proc/<child>/maps shows them (an unlinked one ends " (deleted)"). The training run's
    segment is unlinked at once, so its workers' maps -- not /dev/shm -- show it exists."""
    lines = set()
    for kid in children_of(pid):
        try:
            with open(f"/proc/{kid}/maps") as f:
                lines |= {ln.split(None, 5)[-1].strip() for ln in f
                          if f"{SHM_DIR}/{prefix}" in ln}
        except OSError:                  # the child exited meanwhile
            pass
    return sorted(lines)


def wait_for_workers(proc: subprocess.Popen, prefix: str, n: int) -> list[int]:
    """Wait until ``n`` children of ``proc`` run with the run's segment mapped (the workers
    started; a negative control: the segment and the workers exist); returns their pids. The
    segment must already be unlinked (nothing to leak)."""
    try:
        ok = wait_until(lambda: len(children_of(proc.pid)) >= n
                        and mapped_segments(proc.pid, prefix), 60, 0.05)
        if not ok:
            pytest.fail("the workers never started with the segment mapped (negative control)")
        segs = mapped_segments(proc.pid, prefix)
        assert all(m.endswith("(deleted)") for m in segs), segs
        assert leftovers(prefix) == []
        return children_of(proc.pid)
    except BaseException:          # the run (and its workers, via the lifeline) must not outlive
        proc.kill()                # a failed check: the callers' try blocks start after this
        proc.wait(10)
        raise


@pytest.fixture
def prefix():
    p = f"nxtest_{secrets.token_hex(3)}_"
    yield p
    assert leftovers(p) == [], f"leaked shared-memory segments: {leftovers(p)}"


@pytest.fixture(scope="module")
def data():
    return load_diabetes()


@pytest.fixture(scope="module")
def full_batch(data):
    return {s: train_full_batch(s, data=data) for s in (1, TEST_STEPS, LONG_STEPS)}


# ------------------------------------------------------------------------------------------
# chunking, segment lifetime, the ring itself
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("length,parts", [(0, 1), (1, 3), (7, 7), (33, 4), (194, 8), (5, 8)])
def test_chunk_bounds_cover_exactly(length, parts):
    b = chunk_bounds(length, parts)
    assert len(b) == parts and b[0][0] == 0 and b[-1][1] == length
    assert all(b[i][1] == b[i + 1][0] for i in range(parts - 1))
    sizes = [hi - lo for lo, hi in b]
    assert max(sizes) - min(sizes) <= 1


def test_shm_segment_exists_while_open_and_is_unlinked(prefix):
    with ShmSegment({"a": ((3, 4), np.int64), "b": ((5,), np.float32)}, prefix=prefix) as seg:
        assert os.path.exists(os.path.join(SHM_DIR, seg.name))       # the check is not vacuous
        assert seg.name.startswith(prefix)
        seg["a"][:] = 7
        assert seg["a"].sum() == 84 and seg["b"].sum() == 0
    assert not os.path.exists(os.path.join(SHM_DIR, seg.name))
    seg = ShmSegment({"a": ((2,), np.int64)}, prefix=prefix)
    try:
        raise KeyError("boom")
    except KeyError:
        seg.close()                                                  # error paths close too
    assert leftovers(prefix) == []


def _ring_worker(rank, bufs, barrier):
    ring_allreduce_shm(rank, bufs, lambda a, b: q16_add(a, b, "allreduce"), barrier, 30)


@pytest.mark.parametrize("D,L", [(1, 5), (2, 1), (3, 7), (5, 33), (8, 194), (8, 3)])
def test_ring_allreduce_shm_equals_exact_sum(D, L, prefix):
    rng = np.random.default_rng(D * 100 + L)
    rows = rng.integers(-(2**58), 2**58, size=(D, L), dtype=np.int64)
    exact = [sum(int(rows[r, j]) for r in range(D)) for j in range(L)]      # Python ints
    assert max(abs(v) for v in exact) <= Q16_MAX
    ctx = mp.get_context("fork")
    with ShmSegment({"bufs": ((D, L), np.int64)}, prefix=prefix) as seg:
        seg["bufs"][:] = rows
        barrier = ctx.Barrier(D)
        procs = [ctx.Process(target=_ring_worker, args=(r, seg["bufs"], barrier)) for r in range(D)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
        assert [p.exitcode for p in procs] == [0] * D
        for r in range(D):
            assert seg["bufs"][r].tolist() == exact, f"rank {r}"


def test_ring_rejects_mismatched_arguments():
    ctx = mp.get_context("fork")
    with pytest.raises(ValueError, match=r"bufs must be a \[D, L\] array, got shape \(4,\)"):
        ring_allreduce_shm(0, np.zeros(4, np.int64), np.add, ctx.Barrier(1))
    with pytest.raises(ValueError, match="barrier has 3 parties but bufs has 2 rows"):
        ring_allreduce_shm(0, np.zeros((2, 4), np.int64), np.add, ctx.Barrier(3))
    with pytest.raises(ValueError, match=r"rank 2 outside \[0, 2\)"):
        ring_allreduce_shm(2, np.zeros((2, 4), np.int64), np.add, ctx.Barrier(2))


def test_allreduce_add_is_checked():
    # the all-reduce add is checked: two gradients of 2**61 sum past Q16_MAX -> error, no wrap
    with pytest.raises(Q16OverflowError, match="allreduce"):
        q16_add(np.array([2**61 + 2**60]), np.array([2**61]), "allreduce")


# ------------------------------------------------------------------------------------------
# data-parallel training: bytes across D, equality with the full batch
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("steps", [1, LONG_STEPS])
@pytest.mark.parametrize("D", [1, 2, 3, 4, 5, 8])
def test_weights_byte_identical_to_full_batch(D, steps, data, full_batch, prefix):
    # 442 rows: D = 3, 4, 5, 8 give uneven shards (e.g. 147/147/148)
    ref = full_batch[steps]
    res = train_shm(D, steps, data=data, shm_prefix=prefix)
    assert res.params.dtype == np.int64
    assert res.params.tobytes() == ref.params.tobytes()
    assert res.sha256 == ref.sha256
    assert np.array_equal(res.losses, ref.losses)
    p0 = to_q16(init_params(data.x.shape[1], MLPConfig()))
    moved = int(np.count_nonzero(res.params != p0))
    assert moved > res.params.size // 2, f"only {moved} weights moved off the init"   # neg. ctrl
    if steps == LONG_STEPS:     # the workload trains: 1.90 -> 0.43 measured (mean SSE, std. y)
        assert res.losses[-1] < 0.5 * res.losses[0]


def test_loss_decreases_and_tracks_float64_training(data, full_batch):
    """The Q16 run trains the intended model: a float64 loop written here lands close to it."""
    cfg, steps = MLPConfig(), TEST_STEPS
    n, f = data.x.shape
    flat = from_q16(to_q16(init_params(f, cfg)))
    H = cfg.hidden
    W1, b1 = flat[:f * H].reshape(f, H), flat[f * H:f * H + H]
    W2, b2 = flat[f * H + H:f * H + 2 * H].reshape(H, 1), flat[-1:]
    xq, yq = from_q16(data.xq), from_q16(data.yq)
    lr = from_q16(np.asarray(cfg.lr_q16)) / n
    losses = []
    for _ in range(steps):
        z = xq @ W1 + b1
        h = np.maximum(z, 0)
        d = h @ W2 + b2 - yq
        losses.append(float((d * d).sum()) / n)
        gp = 2 * d
        gz = (gp @ W2.T) * (z > 0)
        W1, b1, W2, b2 = (W1 - lr * xq.T @ gz, b1 - lr * gz.sum(0), W2 - lr * h.T @ gp,
                          b2 - lr * gp.sum(0))
    ref64 = np.concatenate([W1.ravel(), b1, W2.ravel(), b2])
    q = full_batch[steps]
    assert q.losses[-1] < 0.8 * q.losses[0]
    # Tolerance: one step injects at most u/2 (SGD rounding) + lr * (per-row gradient bound of
    # test_q16, < 20 n u) / n ~= 1.5 u, so 25 steps give ~38 u without amplification; 1e-3 ~= 66 u
    # leaves room for the dynamics to amplify it 1.7x (measured: 4.5 u on weights, 1.5 u on loss).
    assert float(np.max(np.abs(from_q16(q.params) - ref64))) < 1e-3
    assert np.max(np.abs(q.losses - np.array(losses))) < 1e-3


def test_float32_contrast_differs_across_worker_counts(data, prefix):
    """Negative control for the byte-identity tests: the same model, data and ring in float32
    do produce different bits for different D (so identity is not automatic)."""
    res = {D: train_shm(D, TEST_STEPS, arith="float32", data=data, shm_prefix=prefix)
           for D in (1, 2, 3, 8)}
    assert len({r.sha256 for r in res.values()}) > 1
    diffs = [float(np.max(np.abs(r.params - res[1].params))) for r in res.values()]
    assert 0 < max(diffs) < 1e-3                   # different bits, same model
    q = train_full_batch(TEST_STEPS, data=data)
    assert float(np.max(np.abs(res[1].params - from_q16(q.params)))) < 1e-3


# ------------------------------------------------------------------------------------------
# failures: named worker, no hang, nothing left in /dev/shm
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["kill", "kill-in-barrier"])
def test_killed_worker_is_named_and_nothing_leaks(data, prefix, how):
    """A worker killed anywhere, also while it holds the barrier's lock (a kill inside
    ``barrier.wait()``): the parent once waited for that lock forever in ``barrier.abort()``,
    past its own timeout."""
    t0 = time.monotonic()
    with pytest.raises(DDPWorkerError, match=r"worker 1 \(pid \d+\) killed by signal SIGKILL") as e:
        train_shm(3, 10, data=data, shm_prefix=prefix, timeout=60, fault_injection=(1, 2, how))
    assert e.value.rank == 1
    assert time.monotonic() - t0 < 30                                     # no hang
    assert leftovers(prefix) == []


def test_raising_worker_is_named_with_its_error(data, prefix):
    with pytest.raises(DDPWorkerError, match=r"worker 2 .*RuntimeError: injected fault") as e:
        train_shm(4, 5, data=data, shm_prefix=prefix, timeout=60, fault_injection=(2, 0, "raise"))
    assert e.value.rank == 2


def test_hung_worker_times_out_naming_it(data, prefix):
    t0 = time.monotonic()
    with pytest.raises(DDPTimeoutError, match=r"worker 0 \(pid \d+\) still computing .* step 1 "):
        train_shm(3, 5, data=data, shm_prefix=prefix, timeout=3, fault_injection=(0, 1, "hang"))
    assert time.monotonic() - t0 < 20


def test_a_stopped_worker_is_named_as_stopped(data, prefix):
    """A worker stopped (SIGSTOP) may hold the barrier's lock, and the progress counters then
    blamed a peer in 1 of 6 runs (the QA helper's count): a stopped worker is named as such,
    with its signal. Control: the hang above is still named from the counters."""
    for _ in range(3):
        t0 = time.monotonic()
        with pytest.raises(DDPTimeoutError, match=r"; worker 2 \(pid \d+\) is stopped by "
                                                  r"SIGSTOP \(the others wait for it\)$"):
            train_shm(3, 5, data=data, shm_prefix=prefix, timeout=2,
                      fault_injection=(2, 1, "stop"))
        assert time.monotonic() - t0 < 20


def test_timeout_is_for_a_hang_not_for_a_long_run(data, prefix):
    """``timeout`` is seconds without progress: a healthy run longer than it completes (it was
    the whole run's budget: ``--workers 2 --steps 2000 --timeout 3`` was "timed out ... still
    computing the gradient of step 1041", exit 6). The hang above still times out."""
    t0 = time.monotonic()
    res = train_shm(2, 600, data=data, shm_prefix=prefix, timeout=0.25)   # ~4 ms a step here
    took = time.monotonic() - t0
    assert len(res.losses) == 600
    if took <= 0.25:                  # the run must outlast the timeout for this to prove it
        pytest.skip(f"600 steps took {took:.2f} s, not longer than the 0.25 s timeout")


def test_overflow_in_training_is_reported_not_wrapped(data, prefix):
    # a huge learning rate makes the weights explode; the tape must raise, naming the worker,
    # as a Q16OverflowError too (the run's arithmetic, not a crash: the CLI's exit 1, one line)
    with pytest.raises(DDPWorkerError, match=r"worker \d .*Q16OverflowError") as e:
        train_shm(2, 200, data=data, cfg=MLPConfig(lr=5e4), shm_prefix=prefix, timeout=60)
    assert isinstance(e.value, Q16OverflowError) and "Traceback" not in str(e.value)
    # the worker's own op and magnitude, as its message gives them (they were "worker N", 0)
    assert e.value.magnitude > e.value.limit
    assert f"(~{e.value.magnitude / 65536:.4g} in real units)" in str(e.value)
    assert not e.value.op.startswith("worker") and f"{e.value.op}: Q16 magnitude" in str(e.value)
    assert leftovers(prefix) == []
    r = _cli("--no-contrast", "--lr", "2", "--steps", "200", "--workers", "2")
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert "Q16OverflowError" in r.stderr and "Traceback" not in r.stderr
    # control: a worker that raises anything else stays a worker failure (6)
    with pytest.raises(DDPWorkerError) as e:
        train_shm(2, 5, data=data, shm_prefix=prefix, timeout=60, fault_injection=(1, 0, "raise"))
    assert not isinstance(e.value, Q16OverflowError)


def test_bad_arguments_are_named(data):
    with pytest.raises(ValueError, match="workers must be a positive integer, got 0"):
        train_shm(0, 1, data=data)
    with pytest.raises(ValueError, match="workers=500 exceeds the 442 data rows"):
        train_shm(500, 1, data=data)
    with pytest.raises(ValueError, match="steps must be a non-negative integer"):
        train_shm(2, -1, data=data)
    with pytest.raises(ValueError, match="workers must be a positive integer, got True"):
        train_shm(True, 1, data=data)         # it was a SharedArena shape error
    with pytest.raises(ValueError, match="steps must be a non-negative integer, got True"):
        train_shm(1, True, data=data)
    empty = type(data)(data.x[:0], data.y[:0], "empty")
    with pytest.raises(ValueError, match="the data set 'empty' has no rows"):
        train_full_batch(1, data=empty)       # it was a ZeroDivisionError
    with pytest.raises(ValueError, match="arith must be 'q16' or 'float32'"):
        train_full_batch(1, arith="float16", data=data)
    with pytest.raises(ValueError, match="rounds to 0 in Q16"):
        MLPConfig(lr=1e-6).lr_q16
    for lr in (1e6, 1e9, float("inf"), float("nan"), 0.0, -1.0):   # the message states the range
        with pytest.raises(ValueError, match=r"lr must be a positive number below 1e6"):
            MLPConfig(lr=lr)
    assert MLPConfig(lr=9.99e5).lr == 9.99e5                        # control
    # caught in the caller, by name (a shape error surfaced as a worker's traceback, a
    # feature-less x as a ZeroDivisionError, lr "0.1" as a bare comparison TypeError and lr
    # True ran as 1.0: the QA helper's finds); controls: numpy scalars and ints are numbers
    for lr in ("0.1", True, None):
        with pytest.raises(TypeError, match="MLPConfig: lr must be a number"):
            MLPConfig(lr=lr)
    assert MLPConfig(lr=np.float32(0.05)).lr_q16 == 3277 and MLPConfig(lr=1).lr_q16 == 65536
    D = type(data)
    for x, y, what in ((data.x[:, :0], data.y, "at least one feature"),
                       (data.x[:, 0], data.y, "at least one feature"),
                       (data.x, data.y[:, 0], r"y must be \[rows, 1\] = \[442, 1\]"),
                       (data.x, data.y[:-1], r"got shape \[441, 1\]")):
        with pytest.raises(ValueError, match=what):
            D(x, y, "bad")
    with pytest.raises(TypeError, match="x must be a numeric numpy array, got list"):
        D(data.x.tolist(), data.y, "bad")


_KILL_PARENT = r"""
import sys
from nxhpc.train.ddp import train_shm
print("started", flush=True)
train_shm(3, 50, shm_prefix=sys.argv[1], timeout=600, fault_injection=(0, 1, "hang"))
"""


def _start_hanging_run(prefix: str) -> subprocess.Popen:
    """A driver process whose worker 0 hangs at step 1; returns once its segment exists."""
    proc = subprocess.Popen([sys.executable, "-c", _KILL_PARENT, prefix], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    wait_for_workers(proc, prefix, 3)
    time.sleep(0.5)
    return proc


def test_parent_killed_leaves_no_segment_and_no_orphan(prefix):
    """SIGKILL of the driving process: workers die with it (PDEATHSIG); the segment was
    unlinked when it was made."""
    proc = _start_hanging_run(prefix)
    try:
        child_pids = children_of(proc.pid)
        assert len(child_pids) >= 3, child_pids          # the 3 workers
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 20
        while leftovers(prefix) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert leftovers(prefix) == []
        for pid in child_pids:              # no orphan left running (resource tracker included)
            for _ in range(100):
                if not os.path.exists(f"/proc/{pid}") or _is_zombie(pid):
                    break
                time.sleep(0.1)
            assert not os.path.exists(f"/proc/{pid}") or _is_zombie(pid), f"orphan pid {pid}"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_whole_process_group_killed_leaves_no_segment(prefix):
    """SIGKILL of the whole process group (a closed terminal's SIGHUP, ``timeout -s KILL``,
    a batch system's kill): the resource tracker dies with the run, so a segment still linked
    in /dev/shm stayed there (2026-12-07). The run's segment is unlinked when it is made."""
    proc = _start_hanging_run(prefix)
    try:
        kids = children_of(proc.pid)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        assert wait_until(lambda: not any(os.path.exists(f"/proc/{k}") and not _is_zombie(k)
                                          for k in kids), 10, 0.05)
        assert leftovers(prefix) == []
    finally:
        if proc.poll() is None:
            proc.kill()


def test_ctrl_c_in_parent_cleans_up(prefix):
    """KeyboardInterrupt while workers run: workers are killed, the segment is unlinked."""
    proc = _start_hanging_run(prefix)
    try:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode != 0 and "KeyboardInterrupt" in err
        assert leftovers(prefix) == []
    finally:
        if proc.poll() is None:
            proc.kill()


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


# ------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------

def _cli(*args, timeout=120, env=None):
    return subprocess.run([sys.executable, "-m", "nxhpc.ddp", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


def test_cli_help_and_bad_arguments():
    r = _cli("--help")
    assert r.returncode == 0 and "--backend" in r.stdout and "--workers" in r.stdout
    r = _cli("--workers", "0")
    assert r.returncode == 2 and "--workers must be >= 1, got 0" in r.stderr
    r = _cli("--backend", "tcp")
    assert r.returncode == 2 and "invalid choice: 'tcp'" in r.stderr
    r = _cli("--contrast", "1,x")
    assert r.returncode == 2 and "comma-separated integers" in r.stderr
    # both was taken, the contrast skipped without a word (the CLI helper's find)
    r = _cli("--contrast", "1,2", "--no-contrast", "--steps", "1")
    assert r.returncode == 2 and "not allowed with argument --contrast" in r.stderr, r.stderr
    r = _cli("--timeout", "0")
    assert r.returncode == 2 and "--timeout must be > 0 seconds, got 0.0" in r.stderr
    # a step count whose losses no memory holds was "out of memory (...less an e)", cut off
    # and advising a smaller image; control: the largest count is accepted by the parser
    r = _cli("--steps", str(10**10), "--no-contrast")
    assert r.returncode == 2 and "--steps must be in [1, 10000000], got 10000000000" in r.stderr
    from nxhpc.ddp import build_parser
    assert build_parser().parse_args(["--steps", "10000000"]).steps == 10**7
    r = _cli("--sweep", "1,,2")                      # an empty item is refused, not skipped
    assert r.returncode == 2 and "comma-separated integers" in r.stderr
    top = max_workers()                             # the pools' cap: 8x the CPUs, at least 64
    r = _cli("--workers", str(top + 1), "--steps", "1")
    assert r.returncode == 2 and f"--workers: [{top + 1}] exceeds {top}, the most" in r.stderr
    r = _cli("--workers", "2", "--sweep", f"1,{top + 1}", "--steps", "1")
    assert r.returncode == 2 and f"--sweep: [{top + 1}] exceeds {top}" in r.stderr
    r = _cli("--workers", "2", "--contrast", f"{top + 1}", "--steps", "1")
    assert r.returncode == 2 and f"--contrast: [{top + 1}] exceeds {top}" in r.stderr
    # under an MPI launcher the shm backend would run the whole job once per rank (each rank
    # printing its report and writing the same --json): refused; control: a world of one
    r = _cli("--steps", "1", "--no-contrast", env=dict(os.environ, OMPI_COMM_WORLD_SIZE="2"))
    assert r.returncode == 2 and "give --backend mpi" in r.stderr, r.stderr
    r = _cli("--steps", "1", "--no-contrast", env=dict(os.environ, OMPI_COMM_WORLD_SIZE="1"))
    assert r.returncode == 0, r.stderr
    r = _cli("--workers", "443", "--steps", "1")     # more workers than the 442 data rows
    assert r.returncode == 2 and ("exceeds the 442 data rows" in r.stderr if top >= 443
                                  else "--workers: [443] exceeds" in r.stderr)


def test_cli_prints_losses_hash_and_contrast(tmp_path, full_batch):
    out = tmp_path / "r.json"
    r = _cli("--workers", "3", "--steps", str(TEST_STEPS), "--contrast", "1,2",
             "--sweep", "1,2", "--json", str(out))
    assert r.returncode == 0, r.stderr
    ref = full_batch[TEST_STEPS]
    assert f"weights sha256 {ref.sha256}" in r.stdout
    assert r.stdout.count("loss ") >= TEST_STEPS
    assert "float32 contrast" in r.stdout and "max|W_D - W_1|" in r.stdout
    rep = json.loads(out.read_text())
    assert rep["sha256"] == ref.sha256 and rep["sweep"]["full_batch"] == ref.sha256
    assert rep["sweep"]["1"] == rep["sweep"]["2"] == ref.sha256
    assert np.allclose(rep["losses"], ref.losses, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------
# the trainer on the runtime (issue 8) and its CLI edges (issue 12, item 13)
# ------------------------------------------------------------------------------------------

def test_train_uses_the_runtime_not_copies_of_it():
    """The ring's chunking is the runtime's one bands(), its segment a SharedArena, the
    trainer's die-with-parent and exit text the runtime's; nothing in nxhpc/train imports the
    compiled kernels (checked on the import statements, so a lazy import would be caught)."""
    import ast
    import inspect
    import pathlib

    import nxhpc.train.ddp as ddp_mod
    import nxhpc.train.ring as ring_mod
    from nxhpc.runtime.shm import SharedArena
    from nxhpc.runtime.workers import bands
    assert chunk_bounds is bands and issubclass(ShmSegment, SharedArena)
    assert "prctl" not in inspect.getsource(ddp_mod)          # PDEATHSIG lives in the runtime
    assert "shared_memory" not in inspect.getsource(ring_mod)
    imported = {}
    for f in sorted(pathlib.Path(ring_mod.__file__).parent.glob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        imported[f.name] = names
        assert not any("_kernels" in n for n in names), (f.name, names)
        assert not any(n.startswith(("nxhpc.dit", "nxhpc.models")) for n in names), f.name
    assert any(n.startswith("nxhpc.runtime") for n in imported["ring.py"])
    assert any(n.startswith("nxhpc.runtime") for n in imported["ddp.py"])


_NO_KERNELS = r"""
import sys
sys.modules["nxhpc._kernels"] = None          # any import of the compiled kernels now fails
from nxhpc.train.ddp import train_full_batch, train_shm
r = train_shm(2, 3, shm_prefix=sys.argv[1])
assert r.sha256 == train_full_batch(3).sha256
print("ok", "nxhpc._kernels" in sys.modules and sys.modules["nxhpc._kernels"] is None)
"""


def test_training_runs_without_the_compiled_kernels(prefix):
    r = subprocess.run([sys.executable, "-c", _NO_KERNELS, prefix], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "ok True"


_KILL_THREAD_PARENT = r"""
import sys, threading
from nxhpc.train.ddp import train_shm
print("started", flush=True)
t = threading.Thread(target=train_shm, args=(3, 50),
                     kwargs=dict(shm_prefix=sys.argv[1], timeout=600, fault_injection=(0, 1, "hang")))
t.start()
t.join()
"""


def test_run_from_a_thread_still_dies_with_the_parent(prefix):
    """Workers forked from a non-main thread get no PR_SET_PDEATHSIG (it would fire with that
    thread); the runtime's lifeline must still take them down with a SIGKILLed parent."""
    proc = subprocess.Popen([sys.executable, "-c", _KILL_THREAD_PARENT, prefix],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_workers(proc, prefix, 3)
        time.sleep(0.5)
        kids = children_of(proc.pid)
        assert len(kids) >= 3
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 10
        while any(os.path.exists(f"/proc/{k}") and not _is_zombie(k) for k in kids) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(os.path.exists(f"/proc/{k}") and not _is_zombie(k) for k in kids)
        deadline = time.monotonic() + 20
        while leftovers(prefix) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert leftovers(prefix) == []
    finally:
        if proc.poll() is None:
            proc.kill()


def test_timeout_inf_means_no_limit(data, prefix, full_batch):
    """``--timeout inf`` failed inside the barrier with errno 22 (a semaphore wait of inf)."""
    res = train_shm(2, 1, data=data, shm_prefix=prefix, timeout=float("inf"))
    assert res.sha256 == full_batch[1].sha256
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        train_shm(2, 1, data=data, timeout=float("nan"))
    r = _cli("--workers", "2", "--steps", "1", "--no-contrast", "--timeout", "inf")
    assert r.returncode == 0, r.stderr
    assert f"weights sha256 {full_batch[1].sha256}" in r.stdout


def test_cli_argument_edges_exit_2_without_traceback(tmp_path):
    """``--seed -1`` and an unwritable ``--json`` path gave tracebacks (the latter after the
    whole run); both are now usage errors, found before any training."""
    for args, msg in ((["--seed", "-1"], "seed must be a non-negative integer"),
                      (["--json", str(tmp_path / "no" / "r.json")], "does not exist"),
                      (["--json", str(tmp_path)], "is a directory"),
                      # a count twice: trained twice and one JSON key (--sweep 2,2)
                      (["--sweep", "2,2"], "--sweep lists a worker count twice: 2,2"),
                      (["--contrast", "1,3,1"], "--contrast lists a worker count twice"),
                      # 1e8 ran the machine out of memory (the kernel's OOM killer)
                      (["--hidden", "65537"], "hidden must be an integer in [1, 65536]")):
        skip = [] if "--contrast" in args else ["--no-contrast"]   # the two exclude each other
        r = _cli("--workers", "2", "--steps", "1", *skip, *args)
        assert r.returncode == 2, (args, r.stderr)
        assert msg in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
        assert "weights sha256" not in r.stdout               # refused before training


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_cli_signal_clean_exit_no_traceback(sig, code):
    """SIGINT printed a raw traceback. Now: a one-line message, 130 (SIGTERM: 143), the workers
    gone and the segment unlinked."""
    p = subprocess.Popen([sys.executable, "-m", "nxhpc.ddp", "--workers", "2", "--steps",
                          "1000000", "--no-contrast", "--log-every", "1000000"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        mine = f"nxddp_{p.pid}_"
        wait_for_workers(p, mine, 2)
        time.sleep(0.5)
        kids = children_of(p.pid)
        assert len(kids) >= 2
        p.send_signal(sig)
        out, err = p.communicate(timeout=30)
        assert p.returncode == code, err
        assert "Traceback" not in err and "shared memory released" in err
        assert leftovers(mine) == []
        time.sleep(0.2)
        assert not any(os.path.exists(f"/proc/{k}") and not _is_zombie(k) for k in kids)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


class _SklearnThatCannotLoad:
    """A finder that finds scikit-learn (it is installed) and fails to load it the way the
    loader does when an address-space limit leaves no room for scipy's OpenBLAS."""

    def find_spec(self, name, path=None, target=None):
        import importlib.machinery
        if name == "sklearn" or name.startswith("sklearn."):
            return importlib.machinery.ModuleSpec(name, self)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise ImportError("libscipy_openblas-6cdc3b4a.so: failed to map segment from shared "
                          "object: Cannot allocate memory")


def test_a_scikit_learn_that_cannot_load_is_not_called_missing(monkeypatch, capsys):
    """Under ``ulimit -v`` near ddp's needs, scipy's OpenBLAS failed to map and ddp said "pip
    install ... scikit-learn" (exit 2) with scikit-learn installed (the environment helper's
    find). "Install it" is said only when it is missing now; an installed one that cannot
    load is the out-of-memory exit 7 naming the limit. Control: without the fault ddp
    trains."""
    from nxhpc import ddp
    argv = ["--workers", "2", "--steps", "2", "--no-contrast"]
    with monkeypatch.context() as m:
        for name in [k for k in sys.modules if k == "sklearn" or k.startswith("sklearn.")]:
            m.delitem(sys.modules, name)
        m.setattr(sys, "meta_path", [_SklearnThatCannotLoad(), *sys.meta_path])
        assert ddp.main(argv) == 7
    err = capsys.readouterr().err
    assert "out of memory (libscipy_openblas" in err and "pip install" not in err, err
    assert ddp.main(argv) == 0, capsys.readouterr().err                      # control


def test_a_dev_shm_too_small_for_ddp_is_not_enough_shared_memory():
    """A /dev/shm of 64 KiB (ddp's 47 KB segment fits it alone) gave exit 4 "a memory-mapped
    file lost its pages (SIGBUS): a model file was truncated" (the environment helper's find):
    the barrier's state lives in multiprocessing's sparse heap file in /dev/shm, and its first
    write after the segment took the room was a SIGBUS. The barrier is made (and written)
    first now, so the segment's own check says it: exit 7, the bytes needed and free.
    Control: 128 KiB holds both, and the run trains."""
    from nsutil import run_with_tmpfs
    cmd = [sys.executable, "-m", "nxhpc.ddp", "--workers", "2", "--steps", "3", "--no-contrast"]
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    r = run_with_tmpfs(cmd, "/dev/shm", "size=64k", env=env, timeout=120)
    assert r.returncode == 7 and "not enough shared memory" in r.stderr, (r.returncode, r.stderr)
    assert "SIGBUS" not in r.stderr
    r = run_with_tmpfs(cmd, "/dev/shm", "size=128k", env=env, timeout=120)        # control
    assert r.returncode == 0 and "weights sha256" in r.stdout, r.stderr
