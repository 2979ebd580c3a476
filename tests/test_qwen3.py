"""The Qwen3 text encoder on nxhpc's engine (nxhpc.qwen3): features = hidden_states[-2].

Models: small random Qwen3s written as llama.cpp-layout GGUFs (``nxhpc.models.qwen3_files``,
the one GGUF writer; arch ``qwen3``, ``qwen3.*`` metadata in llama.cpp's value types, a
tokenizer's tiny vocab) with EVERY parameter randomized (norm weights
``1 + 0.3 N(0, 1)``, so no norm is the identity): SMALL (D=64, 4 query heads / 2 kv heads of
16, FFN 96, 3 blocks of which 2 run, vocab 300) for the model-level checks, K256 (D=256, 4/2
heads of 128 -- H*hd = 512 != D, as in Qwen3-4B --, FFN 512) where every weight type (K-quants
need rows of 256) is written.

Oracles, on the weights read back and dequantized by the ``gguf`` package:
- transformers' ``Qwen3Model`` in float64 (eager attention), every parameter loaded strictly
  (``nxhpc.qwen3.oracle``): ``hidden_states[-2]``;
- ``nxhpc.qwen3.reference`` (plain float64 numpy, shares no code with the engine). The two
  agree to ~1.5e-7 x max|ref|: transformers builds its RoPE cos/sin tables in float32 even for
  a float64 model (checked: the reference with float32-rounded tables agrees to 1e-12).

Tolerances (docs/text_encoder.md): f32 within 1e-5 x max|ref| against both oracles, for
every weight type (measured ~3e-7: every decoded weight is exact in float32, the error is
float32 arithmetic over two blocks); bf16 and q8 bounds measured and written down in
:data:`LOWP_BOUND`. Negative controls -- no q/k norm, interleaved RoPE pairs, no causal mask,
the final norm applied, one block too many -- are the reference with one fact changed and
must miss the f32 bound by x100 at least.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import nxhpc.qwen3.model as QM
from nxhpc.formats.gguf_io import (GGUFFile, MissingTensorError, ModelFileError, QuantTensor,
                                   write_gguf)
from nxhpc.models.qwen3_files import (qwen3_metadata, random_qwen3_weights, read_qwen3_gguf,
                                      tiny_tokenizer, write_qwen3_gguf)
from nxhpc.qwen3.config import Qwen3Config, infer_config, layer_names
from nxhpc.qwen3.model import (TIMING_KEYS, TextEncoderInputError, TextEncoderModel,
                               rope_table, stage_table)
from nxhpc.qwen3.reference import encode_f64, rope_half_f64
from nxhpc.runtime.shm import live_segments
from kernelutil import assert_bitwise
from procutil import children_of, record_dispatches

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from nxhpc.qwen3.oracle import hidden_states_m2, transformers_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_threads")

PID = os.getpid()
SMALL = Qwen3Config(vocab=300, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16,
                    ffn=96, eps=1e-6, rope_theta=1e6, context_length=96)
K256 = Qwen3Config(vocab=260, dim=256, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=128,
                   ffn=512, eps=1e-6, rope_theta=1e6, context_length=64)
#: every weight type the kernels run, each written for every matrix (token_embd included)
TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K",
         "Q5_K", "Q6_K")
F32_BOUND = 1e-5
IDS = [275, 5, 17, 17, 250, 3, 0, 299, 120, 64, 7, 276, 33]     # 13 tokens, chat ids included


def _ids(cfg: Qwen3Config, n: int = 13, seed: int = 0) -> list[int]:
    return [int(i) for i in np.random.default_rng(seed).integers(0, cfg.vocab, n)]


def _file_cfg(cfg: Qwen3Config) -> Qwen3Config:
    """The config as a file stores it: eps and RoPE base rounded to float32."""
    from dataclasses import replace
    return replace(cfg, eps=float(np.float32(cfg.eps)),
                   rope_theta=float(np.float32(cfg.rope_theta)))


def _no_leak(kids: set[int]) -> None:
    assert live_segments(PID) == []
    assert set(children_of(PID)) <= kids


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """SMALL as Q8_0 (1-D F32): path, float64 weights read back, transformers' features."""
    p = write_qwen3_gguf(tmp_path_factory.mktemp("q3") / "small.gguf", SMALL, seed=1,
                         matrix_type="Q8_0", tokenizer=tiny_tokenizer(SMALL.vocab))
    w = read_qwen3_gguf(p).weights
    hf = hidden_states_m2(transformers_model(_file_cfg(SMALL), w), IDS)
    return p, w, hf


