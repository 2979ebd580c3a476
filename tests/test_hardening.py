"""Issue 12, the items that live in the block, the engine, the models package and the CLIs:
4 (Engine / BlockRunner / Block part), 6, 10, 11, 12, 14. (Items 1-5, 7-9, 13: test_workers.py (interrupts),
test_shm.py, test_workers.py, test_outfile.py, test_blockrun.py, test_ddp.py.)

Owns: one test (or a few) per defect, each written to fail on the code before its fix, with a
negative control where a check could pass vacuously. Must not: depend on another test's state
(each makes its own models directory or uses the module's), or leave a process, a segment or a
temporary behind. Linux only where it reads /proc or makes private mounts (skipped elsewhere).
"""
import fcntl
import gc
import json
import os
import resource
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from nxhpc.dit.block import BlockRunner, run_layers, validate_inputs
from nxhpc.dit.plan import EPS_RANGE, BlockPlan, Engine
from nxhpc.models import ModelNotFoundError, ModelsDirError, open_model
from nxhpc.models.modeldir import sweep_stale
from nxhpc.runtime.shm import live_segments
from nxhpc.runtime.workers import STOP_GRACE_S
from nsutil import require_private_mounts, run_script      # tests/ is on sys.path
from procutil import alive, children_of, with_tests_on_path

ROOT = Path(__file__).resolve().parents[1]
PID = os.getpid()
LINUX = os.path.isdir("/proc/self/fd") and os.path.isdir("/dev/shm")
linux_only = pytest.mark.skipif(not LINUX, reason="needs Linux /proc and /dev/shm")


@pytest.fixture(scope="module")
def models_root(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="module")
def tiny(models_root):
    return open_model("tiny", models_dir=models_root)


def _env(root, **extra):
    return dict(os.environ, NXHPC_MODELS=str(root), **extra)


def _cli(module, args, root, timeout=300, **kw):
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                          env=_env(root), timeout=timeout, cwd=ROOT, **kw)


def _mapped_arenas() -> list[str]:
    """Arena segments still mapped into this process (unlinked ones show as '(deleted)')."""
    with open("/proc/self/maps") as f:
        return [ln for ln in f if "/dev/shm/nxhpc_" in ln]


def _inputs(m):
    return m.blk_in(0), m.t_emb(), m.pe()


# ============================================================ item 4: Engine / BlockRunner part
def test_half_built_engine_and_runner_close_is_a_noop():
    """close() of an Engine / BlockRunner whose __init__ never ran (an interrupt before its
    first statement) touches no attribute that does not exist yet. Before: AttributeError
    ('pool', 'engine') -- the error that replaced the KeyboardInterrupt."""
    for cls in (Engine, BlockRunner):
        obj = object.__new__(cls)
        obj.close()
        obj.close()
    assert object.__new__(Engine).closed


@linux_only
@pytest.mark.parametrize("where", ["in SharedArena()", "in WorkerPool()", "after Engine()"])
def test_interrupt_in_setup_is_the_interrupt_and_frees_all(tiny, monkeypatch, where):
    """A KeyboardInterrupt during setup -- inside Engine.__init__ (at the arena, at the fork),
    or right after Engine() returned, before BlockRunner stored it -- comes out of Engine(),
    BlockRunner() and Block.forward() as itself, with nothing mapped or forked, without any
    garbage collection. Before: the last case left the engine's workers and arena alive (a
    reference cycle) until the cyclic GC ran; the first two are regression checks."""
    import nxhpc.dit.block as block
    import nxhpc.nn.engine as plan
    mod, name = (block, "Engine") if where == "after Engine()" else (plan, where[3:-2])
    real = getattr(mod, name)
    calls = []

    def interrupted(*a, **k):
        calls.append(where)
        if where == "after Engine()":
            real(*a, **k)                  # built, then dropped unstored
        elif where == "in WorkerPool()":   # after the arena exists: it must be released
            assert len(_mapped_arenas()) == 1
        raise KeyboardInterrupt
    x, t, pe = _inputs(tiny)
    w = {0: tiny.layer_weights(0)}
    kids = set(children_of(PID))
    gc.disable()
    try:
        monkeypatch.setattr(mod, name, interrupted)
        if mod is plan:
            with pytest.raises(KeyboardInterrupt):
                Engine([(BlockPlan(tiny.config), x.shape[0])], w, workers=2)
        with pytest.raises(KeyboardInterrupt):
            BlockRunner(tiny.config, w, x.shape[0], workers=2)
        with tiny.block(0) as blk:
            with pytest.raises(KeyboardInterrupt):
                blk.forward(x, t, pe, workers=2)
            assert blk._runner is None
        assert calls == [where] * (3 if mod is plan else 2)    # the patched step really ran
        assert _mapped_arenas() == [] and set(children_of(PID)) == kids
        monkeypatch.setattr(mod, name, real)
        with tiny.block(0) as blk:                      # negative control: the check sees one
            blk.forward(x, t, pe, workers=2)
            assert len(_mapped_arenas()) == 1 and len(set(children_of(PID)) - kids) == 2
    finally:
        gc.enable()
    assert live_segments(PID) == []


