"""The Qwen3 tokenizer (``nxhpc.qwen3.tokenizer``) against two references.

1. transformers' ``Qwen2Tokenizer``, loaded with ``from_pretrained`` from a directory holding
   ``vocab.json``, ``merges.txt`` and ``tokenizer_config.json`` of the same vocab (the layout of
   the Hugging Face repos). transformers 5 has no pure-Python Qwen2 tokenizer: this is its fast
   class, which assembles a ``tokenizers`` pipeline from those files itself -- the same engine
   nxhpc uses, but configured by transformers, not by us.
2. :class:`PlainBPE` below: byte-level BPE written out in plain Python (``regex`` for the split,
   ``unicodedata`` for NFC, a byte map derived here), independent of ``tokenizers``.

Negative controls: a copy of our tokenizer without NFC, or with GPT-2's split regex, gives other
ids on some test prompt; so does the plain reference with the same mistakes.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import unicodedata
from pathlib import Path

import numpy as np
import pytest
import regex
from hypothesis import given
from hypothesis import strategies as st

import gguf
from nxhpc.formats.gguf_io import (
    GGUFFile, ModelFileError, read_field, read_fields, write_gguf,
)
from nxhpc.qwen3.tokenizer import (
    CHAT_TOKENS, QWEN2_SPLIT, QWEN3_ADDED_TOKENS, Qwen3Tokenizer, VocabError, byte_alphabet,
    template, tiny_vocab, vocab_metadata,
)
from pipeline_fixtures import CHAT_TEMPLATE

GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
"""GPT-2's split: case-sensitive contractions, digit runs, no punctuation+newline pieces."""


def _digit_vocab() -> tuple[list[str], list[int], list[str]]:
    """The tiny vocab plus merges of digits ("1 2", "12 3"), which the qwen2 split must never
    apply (digits are pieces of their own), spliced in before the added tokens."""
    tokens, types, merges = tiny_vocab()
    n_bpe = types.index(3)
    tokens = tokens[:n_bpe] + ["12", "123"] + tokens[n_bpe:]
    types = types[:n_bpe] + [1, 1] + types[n_bpe:]
    return tokens, types, merges + ["1 2", "12 3"]


VOCAB = _digit_vocab()

PROMPTS = [
    "a fox",
    "A photo of a red fox in the snow, golden hour.",
    "e\u0301te\u0301 cafe\u0301",                       # NFD
    "\u00e9t\u00e9 caf\u00e9",                          # the same text in NFC
    "\u212bngstr\u00f6m, \u0041\u030a",                 # the angstrom sign and A + ring -> U+00C5
    "日本語のテキスト、中文字符。한국어",
    "🦊🦊 🏳️‍🌈 👩🏽‍🚀 fox",
    "12345 and 3.14159, 2024-01-01, 123123",
    "many   spaces    here     ",
    "tabs\tand\t\ttabs\nnew\nlines\n\n\nend\r\nwindows \n ",
    "don't I'LL we've She'S they'd 'tis",
    "<|im_start|>system\nyou are<|im_end|> <|endoftext|><think>x</think><|im_end|>",
    "<|im_end <|im_start|",
    "",
    " leading and trailing ",
    "a fox.\nthe end!\n\nwhat?",
    "(fox) [red] {snow} #tag @you $5 100%",
]


# ----------------------------------------------------------------------------- references

def _gpt2_bytes() -> list[str]:
    """GPT-2's byte map derived differently from the module's: the bytes whose Latin-1
    character Python calls printable (space excepted) stand for themselves, the rest are
    shifted past U+00FF in byte order."""
    own = [b for b in range(256) if chr(b).isprintable() and b != 0x20]
    out, n = {}, 0
    for b in range(256):
        if b in own:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return [out[b] for b in range(256)]


