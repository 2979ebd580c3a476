"""The library objects with workers and shared memory -- ``VaeDecoder``, ``TextEncoder``,
``Denoiser``, ``Block`` -- used the ways a downstream program may misuse them (a review of the
API, 2026-12-06): a call after a failed one, from a forked child, with an overflow inside, after
``close()``, with a setting changed between calls. Every result is compared with a fresh
object's (the reference bits of the same kernels) or with float64 where a value is asked for;
each fix has its negative control.
"""
import os
import signal

import numpy as np
import pytest

import nxhpc
from nxhpc.models import registry
from nxhpc.models.registry import open_denoiser, open_model
from nxhpc.runtime.checks import NonFiniteOutputError
from nxhpc.runtime.workers import WorkerError
from sample_util import shm_entries

PROMPT = "a red fox in the snow"


@pytest.fixture(scope="module")
def latents():
    return np.random.default_rng(0).standard_normal((16, 6, 4)).astype(np.float32)


def _kill_a_worker(pids) -> None:
    pid = next(p for p in pids if p > 0)
    os.kill(pid, signal.SIGKILL)


def _in_child(fn) -> int:
    """Run ``fn()`` in a forked child; its exit code: 0 if it raised the owner's RuntimeError,
    3 if it returned, 4 for any other exception."""
    pid = os.fork()
    if pid == 0:                                  # pragma: no cover - the child
        try:
            fn()
            os._exit(3)
        except RuntimeError as e:
            os._exit(0 if "forked child must open its own" in str(e) else 4)
        except BaseException:
            os._exit(4)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def _in_child_while_held(lock, fn) -> int:
    """:func:`_in_child` while another thread of this process holds ``lock`` (a call in
    progress at the fork): a child that takes the lock hangs, so it has 20 s (SIGALRM, exit
    -14) before the test fails instead of hanging."""
    import threading
    held, done = threading.Event(), threading.Event()

    def hold():
        with lock:
            held.set()
            done.wait(60)
    t = threading.Thread(target=hold, daemon=True)
    t.start()
    assert held.wait(10)
    try:
        return _in_child(lambda: (signal.alarm(20), fn()))
    finally:
        done.set()
        t.join(10)


def test_vae_rebuilds_its_workers_after_a_failed_call(models_root, latents):
    """A worker killed between calls (the OOM killer, a signal): the next decode fails naming
    it, the one after rebuilds the workers and gives the bits of a fresh decoder. The VAE once
    stayed broken for good ("WorkerPool: closed") while the other objects recovered."""
    before = shm_entries()
    with nxhpc.load_vae("tiny-vae", workers=1, models_dir=models_root) as one:
        ref = one.decode(latents)
    with nxhpc.load_vae("tiny-vae", workers=2, models_dir=models_root) as vae:
        assert np.array_equal(vae.decode(latents), ref)        # any worker count: same bits
        _kill_a_worker(vae._engine.pool.pids)
        with pytest.raises(WorkerError):
            vae.decode(latents)
        assert np.array_equal(vae.decode(latents), ref)
        assert np.array_equal(vae.decode(latents), ref)
    assert shm_entries() == before


def test_vae_overflow_inside_is_an_error_not_a_nan_image(models_root, latents):
    """Finite latents near float32's largest overflow inside the decoder: NonFiniteOutputError
    with the count and the array (it silently returned an all-NaN image); ordinary latents
    decode as before on the same object (control)."""
    z = latents.copy()
    z[0, 0, 0] = 2e38
    with nxhpc.load_vae("tiny-vae", workers=2, models_dir=models_root) as vae:
        with pytest.raises(NonFiniteOutputError) as e:
            vae.decode(z)
        assert e.value.count == e.value.size == 3 * 48 * 32
        assert e.value.output.shape == (3, 48, 32) and not np.isfinite(e.value.output).any()
        assert np.isfinite(vae.decode(latents)).all()


def test_vae_precision_set_between_calls_takes_effect(models_root, latents):
    """``vae.precision = "bf16"`` after opening: the bits of a decoder opened at bf16 (it
    changed only the attribute, the output stayed f32's); a misspelled value is refused."""
    with nxhpc.load_vae("tiny-vae", workers=2, models_dir=models_root) as vae:
        f32 = vae.decode(latents)
        vae.precision = "bf16"
        got = vae.decode(latents)
        with pytest.raises(ValueError, match="precision"):
            vae.precision = "BF16"
        assert vae.precision == "bf16"
        vae.precision = "f32"
        assert np.array_equal(vae.decode(latents), f32)
    with nxhpc.load_vae("tiny-vae", workers=1, precision="bf16", models_dir=models_root) as b:
        want = b.decode(latents)
    assert np.array_equal(got, want) and not np.array_equal(got, f32)


