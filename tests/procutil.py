"""Process helpers shared by the process-lifecycle tests (workers, plan, block, models, CLIs):
/proc readers (Linux only: :data:`linux_only` skips elsewhere), running a CLI module on a models
directory, reading a child's pipe while it runs."""
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINUX = os.path.isdir("/proc/self/fd") and os.path.isdir("/dev/shm")
linux_only = pytest.mark.skipif(not LINUX, reason="needs Linux /proc and /dev/shm")


def alive(pid: int) -> bool:
    """True if pid exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def children_of(pid: int) -> list[int]:
    """Pids whose parent is `pid` (zombies included)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    return out


def with_tests_on_path(env=None) -> dict:
    """A copy of ``env`` (default: os.environ) whose PYTHONPATH starts with this tests folder, so
    that a child script can import these helpers."""
    env = dict(os.environ if env is None else env)
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    return env


def wait_until(pred, timeout: float, step: float = 0.02):
    """Poll ``pred()`` until it is truthy or ``timeout`` seconds pass; its last value."""
    deadline = time.monotonic() + timeout
    while not (v := pred()) and time.monotonic() < deadline:
        time.sleep(step)
    return v


def mapped_arenas() -> list[str]:
    """Arena segments still mapped into this process (unlinked ones show as '(deleted)')."""
    with open("/proc/self/maps") as f:
        return [ln for ln in f if "/dev/shm/nxhpc_" in ln]


def assert_signal_releases(p: subprocess.Popen, sig: int, code: int, kids: list[int],
                           timeout: float) -> None:
    """``p`` holds an arena (mapped, already unlinked: checked first, so the checks after are
    about that segment and not a vacuous empty listing); ``sig`` must make it exit ``code``
    saying the shared memory was released, leaving no segment of its own and none of ``kids``
    alive."""
    from nxhpc.runtime.shm import live_segments
    with open(f"/proc/{p.pid}/maps") as f:
        assert any("/dev/shm/nxhpc_" in ln and "(deleted)" in ln for ln in f)
    p.send_signal(sig)
    out, err = p.communicate(timeout=timeout)
    assert p.returncode == code, err
    assert "shared memory released" in err
    assert live_segments(p.pid) == []
    time.sleep(0.2)
    assert not any(alive(k) for k in kids)


def models_env(root, **extra) -> dict:
    """A copy of os.environ with ``NXHPC_MODELS=root`` (and ``extra``)."""
    return dict(os.environ, NXHPC_MODELS=str(root), **extra)


def run_cli(module: str, args, root, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    """``python -m module *args`` from the repository root with ``NXHPC_MODELS=root``."""
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], capture_output=True,
                          text=True, env=models_env(root), timeout=timeout, cwd=ROOT, **kw)


class PipeReader(threading.Thread):
    """Collects a pipe's text as it comes (a waiter's message must arrive while it waits)."""

    def __init__(self, stream):
        super().__init__(daemon=True)
        self.stream, self.text = stream, ""

    def run(self):
        for line in self.stream:
            self.text += line

    def wait_for(self, s, timeout=60):
        end = time.monotonic() + timeout
        while s not in self.text and time.monotonic() < end:
            time.sleep(0.05)
        return s in self.text


def arena_pool_cycle(mode: str, named: bool) -> None:
    """One SharedArena (named or not) and a 2-worker WorkerPool in ``mode`` running two
    stages: the unit of work the interrupt loops of tests/test_workers.py interrupt."""
    from nxhpc.runtime.shm import SharedArena
    from nxhpc.runtime.workers import WorkerPool
    with SharedArena({"x": (64, 64), "n": ((8,), "int64")}, named=named) as a:
        def f(lo, hi, arg):
            a["x"][lo:hi] += 1
        with WorkerPool(2, {"f": f}, mode=mode) as p:
            p.run("f", 64)
            p.run("f", 64)


def open_fds() -> dict[str, str]:
    """This process's open file descriptors: ``{fd: what it points at}``."""
    return {f: os.readlink(f"/proc/self/fd/{f}") for f in os.listdir("/proc/self/fd")
            if os.path.exists(f"/proc/self/fd/{f}")}


def warm_cycle_seconds(cycle) -> float:
    """Warm ``cycle(mode, named)`` up (imports, lifeline, tracker), then return the median
    length of 8 cycles over both spawn modes and both arena kinds (an interrupt timer's
    range)."""
    import time
    for mode in ("pool", "stage", "pool", "stage"):
        cycle(mode, mode == "pool")
    times = []
    for i in range(8):
        t0 = time.perf_counter()
        cycle(("pool", "stage")[i % 2], i % 4 < 2)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def note_interrupt(e: BaseException, where, errors, prefix: str) -> int:
    """Book one exception of an interrupt loop: a KeyboardInterrupt counts in ``where`` under
    the innermost function below ``prefix`` (a source path) it came out of, and returns 1;
    anything else counts in ``errors`` by type and message, and returns 0."""
    import traceback
    if not isinstance(e, KeyboardInterrupt):
        errors[f"{type(e).__name__}: {str(e)[:80]}"] += 1
        return 0
    inner = [fr for fr in traceback.extract_tb(e.__traceback__) if fr.filename.startswith(prefix)]
    if inner:
        where[inner[-1].name] += 1
    return 1


def mapping_rss_kb(addr: int) -> int:
    """Resident kB of this process's mapping that contains address ``addr`` (from
    /proc/self/smaps: the pages mapped into this process's page tables, not the segment's)."""
    found = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(None, 1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(v, 16) for v in head.split("-"))
                found = lo <= addr < hi
            elif found and head == "Rss:":
                return int(line.split()[1])
    raise LookupError(f"no mapping holds address {addr:#x}")


def kernel_populates() -> bool:
    """Whether this kernel (and sandbox) takes ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14+),
    tried on a scratch anonymous mapping of one page, apart from the code under test."""
    if not LINUX:
        return False
    import mmap
    m = mmap.mmap(-1, mmap.PAGESIZE)
    try:
        m.madvise(23)                          # MADV_POPULATE_WRITE in <linux/mman.h>
        return True
    except OSError:
        return False
    finally:
        m.close()


def record_dispatches(monkeypatch) -> list[str]:
    """A list that receives the stage label of every ``WorkerPool.run`` from now on (for the
    rest of the test): what the engine sent the workers, row groups as ``"a+b"``."""
    from nxhpc.runtime.workers import WorkerPool
    sent: list[str] = []
    real_run = WorkerPool.run

    def recording(self, stage, m, **kw):
        sent.append(stage)
        return real_run(self, stage, m, **kw)
    monkeypatch.setattr(WorkerPool, "run", recording)
    return sent