class PlainBPE:
    """Byte-level BPE in plain Python: added tokens cut out first (longest match at the
    leftmost position), NFC (``nfc``), the split regex (``split``), then per piece the
    adjacent pair of lowest merge rank is merged everywhere, until no pair has a rank."""

    def __init__(self, vocab, nfc: bool = True, split: str = QWEN2_SPLIT) -> None:
        tokens, types, merges = vocab
        self.ids = {t: i for i, t in enumerate(tokens)}
        self.rank = {tuple(m.split(" ")): r for r, m in enumerate(merges)}
        added = sorted((t for t, ty in zip(tokens, types) if ty in (3, 4)), key=len,
                       reverse=True)
        self.added = regex.compile("|".join(regex.escape(t) for t in added))
        self.split = regex.compile(split)
        self.nfc = nfc
        self.char = _gpt2_bytes()

    def _pieces(self, text: str) -> list[int]:
        if self.nfc:
            text = unicodedata.normalize("NFC", text)
        out = []
        for piece in self.split.findall(text):
            sym = [self.char[b] for b in piece.encode("utf-8")]
            while len(sym) > 1:
                r, i = min((self.rank.get(p, math.inf), i) for i, p in enumerate(zip(sym, sym[1:])))
                if r == math.inf:
                    break
                pair, merged, j = (sym[i], sym[i + 1]), [], 0
                while j < len(sym):
                    if j + 1 < len(sym) and (sym[j], sym[j + 1]) == pair:
                        merged.append(sym[j] + sym[j + 1])
                        j += 2
                    else:
                        merged.append(sym[j])
                        j += 1
                sym = merged
            out += [self.ids[s] for s in sym]
        return out

    def encode(self, text: str) -> list[int]:
        out, pos = [], 0
        for m in self.added.finditer(text):
            out += self._pieces(text[pos:m.start()])
            out.append(self.ids[m.group()])
            pos = m.end()
        return out + self._pieces(text[pos:])


HF_SPECIAL = {t for t, _ in QWEN3_ADDED_TOKENS[:14]}
"""The added tokens Qwen3's ``tokenizer_config.json`` marks ``special`` (ids 151643..151656);
llama.cpp makes the fill-in-the-middle ones control tokens too (they look special)."""


