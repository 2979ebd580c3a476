"""``python -m nxhpc.blockrun``: output format, verdicts, every exit code, signals, the README's
main command on a fresh models directory, and the README's downstream example (docs/example.py).
"""
import json
import faulthandler
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import nxhpc._kernels as K
from nxhpc.blockrun import main
from nxhpc.dit.grade import grade
from nxhpc.models import open_model
from nxhpc.runtime.shm import live_segments
# /proc helpers (tests/ is on sys.path)
from procutil import assert_signal_releases, children_of, wait_until

ROOT = Path(__file__).resolve().parents[1]
PID = os.getpid()


def _cli(args, root, timeout=300, **kw):
    env = dict(os.environ, NXHPC_MODELS=str(root))
    return subprocess.run([sys.executable, "-m", "nxhpc.blockrun", *args], capture_output=True,
                          text=True, env=env, timeout=timeout, cwd=ROOT, **kw)


def _kv(stdout):
    out = {}
    for line in stdout.splitlines():
        if "=" in line and " " not in line:
            k, v = line.split("=", 1)
            out[k] = v
    return out


def test_readme_main_command_fresh_machine(tmp_path):
    """The README's main command on the tiny default, with an empty models directory."""
    fresh = tmp_path / "fresh-models"
    r = _cli(["tiny"], fresh)
    assert r.returncode == 0, r.stderr
    kv = _kv(r.stdout)
    for key in ("dim", "tokens", "qkv_width", "ffn_dim", "workers", "gguf_tensors",
                "adaln_gguf_vs_fixture_fail_1e3", "us_prenorm_qkv", "us_qknorm_rope", "us_sdpa",
                "us_attn_tail", "us_ffn", "block_us", "fail_1e2", "fail_1e3", "fail_1e4",
                "fail_1e5", "max_abs", "max_rel", "rms_err", "cosine", "non_finite"):
        assert key in kv, key
    assert kv["dim"] == "384" and kv["adaln_gguf_vs_fixture_fail_1e3"] == "0"
    assert int(kv["workers"]) == len(os.sched_getaffinity(0))
    assert r.stdout.rstrip().splitlines()[-1].startswith("PASS")
    assert float(kv["max_rel"]) < 1e-4 and kv["non_finite"] == "0"


def test_no_model_id_runs_the_default_model(models_root):
    """``blockrun`` alone runs the model ``models list`` marks "(default)" (it was a usage
    error, "the following arguments are required: model_id"), with the same output as naming
    it."""
    from nxhpc.models.registry import DEFAULT_MODEL_ID
    r = _cli(["--json"], models_root)
    named = _cli([DEFAULT_MODEL_ID, "--json"], models_root)
    assert r.returncode == 0 and named.returncode == 0, r.stderr
    got, want = json.loads(r.stdout), json.loads(named.stdout)
    assert got["model"] == want["model"] == str(models_root / DEFAULT_MODEL_ID)
    assert got["max_rel"] == want["max_rel"] and got["verdict"] == "PASS"


def test_json_and_save_output_match_library(models_root, tmp_path):
    out_path = tmp_path / "o.npy"
    r = _cli(["tiny-gqa", "2", "--json", "--spawn", "stage", "--save-output", str(out_path)],
             models_root)
    assert r.returncode == 0, r.stderr
    obj = json.loads(r.stdout)
    assert obj["verdict"] == "PASS" and obj["mask"] is True and obj["kv_heads"] == 2
    assert obj["reference"] == "layers.1.blk_in"
    saved = np.load(out_path)
    assert saved.dtype == np.float32
    m = open_model("tiny-gqa", models_dir=models_root)
    lib, _ = m.block(0).forward(m.blk_in(0), m.t_emb(), m.pe(), mask=m.mask(), workers=3)
    assert np.array_equal(saved, lib)


def test_layers_all_table_and_equals_layer_by_layer(models_root, tmp_path):
    out_path = tmp_path / "chain.npy"
    r = _cli(["mid", "2", "--layers", "all", "--save-output", str(out_path)], models_root)
    assert r.returncode == 0, r.stderr
    rows = [ln for ln in r.stdout.splitlines() if ln.startswith("layer=")]
    assert len(rows) == 3 and "max_abs=" in rows[0] and "cosine=" in rows[0]
    assert "layer 3/3 done" in r.stderr                       # progress on stderr
    m = open_model("mid", models_dir=models_root)
    cur = m.blk_in(0)
    for i in range(3):
        cur, _ = m.block(i).forward(cur, m.t_emb(), m.pe(), workers=1)
    assert np.array_equal(np.load(out_path), cur)