@pytest.fixture(scope="module")
def small_out(small):
    """Our f32 features of IDS at 2 workers (one engine, reused by the tests that grade it)."""
    with TextEncoderModel(small[0], workers=2) as m:
        return m.encode_ids(IDS)


def _rel(a, ref) -> float:
    return float(np.abs(np.asarray(a, np.float64) - ref).max() / np.abs(ref).max())


# ------------------------------------------------------------------------------ file & config
def test_config_from_metadata_and_shapes(small):
    p, w, _ = small
    with TextEncoderModel(p, workers=1) as m:
        assert m.config == _file_cfg(SMALL)
        assert m.config.layers_needed == 2 and m.config.qkv_width == (4 + 2 * 2) * 16
        # zero copy: every matrix is a read-only view of the file's map
        mapping = m.gguf.mapping
        mats = [m.weights.token_embd] + [v for lw in m.weights.layers.values()
                                         for v in lw.matrices().values()]
        assert len(mats) == 1 + 2 * 7
        assert all(np.shares_memory(t.data, mapping) and not t.data.flags.writeable
                   for t in mats)
        assert sorted(m.weights.layers) == [0, 1]          # block 2 (the last) is never bound
        assert m.metadata["tokenizer.ggml.pre"] == "qwen2"


def test_tensor_names_are_llama_cpps():
    """The writer, the engine and the transformers oracle share one table (LAYER_TENSORS,
    HF_NAMES); a swap in it (w_gate/w_up, q_norm/k_norm) would pass every other test. So each
    pair is pinned to the gguf package's own HF -> llama.cpp name map for Qwen3."""
    import gguf
    from nxhpc.qwen3.config import GLOBAL_TENSORS
    from nxhpc.qwen3.oracle import HF_NAMES
    n = 3
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, n)

    def gguf_name(hf: str) -> str | None:        # "x.weight" -> "blk.N.y.weight"
        return tmap.get_name(hf, try_suffixes=(".weight",))

    for i in range(n):
        names = layer_names(i)
        assert sorted(names) == sorted(HF_NAMES)
        for key, name in names.items():
            assert gguf_name(f"model.layers.{i}.{HF_NAMES[key]}.weight") == name, key
    # the globals the oracle loads as embed_tokens / norm
    assert gguf_name("model.embed_tokens.weight") == "token_embd.weight"
    assert gguf_name("model.norm.weight") == "output_norm.weight"
    assert set(GLOBAL_TENSORS) == {"token_embd.weight", "output_norm.weight"}
    # negative control: the map tells gate from up
    assert gguf_name("model.layers.0.mlp.up_proj.weight") != layer_names(0)["w_gate"]


def test_metadata_written_in_llama_cpp_types(small):
    import gguf
    r = gguf.GGUFReader(os.fspath(small[0]))
    vt = {k: f.types for k, f in r.fields.items()}
    U32, F32, STR, ARR, I32 = (gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32,
                               gguf.GGUFValueType.STRING, gguf.GGUFValueType.ARRAY,
                               gguf.GGUFValueType.INT32)
    assert vt["qwen3.block_count"] == [U32] and vt["qwen3.attention.key_length"] == [U32]
    assert vt["qwen3.rope.freq_base"] == [F32]
    assert vt["qwen3.attention.layer_norm_rms_epsilon"] == [F32]
    assert vt["tokenizer.ggml.tokens"] == [ARR, STR]
    assert vt["tokenizer.ggml.token_type"] == [ARR, I32]
    f = read_qwen3_gguf(small[0], names=())
    assert f.metadata["general.architecture"] == "qwen3"
    toks = f.metadata["tokenizer.ggml.tokens"]
    assert len(toks) == SMALL.vocab and toks[274:277] == ["<|endoftext|>", "<|im_start|>",
                                                          "<|im_end|>"]