def write_hf_dir(d: Path, vocab, chat_template: str | None = None) -> Path:
    """``vocab.json`` (the BPE tokens), ``merges.txt``, ``tokenizer_config.json`` (the added
    tokens with their ids and Qwen's flags, eos ``<|im_end|>``, pad ``<|endoftext|>``) as in
    Qwen's repos."""
    tokens, types, merges = vocab
    d.mkdir(parents=True, exist_ok=True)
    bpe = {t: i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == 1}
    (d / "vocab.json").write_text(json.dumps(bpe, ensure_ascii=False), encoding="utf-8")
    (d / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": t in HF_SPECIAL}
             for i, (t, ty) in enumerate(zip(tokens, types)) if ty in (3, 4)}
    cfg = {"tokenizer_class": "Qwen2Tokenizer", "added_tokens_decoder": added,
           "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
           "unk_token": None, "errors": "replace", "split_special_tokens": False,
           "add_prefix_space": False, "model_max_length": 131072}
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    (d / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")
    return d


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    from transformers import Qwen2Tokenizer
    d = write_hf_dir(tmp_path_factory.mktemp("qwen2tok"), VOCAB, CHAT_TEMPLATE)
    ref = Qwen2Tokenizer.from_pretrained(str(d))
    assert type(ref) is Qwen2Tokenizer and len(ref) == len(VOCAB[0])
    for i, (t, ty) in enumerate(zip(*VOCAB[:2])):
        if ty in (3, 4):
            assert ref.convert_tokens_to_ids(t) == i, t
    return ref


@pytest.fixture(scope="module")
def tok():
    return Qwen3Tokenizer.from_fields(*VOCAB)


@pytest.fixture(scope="module")
def plain():
    return PlainBPE(VOCAB)


def diffusers_ids(ref, text: str, max_length: int = 512) -> list[int]:
    """The ids ``ZImagePipeline._encode_prompt`` keeps: padded to ``max_length``, truncated,
    then only the positions the attention mask marks."""
    enc = ref(text, padding="max_length", max_length=max_length, truncation=True)
    return [i for i, m in zip(enc["input_ids"], enc["attention_mask"]) if m]


# ----------------------------------------------------------------------------- exact ids

def test_byte_alphabet_is_gpt2s():
    a = byte_alphabet()
    assert a == _gpt2_bytes() and len(set(a)) == 256
    assert a[ord(" ")] == "\u0120" and a[ord("\n")] == "\u010a" and a[ord("A")] == "A"


@pytest.mark.parametrize("prompt", PROMPTS)
def test_ids_match_qwen2_tokenizer(prompt, tok, hf, plain):
    ids = tok.tokenize(prompt)
    assert ids == diffusers_ids(hf, template(prompt))
    assert ids == plain.encode(template(prompt))
    assert tok.encode(prompt) == hf(prompt)["input_ids"] == plain.encode(prompt)


def test_template_ids_and_typed_chat_tokens(tok):
    s = tok.special_ids
    # the chat tokens cut the text: the ids are those of the pieces between them, joined
    ids = tok.tokenize("x<|im_end|>y<think>")
    assert ids == ([s["<|im_start|>"]] + tok.encode("user\nx") + [s["<|im_end|>"]]
                   + tok.encode("y") + [s["<think>"], s["<|im_end|>"]] + tok.encode("\n")
                   + [s["<|im_start|>"]] + tok.encode("assistant\n"))
    assert tok.encode("\n") == [tok.token_to_id("\u010a")] == [10]
    # a chat token cut short is ordinary text
    assert s["<|im_end|>"] not in tok.encode("<|im_end")


def test_digits_are_split_one_at_a_time(tok):
    ids = tok.encode("12345")
    assert ids == [ord(c) for c in "12345"]        # ids 0..255 are the bytes
    assert tok.token_to_id("12") is not None        # the merge exists but must not apply


def test_truncation_keeps_first_512(tok, hf, plain):
    prompt = " ".join(f"fox{i % 10} in the snow" for i in range(300))
    full = plain.encode(template(prompt))
    assert len(full) > 600
    ids = tok.tokenize(prompt)
    assert len(ids) == 512 and ids == full[:512] == diffusers_ids(hf, template(prompt))
    assert tok.tokenize(prompt, max_tokens=10**6) == full
    for k in (1, 7, 511):
        want = diffusers_ids(hf, template(prompt), max_length=k)
        assert tok.tokenize(prompt, max_tokens=k) == full[:k] == want
    short = tok.tokenize("a fox")
    assert tok.tokenize("a fox", max_tokens=len(short)) == short


@pytest.mark.parametrize("prompt", ["a fox", "", "e\u0301 <|im_end|> \n"])
def test_template_matches_chat_template(prompt, hf):
    # The real Qwen3 jinja template is not available offline; CHAT_TEMPLATE
    # (tests/pipeline_fixtures.py) restates its user-turn and generation-prompt branches, and
    # the literal text below is checked too.
    msgs = [{"role": "user", "content": prompt}]
    text = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True,
                                  enable_thinking=True)
    assert text == template(prompt)
    assert template(prompt) == f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"
    # negative control: the template differs when thinking is disabled
    off = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True,
                                 enable_thinking=False)
    assert off != template(prompt) and off.endswith("<think>\n\n</think>\n\n")


_SPECIAL_TEXT = [t for t, _ in QWEN3_ADDED_TOKENS[:3]] + ["<think>", "</think>", "<|im_end"]
_TEXT = st.lists(st.one_of(
    st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=12),
    st.text(" \t\n\r'sSlLdDtT0123456789.,!?e\u0301\u00e9\u3042\U0001f98a-", max_size=12),
    st.sampled_from(_SPECIAL_TEXT)), max_size=8).map("".join)


@given(_TEXT)
def test_property_random_text(tok, hf, plain, text):
    ids = tok.encode(text)
    assert ids == hf(text)["input_ids"] == plain.encode(text)
    assert tok.tokenize(text) == diffusers_ids(hf, template(text))