def test_run_stack_library_is_the_cli_run(models_root, tmp_path):
    """blockrun's orchestration is the library function nxhpc.dit.stackrun.run_stack: its output
    is the layer-by-layer chain of Block.forward (an independent path), its grade and per-layer
    rows what the CLI prints, and it refuses a slice the model does not have."""
    from nxhpc.dit.stackrun import StackRangeError, run_stack
    m = open_model("mid", models_dir=models_root)
    res = run_stack(m, layers=2, workers=2)
    cur = m.blk_in(0)
    for i in range(2):
        cur, _ = m.block(i).forward(cur, m.t_emb(), m.pe(), workers=1)
    assert res.output.tobytes() == cur.tobytes()
    assert res.grade.passed and res.reference == "layers.2.blk_in"
    assert [r["layer"] for r in res.per_layer] == [0, 1]
    assert res.per_layer[1]["reference"] == "layers.2.blk_in"
    assert res.report["layers"] == 2 and res.report["adaln"] == "t_emb"
    out_path = tmp_path / "o.npy"
    r = _cli(["mid", "2", "--layers", "2", "--json", "--save-output", str(out_path)],
             models_root)
    assert r.returncode == 0, r.stderr
    obj = json.loads(r.stdout)
    assert np.load(out_path).tobytes() == res.output.tobytes()
    assert obj["max_rel"] == res.grade.as_dict()["max_rel"]
    with pytest.raises(StackRangeError, match="only 3 layers"):
        run_stack(m, layers=4, workers=1)
    with pytest.raises(ValueError, match="workers must be an integer >= 1"):
        run_stack(m, workers=0)
    with pytest.raises(ValueError, match="spawn must be one of"):
        run_stack(m, workers=1, spawn="threads")
    m.close()


def test_adaln_fixture_runs_the_tapped_modulation(models_root, tmp_path):
    """``--adaln fixture``: each layer runs the tapped ``layers.N.adaln_m`` (the chain of
    Block.forward with ``adaln_m=``, an independent path), not the one from t_emb; the report
    says which."""
    m = open_model("mid", models_dir=models_root)
    want = {"fixture": m.blk_in(0), "t_emb": m.blk_in(0)}
    for i in range(2):
        want["fixture"], _ = m.block(i).forward(want["fixture"], pe=m.pe(),
                                                adaln_m=m.adaln_m(i), workers=1)
        want["t_emb"], _ = m.block(i).forward(want["t_emb"], m.t_emb(), m.pe(), workers=1)
    m.close()
    assert want["fixture"].tobytes() != want["t_emb"].tobytes()    # the two really differ
    for adaln in ("fixture", "t_emb"):
        out_path = tmp_path / f"{adaln}.npy"
        r = _cli(["mid", "2", "--layers", "2", "--adaln", adaln, "--json", "--save-output",
                  str(out_path)], models_root)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["adaln"] == adaln
        assert np.load(out_path).tobytes() == want[adaln].tobytes(), adaln


def test_repeat_same_output_as_single_run(models_root, tmp_path):
    a, b = tmp_path / "a.npy", tmp_path / "b.npy"
    r1 = _cli(["tiny", "2", "--save-output", str(a)], models_root)
    r3 = _cli(["tiny", "2", "--repeat", "3", "--save-output", str(b)], models_root)
    assert r1.returncode == 0 and r3.returncode == 0, r1.stderr + r3.stderr
    assert _kv(r3.stdout)["repeat"] == "3" and _kv(r1.stdout)["repeat"] == "1"
    assert np.load(a).tobytes() == np.load(b).tobytes()


def test_save_output_writes_exactly_the_given_path(models_root, tmp_path):
    """np.save would append .npy to a bare name; the CLI writes the path it reports."""
    target = tmp_path / "out_without_suffix"
    r = _cli(["tiny", "2", "--save-output", str(target)], models_root)
    assert r.returncode == 0, r.stderr
    assert target.is_file() and not (tmp_path / "out_without_suffix.npy").exists()
    assert _kv(r.stdout)["saved_output"] == str(target)
    assert np.load(target).shape == (45, 384)


