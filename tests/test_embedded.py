"""The CLIs' main() and the library inside the processes downstream programs run them in (a
review of those contexts, 2026-12-06): a caller's own shared memory, signal dispositions,
SIGCHLD / SIGPIPE settings, a closed or full stdout / stderr, the process limit, a daemonic
multiprocessing worker, a removed working directory, the umask, threads importing at once.
Each case is checked against what the caller had before or what README's exit-code table
says, with a control where the check could pass vacuously."""
import errno
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from nxhpc.cli.codes import Exit
from nsutil import run_with_tmpfs
from procutil import models_env

ROOT = Path(__file__).resolve().parents[1]


def _py(code: str, root, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    """``python -c code`` from the repository root with ``NXHPC_MODELS=root``."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=models_env(root), cwd=kw.pop("cwd", ROOT), timeout=timeout, **kw)


def test_main_leaves_the_callers_and_other_threads_arenas_alone(models_root, capsys):
    """A CLI's main() released every named arena of the process on its way out: a caller's
    own, and another thread's call's (ddp's ring died under it). It releases only those it
    made, in its thread; cleanup_all() (the atexit sweep) still takes them all (control)."""
    from nxhpc.models import main as models_main
    from nxhpc.runtime import shm
    mine = shm.SharedArena({"x": (4,)}, named=True)
    try:
        mine["x"][:] = 3
        other: dict = {}

        def other_thread() -> None:
            other["arena"] = shm.SharedArena({"y": (2,)}, named=True)
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
        assert models_main(["--models-dir", str(models_root), "list"]) == Exit.PASS
        assert not mine.closed and (mine["x"] == 3).all()
        assert not other["arena"].closed
        mark = shm.arena_mark()
        made = shm.SharedArena({"z": (2,)}, named=True)
        assert shm.cleanup_since(mark, threading.get_ident() + 1) == 0 and not made.closed
        assert shm.cleanup_since(mark, threading.get_ident()) == 1 and made.closed
        assert shm.cleanup_all() >= 2 and mine.closed and other["arena"].closed
    finally:
        mine.close()
    capsys.readouterr()


@pytest.mark.parametrize("mode", ["ignore", "reaper"])
def test_stage_spawn_with_sigchld_ignored_or_reaped_by_the_caller(models_root, mode):
    """--spawn stage failed every stage (exit 6, "disappeared without reporting") when the
    caller ignored SIGCHLD or reaped children itself: the workers' statuses were gone. The
    block now passes, as with pool spawning."""
    handler = "signal.SIG_IGN" if mode == "ignore" else "reap"
    r = _py(f"""
import os, signal, sys
def reap(s, f):
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass
signal.signal(signal.SIGCHLD, {handler})
import nxhpc.blockrun as b
sys.exit(b.main(["tiny", "2", "--spawn", "stage"]))""", models_root)
    assert r.returncode == Exit.PASS and "PASS" in r.stdout, r.stderr[-2000:]


def test_a_dead_worker_with_sigpipe_at_its_default_is_an_error_not_a_crash(models_root):
    """A program that set SIGPIPE back to its default (Python ignores it) was killed by it when
    a denoiser wrote to a dead worker's pipe (exit 141, nothing printed); the call now raises
    WorkerError, and the next call runs on new workers. Control: the same with SIGPIPE ignored."""
    for disposition in ("SIG_DFL", "SIG_IGN"):
        r = _py(f"""
import os, signal, time, numpy as np
signal.signal(signal.SIGPIPE, signal.{disposition})
import nxhpc
from nxhpc.runtime.workers import WorkerError
den = nxhpc.load_denoiser("tiny-dit", workers=2)
cap = np.zeros((3, den.config.cap_dim), np.float32)
lat = np.zeros((16, 8, 8), np.float32)
a = den.forward(lat, 0.5, cap)
s = den.session(8, 8, 3)
os.kill(s.engine.pool.pids[0], signal.SIGKILL)
time.sleep(0.3)
try:
    den.forward(lat, 0.5, cap)
    print("no error")
except WorkerError as e:
    print("WorkerError", "SIGKILL" in str(e))
print("again", np.array_equal(den.forward(lat, 0.5, cap), a))
den.close()""", models_root)
        assert r.returncode == 0, (disposition, r.returncode, r.stderr[-2000:])
        assert r.stdout.split("\n")[:2] == ["WorkerError True", "again True"], r.stdout


def test_an_unusable_dev_shm_is_exit_7(models_root):
    """No writable /dev/shm (a container without one, or mounted read-only) was exit 70 with a
    traceback from shm_open; it is exit 7 naming /dev/shm. Control: a writable tmpfs there
    runs the block."""
    cmd = [sys.executable, "-m", "nxhpc.blockrun", "tiny", "1"]
    env = models_env(models_root)
    r = run_with_tmpfs(cmd, "/dev/shm", "size=64m,ro", env=env, cwd=ROOT, timeout=300)
    assert r.returncode == Exit.SHM, r.stderr[-2000:]
    assert "cannot create a shared-memory segment in /dev/shm: Read-only file system" \
        in r.stderr and "Traceback" not in r.stderr
    r = run_with_tmpfs(cmd, "/dev/shm", "size=64m", env=env, cwd=ROOT, timeout=300)
    assert r.returncode == Exit.PASS, r.stderr[-2000:]


@pytest.mark.parametrize("buffered", [True, False], ids=["buffered", "unbuffered"])
def test_stdout_and_stderr_closed_or_full(models_root, tmp_path, buffered):
    """stdout on a full device was exit 70 with a traceback: it is exit 8 with one line; stdout
    closed (sys.stdout None) was exit 70: the run passes, its report unprinted; stderr full
    made generate fail inside its progress bar (exit 1, nothing written): the PNG is written
    and the exit is 0. --prompts - with stdin closed says so. Both with Python's default
    buffering (stdout full, or stderr full under a progress bar's unfinished line, failed only in
    the interpreter's flush at exit: exit 120, 2026-12-06) and with PYTHONUNBUFFERED."""
    env = models_env(models_root)
    env.pop("PYTHONUNBUFFERED", None)
    if not buffered:
        env["PYTHONUNBUFFERED"] = "1"

    def sh(cmd: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, env=env,
                              cwd=ROOT, timeout=300)
    py = sys.executable
    r = sh(f"{py} -m nxhpc.models list >/dev/full")
    assert r.returncode == Exit.OUTPUT, r.stderr
    assert r.stderr.strip() == ("models: error: standard output could not be written (No "
                                "space left on device)")
    r = sh(f"{py} -m nxhpc.blockrun tiny 1 >&-")
    assert r.returncode == Exit.PASS and r.stderr == "", r.stderr
    png = tmp_path / "a.png"
    r = sh(f"{py} -m nxhpc.generate --prompt fox --steps 1 --out {png} 2>/dev/full")
    assert r.returncode == Exit.PASS and png.is_file() and "out=" in r.stdout, r.stdout
    r = sh(f"{py} -m nxhpc.generate --prompts - --out {tmp_path / 'b.png'} <&-")
    assert r.returncode == Exit.USAGE and "--prompts -: standard input is closed" in r.stderr
    r = sh(f"{py} -m nxhpc.models list >/dev/null")                       # control
    assert r.returncode == Exit.PASS and r.stderr == ""


def test_the_process_limit_is_a_usage_error(models_root, monkeypatch, capsys):
    """fork() refused for the process limit (EAGAIN: ulimit -u, a container's pids.max) was
    exit 70 with a traceback; it is exit 2 naming the limit, like the open-files limit. Another
    BlockingIOError stays what it was (control)."""
    import nxhpc.blockrun as blockrun
    from nxhpc.runtime import proc, workers

    def refused():
        raise BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")
    monkeypatch.setattr(workers, "limited_fork", lambda: proc.limited_fork(refused))
    assert blockrun.main(["tiny", "2", "--models-dir", str(models_root)]) == Exit.USAGE
    err = capsys.readouterr().err
    assert "blockrun: error: cannot start a worker process (Resource temporarily unavailable):" \
           " the limit on processes (ulimit -u) is" in err and "Traceback" not in err, err

    def other():
        raise BlockingIOError(errno.EWOULDBLOCK + 1000, "something else")
    with pytest.raises(BlockingIOError) as info:
        proc.limited_fork(other)
    assert not isinstance(info.value, proc.ProcessLimitError)


def test_sigterm_is_taken_over_only_from_its_default():
    """A caller that ignores SIGTERM or handles it keeps its disposition during a CLI call (a
    SIGTERM aborted main() with 143 even under SIG_IGN); from the default action the call takes
    it (so SIGTERM ends a run with 143) and gives it back."""
    from nxhpc.runtime.proc import cli_signals
    mine = lambda s, f: None          # noqa: E731
    old = signal.getsignal(signal.SIGTERM)
    try:
        for before in (signal.SIG_IGN, mine):
            signal.signal(signal.SIGTERM, before)
            with cli_signals():
                assert signal.getsignal(signal.SIGTERM) is before
            assert signal.getsignal(signal.SIGTERM) is before
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        with cli_signals() as sig:
            assert signal.getsignal(signal.SIGTERM) == sig._on_term
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, old)


def _sigbus_caught() -> bool:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) & (1 << (signal.SIGBUS - 1)))
    raise AssertionError("no SigCgt line")


