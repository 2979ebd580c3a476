"""Model ids, directories, config inference, layer binding and synthetic models (nxhpc.models);
models directories that cannot take a model (a file, read-only, full: exit 9), the generation
lock and the sweeping of dead writers' temporaries, and the API's edges (a closed model, an
empty id).

The synthetic references are checked against diffusers' blocks (an independent oracle), not
against the float64 module that produced them.
"""
import dataclasses
import fcntl
import json
import multiprocessing as mp
import os
import resource
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

import gguf
from nxhpc import models as M
from nxhpc.models import registry
from nxhpc.formats.fixtures import FixtureStore
from nxhpc.formats.gguf_io import (GGUFFile, MissingTensorError, ModelFileError, ModelNotFoundError,
                                   write_gguf)
from nxhpc.formats.weights import WeightTensor
from testutil import gguf_weights_f64, t32
from nsutil import require_private_mounts, run_script
from procutil import PipeReader, linux_only, models_env, run_cli
from nxhpc.dit.binding import LayerWeights
from nxhpc.dit.config import tensor_names
from nxhpc.models import (BUILTINS, ModelsDirError, SyntheticSpec, builtin_ids, ensure_builtin,
                          make_synthetic, open_model)
from nxhpc.models.modeldir import sweep_stale

BUILTIN_MODELS = {k: BUILTINS[k] for k in builtin_ids("block")}     # the block models

Q8 = gguf.GGMLQuantizationType.Q8_0
ROOT = Path(__file__).resolve().parents[1]
PID = os.getpid()


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    r = tmp_path_factory.mktemp("models")
    for mid in ("tiny", "tiny-gqa", "mid"):
        ensure_builtin(mid, r)
    return r


def small_spec(**kw):
    base = dict(variant="zimage", dim=64, n_heads=2, ffn_dim=128, n_layers=2, adaln_in=64,
                n_caption=3, grid=(1, 2, 3), seed=5)
    base.update(kw)
    return SyntheticSpec(**base)


# ----------------------------------------------------------------------------- built-ins

def test_one_builtin_table_holds_both_kinds():
    assert builtin_ids("block") == ["tiny", "tiny-gqa", "mid", "zimage-1l"]
    assert builtin_ids("denoiser") == ["tiny-dit", "zimage-dit-2l"]
    assert builtin_ids("text_encoder") == ["tiny-te"]
    assert builtin_ids("vae") == ["tiny-vae"]
    assert builtin_ids() == [*builtin_ids("block"), *builtin_ids("denoiser"),
                             *builtin_ids("text_encoder"), *builtin_ids("vae")] == list(BUILTINS)
    for mid, spec in BUILTINS.items():
        assert registry.builtin_spec(mid) is spec
        if spec.kind not in ("text_encoder", "vae"):
            assert spec.config().whole == (spec.kind == "denoiser"), mid
    assert registry.builtin_spec("zimage-dit-7l").kind == "denoiser"
    with pytest.raises(ValueError, match="kind must be one of"):
        builtin_ids("denoisers")


def test_builtin_specs_are_valid_and_sized_as_promised():
    assert M.DEFAULT_MODEL_ID in BUILTIN_MODELS
    for mid, spec in BUILTIN_MODELS.items():
        spec.validate()
    z = BUILTIN_MODELS["zimage-1l"].config()
    assert (z.dim, z.n_heads, z.head_dim, z.ffn_dim, z.n_layers) == (3840, 30, 128, 10240, 1)
    assert BUILTIN_MODELS["zimage-1l"].n_tokens == 256
    t = BUILTIN_MODELS["tiny"]
    assert t.config().dim <= 384 and 40 <= t.n_tokens <= 64 and t.n_tokens % 8
    g = BUILTIN_MODELS["tiny-gqa"].config()
    assert g.n_kv_heads < g.n_heads and g.adaln_silu and g.adaln_in == 1024
    m = BUILTIN_MODELS["mid"]
    assert 768 <= m.config().dim <= 1024 and 100 <= m.n_tokens <= 200


#: The fingerprints of the built-ins as generated before the block and denoiser specs became one
#: spec: a change of a spec's identity (its fields, their names, GENERATOR_VERSION) shows here
#: before it regenerates every user's models.
PINNED_FINGERPRINTS = {
    "tiny": "adc4a44d7e209441", "tiny-gqa": "0173d2dd460a2061", "mid": "4b0df528e2a1c00f",
    "zimage-1l": "4c830a01607bb22e", "tiny-dit": "b3ea256497fd4c6c",
    "zimage-dit-1l": "e51a25a273e208bf", "zimage-dit-2l": "31fd10db6b362feb",
}


def test_builtin_fingerprints_are_pinned():
    got = {mid: registry.builtin_spec(mid).fingerprint() for mid in PINNED_FINGERPRINTS}
    assert got == PINNED_FINGERPRINTS
    # negative control: every identifying field moves the fingerprint
    tiny, dit = BUILTINS["tiny"], BUILTINS["tiny-dit"]
    assert dataclasses.replace(tiny, types="q4_0").fingerprint() != tiny.fingerprint()
    assert dataclasses.replace(dit, timestep=0.5).fingerprint() != dit.fingerprint()


def test_one_spec_kind_follows_the_embedders():
    """One spec class for both kinds: ``cap_dim`` makes it a denoiser; each kind stores and
    fingerprints its own fields only, and a field of the other kind is refused."""
    block, den = SyntheticSpec(), SyntheticSpec(cap_dim=64)
    assert (block.kind, den.kind) == ("block", "denoiser")
    assert (block.n_caption, den.n_caption) == (13, 19)               # per-kind defaults
    assert not block.config().whole and den.config().whole
    assert den.config().cap_dim == 64 and den.config().n_noise_refiner == 2
    assert "grid" in block.fields() and "cap_dim" not in block.fields()
    assert "latent_hw" in den.fields() and "grid" not in den.fields()
    assert den.token_grid == (1, 7, 5) and den.n_tokens == 19 + 35
    with pytest.raises(ValueError, match="grid does not apply to a denoiser"):
        SyntheticSpec(cap_dim=64, grid=(1, 2, 2)).validate()
    with pytest.raises(ValueError, match="layout, timestep do not apply to a block"):
        SyntheticSpec(layout="sdcpp-q8_0", timestep=0.5).validate()
    with pytest.raises(ValueError, match="latent_hw"):
        SyntheticSpec(cap_dim=64, latent_hw=(3, 4)).validate()
    SyntheticSpec(cap_dim=64, n_caption=19, seed=3).validate()         # shared fields are fine


@pytest.mark.parametrize("mid", ["tiny", "tiny-gqa", "mid"])
def test_builtin_opens_with_inferred_config(root, mid):
    with open_model(mid, models_dir=root) as m:
        assert m.config == BUILTIN_MODELS[mid].config()
        assert m.n_tokens == BUILTIN_MODELS[mid].n_tokens
        assert set(m.config_report) >= {"variant", "dim", "head_dim", "n_heads", "n_kv_heads",
                                        "ffn_dim", "adaln_in", "n_layers", "norm_eps"}
        assert mid in m.describe()
        spec = BUILTIN_MODELS[mid]
        assert m.rope == spec.rope_params()
        mask = m.mask()
        if spec.mask_pad:
            assert mask.dtype == bool and (~mask).sum() == spec.mask_pad
        else:
            assert mask is None


