"""The pure-Python tools work in a source tree whose compiled extension is not built.

The package's ``.py`` sources (no ``.so``, no ``.c``) are copied to a temporary directory and run
from there with ``PYTHONPATH`` pointing at it (``python -S`` plus the site-packages directories,
so that no ``.pth`` file -- e.g. an editable install of another checkout -- can supply the
extension): ``import nxhpc``, ``python -m nxhpc.models list``
and ``python -m nxhpc.ddp --help`` succeed; the first use of a kernel fails with the clear "not
built" ImportError (the negative control that the copy really lacks the extension).
"""
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def unbuilt(tmp_path_factory):
    d = tmp_path_factory.mktemp("unbuilt")
    for src in (ROOT / "nxhpc").rglob("*.py"):
        dst = d / src.relative_to(ROOT)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)
    assert not list(d.rglob("*.so"))
    path = os.pathsep.join([str(d), *site.getsitepackages()])
    env = dict(os.environ, PYTHONPATH=path, NXHPC_MODELS=str(d / "models"))
    return d, env


def _run(unbuilt, *args):
    d, env = unbuilt
    return subprocess.run([sys.executable, "-S", *args], capture_output=True, text=True, env=env,
                          cwd=d, timeout=120)


def test_import_nxhpc(unbuilt):
    d, _ = unbuilt
    r = _run(unbuilt, "-c", "import nxhpc, nxhpc.models, nxhpc.dit.config, nxhpc.dit.plan, "
                            "nxhpc.formats.weights; print(nxhpc.__file__)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(d / "nxhpc" / "__init__.py")


def test_models_list(unbuilt):
    r = _run(unbuilt, "-m", "nxhpc.models", "list")
    assert r.returncode == 0, r.stderr
    assert "tiny" in r.stdout and "zimage-1l" in r.stdout


def test_ddp_help(unbuilt):
    r = _run(unbuilt, "-m", "nxhpc.ddp", "--help")
    assert r.returncode == 0, r.stderr
    assert "usage" in r.stdout


def test_kernel_use_says_not_built(unbuilt):
    r = _run(unbuilt, "-c", "import nxhpc; nxhpc.cpu_features()")
    assert r.returncode != 0 and "not built" in r.stderr, r.stderr
