"""SharedArena: layout vs a plain dict model (hypothesis stateful), fork sharing, lifetime.

Every scenario checks /dev/shm for segments of the process that created the arena, before and
after; named arenas serve as the negative control showing the check does see live segments.
"""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import nxhpc.runtime.shm as shm
from nsutil import run_with_tmpfs                # private mounts (tests/ is on sys.path)
from nxhpc.runtime.shm import ALIGN, SharedArena, cleanup_all, live_segments
from procutil import kernel_populates, linux_only, mapping_rss_kb

PID = os.getpid()

names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=6)
shapes = st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple)
dtypes = st.sampled_from([np.float32, np.uint8, np.int32, np.float64])


class ArenaVsDict(RuleBasedStateMachine):
    """Random layout; random writes through the arena and into a dict of private arrays."""

    @initialize(spec=st.dictionaries(names, st.tuples(shapes, dtypes), min_size=1, max_size=6),
                named=st.booleans())
    def make(self, spec, named):
        self.before = live_segments(PID)
        self.arena = SharedArena({k: (s, d) for k, (s, d) in spec.items()}, named=named)
        self.model = {k: np.zeros(s, dtype=d) for k, (s, d) in spec.items()}
        self.named = named

    @rule(data=st.data())
    def write(self, data):
        name = data.draw(st.sampled_from(sorted(self.model)))
        ref = self.model[name]
        if ref.size == 0:
            return
        flat = data.draw(st.integers(0, ref.size - 1))
        val = data.draw(st.integers(0, 100))     # fits every dtype drawn
        idx = np.unravel_index(flat, ref.shape)
        ref[idx] = val
        self.arena[name][idx] = val

    @rule(data=st.data())
    def fill(self, data):
        name = data.draw(st.sampled_from(sorted(self.model)))
        val = data.draw(st.integers(0, 50))
        self.model[name][...] = val
        self.arena[name][...] = val

    @invariant()
    def same_as_dict(self):
        if not hasattr(self, "arena"):
            return
        assert sorted(self.arena) == sorted(self.model)
        for k, ref in self.model.items():
            got = self.arena[k]
            assert got.shape == ref.shape and got.dtype == ref.dtype
            assert got.flags.c_contiguous and got.flags.writeable
            np.testing.assert_array_equal(got, ref)

    @invariant()
    def aligned_and_disjoint(self):
        if not hasattr(self, "arena"):
            return
        spans = sorted((b.offset, b.offset + b.nbytes) for b in self.arena.layout.values())
        for (a0, a1), (b0, _) in zip(spans, spans[1:]):
            assert a1 <= b0
        for b in self.arena.layout.values():
            assert b.offset % ALIGN == 0
            assert b.offset + b.nbytes <= self.arena.nbytes

    @invariant()
    def visible_iff_named(self):
        if not hasattr(self, "arena"):
            return
        live = live_segments(PID)
        assert (self.arena.name in live) == self.named

    def teardown(self):
        if hasattr(self, "arena"):
            self.arena.close()
            assert self.arena.closed
            with pytest.raises(ValueError, match="closed"):
                self.arena[next(iter(self.model))]
            assert live_segments(PID) == self.before


ArenaVsDict.TestCase.settings = settings(max_examples=25, stateful_step_count=15, deadline=None)
TestArenaVsDict = ArenaVsDict.TestCase


def test_default_float32_and_int_shape():
    with SharedArena({"a": (3, 4), "b": 5}) as a:
        assert a["a"].dtype == np.float32 and a["a"].shape == (3, 4)
        assert a["b"].shape == (5,)
        assert (a["a"] == 0).all() and (a["b"] == 0).all()
        assert a.nbytes == 64 + 64
        assert not a.linked
    assert live_segments(PID) == []


@linux_only
@pytest.mark.parametrize("by_madvise", [True, False])
def test_new_arena_is_zero_and_mapped_either_way(monkeypatch, by_madvise):
    """When the constructor returns, every page of a new arena is in this process's page tables
    (no first-touch fault left for a timed stage) and every buffer reads zero: by one
    ``madvise(MADV_POPULATE_WRITE)`` on a kernel that has it (5.14+), else (or with it disabled)
    by writing the zeros."""
    if not by_madvise:
        monkeypatch.setattr(shm, "populate", lambda mm: False)
    with SharedArena({"a": (4 << 20,), "b": ((1000,), np.int32), "c": ((7, 3), np.float64)}) as a:
        assert a.populated == (by_madvise and kernel_populates())
        assert mapping_rss_kb(a["a"].ctypes.data) * 1024 >= a.nbytes
        for name in a:
            assert not a[name].any(), name