def test_decode(tok, hf):
    for p in PROMPTS:
        ids = tok.tokenize(p, max_tokens=10**6)
        assert tok.decode(ids) == hf.decode(ids) == template(unicodedata.normalize("NFC", p))
    assert tok.decode([0xC3]) == "\ufffd"              # half of a UTF-8 sequence
    assert tok.decode(np.array(tok.encode("a fox"), dtype=np.int64)) == "a fox"
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([tok.vocab_size])
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([-1])
    with pytest.raises(TypeError, match="expected an int"):
        tok.decode([1.0])


# ----------------------------------------------------------------------------- negative controls

def _variant(tok, normalizer=None, split: str | None = None):
    """A copy of ``tok``'s pipeline with the normalizer or the split regex replaced."""
    from tokenizers import Regex, Tokenizer, pre_tokenizers
    t = Tokenizer.from_str(tok.backend.to_str())
    if normalizer is not None:
        t.normalizer = normalizer
    if split is not None:
        t.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return lambda text: t.encode(text, add_special_tokens=False).ids


def _differs(encode, ref) -> list[str]:
    return [p for p in PROMPTS if encode(template(p)) != diffusers_ids(ref, template(p))]


def test_negative_control_without_nfc(tok, hf):
    from tokenizers import normalizers
    same = _variant(tok, normalizer=normalizers.Sequence([]))
    assert _differs(_variant(tok), hf) == []          # the copy itself is faithful
    bad = _differs(same, hf)
    assert "e\u0301te\u0301 cafe\u0301" in bad and "\u00e9t\u00e9 caf\u00e9" not in bad
    assert PlainBPE(VOCAB, nfc=False).encode("e\u0301") != hf("e\u0301")["input_ids"]


def test_negative_control_gpt2_split(tok, hf):
    bad = _differs(_variant(tok, split=GPT2_SPLIT), hf)
    assert "12345 and 3.14159, 2024-01-01, 123123" in bad    # digits grouped, then merged
    assert "a fox.\nthe end!\n\nwhat?" in bad                 # '.' and '\n' apart
    gpt2 = PlainBPE(VOCAB, split=GPT2_SPLIT)
    assert gpt2.encode("12345") != hf("12345")["input_ids"]


# ----------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("bad", [None, b"a fox", 5, ["a"]])
def test_non_string_prompt(tok, bad):
    with pytest.raises(TypeError, match="expected str"):
        tok.tokenize(bad)
    with pytest.raises(TypeError, match="expected str"):
        tok.encode(bad)


@pytest.mark.parametrize("bad, what", [("a\x00fox", "NUL character at index 1"),
                                       ("a\ud800fox", "lone surrogate U\\+D800 at index 1"),
                                       ("\udfff", "lone surrogate U\\+DFFF")])
def test_bad_text(tok, bad, what):
    with pytest.raises(ValueError, match=what):
        tok.tokenize(bad)
    with pytest.raises(ValueError, match=what):
        tok.encode(bad)


@pytest.mark.parametrize("bad, exc", [(0, ValueError), (-3, ValueError), (1.5, TypeError),
                                      (True, TypeError), ("512", TypeError), (None, TypeError)])
def test_bad_max_tokens(tok, bad, exc):
    with pytest.raises(exc, match="max_tokens"):
        tok.tokenize("a fox", max_tokens=bad)


def _edit(vocab, fn):
    tokens, types, merges = (list(x) for x in vocab)
    fn(tokens, types, merges)
    return tokens, types, merges


def _drop(name):
    def fn(tokens, types, merges):
        i = tokens.index(name)
        del tokens[i], types[i]
    return fn


def _set(seq, i, v):
    def fn(tokens, types, merges):
        {"tokens": tokens, "types": types, "merges": merges}[seq][i] = v
    return fn


