"""MPI backend of nxhpc.ddp: `mpirun -n D python -m nxhpc.ddp --backend mpi` gives the same bytes.

References: the shared-memory run and the single-process full batch (SHA-256 of the weights),
and exact Python-int sums for the MPI ring. Runs mpirun in a subprocess on localhost; skipped
only when mpirun or mpi4py is absent (CI installs both).
"""
import json
import subprocess

import pytest

from mpiutil import MPI_MARKS, mpirun, run_single

from nxhpc.train.ddp import train_full_batch, train_shm

pytestmark = MPI_MARKS

STEPS = 300                 # the real workload's "some hundreds of steps" (~1-8 s per mpirun)


def _mpirun(n: int, args: list[str], timeout: float = 180) -> subprocess.CompletedProcess:
    return mpirun(n, args, timeout=timeout)


_RING_CHECK = r"""
import numpy as np
from mpi4py import MPI
from nxhpc.train.q16 import q16_add
from nxhpc.train.ring import ring_allreduce_mpi
comm = MPI.COMM_WORLD
D, rank = comm.Get_size(), comm.Get_rank()
for L in (1, 2, 7, 33, 194):
    rows = np.random.default_rng(L).integers(-(2**58), 2**58, size=(D, L), dtype=np.int64)
    got = ring_allreduce_mpi(comm, rows[rank], lambda a, b: q16_add(a, b, "allreduce"))
    exact = [sum(int(rows[r, j]) for r in range(D)) for j in range(L)]
    assert got.tolist() == exact, (rank, L)
print("ring ok", rank, flush=True)
"""


@pytest.mark.parametrize("n", [3, 4])
def test_mpi_ring_equals_exact_sum(n):
    r = _mpirun(n, ["-c", _RING_CHECK])
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("ring ok") == n


@pytest.fixture(scope="module")
def reference():
    ref = train_full_batch(STEPS)
    shm = train_shm(5, STEPS)        # a D the MPI tests do not use
    assert shm.sha256 == ref.sha256
    return ref


@pytest.mark.parametrize("n", [3, 8])
def test_mpi_training_same_bytes_as_shm(n, reference, tmp_path):
    out = tmp_path / "mpi.json"
    r = _mpirun(n, ["-m", "nxhpc.ddp", "--backend", "mpi", "--steps", str(STEPS),
                    "--json", str(out)])
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(out.read_text())
    assert rep["backend"] == "mpi" and rep["workers"] == n
    assert rep["sha256"] == reference.sha256
    assert f"weights sha256 {reference.sha256}" in r.stdout
    assert rep["losses"] == reference.losses.tolist()
    assert rep["losses"][-1] < 0.5 * rep["losses"][0]          # it trains (1.90 -> 0.43)


def test_mpi_workers_mismatch_is_refused():
    r = _mpirun(2, ["-m", "nxhpc.ddp", "--backend", "mpi", "--workers", "3", "--steps", "1"])
    assert r.returncode != 0
    assert "--workers 3 but the MPI world has 2 ranks" in r.stderr


def test_mpi_rank_failure_aborts_the_job_with_its_error():
    # a huge learning rate overflows Q16 on every rank: the job must end, naming a rank
    r = _mpirun(2, ["-m", "nxhpc.ddp", "--backend", "mpi", "--steps", "300", "--lr", "50000"])
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])    # Q16 overflow: as in shm
    assert "MPI rank" in r.stderr and "Q16OverflowError" in r.stderr


_ONE_RANK_FAILS = r"""
import sys
from mpi4py import MPI
import nxhpc.ddp as cli
import nxhpc.train.ddp as ddp
if MPI.COMM_WORLD.Get_rank() == 1:          # only rank 1 fails; its peers wait in Sendrecv
    def broken(*args, **kwargs):
        raise RuntimeError("injected fault on one rank")
    ddp.q16_shard_grad = broken
sys.exit(cli.main(["--backend", "mpi", "--steps", "5"]))
"""


def test_mpi_single_rank_failure_aborts_peers_without_hanging():
    r = _mpirun(3, ["-c", _ONE_RANK_FAILS], timeout=60)      # a hang would raise TimeoutExpired
    assert r.returncode != 0
    assert "MPI rank 1 of 3 failed: RuntimeError: injected fault on one rank" in r.stderr
    assert "weights sha256" not in r.stdout


_SIGTERM_ONE_RANK = r"""
import os, signal, sys
from mpi4py import MPI
import nxhpc.ddp as cli
import nxhpc.train.ddp as ddp
if MPI.COMM_WORLD.Get_rank() == 1:          # rank 1 gets SIGTERM mid-run; its peers wait in Sendrecv
    real, n = ddp.q16_shard_grad, [0]
    def grad(*args, **kwargs):
        n[0] += 1
        if n[0] == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)
    ddp.q16_shard_grad = grad
sys.exit(cli.main(["--backend", "mpi", "--steps", "1000000", "--log-every", "100000"]))
"""


