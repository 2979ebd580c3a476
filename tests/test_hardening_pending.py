"""Sketches of the failing tests for the issue-12 items deferred while nxhpc/dit/block.py,
nxhpc/models/* and nxhpc/dit/config are being rewritten: items 6, 10, 11, 12, 14 and the
BlockRunner part of item 4. Each is written to fail on today's code; they are skipped (not wired)
until the fix lands -- remove the ``skip`` mark together with the fix, and adjust the names to the
new API (block plans, the split models package) where they moved.
"""
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from nxhpc.runtime.shm import live_segments

ROOT = Path(__file__).resolve().parents[1]
PID = os.getpid()


def pending(item: str):
    """Skipped unless NXHPC_RUN_PENDING=1 (to watch them fail before a fix; the SIGSTOP one then
    hangs by design: run it with a timeout)."""
    return pytest.mark.skipif(os.environ.get("NXHPC_RUN_PENDING") != "1",
                              reason=f"pending: issue 12 {item} (lives in files being rewritten)")


def _cli(module, args, env_models, timeout=300, **kw):
    env = dict(os.environ, NXHPC_MODELS=str(env_models))
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=ROOT, **kw)


# ------------------------------------------------------------------ item 4, BlockRunner part
@pending("item 4 (BlockRunner cleanup touches attributes that may not exist yet)")
def test_blockrunner_interrupted_in_init_raises_the_interrupt(monkeypatch, tmp_path):
    """An interrupt inside BlockRunner.__init__ (here: the pool's fork) must come out as the
    KeyboardInterrupt itself -- not an AttributeError from close() -- and leak nothing."""
    import nxhpc.dit.block as block
    from nxhpc.models import open_model
    m = open_model("tiny", models_dir=tmp_path)

    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(block, "WorkerPool", interrupted)
    with pytest.raises(KeyboardInterrupt):
        block.BlockRunner(m.config, {0: m.layer_weights(0)}, 45, workers=2)
    r = object.__new__(block.BlockRunner)           # a runner whose __init__ never ran
    r.close()                                       # must be a no-op, not AttributeError
    assert live_segments(PID) == []


# ------------------------------------------------------------------ item 6
@pending("item 6 (unwritable / full / non-directory NXHPC_MODELS)")
@pytest.mark.parametrize("kind", ["file", "readonly"])
def test_bad_models_dir_is_a_clear_error(tmp_path, kind):
    """Exit 70 with a traceback (models CLI: exit 1 with a traceback) -> a documented code and one
    line naming the directory. (readonly needs a non-root user or a read-only mount.)"""
    root = tmp_path / "models"
    if kind == "file":
        root.write_text("not a directory")
    else:
        root.mkdir()
        root.chmod(0o555)
        if os.geteuid() == 0:
            pytest.skip("root ignores permissions; use a read-only mount (tests/nsutil.py)")
    for module, args in (("nxhpc.blockrun", ["tiny", "2"]), ("nxhpc.models", ["show", "tiny"])):
        r = _cli(module, args, root)
        assert r.returncode not in (0, 1, 70), (module, r.returncode)
        assert "Traceback" not in r.stderr and str(root) in r.stderr


# ------------------------------------------------------------------ item 10
@pending("item 10 (inputs checked in float64, then narrowed to float32)")
def test_inputs_checked_after_narrowing_and_eps_bounded(tmp_path):
    from nxhpc.models import open_model
    m = open_model("tiny", models_dir=tmp_path)
    x = m.blk_in(0).astype(np.float64)
    x[0, 0] = 1e300                                   # finite in float64, inf in float32
    with pytest.raises(ValueError, match="float32"):
        m.block(0).forward(x, m.t_emb(), m.pe(), workers=1)
    for eps in (1e-50, 1e39):                         # 0 and inf once narrowed
        with pytest.raises(ValueError, match="eps"):
            m.block(0).forward(m.blk_in(0), m.t_emb(), m.pe(), workers=1, eps=eps)