def test_explicit_gguf_path_and_fixture_source_identical(models_root, tmp_path):
    a, b = tmp_path / "a.npy", tmp_path / "b.npy"
    d = open_model("tiny", models_dir=models_root).path
    r1 = _cli(["tiny", "2", "layers.0.ref_out", str(d / "model.gguf"), "--save-output", str(a)],
              models_root)
    r2 = _cli(["tiny", "2", "--source", "fixtures", "--save-output", str(b)], models_root)
    assert r1.returncode == 0 and r2.returncode == 0, (r1.stderr, r2.stderr)
    assert "reference=layers.0.ref_out" in r1.stdout and "weights=fixtures" in r2.stdout
    assert np.array_equal(np.load(a), np.load(b))


def test_graded_fail_exit_1(models_root):
    r = _cli(["tiny", "2", "--tol", "1e-9"], models_root)            # honest run, absurd tol
    assert r.returncode == 1 and r.stdout.splitlines()[-1].startswith("FAIL")
    r = _cli(["tiny", "2", "layers.0.blk_in"], models_root)          # wrong reference
    assert r.returncode == 1 and "FAIL" in r.stdout


@pytest.mark.parametrize("args, code, msg", [
    (["tiny", "abc"], 2, "n_workers"),
    (["tiny", "0"], 2, "n_workers"),
    (["tiny", "2", "--layers", "9"], 2, "only 2 layers"),
    (["tiny", "2", "--eps", "-1"], 2, "--eps"),
    (["tiny", "2", "--stage-timeout", "0"], 2, "--stage-timeout"),
    (["no-such-model"], 3, "not found"),
    (["2"], 3, "the model id comes first: blockrun tiny 2 for 2 workers"),   # model_id optional
    # another kind's built-in: not found as a DiT model (it was exit 5, "missing tensor")
    (["tiny-te"], 3, "'tiny-te' is a built-in text encoder model, not a DiT model"),
    (["tiny-vae"], 3, "'tiny-vae' is a built-in autoencoder model, not a DiT model"),
    (["tiny", "2", "layers.0.nope"], 5, "layers.0.nope"),
    # a reference path that is missing or not a regular file is a usage error naming it (it was
    # looked up as a fixture: exit 5, "no such fixture"); a fixture name stays 5 (above)
    (["tiny", "2", "nofile.npy"], 2, "reference nofile.npy: no such file"),
    (["tiny", "2", "/dev/null"], 2, "reference /dev/null: is a character device"),
    (["tiny", "2", "/tmp"], 2, "reference /tmp: is a directory, expected a .npy file"),
    (["tiny", "2", "--save-output", "/nonexistent-dir/x.npy"], 2, "does not exist"),
    (["tiny", "2", "--save-output", "/tmp"], 2, "is a directory"),
    (["tiny", "100000"], 2, "at most"),              # no fork storm: capped at 8x the CPUs
])
def test_usage_and_lookup_exit_codes(models_root, args, code, msg):
    r = _cli(args, models_root)
    assert r.returncode == code, (r.stdout, r.stderr)
    assert msg in r.stderr


def test_missing_gguf_path_is_not_found(models_root, tmp_path):
    r = _cli(["tiny", "2", "layers.1.blk_in", str(tmp_path / "none.gguf")], models_root)
    assert r.returncode == 3 and "none.gguf" in r.stderr