@pytest.mark.parametrize("fn, msg", [
    (_drop("<|im_start|>"), "no '<\\|im_start\\|>' token: not a Qwen chat vocab"),
    (_drop("<|im_end|>"), "no '<\\|im_end\\|>' token"),
    (_drop("<|endoftext|>"), "no '<\\|endoftext\\|>' token"),
    (lambda t, y, m: y.__setitem__(t.index("<|im_end|>"), 1), "type normal, expected control"),
    (lambda t, y, m: y.__setitem__(t.index("<|im_end|>"), 4), "type user-defined, expected"),
    (_set("tokens", 300, "he"), "token 'he' appears twice"),
    (_set("tokens", 300, ""), "tokens\\[300\\] = '' is not a non-empty string"),
    (_set("tokens", 7, 7), "tokens\\[7\\] = 7 is not"),
    (_set("tokens", 256, "h e"), "tokens\\[256\\] = 'h e' is a normal token with U\\+0020"),
    (_set("types", 5, 2), "token_type\\[5\\] = 2"),
    (_set("types", 5, 1.0), "token_type\\[5\\] = 1.0"),
    (_set("merges", 0, "he"), "merges\\[0\\] = 'he' is not 'left right'"),
    (_set("merges", 0, "h  e"), "merges\\[0\\] = 'h  e' is not 'left right'"),
    (_set("merges", 3, "q \u4e00"), "merges\\[3\\] = 'q \u4e00': '\u4e00' is not a token"),
    (_set("merges", 3, "q z"), "merges\\[3\\] = 'q z': 'qz' is not a token"),
    (lambda t, y, m: y.pop(), "token_type has 583 entries for 584 tokens"),
])
def test_from_fields_refuses_bad_vocab(fn, msg):
    with pytest.raises(VocabError, match=msg):
        Qwen3Tokenizer.from_fields(*_edit(VOCAB, fn))


def test_from_fields_refuses_other_kinds():
    with pytest.raises(VocabError, match="tokenizer.ggml.model is 'llama'"):
        Qwen3Tokenizer.from_fields(*VOCAB, model="llama")
    with pytest.raises(VocabError, match="tokenizer.ggml.pre is 'llama-bpe'.*'qwen2'"):
        Qwen3Tokenizer.from_fields(*VOCAB, pre="llama-bpe")
    with pytest.raises(VocabError, match="tokens is empty"):
        Qwen3Tokenizer.from_fields([], [], [])
    with pytest.raises(VocabError, match="expected a sequence, got str"):
        Qwen3Tokenizer.from_fields("abc", [1, 1, 1], [])
    for kw in ({"eos_id": len(VOCAB[0])}, {"pad_id": -1}, {"bos_id": True}):
        with pytest.raises(VocabError, match="_token_id = .* is not a token id"):
            Qwen3Tokenizer.from_fields(*VOCAB, **kw)
    assert isinstance(VocabError("x"), ModelFileError) and isinstance(VocabError("x"), ValueError)


# ----------------------------------------------------------------------------- the tiny vocab

def test_tiny_vocab_is_pinned():
    tokens, types, merges = tiny_vocab()
    assert (tokens, types, merges) == tiny_vocab()
    assert len(merges) == 300 and tokens[:256] == byte_alphabet()
    assert [t for t, ty in zip(tokens, types) if ty != 1] == [t for t, _ in QWEN3_ADDED_TOKENS]
    assert types[-26:] == [ty for _, ty in QWEN3_ADDED_TOKENS]
    assert merges[:4] == ["h e", "\u0120 t", "\u0120t he", "\u0120 a"]
    # the built-in models' token ids depend on this exact list: a change must be deliberate
    digest = hashlib.sha256("\n".join(tokens + ["--"] + merges).encode()).hexdigest()
    assert digest[:16] == PINNED_TINY_DIGEST
    tk = Qwen3Tokenizer.from_fields(tokens, types, merges)
    assert tk.vocab_size == len(tokens) and all(t in tk.special_ids for t in CHAT_TOKENS)


PINNED_TINY_DIGEST = "42f7f57e4e95952b"


def test_tiny_vocab_sizes_and_padding(hf):
    t0, y0, m0 = tiny_vocab(n_merges=0)
    assert len(t0) == 256 + 26 and m0 == []
    tokens, types, merges = tiny_vocab(n_merges=40, pad_to=400)
    assert len(tokens) == 400 and types[-1] == 5 and tokens[-1] == "[PAD399]"
    small = Qwen3Tokenizer.from_fields(tokens, types, merges)
    assert small.tokenize("<|im_end|>")[5] == tokens.index("<|im_end|>")
    assert small.encode("[PAD399]") != [399]              # unused tokens are never produced
    assert small.decode([399]) == "[PAD399]"
    with pytest.raises(ValueError, match="pad_to=300 is below"):
        tiny_vocab(n_merges=40, pad_to=300)
    with pytest.raises(ValueError, match="n_merges must be"):
        tiny_vocab(n_merges=-1)
    with pytest.raises(ValueError, match="yields only"):
        tiny_vocab(n_merges=100_000)