# ------------------------------------------------------------------------------ the oracles
def test_reference_matches_transformers(small):
    """The two oracles agree to 1e-6 x max|ref| (measured 1.5e-7: transformers' RoPE cos/sin
    are computed in float32 even in a float64 model; the rest agrees to rounding)."""
    _, w, hf = small
    ref = encode_f64(IDS, w, _file_cfg(SMALL))
    assert _rel(ref, hf) <= 1e-6, _rel(ref, hf)
    assert _rel(w["token_embd.weight"][IDS], hf) > 0.1        # the blocks did something


def test_f32_features_vs_both_oracles(small, small_out):
    _, w, hf = small
    ref = encode_f64(IDS, w, _file_cfg(SMALL))
    assert small_out.dtype == np.float32 and small_out.shape == (len(IDS), SMALL.dim)
    assert _rel(small_out, hf) <= F32_BOUND, _rel(small_out, hf)
    assert _rel(small_out, ref) <= F32_BOUND, _rel(small_out, ref)


@pytest.mark.parametrize("control", ["no_qk_norm", "interleaved_rope", "no_causal_mask",
                                     "final_norm", "one_block_more", "one_block_less"])
def test_negative_controls_fail_the_bound(small, small_out, control):
    """The reference with one fact changed must miss our features by 100x the f32 bound."""
    _, w, _ = small
    cfg = _file_cfg(SMALL)
    kw = {"no_qk_norm": {"qk_norm": False}, "interleaved_rope": {"rope": "interleaved"},
          "no_causal_mask": {"causal": False}, "final_norm": {"final_norm": True},
          "one_block_more": {"n_blocks": 3}, "one_block_less": {"n_blocks": 1}}[control]
    wrong = encode_f64(IDS, w, cfg, **kw)
    assert _rel(small_out, wrong) > 100 * F32_BOUND, (control, _rel(small_out, wrong))


@pytest.mark.parametrize("wtype", TYPES + ("mixed",))
def test_f32_every_weight_type_vs_transformers(tmp_path, wtype):
    """Every matrix -- the embedding too -- in ``wtype`` (``mixed``: a Q4_K_M-like file,
    embedding and attn_v Q6_K, ffn_down Q5_K, the rest Q4_K, norms F16/BF16/F32)."""
    types = None
    if wtype == "mixed":
        types = {"token_embd.weight": "Q6_K", "output_norm.weight": "BF16"}
        for i in range(K256.n_layers):
            n = layer_names(i)
            types.update({n["wv"]: "Q6_K", n["w_down"]: "Q5_K", n["attn_norm"]: "F16",
                          n["q_norm"]: "BF16"})
    p = write_qwen3_gguf(tmp_path / f"{wtype}.gguf", K256, seed=3,
                         matrix_type="Q4_K" if wtype == "mixed" else wtype, types=types)
    f = read_qwen3_gguf(p)
    want = wtype if wtype != "mixed" else "Q4_K"
    assert f.types["blk.0.attn_q.weight"] == want
    if wtype == "mixed":
        assert f.types["token_embd.weight"] == "Q6_K" and f.types["blk.1.attn_norm.weight"] == "F16"
    cfg = _file_cfg(K256)
    ids = _ids(K256, 11, seed=4)
    hf = hidden_states_m2(transformers_model(cfg, f.weights), ids)
    with TextEncoderModel(p, workers=2) as m:
        out = m.encode_ids(ids)
    assert _rel(out, hf) <= F32_BOUND, (wtype, _rel(out, hf))
    assert _rel(out, encode_f64(ids, f.weights, cfg)) <= F32_BOUND
    assert live_segments(PID) == []