@linux_only
def test_populate_maps_a_fresh_segment():
    """Negative control for the Rss reading above: a fresh segment mapped without touching it
    holds (almost) no pages; :func:`populate` maps them all, contents unchanged (zeros)."""
    import mmap
    size = 16 << 20
    fd = os.memfd_create("nxhpc-test-populate")
    try:
        os.posix_fallocate(fd, 0, size)
        mm = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    try:
        view = np.frombuffer(mm, np.uint8)
        addr = view.ctypes.data
        assert mapping_rss_kb(addr) * 1024 < size // 8
        assert shm.populate(mm) == kernel_populates()
        if kernel_populates():
            assert mapping_rss_kb(addr) * 1024 >= size
        assert not view.any()
        del view
    finally:
        mm.close()


def test_fork_child_writes_are_seen_by_parent():
    with SharedArena({"x": (4, 8)}) as a:
        pid = os.fork()
        if pid == 0:
            try:
                a["x"][...] = 7.5
                a.close()              # in a child: forgets views, never unlinks
            finally:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
        assert (a["x"] == 7.5).all()


def test_named_child_close_does_not_unlink():
    with SharedArena({"x": 16}, named=True) as a:
        assert a.name in live_segments(PID)        # negative control: the check sees it
        pid = os.fork()
        if pid == 0:
            a.close()
            os._exit(0)
        os.waitpid(pid, 0)
        assert a.name in live_segments(PID)
    assert live_segments(PID) == []


def test_named_unlinked_on_exception():
    with pytest.raises(RuntimeError):
        with SharedArena({"x": 16}, named=True) as a:
            assert a.name in live_segments(PID)
            raise RuntimeError("boom")
    assert live_segments(PID) == []


def test_cleanup_all_unlinks_named():
    a = SharedArena({"x": 16}, named=True)
    b = SharedArena({"y": 16}, named=True)
    assert len(live_segments(PID)) == 2
    assert cleanup_all() == 2
    assert live_segments(PID) == [] and a.closed and b.closed


def test_close_with_outstanding_view_is_safe():
    a = SharedArena({"x": 16}, named=True)
    v = a["x"]
    a.close()                                     # unlinks; mapping stays valid for `v`
    assert live_segments(PID) == []
    v[...] = 3.0
    assert (v == 3.0).all()
    a.close()                                     # idempotent


@pytest.mark.parametrize("bad, err, msg", [
    ({"x": (-1,)}, ValueError, "non-negative"),
    ({"x": "abc"}, TypeError, "shape"),
    ({"": 3}, TypeError, "non-empty"),
    ({"x": ((3,), object)}, TypeError, "numeric"),
    ([("x", 3)], TypeError, "mapping"),
])
def test_bad_specs(bad, err, msg):
    with pytest.raises(err, match=msg):
        SharedArena(bad)
    assert live_segments(PID) == []


def test_unknown_buffer_names_it():
    with SharedArena({"x": 3}) as a:
        with pytest.raises(KeyError, match="'nope'.*has: x"):
            a["nope"]


_CHILD = textwrap.dedent("""
    import os, sys, time
    from nxhpc.runtime.shm import SharedArena
    a = SharedArena({"x": (1024,)}, named=(sys.argv[1] == "named"))
    a["x"][...] = 1
    print(a.name, flush=True)
    if sys.argv[2] == "exit":
        sys.exit(0)            # atexit must unlink a named arena
    time.sleep(60)
""")


def _spawn(named: str, how: str):
    return subprocess.Popen([sys.executable, "-c", _CHILD, named, how],
                            stdout=subprocess.PIPE, text=True)


def test_unnamed_never_visible_even_on_sigkill():
    p = _spawn("unnamed", "wait")
    name = p.stdout.readline().strip()
    maps = open(f"/proc/{p.pid}/maps").read()
    assert f"/dev/shm/{name} (deleted)" in maps    # really a shm mapping, already unlinked
    assert live_segments(p.pid) == []
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert live_segments(p.pid) == []


def test_named_visible_then_unlinked_at_exit():
    p = _spawn("named", "exit")
    name = p.stdout.readline().strip()
    assert p.wait(timeout=30) == 0
    assert name.startswith(f"nxhpc_{p.pid}_")
    assert live_segments(p.pid) == []


def test_named_visible_while_alive():
    p = _spawn("named", "wait")
    try:
        name = p.stdout.readline().strip()
        assert live_segments(p.pid) == [name]     # negative control for the checks above
    finally:
        p.send_signal(signal.SIGINT)              # KeyboardInterrupt -> atexit unlinks
        p.wait(timeout=30)
    deadline = time.time() + 5
    while live_segments(p.pid) and time.time() < deadline:
        time.sleep(0.05)
    assert live_segments(p.pid) == []