@linux_only
@pytest.mark.parametrize("spawn", ["pool", "stage"])
def test_dropped_engine_frees_workers_and_arena_without_gc(tiny, spawn):
    """An Engine dropped without close() -- e.g. an interrupt between Engine() returning and
    the caller's store -- is released when its last reference goes. Before: the pool's tasks
    held the engine (engine -> pool -> task -> engine), so its workers and arena lived until
    the cyclic garbage collector happened to run."""
    x, t, pe = _inputs(tiny)
    T, D, hd = x.shape[0], tiny.config.dim, tiny.config.head_dim
    plan = BlockPlan(tiny.config)
    kids = set(children_of(PID))                # (e.g. multiprocessing's resource tracker)
    gc.disable()
    try:
        e = Engine([(plan, T)], {0: tiny.layer_weights(0)}, workers=2, spawn=spawn,
                   buffers={"x": (T, D), "pe": (T, hd // 2, 2, 2)})
        np.copyto(e.buffer("x"), x)
        np.copyto(e.buffer("pe"), pe)
        e.run(plan, 0, e.buffer("x"), e.buffer("pe"), adaln_m=e.adaln(0, t))
        pids = list(e.pool.pids)
        assert len(_mapped_arenas()) == 1 and (spawn == "stage" or all(map(alive, pids)))
        del e
        assert _mapped_arenas() == []
        assert not any(map(alive, pids)) and set(children_of(PID)) == kids
    finally:
        gc.enable()


_LOOP = textwrap.dedent(r"""
    import collections, gc, json, os, random, signal, sys, time, traceback
    import numpy as np
    from procutil import children_of                  # tests/, on this child's PYTHONPATH
    from nxhpc.models import open_model
    from nxhpc.dit.block import run_layers
    from nxhpc.dit.plan import BlockPlan, Engine
    from nxhpc.runtime.shm import live_segments

    N, seed, models = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    rng = random.Random(seed)
    DIT = os.path.dirname(sys.modules["nxhpc.dit.block"].__file__)
    RUNTIME = os.path.dirname(sys.modules["nxhpc.runtime.shm"].__file__)
    m = open_model("tiny", models_dir=models)
    cfg = m.config
    x, t, pe = m.blk_in(0), m.t_emb(), m.pe()
    T, D, hd = x.shape[0], cfg.dim, cfg.head_dim
    w01 = {0: m.layer_weights(0), 1: m.layer_weights(1)}
    plan = BlockPlan(cfg, "layers")

    def on_alarm(signum, frame):
        raise KeyboardInterrupt
    signal.signal(signal.SIGALRM, on_alarm)

    def kept(mode):                 # Block kept between calls
        with m.block(0) as blk:
            blk.forward(x, t, pe, workers=2, spawn=mode)
            blk.forward(x, t, pe, workers=2, spawn=mode)

    def single(mode):               # Block, one call: forks and releases inside forward
        m.block(0).forward(x, t, pe, workers=2, spawn=mode)

    def chain(mode):                # run_layers: one BlockRunner for two layers
        run_layers(m, [0, 1], x, pe, t_emb=t, workers=2, spawn=mode, weights=w01)

    def engine(mode):               # the Engine itself
        with Engine([(plan, T)], w01, workers=2, spawn=mode,
                    buffers={"x": (T, D), "pe": (T, hd // 2, 2, 2)}) as e:
            np.copyto(e.buffer("x"), x)
            np.copyto(e.buffer("pe"), pe)
            e.run(plan, 0, e.buffer("x"), e.buffer("pe"), adaln_m=e.adaln(0, t))

    CYCLES = (kept, single, chain, engine)

    def children():
        return children_of(os.getpid())

    def mapped():
        with open("/proc/self/maps") as fh:
            return sorted({ln.split()[5] for ln in fh if "/dev/shm/nxhpc_" in ln})

    def fds():
        return {f: os.readlink(f"/proc/self/fd/{f}") for f in os.listdir("/proc/self/fd")
                if os.path.exists(f"/proc/self/fd/{f}")}

    for c in CYCLES:                               # warm up: imports, lifeline, caches
        for mode in ("pool", "stage"):
            c(mode)
    times = collections.defaultdict(list)
    for _ in range(3):                             # each cycle's length: its timer's range
        for c in CYCLES:
            for mode in ("pool", "stage"):
                t0 = time.perf_counter()
                c(mode)
                times[(c, mode)].append(time.perf_counter() - t0)
    per = {k: sorted(v)[1] for k, v in times.items()}
    gc.collect()
    fds0, kids0 = fds(), set(children())
    errors, where = collections.Counter(), collections.Counter()
    interrupted = 0
    gc.disable()          # what is left must be released by refcounting, not a lucky GC run
    for i in range(N):
        c = rng.choice(CYCLES)
        mode = rng.choice(("pool", "stage"))
        try:
            try:
                signal.setitimer(signal.ITIMER_REAL, rng.uniform(1e-6, 1.2 * per[(c, mode)]))
                c(mode)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except KeyboardInterrupt as e:
            interrupted += 1
            inner = [fr for fr in traceback.extract_tb(e.__traceback__)
                     if fr.filename.startswith((DIT, RUNTIME))]
            if inner:
                where[f"{os.path.basename(inner[-1].filename)}:{inner[-1].name}"] += 1
        except BaseException as e:  # noqa: BLE001
            errors[f"{type(e).__name__}: {str(e)[:80]}"] += 1
    time.sleep(0.2)
    before_gc = {"children": sorted(set(children()) - kids0), "mapped": mapped(),
                 "new_fds": {k: v for k, v in fds().items() if k not in fds0}}
    gc.enable()
    gc.collect()
    time.sleep(0.2)
    print(json.dumps({
        "cycles": N, "interrupted": interrupted, "errors": dict(errors), "where": dict(where),
        "before_gc": before_gc, "segments": live_segments(os.getpid()),
        "children": sorted(set(children()) - kids0), "mapped": mapped(),
        "new_fds": {k: v for k, v in fds().items() if k not in fds0},
    }))
""")


@linux_only
@pytest.mark.parametrize("seed", [1, 2])
def test_random_interrupts_in_block_runs_leak_nothing(models_root, tiny, seed):
    """The random-interrupt loop of test_workers.py (the runtime alone) on block runs (a kept Block, a one-call
    Block, run_layers, the Engine), both spawn modes: every interrupt surfaces as itself; no
    worker, mapped arena or descriptor survives -- already before any garbage collection.
    Before: 2 live workers and 3 mapped arenas after 300 interrupts (freed only by gc)."""
    r = subprocess.run([sys.executable, "-c", _LOOP, "300", str(seed), str(models_root)],
                       capture_output=True, text=True, timeout=600, cwd=ROOT,
                       env=with_tests_on_path())
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(r.stdout.strip().splitlines()[-1])
    # negative controls: the interrupts happened, at many places, in the block code too
    assert rep["interrupted"] >= rep["cycles"] // 2, rep
    assert len(rep["where"]) >= 5, rep["where"]
    assert any(not k.startswith(("proc.py", "shm.py", "workers.py")) for k in rep["where"]), \
        rep["where"]                             # ... also in the block code, not only runtime
    assert rep["errors"] == {}, rep["errors"]
    assert "Exception ignored" not in r.stderr, r.stderr[-3000:]
    assert rep["before_gc"] == {"children": [], "mapped": [], "new_fds": {}}, rep["before_gc"]
    assert rep["segments"] == [] and rep["children"] == [] and rep["mapped"] == [], rep
    assert rep["new_fds"] == {}, rep


# ============================================================ item 6: the models directory
def _assert_models_dir_error(r, root, code, *words):
    assert r.returncode == code, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    assert str(root) in r.stderr and all(w in r.stderr for w in words), r.stderr


def test_models_dir_not_a_directory(tmp_path):
    """NXHPC_MODELS / --models-dir naming a file: exit 9 in blockrun and ``models`` alike, one line
    naming the path. Before: exit 70 / 1 with a FileExistsError traceback."""
    root = tmp_path / "models"
    root.write_text("not a directory")
    for args in (["tiny", "1"], ["mymodel", "1"]):
        _assert_models_dir_error(_cli("nxhpc.blockrun", args, root), root, 9, "not a directory")
    _assert_models_dir_error(_cli("nxhpc.models", ["show", "tiny"], root), root, 9,
                             "not a directory")
    _assert_models_dir_error(_cli("nxhpc.models", ["--models-dir", str(root), "make", "x",
                                                   "--dim", "96", "--heads", "1"], tmp_path),
                             root, 9, "not a directory")
    with pytest.raises(ModelsDirError, match="not a directory"):
        open_model("tiny", models_dir=root)
    assert root.read_text() == "not a directory"


def test_models_dir_read_only(models_root, tiny, tmp_path):
    """A read-only models directory: generating a built-in there is exit 9 (every CLI) naming it
    (before: a traceback); a model already in it runs (read-only is fine for reading)."""
    require_private_mounts()
    ro = tmp_path / "ro"
    ro.mkdir()
    src = models_root / "tiny"
    assert (src / "model.gguf").is_file()
    script = textwrap.dedent(f"""
        set -e
        mount -t tmpfs -o size=64k,ro nxtest "{ro}"
        cd "{ROOT}"
        set +e
        "{sys.executable}" -m nxhpc.blockrun tiny 1 2>"{tmp_path}/e1"; echo "rc1=$?"
        "{sys.executable}" -m nxhpc.models show tiny 2>"{tmp_path}/e2" >/dev/null; echo "rc2=$?"
        umount "{ro}"
        cp -r "{src}" "{ro}/tiny"
        mount --bind "{ro}" "{ro}"
        mount -o remount,ro,bind "{ro}"
        touch "{ro}/x" 2>/dev/null && echo writable
        "{sys.executable}" -m nxhpc.blockrun tiny 1 --models-dir "{ro}" >/dev/null \\
            2>"{tmp_path}/e3"; echo "rc3=$?"
    """)
    r = run_script(script, env=_env(ro), timeout=300)
    out = r.stdout
    e1, e2, e3 = ((tmp_path / f"e{i}").read_text() for i in (1, 2, 3))
    assert "rc1=9" in out and "rc2=9" in out, (out, r.stderr, e1, e2)
    for e in (e1, e2):
        assert "Traceback" not in e and str(ro) in e and "not writable" in e, e
    assert "writable\n" not in out and "rc3=0" in out, (out, e3)     # positive control


def test_models_dir_full(tmp_path):
    """A models directory too small for the model: refused before the work (exit 9, needed
    and free MB named); a write that fails anyway (a file-size limit standing in for a disk
    that fills meanwhile) is exit 9 too, leaving no temporary behind. Before: exit 70 / 1
    with a traceback."""
    require_private_mounts()
    small = tmp_path / "small"
    small.mkdir()
    script = textwrap.dedent(f"""
        mount -t tmpfs -o size=2m nxtest "{small}" || exit 99
        cd "{ROOT}"
        "{sys.executable}" -m nxhpc.blockrun tiny 1 2>"{tmp_path}/e1"; echo "rc1=$?"
        "{sys.executable}" -m nxhpc.models make tiny 2>"{tmp_path}/e2"; echo "rc2=$?"
        ls -A "{small}" > "{tmp_path}/left"
    """)
    r = run_script(script, env=_env(small), timeout=300)
    e1, e2 = ((tmp_path / f"e{i}").read_text() for i in (1, 2))
    assert "rc1=9" in r.stdout and "rc2=9" in r.stdout, (r.stdout, r.stderr, e1, e2)
    for e in (e1, e2):
        assert "Traceback" not in e and str(small) in e and "too full" in e and "free" in e, e
    assert (tmp_path / "left").read_text().split() in ([], [".tiny.lock"])

    limited = tmp_path / "limited"               # the write itself fails: EFBIG at 1 MB

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    r = subprocess.run([sys.executable, "-m", "nxhpc.blockrun", "tiny", "1"], capture_output=True,
                       text=True, env=_env(limited), cwd=ROOT, timeout=300, preexec_fn=limit)
    _assert_models_dir_error(r, limited, 9, "cannot write built-in model 'tiny'")
    assert sorted(p.name for p in limited.iterdir()) == [".tiny.lock"]


# ============================================================ item 10: float32 narrowing, eps
def test_inputs_checked_after_narrowing_to_float32(tiny):
    """A float64 input of 1e300 is finite but inf in float32: refused, naming the input and the
    index. Before: accepted, and the block returned all-NaN silently."""
    x, t, pe = _inputs(tiny)
    blk = tiny.block(0)
    big = x.astype(np.float64)
    big[3, 7] = 1e300
    with pytest.raises(ValueError, match=r"x has 1 non-finite.*float32.*\(3, 7\)"):
        blk.forward(big, t, pe, workers=1)
    t64 = t.astype(np.float64)
    t64[0] = -1e40
    with pytest.raises(ValueError, match=r"t_emb .*float32"):
        blk.forward(x, t64, pe, workers=1)
    with pytest.raises(ValueError, match=r"t_emb .*float32"):
        blk.adaln(t64)
    m64 = blk.adaln(t).astype(np.float64)
    m64[5] = 1e39
    with pytest.raises(ValueError, match=r"adaln_m .*float32"):
        blk.forward(x, pe=pe, adaln_m=m64, workers=1)
    T, D, hd = x.shape[0], tiny.config.dim, tiny.config.head_dim
    plan = BlockPlan(tiny.config)
    with Engine([(plan, T)], {0: blk.weights}, workers=1,
                buffers={"x": (T, D), "pe": (T, hd // 2, 2, 2)}) as e:
        with pytest.raises(ValueError, match=r"adaln_m .*float32"):
            e.run(plan, 0, e.buffer("x"), e.buffer("pe"), adaln_m=m64)
        with pytest.raises(ValueError, match=r"t_emb .*float32"):
            e.adaln(0, t64)
    # negative controls: float64 inputs within float32's range run, bit-identical to float32;
    # the largest float32 value itself passes the check
    ref, _ = blk.forward(x, t, pe, workers=1)
    out, _ = blk.forward(x.astype(np.float64), t.astype(np.float64), pe.astype(np.float64),
                         workers=1)
    assert np.array_equal(out, ref)
    edge = x.astype(np.float64)
    edge[0, 0] = float(np.finfo(np.float32).max)
    validate_inputs(tiny.config, edge, pe, t_emb=t)


@pytest.mark.parametrize("eps", [1e-50, 1e-39, 3.5e38, 1e39])
def test_eps_outside_float32_is_refused(tiny, eps):
    """eps is narrowed to float32 in the kernels: 1e-50 -> 0 (a zero row, i.e. padding, turns
    NaN), 1e-39 -> subnormal, >= 3.5e38 -> inf. Refused in Block.forward, run_layers,
    Engine.run and blockrun --eps (exit 2). Before: accepted everywhere (Engine.run did not
    check eps at all)."""
    x, t, pe = _inputs(tiny)
    T, D, hd = x.shape[0], tiny.config.dim, tiny.config.head_dim
    with pytest.raises(ValueError, match="eps .*float32"):
        tiny.block(0).forward(x, t, pe, workers=1, eps=eps)
    with pytest.raises(ValueError, match="eps .*float32"):
        run_layers(tiny, [0], x, pe, t_emb=t, workers=1, eps=eps)
    plan = BlockPlan(tiny.config)
    with Engine([(plan, T)], {0: tiny.layer_weights(0)}, workers=1,
                buffers={"x": (T, D), "pe": (T, hd // 2, 2, 2)}) as e:
        for bad in (eps, 0.0, -1.0):
            with pytest.raises(ValueError, match="eps"):
                e.run(plan, 0, e.buffer("x"), e.buffer("pe"), adaln_m=e.adaln(0, t), eps=bad)


def test_eps_bounds_run_finite_on_a_zero_row(tiny, models_root):
    """Positive control of the eps bound: at both ends of EPS_RANGE a block whose input has an
    all-zero row (padding) gives a finite output; blockrun --eps 1e-50 is a usage error."""
    x, t, pe = _inputs(tiny)
    x = x.copy()
    x[2] = 0.0
    for eps in EPS_RANGE:
        out, _ = tiny.block(0).forward(x, t, pe, workers=2, eps=eps)
        assert np.isfinite(out).all(), eps
    r = _cli("nxhpc.blockrun", ["tiny", "1", "--eps", "1e-50"], models_root)
    assert r.returncode == 2 and "float32" in r.stderr and "Traceback" not in r.stderr, r.stderr


# ============================================================ item 11: threads
def test_kept_block_from_threads_is_serialized(tiny):
    """One kept Block used from 4 threads (3 calls each): calls are serialized by the Block's
    lock -- every output is the single-thread result bit for bit, no error, the workers are
    the same ones throughout. Before: spurious worker errors, EBADF and 1 s stalls."""
    x, t, pe = _inputs(tiny)
    ref, _ = tiny.block(0).forward(x, t, pe, workers=2)
    outcomes, pids = [], set()
    with tiny.block(0) as blk:
        blk.forward(x, t, pe, workers=2)
        pids0 = tuple(blk._runner.pool.pids)

        def call():
            for _ in range(3):
                try:
                    out, _ = blk.forward(x, t, pe, workers=2)
                    outcomes.append("same" if np.array_equal(out, ref) else "DIFFERENT")
                    pids.add(tuple(blk._runner.pool.pids))
                except BaseException as e:  # noqa: BLE001
                    outcomes.append(f"{type(e).__name__}: {e}")
        ts = [threading.Thread(target=call) for _ in range(4)]
        for th in ts:
            th.start()
        for th in ts:
            th.join(120)
    assert outcomes == ["same"] * 12, outcomes
    assert pids == {pids0}
    assert live_segments(PID) == []


def test_engine_from_threads_is_serialized(tiny):
    """One Engine, two threads each running the block on its own row range of a joint buffer
    (10 runs each): Engine.run is serialized, every result is the single-run one."""
    x, t, pe = _inputs(tiny)
    T, D, hd = x.shape[0], tiny.config.dim, tiny.config.head_dim
    plan = BlockPlan(tiny.config)
    w = {0: tiny.layer_weights(0)}
    ref, _ = tiny.block(0).forward(x, t, pe, workers=2)
    errors = []
    with Engine([(plan, T)], w, workers=2, buffers={"u": (2 * T, D), "o": (2 * T, D),
                                                    "pe": (2 * T, hd // 2, 2, 2)}) as e:
        u, o, p = e.buffer("u"), e.buffer("o"), e.buffer("pe")
        for k in (0, 1):
            u[k * T:(k + 1) * T] = x
            p[k * T:(k + 1) * T] = pe
        m = e.adaln(0, t)

        def call(k):
            for _ in range(10):
                try:
                    sl = slice(k * T, (k + 1) * T)
                    e.run(plan, 0, u[sl], p[sl], adaln_m=m, out=o[sl])
                    if not np.array_equal(o[sl], ref):
                        errors.append(f"thread {k}: different output")
                except BaseException as ex:  # noqa: BLE001
                    errors.append(f"thread {k}: {type(ex).__name__}: {ex}")
        ts = [threading.Thread(target=call, args=(k,)) for k in (0, 1)]
        for th in ts:
            th.start()
        for th in ts:
            th.join(120)
    assert errors == [], errors[:5]


@pytest.mark.parametrize("mode", ["pool", "stage"])
def test_worker_pool_from_threads_is_serialized(mode):
    """The pool itself (used directly, as the trainer does): stages dispatched from 3 threads
    at once run one after the other -- no garbled replies, no EBADF -- and each stage did its
    whole band split (a per-stage counter in shared memory)."""
    from nxhpc.runtime.shm import SharedArena
    from nxhpc.runtime.workers import WorkerPool
    errors = []
    with SharedArena({"hits": ((3, 64), np.int64)}) as a:
        def f(lo, hi, k):
            a["hits"][k, lo:hi] += 1
        with WorkerPool(2, {"f": f}, mode=mode) as p:
            def call(k):
                for _ in range(15 if mode == "pool" else 4):
                    try:
                        p.run("f", 64, arg=k)
                    except BaseException as e:  # noqa: BLE001
                        errors.append(f"{type(e).__name__}: {e}")
                        return
            ts = [threading.Thread(target=call, args=(k,)) for k in range(3)]
            for th in ts:
                th.start()
            for th in ts:
                th.join(120)
        runs = 15 if mode == "pool" else 4
        assert errors == [], errors[:3]
        assert (a["hits"] == runs).all(), a["hits"]


# ============================================================ item 12: first-use generation
class _Reader(threading.Thread):
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


@linux_only
def test_generation_waiter_says_for_whom_and_ctrl_c_is_130(tmp_path):
    """While another process holds a built-in's generation lock, a run says that it waits,
    for which lock and pid -- and that the holder is stopped, when it is; Ctrl-C then exits 130
    without a traceback; once the holder is gone the run generates and passes. Before: it
    waited silently (forever, for a stopped holder)."""
    root = tmp_path / "models"
    root.mkdir()
    lock = root / ".tiny.lock"
    with open(lock, "a+") as fh:                            # this process holds it
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        p = subprocess.Popen([sys.executable, "-m", "nxhpc.blockrun", "tiny", "1"],
                             stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                             cwd=ROOT, env=_env(root))
        rd = _Reader(p.stderr)
        rd.start()
        assert rd.wait_for("waiting"), rd.text
        p.send_signal(signal.SIGINT)
        assert p.wait(30) == 130
        rd.join(5)
    assert f"waiting for the lock {lock}: pid {PID} is generating 'tiny'" in rd.text, rd.text
    assert "it is stopped" not in rd.text and "Traceback" not in rd.text, rd.text
    # a stopped holder (another process): the waiter says so, and goes on once it is gone
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, sys, time
        fh = open({str(lock)!r}, "a+"); fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        print("locked", flush=True); time.sleep(600)""")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        holder.send_signal(signal.SIGSTOP)
        p = subprocess.Popen([sys.executable, "-m", "nxhpc.blockrun", "tiny", "1"],
                             stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             cwd=ROOT, env=_env(root))
        rd = _Reader(p.stderr)
        rd.start()
        assert rd.wait_for("kill -CONT"), rd.text
        assert f"pid {holder.pid} is generating 'tiny' (it is stopped" in rd.text, rd.text
    finally:
        holder.kill()
        holder.wait()
    assert p.wait(300) == 0, rd.text
    assert not [q for q in root.iterdir() if ".tmp-" in q.name]


def test_stale_temporaries_are_swept(tmp_path):
    """Temporaries of dead writers are removed on the next generation: one named with a pid
    that is gone, one without a pid (an older writer) untouched for over an hour; a live
    writer's and a fresh pid-less one are kept (negative controls). Before: never swept."""
    root = tmp_path / "models"
    root.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    live = subprocess.Popen(["sleep", "600"])
    try:
        paths = {k: root / n for k, n in {
            "dead": f".tiny.tmp-{dead}-abc123", "old_format": ".tiny.tmp-deadbeef",
            "live": f".tiny.tmp-{live.pid}-xyz789", "fresh_old_format": ".tiny.tmp-0a1b2c3d",
            "other_model": f".mid.tmp-{dead}-abc123"}.items()}
        for q in paths.values():
            q.mkdir()
            (q / "model.gguf").write_bytes(b"partial")
        os.utime(paths["old_format"], (0, 0))
        m = open_model("tiny", models_dir=root)
        assert m.config.dim == 384
        assert not paths["dead"].exists() and not paths["old_format"].exists()
        assert paths["live"].exists() and paths["fresh_old_format"].exists()
        assert paths["other_model"].exists()
    finally:
        live.kill()
        live.wait()


def test_sweep_puts_back_a_dead_replacers_old_model(tmp_path):
    """A writer killed between its two renames left the previous model as ``...-old`` and no
    model: the sweep puts it back instead of deleting it."""
    old = tmp_path / ".m.tmp-999999999-abc-old"
    old.mkdir()
    (old / "model.gguf").write_bytes(b"the previous model")
    assert sweep_stale(tmp_path, "m") == []
    assert (tmp_path / "m" / "model.gguf").read_bytes() == b"the previous model"
    assert not old.exists()


@linux_only
def test_sigkilled_generator_temporary_is_swept(tmp_path):
    """The real case: a generator SIGKILLed while writing leaves ``.mid.tmp-<pid>-*``; the next
    run sweeps it (and generates, exit 0)."""
    root = tmp_path / "models"
    for _attempt in range(4):
        p = subprocess.Popen([sys.executable, "-m", "nxhpc.models", "make", "mid"], cwd=ROOT,
                             env=_env(root), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        left = []
        while p.poll() is None and not left:
            left = [q for q in root.glob(".mid.tmp-*") if q.is_dir()] if root.is_dir() else []
            time.sleep(0.002)
        p.kill()
        p.wait()
        left = [q for q in root.glob(".mid.tmp-*") if q.is_dir()]
        if left:
            break
        if (root / "mid").exists():
            import shutil
            shutil.rmtree(root / "mid")
    assert left, "never caught the generator while it wrote"
    r = _cli("nxhpc.blockrun", ["mid", "1"], root)
    assert r.returncode == 0, r.stderr
    assert not [q for q in root.iterdir() if ".tmp-" in q.name]


_SWALLOW = textwrap.dedent(r"""
    import os, signal, sys
    import nxhpc.models.modeldir as md
    real, mode = md.write_gguf, sys.argv[1]

    def write_gguf(*a, **k):
        # what numpy's tofile does with a KeyboardInterrupt raised inside it: it catches it
        # and raises its own TypeError ("expected str, bytes or os.PathLike object, not
        # BufferedWriter"; measured: 1 in ~300 interrupts of a tofile loop)
        try:
            if mode != "no-signal":
                os.kill(os.getpid(), signal.SIGINT)
            real(*a, **k)
        except KeyboardInterrupt:
            pass
        raise TypeError("expected str, bytes or os.PathLike object, not BufferedWriter")
    md.write_gguf = write_gguf
    if sys.argv[2] == "blockrun":
        from nxhpc.blockrun import main
        sys.exit(main(["tiny", "1"]))
    from nxhpc.models.cli import main
    sys.exit(main(["make", "tiny"]))
""")


@pytest.mark.parametrize("cli", ["blockrun", "models"])
def test_ctrl_c_replaced_by_c_code_during_generation_exits_130(tmp_path, cli):
    """A Ctrl-C during generation whose KeyboardInterrupt numpy's tofile swallowed (raising a
    TypeError instead) exits 130 like any Ctrl-C, leaving no temporary. Before: exit 70 (an
    'internal error' traceback; the models CLI: a traceback). Negative control: the same
    TypeError with no signal is still reported as the bug it is."""
    root = tmp_path / "models"
    r = subprocess.run([sys.executable, "-c", _SWALLOW, "signal", cli], capture_output=True,
                       text=True, env=_env(root), cwd=ROOT, timeout=300)
    assert r.returncode == 130, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr and "interrupted" in r.stderr, r.stderr[-2000:]
    assert not [q for q in root.iterdir() if ".tmp-" in q.name]
    r = subprocess.run([sys.executable, "-c", _SWALLOW, "no-signal", cli], capture_output=True,
                       text=True, env=_env(root), cwd=ROOT, timeout=300)
    assert r.returncode in (70, 1) and "TypeError" in r.stderr, (r.returncode, r.stderr[-2000:])


# ============================================================ item 14: API edges
def test_block_after_model_close_is_a_clear_error(models_root):
    m = open_model("tiny", models_dir=models_root)
    m.block(0)                                                 # open: fine
    m.close()
    with pytest.raises(RuntimeError, match="closed"):          # before: a bare KeyError
        m.block(0)
    with pytest.raises(RuntimeError, match="closed"):
        m.layer_weights(1)
    with open_model("tiny", models_dir=models_root) as m2:
        pass
    with pytest.raises(RuntimeError, match="closed"):
        m2.block(1)


@linux_only
def test_nested_with_keeps_workers_until_the_outermost_exit(tiny):
    """``with blk:`` inside ``with blk:``: leaving the inner block keeps the workers (same
    pids on the next call); leaving the outer one releases them. Before: the inner exit
    silently stopped keeping them."""
    x, t, pe = _inputs(tiny)
    with tiny.block(0) as blk:
        with blk:
            out1, _ = blk.forward(x, t, pe, workers=2)
            pids = list(blk._runner.pool.pids)
        assert blk._runner is not None and all(map(alive, pids))
        out2, _ = blk.forward(x, t, pe, workers=2)
        assert list(blk._runner.pool.pids) == pids and np.array_equal(out1, out2)
    assert blk._runner is None and not any(map(alive, pids))
    with blk:                                                   # reusable afterwards
        blk.forward(x, t, pe, workers=2)
        assert blk._runner is not None
        blk.close()                                             # close() inside: released
        assert blk._runner is None
    assert live_segments(PID) == []


def test_empty_model_id_is_an_error(models_root, tmp_path, monkeypatch):
    """``""`` is not the current directory (before: it opened the cwd when that was a model
    directory); ``"."`` still is (negative control)."""
    src = models_root / "tiny"
    open_model("tiny", models_dir=models_root)
    monkeypatch.chdir(src)
    with pytest.raises(ModelNotFoundError, match="empty"):
        open_model("", models_dir=tmp_path)
    with pytest.raises(ModelNotFoundError, match="empty"):
        open_model("  ", models_dir=tmp_path)
    assert open_model(".", models_dir=tmp_path).config.dim == 384
    r = subprocess.run([sys.executable, "-m", "nxhpc.blockrun", "", "1"], capture_output=True,
                       text=True, env=dict(_env(tmp_path), PYTHONPATH=str(ROOT)), cwd=src,
                       timeout=300)
    assert r.returncode == 3 and "empty" in r.stderr, (r.returncode, r.stderr)


def test_make_with_a_derived_ffn_says_it_was_derived(tmp_path):
    """``models make x --dim 64 --heads 1``: the FFN width nobody gave is derived from --dim
    (int(64/3*8) = 170, not a multiple of 32); the message says so. Control: given explicitly
    (--ffn 170) it is blamed as given."""
    r = _cli("nxhpc.models", ["make", "x", "--dim", "64", "--heads", "1"], tmp_path)
    assert r.returncode == 2, r.stderr
    assert "not given" in r.stderr and "derived from dim 64" in r.stderr, r.stderr
    r = _cli("nxhpc.models", ["make", "x", "--dim", "64", "--heads", "1", "--ffn", "170"],
             tmp_path)
    assert r.returncode == 2 and "ffn_dim 170" in r.stderr and "derived" not in r.stderr
    assert not (tmp_path / "x").exists()


_STOPPED = textwrap.dedent(r"""
    import os, signal, sys, threading, time
    from nxhpc.runtime.workers import WorkerError, WorkerPool
    mode, resume = sys.argv[1], sys.argv[2] == "resume"

    def task(lo, hi, arg):
        if lo > 0:
            os.kill(os.getpid(), signal.SIGSTOP)

    def resumer(pool):              # SIGCONT a stopped worker 0.3 s after it stopped
        while True:
            for pid in (pool.pids or pool.last_pids):
                try:
                    st = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
                except (OSError, IndexError):
                    continue
                if st == "T":
                    time.sleep(0.3)
                    os.kill(pid, signal.SIGCONT)
                    return
            time.sleep(0.01)
    with WorkerPool(2, {"s": task}, mode=mode) as p:
        if resume:
            threading.Thread(target=resumer, args=(p,), daemon=True).start()
        t0 = time.monotonic()
        try:
            p.run("s", 4)
            print("ok", round(time.monotonic() - t0, 2))
        except WorkerError as e:
            print("WorkerError", round(time.monotonic() - t0, 2), e)
""")


@linux_only
@pytest.mark.parametrize("mode", ["pool", "stage"])
def test_stopped_worker_is_a_worker_error(mode):
    """A worker SIGSTOPped during a stage, no stage timeout: WorkerError naming the worker and
    the signal within a few seconds, nothing left. Before: waited forever (here: the 60 s
    subprocess timeout). Control: a worker stopped and resumed within the grace is no failure.
    """
    r = subprocess.run([sys.executable, "-c", _STOPPED, mode, "stop"], capture_output=True,
                       text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    what, secs, *msg = r.stdout.split(maxsplit=2)
    assert what == "WorkerError" and STOP_GRACE_S <= float(secs) < 5, r.stdout
    assert "worker 1 of 2 (band [2, 4)) was stopped by SIGSTOP" in msg[0], r.stdout
    assert "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-c", _STOPPED, mode, "resume"], capture_output=True,
                       text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.startswith("ok"), (r.stdout, r.stderr[-2000:])


@linux_only
def test_stopped_worker_fails_a_block_run_with_exit_6(models_root, tiny):
    """The same through ``blockrun`` (no --stage-timeout): exit 6 naming the worker."""
    script = textwrap.dedent(f"""
        import os, signal, sys
        import nxhpc._kernels as K
        real = K.swiglu
        def stopping(a, b, out, i0=0, i1=None, isa=None):
            if i0 > 0:
                os.kill(os.getpid(), signal.SIGSTOP)
            return real(a, b, out, i0=i0, i1=i1, isa=isa)
        K.swiglu = stopping
        from nxhpc.blockrun import main
        sys.exit(main(["tiny", "2", "--models-dir", {str(models_root)!r}]))
    """)
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert r.returncode == 6, (r.returncode, r.stderr[-2000:])
    assert "stage 'swiglu': worker 1 of 2" in r.stderr and "SIGSTOP" in r.stderr, r.stderr
    assert time.monotonic() - t0 < 60