def test_prompt_to_features_from_one_file(small):
    """The tokenizer and the model from the same file compose: the templated prompt's ids
    (``Qwen3Tokenizer.tokenize``) -> features equal to transformers' on those ids."""
    from nxhpc.qwen3.tokenizer import Qwen3Tokenizer
    p, w, _ = small
    ids = Qwen3Tokenizer.from_gguf(p).tokenize("a red fox, 12 ways")
    assert ids[0] == 275 and 276 in ids and len(ids) > 8       # <|im_start|> ... <|im_end|>
    hf = hidden_states_m2(transformers_model(_file_cfg(SMALL), w), ids)
    with TextEncoderModel(p, workers=2) as m:
        assert _rel(m.encode_ids(ids), hf) <= F32_BOUND


#: measured max |out - ref| / max|ref| (SMALL, Q8_0 weights, 13 tokens) and the bound set:
#: bf16 rounds x and w to 8 bits (2^-9 relative each) before float32 sums, q8 quantizes x per
#: 32-block to int8 (0.4% of the block max); errors compound over 2 blocks' 7 matmuls.
LOWP_BOUND = {"bf16": 1.5e-2, "q8": 3e-2}


@pytest.mark.parametrize("precision", ["bf16", "q8"])
def test_low_precision_errors_bounded(small, small_out, precision):
    _, w, _ = small
    ref = encode_f64(IDS, w, _file_cfg(SMALL))
    with TextEncoderModel(small[0], workers=2, precision=precision) as m:
        out = m.encode_ids(IDS)
        m.precision = "f32"                                # switchable between calls
        assert_bitwise(m.encode_ids(IDS), small_out, "f32 after a low-precision call")
    err = _rel(out, ref)
    assert err <= LOWP_BOUND[precision], (precision, err)
    assert err > F32_BOUND, (precision, err)             # the switch really changed the matmuls


# ------------------------------------------------------------------------------ the engine
@pytest.mark.parametrize("precision", ["f32", "bf16"])
def test_bit_identical_for_any_worker_count(small, small_out, precision, monkeypatch):
    """The same features for every worker count and spawn mode, with the row groups (the
    attention's residual and the FFN's norm sent as one command, ``nxhpc.nn.engine.ROW_GROUPS``)
    or every stage alone."""
    from nxhpc.nn import engine as eng_mod
    sent = record_dispatches(monkeypatch)
    outs = {}
    for workers, spawn, groups in ((1, "pool", True), (2, "pool", True), (3, "pool", True),
                                   (2, "stage", True), (2, "pool", False)):
        monkeypatch.setattr(eng_mod, "ROW_GROUPS", groups)
        sent.clear()
        with TextEncoderModel(small[0], workers=workers, spawn=spawn,
                              precision=precision) as m:
            outs[(workers, spawn, groups)] = m.encode_ids(IDS)
        layers = [s for s in sent if s.startswith("norm1")]
        assert len(layers) == 2                   # SMALL runs two of its three blocks
        assert ("attn_res+ffn_norm" in sent) == groups and ("ffn_norm" in sent) != groups
    base = outs[(1, "pool", True)]
    for k, o in outs.items():
        assert_bitwise(o, base, f"{precision} workers={k}")
    if precision == "f32":
        assert_bitwise(base, small_out, "f32 1 worker vs the module's 2-worker run")