# ------------------------------------------------------------------ item 11
@pending("item 11 (one kept Block used from two threads)")
def test_kept_block_from_two_threads_is_serialized_or_refused(tmp_path):
    """Spurious worker errors, EBADF and 1 s stalls. Either every call gives the right bits
    (a lock) or the second concurrent call gets a clear error; never anything else."""
    from nxhpc.models import open_model
    m = open_model("tiny", models_dir=tmp_path)
    ref, _ = m.block(0).forward(m.blk_in(0), m.t_emb(), m.pe(), workers=2)
    outcomes = []
    with m.block(0) as blk:
        def call():
            try:
                out, _ = blk.forward(m.blk_in(0), m.t_emb(), m.pe(), workers=2)
                outcomes.append("same" if np.array_equal(out, ref) else "DIFFERENT")
            except RuntimeError as e:                 # the documented refusal
                outcomes.append("refused" if "concurrent" in str(e) else f"error: {e}")
            except BaseException as e:  # noqa: BLE001
                outcomes.append(f"{type(e).__name__}: {e}")
        ts = [threading.Thread(target=call) for _ in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    assert set(outcomes) <= {"same", "refused"} and "same" in outcomes, outcomes


# ------------------------------------------------------------------ item 12
@pending("item 12 (first-use generation: silent wait, stale .tmp-*, Ctrl-C -> 70)")
def test_generation_waits_loudly_and_sweeps_stale_tmp(tmp_path):
    root = tmp_path / "models"
    root.mkdir()
    stale = root / ".tiny.tmp-deadbeef"               # what a SIGKILLed generator leaves
    stale.mkdir()
    os.utime(stale, (0, 0))
    import fcntl
    with open(root / ".tiny.lock", "a+") as fh:       # another generator holds the lock
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        p = subprocess.Popen([sys.executable, "-m", "nxhpc.blockrun", "tiny", "2"],
                             stderr=subprocess.PIPE, text=True, cwd=ROOT,
                             env=dict(os.environ, NXHPC_MODELS=str(root)))
        time.sleep(3)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=30)
    assert "waiting" in err and "lock" in err         # it said that it waits, and for whom
    assert p.returncode == 130
    r = _cli("nxhpc.blockrun", ["tiny", "2"], root)
    assert r.returncode == 0 and not stale.exists()  # the stale temporary was swept


# ------------------------------------------------------------------ item 14
@pending("item 14 (API edges)")
def test_api_edges(tmp_path):
    from nxhpc.models import open_model
    m = open_model("tiny", models_dir=tmp_path)
    m.close()
    with pytest.raises(RuntimeError, match="closed"):           # was a bare KeyError
        m.block(0)
    m = open_model("tiny", models_dir=tmp_path)
    with m.block(0) as blk:
        with blk:                                               # nested: still kept after
            blk.forward(m.blk_in(0), m.t_emb(), m.pe(), workers=2)
        assert blk._runner is not None
    with pytest.raises(Exception, match="empty"):               # resolved to the cwd
        open_model("", models_dir=tmp_path)
    r = _cli("nxhpc.models", ["make", "x", "--dim", "64", "--heads", "1"], tmp_path)
    assert r.returncode == 2 and "--ffn" not in r.stderr        # blamed an --ffn nobody gave


@pending("item 14 (a SIGSTOPped worker without --stage-timeout hangs forever)")
def test_stopped_worker_is_detected():
    """WUNTRACED shows a stopped worker; the pool should fail the stage naming it (or resume
    it), not wait forever. (Runtime side: nxhpc/runtime/workers.py.)"""
    from nxhpc.runtime.workers import WorkerError, WorkerPool

    def task(lo, hi, arg):
        if lo > 0:
            os.kill(os.getpid(), signal.SIGSTOP)
    with WorkerPool(2, {"s": task}) as p:
        t0 = time.monotonic()
        with pytest.raises(WorkerError, match="stopped"):
            p.run("s", 4)
        assert time.monotonic() - t0 < 5