def test_same_seed_byte_identical_other_seed_differs(tmp_path):
    spec = small_spec()
    a = make_synthetic(tmp_path / "a", spec)
    b = make_synthetic(tmp_path / "b", spec)
    c = make_synthetic(tmp_path / "c", dataclasses.replace(spec, seed=6))
    for f in ("model.gguf", "fixtures.safetensors", "synthetic.json"):
        assert (a / f).read_bytes() == (b / f).read_bytes(), f
    assert (a / "model.gguf").read_bytes() != (c / "model.gguf").read_bytes()
    with pytest.raises(FileExistsError):
        make_synthetic(tmp_path / "a", spec)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "c"]   # no temp dirs left


def _score_spread(m):
    """The largest spread (max - min) of a row's attention scores in layer 0 of model ``m``,
    float64 from the dequantized weights (RoPE left out: it turns q and k, not their norms)."""
    from nxhpc.dit.reference import dequantize_layer
    c = m.config
    w = dequantize_layer(m.layer_weights(0))
    x = m.blk_in(0).astype(np.float64)
    D, hd = c.dim, c.head_dim
    mod = 1.0 + m.adaln_m(0)[:D].astype(np.float64)
    h = x / np.sqrt((x * x).mean(1, keepdims=True) + c.norm_eps) * w["attention_norm1"] * mod
    qkv = h @ w["qkv"].T
    best = 0.0
    for j in range(c.n_heads):
        q, k = qkv[:, j * hd:(j + 1) * hd], qkv[:, D + j * hd:D + (j + 1) * hd]
        q = q / np.sqrt((q * q).mean(1, keepdims=True) + c.norm_eps) * w["q_norm"]
        k = k / np.sqrt((k * k).mean(1, keepdims=True) + c.norm_eps) * w["k_norm"]
        s = q @ k.T / np.sqrt(hd)
        best = max(best, float((s.max(1) - s.min(1)).max()))
    return best


def test_qk_norm_scale_sharpens_only_the_qk_norms(tmp_path):
    """``qk_norm_scale`` multiplies the q_norm / k_norm weights and nothing else (the same draws:
    every other tensor byte-identical); its reference is the block on the scaled weights
    (nxhpc's f32 block matches it), and its softmax weights do underflow, as the option is
    for. 1 is the default and leaves the fingerprint of every older spec alone."""
    from gguf import GGUFReader
    spec = small_spec(n_layers=1, dim=128, n_heads=2, grid=(1, 6, 8))
    a = make_synthetic(tmp_path / "a", spec)
    b = make_synthetic(tmp_path / "b", dataclasses.replace(spec, qk_norm_scale=8.0))
    ta = {t.name: np.array(t.data) for t in GGUFReader(a / "model.gguf").tensors}
    tb = {t.name: np.array(t.data) for t in GGUFReader(b / "model.gguf").tensors}
    assert ta.keys() == tb.keys()
    scaled = [n for n in ta if n.endswith(("q_norm.weight", "k_norm.weight"))]
    assert len(scaled) == 2
    for n in ta:
        if n in scaled:
            np.testing.assert_array_equal(tb[n], ta[n] * np.float32(8.0))
        else:
            np.testing.assert_array_equal(tb[n], ta[n])
    assert dataclasses.replace(spec, qk_norm_scale=1.0).fingerprint() == spec.fingerprint()
    assert dataclasses.replace(spec, qk_norm_scale=8.0).fingerprint() != spec.fingerprint()
    spreads = []
    for d in (a, b):
        with open_model(d) as m:
            out, _ = m.block(0).forward(m.blk_in(0), m.t_emb(), m.pe(), mask=m.mask(),
                                        workers=1)
            ref = m.ref_out(0).astype(np.float64)
            assert np.abs(out - ref).max() <= 1e-5 * np.abs(ref).max()
            spreads.append(_score_spread(m))
    # a row's scores spread over > 87 (e^-87 = 2^-126: its weights underflow) only when sharp
    assert spreads[0] < 20 < 87 < spreads[1], spreads
    with pytest.raises(ValueError, match="qk_norm_scale"):
        dataclasses.replace(spec, qk_norm_scale=0.0).validate()
    # a whole denoiser (every block's q/k norms, refiners too), the same way
    den = dataclasses.replace(BUILTINS["tiny-dit"], reference=False)
    da = make_synthetic(tmp_path / "da", den)
    db = make_synthetic(tmp_path / "db", dataclasses.replace(den, qk_norm_scale=4.0))
    ta = {t.name: np.array(t.data) for t in GGUFReader(da / "model.gguf").tensors}
    tb = {t.name: np.array(t.data) for t in GGUFReader(db / "model.gguf").tensors}
    qk = [n for n in ta if n.endswith(("q_norm.weight", "k_norm.weight"))]
    assert len(qk) == 2 * (den.n_layers + 2 * den.n_refiner)
    for n in ta:
        np.testing.assert_array_equal(tb[n], ta[n] * np.float32(4.0) if n in qk else ta[n])
    assert dataclasses.replace(den, qk_norm_scale=4.0).fingerprint() != den.fingerprint()


def test_write_model_dir_is_all_or_nothing(tmp_path):
    """A failed write leaves no temporary directory and keeps the previous model; a
    successful replace swaps the whole directory."""
    d = M.write_model_dir(tmp_path / "m", {"a": np.ones(8)}, {"x": np.ones(3)})
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    with pytest.raises(FileExistsError):
        M.write_model_dir(d, {"a": np.ones(8)}, {"x": np.ones(3)})
    with pytest.raises(ValueError, match="'bad' contains NaN"):
        M.write_model_dir(d, {"a": np.ones(8)}, {"bad": np.array([np.nan])}, replace=True)
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]
    M.write_model_dir(d, {"a": np.zeros(8)}, {"y": np.ones(2)}, replace=True,
                      extra_files={"note.txt": "hi\n"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]
    assert FixtureStore(d / "fixtures.safetensors").names() == ["y"]
    assert (d / "note.txt").read_text() == "hi\n"
    with GGUFFile(d / "model.gguf") as g:
        np.testing.assert_array_equal(g.load_f32("a"), np.zeros(8))


def test_builtin_is_generated_once_and_regenerated_when_stale(tmp_path):
    d = ensure_builtin("tiny", tmp_path)
    st = (d / "model.gguf").stat()
    assert ensure_builtin("tiny", tmp_path) == d
    assert (d / "model.gguf").stat().st_mtime_ns == st.st_mtime_ns
    info = json.loads((d / "synthetic.json").read_text())
    info["fingerprint"] = "stale"
    (d / "synthetic.json").write_text(json.dumps(info))
    ensure_builtin("tiny", tmp_path)
    assert json.loads((d / "synthetic.json").read_text())["fingerprint"] != "stale"


@pytest.mark.parametrize("model_id", ["tiny", "tiny-dit", "tiny-te", "tiny-vae"])
def test_damaged_builtin_is_detected_and_generated_again(tmp_path, model_id):
    """Issue 19, item 2: a built-in whose files were overwritten (a result saved over
    model.gguf), truncated or deleted was used as is -- every later run failed -- because the
    freshness check read only the fingerprint. Each damage is now detected and the built-in
    generated again, byte-identical to the first generation (sha256 of every file); an
    untouched directory is reused as it is (negative control: nothing regenerated)."""
    import hashlib

    def digests(d):
        return {f.name: hashlib.sha256(f.read_bytes()).hexdigest()
                for f in sorted(d.iterdir()) if f.is_file() and not f.name.startswith(".")}

    d = ensure_builtin(model_id, tmp_path)
    first = digests(d)
    spec = registry.builtin_spec(model_id)
    assert registry.builtin_current(d, spec)
    mtime = {n: (d / n).stat().st_mtime_ns for n in first}
    assert ensure_builtin(model_id, tmp_path) == d                       # reused, untouched
    assert {n: (d / n).stat().st_mtime_ns for n in first} == mtime
    main = getattr(spec, "main_file", "model.gguf")
    some = d / sorted(first)[0]
    def result_over_it():                                 # what `--out <dir>/model.gguf` did
        with open(d / main, "wb") as f:
            np.save(f, np.zeros(48, np.float32))

    damages = [result_over_it,
               lambda: os.truncate(some, some.stat().st_size // 2),
               lambda: (d / sorted(first)[-1]).unlink()]
    for damage in damages:
        damage()
        assert not registry.builtin_current(d, spec)
        assert ensure_builtin(model_id, tmp_path) == d
        assert digests(d) == first
        assert registry.builtin_current(d, spec)


def test_large_builtin_reports_progress_on_stderr(tmp_path, monkeypatch, capsys):
    """Generating zimage-1l (about 10 s) shows progress unasked; tiny stays quiet. The
    generator is replaced by a stub that only reports, so nothing large is built here."""
    seen = {}

    def stub(out_dir, spec, progress=None, *, replace=False):
        seen[spec.dim] = progress
        if progress is not None:
            progress("layer 0: qkv")
        Path(out_dir).mkdir(parents=True)
        return Path(out_dir)
    monkeypatch.setattr(registry, "make_synthetic", stub)
    ensure_builtin("zimage-1l", tmp_path)
    ensure_builtin("tiny", tmp_path)
    assert seen[384] is None and seen[3840] is not None
    err = capsys.readouterr().err
    assert "[nxhpc.models zimage-1l" in err and "layer 0: qkv" in err


def _gen(root, q):
    try:
        d = ensure_builtin("tiny", Path(root))
        q.put(("ok", (d / "model.gguf").read_bytes()))
    except Exception as e:  # pragma: no cover - reported to the parent
        q.put(("err", repr(e)))


def test_concurrent_generation_is_safe(tmp_path):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_gen, args=(str(tmp_path), q)) for _ in range(3)]
    for p in procs:
        p.start()
    res = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(60)
    assert all(r[0] == "ok" for r in res), res
    assert len({r[1] for r in res}) == 1
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == ["tiny"]