def test_one_session_serves_every_length_and_prefixes_are_exact(small, small_out):
    """Calls of different lengths reuse one arena and one pool; causal attention makes the
    features of a prefix the first rows of the whole, bit for bit (every kernel is
    batch-invariant). A call beyond max_tokens gets a larger session."""
    with TextEncoderModel(small[0], workers=2, max_tokens=16) as m:
        full = m.encode_ids(IDS)
        s = m._session
        pids = list(s.engine.pool.pids)
        for n in (1, 5, 12):
            assert_bitwise(m.encode_ids(IDS[:n]), full[:n], f"prefix {n}")
        assert m._session is s and s.engine.pool.pids == pids and s.capacity == 16
        assert set(m.last_timings) == {"us_embed", "us_layers", "us_total"}
        long_ids = (IDS * 3)[:30]
        out = m.encode_ids(long_ids)
        assert m._session is not s and m._session.capacity == 30 and s.engine.closed
        assert_bitwise(out[:len(IDS)], full, "prefix of a call in a larger session")
    assert_bitwise(full, small_out, "max_tokens=16 session vs the default")
    assert live_segments(PID) == []


def test_stage_table_and_timing_keys():
    for line in stage_table().splitlines():
        assert "    " + line in QM.__doc__, line
    assert TIMING_KEYS == ("us_attn", "us_ffn", "block_us")
    assert [s.name for s in QM.STAGES] == ["norm1", "qkv", "qknorm_rope", "sdpa", "out_proj",
                                           "attn_res", "ffn_norm", "w13", "w2",
                                           "ffn_res"]


