"""Model directories on disk: the file names, writing a directory all-or-nothing, locking.

Owns: the names inside a model directory (``model.gguf``, ``fixtures.safetensors``,
``synthetic.json``; an autoencoder's ``ae.safetensors``; :data:`NAMED_FILES`, what no result
may overwrite and what a replaced directory does not pass on), :func:`write_model_dir` and
:func:`build_model_dir` (built in a temporary sibling, renamed into place; the user's other
entries carried into the new one),
:func:`check_replaceable` (what may be replaced), the per-id generation lock (:func:`locked`:
a waiter says that it waits and for which process), sweeping the temporaries a killed writer
left (:func:`sweep_stale`) and checking that a models root can take a new model
(:func:`check_models_root`, :class:`ModelsDirError`).
Must not: know what the tensors mean (the config lives in ``nxhpc.dit.config``), or run kernels.

Temporaries are named ``.<name>.tmp-<pid>-<random>`` (and ``...-old`` for a model being
replaced), so a later writer can tell a live writer's temporary from a dead one's.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from nxhpc.formats.fixtures import FIXTURES_FILE, FixtureStore
from nxhpc.formats.gguf_io import ModelError, write_gguf
from nxhpc.runtime.proc import deferred_signals

__all__ = ["GGUF_FILE", "FIXTURES_FILE", "SPEC_FILE", "VAE_FILE", "MODEL_FILES",
           "write_model_dir",
           "build_model_dir", "check_replaceable", "locked", "lock_holder", "sweep_stale",
           "check_models_root", "ModelsDirError", "STALE_AGE_S", "process_umask",
           "FILES_MANIFEST", "NAMED_FILES", "carry_over"]

GGUF_FILE = "model.gguf"
SPEC_FILE = "synthetic.json"
#: The weights of a built-in autoencoder (the BFL single-file layout).
VAE_FILE = "ae.safetensors"
#: A directory holding one of these is a model directory (what may be replaced).
MODEL_FILES = (GGUF_FILE, FIXTURES_FILE, VAE_FILE)
#: Written into a built-in's directory after it was generated: each file's name, size and
#: sampled sha256 (``runtime.ranks.file_fingerprint``: ~5 MB read per file, whatever its size).
#: A file that was overwritten, truncated or replaced since (say an output saved over the
#: model) no longer matches, and the built-in is generated again.
FILES_MANIFEST = ".nxhpc-files.json"
#: The names of the files a model's loaders read or a built-in keeps: an output never replaces
#: one beside a model named by its path, and a replaced model's directory passes every other
#: entry (the user's) on to the new one (:func:`build_model_dir`)
NAMED_FILES = (GGUF_FILE, FIXTURES_FILE, SPEC_FILE, FILES_MANIFEST, VAE_FILE, "config.json",
               "diffusion_pytorch_model.safetensors")
#: A temporary without a writer pid in its name (an older nxhpc's) is stale after this long.
STALE_AGE_S = 3600.0
#: How often a waiter for the generation lock repeats that it is waiting.
_WAIT_REPEAT_S = 60.0


class ModelsDirError(ModelError):
    """The models directory (``$NXHPC_MODELS`` / ``--models-dir``) cannot take a model: not a
    directory, not writable, or full. Attribute ``path``."""

    def __init__(self, path: str | os.PathLike, message: str) -> None:
        self.path = Path(path)
        super().__init__(message)


_ROOT_SRC = "(from $NXHPC_MODELS / --models-dir)"


def check_models_root(root: Path, *, need_bytes: int = 0, what: str = "a model",
                      src: str = _ROOT_SRC) -> None:
    """Make sure ``root`` is (or can be made) a writable directory with about ``need_bytes``
    free; :class:`ModelsDirError` naming the directory (``src``: where it came from) and the
    reason otherwise."""
    if root.exists() and not root.is_dir():
        raise ModelsDirError(root, f"models directory {root} {src} is not a directory; "
                                   f"point it at a directory")

    def check_room(d: Path) -> None:
        free = _free_bytes(d) if need_bytes else None
        if free is not None and free < need_bytes:
            raise ModelsDirError(root, f"models directory {root} {src} is too full for {what}: "
                                       f"about {_mb(need_bytes)} needed, {_mb(free)} free")
    try:                                    # the nearest folder that exists: a refusal for
        nearest = top = root.absolute()     # room makes nothing
    except OSError:                         # relative, the working directory removed: mkdir
        nearest = top = root                # names that
    while not os.path.lexists(nearest) and nearest != nearest.parent:
        nearest = nearest.parent
    if nearest != top:
        check_room(nearest)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ModelsDirError(root, f"models directory {root} {src} cannot be created: "
                                   f"{e.strerror or e}") from None
    if not os.access(root, os.W_OK | os.X_OK):
        raise ModelsDirError(root, f"models directory {root} {src} is not writable (read-only "
                                   f"or no permission), so {what} cannot be generated there; "
                                   f"use a writable directory, or generate it elsewhere first")
    check_room(root)


def _free_bytes(d: Path) -> int | None:
    """Bytes free on ``d``'s file system; None if unknown, or if it has no blocks at all
    (``/proc``, ``/sys``: nothing can be stored there, and mkdir says why, not "too full")."""
    try:
        usage = shutil.disk_usage(d)
    except OSError:
        return None
    return usage.free if usage.total > 0 else None


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def write_failed(root: Path, what: str, e: OSError, src: str = _ROOT_SRC,
                 left: str = "nothing was left behind") -> ModelsDirError:
    """The :class:`ModelsDirError` for an OSError while writing ``what`` under ``root`` (numpy's
    ``tofile`` reports a full disk as "N requested and M written", without an errno); ``left``
    says what the failure left."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        reason = f"the file system is full ({e.strerror})"
    elif e.errno == errno.EFBIG:
        reason = f"a file-size limit (ulimit -f) stopped the write ({e.strerror})"
    elif e.errno is None:
        reason = f"a write was cut short ({e}: the file system is full, or a size limit)"
    else:
        reason = e.strerror or str(e)
    free = _free_bytes(root)
    tail = f"; {_mb(free)} free there" if free is not None else ""
    return ModelsDirError(root, f"cannot write {what} under {root} {src}: {reason}{tail}; "
                                f"{left}")


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