# ----------------------------------------------------------------------------- GGUF

def _write(path: Path, meta: dict) -> Path:
    return write_gguf(path, {"output_norm.weight": np.ones(8, np.float32)}, prefix=False,
                      arch="qwen3", metadata=meta)


def test_gguf_round_trip(tmp_path, tok):
    meta = vocab_metadata(*VOCAB, chat_template=CHAT_TEMPLATE)
    path = _write(tmp_path / "tok.gguf", meta)
    r = gguf.GGUFReader(path, "r")        # the stored fields, read by the gguf package
    f = r.fields
    assert f["tokenizer.ggml.tokens"].contents() == VOCAB[0]
    assert f["tokenizer.ggml.merges"].contents() == VOCAB[2]
    assert f["tokenizer.ggml.token_type"].contents() == VOCAB[1]
    assert f["tokenizer.ggml.tokens"].types == [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING]
    assert f["tokenizer.ggml.token_type"].types[-1] == gguf.GGUFValueType.INT32
    assert f["tokenizer.ggml.model"].contents() == "gpt2"
    assert f["tokenizer.ggml.pre"].contents() == "qwen2"
    assert f["tokenizer.ggml.eos_token_id"].contents() == VOCAB[0].index("<|im_end|>")
    assert f["tokenizer.ggml.padding_token_id"].contents() == VOCAB[0].index("<|endoftext|>")
    assert f["tokenizer.chat_template"].contents() == CHAT_TEMPLATE
    with GGUFFile(path) as g:
        loaded = [Qwen3Tokenizer.from_gguf(path), Qwen3Tokenizer.from_gguf(str(path)),
                  Qwen3Tokenizer.from_gguf(g), Qwen3Tokenizer.from_gguf(r)]
    for t in loaded:
        assert t.eos_id == VOCAB[0].index("<|im_end|>")
        assert t.pad_id == t.bos_id == VOCAB[0].index("<|endoftext|>")
        for p in PROMPTS:
            assert t.tokenize(p) == tok.tokenize(p)