def test_rope_table_is_rotate_half_of_the_reference():
    rng = np.random.default_rng(5)
    T, hd, theta = 9, 16, 1e6
    pe = rope_table(T, hd, theta).astype(np.float64)
    y = rng.standard_normal((T, hd))
    a, b = y[:, :hd // 2], y[:, hd // 2:]
    ours = np.concatenate([pe[..., 0, 0] * a + pe[..., 0, 1] * b,
                           pe[..., 1, 0] * a + pe[..., 1, 1] * b], -1)
    assert np.abs(ours - rope_half_f64(y[None], theta)[0]).max() < 1e-7
    assert np.array_equal(pe[0], np.tile(np.eye(2), (hd // 2, 1, 1)))   # position 0: identity


# ------------------------------------------------------------------------------ bad input
def test_bad_ids_refused_before_any_work(small):
    kids = set(children_of(PID))
    with TextEncoderModel(small[0], workers=2) as m:
        cases = {"empty": ([], "empty"), "out of vocab": ([1, 300], r"ids\[1\] = 300"),
                 "negative": ([-1], "outside the vocab"), "float": ([1.0, 2.0], "not an integer"),
                 "bool": ([True], "not an integer"), "str": ("hello", "sequence of token ids"),
                 "2-D": (np.zeros((2, 2), np.int64), "1-D"),
                 "float array": (np.zeros(3), "1-D array of integers"),
                 "too long": ([1] * (SMALL.context_length + 1), "context length 96"),
                 "huge": ([2**70], "outside the vocab")}
        for what, (ids, msg) in cases.items():
            with pytest.raises(TextEncoderInputError, match=msg):
                m.encode_ids(ids)
            assert m._session is None, what                # nothing was built or run
        assert isinstance(TextEncoderInputError("x"), ValueError)
        np.testing.assert_array_equal(m.encode_ids(np.array(IDS, np.uint16)),
                                      m.encode_ids(tuple(IDS)))
    _no_leak(kids)


def _bad_file(tmp_path, name, **kw):
    return write_qwen3_gguf(tmp_path / f"{name}.gguf", SMALL, seed=1, **kw)


def test_bad_files_are_one_line_errors_without_leaks(tmp_path):
    kids = set(children_of(PID))
    w = random_qwen3_weights(SMALL, 1)
    bad_shape = dict(w, **{"blk.1.attn_k.weight": np.zeros((48, 64), np.float32)})
    cases = {
        "wrong arch": (dict(metadata={"general.architecture": "llama"}),
                       ModelFileError, "general.architecture is 'llama', not 'qwen3'"),
        "missing tensor": (dict(overrides={"blk.1.ffn_up.weight": None}),
                           MissingTensorError, "'blk.1.ffn_up.weight' is missing"),
        "missing last block": (dict(overrides={"blk.2.ffn_up.weight": None}),
                               MissingTensorError, "'blk.2.ffn_up.weight' is missing"),
        "missing output_norm": (dict(overrides={"output_norm.weight": None}),
                                MissingTensorError, "'output_norm.weight' is missing"),
        "shape disagrees": (dict(weights=bad_shape), ModelFileError,
                            r"'blk.1.attn_k.weight' has shape \[48, 64\].*imply \[32, 64\]"),
        "block count disagrees": (dict(metadata={"qwen3.block_count": np.uint32(2)}),
                                  ModelFileError, "'blk.2.*' lies beyond qwen3.block_count"),
        "heads disagree": (dict(metadata={"qwen3.attention.head_count": np.uint32(2)}),
                           ModelFileError, "'blk.0.attn_q.weight' has shape"),
        "key not a number": (dict(metadata={"qwen3.rope.freq_base": "1e6"}), ModelFileError,
                             "qwen3.rope.freq_base = '1e6' is not a positive number"),
        "NaN weight": (dict(overrides={"blk.0.ffn_gate.weight": QuantTensor(
            np.full((96, 64), np.nan, np.float32).view(np.uint8), "F32")}),
            ModelFileError, "'blk.0.ffn_gate.weight': 6144 F32 values are NaN/Inf"),
    }
    for what, (kw, err, msg) in cases.items():
        p = _bad_file(tmp_path, what.replace(" ", "_"), **kw)
        with pytest.raises(err, match=msg) as e:
            TextEncoderModel(p, workers=2)
        assert "\n" not in str(e.value), what
        assert str(p) in str(e.value), what
        _no_leak(kids)
    # a file without a metadata key at all
    meta = qwen3_metadata(SMALL)
    del meta["qwen3.context_length"]
    p = write_gguf(tmp_path / "nokey.gguf", w, prefix="", arch="qwen3", metadata=meta,
                   quantize=False)
    with pytest.raises(ModelFileError, match="'qwen3.context_length' is missing"):
        TextEncoderModel(p, workers=2)
    # an extra tensor whose "index" is a digit to str.isdigit() that int() refuses ('²': it was
    # a ValueError, exit 70) is an unknown tensor like any other, not an index; a real index
    # past the blocks is still refused (the "block count disagrees" case above)
    p = _bad_file(tmp_path, "superscript",
                  weights=dict(w, **{"blk.\u00b2.attn_norm.weight": np.ones(64, np.float32)}))
    TextEncoderModel(p, workers=1).close()
    _no_leak(kids)
    # an IQ type (rows of 256 values: the K256 dims), refused naming tensor and type
    iq = QuantTensor(np.zeros((K256.q_width, K256.dim // 256 * 136), np.uint8), "IQ4_XS")
    p = write_qwen3_gguf(tmp_path / "iq.gguf", K256, overrides={"blk.0.attn_q.weight": iq})
    with pytest.raises(ModelFileError, match="'blk.0.attn_q.weight' has type IQ4_XS, which "
                                             "nxhpc does not run"):
        TextEncoderModel(p, workers=2)
    # truncated: cut inside the tensor data
    raw = _bad_file(tmp_path, "good").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(raw[:len(raw) - 1000])
    with pytest.raises(ModelFileError, match="truncated"):
        TextEncoderModel(cut, workers=2)
    _no_leak(kids)


@settings(max_examples=150)
@given(st.data())
def test_fuzzed_header_is_an_error_or_a_working_model(small, data):
    """1-4 bytes of the header (metadata, tensor infos) replaced at random: opening either
    raises a ModelFileError (one line, naming the file) or gives a model that encodes (or
    refuses the ids as input). Nothing else escapes; nothing is left mapped or forked."""
    src = small[0].read_bytes()
    with GGUFFile(small[0]) as g:
        header_end = g.data_start
    buf = bytearray(src)
    for _ in range(data.draw(st.integers(1, 4), label="n_bytes")):
        buf[data.draw(st.integers(0, header_end - 1), label="pos")] = data.draw(
            st.integers(0, 255), label="value")
    path = small[0].with_name("fuzz.gguf")
    path.write_bytes(bytes(buf))
    try:
        m = TextEncoderModel(path, workers=1)
    except ModelFileError as e:
        assert "\n" not in str(e) and str(path) in str(e), str(e)
        return
    with m:
        try:
            out = m.encode_ids(IDS[:3])
        except TextEncoderInputError:
            return
        assert out.shape == (3, m.config.dim)
    assert live_segments(PID) == []


def test_hostile_hyper_parameters_are_file_errors(tmp_path):
    """Every qwen3.* number set to an extreme (0, 1, 2^32-1 for counts; 0, -1, NaN, inf, a
    subnormal, 1 for the floats): a one-line ModelFileError at once (a huge block_count fails
    at the first absent block), or -- for values that still describe these tensors -- a model
    that runs. Negative control: some extremes are accepted (a context of 2^32-1)."""
    from nxhpc.qwen3.config import METADATA_KEYS
    kids = set(children_of(PID))
    w = random_qwen3_weights(SMALL, 1)
    ok = []
    for field, key in METADATA_KEYS.items():
        floats = field in ("eps", "rope_theta")
        values = [np.float32(v) for v in (0.0, -1.0, np.nan, np.inf, 1e-45, 1.0)] if floats \
            else [np.uint32(v) for v in (0, 1, 2**32 - 1)]
        for v in values:
            p = write_qwen3_gguf(tmp_path / "h.gguf", SMALL, w, metadata={f"qwen3.{key}": v})
            try:
                with TextEncoderModel(p, workers=1) as m:
                    n = min(4, m.config.context_length)
                    assert np.isfinite(m.encode_ids(IDS[:n])).all(), (key, v)
                ok.append((field, float(v)))
            except ModelFileError as e:
                msg = str(e)                        # names the key, or the tensor it breaks
                assert "\n" not in msg and (key in msg or "tensor '" in msg), (key, v, msg)
    assert ("context_length", 2.0**32 - 1) in ok and ("rope_theta", 1.0) in ok
    assert len(ok) < 10
    _no_leak(kids)


def test_infer_config_checks_without_a_file():
    meta = {"general.architecture": "qwen3", **{k: v.item() if hasattr(v, "item") else v
                                                for k, v in qwen3_metadata(SMALL).items()}}
    table = {n: (a.shape, "F32") for n, a in random_qwen3_weights(SMALL, 0).items()}
    assert infer_config(meta, table, "t") == _file_cfg(SMALL)
    m2 = dict(meta)
    del m2["qwen3.attention.key_length"], m2["qwen3.attention.value_length"]
    assert infer_config(m2, table, "t").head_dim == 16          # from attn_q_norm
    with pytest.raises(ModelFileError, match="key_length = 16 and value_length = 8 disagree"):
        infer_config(dict(meta, **{"qwen3.attention.value_length": 8}), table, "t")
    with pytest.raises(ModelFileError, match="vocab_size = 301 but 'token_embd.weight' has 300"):
        infer_config(dict(meta, **{"qwen3.vocab_size": 301}), table, "t")
    with pytest.raises(ModelFileError, match="head_count = 4 is not a multiple of "
                                             "qwen3.attention.head_count_kv = 3"):
        infer_config(dict(meta, **{"qwen3.attention.head_count_kv": 3}), table, "t")
    with pytest.raises(ModelFileError, match="general.architecture is missing"):
        infer_config({k: v for k, v in meta.items() if k != "general.architecture"}, table, "t")


def test_rope_scaling_and_partial_rotary_are_refused():
    """A file converted with RoPE context extension (the 128K Qwen3 GGUFs: ``rope.scaling.type
    = yarn`` and a factor; llama.cpp applies a factor even without a type) or a rotary width
    other than head_dim is refused by key (a YaRN file ran as plain RoPE, exit 0, 41% off
    transformers with YaRN: the QA helper's measurement). Controls: a factor of 1 or 0 and a
    dimension_count equal to head_dim change nothing and are accepted."""
    meta = {"general.architecture": "qwen3", **{k: v.item() if hasattr(v, "item") else v
                                                for k, v in qwen3_metadata(SMALL).items()}}
    table = {n: (a.shape, "F32") for n, a in random_qwen3_weights(SMALL, 0).items()}
    r = "qwen3.rope."
    for extra, words in [({r + "scaling.type": "yarn", r + "scaling.factor": 4.0,
                           r + "scaling.original_context_length": 32768},
                          r"scaling.factor = 4.0 \(qwen3.rope.scaling.type 'yarn'\)"),
                         ({r + "scaling.factor": 2.0}, "scaling.factor = 2.0 .*'linear'"),
                         ({r + "scale_linear": 2.0}, "scale_linear = 2.0"),
                         ({r + "dimension_count": 8}, "dimension_count = 8 but head_dim is 16")]:
        with pytest.raises(ModelFileError, match=words):
            infer_config(dict(meta, **extra), table, "t")
    for extra in ({r + "scaling.type": "yarn", r + "scaling.factor": 1.0},
                  {r + "scaling.type": "none", r + "scaling.factor": 0.0},
                  {r + "dimension_count": 16}):
        assert infer_config(dict(meta, **extra), table, "t") == _file_cfg(SMALL)


# ------------------------------------------------------------------------------ lifetime
def test_close_and_interrupt_release_everything(small, small_out, monkeypatch):
    kids = set(children_of(PID))
    m = TextEncoderModel(small[0], workers=2)
    m.encode_ids(IDS[:3])
    assert len(set(children_of(PID)) - kids) == 2               # negative control: seen live
    calls = []
    real = QM.Engine.run_plan

    def interrupted(self, *a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(self, *a, **k)
    monkeypatch.setattr(QM.Engine, "run_plan", interrupted)
    with pytest.raises(KeyboardInterrupt):
        m.encode_ids(IDS)
    monkeypatch.setattr(QM.Engine, "run_plan", real)
    assert_bitwise(m.encode_ids(IDS), small_out, "after an interrupted call")
    m.close()
    m.close()                                                   # idempotent
    assert m.closed
    with pytest.raises(RuntimeError, match="closed"):
        m.encode_ids(IDS)
    _no_leak(kids)


# ------------------------------------------------------------------------------ import rules
def _imports(path) -> set[str]:
    """Every module a file imports (``from a.b import c`` gives ``a.b`` and ``a.b.c``)."""
    import ast
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def test_import_rules_of_the_shared_engine_and_the_family():
    """docs/architecture.md: nn imports no family; dit and qwen3 import nothing of each other
    nor the registry; the qwen3 oracles and the file tooling import no engine code."""
    from pathlib import Path
    pkg = Path(QM.__file__).resolve().parents[1]

    def hits(files, banned):
        return {(f.name, m) for f in files for m in _imports(f)
                if any(m == b or m.startswith(b + ".") for b in banned)}
    nn, qwen3, dit = (sorted((pkg / d).glob("*.py")) for d in ("nn", "qwen3", "dit"))
    assert hits(nn, ["nxhpc.dit", "nxhpc.qwen3", "nxhpc.models"]) == set()
    assert hits(qwen3, ["nxhpc.dit", "nxhpc.models"]) == set()
    assert hits(dit, ["nxhpc.qwen3"]) == set()
    engine = ["nxhpc._kernels", "nxhpc.nn", "nxhpc.runtime", "nxhpc.qwen3.model"]
    oracles = [pkg / "qwen3" / "reference.py", pkg / "qwen3" / "oracle.py",
               pkg / "models" / "qwen3_files.py"]
    assert hits(oracles, engine) == set()
    assert "kernels()" not in "".join(f.read_text() for f in oracles)
    # negative control: the scan sees the imports that do exist
    assert ("model.py", "nxhpc.nn.engine") in hits(qwen3, ["nxhpc.nn"])
    assert ("plan.py", "nxhpc.nn.engine") in hits(dit, ["nxhpc.nn"])