def process_umask() -> int:
    """This process's umask, read without changing it (``/proc/self/status``, Linux >= 4.7;
    else 0o022): the mode a generated file or directory should end with is ``0o666`` /
    ``0o777`` less it, as for any file the user creates."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def build_model_dir(out_dir: str | os.PathLike, write: Callable[[Path], None], *,
                    replace: bool = False) -> Path:
    """Run ``write(tmp)`` to fill a temporary sibling of ``out_dir``, then rename it into place
    (all-or-nothing; ``replace`` as for :func:`write_model_dir`). ``write`` must leave a
    ``model.gguf``, ``fixtures.safetensors`` or ``ae.safetensors`` in ``tmp`` (what makes it a
    model directory: :data:`MODEL_FILES`). Without ``replace`` a directory that appeared at
    ``out_dir`` meanwhile (another process's make) is FileExistsError, not replaced. A replaced
    directory's entries that are not a model's files (:data:`NAMED_FILES`: the user's outputs,
    notes, folders) are moved into the new one, not deleted with the old model."""
    out_dir = Path(out_dir)
    check_replaceable(out_dir, replace)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    sweep_stale(out_dir.parent, out_dir.name)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-{os.getpid()}-",
                                dir=out_dir.parent))
    old = tmp.with_name(tmp.name + "-old")
    try:
        write(tmp)
        if not any((tmp / name).is_file() for name in MODEL_FILES):
            raise RuntimeError(f"build_model_dir: {out_dir}: none of {', '.join(MODEL_FILES)} "
                               f"was written")
        os.chmod(tmp, 0o777 & ~process_umask())     # mkdtemp made it 0o700
        with deferred_signals():        # Ctrl-C / SIGTERM: after the swap and the carry-over
            if replace and out_dir.exists():
                os.rename(out_dir, old)
            try:
                os.rename(tmp, out_dir)                 # onto an existing non-empty dir: fails
            except OSError as e:
                if replace or e.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR,
                                              errno.EISDIR):
                    raise
                raise FileExistsError(f"{out_dir} already exists (made meanwhile, by another "
                                      f"process?)") from None
            done = carry_over(old, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not out_dir.exists():
            os.rename(old, out_dir)                     # put the previous model back
        raise
    if done:
        shutil.rmtree(old, ignore_errors=True)
    return out_dir


def carry_over(old: Path, new: Path) -> bool:
    """Move the entries of a replaced model directory ``old`` that are not a model's files
    (:data:`NAMED_FILES`, the manifest's temporaries; an entry ``new`` already has stays) into
    ``new``: the user's outputs, notes, folders. True when ``old`` holds nothing of the user's
    any more (it may go). If a move fails, ``old`` is renamed to a visible
    ``<name>.replaced-<random>`` beside ``new``, said on stderr, and False. A writer killed in
    between leaves the rest in its ``-old`` temporary; :func:`sweep_stale` finishes the move."""
    if not old.is_dir() or old.is_symlink():
        return True
    try:
        for p in sorted(old.iterdir()):
            if p.name in NAMED_FILES or p.name.startswith(f"{FILES_MANIFEST}.tmp-") \
                    or os.path.lexists(new / p.name):
                continue
            os.rename(p, new / p.name)
    except OSError as e:
        keep = Path(tempfile.mkdtemp(prefix=f"{new.name}.replaced-", dir=new.parent))
        os.rename(old, keep / "files")
        print(f"nxhpc.models: {new}: could not move the previous directory's own files into "
              f"the new one ({e.strerror or e}); what was not moved is in {keep / 'files'}",
              file=sys.stderr)
        return False
    return True


def check_replaceable(out_dir: Path, replace: bool) -> None:
    """FileExistsError unless ``out_dir`` is absent, or ``replace`` and it is an empty or
    model directory (holding ``model.gguf`` or ``fixtures.safetensors``)."""
    if not out_dir.exists() and not out_dir.is_symlink():
        return
    if not replace:
        raise FileExistsError(f"{out_dir} already exists")
    if out_dir.is_symlink() or not out_dir.is_dir() or (
            any(out_dir.iterdir()) and not any((out_dir / n).is_file() for n in MODEL_FILES)):
        raise FileExistsError(f"{out_dir} exists and is not a model directory (no {GGUF_FILE} "
                              f"or {FIXTURES_FILE}); refusing to replace it")




def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:             # someone else's process: alive
        return True
    except OSError:
        return True
    return True


def _writer_pid(name: str, tmp_name: str) -> int | None:
    """The writer pid in a temporary's name ``.<name>.tmp-<pid>-...``, or None (older format)."""
    rest = tmp_name[len(f".{name}.tmp-"):]
    head, sep, _ = rest.partition("-")
    return int(head) if sep and head.isdigit() else None


def sweep_stale(parent: Path, name: str, *, now: float | None = None) -> list[Path]:
    """Remove the temporaries of ``parent/name`` left by writers that died (SIGKILL, a crash):
    ``.<name>.tmp-<pid>-*`` whose pid is no longer running, and ``.<name>.tmp-*`` without a pid
    untouched for :data:`STALE_AGE_S`. A dead writer's ``-old`` directory (the model it was
    replacing) is put back when ``name`` itself is missing, and otherwise passes the user's
    entries still in it on to ``name`` (:func:`carry_over`) before it goes. Returns what was
    removed."""
    now = time.time() if now is None else now
    removed: list[Path] = []
    try:
        entries = sorted(parent.iterdir())
    except OSError:
        return removed
    for p in entries:
        if not p.name.startswith(f".{name}.tmp-") or p.is_symlink() or not p.is_dir():
            continue
        pid = _writer_pid(name, p.name)
        if pid is not None:
            stale = pid != os.getpid() and not _pid_alive(pid)
        else:
            try:
                stale = now - p.stat().st_mtime > STALE_AGE_S
            except OSError:
                continue
        if not stale:
            continue
        target = parent / name
        if p.name.endswith("-old") and not target.exists() and not target.is_symlink():
            with contextlib.suppress(OSError):
                os.rename(p, target)          # the writer died between its two renames
            continue
        if p.name.endswith("-old") and target.is_dir() and not target.is_symlink() \
                and not carry_over(p, target):  # died while passing the user's files on
            continue
        shutil.rmtree(p, ignore_errors=True)
        if not p.exists():
            removed.append(p)
    return removed


def lock_holder(path: Path) -> int | None:
    """The pid holding an flock on ``path`` (from ``/proc/locks``), else the pid the holder
    wrote into the file, else None."""
    try:
        st = os.stat(path)
        with open("/proc/locks") as fh:
            for line in fh:
                f = line.split()
                # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF" (a blocked waiter: "->")
                if len(f) >= 6 and f[1] == "FLOCK" and f[2] != "->":
                    dev_ino = f[5].split(":")
                    if len(dev_ino) == 3 and dev_ino[2].isdigit() \
                            and int(dev_ino[2]) == st.st_ino and f[4].isdigit():
                        return int(f[4])
    except OSError:
        pass
    try:
        head = Path(path).read_text().split()
        return int(head[0]) if head and head[0].isdigit() else None
    except (OSError, ValueError):
        return None


def _proc_state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


@contextlib.contextmanager
def locked(root: Path, model_id: str,
           say: Callable[[str], None] | None = None) -> Iterator[None]:
    """Hold ``<root>/.<model_id>.lock`` exclusively (one process generates a model at a time).

    A waiter says so -- which lock, which pid holds it, whether that process is stopped -- on
    stderr (or through ``say``), and again every minute; it waits until the holder finishes
    or dies (a Ctrl-C ends the wait). The holder writes its pid into the file."""
    say = say or (lambda m: print(m, file=sys.stderr, flush=True))
    root.mkdir(parents=True, exist_ok=True)
    path = root / f".{model_id}.lock"
    with open(path, "a+") as fh:
        told = None
        while True:
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                pass
            t = time.monotonic()
            if told is None or t - told >= _WAIT_REPEAT_S:
                pid = lock_holder(path)
                who = f"pid {pid}" if pid is not None else "another process"
                stopped = pid is not None and _proc_state(pid) in ("T", "t")
                note = (f" (it is stopped: resume it with kill -CONT {pid}, or end it)"
                        if stopped else "")
                say(f"nxhpc.models: waiting for the lock {path}: {who} is generating "
                    f"{model_id!r}{note}; Ctrl-C to give up")
                told = t
            time.sleep(0.1)
        try:
            with contextlib.suppress(OSError):
                fh.seek(0)
                fh.truncate()
                fh.write(f"{os.getpid()}\n")
                fh.flush()
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