def test_vae_close_unmaps_its_file(models_root, latents):
    vae = nxhpc.load_vae("tiny-vae", workers=2, models_dir=models_root)
    vae.decode(latents)
    path = str(vae.file.path)
    assert path in open("/proc/self/maps").read()              # control: mapped while open
    vae.close()
    assert path not in open("/proc/self/maps").read()
    with pytest.raises(RuntimeError, match="closed"):
        vae.decode(latents)


def test_objects_refuse_a_forked_child_without_touching_the_parent(models_root, latents):
    """Called from a forked child, each object raises before it writes into the shared arena
    it inherited (the child's inputs once landed in the parent's buffers: wrong parent results,
    or a hang on a lock held at the fork); the parent's next call gives its reference bits, and
    a child leaving the parent's ``with`` closes nothing."""
    kw = dict(workers=2, models_dir=models_root)
    with nxhpc.load_text_encoder("tiny-te", **kw) as te, \
            nxhpc.load_vae("tiny-vae", **kw) as vae, \
            open_denoiser("tiny-dit", **kw) as den, \
            open_model("tiny", models_dir=models_root) as m:
        cap = te.encode(PROMPT)
        img = vae.decode(latents)
        out = den.forward(latents, 0.5, cap)
        blk = m.block(0)
        x, t, pe = m.blk_in(0), m.t_emb(), m.pe()
        with blk:
            bout = blk.forward(x, t, pe, workers=2).output
            assert _in_child(lambda: blk.forward(x * 3, t, pe, workers=2)) == 0
            # entry points that take the lock: refused before it (they hung in the child when
            # a parent thread held it at the fork: 2026-12-07)
            assert _in_child_while_held(blk._lock, lambda: blk.__enter__()) == 0
            assert _in_child_while_held(te._lock, lambda: setattr(te, "precision", "bf16")) == 0
            assert _in_child_while_held(blk._lock, lambda: blk.forward(x, t, pe)) == 0
            assert _in_child(lambda: blk.__exit__(None, None, None)) == 3
            assert np.array_equal(blk.forward(x, t, pe, workers=2).output, bout)
        assert _in_child(lambda: te.encode("another prompt")) == 0
        assert _in_child(lambda: vae.decode(latents * 2)) == 0
        assert _in_child(lambda: den.forward(latents * 2, 0.3, cap)) == 0
        assert _in_child(lambda: (te.close(), vae.close(), den.close())) == 3   # no-ops there
        assert np.array_equal(te.encode(PROMPT), cap)
        assert np.array_equal(vae.decode(latents), img)
        assert np.array_equal(den.forward(latents, 0.5, cap), out)
        # negative control: the same calls in this process run (the check is the owner's)
        assert not np.array_equal(te.encode("another prompt"), cap)


def test_block_overflow_inside_is_an_error_not_a_nan_output(models_root):
    """A finite t_emb large enough to overflow the modulation: NonFiniteOutputError with the
    output attached (it returned an all-NaN array), as Denoiser.forward does."""
    with open_model("tiny", models_dir=models_root) as m:
        blk = m.block(0)
        x, t, pe = m.blk_in(0), m.t_emb(), m.pe()
        with pytest.raises(NonFiniteOutputError) as e:
            blk.forward(x, t * np.float32(1e20), pe, workers=2)
        assert e.value.count > 0 and e.value.output.shape == x.shape
        assert np.isfinite(blk.forward(x, t, pe, workers=2).output).all()   # control


