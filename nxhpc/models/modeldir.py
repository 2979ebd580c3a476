"""Model directories on disk: the file names, writing a directory all-or-nothing, locking.

Owns: the names inside a model directory (``model.gguf``, ``fixtures.safetensors``,
``synthetic.json``, ``denoiser_fixtures.npz``), :func:`write_model_dir` and
:func:`build_model_dir` (built in a temporary sibling, renamed into place),
:func:`check_replaceable` (what may be replaced) and the per-id generation lock.
Must not: know what the tensors mean (the config lives in ``nxhpc.dit.config``), or run kernels.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from nxhpc.formats.fixtures import FIXTURES_FILE, FixtureStore
from nxhpc.formats.gguf_io import write_gguf

__all__ = ["GGUF_FILE", "FIXTURES_FILE", "SPEC_FILE", "DENOISER_FIXTURES_FILE", "write_model_dir",
           "build_model_dir", "check_replaceable", "locked"]

GGUF_FILE = "model.gguf"
SPEC_FILE = "synthetic.json"
#: A synthetic denoiser's stored inputs and float64 reference output (``.npz``, no pickles).
DENOISER_FIXTURES_FILE = "denoiser_fixtures.npz"


def write_model_dir(out_dir: str | os.PathLike, gguf_tensors: Mapping[str, Any],
                    fixtures: Mapping[str, np.ndarray], *, prefix: bool = True,
                    gguf_metadata: Mapping[str, Any] | None = None,
                    fixture_metadata: Mapping[str, str] | None = None,
                    extra_files: Mapping[str, str] | None = None, replace: bool = False,
                    progress: Callable[[str], None] | None = None) -> Path:
    """Write a model directory: ``model.gguf`` (:func:`~nxhpc.formats.gguf_io.write_gguf` of
    ``gguf_tensors``), ``fixtures.safetensors`` and any ``extra_files`` (name -> text).

    Built in a temporary sibling and renamed into place, so readers never see a half-written
    model and a failure leaves nothing behind. An existing ``out_dir`` raises FileExistsError
    unless ``replace``, in which case it is swapped out only once the new one is complete
    (and only if it is a model directory: one never replaces a folder of other files).
    """
    say = progress or (lambda s: None)

    def write(tmp: Path) -> None:
        say(f"writing {GGUF_FILE}")
        write_gguf(tmp / GGUF_FILE, gguf_tensors, prefix=prefix, metadata=gguf_metadata)
        say(f"writing {FIXTURES_FILE}")
        FixtureStore.save(tmp / FIXTURES_FILE, fixtures, metadata=fixture_metadata)
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
    return build_model_dir(out_dir, write, replace=replace)


def build_model_dir(out_dir: str | os.PathLike, write: Callable[[Path], None], *,
                    replace: bool = False) -> Path:
    """Run ``write(tmp)`` to fill a temporary sibling of ``out_dir``, then rename it into place
    (all-or-nothing; ``replace`` as for :func:`write_model_dir`). ``write`` must leave a
    ``model.gguf`` or ``fixtures.safetensors`` in ``tmp`` (what makes it a model directory)."""
    out_dir = Path(out_dir)
    check_replaceable(out_dir, replace)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    old = tmp.with_name(tmp.name + "-old")
    try:
        write(tmp)
        if not ((tmp / GGUF_FILE).is_file() or (tmp / FIXTURES_FILE).is_file()):
            raise RuntimeError(f"build_model_dir: {out_dir}: neither {GGUF_FILE} nor "
                               f"{FIXTURES_FILE} was written")
        os.chmod(tmp, 0o755)
        if out_dir.exists():
            os.rename(out_dir, old)
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not out_dir.exists():
            os.rename(old, out_dir)                     # put the previous model back
        raise
    shutil.rmtree(old, ignore_errors=True)
    return out_dir


def check_replaceable(out_dir: Path, replace: bool) -> None:
    """FileExistsError unless ``out_dir`` is absent, or ``replace`` and it is an empty or
    model directory (holding ``model.gguf`` or ``fixtures.safetensors``)."""
    if not out_dir.exists() and not out_dir.is_symlink():
        return
    if not replace:
        raise FileExistsError(f"{out_dir} already exists")
    if out_dir.is_symlink() or not out_dir.is_dir() or (
            any(out_dir.iterdir()) and not ((out_dir / GGUF_FILE).is_file()
                                            or (out_dir / FIXTURES_FILE).is_file())):
        raise FileExistsError(f"{out_dir} exists and is not a model directory (no {GGUF_FILE} "
                              f"or {FIXTURES_FILE}); refusing to replace it")




@contextlib.contextmanager
def locked(root: Path, model_id: str) -> Iterator[None]:
    """Hold ``<root>/.<model_id>.lock`` exclusively (one process generates a model at a time)."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{model_id}.lock", "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
