"""Interrupt safety of the runtime (issue 12, item 4): Ctrl-C at a random moment of library use.

A child process builds and tears down a SharedArena and a WorkerPool (both spawn modes, named and
unnamed arenas) hundreds of times while a one-shot ``SIGALRM`` timer, armed at a random delay
spanning the whole cycle, raises ``KeyboardInterrupt`` -- the notebook "interrupt kernel" case.
Afterwards it counts what survived: segments in /dev/shm, child processes (zombies included),
descriptors, and whether any descriptor the "user" opened between cycles was closed or replaced
behind its back (a stale fd number closed twice). Every interrupt must surface as the
``KeyboardInterrupt`` itself (no EBADF, no AttributeError in its place).

Negative controls: the interrupts really happen (most cycles are cut) and land inside the
runtime's own functions (setup, dispatch and teardown), and the same loop run on the pre-fix
runtime leaked segments, children and descriptors (10 segments, ~140 children, ~400 fds measured
over 700 interrupts). Linux only (/proc, /dev/shm).
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest
from procutil import with_tests_on_path

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/fd") or not os.path.isdir("/dev/shm"),
                                reason="needs Linux /proc and /dev/shm")

_LOOP = textwrap.dedent(r"""
    import collections, gc, json, os, random, signal, sys, time, traceback
    from procutil import children_of                  # tests/, on this child's PYTHONPATH
    from nxhpc.runtime.shm import SharedArena, live_segments
    from nxhpc.runtime.workers import WorkerPool

    N, seed = int(sys.argv[1]), int(sys.argv[2])
    rng = random.Random(seed)
    RUNTIME = os.path.dirname(sys.modules["nxhpc.runtime.shm"].__file__)

    def on_alarm(signum, frame):
        raise KeyboardInterrupt
    signal.signal(signal.SIGALRM, on_alarm)

    def cycle(mode, named):
        with SharedArena({"x": (64, 64), "n": ((8,), "int64")}, named=named) as a:
            def f(lo, hi, arg):
                a["x"][lo:hi] += 1
            with WorkerPool(2, {"f": f}, mode=mode) as p:
                p.run("f", 64)
                p.run("f", 64)

    def children():
        return children_of(os.getpid())

    def fds():
        return {f: os.readlink(f"/proc/self/fd/{f}") for f in os.listdir("/proc/self/fd")
                if os.path.exists(f"/proc/self/fd/{f}")}

    for mode in ("pool", "stage", "pool", "stage"):   # warm up: imports, lifeline, tracker
        cycle(mode, mode == "pool")
    times = []
    for i in range(8):                             # the cycle's length: the timer's range
        t0 = time.perf_counter()
        cycle(("pool", "stage")[i % 2], i % 4 < 2)
        times.append(time.perf_counter() - t0)
    per = sorted(times)[len(times) // 2]
    fds0, kids0 = fds(), set(children())
    errors, where = collections.Counter(), collections.Counter()
    user = []                                      # (fd, inode) the "user" opened meanwhile
    clobbered = 0
    interrupted = 0
    for i in range(N):
        mode = rng.choice(("pool", "stage"))
        named = rng.random() < 0.5
        try:
            try:
                signal.setitimer(signal.ITIMER_REAL, rng.uniform(1e-6, 1.3 * per))
                cycle(mode, named)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except KeyboardInterrupt as e:
            interrupted += 1
            inner = [fr for fr in traceback.extract_tb(e.__traceback__)
                     if fr.filename.startswith(RUNTIME)]
            if inner:
                where[inner[-1].name] += 1
        except BaseException as e:  # noqa: BLE001
            errors[f"{type(e).__name__}: {str(e)[:80]}"] += 1
        for fd, ino in user:                       # the user's files are still theirs
            try:
                if os.fstat(fd).st_ino != ino:
                    clobbered += 1
            except OSError:
                clobbered += 1
        fd = os.open(sys.argv[3], os.O_RDONLY)
        user.append((fd, os.fstat(fd).st_ino))
        if len(user) > 16:
            os.close(user.pop(0)[0])
    for fd, _ in user:
        os.close(fd)
    gc.collect()
    time.sleep(0.2)
    now = fds()
    print(json.dumps({
        "per_cycle_s": per, "cycles": N, "interrupted": interrupted, "errors": dict(errors),
        "where": dict(where), "user_fds_clobbered": clobbered,
        "segments": live_segments(os.getpid()),
        "children": sorted(set(children()) - kids0),
        "new_fds": {k: v for k, v in now.items() if k not in fds0 and k not in
                    {str(f) for f, _ in user}},
    }))
""")


@pytest.mark.parametrize("seed", [1, 2])
def test_random_interrupts_leak_nothing(seed, tmp_path):
    sentinel = tmp_path / "user-file"
    sentinel.write_text("mine")
    r = subprocess.run([sys.executable, "-c", _LOOP, "600", str(seed), str(sentinel)],
                       capture_output=True, text=True, timeout=600, env=with_tests_on_path())
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(r.stdout.strip().splitlines()[-1])
    # the interrupts happened, at many places inside the runtime (negative controls)
    assert rep["interrupted"] >= rep["cycles"] // 10, rep
    assert len(rep["where"]) >= 3, rep["where"]
    # ... and every one surfaced as itself, leaving nothing behind
    assert rep["errors"] == {}, rep["errors"]
    assert "Exception ignored" not in r.stderr, r.stderr[-3000:]
    assert rep["segments"] == [], rep
    assert rep["children"] == [], rep
    assert rep["new_fds"] == {}, rep
    assert rep["user_fds_clobbered"] == 0, rep