def test_denoiser_closed_and_bad_timesteps(models_root, latents):
    """After close(), a q8 denoiser says it is closed (it failed inside its int8 copies with an
    AttributeError); a timestep that is a string or None is refused as such (a string was
    parsed, None reported as "got nan"); a one-element array is a number."""
    den = open_denoiser("tiny-dit", workers=2, precision="q8", models_dir=models_root)
    cap = np.zeros((3, den.config.cap_dim), np.float32)
    a = den.forward(latents, 0.5, cap)
    assert np.array_equal(den.forward(latents, np.array([0.5]), cap), a)
    for bad in ("0.5", None, b"0.5", np.array(["0.5"])):
        with pytest.raises(ValueError, match=r"t must be a number in \[0, 1\], got"):
            den.forward(latents, bad, cap)
    den.close()
    with pytest.raises(RuntimeError, match="Denoiser: closed"):
        den.forward(latents, 0.5, cap)


def test_arguments_are_checked_when_given(models_root, latents):
    """Refused where they are given, with the argument named (a bad spawn failed at the first
    forward inside the engine, norm_eps="x" as a format error, a NaN norm_eps as a model-file
    error; sample's shift="3" as a numpy TypeError, on_step=5 after the first step ran)."""
    from nxhpc.dit.sampler import sample
    kw = dict(workers=1, models_dir=models_root)
    for bad, msg in ((dict(spawn="bogus"), "spawn must be one of"),
                     (dict(precision="auto"), "got 'auto' .*fastest_precision()"),
                     (dict(precision="fp32"), "precision must be one of 'f32', 'bf16', 'q8', "
                                              "got 'fp32'$"),
                     (dict(norm_eps="x"), "norm_eps: eps must be a positive finite number"),
                     (dict(norm_eps=float("nan")), "norm_eps: eps must be a positive")):
        with pytest.raises(ValueError, match=msg):
            open_denoiser("tiny-dit", **kw, **bad)
    with open_denoiser("tiny-dit", spawn=None, **kw) as den:    # None: the default
        cap = np.zeros((3, den.config.cap_dim), np.float32)
        calls = []
        den.forward = lambda *a, _f=den.forward: calls.append(1) or _f(*a)
        with pytest.raises(ValueError, match="shift must be a positive number, got '3'"):
            sample(den, cap, latents, steps=2, shift="3")
        with pytest.raises(TypeError, match="on_step must be callable"):
            sample(den, cap, latents, steps=2, on_step=5)
        assert calls == []                                      # nothing ran
        sample(den, cap, latents, steps=2, on_step=lambda *a: None)    # control
        assert calls == [1, 1]


def test_text_encoder_options_are_checked_as_the_denoiser_checks_them(models_root):
    """``load_text_encoder(check_values="False")`` or ``None`` was taken as truthy / falsy
    (``None`` silently skipped the weights' NaN/inf scan), and ``spawn=None`` was refused,
    where ``Denoiser`` and ``Block`` read it as the default (the library-API helper's finds).
    ``check_values`` is a bool now (numpy's too), and ``spawn=None`` the default. Controls:
    True / False / ``np.bool_`` open, and ``spawn="bogus"`` is still refused."""
    kw = dict(workers=1, models_dir=models_root)
    for bad in ("False", None, 0, 1.0):
        with pytest.raises(TypeError, match="check_values must be True or False"):
            nxhpc.load_text_encoder("tiny-te", check_values=bad, **kw)
    with pytest.raises(ValueError, match="spawn must be one of"):
        nxhpc.load_text_encoder("tiny-te", spawn="bogus", **kw)
    for ok in (True, False, np.bool_(True)):
        with nxhpc.load_text_encoder("tiny-te", spawn=None, check_values=ok, **kw) as te:
            assert te.encode("a fox").shape[0] > 0


def test_doors_name_a_built_in_of_another_kind(models_root):
    """Each door refuses a built-in id of another kind before generating anything, naming its
    kind in words (load_denoiser("tiny-te") reported a missing denoiser tensor; the others
    said "text_encoder"; load_model("tiny-te"), blockrun's door, a missing block tensor)."""
    from nxhpc.formats.gguf_io import ModelNotFoundError
    for door, model, kind in ((nxhpc.load_denoiser, "tiny-te", "text encoder"),
                              (nxhpc.load_denoiser, "tiny-vae", "autoencoder"),
                              (nxhpc.load_model, "tiny-te", "text encoder"),
                              # a block model: it was generated (27 MB for mid), then refused
                              (nxhpc.load_denoiser, "mid", "block"),
                              (nxhpc.load_model, "tiny-vae", "autoencoder"),
                              (nxhpc.load_vae, "tiny-te", "text encoder"),
                              (nxhpc.load_text_encoder, "tiny-vae", "autoencoder")):
        with pytest.raises(ModelNotFoundError, match=f"is a built-in {kind} model, not a"):
            door(model, models_dir=models_root / "none")
    assert not (models_root / "none").exists()                  # nothing generated