# ----------------------------------------------------------------------------- references

@pytest.mark.parametrize("mid", ["tiny", "tiny-gqa"])
def test_synthetic_references_match_diffusers(root, mid):
    """ref_out of every layer = diffusers' block on blk_in (to float32 accuracy), and the
    layers chain (blk_in[i+1] == ref_out[i])."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("diffusers")
    from nxhpc.dit.oracle import diffusers_block
    with open_model(mid, models_dir=root) as m:
        c = m.config
        pe, t_emb, mask = m.pe(), m.t_emb(), m.mask()
        freqs = torch.complex(t32(pe[..., 0, 0]), t32(pe[..., 1, 0]))[None]
        tm = None if mask is None else torch.from_numpy(mask)[None]
        for i in range(c.n_layers):
            w = gguf_weights_f64(m.gguf.path, tensor_names("layers", i, c.variant))
            blk = diffusers_block(c, w, layer_id=i)
            x = m.blk_in(i)
            with torch.no_grad():
                theirs = blk(t32(x)[None], tm, freqs, t32(t_emb)[None])[0].double().numpy()
            ref = m.ref_out(i).astype(np.float64)
            err = np.abs(ref - theirs).max() / np.sqrt(np.mean(theirs ** 2))
            assert err < 2e-5, (mid, i, err)
            assert np.abs(ref - x).max() > 0.1          # the block did change its input
            if i + 1 < c.n_layers:
                np.testing.assert_array_equal(m.blk_in(i + 1), m.ref_out(i))
            # adaln_m fixture = adaLN of t_emb (silu for Lumina-2) with the stored weights
            tt = t_emb.astype(np.float64)
            if c.adaln_silu:
                tt = tt / (1 + np.exp(-tt))
            np.testing.assert_allclose(m.adaln_m(i), w["adaln_w"] @ tt + w["adaln_b"],
                                       rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- layer binding

def test_layer_weights_zero_copy_and_contract_shapes(root):
    with open_model("tiny", models_dir=root) as m:
        c = m.config
        lw = m.layer_weights(1)
        assert isinstance(lw, LayerWeights) and lw.source == "gguf" and lw.layer == 1
        rb = lambda k: k // 32 * 34  # noqa: E731
        shapes = {"qkv": ((c.qkv_width, c.dim), (c.qkv_width, rb(c.dim))),
                  "out": ((c.dim, c.dim), (c.dim, rb(c.dim))),
                  "w1": ((c.ffn_dim, c.dim), (c.ffn_dim, rb(c.dim))),
                  "w3": ((c.ffn_dim, c.dim), (c.ffn_dim, rb(c.dim))),
                  "w2": ((c.dim, c.ffn_dim), (c.dim, rb(c.ffn_dim))),
                  "adaln_w": ((4 * c.dim, c.adaln_in), (4 * c.dim, rb(c.adaln_in)))}
        for k, (torch_shape, s) in shapes.items():
            w = getattr(lw, k)
            assert isinstance(w, WeightTensor) and w.type_name == "Q8_0", k
            assert w.shape == torch_shape, k
            a = w.data
            assert a.dtype == np.uint8 and a.shape == s, k
            assert np.shares_memory(a, m.gguf.mapping), k
            assert not a.flags.writeable, k
        for k in ("attention_norm1", "attention_norm2", "ffn_norm1", "ffn_norm2"):
            assert getattr(lw, k).dtype == np.float32 and getattr(lw, k).shape == (c.dim,)
        assert lw.q_norm.shape == lw.k_norm.shape == (c.head_dim,)
        assert lw.adaln_b.shape == (4 * c.dim,)
        # fixture weights re-quantize to the identical Q8_0 bytes
        fw = m.layer_weights(1, source="fixtures")
        assert fw.source == "fixtures"
        for k in ("qkv", "out", "w1", "w2", "w3"):
            assert getattr(fw, k).type_name == "Q8_0"
            np.testing.assert_array_equal(getattr(fw, k).data, getattr(lw, k).data)
        for k in ("attention_norm1", "q_norm", "adaln_b"):
            np.testing.assert_array_equal(getattr(fw, k), getattr(lw, k))
        with pytest.raises(IndexError):
            m.layer_weights(c.n_layers)
        with pytest.raises(ValueError, match="source"):
            m.layer_weights(0, source="disk")


def test_float_projections_are_bound_as_stored(tmp_path):
    """A file holding every tensor as F32 binds each matrix as an F32 view of the map (the
    file's bytes, not a copy, not requantized), with no warning."""
    d = make_synthetic(tmp_path / "s", small_spec(include_weights=True))
    fx = FixtureStore(d / "fixtures.safetensors")
    floats = {n: fx.load(n) for n in fx.names() if n.endswith((".weight", ".bias"))}
    write_gguf(tmp_path / "f32.gguf", floats, quantize=False, prefix=False,
               metadata={"nxhpc.norm_eps": 1e-5})
    with open_model(d, gguf_path=tmp_path / "f32.gguf") as m:
        assert all(m.gguf.type_name(n) == "F32" for n in m.gguf.names())
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            lw = m.layer_weights(0)
        for k, name in tensor_names("layers", 0, "zimage").items():
            a = getattr(lw, k)
            if isinstance(a, WeightTensor):
                assert a.type_name == "F32" and a.name == name, k
                assert np.shares_memory(a.data, m.gguf.mapping), k
                np.testing.assert_array_equal(a.data.view(np.float32), floats[name])
        with open_model(d) as m2:          # the Q8_0 file stays Q8_0
            assert m2.layer_weights(0).w2.type_name == "Q8_0"


def test_model_gguf_that_is_not_a_file_is_refused(tmp_path):
    """A model directory whose model.gguf is a FIFO, a directory or a dangling link is refused
    (it ran from the fixtures' weights without a word); the untouched directory opens."""
    d = make_synthetic(tmp_path / "s", small_spec(include_weights=True))
    with open_model(d) as m:
        assert m.weights_source == "gguf"
    (d / "model.gguf").unlink()
    for make, kind in ((os.mkfifo, "a FIFO"), (os.mkdir, "a directory"),
                       (lambda p: os.symlink(tmp_path / "absent", p), "cannot be read")):
        make(d / "model.gguf")
        with pytest.raises(ModelNotFoundError, match=f"model.gguf: {kind}.*not a regular file"):
            open_model(d)
        p = d / "model.gguf"
        p.rmdir() if p.is_dir() and not p.is_symlink() else p.unlink()


def test_norm_eps_of_another_type_is_refused(tmp_path):
    """nxhpc.norm_eps stored as a string is the file's mistake, not a reason to run with
    another eps (it fell back to the fixtures' or the default one); a float is read."""
    d = make_synthetic(tmp_path / "s", small_spec(include_weights=True))
    fx = FixtureStore(d / "fixtures.safetensors")
    floats = {n: fx.load(n) for n in fx.names() if n.endswith((".weight", ".bias"))}
    for value, ok in (("1e-5", False), (1e-5, True)):
        write_gguf(tmp_path / "e.gguf", floats, quantize=False, prefix=False,
                   metadata={"nxhpc.norm_eps": value})
        if ok:
            with open_model(d, gguf_path=tmp_path / "e.gguf") as m:
                assert m.config.norm_eps == 1e-5
        else:
            with pytest.raises(ModelFileError, match="'nxhpc.norm_eps' is str '1e-5', expected"):
                open_model(d, gguf_path=tmp_path / "e.gguf")


def test_fixture_only_model(tmp_path):
    d = make_synthetic(tmp_path / "s", small_spec(include_weights=True))
    (d / "model.gguf").unlink()
    with open_model(d) as m:
        assert m.gguf is None and m.weights_source == "fixtures"
        assert m.config == small_spec().config()
        assert m.layer_weights(0).source == "fixtures"
    d2 = make_synthetic(tmp_path / "t", small_spec(include_weights=False))
    (d2 / "model.gguf").unlink()
    with pytest.raises(MissingTensorError, match="no main-layer tensors"):
        open_model(d2)


def _write_variant(tmp_path, drop=(), replace=None, name="x.gguf"):
    d = tmp_path / "src"
    if not d.exists():
        make_synthetic(d, small_spec(include_weights=True))
    fx = FixtureStore(d / "fixtures.safetensors")
    t = {n: fx.load(n) for n in fx.names() if n.endswith((".weight", ".bias"))}
    for n in drop:
        del t[n]
    t.update(replace or {})
    return write_gguf(tmp_path / name, t)


@pytest.mark.parametrize("case,kw,exc,pattern", [
    ("missing norm", dict(drop=["layers.1.ffn_norm2.weight"]), MissingTensorError,
     "'layers.1.ffn_norm2.weight' is missing"),
    ("layer gap", dict(drop=[n for n in tensor_names("layers", 0, "zimage").values()]),
     MissingTensorError, "'layers.0.attention.qkv.weight' missing"),
    ("wrong q_norm", dict(replace={"layers.1.attention.q_norm.weight": np.ones(16)}),
     ModelFileError, r"'layers.1.attention.q_norm.weight' has shape \[16\], expected \[32\]"),
    ("both adaLN namings", dict(replace={"layers.0.adaLN_modulation.1.weight":
                                         np.ones((256, 64))}), ModelFileError, "found both"),
    ("qkv rows", dict(replace={"layers.0.attention.qkv.weight": np.ones((200, 64))}),
     ModelFileError, "'layers.0.attention.qkv.weight' has 200 rows"),
    ("2-D norm", dict(replace={"layers.0.attention_norm1.weight": np.ones((2, 32))}),
     ModelFileError, "expected 1-D"),
    ("w2 shape", dict(replace={"layers.1.feed_forward.w2.weight": np.ones((64, 96))}),
     ModelFileError, r"'layers.1.feed_forward.w2.weight' has shape \[64, 96\]"),
])
def test_config_errors_name_the_tensor(tmp_path, case, kw, exc, pattern):
    p = _write_variant(tmp_path, **kw)
    with pytest.raises(exc, match=pattern) as ei:
        open_model(p)
    assert str(p) in str(ei.value)


def test_non_finite_weights_are_rejected_at_bind(tmp_path):
    p = _write_variant(tmp_path, name="ok.gguf")
    data = bytearray(p.read_bytes())
    with GGUFFile(p) as g:
        off = g.info("layers.1.feed_forward.w3.weight").offset
        noff = g.info("layers.0.ffn_norm1.weight").offset
    data[off:off + 2] = np.array([np.inf], np.float16).tobytes()      # first block's scale
    data[noff:noff + 4] = np.array([np.nan], np.float32).tobytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with open_model(bad) as m:
        with pytest.raises(ModelFileError, match="'layers.1.feed_forward.w3.weight'.*scale"):
            m.layer_weights(1)
        with pytest.raises(ModelFileError, match="'layers.0.ffn_norm1.weight' has NaN"):
            m.layer_weights(0)


def test_fixture_shape_checks_against_config(tmp_path):
    d = make_synthetic(tmp_path / "s", small_spec())
    fx = FixtureStore(d / "fixtures.safetensors")
    t = {n: fx.load(n) for n in fx.names()}
    t["layers.1.adaln_m"] = np.zeros(10)
    FixtureStore.save(d / "fixtures.safetensors", t)
    with open_model(d) as m:
        m.adaln_m(0)
        with pytest.raises(ModelFileError, match=r"'layers.1.adaln_m' has dims \[10\]"):
            m.adaln_m(1)


# ----------------------------------------------------------------------------- resolution

def test_resolution(tmp_path, monkeypatch):
    monkeypatch.setenv("NXHPC_MODELS", str(tmp_path / "env"))
    assert M.models_dir() == tmp_path / "env"
    with pytest.raises(ModelNotFoundError, match="'nonesuch' not found.*tiny"):
        open_model("nonesuch")
    with pytest.raises(ModelNotFoundError):
        open_model(tmp_path / "no" / "such")
    # a device, a FIFO, a non-GGUF file: said as such, not "not found" (and nothing is read)
    with pytest.raises(ModelNotFoundError, match="'/dev/null' is not a regular file.*character device"):
        open_model("/dev/null")
    fifo = tmp_path / "pipe.gguf"
    os.mkfifo(fifo)
    with pytest.raises(ModelNotFoundError, match="is not a regular file.*a FIFO"):
        open_model(fifo)
    (tmp_path / "weights.bin").write_bytes(b"GGUF")
    with pytest.raises(ModelNotFoundError, match="is a file but not a .gguf file"):
        open_model(tmp_path / "weights.bin")
    d = make_synthetic(tmp_path / "env" / "mine", small_spec())
    with open_model("mine") as m:                       # an id under $NXHPC_MODELS
        assert m.path == d
    with open_model(str(d)) as m:                       # a directory path
        assert m.fixtures is not None
    with open_model(d / "model.gguf") as m:             # a bare .gguf file
        assert m.fixtures is None and m.n_tokens is None
        with pytest.raises(MissingTensorError):
            m.pe()
    with pytest.raises(ModelNotFoundError, match="gguf_path"):
        open_model(d, gguf_path=tmp_path / "missing.gguf")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelNotFoundError, match="neither"):
        open_model(empty)


