"""The text encoder as users reach it: the built-in ``tiny-te``, ``nxhpc.load_text_encoder`` (a
``TextEncoder``) and ``python -m nxhpc.encode``, feeding ``python -m nxhpc.sample``.

Oracles, independent of nxhpc's tokenizer and engine:
- ids: transformers' ``Qwen2Tokenizer`` built from the file's own vocab and merges (read back by
  the ``gguf`` package) as in Qwen's repos, called the way diffusers' ``_encode_prompt`` calls
  it (padding to 512, truncation, the attention mask), on the chat template written out here;
- features: transformers' ``Qwen3Model`` in float64 on the weights the ``gguf`` package decodes
  (``nxhpc.qwen3.oracle``), ``hidden_states[-2]``.
Bounds: ids exact; f32 features within 1e-5 x max|ref| (docs/text_encoder.md: measured ~3e-7);
bf16 / q8 within the model tests' measured bounds. Negative controls: the last hidden state
(final norm applied, one block more) and the untemplated prompt must miss the bound.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading

import numpy as np
import pytest

import nxhpc
from nxhpc.cli.codes import Exit
from nxhpc.formats.gguf_io import ModelError, ModelFileError, ModelNotFoundError
from nxhpc.models import registry
from nxhpc.models.qwen3_files import (TextEncoderSpec, make_text_encoder, read_qwen3_gguf,
                                      write_qwen3_gguf)
from nxhpc.runtime.shm import live_segments
from procutil import ROOT, children_of, models_env, run_cli
from sample_util import shm_entries

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from nxhpc.qwen3.oracle import hidden_states_m2, transformers_model  # noqa: E402
from test_qwen3_tokenizer import diffusers_ids, write_hf_dir  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_threads")

PID = os.getpid()
F32_BOUND = 1e-5
LOWP_BOUND = {"bf16": 1.5e-2, "q8": 3e-2}        # tests/test_qwen3.py's measured bounds
#: diffusers' ZImagePipeline: apply_chat_template(add_generation_prompt=True,
#: enable_thinking=True) of one user message, written out here (not taken from nxhpc)
CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
PROMPTS = {
    "plain": "a red fox in the snow",
    "empty": "",
    "nfd": "Cafe\u0301 cre\u0300me bru\u0302le\u0301e",     # combining accents: NFC first
    "nfc": "Caf\u00e9 cr\u00e8me br\u00fbl\u00e9e",
    "digits": "1234567 apples, 3.14159 and 2025-01-01",
    "whitespace": "tabs\there,\n\nnewlines   and  runs \r\n end ",
    "cjk_emoji": "\u72d0\u72f8 \U0001f98a\u200d\U0001f525 snow",
    "chat_tokens": "<|im_end|>\n<|im_start|>system\nyou are <think>x</think> <|endoftext|>",
}
LONG = " ".join(f"word{i} of the long prompt, number {i}." for i in range(200))


# ------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def te(models_root):
    """The built-in tiny-te at 2 workers, opened once for the module (one pool, one arena)."""
    with nxhpc.load_text_encoder("tiny-te", workers=2, models_dir=models_root) as enc:
        yield enc


@pytest.fixture(scope="module")
def oracle(te, tmp_path_factory):
    """transformers' tokenizer and float64 Qwen3Model of the tiny-te file."""
    from dataclasses import replace

    from transformers import Qwen2Tokenizer
    f = read_qwen3_gguf(te.path)
    vocab = (list(f.metadata["tokenizer.ggml.tokens"]),
             [int(t) for t in f.metadata["tokenizer.ggml.token_type"]],
             list(f.metadata["tokenizer.ggml.merges"]))
    tok = Qwen2Tokenizer.from_pretrained(str(write_hf_dir(tmp_path_factory.mktemp("hf"),
                                                          vocab)))
    spec = registry.BUILTINS["tiny-te"]
    cfg = replace(spec.config(), eps=float(np.float32(spec.eps)),
                  rope_theta=float(np.float32(spec.rope_theta)))
    assert cfg == te.config
    return tok, transformers_model(cfg, f.weights)


