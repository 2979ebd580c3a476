"""``mpirun`` for the MPI tests (test_ddp_mpi, test_mpi_split, test_mpi_generate): one launcher,
one environment, one set of skip marks.

Runs ``mpirun --oversubscribe`` on localhost (2 cores here: more ranks than cores), as root in
containers and CI (Open MPI's ``OMPI_ALLOW_RUN_AS_ROOT*``), from the repository root with it on
``PYTHONPATH``, with a 3 s kill grace (:func:`mpi_env`); ``models`` sets ``$NXHPC_MODELS`` for
the ranks. The marks skip a module only when ``mpirun`` or ``mpi4py`` is absent (CI installs
both).
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: ``pytestmark`` of every MPI test module.
MPI_MARKS = [
    pytest.mark.mpi,
    pytest.mark.skipif(shutil.which("mpirun") is None,
                       reason="mpirun not on PATH (apt install openmpi-bin)"),
    pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None,
                       reason="mpi4py not installed (pip install mpi4py)"),
]


def mpi_env(models=None) -> dict:
    """The ranks' environment: this one, the repository on PYTHONPATH, Open MPI's root and
    oversubscription switches (unless set), and ``NXHPC_MODELS=models`` if given."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    if models is not None:
        env["NXHPC_MODELS"] = str(models)
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")
    # When a rank dies, Open MPI 4.1's mpirun signals the survivors odls_base_sigkill_timeout
    # (default 1 s) after the death, SIGTERM and then SIGKILL that long again later. On the
    # 2-core test host (3 ranks x 2 workers) rank 0 sometimes missed recording its exit code in
    # the default second (test_mpi_split's dying-rank test failed alone, 2026-12-04); 3 s passed
    # every run. Only a killed job waits for it.
    env.setdefault("OMPI_MCA_odls_base_sigkill_timeout", "3")
    return env


def mpirun(n: int, args: list[str], models=None, timeout: float = 120,
           extra_env: dict | None = None, apps: list[list[str]] | None = None
           ) -> subprocess.CompletedProcess:
    """``mpirun -n n python ARGS`` (or an MPMD line of ``apps``, one rank each), output
    captured."""
    cmd = ["mpirun", "--oversubscribe"]
    if apps is None:
        cmd += ["-n", str(n), sys.executable, *args]
    else:
        for i, a in enumerate(apps):
            cmd += ([":"] if i else []) + ["-n", "1", sys.executable, *a]
    env = mpi_env(models)
    env.update(extra_env or {})
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=ROOT)


def run_single(args: list[str], models=None, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python ARGS`` as one process without mpirun, in the ranks' environment."""
    return subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          timeout=timeout, env=mpi_env(models), cwd=ROOT)


def run_cli_recording_rc(module: str, argv_from: int) -> str:
    """The end of a ``python -c`` fault script run on every rank: import the CLI ``module``
    (e.g. ``"nxhpc.denoise"``), run its ``main(sys.argv[argv_from:])`` and write each rank's exit
    code to ``$RC_DIR/rc.<rank>`` -- also when the CLI's signal frame leaves through
    ``os._exit``. The script before it sets ``rank`` and its fault."""
    return f"""
import nxhpc.cli.frame as frame
import {module} as cli
def record(code):                              # each rank's exit code, for the test to read
    with open(os.path.join(os.environ["RC_DIR"], f"rc.{{rank}}"), "w") as f:
        f.write(str(code))
class Os:
    def __getattr__(self, name):
        return getattr(os, name)
    @staticmethod
    def _exit(code):
        record(code)
        os._exit(code)
frame.os = Os()
code = cli.main(sys.argv[{argv_from}:])
record(code)
sys.exit(code)
"""