def test_mpi_sigterm_to_one_rank_ends_the_job():
    """SIGTERM to one rank ends the job with 143 (it hung: the signalled rank sat in
    MPI_Finalize, its peers spun in a blocking Sendrecv)."""
    r = _mpirun(2, ["-c", _SIGTERM_ONE_RANK], timeout=90)   # a hang raises TimeoutExpired
    assert r.returncode == 143, (r.returncode, r.stderr[-2000:])
    assert "ddp: error: MPI rank 1 terminated (SIGTERM)" in r.stderr


_SIGTERM_AT_LOAD = r"""
import os, signal, sys
from mpi4py import MPI
import nxhpc.ddp as cli
import nxhpc.train.ddp as ddp
if MPI.COMM_WORLD.Get_rank() == 1:          # rank 1 gets SIGTERM while it loads the data
    real = ddp.load_diabetes
    def load(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)
    ddp.load_diabetes = load
sys.exit(cli.main(["--backend", "mpi", "--steps", "1000000", "--log-every", "100000"]))
"""


def test_mpi_sigterm_to_one_rank_before_the_ring_ends_the_job():
    """SIGTERM to one rank while it loads the data (3-8 s of importing scikit-learn) hung the
    job for good: the handler that aborts covered the ring only, so the rank returned 143 and
    sat in MPI_Finalize while its peer spun in the ring (the QA helper's find)."""
    r = _mpirun(2, ["-c", _SIGTERM_AT_LOAD], timeout=90)    # a hang raises TimeoutExpired
    assert r.returncode == 143, (r.returncode, r.stderr[-2000:])
    assert "ddp: error: MPI rank 1 terminated (SIGTERM)" in r.stderr


def test_mpi_sweep_is_refused():
    r = _mpirun(2, ["-m", "nxhpc.ddp", "--backend", "mpi", "--steps", "1", "--sweep", "1,2"])
    assert r.returncode == 2 and "--sweep runs worker counts in this process" in r.stderr, r.stderr


def test_mpi_bad_arguments_are_printed_once():
    """The same bad arguments on every rank print one usage and one error (they printed one a
    rank), ``--help`` once, and the job exits 2 (0 for ``--help``). Control: one process
    prints the same text."""
    bad = ["-m", "nxhpc.ddp", "--backend", "mpi", "--steps", "x"]
    r = _mpirun(3, bad, timeout=100)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.count("argument --steps") == 1 and r.stderr.count("usage: ") == 1, r.stderr
    one = run_single(bad)
    assert one.returncode == 2 and one.stderr and one.stderr in r.stderr, (one.stderr, r.stderr)
    r = _mpirun(2, ["-m", "nxhpc.ddp", "--help"], timeout=100)
    assert r.returncode == 0 and r.stdout.count("usage: ") == 1 and "--backend" in r.stdout


@pytest.mark.parametrize("other", [["--steps", "7"], ["--hidden", "8"], ["--seed", "3"]],
                         ids=["steps", "hidden", "seed"])
def test_mpi_ranks_that_disagree_on_the_training_are_refused(other):
    """Ranks given other ``--steps`` hung the ring for ever, other ``--hidden`` ended in
    MPI_ERR_TRUNCATE (exit 6), another ``--seed`` trained to the end and then failed as
    "replicas diverged" (the MPI helper's finds). They are compared before any training now:
    exit 4, one line from rank 0 naming each rank's value. Control: the same arguments on
    every rank train."""
    base = ["-m", "nxhpc.ddp", "--backend", "mpi", "--steps", "5"]
    r = mpirun(2, [], apps=[base, [*base, *other]], timeout=60)
    assert r.returncode == 4, r.stdout + r.stderr
    assert r.stderr.count("MPI ranks disagree on the arguments") == 1, r.stderr
    assert f"{other[0]}: rank 0 " in r.stderr and "weights sha256" not in r.stdout, r.stderr
    r = mpirun(2, [], apps=[[*base, *other], [*base, *other]], timeout=60)     # control
    assert r.returncode == 0 and "weights sha256" in r.stdout, r.stdout + r.stderr


def test_mpi_json_is_checked_where_it_is_written(tmp_path):
    """``--json j/r.json`` was checked on every rank: a folder only rank 0's disk holds (each
    node its own disk; here each rank its own working directory) was "does not exist", exit 2
    (the MPI helper's find). Rank 0 alone writes it, and alone checks it now. Control: a
    folder rank 0 lacks is still refused, before any training."""
    d0, d1 = tmp_path / "r0", tmp_path / "r1"
    (d0 / "j").mkdir(parents=True)
    d1.mkdir()
    import sys

    from mpiutil import mpi_env

    def run(wd0, wd1):
        app = [sys.executable, "-m", "nxhpc.ddp", "--backend", "mpi", "--steps", "3", "--json",
               "j/r.json"]
        cmd = ["mpirun", "--oversubscribe", "-n", "1", "-wdir", str(wd0), *app, ":",
               "-n", "1", "-wdir", str(wd1), *app]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=mpi_env())
    r = run(d0, d1)
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads((d0 / "j" / "r.json").read_text())["backend"] == "mpi"
    assert not (d1 / "j").exists()
    r = run(d1, d0)                                               # control: rank 0 lacks it
    assert r.returncode == 2 and "does not exist" in r.stderr, r.stdout + r.stderr