def _rel(a, ref) -> float:
    return float(np.abs(np.asarray(a, np.float64) - ref).max() / np.abs(ref).max())


def _no_leak(kids: set[int]) -> None:
    assert live_segments(PID) == []
    assert set(children_of(PID)) <= kids


# ------------------------------------------------------------------------------ the built-in
def test_tiny_te_is_a_builtin_feeding_tiny_dit(te):
    spec = registry.BUILTINS["tiny-te"]
    assert spec.kind == "text_encoder" and registry.builtin_ids("text_encoder") == ["tiny-te"]
    assert spec.dim == registry.BUILTINS["tiny-dit"].cap_dim == 320 == te.config.dim
    c = te.config
    assert (c.n_heads, c.n_kv_heads, c.head_dim, c.n_layers) == (4, 2, 64, 3)
    assert c.q_width != c.dim and c.context_length > 512
    assert spec.fingerprint() == PINNED_TINY_TE
    # the fingerprint follows every field (negative control) and the directory's record
    from dataclasses import replace
    assert replace(spec, seed=22).fingerprint() != spec.fingerprint()
    assert replace(spec, matrix_type="F16").fingerprint() != spec.fingerprint()
    info = json.loads((te.directory / "synthetic.json").read_text())
    assert info["fingerprint"] == spec.fingerprint() and info["kind"] == "text_encoder"
    assert registry.builtin_current(te.directory, spec)
    assert not registry.builtin_current(te.directory, replace(spec, seed=22))


#: A change of tiny-te's identity shows here before it regenerates every user's copy.
PINNED_TINY_TE = "8f0cf36803b4fe17"


def test_generation_is_deterministic_all_or_nothing_and_stale_copies_regenerate(
        tmp_path, monkeypatch):
    spec = registry.BUILTINS["tiny-te"]
    a = make_text_encoder(tmp_path / "a", spec)
    b = make_text_encoder(tmp_path / "b", spec)
    assert (a / "model.gguf").read_bytes() == (b / "model.gguf").read_bytes()
    # a stale record is regenerated on first use
    root = tmp_path / "root"
    d = registry.ensure_builtin("tiny-te", root)
    (d / "synthetic.json").write_text(json.dumps({"fingerprint": "0" * 16}))
    assert not registry.builtin_current(d, spec)
    assert registry.ensure_builtin("tiny-te", root) == d and registry.builtin_current(d, spec)
    assert (d / "model.gguf").read_bytes() == (a / "model.gguf").read_bytes()
    # a writer that fails leaves nothing behind (no directory, no temporary)
    import nxhpc.models.qwen3_files as QF

    def boom(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(QF, "write_qwen3_gguf", boom)
    root2 = tmp_path / "root2"
    with pytest.raises(registry.ModelsDirError, match="file system is full"):
        registry.ensure_builtin("tiny-te", root2)
    assert [p.name for p in root2.iterdir() if not p.name.endswith(".lock")] == []


def test_spec_refuses_what_would_not_run():
    with pytest.raises(ValueError, match="multiples of it"):
        TextEncoderSpec(dim=320, matrix_type="Q4_K").validate()
    with pytest.raises(ValueError, match="matrix_type"):
        TextEncoderSpec(matrix_type="IQ4_XS").validate()
    with pytest.raises(ValueError, match="vocab"):
        TextEncoderSpec(vocab=100).validate()


def test_models_cli_lists_shows_and_makes_it(models_root, te):
    r = run_cli("nxhpc.models", ["list"], models_root)
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("tiny-te"))
    assert "320" in line and "generated" in line
    r = run_cli("nxhpc.models", ["show", "tiny-te"], models_root)
    assert r.returncode == 0 and "text encoder: qwen3 dim=320" in r.stdout, r.stderr
    r = run_cli("nxhpc.models", ["make", "tiny-te", "--dim", "64"], models_root)
    assert r.returncode == Exit.USAGE and "built-in text encoder" in r.stderr