def test_doors_name_a_file_of_another_kind(models_root):
    """A file path of another kind (the library-API helper's finds): a text encoder's GGUF
    given to ``load_denoiser`` / ``load_model`` reported its first missing DiT tensor (exit 5
    in the CLIs), a GGUF given to ``load_vae`` "header length 14064895815 is absurd", and a
    model opened from a bare .gguf called itself ``Model('None', ...)`` and "the model  is
    closed". Each names what the file is now (the text encoder: exit 3, as a built-in id of
    another kind). Controls: each file opens at its own door."""
    from nxhpc.formats.gguf_io import ModelFileError, ModelNotFoundError
    from procutil import run_cli
    te = registry.ensure_builtin("tiny-te", models_root) / "model.gguf"
    dit = registry.ensure_builtin("tiny-dit", models_root) / "model.gguf"
    blk = registry.ensure_builtin("tiny", models_root) / "model.gguf"
    for door, noun in ((nxhpc.load_denoiser, "a Z-Image denoiser"),
                       (nxhpc.load_model, "a DiT model")):
        with pytest.raises(ModelNotFoundError, match=f"a Qwen3 text encoder's GGUF "
                                                     f"\\(general.architecture 'qwen3'\\), "
                                                     f"not {noun}"):
            door(te)
    r = run_cli("nxhpc.denoise", [te], models_root)
    assert r.returncode == 3 and "Qwen3 text encoder's GGUF" in r.stderr, r.stderr
    with pytest.raises(ModelFileError, match="a GGUF file, not a safetensors file"):
        nxhpc.load_vae(dit)
    m = nxhpc.load_model(blk)
    assert repr(m).startswith(f"Model({str(blk)!r}, ")
    m.close()
    with pytest.raises(RuntimeError, match=f"the model {blk} is closed"):
        m.block(0)
    with nxhpc.load_text_encoder(te, workers=1) as t, nxhpc.load_denoiser(dit, workers=1) as d:
        assert t.config.n_layers >= 1 and d.config.n_layers >= 1          # controls


def test_objects_cannot_be_pickled_or_copied_and_say_why(models_root):
    """pickle / copy.copy / copy.deepcopy of an object holding a map, an arena or workers is a
    TypeError naming the class and what to do (it was "cannot pickle '_thread.RLock' object");
    a plain settings object of the same package still pickles (control)."""
    import copy
    import pickle

    from nxhpc.dit.config import DenoiserConfig
    objs = [nxhpc.load_denoiser("tiny-dit", workers=1, models_dir=models_root),
            nxhpc.load_text_encoder("tiny-te", workers=1, models_dir=models_root),
            nxhpc.load_vae("tiny-vae", workers=1, models_dir=models_root),
            nxhpc.load_model("tiny", models_dir=models_root)]
    objs.append(objs[-1].block(0))      # a Block too (a copy shared its kept workers)
    try:
        for o in objs:
            name = type(o).__name__
            for f in (pickle.dumps, copy.copy, copy.deepcopy):
                with pytest.raises(TypeError, match=f"{name} cannot be pickled or copied: .*"
                                                    f"open one in each process"):
                    f(o)
        cfg = objs[0].config
        assert isinstance(cfg, DenoiserConfig) and pickle.loads(pickle.dumps(cfg)) == cfg
    finally:
        for o in objs:
            o.close()