# ----------------------------------------------------------------------------- CLI

def _cli(*args, env_dir):
    env = dict(os.environ, NXHPC_MODELS=str(env_dir))
    return subprocess.run([sys.executable, "-m", "nxhpc.models", *args], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=300)


def test_cli(tmp_path, root):
    r = _cli("--help", env_dir=root)
    assert r.returncode == 0 and "list" in r.stdout and "make" in r.stdout
    r = _cli("list", env_dir=root)
    assert r.returncode == 0 and "zimage-1l" in r.stdout and "tiny-gqa" in r.stdout
    r = _cli("show", "tiny-gqa", env_dir=root)
    assert r.returncode == 0, r.stderr
    assert "4 heads x 96 (GQA, 2 kv heads)" in r.stdout and "adaLN 1024 (SiLU)" in r.stdout
    r = _cli("make", "custom", "--dim", "64", "--heads", "2", "--ffn", "128", "--layers", "1",
             "--adaln-in", "64", "--caption", "5", "--grid", "1x3x3", "--seed", "3",
             env_dir=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "D=64, 2 heads x 32" in r.stdout and "T=14" in r.stdout
    assert (tmp_path / "custom" / "model.gguf").is_file()
    r = _cli("make", "custom", "--dim", "64", env_dir=tmp_path)
    assert r.returncode == 2 and "exists" in r.stderr
    r = _cli("make", "bad", "--dim", "70", "--heads", "2", env_dir=tmp_path)
    assert r.returncode == 2 and "error:" in r.stderr
    r = _cli("show", "nonesuch", env_dir=tmp_path)
    assert r.returncode == 3 and "not found" in r.stderr      # Exit.NOT_FOUND, as in blockrun
    r = _cli("make", "x", "--grid", "banana", env_dir=tmp_path)
    assert r.returncode == 2 and "FxHxW" in r.stderr


def test_cli_builtin_autoencoder_ids_and_models_dir(tmp_path):
    """``make`` / ``show`` of the built-in autoencoder (they once failed looking for a
    model.gguf, or crashed), a file or directory holding it; an id is a plain name (``../x``
    wrote outside the models directory, ``a/b`` made a model no id could name); an empty
    ``--models-dir`` is refused (it quietly meant the current directory)."""
    from safetensors import safe_open
    spec = BUILTINS["tiny-vae"]
    r = _cli("make", "tiny-vae", env_dir=tmp_path)
    assert r.returncode == 0, r.stderr
    ae = tmp_path / "tiny-vae" / "ae.safetensors"
    with safe_open(str(ae), "np") as f:              # the file as written, read by safetensors
        n_dec = sum(1 for k in f.keys() if k.startswith("decoder."))
    want = (f"channels {list(spec.block_out_channels)}, z={spec.latent_channels}, "
            f"3 output channels, 8x upscale, {spec.dtype}")
    assert want in r.stdout and f"{n_dec} decoder tensors" in r.stdout, r.stdout
    for what in ("tiny-vae", str(ae), str(ae.parent)):
        r = _cli("show", what, env_dir=tmp_path)
        assert r.returncode == 0 and want in r.stdout, (what, r.stderr)
    for extra in (["--out", str(tmp_path / "v2")], ["--dim", "64"]):
        r = _cli("make", "tiny-vae", *extra, env_dir=tmp_path)
        assert r.returncode == 2 and "built-in autoencoder" in r.stderr, r.stderr
    assert not (tmp_path / "v2").exists()
    for bad in ("../escape", "a/b", ".hidden"):
        r = _cli("make", bad, "--dim", "64", "--heads", "2", "--ffn", "128", env_dir=tmp_path)
        assert r.returncode == 2 and "plain name" in r.stderr, (bad, r.stderr)
    assert sorted(n for n in os.listdir(tmp_path) if not n.startswith(".")) == ["tiny-vae"]
    assert not (tmp_path.parent / "escape").exists() and not (tmp_path / ".hidden").exists()
    r = _cli("make", "ok", "--dim", "64", "--heads", "2", "--ffn", "128", "--layers", "1",
             "--out", tmp_path / "a" / "b", env_dir=tmp_path)      # --out may be any path
    assert r.returncode == 0 and (tmp_path / "a" / "b" / "model.gguf").is_file(), r.stderr
    r = _cli("--models-dir", "", "list", env_dir=tmp_path)
    assert r.returncode == 2 and "empty path" in r.stderr
    r = subprocess.run([sys.executable, "-m", "nxhpc.blockrun", "tiny", "1", "--models-dir", ""],
                       capture_output=True, text=True, cwd=tmp_path, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 2 and "empty path" in r.stderr and not (tmp_path / "tiny").exists()


def test_cli_makes_a_custom_denoiser_from_a_builtin(tmp_path):
    """``make tiny-dit --dim ... --out``: the built-in denoiser's spec with custom dims, through
    the one generator; an option only block models take is a usage error naming it."""
    out = tmp_path / "den"
    r = _cli("make", "tiny-dit", "--dim", "128", "--heads", "2", "--ffn", "256", "--layers",
             "1", "--seed", "4", "--out", out, env_dir=tmp_path)
    assert r.returncode == 0, r.stderr
    info = json.loads((out / "synthetic.json").read_text())
    want = dataclasses.replace(BUILTINS["tiny-dit"], dim=128, n_heads=2, ffn_dim=256,
                               n_layers=1, seed=4)
    assert info["kind"] == "denoiser" and info["fingerprint"] == want.fingerprint()
    assert FixtureStore(out / "fixtures.safetensors").has("reference")
    r = _cli("make", "tiny-dit", "--grid", "1x2x2", "--out", tmp_path / "no", env_dir=tmp_path)
    assert r.returncode == 2 and "grid does not apply to a denoiser" in r.stderr, r.stderr
    assert not (tmp_path / "no").exists()


def test_blockconfig_validate():
    c = BUILTIN_MODELS["tiny"].config().block
    assert c.qkv_width == 3 * 384
    with pytest.raises(ValueError, match="n_heads\\*head_dim"):
        dataclasses.replace(c, n_heads=5).validate()
    with pytest.raises(ValueError, match="multiple of 32"):
        dataclasses.replace(c, ffn_dim=1000).validate()
    g = BUILTIN_MODELS["tiny-gqa"].config()
    assert g.qkv_width == (4 + 2 * 2) * 96


def test_mixed_stored_types_via_the_gguf_writer(tmp_path):
    """A file as another converter might write it (the gguf package's writer): projections in
    F16 / BF16 / F32 are bound in exactly their stored type and bytes (never requantized);
    F16 norms decode to float32; a Q4_0 projection is bound as stored too (runnable since issue
    10), and an IQ4_NL one (no kernels) is refused, naming it."""
    d = make_synthetic(tmp_path / "s", small_spec(n_layers=1, include_weights=True))
    fx = FixtureStore(d / "fixtures.safetensors")
    t = {n: fx.load(n) for n in fx.names() if n.endswith((".weight", ".bias"))}
    BF16 = gguf.GGMLQuantizationType.BF16

    def write(path, q4=False, iq4=False):
        w = gguf.GGUFWriter(path, "lumina2")
        for n, a in t.items():
            if n.endswith("qkv.weight"):
                w.add_tensor(n, a.astype(np.float16))
            elif n.endswith("out.weight"):
                w.add_tensor(n, gguf.quants.quantize(a, BF16), raw_dtype=BF16)
            elif n.endswith("w1.weight") and q4:
                Q4 = gguf.GGMLQuantizationType.Q4_0
                w.add_tensor(n, gguf.quants.quantize(a, Q4), raw_dtype=Q4)
            elif n.endswith("w1.weight") and iq4:
                IQ4 = gguf.GGMLQuantizationType.IQ4_NL      # 32 values in 18 bytes
                w.add_tensor(n, np.zeros((a.shape[0], a.shape[1] // 32 * 18), np.uint8),
                             raw_dtype=IQ4)
            elif n.endswith("w1.weight") or n.endswith("norm1.weight"):
                w.add_tensor(n, a)                              # F32
            elif a.ndim == 2:
                w.add_tensor(n, gguf.quants.quantize(a, Q8), raw_dtype=Q8)
            else:
                w.add_tensor(n, a.astype(np.float16))           # F16 norms
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path

    p = write(tmp_path / "mixed.gguf")
    with open_model(p) as m:
        lw = m.layer_weights(0)
        want = {"qkv": ("F16", t["layers.0.attention.qkv.weight"].astype(np.float16)),
                "out": ("BF16", gguf.quants.quantize(t["layers.0.attention.out.weight"], BF16)),
                "w1": ("F32", t["layers.0.feed_forward.w1.weight"]),
                "w2": ("Q8_0", gguf.quants.quantize(t["layers.0.feed_forward.w2.weight"], Q8))}
        for k, (tname, raw) in want.items():
            w = getattr(lw, k)
            assert w.type_name == tname == m.gguf.type_name(w.name), k
            np.testing.assert_array_equal(w.data, np.ascontiguousarray(raw).view(np.uint8))
            assert np.shares_memory(w.data, m.gguf.mapping) and not w.data.flags.writeable, k
        np.testing.assert_array_equal(lw.q_norm, t["layers.0.attention.q_norm.weight"].astype(
            np.float16).astype(np.float32))
    p4 = write(tmp_path / "q4.gguf", q4=True)
    with open_model(p4) as m:
        w1 = m.layer_weights(0).w1
        want = gguf.quants.quantize(t["layers.0.feed_forward.w1.weight"],
                                    gguf.GGMLQuantizationType.Q4_0)
        assert w1.type_name == "Q4_0" and np.shares_memory(w1.data, m.gguf.mapping)
        np.testing.assert_array_equal(w1.data, want)
    pi = write(tmp_path / "iq4.gguf", iq4=True)
    with pytest.raises(ModelFileError, match="'layers.0.feed_forward.w1.weight' has type IQ4_NL"):
        open_model(pi)


# ----------------------------------------------------------------------------- models directory problems, generation

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
        _assert_models_dir_error(run_cli("nxhpc.blockrun", args, root), root, 9, "not a directory")
    _assert_models_dir_error(run_cli("nxhpc.models", ["show", "tiny"], root), root, 9,
                             "not a directory")
    _assert_models_dir_error(run_cli("nxhpc.models", ["--models-dir", str(root), "make", "x",
                                                   "--dim", "96", "--heads", "1"], tmp_path),
                             root, 9, "not a directory")
    with pytest.raises(ModelsDirError, match="not a directory"):
        open_model("tiny", models_dir=root)
    assert root.read_text() == "not a directory"


def test_models_dir_read_only(root, tmp_path):
    """A read-only models directory: generating a built-in there is exit 9 (every CLI) naming it
    (before: a traceback); a model already in it runs (read-only is fine for reading)."""
    require_private_mounts()
    ro = tmp_path / "ro"
    ro.mkdir()
    src = root / "tiny"
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
    r = run_script(script, env=models_env(ro), timeout=300)
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
    r = run_script(script, env=models_env(small), timeout=300)
    e1, e2 = ((tmp_path / f"e{i}").read_text() for i in (1, 2))
    assert "rc1=9" in r.stdout and "rc2=9" in r.stdout, (r.stdout, r.stderr, e1, e2)
    for e in (e1, e2):
        assert "Traceback" not in e and str(small) in e and "too full" in e and "free" in e, e
    assert (tmp_path / "left").read_text().split() in ([], [".tiny.lock"])

    limited = tmp_path / "limited"               # the write itself fails: EFBIG at 1 MB

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    r = subprocess.run([sys.executable, "-m", "nxhpc.blockrun", "tiny", "1"], capture_output=True,
                       text=True, env=models_env(limited), cwd=ROOT, timeout=300, preexec_fn=limit)
    _assert_models_dir_error(r, limited, 9, "cannot write built-in model 'tiny'")
    assert sorted(p.name for p in limited.iterdir()) == [".tiny.lock"]


def _blockrun_tiny(root):
    """``blockrun tiny 1`` on the models directory ``root``, its stderr read as it comes."""
    p = subprocess.Popen([sys.executable, "-m", "nxhpc.blockrun", "tiny", "1"],
                         stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                         cwd=ROOT, env=models_env(root))
    rd = PipeReader(p.stderr)
    rd.start()
    return p, rd


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
        p, rd = _blockrun_tiny(root)
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
        p, rd = _blockrun_tiny(root)
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
                             env=models_env(root), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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
    r = run_cli("nxhpc.blockrun", ["mid", "1"], root)
    assert r.returncode == 0, r.stderr
    assert not [q for q in root.iterdir() if ".tmp-" in q.name]


def test_block_after_model_close_is_a_clear_error(root):
    m = open_model("tiny", models_dir=root)
    m.block(0)                                                 # open: fine
    m.close()
    with pytest.raises(RuntimeError, match="closed"):          # before: a bare KeyError
        m.block(0)
    with pytest.raises(RuntimeError, match="closed"):
        m.layer_weights(1)
    with open_model("tiny", models_dir=root) as m2:
        pass
    with pytest.raises(RuntimeError, match="closed"):
        m2.block(1)


def test_empty_model_id_is_an_error(root, tmp_path, monkeypatch):
    """``""`` is not the current directory (before: it opened the cwd when that was a model
    directory); ``"."`` still is (negative control)."""
    src = root / "tiny"
    open_model("tiny", models_dir=root)
    monkeypatch.chdir(src)
    with pytest.raises(ModelNotFoundError, match="empty"):
        open_model("", models_dir=tmp_path)
    with pytest.raises(ModelNotFoundError, match="empty"):
        open_model("  ", models_dir=tmp_path)
    assert open_model(".", models_dir=tmp_path).config.dim == 384
    r = subprocess.run([sys.executable, "-m", "nxhpc.blockrun", "", "1"], capture_output=True,
                       text=True, env=dict(models_env(tmp_path), PYTHONPATH=str(ROOT)), cwd=src,
                       timeout=300)
    assert r.returncode == 3 and "empty" in r.stderr, (r.returncode, r.stderr)


def test_make_with_a_derived_ffn_says_it_was_derived(tmp_path):
    """``models make x --dim 64 --heads 1``: the FFN width nobody gave is derived from --dim
    (int(64/3*8) = 170, not a multiple of 32); the message says so. Control: given explicitly
    (--ffn 170) it is blamed as given."""
    r = run_cli("nxhpc.models", ["make", "x", "--dim", "64", "--heads", "1"], tmp_path)
    assert r.returncode == 2, r.stderr
    assert "not given" in r.stderr and "derived from dim 64" in r.stderr, r.stderr
    r = run_cli("nxhpc.models", ["make", "x", "--dim", "64", "--heads", "1", "--ffn", "170"],
             tmp_path)
    assert r.returncode == 2 and "ffn_dim 170" in r.stderr and "derived" not in r.stderr
    assert not (tmp_path / "x").exists()


def test_activation_names_sort_naturally_whatever_they_hold():
    """``models show`` lists a fixture file's activations with layers.10 after layers.9; a
    name with a word where another has a number, or a digit int() refuses ('²'), sorted as
    text instead of raising (a TypeError comparing int with str, a ValueError from int)."""
    from nxhpc.models.model import _natural_key
    names = ["layers.10.blk_in", "layers.b", "layers.9.blk_in", "layers.\u00b2", "layers.9.adaln_m"]
    assert sorted(names, key=_natural_key) == [
        "layers.9.adaln_m", "layers.9.blk_in", "layers.10.blk_in", "layers.b", "layers.\u00b2"]


def test_models_dir_option_before_or_after_the_command(tmp_path, capsys):
    """``models list --models-dir D`` was "unrecognized arguments" (the option was taken only
    before the command; every other CLI takes it anywhere). Both places name the same root;
    without it the default root is listed (control: the option is not ignored)."""
    from nxhpc.models import cli as models_cli
    for argv in (["--models-dir", str(tmp_path), "list"], ["list", "--models-dir", str(tmp_path)]):
        assert models_cli.main(argv) == 0
        assert capsys.readouterr().out.splitlines()[0] == f"models dir: {tmp_path}", argv
    assert models_cli.main(["list"]) == 0
    assert capsys.readouterr().out.splitlines()[0] != f"models dir: {tmp_path}"


# ------------------------------------------------------------ model directories keep the user's
def test_regenerating_a_stale_builtin_keeps_the_users_files(tmp_path):
    """A stale built-in (an upgrade, damage) is generated again; the user's files in its
    directory (an output saved there, a model made under it, notes) move into the new one
    (they were deleted with the old model). The model's own files are the new ones."""
    d = ensure_builtin("tiny", tmp_path)
    np.save(d / "out.npy", np.arange(3))
    (d / "mine").mkdir()
    (d / "mine" / "notes.txt").write_text("keep me")
    spec = json.loads((d / "synthetic.json").read_text())
    spec["fingerprint"] = "stale"
    (d / "synthetic.json").write_text(json.dumps(spec))
    assert not registry.builtin_current(d, registry.builtin_spec("tiny"))
    assert ensure_builtin("tiny", tmp_path) == d
    assert registry.builtin_current(d, registry.builtin_spec("tiny"))          # regenerated
    assert np.load(d / "out.npy").tolist() == [0, 1, 2]
    assert (d / "mine" / "notes.txt").read_text() == "keep me"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tiny.tmp-")]
    assert not [p for p in tmp_path.iterdir() if ".replaced-" in p.name]


def test_a_make_without_force_never_replaces_a_model_made_meanwhile(tmp_path):
    """Two ``models make X`` at once without --force: the second to finish was renamed over the
    first (both exit 0). Here the directory appears while the model is written (the other
    process): FileExistsError, the other's model untouched, no temporary left. Control: with
    replace=True it is replaced."""
    from nxhpc.models.modeldir import build_model_dir
    out = tmp_path / "race"

    def write(tmp, marker):
        if not out.exists():                         # the other process finishes first
            out.mkdir()
            (out / "model.gguf").write_text("theirs")
        (tmp / "model.gguf").write_text(marker)
    with pytest.raises(FileExistsError, match="made meanwhile"):
        build_model_dir(out, lambda tmp: write(tmp, "mine"))
    assert (out / "model.gguf").read_text() == "theirs"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["race"]
    build_model_dir(out, lambda tmp: write(tmp, "mine"), replace=True)
    assert (out / "model.gguf").read_text() == "mine"


def test_a_builtin_whose_manifest_cannot_be_written_says_so(tmp_path, monkeypatch):
    """A full disk at the manifest (the last, small file) said "nothing was left behind" while
    the model's files stayed. It says what it left: the files without their manifest, which
    the next use generates again (the user's files there kept throughout). Control: with the
    disk back the next use makes a current built-in, keep.txt still there."""
    import errno as _errno

    def full(d):
        raise OSError(_errno.ENOSPC, "No space left on device")
    d = ensure_builtin("tiny", tmp_path)
    (d / "keep.txt").write_text("mine")
    (d / "synthetic.json").write_text("{}")                      # stale: generated again
    monkeypatch.setattr(registry, "_write_manifest", full)
    with pytest.raises(ModelsDirError, match="written but not their manifest, so it is "
                                             "generated again at its next use") as e:
        ensure_builtin("tiny", tmp_path)
    assert "nothing was left behind" not in str(e.value)
    assert (d / "keep.txt").read_text() == "mine"
    monkeypatch.undo()
    assert not registry.builtin_current(d, registry.builtin_spec("tiny"))
    assert registry.builtin_current(ensure_builtin("tiny", tmp_path), registry.builtin_spec("tiny"))
    assert (d / "keep.txt").read_text() == "mine"


def test_the_manifest_holds_the_models_files_only(tmp_path):
    """A built-in's manifest fingerprints the model's files, not the user's beside them: once a
    regeneration had carried a user's out.npy in, writing out.npy again made the model stale
    and generated it again at every change (the review's finding)."""
    d = ensure_builtin("tiny", tmp_path)
    np.save(d / "out.npy", np.arange(3))
    (d / "synthetic.json").write_text("{}")                      # stale: generated again
    d = ensure_builtin("tiny", tmp_path)
    manifest = json.loads((d / ".nxhpc-files.json").read_text())
    assert sorted(manifest) == ["fixtures.safetensors", "model.gguf", "synthetic.json"]
    ino = (d / "model.gguf").stat().st_ino
    np.save(d / "out.npy", np.arange(5))                         # the user's output again
    assert registry.builtin_current(d, registry.builtin_spec("tiny"))
    assert ensure_builtin("tiny", tmp_path) == d and (d / "model.gguf").stat().st_ino == ino


def test_a_writer_killed_while_carrying_the_users_files_loses_none(tmp_path):
    """A writer killed after the swap, while moving the user's files into the new directory,
    left the rest in its ``-old`` temporary, which the next sweep deleted with the old model.
    The sweep now passes them on first (here the writer's state is made by hand: a dead pid's
    ``-old`` holding an old model and two user files, one already moved)."""
    from nxhpc.models.modeldir import sweep_stale
    d = ensure_builtin("tiny", tmp_path)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    old = tmp_path / f".tiny.tmp-{dead}-abc-old"
    old.mkdir()
    (old / "model.gguf").write_bytes(b"the old model")
    (old / "b_notes.txt").write_text("b")
    (old / "c").mkdir()
    (old / "c" / "out.npy").write_text("c")
    (d / "a_first.txt").write_text("a")                          # moved before the kill
    sweep_stale(tmp_path, "tiny")
    assert not old.exists()
    assert (d / "b_notes.txt").read_text() == "b" and (d / "c" / "out.npy").read_text() == "c"
    assert (d / "model.gguf").read_bytes() != b"the old model"   # the model's files: the new
    assert registry.builtin_current(d, registry.builtin_spec("tiny"))


def test_make_refuses_a_builtins_directory_and_zero_dims(tmp_path):
    """``models make tiny --types q4_k_m`` (no --out) wrote the variant into the built-in's own
    directory, which the next use generated again over it (exit 0 both times): refused, as is
    ``--out <models>/tiny``; --heads 0 was exit 70 (ZeroDivisionError) and --adaln-in 0 /
    --kv-heads 0 were replaced by defaults: exit 2. A blank NXHPC_MODELS made a directory named
    " " (exit 9 now); ``--models-dir=~/x`` is expanded as NXHPC_MODELS is. Control: the variant
    under another id is made."""
    for argv in (["make", "tiny", "--types", "q4_k_m"],
                 ["make", "v", "--out", str(tmp_path / "tiny"), "--dim", "64", "--heads", "2"]):
        r = run_cli("nxhpc.models", argv, tmp_path)
        assert r.returncode == 2 and "the directory of the built-in model 'tiny'" in r.stderr, \
            r.stderr
    assert not (tmp_path / "tiny").exists()
    for opt in ("--heads", "--adaln-in", "--kv-heads", "--ffn", "--dim", "--layers"):
        r = run_cli("nxhpc.models", ["make", "x", opt, "0"], tmp_path)
        assert r.returncode == 2 and f"argument {opt}: must be an integer >= 1" in r.stderr, \
            (opt, r.stderr)
    r = run_cli("nxhpc.models", ["make", "tiny-q4", "--types", "q4_k_m"], tmp_path)
    assert r.returncode == 0 and (tmp_path / "tiny-q4" / "model.gguf").is_file(), r.stderr
    from procutil import ROOT
    env = models_env(tmp_path, PYTHONPATH=str(ROOT), HOME=str(tmp_path))
    r = subprocess.run([sys.executable, "-m", "nxhpc.blockrun", "tiny"], capture_output=True,
                       text=True, cwd=tmp_path, timeout=300, env=dict(env, NXHPC_MODELS=" "))
    assert r.returncode == 9 and "NXHPC_MODELS=' ' is blank" in r.stderr, r.stderr
    assert not (tmp_path / " ").exists()
    r = subprocess.run([sys.executable, "-m", "nxhpc.models", "list", "--models-dir=~/x"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=300, env=env)
    assert r.returncode == 0 and f"models dir: {tmp_path}{os.sep}x" in r.stdout, \
        r.stdout + r.stderr


def test_a_bare_name_is_an_id_for_every_kind(tmp_path, monkeypatch):
    """A bare name is an id for the autoencoder door as for the others: a ``tiny-vae`` folder in
    the working directory made ``tiny-vae`` read its junk (exit 4) while ``tiny`` and
    ``tiny-te`` stayed the built-ins. ``./tiny-vae`` still names the folder (control)."""
    root = tmp_path / "models"
    work = tmp_path / "work"
    for name, f in (("tiny-vae", "ae.safetensors"), ("tiny-te", "model.gguf")):
        (work / name).mkdir(parents=True)
        (work / name / f).write_text("junk")
    monkeypatch.chdir(work)
    assert registry.resolve_vae("tiny-vae", root) == root / "tiny-vae" / "ae.safetensors"
    assert registry.resolve_vae("./tiny-vae", root) == Path("./tiny-vae") / "ae.safetensors"
    assert registry.resolve_model("tiny-te", root)[0] == root / "tiny-te"
    with pytest.raises(ModelNotFoundError, match="is a built-in text encoder model, not an "
                                                 "autoencoder"):
        registry.resolve_vae("tiny-te", root)


def test_a_models_dir_on_proc_is_said_to_be_uncreatable_not_full(tmp_path):
    """``--models-dir /proc/nonexist``: "too full ... 0.0 MB free" (the library-API helper's
    find; /sys the same): the room was read on /proc, a file system of no blocks, before
    the folder was made. Such a file system's room is unknown now, and the mkdir's own reason
    is given, exit 9. Control: a real folder of no room is still "too full"."""
    from nxhpc.models import modeldir
    for root, why in (("/proc/nxhpc-nonexist", "No such file or directory"),
                      ("/sys/nxhpc-nonexist", "Operation not permitted")):
        with pytest.raises(ModelsDirError, match="cannot be created: " + why):
            modeldir.check_models_root(Path(root), need_bytes=10**6)
    r = run_cli("nxhpc.blockrun", ["tiny", "1", "--models-dir", "/proc/nxhpc-nonexist"],
                tmp_path)
    assert r.returncode == 9 and "cannot be created" in r.stderr, r.stderr
    assert "too full" not in r.stderr
    with pytest.raises(ModelsDirError, match="too full"):              # control
        modeldir.check_models_root(tmp_path / "x", need_bytes=modeldir._free_bytes(tmp_path)
                                   + (1 << 40))
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("given", ["", "  ", b""], ids=["empty", "blank", "empty-bytes"])
def test_an_empty_models_dir_is_refused_not_taken_as_the_working_directory(given, tmp_path,
                                                                           monkeypatch):
    """``load_model("tiny", models_dir="")`` generated the model in the working directory
    without a word (the library-API helper's find: ``Path("")`` is "."); the CLI refuses an
    empty ``--models-dir`` and a blank ``$NXHPC_MODELS`` is refused too. The library now
    refuses it the same way, making nothing. Control: ``"."`` names the working directory on
    purpose and is taken."""
    import nxhpc
    monkeypatch.chdir(tmp_path)
    for load in (nxhpc.load_model, nxhpc.load_denoiser, nxhpc.load_vae):
        with pytest.raises(ModelsDirError, match="is empty: give a directory"):
            load("tiny-dit" if load is nxhpc.load_denoiser else
                 "tiny-vae" if load is nxhpc.load_vae else "tiny", models_dir=given)
    assert os.listdir(tmp_path) == []
    with nxhpc.load_model("tiny", models_dir=".") as m:                  # control
        assert m.config.n_layers >= 1
    assert (tmp_path / "tiny" / "model.gguf").is_file()


def test_a_models_dir_too_full_is_refused_before_any_folder_is_made(tmp_path, monkeypatch):
    """``NXHPC_MODELS=/full/x/y/z``: exit 9 "too full", but ``x/y/z`` had been made first and
    stayed (the environment helper's find; "nothing is left behind"). The room is checked on
    the nearest folder that exists, before anything is made. Control: with room, the folders
    are made."""
    from nxhpc.models import modeldir
    free = {"bytes": 10}
    monkeypatch.setattr(modeldir, "_free_bytes", lambda d: free["bytes"])
    root = tmp_path / "x" / "y" / "z"
    with pytest.raises(ModelsDirError, match="too full"):
        modeldir.check_models_root(root, need_bytes=10**6)
    assert not (tmp_path / "x").exists()
    free["bytes"] = 10**7
    modeldir.check_models_root(root, need_bytes=10**6)
    assert root.is_dir()


def test_models_make_with_a_stderr_that_cannot_be_written_or_no_working_directory(tmp_path):
    """``models make ... 2>/dev/full`` failed with exit 9 "the file system is full" and no
    model: its progress line's ENOSPC on stderr was taken for the model's own write; and
    ``models make --out mm`` from a removed working directory was exit 9 "cannot write model
    ... under ." where every other CLI says exit 2 (the environment helper's finds). The
    progress line is dropped now (the model is made, exit 0), and the removed directory is
    exit 2 naming it. Control: the same make with stderr captured writes the same files."""
    make = ["-m", "nxhpc.models", "make", "mm", "--dim", "64", "--heads", "2", "--ffn", "128",
            "--layers", "1", "--grid", "1x4x4", "--out"]
    env = models_env(tmp_path / "models")
    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, *make, str(tmp_path / "a")], stdout=subprocess.PIPE,
                           stderr=full, text=True, cwd=ROOT, env=env, timeout=300)
    assert r.returncode == 0, r.stdout
    r = subprocess.run([sys.executable, *make, str(tmp_path / "b")], capture_output=True,
                       text=True, cwd=ROOT, env=env, timeout=300)                 # control
    assert r.returncode == 0 and "[nxhpc.models mm" in r.stderr, r.stderr
    for name in ("model.gguf", "fixtures.safetensors"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    gone = tmp_path / "gone"
    r = subprocess.run(["sh", "-c", f'mkdir "{gone}" && cd "{gone}" && rmdir "{gone}" && '
                        f'exec "{sys.executable}" ' + " ".join(make) + " mm"],
                       capture_output=True, text=True, timeout=120,
                       env=dict(env, PYTHONPATH=str(ROOT)))
    assert r.returncode == 2 and "the current directory no longer exists" in r.stderr, r.stderr