def test_overlapping_calls_keep_the_sigbus_handler_until_the_last_leaves():
    """Two CLI calls overlapping in threads: the first to leave removed the SIGBUS handler the
    other still relied on. It is now counted: installed while any call is inside the frame,
    the action from before once the last has left."""
    import faulthandler
    from nxhpc.cli import frame
    was = faulthandler.is_enabled()
    faulthandler.disable()                        # pytest's catches SIGBUS too
    try:
        assert not _sigbus_caught()               # the control: nothing catches it now
        a = frame._sigbus_exit("a")
        b = frame._sigbus_exit("b")
        assert a and b and _sigbus_caught()
        frame._sigbus_exit(None, a)
        assert _sigbus_caught()                   # b is still inside
        frame._sigbus_exit(None, b)
        assert not _sigbus_caught()
    finally:
        if was:
            faulthandler.enable()


def test_ddp_in_a_daemonic_pool_worker_says_why(models_root):
    """ddp's shm backend inside a multiprocessing.Pool worker (daemonic: no children allowed)
    was exit 70 with an AssertionError; it is exit 2 saying why and what to do."""
    r = _py("""
import multiprocessing as mp
def job(_):
    import nxhpc.ddp
    return nxhpc.ddp.main(["--workers", "2", "--steps", "2", "--no-contrast"])
if __name__ == "__main__":
    with mp.get_context("fork").Pool(1) as p:
        print("rc", p.map(job, [0])[0])""", models_root)
    assert r.stdout.strip() == "rc 2", (r.stdout, r.stderr[-2000:])
    assert "a daemonic process (e.g. a multiprocessing.Pool worker)" in r.stderr