@given(st.dictionaries(names, shapes, min_size=1, max_size=5))
@settings(max_examples=20)
def test_views_are_independent(spec):
    with SharedArena(spec) as a:
        for i, k in enumerate(a):
            a[k][...] = i + 1
        for i, k in enumerate(a):
            assert (a[k] == i + 1).all()
    assert live_segments(PID) == []


# ------------------------------------------------------------------ a /dev/shm too small (item 1)
_SMALL_SHM = textwrap.dedent("""
    import json, os, sys
    from nxhpc.runtime.shm import SharedArena
    st = os.statvfs("/dev/shm")
    out = {"size": st.f_blocks * st.f_frsize}
    with SharedArena({"x": (1024,)}) as a:        # 4 KiB: fits (negative control)
        a["x"][:] = 1
        out["small_ok"] = float(a["x"].sum())
    for named in (False, True):
        try:
            a = SharedArena({"x": (1024, 1024)}, named=named)   # 4 MiB > the tmpfs
            a["x"][:] = 1                          # a sparse segment dies here with SIGBUS
            out[str(named)] = "no error"
        except OSError as e:
            out[str(named)] = {"type": type(e).__name__, "msg": str(e),
                               "needed": getattr(e, "needed", None),
                               "free": getattr(e, "free", None)}
    out["left"] = os.listdir("/dev/shm")
    print(json.dumps(out))
""")


def test_small_dev_shm_is_a_clear_error_not_sigbus():
    """Docker's default /dev/shm is 64 MiB; here 256 KiB against a 4 MiB arena. Before the fix
    the segment was sparse and the first write killed the process with SIGBUS."""
    r = run_with_tmpfs([sys.executable, "-c", _SMALL_SHM], "/dev/shm", "size=256k", timeout=120)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    out = json.loads(r.stdout)
    assert out["size"] == 256 * 1024 and out["small_ok"] == 1024.0
    for named in ("False", "True"):
        e = out[named]
        assert isinstance(e, dict) and e["type"] == "ShmSpaceError", e
        assert e["needed"] == 4 * 2**20 and 0 <= e["free"] <= 256 * 1024
        assert f"needs {4 * 2**20} bytes" in e["msg"] and f"{e['free']} bytes" in e["msg"]
        assert "--shm-size" in e["msg"]
    assert out["left"] == []                      # nothing left in the small /dev/shm either


# --------------------------------------------------------------- memory, not only /dev/shm
def _meminfo_kb(key):
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return None


@linux_only
def test_memory_available_is_meminfo_within_the_cgroup():
    """MemAvailable + SwapFree as /proc/meminfo says (read here independently; it moves between
    the two reads by what other processes do), no more than the cgroup leaves."""
    want = (_meminfo_kb("MemAvailable") + (_meminfo_kb("SwapFree") or 0)) * 1024
    got = shm.memory_available_bytes()
    room = shm._cgroup_room()
    if room is None:
        assert abs(got - want) < 512 << 20, (got, want)
    else:
        assert got <= room + (512 << 20) and got <= want + (512 << 20)
    assert shm.memory_room(8 << 30) == 7 << 30                 # an eighth kept
    assert shm.memory_room(1 << 30) == (1 << 30) - (256 << 20)  # at least 256 MiB kept
    assert shm.memory_room(100 << 20) == 0 and shm.memory_room(None) is None


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_cgroup_limits_are_read_from_either_hierarchy(tmp_path, version):
    """The cgroup's limit less its usage, from a made-up hierarchy of each version; "max" (v2)
    and v1's huge value mean no limit, and a path not visible in the namespace falls back to
    the mount's root."""
    fs = tmp_path / "cgroup"
    proc = tmp_path / "cgroup.txt"
    if version == "v2":
        proc.write_text("0::/user.slice/job\n")
        d, files = fs / "user.slice" / "job", ("memory.max", "memory.current")
    else:
        proc.write_text("5:cpu,cpuacct:/x\n4:memory:/job\n0::/\n")
        d, files = fs / "memory" / "job", ("memory.limit_in_bytes", "memory.usage_in_bytes")
    d.mkdir(parents=True)
    (d / files[0]).write_text(f"{3 << 30}\n")
    (d / files[1]).write_text(f"{1 << 30}\n")
    assert shm._cgroup_room(str(proc), str(fs)) == 2 << 30
    (d / files[1]).write_text(f"{4 << 30}\n")                   # over its limit: no room
    assert shm._cgroup_room(str(proc), str(fs)) == 0
    # the usage's file cache is reclaimed before the OOM killer: it counts as room (tmpfs and
    # shared memory are swap-backed, on the anon lists, and do not); v1 has total_ fields
    pre = "" if version == "v2" else "total_"
    (d / "memory.stat").write_text(f"anon {1 << 30}\nshmem {1 << 29}\n{pre}active_file "
                                   f"{1 << 30}\n{pre}inactive_file {1 << 30}\n"
                                   + ("active_file 1\ninactive_file 1\n" if pre else ""))
    (d / files[1]).write_text(f"{3 << 30}\n")                   # 2 GiB of it file cache
    assert shm._cgroup_room(str(proc), str(fs)) == 2 << 30
    (d / "memory.stat").unlink()
    (d / files[0]).write_text("max\n" if version == "v2" else f"{(1 << 63) - 4096}\n")
    assert shm._cgroup_room(str(proc), str(fs)) is None         # no limit
    root = d.parent if version == "v2" else fs / "memory"       # the namespace hides the path
    for f in d.iterdir():
        f.rename(root / f.name)
    (root / files[0]).write_text(f"{5 << 30}\n")
    if version == "v2":                     # v2's root is fs itself; its files moved there
        for f in list(root.iterdir()):
            if f.is_file():
                f.rename(fs / f.name)
    assert shm._cgroup_room(str(proc), str(fs)) == 2 << 30      # 5 GiB less 3 in use
    assert shm._cgroup_room(str(tmp_path / "none"), str(fs)) is None