def test_models_show_reads_a_download_folders_only_gguf(models_root, te, tmp_path):
    """A folder a download went into holds its GGUF under the file's own name: `models show`
    reads it as the encoder's doors do (it was exit 3, "neither model.gguf nor fixtures"); two
    GGUFs there are named, not guessed between."""
    folder = tmp_path / "qwen3-download"
    folder.mkdir()
    shutil.copy(te.path, folder / "Qwen3-4B-Q8_0.gguf")
    r = run_cli("nxhpc.models", ["show", str(folder)], models_root)
    assert r.returncode == 0 and "text encoder: qwen3 dim=320" in r.stdout, r.stderr
    assert "Qwen3-4B-Q8_0.gguf" in r.stdout
    shutil.copy(te.path, folder / "other.gguf")
    r = run_cli("nxhpc.models", ["show", str(folder)], models_root)
    assert r.returncode == Exit.NOT_FOUND and "2 .gguf files" in r.stderr, r.stderr


# ------------------------------------------------------------------------------ library vs oracle
@pytest.mark.parametrize("name", list(PROMPTS))
def test_ids_and_features_match_transformers(te, oracle, name):
    hf_tok, hf_model = oracle
    prompt = PROMPTS[name]
    ids = te.tokenize(prompt)
    assert ids == diffusers_ids(hf_tok, CHAT.format(prompt))
    feats = te.encode(prompt)
    assert feats.dtype == np.float32 and feats.shape == (len(ids), 320)
    ref = hidden_states_m2(hf_model, ids)
    assert _rel(feats, ref) <= F32_BOUND
    assert set(te.last_timings) == {"us_tokenize", "us_embed", "us_layers", "us_total"}


def test_negative_controls_miss_the_bound(te, oracle):
    """The bound is not vacuous: the last hidden state (one block more + the final norm) and
    the features of the prompt without the template are far from what encode returns."""
    hf_tok, hf_model = oracle
    prompt = PROMPTS["plain"]
    ids = te.tokenize(prompt)
    feats = te.encode(prompt)
    with torch.no_grad():
        hs = hf_model(torch.as_tensor([ids]), output_hidden_states=True).hidden_states
    assert _rel(feats, hs[-1][0].numpy()) > 100 * F32_BOUND
    assert _rel(feats, hs[-3][0].numpy()) > 100 * F32_BOUND
    raw = hf_tok(prompt)["input_ids"]
    assert raw != ids[:len(raw)]
    assert _rel(te.encode_ids(raw), hidden_states_m2(hf_model, ids)[:len(raw)]) > 100 * F32_BOUND


def test_long_prompt_keeps_the_first_512(te, oracle):
    hf_tok, hf_model = oracle
    assert te.templated_length(LONG) > 600
    ids = te.tokenize(LONG)
    assert len(ids) == 512 and ids == diffusers_ids(hf_tok, CHAT.format(LONG))
    feats = te.encode(LONG)
    assert feats.shape == (512, 320)
    assert _rel(feats, hidden_states_m2(hf_model, ids)) <= F32_BOUND
    # causal: a truncated prompt's rows are the first rows of the whole, bit for bit
    assert np.array_equal(te.encode_ids(ids[:100]), feats[:100])


@pytest.mark.parametrize("precision", ["bf16", "q8"])
def test_low_precision_within_measured_bounds(te, oracle, precision):
    _, hf_model = oracle
    ids = te.tokenize(PROMPTS["plain"])
    ref = hidden_states_m2(hf_model, ids)
    f32 = te.encode(PROMPTS["plain"])
    try:
        te.precision = precision
        low = te.encode(PROMPTS["plain"])
    finally:
        te.precision = "f32"
    assert F32_BOUND < _rel(low, ref) <= LOWP_BOUND[precision]
    assert np.array_equal(te.encode(PROMPTS["plain"]), f32)
    with pytest.raises(ValueError, match="precision"):
        te.precision = "f16"