def test_a_removed_working_directory_is_a_usage_error(models_root, tmp_path):
    """The caller's working directory removed (a notebook whose folder was deleted) and a
    relative --out: exit 70 from realpath; it is exit 2 saying so. Absolute paths still work
    there (control)."""
    gone = tmp_path / "gone"
    out = tmp_path / "abs.png"
    r = _py(f"""
import os, sys
os.makedirs({str(gone)!r}); os.chdir({str(gone)!r}); os.rmdir({str(gone)!r})
import nxhpc.generate as g
a = g.main(["--prompt", "x", "--steps", "1", "--out", "rel.png", "--no-progress"])
b = g.main(["--prompt", "x", "--steps", "1", "--out", {str(out)!r}, "--no-progress"])
print("codes", a, b)""", models_root)
    assert r.stdout.strip().endswith("codes 2 0"), (r.stdout, r.stderr[-2000:])
    assert "the current directory no longer exists" in r.stderr and out.is_file()


@pytest.mark.parametrize("umask, dmode, fmode", [(0o077, 0o700, 0o600), (0o022, 0o755, 0o644)])
def test_generated_models_follow_the_umask(tmp_path, umask, dmode, fmode):
    """A generated model directory and its files were 0755 / 0644 whatever the umask (world-
    readable under umask 077); they now take the modes any file the user makes takes."""
    root = tmp_path / "models"
    r = subprocess.run(["bash", "-c", f"umask {umask:03o}; exec {sys.executable} -m nxhpc.models "
                                      f"make tiny-vae"], capture_output=True, text=True,
                       env=models_env(root), cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    d = root / "tiny-vae"
    assert d.stat().st_mode & 0o777 == dmode
    modes = {p.name: p.stat().st_mode & 0o777 for p in d.iterdir()}
    assert {"ae.safetensors", "synthetic.json"} <= set(modes)
    assert set(modes.values()) == {fmode}, modes


def test_importing_the_models_package_imports_none_of_its_modules():
    """Threads importing parts of nxhpc.models at once could deadlock on module locks (a
    library call and a CLI import: ~1 in 7 runs of a reviewer's script); the package now
    imports its submodules on first use of a name, so its own import takes no other lock."""
    r = subprocess.run([sys.executable, "-c", "import sys, nxhpc.models as m; "
                        "print(sorted(k for k in sys.modules if k.startswith('nxhpc.models.')));"
                        "m.open_model; print('nxhpc.models.registry' in sys.modules)"],
                       capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0 and r.stdout.split("\n")[:2] == ["[]", "True"], (r.stdout, r.stderr)


def test_a_worker_reaped_by_the_kernel_is_never_signalled(models_root):
    """Under a SIGCHLD of SIG_IGN the kernel reaps a dead worker at once, and its pid may then
    belong to another process: the pool's kill path (after the failure it reports) signalled
    every recorded pid. It now signals only its own live children: the dead worker's pid is
    not in os.kill's calls, the live one is (control), and the failure is still WorkerError.
    The live worker is stopped first: left running, it sees its pipe's EOF and may exit (and be
    reaped by the kernel) before the kill path looks at it, which then rightly leaves it alone
    (2 runs in 8 on an AMD Zen 4 failed the control that way)."""
    r = _py("""
import os, signal, time, numpy as np
signal.signal(signal.SIGCHLD, signal.SIG_IGN)
import nxhpc
from nxhpc.runtime import workers
from nxhpc.runtime.workers import WorkerError
calls, real = [], os.kill
def spy(pid, sig):
    calls.append((pid, sig))
    real(pid, sig)
den = nxhpc.load_denoiser("tiny-dit", workers=2)
cap = np.zeros((3, den.config.cap_dim), np.float32)
lat = np.zeros((16, 8, 8), np.float32)
den.forward(lat, 0.5, cap)
dead, live = den.session(8, 8, 3).engine.pool.pids
real(live, signal.SIGSTOP)
real(dead, signal.SIGKILL)
time.sleep(0.3)
workers.os.kill = spy
try:
    den.forward(lat, 0.5, cap)
except WorkerError as e:
    print("WorkerError")
workers.os.kill = real
print("dead signalled", any(p == dead for p, _ in calls), "live signalled",
      (live, signal.SIGKILL) in calls)
den.close()""", models_root)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split("\n")[:2] == ["WorkerError", "dead signalled False live signalled True"], \
        (r.stdout, r.stderr[-2000:])