@pytest.mark.parametrize("named", [False, True])
def test_arena_larger_than_memory_is_refused_before_reserving(monkeypatch, named):
    """/dev/shm may be larger than the memory left (tmpfs takes any size): a segment that would
    bring in the out-of-memory killer is a ShmSpaceError (the CLIs' exit 7) before any page is
    reserved, naming what it needs and what can go to it; nothing is left behind."""
    from nxhpc.cli.codes import Exit, code_for
    monkeypatch.setattr(shm, "memory_available_bytes", lambda: 1 << 30)   # pretend 1 GiB
    room = (1 << 30) - (256 << 20)
    before = live_segments(os.getpid())
    with pytest.raises(shm.ShmSpaceError) as e:
        SharedArena({"x": (room // 4 + 1024,)}, named=named)
    assert e.value.memory == room and e.value.needed > room
    assert f"at most {room} bytes" in str(e.value) and "out-of-memory" in str(e.value)
    assert code_for(e.value) == Exit.SHM
    assert live_segments(os.getpid()) == before
    with SharedArena({"x": (1 << 20,)}, named=named) as a:     # control: within the room
        a["x"][:] = 1.0


def test_check_room_counts_the_address_space_limit_per_process(monkeypatch):
    """``ulimit -v`` was not checked up front: ``generate`` under it ran its text encoder and
    every step, then failed at the decode (exit 7; the memory helper's find). ``check_room``
    now refuses a size this process could not map under RLIMIT_AS (its ``VmSize`` counted),
    naming the limit. ``copies`` (ranks on this host) multiply the memory and /dev/shm need,
    not one process's address space. Controls: a size that fits maps; with no limit the same
    size passes the address-space check."""
    code = textwrap.dedent("""
        import resource, sys
        import nxhpc.runtime.shm as shm
        shm.memory_available_bytes = lambda: 1 << 50      # only the address space is short
        shm.shm_free_bytes = lambda where=shm.SHM_DIR: 1 << 50
        vm = [int(l.split()[1]) * 1024 for l in open("/proc/self/status")
              if l.startswith("VmSize:")][0]
        resource.setrlimit(resource.RLIMIT_AS, (vm + (256 << 20), resource.RLIM_INFINITY))
        for size, copies in ((1 << 30, 1), (64 << 20, 1), (64 << 20, 16)):
            try:
                shm.check_room(size, "the test's arena", copies=copies)
                print("fits", size, copies)
            except shm.ShmSpaceError as e:
                print("refused", size, copies, "|", e)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith(f"refused {1 << 30} 1 | the test's arena: not enough address "
                               f"space"), lines
    assert "ulimit -v" in lines[0]
    assert lines[1:] == [f"fits {64 << 20} 1", f"fits {64 << 20} 16"], lines
    monkeypatch.setattr(shm, "_address_space_room", lambda: None)      # no limit: passes
    monkeypatch.setattr(shm, "memory_available_bytes", lambda: 1 << 50)
    monkeypatch.setattr(shm, "shm_free_bytes", lambda where=shm.SHM_DIR: 1 << 50)
    shm.check_room(1 << 30, "the test's arena")
    monkeypatch.setattr(shm, "shm_free_bytes", lambda where=shm.SHM_DIR: 3 << 30)
    with pytest.raises(shm.ShmSpaceError):          # copies count against /dev/shm
        shm.check_room(1 << 30, "the test's arena", copies=4)