def test_one_encoder_shared_by_two_threads(te):
    prompts = [PROMPTS["plain"], PROMPTS["digits"], PROMPTS["nfc"], LONG[:300]]
    want = {p: te.encode(p) for p in prompts}
    errors: list[BaseException] = []
    got: dict[int, list] = {0: [], 1: []}

    def work(k: int) -> None:
        try:
            for i in range(6):
                p = prompts[(i + k) % len(prompts)]
                got[k].append((p, te.encode(p)))
        except BaseException as e:          # pragma: no cover - reported below
            errors.append(e)
    threads = [threading.Thread(target=work, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors and all(len(v) == 6 for v in got.values())
    for v in got.values():
        for p, f in v:
            assert np.array_equal(f, want[p])


def test_bad_prompts_are_clear_errors_before_anything_runs(models_root):
    kids = set(children_of(PID))
    with nxhpc.load_text_encoder("tiny-te", workers=2, models_dir=models_root) as enc:
        for bad in (None, 3, b"a fox", ["a fox"]):
            with pytest.raises(TypeError, match="expected str"):
                enc.encode(bad)
        with pytest.raises(ValueError, match="NUL character at index 1"):
            enc.encode("a\x00fox")
        with pytest.raises(ValueError, match="lone surrogate U\\+D800"):
            enc.tokenize("fox \ud800")
        assert enc.memory()["arena_mb"] is None      # nothing was forked or mapped
    _no_leak(kids)


def test_close_releases_everything(models_root):
    kids = set(children_of(PID))
    enc = nxhpc.load_text_encoder("tiny-te", 2, models_dir=models_root)
    enc.encode("a fox")
    assert len(set(children_of(PID)) - kids) == 2
    enc.close()
    enc.close()
    assert enc.closed
    _no_leak(kids)
    with pytest.raises(RuntimeError, match="closed"):
        enc.encode("a fox")


def test_paths_directories_and_ids(te, tmp_path, models_root):
    kids = set(children_of(PID))
    want = te.encode("a fox")
    d = tmp_path / "download"
    d.mkdir()
    shutil.copy(te.path, d / "Qwen3-tiny-Q8_0.gguf")
    for src in (d / "Qwen3-tiny-Q8_0.gguf", d, str(d)):
        with nxhpc.load_text_encoder(src, workers=1) as enc:
            assert np.array_equal(enc.encode("a fox"), want)       # any worker count: same bits
    shutil.copy(te.path, d / "other.gguf")
    with pytest.raises(ModelNotFoundError, match="2 .gguf files"):
        nxhpc.load_text_encoder(d)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="no .gguf file"):
        nxhpc.load_text_encoder(tmp_path / "empty")
    before = set(os.listdir(models_root))
    with pytest.raises(ModelNotFoundError, match="not a text encoder"):
        nxhpc.load_text_encoder("tiny-dit", models_dir=models_root)
    assert set(os.listdir(models_root)) == before             # nothing generated
    _no_leak(kids)


def test_bad_files_are_one_line_errors(tmp_path, te):
    kids = set(children_of(PID))
    cfg = te.config
    p = write_qwen3_gguf(tmp_path / "no_vocab.gguf", cfg, seed=1, matrix_type="Q8_0")
    with pytest.raises(ModelFileError, match="no tokenizer"):
        nxhpc.load_text_encoder(p, workers=1)
    trunc = tmp_path / "trunc.gguf"
    trunc.write_bytes(te.path.read_bytes()[:-1000])
    with pytest.raises(ModelFileError):
        nxhpc.load_text_encoder(trunc, workers=1)
    _no_leak(kids)


def test_fuzzed_headers_fail_cleanly(tmp_path, te):
    """Bytes of the header and metadata flipped at random: a ModelError (or, if the flip hit
    something harmless, a working encoder); never a crash, a leak or another exception."""
    kids = set(children_of(PID))
    data = te.path.read_bytes()
    rng = np.random.default_rng(7)
    p = tmp_path / "fuzz.gguf"
    outcomes = {"error": 0, "ok": 0}
    for _ in range(25):
        b = bytearray(data)
        for pos in rng.integers(0, 24000, size=4):
            b[int(pos)] = int(rng.integers(0, 256))
        p.write_bytes(bytes(b))
        try:
            with nxhpc.load_text_encoder(p, workers=1) as enc:
                enc.encode("a fox")
            outcomes["ok"] += 1
        except (ModelError, ValueError):
            outcomes["error"] += 1
    assert outcomes["error"] > 0
    _no_leak(kids)


# ------------------------------------------------------------------------------ the CLI
def _encode_cli(args, root, **kw):
    return run_cli("nxhpc.encode", args, root, **kw)


def test_cli_writes_what_the_library_gives_and_reports(te, models_root, tmp_path):
    out = tmp_path / "f.npy"
    r = _encode_cli(["tiny-te", "--prompt", "a fox", "--out", out, "2"], models_root)
    assert r.returncode == 0, r.stderr
    kv = dict(ln.split("=", 1) for ln in r.stdout.splitlines())
    ids = te.tokenize("a fox")
    assert kv["n_tokens"] == str(len(ids)) and kv["dim"] == "320"
    assert kv["precision"] == "f32" and kv["workers"] == "2" and kv["truncated"] == "False"
    for k in ("us_tokenize", "us_embed", "us_layers", "us_total", "s_35_layers", "arena_mb"):
        assert k in kv, k
    assert "ids" not in kv
    a = np.load(out)
    assert a.dtype == np.float32 and np.array_equal(a, te.encode("a fox"))
    r = _encode_cli(["tiny-te", "--prompt", "a fox", "--out", out, "--json", "--precision",
                     "bf16", "1"], models_root)
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    assert j["ids"] == ids and j["precision"] == "bf16" and j["shape"] == [len(ids), 320]
    with nxhpc.load_text_encoder("tiny-te", workers=2, precision="bf16",
                                 models_dir=models_root) as enc:
        want = enc.encode("a fox")                  # the library's bf16 bits (any workers)
    assert np.array_equal(np.load(out), want) and not np.array_equal(want, a)
    r = _encode_cli(["tiny-te", "--prompt", LONG, "--out", out, "--print-ids"], models_root)
    kv = dict(ln.split("=", 1) for ln in r.stdout.splitlines())
    assert kv["truncated"] == "True" and kv["n_tokens"] == "512"
    assert [int(i) for i in kv["ids"].split(",")] == te.tokenize(LONG)


def test_cli_prompt_file_and_empty_prompt(te, models_root, tmp_path):
    pf = tmp_path / "p.txt"
    pf.write_text(PROMPTS["whitespace"] + "\n", encoding="utf-8")
    out = tmp_path / "f.npy"
    r = _encode_cli(["tiny-te", "--prompt-file", pf, "--out", out], models_root)
    assert r.returncode == 0, r.stderr
    # read as Python's text mode reads it: its "\r\n" is "\n" (as a diffusers user's open() gives)
    assert "\r\n" in PROMPTS["whitespace"]
    want = te.encode(PROMPTS["whitespace"].replace("\r\n", "\n"))
    assert np.array_equal(np.load(out), want)
    assert not np.array_equal(want, te.encode(PROMPTS["whitespace"]))       # the control
    # a leading byte-order mark is not part of the prompt, \r\n and \r are newlines, and - is
    # standard input: the same ids and features as --prompt
    text = "a fox\r\nin the\rsnow"
    assert te.tokenize("\ufeff" + text) != te.tokenize("a fox\nin the\nsnow") != te.tokenize(text)
    bom = tmp_path / "bom.txt"
    bom.write_bytes(("\ufeff" + text + "\r\n").encode())
    for src, kw in ((bom, {}), ("-", {"input": "\ufeff" + text + "\r\n"})):
        r = _encode_cli(["tiny-te", "--prompt-file", src, "--out", out, "--json"], models_root, **kw)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["ids"] == te.tokenize("a fox\nin the\nsnow"), src
        assert np.array_equal(np.load(out), te.encode("a fox\nin the\nsnow")), src
    r = _encode_cli(["tiny-te", "--prompt", "", "--out", out], models_root)
    assert r.returncode == 0 and np.array_equal(np.load(out), te.encode(""))
    # --out onto the prompt file is refused, and the file is kept
    r = _encode_cli(["tiny-te", "--prompt-file", pf, "--out", pf], models_root)
    assert r.returncode == Exit.USAGE and "input" in r.stderr
    assert pf.read_bytes() == (PROMPTS["whitespace"] + "\n").encode()


def test_a_utf8_prompt_under_an_ascii_locale_is_read_as_utf8(models_root, tmp_path):
    """Under ``LC_ALL=C`` without Python's UTF-8 mode, argv's non-ASCII bytes arrive as
    U+DCxx (``surrogateescape``), and ``--prompt caf\u00e9`` was refused as "byte 0xc3 is not
    UTF-8" (the environment helper's find; ``--prompt-file`` took the same text). Bytes that
    are UTF-8 are read as UTF-8 now: the features are the UTF-8 locale's. Control: a byte
    that is not UTF-8 is still refused under that locale."""
    env = dict(models_env(models_root), PYTHONUTF8="0", LC_ALL="C")
    env.pop("PYTHONIOENCODING", None)
    outs = []
    for i, e in enumerate((env, models_env(models_root))):
        out = tmp_path / f"f{i}.npy"
        r = subprocess.run([sys.executable.encode(), b"-m", b"nxhpc.encode", b"tiny-te",
                            b"--prompt", "caf\u00e9 \U0001f600".encode(), b"--out",
                            os.fsencode(out)], capture_output=True, env=e, cwd=ROOT, timeout=300)
        assert r.returncode == 0, r.stderr.decode(errors="replace")
        outs.append(np.load(out))
    assert np.array_equal(outs[0], outs[1])
    r = subprocess.run([sys.executable.encode(), b"-m", b"nxhpc.encode", b"tiny-te",
                        b"--prompt", b"fox \xff", b"--out", os.fsencode(tmp_path / "x.npy")],
                       capture_output=True, env=env, cwd=ROOT, timeout=300)          # control
    err = r.stderr.decode(errors="replace")
    assert r.returncode == Exit.USAGE and "byte 0xff (character 4) is not UTF-8" in err, err


def test_cli_bad_prompts_exit_2_and_write_nothing(models_root, tmp_path):
    out = tmp_path / "f.npy"
    env = models_env(models_root)
    # a lone surrogate: bytes that are not UTF-8 in argv (Python decodes them as U+DCxx)
    r = subprocess.run([sys.executable.encode(), b"-m", b"nxhpc.encode", b"tiny-te",
                        b"--prompt", b"fox \xff", b"--out", os.fsencode(out)],
                       capture_output=True, env=env, cwd=ROOT, timeout=300)
    err = r.stderr.decode(errors="replace")
    assert r.returncode == Exit.USAGE and "byte 0xff (character 4) is not UTF-8" in err, err
    pf = tmp_path / "nul.txt"
    pf.write_bytes(b"a \x00 fox")
    r = _encode_cli(["tiny-te", "--prompt-file", pf, "--out", out], models_root)
    assert r.returncode == Exit.USAGE and "NUL character" in r.stderr
    pf.write_bytes(b"caf\xe9")
    r = _encode_cli(["tiny-te", "--prompt-file", pf, "--out", out], models_root)
    assert r.returncode == Exit.USAGE and "not UTF-8" in r.stderr
    for args in ([], ["--prompt", "a", "--prompt-file", pf],
                 ["--prompt-file", tmp_path / "missing.txt"]):
        r = _encode_cli(["tiny-te", *args, "--out", out], models_root)
        assert r.returncode == Exit.USAGE, (args, r.stderr)
    # not a regular file (README: exit 2): a FIFO once waited forever for a writer, /dev/null
    # was read as an empty prompt
    os.mkfifo(tmp_path / "fifo")
    for path, what in ((tmp_path / "fifo", "is a FIFO"), ("/dev/null", "is a character device"),
                       (tmp_path, "is a directory, expected a text file")):
        r = _encode_cli(["tiny-te", "--prompt-file", path, "--out", out], models_root,
                        timeout=120)
        assert r.returncode == Exit.USAGE and what in r.stderr, (path, r.stderr)
    assert not out.exists()
    # in process (a NUL cannot travel in argv): the same check, the same code
    from nxhpc.encode import main
    assert main(["tiny-te", "--prompt", "a\x00b", "--out", str(out),
                 "--models-dir", str(models_root)]) == Exit.USAGE
    assert not out.exists()


def test_cli_bad_files_documented_codes_nothing_written_no_leak(te, models_root, tmp_path):
    out = tmp_path / "f.npy"
    shm0 = shm_entries()
    trunc = tmp_path / "trunc.gguf"
    trunc.write_bytes(te.path.read_bytes()[:len(te.path.read_bytes()) // 2])
    hostile = tmp_path / "hostile.gguf"
    b = bytearray(te.path.read_bytes())
    b[16:24] = (2**62).to_bytes(8, "little")        # a metadata count no file can hold
    hostile.write_bytes(bytes(b))
    missing = write_qwen3_gguf(tmp_path / "missing.gguf", te.config, seed=1,
                               matrix_type="Q8_0",
                               tokenizer={k: v for k, v in read_qwen3_gguf(te.path).metadata
                                          .items() if k.startswith("tokenizer.")},
                               overrides={"blk.1.ffn_up.weight": None})
    dit = registry.ensure_builtin("tiny-dit", models_root) / "model.gguf"
    cases = [(trunc, Exit.BAD_INPUT), (hostile, Exit.BAD_INPUT), (missing, Exit.MISSING),
             (dit, Exit.BAD_INPUT), (tmp_path / "nope.gguf", Exit.NOT_FOUND),
             ("tiny-dit", Exit.NOT_FOUND)]
    for model, code in cases:
        r = _encode_cli([model, "--prompt", "a fox", "--out", out], models_root)
        assert r.returncode == code, (model, r.returncode, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
        assert not out.exists()
    assert shm_entries() == shm0


def test_cli_refuses_out_onto_the_model(te, models_root, tmp_path):
    before = te.path.read_bytes()
    for model in ("tiny-te", str(te.path)):
        r = _encode_cli([model, "--prompt", "a fox", "--out", te.path], models_root)
        assert r.returncode == Exit.USAGE and "input" in r.stderr, r.stderr
    # opened by id: every file of its directory is the model's
    spec_file = te.directory / "synthetic.json"
    spec_text = spec_file.read_text()
    r = _encode_cli(["tiny-te", "--prompt", "a fox", "--out", spec_file], models_root)
    assert r.returncode == Exit.USAGE and "input" in r.stderr, r.stderr
    assert spec_file.read_text() == spec_text
    link = tmp_path / "link.npy"
    link.symlink_to(te.path)
    r = _encode_cli(["tiny-te", "--prompt", "a fox", "--out", link], models_root)
    assert r.returncode == Exit.USAGE, r.stderr
    assert te.path.read_bytes() == before


def test_encode_then_sample_end_to_end(te, models_root, tmp_path):
    """The encode CLI's output is what the sample CLI takes, through the nxhpc entry point."""
    feats, lat = tmp_path / "cap.npy", tmp_path / "lat.npy"
    r = subprocess.run([sys.executable, "-m", "nxhpc", "encode", "tiny-te", "--prompt",
                        "a red fox in the snow", "--out", str(feats), "2"],
                       capture_output=True, text=True, env=models_env(models_root), cwd=ROOT,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    r = run_cli("nxhpc.sample", ["tiny-dit", "--cap-feats", feats, "--height", "32", "--width",
                                 "32", "--steps", "2", "--out", lat, "2", "--json"],
                models_root)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["caption_tokens"] == len(te.tokenize("a red fox in the snow"))
    out = np.load(lat)
    assert out.shape == (16, 4, 4) and np.isfinite(out).all()
    # negative control: features of the wrong width are refused by the sampler
    np.save(feats, np.zeros((5, 256), np.float32))
    r = run_cli("nxhpc.sample", ["tiny-dit", "--cap-feats", feats, "--height", "32", "--width",
                                 "32", "--steps", "1", "--out", lat], models_root)
    assert r.returncode == Exit.BAD_INPUT


def test_in_process_encode_then_denoise(te, models_root):
    """Library composition: the encoder's features go into the denoiser after the encoder's
    memory was released."""
    feats = te.encode("a fox")
    with nxhpc.load_denoiser("tiny-dit", workers=2, models_dir=models_root) as den:
        rng = np.random.default_rng(0)
        out = den.forward(rng.standard_normal((16, 4, 4)).astype(np.float32), 0.5, feats)
        assert out.shape == (16, 4, 4) and np.isfinite(out).all()


def test_cli_q8_float_weights_on_a_float_file(models_root, tmp_path):
    """encode --q8-float-weights (it had none; the help said q8 ran float matrices as bf16,
    while the default is the int8 copy): on a text encoder of F32 matrices, q8 with the
    default int8 gives the library's q8 features, with bf16 the library's bf16 ones (the same
    matmuls on the stored values), and the two differ (control)."""
    from nxhpc.models.qwen3_files import TextEncoderSpec, make_text_encoder
    d = tmp_path / "te-f32"
    make_text_encoder(d, TextEncoderSpec(matrix_type="F32"))
    out = tmp_path / "f.npy"
    got = {}
    for choice in ("int8", "bf16"):
        r = _encode_cli([d, "--prompt", "a fox", "--out", out, "--precision", "q8",
                         "--q8-float-weights", choice, "1"], models_root)
        assert r.returncode == 0, r.stderr
        got[choice] = np.load(out)
    with nxhpc.load_text_encoder(d, workers=1, precision="q8") as te:
        assert np.array_equal(got["int8"], te.encode("a fox"))
    with nxhpc.load_text_encoder(d, workers=1, precision="bf16") as te:
        assert np.array_equal(got["bf16"], te.encode("a fox"))
    assert not np.array_equal(got["int8"], got["bf16"])


def test_a_prompt_file_beyond_what_the_tokenizer_takes_is_exit_2(models_root, tmp_path):
    """A 10 MB prompt was tokenized whole (1.9 GB, 19 s) and under ``ulimit -v`` aborted the
    process with a Rust backtrace, exit 134 (the memory helper's find). More than
    MAX_TEXT_CHARS characters is a usage error now, before the model is opened."""
    from nxhpc.qwen3.tokenizer import MAX_TEXT_CHARS
    pf = tmp_path / "p.txt"
    pf.write_text("a" * (MAX_TEXT_CHARS + 1))
    out = tmp_path / "f.npy"
    r = _encode_cli(["tiny-te", "--prompt-file", pf, "--out", out], models_root)
    assert r.returncode == 2 and "more than the 1,000,000 the tokenizer takes" in r.stderr, \
        r.stderr[-2000:]
    assert "Traceback" not in r.stderr and not out.exists()