def _copy_model(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        if f.is_file():
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_bad_model_file_exit_4(models_root, tmp_path):
    d = _copy_model(open_model("tiny", models_dir=models_root).path, tmp_path / "broken")
    g = d / "model.gguf"
    g.write_bytes(g.read_bytes()[:1000])                            # truncated GGUF
    r = _cli([str(d), "2"], models_root)
    assert r.returncode == 4 and "model.gguf" in r.stderr


def test_nan_block_input_exit_4(models_root, tmp_path):
    from nxhpc.formats.fixtures import FixtureStore
    src = open_model("tiny", models_dir=models_root)
    d = _copy_model(src.path, tmp_path / "nan")
    fx = FixtureStore(d / "fixtures.safetensors")
    tensors = {n: fx.load(n, check_finite=False) for n in fx.names()}
    tensors["layers.0.blk_in"][2, 3] = np.nan
    from safetensors.numpy import save_file          # FixtureStore.save refuses NaN, rightly
    save_file(tensors, str(d / "fixtures.safetensors"))
    r = _cli([str(d), "2"], models_root)
    assert r.returncode == 4 and "layers.0.blk_in" in r.stderr and "NaN" in r.stderr


def test_missing_block_input_exit_5(models_root, tmp_path):
    from nxhpc.formats.fixtures import FixtureStore
    src = open_model("tiny", models_dir=models_root)
    d = _copy_model(src.path, tmp_path / "noin")
    fx = FixtureStore(d / "fixtures.safetensors")
    tensors = {n: fx.load(n) for n in fx.names() if n != "layers.0.blk_in"}
    FixtureStore.save(d / "fixtures.safetensors", tensors)
    r = _cli([str(d), "2"], models_root)
    assert r.returncode == 5 and "layers.0.blk_in" in r.stderr


@pytest.mark.parametrize("spawn", ["pool", "stage"])
def test_worker_crash_exit_6(models_root, monkeypatch, capsys, spawn):
    real = K.norm_residual                # the residual tails' kernel

    def crashing(*a, r0=0, **k):
        if r0 > 0:
            faulthandler.disable()        # a deliberate crash: keep pytest's dump out of the log
            os.kill(os.getpid(), signal.SIGSEGV)
        return real(*a, r0=r0, **k)

    monkeypatch.setattr(K, "norm_residual", crashing)
    monkeypatch.setenv("NXHPC_MODELS", str(models_root))
    t0 = time.monotonic()
    code = main(["tiny", "2", "--spawn", spawn])
    assert code == 6
    assert time.monotonic() - t0 < 20
    err = capsys.readouterr().err
    assert "stage 'attn_tail': worker 1 of 2" in err and "SIGSEGV" in err
    assert live_segments(PID) == []


def test_hung_worker_stage_timeout_exit_6(models_root, monkeypatch, capsys):
    real = K.norm_residual                # the residual tails' kernel

    def stuck(*a, r0=0, **k):
        if r0 > 0:
            time.sleep(60)                # hangs without exiting
        return real(*a, r0=r0, **k)

    monkeypatch.setattr(K, "norm_residual", stuck)
    monkeypatch.setenv("NXHPC_MODELS", str(models_root))
    t0 = time.monotonic()
    assert main(["tiny", "2", "--stage-timeout", "0.5"]) == 6
    assert time.monotonic() - t0 < 20
    err = capsys.readouterr().err
    assert "stage 'attn_tail': worker 1 of 2" in err and "stage timeout of 0.5 s" in err
    assert live_segments(PID) == []


_SLOW = textwrap.dedent("""
    import sys, time
    import nxhpc._kernels as K
    def slow(*a, **k):
        sys.stdout.write("started\\n")
        sys.stdout.flush()
        time.sleep(60)
    K.matmul = slow
    from nxhpc.blockrun import main
    sys.exit(main(sys.argv[1:]))
""")


@pytest.mark.parametrize("spawn, workers", [("pool", "2"), ("stage", "2"), ("pool", "1")])
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_during_run(models_root, spawn, workers, sig, code):
    """workers=1 runs the stages in the CLI process itself (no fork): same exit codes."""
    open_model("tiny", models_dir=models_root)              # generate outside the timed part
    env = dict(os.environ, NXHPC_MODELS=str(models_root))
    p = subprocess.Popen([sys.executable, "-c", _SLOW, "tiny", workers, "--spawn", spawn],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    line = p.stdout.readline()
    while line and not line.startswith("started"):            # config lines come first
        line = p.stdout.readline()
    assert line.startswith("started")                        # a stage is running
    need = 0 if workers == "1" else 2                       # (+ multiprocessing's tracker)
    # the first worker prints "started"; in stage mode the second may be forked a moment later
    wait_until(lambda: len(children_of(p.pid)) >= need, 10.0)
    kids = children_of(p.pid)
    assert len(kids) >= need
    # the arena is in /dev/shm but already unlinked (so a leak is impossible by construction)
    assert_signal_releases(p, sig, code, kids, timeout=20)


def test_help_documents_exit_codes_and_grading():
    r = subprocess.run([sys.executable, "-m", "nxhpc.blockrun", "--help"], capture_output=True,
                       text=True, cwd=ROOT)
    assert r.returncode == 0
    for s in ("exit codes", "rel_i = |out_i - ref_i| / max(|ref_i|, rms(ref))", "130", "143",
              "worker process failed", "--layers", "--spawn", "--save-output"):
        assert s in r.stdout, s


def test_readme_example_runs(models_root):
    """docs/example.py is the README's downstream example, verbatim; it must run as is."""
    code = (ROOT / "docs" / "example.py").read_text()
    env = dict(os.environ, NXHPC_MODELS=str(models_root))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "layer 0: (45, 384)" in r.stdout


def test_readme_shows_the_tested_example_and_main_command():
    """The README's library example is docs/example.py verbatim (so the test above runs it)."""
    readme = (ROOT / "README.md").read_text()
    intro = readme.index("This is `docs/example.py`")
    start = readme.index("```python\n", intro) + len("```python\n")
    block = readme[start:readme.index("```", start)]
    assert block == (ROOT / "docs" / "example.py").read_text()
    assert "python -m nxhpc.blockrun tiny" in readme       # the command the fresh-run test runs


# ------------------------------------------------------------------ grading figures
def test_grade_figures_by_hand():
    """ref rms = sqrt((9+16+0+0)/4) = 2.5 is the floor for the zero elements."""
    ref = np.array([3.0, -4.0, 0.0, 0.0])
    out = np.array([3.006, -3.9998, 0.05, 0.0])   # rel: 0.002, 5e-5, 0.05/2.5 = 0.02, 0
    g = grade(out, ref, tol=0.03)
    assert g.fails == {"fail_1e2": 1, "fail_1e3": 2, "fail_1e4": 2, "fail_1e5": 3}
    assert g.max_abs == pytest.approx(0.05, rel=1e-12)
    assert g.max_rel == pytest.approx(0.02, rel=1e-12)
    assert g.rms_err == pytest.approx(np.sqrt((0.006**2 + 0.0002**2 + 0.05**2) / 4), rel=1e-12)
    assert g.rel_rms_err == pytest.approx(g.rms_err / 2.5, rel=1e-12)
    assert g.cosine == pytest.approx((9.018 + 15.9992) / (5 * np.sqrt(3.006**2 + 3.9998**2
                                                                  + 0.0025)), rel=1e-12)
    assert g.passed and g.non_finite == 0 and g.verdict_line().startswith("PASS")
    f = grade(out, ref, tol=0.01)                  # same figures, tighter tol -> FAIL
    assert not f.passed and "max_rel 2.000e-02 > tol 0.01 (1 of 4 elements)" in f.why
    bad = out.copy()
    bad[3] = np.nan                                # NaN fails whatever the tolerance
    n = grade(bad, ref, tol=1e9)
    assert not n.passed and n.non_finite == 1 and n.fails["fail_1e2"] == 2
    assert n.max_rel == pytest.approx(0.02, rel=1e-12)          # figures over finite elements
    with pytest.raises(ValueError, match="shape"):
        grade(out[:3], ref)
    with pytest.raises(ValueError, match="non-finite"):
        grade(out, np.array([3.0, np.inf, 0.0, 0.0]), reference="r")
    z = grade(np.zeros(3), np.zeros(3))            # all-zero reference: exact match passes
    assert z.passed and z.max_rel == 0.0 and z.cosine == 1.0


def test_npy_reference_graded_in_its_own_precision(models_root, tmp_path):
    """A float64 .npy reference is not rounded to float32 before grading: the reported max_rel
    equals the documented formula evaluated here in float64 on the saved output."""
    from nxhpc.dit.reference import block_forward_f64, dequantize_layer
    m = open_model("tiny", models_dir=models_root)
    ref = block_forward_f64(m.blk_in(0), dequantize_layer(m.layer_weights(0)), m.config,
                            t_emb=m.t_emb(), pe=m.pe(), mask=m.mask())
    ref_path, out_path = tmp_path / "ref64.npy", tmp_path / "out.npy"
    np.save(ref_path, ref)
    r = _cli(["tiny", "2", str(ref_path), "--json", "--save-output", str(out_path)], models_root)
    assert r.returncode == 0, r.stderr
    obj = json.loads(r.stdout)
    out = np.load(out_path).astype(np.float64)
    rel = np.abs(out - ref) / np.maximum(np.abs(ref), np.sqrt(np.mean(ref * ref)))
    assert obj["max_rel"] == pytest.approx(rel.max(), rel=1e-9)
    r32 = ref.astype(np.float32).astype(np.float64)                   # negative control
    rel32 = np.abs(out - r32) / np.maximum(np.abs(r32), np.sqrt(np.mean(r32 * r32)))
    assert rel32.max() != pytest.approx(rel.max(), rel=1e-9)
    np.save(ref_path, ref[:5])
    r = _cli(["tiny", "2", str(ref_path)], models_root)
    assert r.returncode == 4 and "ref64.npy" in r.stderr and "shape (45, 384)" in r.stderr


# ------------------------------------------------------------------ hardening (issue 12)
def _files_in(d: Path) -> set[str]:
    return {f.name for f in d.iterdir()}


def test_save_output_full_disk_keeps_old_file_and_prints_verdict(models_root, tmp_path):
    """Item 5: on a full disk the old file was replaced by a truncated .npy, the run exited 70
    and the verdict was never printed. In a private namespace the output directory is a 32 KiB
    tmpfs holding an old result; the 69 KiB output cannot fit: exit 8, the verdict printed, the
    old file and the directory unchanged (no temporary left)."""
    from nsutil import run_script
    open_model("tiny", models_dir=models_root)
    out_dir = tmp_path / "outs"
    out_dir.mkdir()
    script = ('mount -t tmpfs -o size=32k nxtest "$1" && printf "previous result" > "$1/o.npy" '
              '&& "$2" -m nxhpc.blockrun tiny 2 --save-output "$1/o.npy"; rc=$?; '
              'echo "@@rc=$rc"; echo "@@file=$(cat "$1/o.npy")"; echo "@@ls=$(ls -A "$1")"')
    r = run_script(script, str(out_dir), sys.executable, timeout=300, cwd=ROOT,
                   env=dict(os.environ, NXHPC_MODELS=str(models_root)))
    tail = dict(ln[2:].split("=", 1) for ln in r.stdout.splitlines() if ln.startswith("@@"))
    report = [ln for ln in r.stdout.splitlines() if not ln.startswith("@@")]
    assert tail["rc"] == "8", (tail, r.stderr[-2000:])
    assert report[-1].startswith("PASS")                    # the report came first
    assert "max_rel" in r.stdout and not any(ln.startswith("saved_output=") for ln in report)
    assert "could not write the output" in r.stderr and "unchanged" in r.stderr
    assert tail["file"] == "previous result" and tail["ls"] == "o.npy"
    r = _cli(["tiny", "2", "--save-output", str(out_dir / "o.npy")], models_root)   # control
    assert r.returncode == 0 and np.load(out_dir / "o.npy").shape == (45, 384)


def test_save_output_unwritable_directory_fails_before_running(models_root, tmp_path):
    """Item 5: a read-only directory failed only after the whole run. Now: exit 2 up front."""
    open_model("tiny", models_dir=models_root)
    ro = tmp_path / "ro"
    ro.mkdir()
    args = [sys.executable, "-m", "nxhpc.blockrun", "tiny", "2", "--save-output",
            str(ro / "o.npy")]
    env = dict(os.environ, NXHPC_MODELS=str(models_root))
    if os.geteuid() == 0:                       # root ignores permissions: a read-only mount
        from nsutil import run_with_tmpfs
        r = run_with_tmpfs(args, str(ro), "size=64k,ro", env=env, cwd=ROOT, timeout=300)
    else:
        ro.chmod(0o555)
        r = subprocess.run(args, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert r.returncode == 2, (r.returncode, r.stdout[-500:], r.stderr[-2000:])
    assert f"cannot create a file in {ro}" in r.stderr
    assert "block_us" not in r.stdout                       # refused before the run


@pytest.mark.parametrize("victim, how", [("model.gguf", "path"), ("fixtures.safetensors", "link"),
                                         ("ref.npy", "path")])
def test_save_output_refuses_the_runs_own_files(models_root, tmp_path, victim, how):
    """Item 5: ``--save-output <model>/model.gguf`` was accepted (and overwrote the weights).
    The run's inputs -- the model directory's files, the reference .npy -- are refused (exit 2),
    through a symlink too, and stay byte-identical."""
    d = _copy_model(open_model("tiny", models_dir=models_root).path, tmp_path / "m")
    m = open_model(str(d))
    np.save(d / "ref.npy", m.fixtures.load("layers.1.blk_in").astype(np.float64))
    before = (d / victim).read_bytes()
    target = d / victim
    if how == "link":
        target = tmp_path / "innocent.npy"
        target.symlink_to(d / victim)
    r = _cli([str(d), "2", str(d / "ref.npy"), "--save-output", str(target)], models_root)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "input of this run" in r.stderr and "block_us" not in r.stdout
    assert (d / victim).read_bytes() == before
    ok = tmp_path / "fine.npy"                              # control: another path is accepted
    r = _cli([str(d), "2", str(d / "ref.npy"), "--save-output", str(ok)], models_root)
    assert r.returncode == 0 and ok.is_file()


def test_npy_reference_with_nan_or_inf_exit_4(models_root, tmp_path):
    """Item 8: a .npy reference holding NaN/inf exited 70 (grade's ValueError)."""
    ref = open_model("tiny", models_dir=models_root).fixtures.load("layers.1.blk_in")
    for bad in (np.nan, np.inf):
        p = tmp_path / f"ref_{bad}.npy"
        r_ = ref.astype(np.float64)
        r_[4, 7] = bad
        np.save(p, r_)
        r = _cli(["tiny", "2", str(p)], models_root)
        assert r.returncode == 4, (r.returncode, r.stderr[-2000:])
        assert str(p) in r.stderr and "1 of 17280 elements are NaN or inf" in r.stderr


def test_weights_beyond_q8_0_range_exit_4(models_root, tmp_path):
    """Item 7: float weights a Q8_0 block's float16 scale cannot hold (|w| > 65504 * 127) are
    converted at load; that error exited 70. It names the tensor and exits 4."""
    from nxhpc.formats.fixtures import FixtureStore
    d = _copy_model(open_model("tiny", models_dir=models_root).path, tmp_path / "big")
    fx = FixtureStore(d / "fixtures.safetensors")
    tensors = {n: fx.load(n) for n in fx.names()}
    tensors["layers.0.feed_forward.w2.weight"][3, :32] = 1e9
    FixtureStore.save(d / "fixtures.safetensors", tensors)
    r = _cli([str(d), "2", "--source", "fixtures"], models_root)
    assert r.returncode == 4, (r.returncode, r.stderr[-2000:])
    assert "layers.0.feed_forward.w2.weight" in r.stderr and "float16 scale" in r.stderr
    assert "Traceback" not in r.stderr


def test_quantization_error_is_a_model_file_error():
    """Item 7 at its cause: every float -> Q8_0 conversion error is a ModelFileError (exit 4
    in the CLIs) and still a ValueError; a float64 input beyond float32 is caught too."""
    from nxhpc.formats.gguf_io import ModelFileError, quantize_q8_0
    for bad in (np.full((1, 32), 1e9, np.float32), np.full((1, 32), np.nan, np.float32),
                np.full((1, 32), 1e300, np.float64)):
        with pytest.raises(ModelFileError, match="w2") as ei:
            quantize_q8_0(bad, "w2")
        assert isinstance(ei.value, ValueError)


def test_small_dev_shm_exit_7(models_root):
    """Item 1: with a /dev/shm smaller than the arena the run died of SIGBUS (exit 135 / -7, no
    message). In a private 16 KiB /dev/shm: exit 7 naming the bytes needed and free."""
    from nsutil import run_with_tmpfs
    open_model("tiny", models_dir=models_root)
    env = dict(os.environ, NXHPC_MODELS=str(models_root))
    r = run_with_tmpfs([sys.executable, "-m", "nxhpc.blockrun", "tiny", "2"], "/dev/shm",
                       "size=16k", env=env, cwd=ROOT, timeout=300)
    assert r.returncode == 7, (r.returncode, r.stderr[-2000:])
    assert "not enough shared memory" in r.stderr and "bytes free" in r.stderr
    assert "--shm-size" in r.stderr and "Traceback" not in r.stderr


def test_json_is_strict_and_a_huge_reference_cannot_pass(models_root, tmp_path):
    """Item 9 through the CLI: a float64 reference of ~1e308 PASSed any output (rms(ref)
    overflowed) and --json could emit NaN/Infinity. Now it FAILs with max_rel ~ 1 and the
    JSON parses strictly."""
    ref = open_model("tiny", models_dir=models_root).fixtures.load("layers.1.blk_in")
    p = tmp_path / "huge.npy"
    np.save(p, ref.astype(np.float64) * 1e307)
    r = _cli(["tiny", "2", str(p), "--json"], models_root)
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])

    def bad(name):
        raise ValueError(f"not strict JSON: {name}")
    obj = json.loads(r.stdout, parse_constant=bad)
    assert obj["verdict"] == "FAIL" and obj["max_rel"] == pytest.approx(1.0, abs=1e-6)