def test_denoiser_repr_session_and_settable_flags(models_root, latents):
    """repr says "closed" also for a denoiser opened from a directory (it printed the
    directory either way); session() refuses layouts forward() would refuse (an odd H built
    an engine; L = -3 or True reached the engine's own check); a reuse_caption set to
    something that is not a bool is refused at the next call (the string "False" kept reuse
    on), while True / False keep working (control: the same bits either way)."""
    from nxhpc.dit.denoiser import DenoiserInputError
    den = open_denoiser("tiny-dit", workers=1, models_dir=models_root)
    cap = np.zeros((3, den.config.cap_dim), np.float32)
    try:
        assert "closed" not in repr(den)
        for H, W, L, what in ((3, 4, 3, "H must be"), (4, 0, 3, "W must be"),
                              (4, 4, -3, "L must be"), (True, 4, 3, "H must be"),
                              (4, 4, True, "L must be"), (4.0, 4, 3, "H must be"),
                              ("4", 4, 3, "H must be")):
            with pytest.raises(DenoiserInputError, match=f"Denoiser.session: {what}"):
                den.session(H, W, L)
        assert den.session(np.int64(6), 4, 3).key == (6, 4, 32)         # control (Lp = 32)
        a = den.forward(latents, 0.5, cap)
        # a bad setting is refused when it is set (it was taken, and failed at the next call;
        # the docs QA helper's find); the setting stays as it was
        with pytest.raises(TypeError, match="Denoiser.reuse_caption must be True or False"):
            den.reuse_caption = "False"
        for name, bad in (("precision", "auto"), ("precision", "bogus"),
                          ("q8_float_weights", "fp8")):
            with pytest.raises(ValueError, match=f"Denoiser.{name}"):
                setattr(den, name, bad)
        assert (den.reuse_caption, den.precision, den.q8_float_weights) == (True, "f32", "int8")
        den.reuse_caption = False
        assert np.array_equal(den.forward(latents, 0.5, cap), a) and not den.last_caption_reused
        den.reuse_caption = np.bool_(True)
        den.forward(latents, 0.5, cap)
        assert np.array_equal(den.forward(latents, 0.5, cap), a) and den.last_caption_reused
    finally:
        den.close()
    assert repr(den).startswith(f"<Denoiser {models_root / 'tiny-dit'} (closed)")


def test_doors_keep_their_signatures_and_take_bytes_paths(models_root):
    """nxhpc.load_* report the signatures of nxhpc.api's functions (they were (*args,
    **kwargs): help() and IDEs showed nothing); a bytes id or path opens what its str does
    (it was "model id b'tiny-dit' is empty")."""
    import inspect

    import nxhpc.api as api
    for name in ("load_model", "load_denoiser", "load_text_encoder", "load_vae"):
        door = getattr(nxhpc, name)
        assert inspect.signature(door) == inspect.signature(getattr(api, name)), name
        assert door.__name__ == name and door.__doc__ == getattr(api, name).__doc__
    assert "workers" in inspect.signature(nxhpc.load_denoiser).parameters
    with nxhpc.load_vae(b"tiny-vae", workers=1, models_dir=models_root) as v, \
            nxhpc.load_vae("tiny-vae", workers=1, models_dir=models_root) as w:
        assert v.config == w.config
    with nxhpc.load_denoiser(os.fsencode(models_root / "tiny-dit"), workers=1) as d, \
            nxhpc.load_denoiser("tiny-dit", workers=1, models_dir=models_root) as e:
        assert d.gguf.path == e.gguf.path


def test_captions_padding_to_the_same_rows_share_one_engine(models_root, latents):
    """A layout's engine serves every caption that pads to its Lp rows (position ids, rows and
    arena depend on Lp alone): captions of 5, 20 and 32 tokens run on one engine, 33 on
    another; each call gives the bits a fresh denoiser gives for that caption alone (so the
    rows [L, Lp) a longer caption wrote before are the pads again), in any order and with
    the refined-caption cache on or off."""
    rng = np.random.default_rng(7)
    with open_denoiser("tiny-dit", workers=2, models_dir=models_root) as den:
        d = den.config.cap_dim
        caps = {L: rng.standard_normal((L, d)).astype(np.float32) for L in (20, 5, 32, 33)}
        outs = {L: den.forward(latents, 0.5, c) for L, c in caps.items()}
        one = den.session(6, 4, 5)
        assert den.session(6, 4, 20) is one and den.session(6, 4, 32) is one
        assert den.session(6, 4, 33) is not one and one.Lp == 32
        pids = list(one.engine.pool.pids)
        for reuse in (True, False):
            den.reuse_caption = reuse
            for L in (5, 32, 20, 5):
                assert np.array_equal(den.forward(latents, 0.5, caps[L]), outs[L]), (L, reuse)
        assert den.session(6, 4, 20) is one and one.engine.pool.pids == pids    # not rebuilt
    for L, c in caps.items():
        with open_denoiser("tiny-dit", workers=1, models_dir=models_root) as fresh:
            assert np.array_equal(fresh.forward(latents, 0.5, c), outs[L]), L