def test_gguf_written_by_the_gguf_package(tmp_path, tok):
    """A file laid out by gguf's own tokenizer API, as llama.cpp's converter calls it (uint32
    ids, int32 types), with the padding of unused tokens; numpy fields to from_fields."""
    tokens, types, merges = VOCAB
    tokens = tokens + [f"[PAD{i}]" for i in range(len(tokens), 640)]
    types = types + [5] * (640 - len(types))
    path = tmp_path / "llamacpp.gguf"
    w = gguf.GGUFWriter(path, "qwen3")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_pad_token_id(tokens.index("<|endoftext|>"))
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_add_bos_token(False)
    w.add_tensor("output_norm.weight", np.ones(8, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    t = Qwen3Tokenizer.from_gguf(path)
    assert t.vocab_size == 640 and t.eos_id == tokens.index("<|im_end|>")
    n = Qwen3Tokenizer.from_fields(np.array(tokens), np.array(types, np.int32), np.array(merges))
    for p in PROMPTS:
        assert t.tokenize(p) == n.tokenize(p) == tok.tokenize(p)


def test_gguf_field_reading(tmp_path):
    strs = [f"s{i}\u00e9" for i in range(100)]
    ints = [i * 37 - 900 for i in range(70)]
    flags = [i % 3 == 0 for i in range(65)]
    floats = [i / 8 for i in range(80)]
    path = _write(tmp_path / "f.gguf", {"a.str": "fox\u00e9", "a.int": -7, "a.f": 0.5,
                                        "a.b": True, "a.strs": strs, "a.ints": ints,
                                        "a.bools": flags, "a.fl": [0.25, 1.5], "a.fls": floats,
                                        "a.short": ["x", "y"]})
    r = gguf.GGUFReader(path, "r")           # the gguf package's reading is the reference
    want = {k: f.contents() for k, f in r.fields.items() if k.startswith("a.")}
    assert want["a.ints"] == ints and want["a.fls"] == floats and want["a.bools"] == flags
    with GGUFFile(path) as g:
        assert isinstance(g.metadata["a.strs"], str)   # the scan's summary of a long array
        assert g.metadata["a.ints"] == "<array of 70 INT32>" and g.metadata["a.short"] == ["x", "y"]
        assert {k: g.field(k) for k in want} == want
        assert {k: read_field(r, k, str(path)) for k in want} == want
        assert g.field("a.b") is True and g.field("a.bools")[0] is True
        assert g.field("nope") is None and read_field(r, "nope") is None
    with pytest.raises(ModelFileError, match="closed"):
        g.field("a.str")
    got = read_fields(path)
    assert {k: v for k, v in got.items() if k.startswith("a.")} == want
    assert got["general.architecture"] == "qwen3"
    assert read_fields(path, ["a.ints", "nope"]) == {"a.ints": ints}
    # the file replaced while open (same size with other numbers, then cut short): field()
    # reads the bytes it scanned, not the path again (it gave the new file's numbers, or a raw
    # numpy ValueError)
    blob = path.read_bytes()
    with GGUFFile(path) as g:
        other = bytearray(blob)
        at = bytes(blob).index(np.array(ints, np.int32).tobytes())
        other[at:at + 4 * len(ints)] = bytes(4 * len(ints))
        for data in (bytes(other), blob[:200]):
            new = tmp_path / "new.gguf"
            new.write_bytes(data)
            os.replace(new, path)
            assert g.field("a.ints") == ints and g.field("a.fls") == floats
    with pytest.raises(ModelFileError, match="shrank|not a GGUF|past the end|truncated"):
        read_fields(path)               # control: the cut file itself is refused


def test_gguf_bad_utf8(tmp_path):
    path = _write(tmp_path / "u.gguf", {"k": [b"ok", b"\xff\xfe"]})
    for open_it in (GGUFFile, read_fields, Qwen3Tokenizer.from_gguf):
        with pytest.raises(ModelFileError, match=r"'k'\[1\]: string is not valid UTF-8"):
            open_it(path)                                # the validating scan refuses it
    with pytest.raises(ModelFileError, match=r"metadata 'k'\[1\] is not valid UTF-8"):
        read_field(gguf.GGUFReader(path, "r"), "k", str(path))


def _meta(**change):
    m = vocab_metadata(*VOCAB)
    for k, v in change.items():
        key = "tokenizer.ggml." + k
        if v is None:
            del m[key]
        else:
            m[key] = v
    return m


@pytest.mark.parametrize("meta, msg", [
    (_meta(tokens=None), "'tokenizer.ggml.tokens' is missing"),
    (_meta(model=None), "'tokenizer.ggml.model' is missing"),
    (_meta(token_type=None), "'tokenizer.ggml.token_type' is missing"),
    (_meta(tokens="abc"), "'tokenizer.ggml.tokens' should be an array of strings, got 'abc'"),
    (_meta(tokens=list(range(600))), "tokens' should be an array of strings, got a list of 600"),
    (_meta(token_type=VOCAB[0]), "'tokenizer.ggml.token_type' should be an array of integers"),
    (_meta(token_type=[1.0] * 584), "token_type' should be an array of integers.*float"),
    (_meta(merges=[1, 2]), "'tokenizer.ggml.merges' should be an array of strings"),
    (_meta(model=3), "'tokenizer.ggml.model' should be a string, got 3"),
    (_meta(model="llama"), "tokenizer.ggml.model is 'llama'"),
    (_meta(pre="llama-bpe"), "tokenizer.ggml.pre is 'llama-bpe'"),
    (_meta(eos_token_id="x"), "'tokenizer.ggml.eos_token_id' should be an integer"),
    (_meta(eos_token_id=10**6), "eos_token_id = 1000000 is not a token id"),
    (_meta(token_type=VOCAB[1][:-1]), "token_type has 583 entries for 584 tokens"),
    (_meta(tokens=[t for t in VOCAB[0] if t != "<|im_start|>"] + ["x\u0120"]),
     "no '<\\|im_start\\|>' token"),
    (_meta(merges=["h e", "q z"]), "merges\\[1\\] = 'q z': 'qz' is not a token"),
    # a vocab of merged tokens without its merges would split every prompt into bytes
    (_meta(merges=None), "merges is missing or empty but the vocab has 558 normal tokens"),
])
def test_gguf_malformed_fields(tmp_path, meta, msg):
    path = _write(tmp_path / "bad.gguf", meta)
    with pytest.raises(ModelFileError, match=msg) as e:
        Qwen3Tokenizer.from_gguf(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ModelFileError, match=msg):
        Qwen3Tokenizer.from_gguf(gguf.GGUFReader(path, "r"))


def test_gguf_without_tokenizer_and_truncated(tmp_path):
    with pytest.raises(ModelFileError, match="'tokenizer.ggml.model' is missing: no tokenizer"):
        Qwen3Tokenizer.from_gguf(_write(tmp_path / "none.gguf", {}))
    good = _write(tmp_path / "good.gguf", vocab_metadata(*VOCAB)).read_bytes()
    cut = tmp_path / "cut.gguf"
    for n in (10, 100, len(good) // 2, len(good) - 40):
        cut.write_bytes(good[:n])
        with pytest.raises(ModelFileError, match=str(cut)):
            Qwen3Tokenizer.from_gguf(cut)
    with pytest.raises(ModelFileError, match="not found"):
        Qwen3Tokenizer.from_gguf(tmp_path / "absent.gguf")
    with pytest.raises(TypeError, match="expected a path, a GGUFFile or a gguf.GGUFReader"):
        Qwen3Tokenizer.from_gguf(42)


def test_vocab_metadata_checks():
    with pytest.raises(VocabError, match="no '<\\|im_start\\|>' token"):
        vocab_metadata(*_edit(VOCAB, _drop("<|im_start|>")))
    with pytest.raises(VocabError, match="eos_token_id = 9999 is not a token id"):
        vocab_metadata(*VOCAB, eos_id=9999)
    m = vocab_metadata(*tiny_vocab(n_merges=0))
    assert "tokenizer.ggml.merges" not in m and m["tokenizer.ggml.add_bos_token"] is False


def test_gguf_byte_only_vocab_needs_no_merges(tmp_path):
    """Control for the missing-merges refusal: a vocab of the 256 bytes and the added tokens
    has no merges to give: it loads, and splits text into its bytes."""
    tok = Qwen3Tokenizer.from_gguf(_write(tmp_path / "bytes.gguf",
                                          vocab_metadata(*tiny_vocab(n_merges=0))))
    assert len(tok.encode("hello")) == 5


def test_a_text_beyond_what_the_tokenizer_takes_is_refused(tok):
    """The whole text is tokenized before the first 512 ids are kept: ~190 bytes a character,
    and a failed allocation inside the tokenizer aborted the process (SIGABRT, a Rust
    backtrace; the memory helper's 10 MB prompt under ``ulimit -v``). A prompt (or text) of
    more than MAX_TEXT_CHARS characters is a ValueError before any tokenizing. Controls: a
    prompt of exactly that many characters is taken (the template's own characters do not
    count against it), as ids the plain encoding gives."""
    from nxhpc.qwen3.tokenizer import MAX_TEXT_CHARS
    long = "fox " * (MAX_TEXT_CHARS // 4)
    assert len(long) == MAX_TEXT_CHARS
    for call in (tok.tokenize, tok.encode, template):
        with pytest.raises(ValueError, match="1,000,001 characters, more than the 1,000,000"):
            call(long + "x")
    ids, n = tok.tokenize_counted(long)
    assert len(ids) == 512 and ids == tok.encode(template(long)[:4000])[:512] and n > 250_000
