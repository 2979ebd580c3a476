"""The Qwen3 tokenizer, built from a llama.cpp GGUF's ``tokenizer.ggml.*`` fields.

Owns the byte-level BPE (assembled with the ``tokenizers`` package: NFC, the ``qwen2`` split
regex, GPT-2's byte alphabet, control and user-defined tokens matched whole first), the prompt
template and truncation of diffusers' ``ZImagePipeline._encode_prompt``, and a deterministic
tiny vocab for built-in and test models. Must not run the model or import ``nxhpc.models``.
"""
from __future__ import annotations

import collections
import operator
import os
from typing import Any, Sequence

import gguf
import numpy as np

from nxhpc.formats.gguf_io import GGUFFile, ModelFileError, read_field, read_fields

__all__ = [
    "Qwen3Tokenizer", "VocabError", "QWEN2_SPLIT", "TEMPLATE", "MAX_TOKENS", "CHAT_TOKENS",
    "QWEN3_ADDED_TOKENS", "TOKEN_NORMAL", "TOKEN_CONTROL", "TOKEN_USER_DEFINED", "TOKEN_UNUSED",
    "MAX_TEXT_CHARS", "byte_alphabet", "check_text", "template", "tiny_vocab", "vocab_metadata",
]

QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
"""The ``qwen2`` pre-tokenizer's split regex (llama.cpp's ``LLAMA_VOCAB_PRE_TYPE_QWEN2``,
``Qwen2Tokenizer``'s): GPT-2's English contractions case-insensitively, letter runs with one
leading non-letter, digits one at a time, punctuation runs, newline runs, other whitespace."""

TEMPLATE = "<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"
"""What Qwen3's chat template renders for one user turn with ``add_generation_prompt=True,
enable_thinking=True`` (what ``ZImagePipeline._encode_prompt`` asks for)."""

MAX_TOKENS = 512
"""``ZImagePipeline``'s ``max_sequence_length``: the first 512 ids of the templated text."""

MAX_TEXT_CHARS = 1_000_000
"""The longest text :func:`check_text` takes. Only a prompt's first :data:`MAX_TOKENS` tokens
(a few thousand characters) reach the model, but the whole text is tokenized first: about 190
bytes of memory a character (10 MB of text took 1.9 GB and 19 s, and an allocation that fails
inside the tokenizer aborts the process)."""

CHAT_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
"""The control tokens a vocab must have: the template's two and the end/padding token."""

# llama.cpp's token types (gguf.TokenType); 2 (unknown) and 6 (byte) never occur in a gpt2 vocab
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED = 1, 3, 4, 5
_TYPES = {TOKEN_NORMAL: "normal", TOKEN_CONTROL: "control", TOKEN_USER_DEFINED: "user-defined",
          TOKEN_UNUSED: "unused"}

QWEN3_ADDED_TOKENS: tuple[tuple[str, int], ...] = tuple(
    (t, TOKEN_USER_DEFINED if t[1] != "|" else TOKEN_CONTROL) for t in (
        "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>",
        "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>",
        "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>",
        "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
        "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>",
        "</tool_response>", "<think>", "</think>"))
"""Qwen3's 26 added tokens (ids 151643..151668 in the real vocab) in id order, with the type
llama.cpp's converter gives them: control for the ones ``tokenizer.json`` marks special and
for those that look special (``<|...|>``: the fill-in-the-middle markers too), user-defined
for the others (``<think>``, ``</think>``, the tool-call and tool-response tags). The type
does not change the ids: both kinds are matched whole."""


class VocabError(ModelFileError, ValueError):
    """Tokenizer fields that do not make a Qwen3 (qwen2 byte-level BPE) vocab. A
    :class:`ModelFileError` (they come from a model file: the CLIs report a bad file) and a
    ``ValueError`` for callers that pass the fields themselves."""


def byte_alphabet() -> list[str]:
    """GPT-2's byte-to-unicode map as a list: ``byte_alphabet()[b]`` is the character standing
    for byte ``b``. Printable Latin-1 bytes (``!``..``~``, ``¡``..``¬``, ``®``..``ÿ``) stand for
    themselves; the other 68 take U+0100, U+0101, ... in byte order."""
    keep = set(range(0x21, 0x7F)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    out, extra = [], 0
    for b in range(256):
        if b in keep:
            out.append(chr(b))
        else:
            out.append(chr(0x100 + extra))
            extra += 1
    return out


def template(prompt: str) -> str:
    """The templated text of one user prompt (:data:`TEMPLATE`); the prompt is inserted as is."""
    check_text(prompt, "prompt")
    return "<|im_start|>user\n" + prompt + "<|im_end|>\n<|im_start|>assistant\n"


def check_text(text: Any, what: str) -> None:
    """TypeError for a non-string ``text``, ValueError for a NUL character, a lone surrogate or
    more than :data:`MAX_TEXT_CHARS` characters (each naming ``what``): what every prompt must
    be before it is tokenized."""
    if not isinstance(text, str):
        raise TypeError(f"{what}: expected str, got {type(text).__name__}")
    if len(text) > MAX_TEXT_CHARS:
        raise ValueError(f"{what}: {len(text):,} characters, more than the {MAX_TEXT_CHARS:,} "
                         f"the tokenizer takes (a prompt's first {MAX_TOKENS} tokens are all "
                         f"the model reads): shorten it")
    nul = text.find("\x00")
    if nul >= 0:
        raise ValueError(f"{what}: contains a NUL character at index {nul}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what}: contains a lone surrogate U+{ord(text[e.start]):04X} at "
                         f"index {e.start} (not encodable as UTF-8)") from None


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class Qwen3Tokenizer:
    """Qwen3's byte-level BPE, giving the ids of transformers' ``Qwen2Tokenizer``.

    Built by :meth:`from_fields` (the GGUF fields as Python values) or :meth:`from_gguf`. Every
    token keeps its id from the file; control (3) and user-defined (4) tokens are matched as
    whole strings before NFC and the split regex, also when a user types them; unused (5)
    tokens are kept so ids stay aligned but BPE never produces them.
    """

    def __init__(self, tokenizer: Any, tokens: list[str], token_types: list[int],
                 eos_id: int | None, pad_id: int | None, bos_id: int | None) -> None:
        self._tok = tokenizer
        self._tokens = tokens
        self._types = token_types
        self.eos_id = eos_id
        self.pad_id = pad_id
        self.bos_id = bos_id
        self.special_ids = {t: i for i, t in enumerate(tokens)
                            if token_types[i] in (TOKEN_CONTROL, TOKEN_USER_DEFINED)}

    # -- construction
    @classmethod
    def from_fields(cls, tokens: Sequence[str], token_types: Sequence[int],
                    merges: Sequence[str], *, model: str = "gpt2", pre: str = "qwen2",
                    eos_id: int | None = None, pad_id: int | None = None,
                    bos_id: int | None = None) -> "Qwen3Tokenizer":
        """The tokenizer of ``tokens`` (id order, byte-alphabet strings for normal tokens),
        ``token_types`` (1 normal, 3 control, 4 user-defined, 5 unused) and ``merges``
        (``"left right"``, rank order); the vocab must hold :data:`CHAT_TOKENS` as control
        tokens. ``model``/``pre``: ``tokenizer.ggml.model``/``pre``, which must be
        ``"gpt2"``/``"qwen2"``. ``eos_id``/``pad_id``/``bos_id`` are kept as attributes.
        Raises :class:`VocabError` naming what is wrong."""
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
        from tokenizers import pre_tokenizers

        _check_kind(model, pre)
        tokens, token_types, merges = _check_fields(tokens, token_types, merges)
        ids = {}
        for i, t in enumerate(tokens):
            if t in ids:
                raise VocabError(f"tokenizer.ggml.tokens: token {t!r} appears twice "
                                 f"(ids {ids[t]} and {i})")
            ids[t] = i
        for t in CHAT_TOKENS:
            if t not in ids:
                raise VocabError(f"the vocab has no {t!r} token: not a Qwen chat vocab "
                                 f"(needs {', '.join(CHAT_TOKENS)})")
            if token_types[ids[t]] != TOKEN_CONTROL:
                raise VocabError(f"token {t!r} (id {ids[t]}) has type "
                                 f"{_TYPES[token_types[ids[t]]]}, expected control (3)")
        alphabet = set(byte_alphabet())
        normal = [t for t, ty in zip(tokens, token_types) if ty == TOKEN_NORMAL]
        if not set("".join(normal)) <= alphabet:        # one pass; find the culprit after
            i, t = next((i, t) for i, t in enumerate(tokens)
                        if token_types[i] == TOKEN_NORMAL and not set(t) <= alphabet)
            bad = next(c for c in t if c not in alphabet)
            raise VocabError(f"tokenizer.ggml.tokens[{i}] = {t!r} is a normal token with "
                             f"U+{ord(bad):04X}, outside the byte-level alphabet")
        pairs = []
        for r, m in enumerate(merges):
            left, _, right = m.partition(" ")
            if not left or not right or " " in right:
                raise VocabError(f"tokenizer.ggml.merges[{r}] = {m!r} is not 'left right'")
            if left not in ids or right not in ids or left + right not in ids:
                p = next(p for p in (left, right, left + right) if p not in ids)
                raise VocabError(f"tokenizer.ggml.merges[{r}] = {m!r}: {p!r} is not a token")
            pairs.append((left, right))
        for name, v in (("eos", eos_id), ("padding", pad_id), ("bos", bos_id)):
            if v is not None and (not _is_int(v) or not 0 <= v < len(tokens)):
                raise VocabError(f"tokenizer.ggml.{name}_token_id = {v!r} is not a token id "
                                 f"(0..{len(tokens) - 1})")

        # Every token sits in the model's vocab at its own id; the added ones are then found
        # there by ``add_tokens`` (which keeps an existing id) rather than appended.
        tok = Tokenizer(models.BPE(vocab=ids, merges=pairs, dropout=None, unk_token=None,
                                   continuing_subword_prefix="", end_of_word_suffix="",
                                   fuse_unk=False, byte_fallback=False, ignore_merges=False))
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False,
                                     use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        added = [AddedToken(t, special=ty == TOKEN_CONTROL, normalized=False, lstrip=False,
                            rstrip=False, single_word=False)
                 for t, ty in zip(tokens, token_types)
                 if ty in (TOKEN_CONTROL, TOKEN_USER_DEFINED)]
        tok.add_tokens(added)
        if tok.get_vocab_size(with_added_tokens=True) != len(tokens):
            raise VocabError(f"the tokenizer has {tok.get_vocab_size(with_added_tokens=True)} "
                             f"ids for {len(tokens)} tokens")  # pragma: no cover
        for a in added:
            if tok.token_to_id(a.content) != ids[a.content]:  # pragma: no cover - guard
                raise VocabError(f"token {a.content!r} did not keep its id {ids[a.content]}")
        return cls(tok, tokens, token_types, eos_id, pad_id, bos_id)

    @classmethod
    def from_gguf(cls, source: "str | os.PathLike | GGUFFile | Any") -> "Qwen3Tokenizer":
        """The tokenizer of a GGUF: a path (its metadata read by the validating scan of
        :func:`~nxhpc.formats.gguf_io.read_fields`, tensors untouched), an open
        :class:`GGUFFile`, or a ``gguf.GGUFReader``. A missing or mistyped field is a
        :class:`ModelFileError` naming the file and the key; a bad vocab a :class:`VocabError`."""
        if isinstance(source, (str, os.PathLike)):
            where = str(source)
            get = read_fields(source, _GGUF_KEYS).get
        elif isinstance(source, GGUFFile):
            where = str(source.path)
            get = source.field
        elif isinstance(source, gguf.GGUFReader):
            where = str(getattr(source.data, "filename", None) or "GGUF")
            get = lambda key: read_field(source, key, where)
        else:
            raise TypeError(f"from_gguf: expected a path, a GGUFFile or a gguf.GGUFReader, "
                            f"got {type(source).__name__}")

        def field(key: str, kind: str, required: bool = True) -> Any:
            v = get(key)
            if v is None:
                if required:
                    why = "no tokenizer in this GGUF" if key == "tokenizer.ggml.model" \
                        else "the GGUF's tokenizer is incomplete"
                    raise ModelFileError(f"{where}: metadata {key!r} is missing: {why}")
                return None
            ok = {"str": isinstance(v, str), "int": _is_int(v),
                  "strs": isinstance(v, list) and all(isinstance(x, str) for x in v),
                  "ints": isinstance(v, list) and all(_is_int(x) for x in v)}[kind]
            if not ok:
                shown = f"a list of {len(v)}" if isinstance(v, list) else repr(v)[:60]
                raise ModelFileError(f"{where}: metadata {key!r} should be "
                                     f"{_KINDS[kind]}, got {shown}"
                                     f"{'' if not isinstance(v, list) else _item_kinds(v)}")
            return v

        model = field("tokenizer.ggml.model", "str")
        pre = field("tokenizer.ggml.pre", "str")
        try:
            _check_kind(model, pre)     # first: another family's vocab is named as such
        except VocabError as e:
            raise VocabError(f"{where}: {e}") from None
        tokens = field("tokenizer.ggml.tokens", "strs")
        types = field("tokenizer.ggml.token_type", "ints")
        merges = field("tokenizer.ggml.merges", "strs", required=False) or []
        n_normal = sum(1 for t in types if t == 1)
        if not merges and n_normal > 256:   # llama.cpp refuses a BPE vocab without merges too
            raise VocabError(f"{where}: tokenizer.ggml.merges is missing or empty but the vocab "
                             f"has {n_normal} normal tokens (256 are bytes): every prompt would "
                             f"be split into bytes")
        eos = field("tokenizer.ggml.eos_token_id", "int", required=False)
        pad = field("tokenizer.ggml.padding_token_id", "int", required=False)
        bos = field("tokenizer.ggml.bos_token_id", "int", required=False)
        try:
            return cls.from_fields(tokens, types, merges, model=model, pre=pre, eos_id=eos,
                                   pad_id=pad, bos_id=bos)
        except VocabError as e:
            raise VocabError(f"{where}: {e}") from None

    # -- use
    @property
    def backend(self) -> Any:
        """The ``tokenizers.Tokenizer`` doing the work (to inspect or copy; do not modify)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        """Number of ids (every token of the file, unused ones included)."""
        return len(self._tokens)

    def token_to_id(self, token: str) -> int | None:
        """The id of a token string as stored (byte-alphabet form), or None."""
        return self._tok.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        """The ids of ``text`` as is: no template, nothing added, not truncated."""
        check_text(text, "text")
        return self._ids(text)

    def _ids(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def tokenize(self, prompt: str, max_tokens: int = MAX_TOKENS) -> list[int]:
        """The ids ``ZImagePipeline`` gives the text encoder: :data:`TEMPLATE` around
        ``prompt``, encoded whole, then its first ``max_tokens`` ids (a long prompt loses its
        tail and the assistant header, as diffusers' truncation does)."""
        return self.tokenize_counted(prompt, max_tokens)[0]

    def tokenize_counted(self, prompt: str, max_tokens: int = MAX_TOKENS) -> tuple[list[int], int]:
        """:meth:`tokenize`'s ids and the templated prompt's length before truncation, from one
        encoding (the ids were cut when the length is above ``max_tokens``)."""
        if not _is_int(max_tokens):
            raise TypeError(f"max_tokens: expected int, got {type(max_tokens).__name__}")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        ids = self._ids(template(prompt))        # the prompt checked (not the template's text)
        return ids[:max_tokens], len(ids)

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``, special tokens written out; bytes that do not form UTF-8 (a
        sequence cut inside a character) become U+FFFD."""
        ids = [self._check_id(i) for i in ids]
        return self._tok.decode(ids, skip_special_tokens=False)

    def _check_id(self, i: Any) -> int:
        if isinstance(i, bool) or not hasattr(i, "__index__"):
            raise TypeError(f"token id: expected an int, got {type(i).__name__}")
        i = operator.index(i)
        if not 0 <= i < len(self._tokens):
            raise ValueError(f"token id {i} is out of range (vocab of {len(self._tokens)})")
        return i

    def __repr__(self) -> str:
        return (f"Qwen3Tokenizer({len(self._tokens)} tokens, {len(self.special_ids)} added, "
                f"eos={self.eos_id}, pad={self.pad_id})")


_GGUF_KEYS = tuple(f"tokenizer.ggml.{k}" for k in (
    "model", "pre", "tokens", "token_type", "merges", "eos_token_id", "padding_token_id",
    "bos_token_id"))

_KINDS = {"str": "a string", "int": "an integer", "strs": "an array of strings",
          "ints": "an array of integers"}


def _item_kinds(v: list) -> str:
    kinds = sorted({type(x).__name__ for x in v})
    return f" ({'/'.join(kinds)} items)" if kinds else ""


def _check_kind(model: Any, pre: Any) -> None:
    if model != "gpt2":
        raise VocabError(f"tokenizer.ggml.model is {model!r}; only 'gpt2' (byte-level BPE) "
                         f"vocabs are supported")
    if pre != "qwen2":
        raise VocabError(f"tokenizer.ggml.pre is {pre!r}; only the 'qwen2' pre-tokenizer "
                         f"(Qwen2/Qwen3 vocabs) is supported")


def _check_fields(tokens: Any, token_types: Any, merges: Any
                  ) -> tuple[list[str], list[int], list[str]]:
    """The three fields as lists of the right item types (1-D numpy arrays are taken too);
    a fast pass over 150k items, and a slow one only to name the first bad item."""
    def as_list(v: Any, name: str) -> list:
        if isinstance(v, np.ndarray) and v.ndim == 1:
            return v.tolist()
        if isinstance(v, (str, bytes)) or not isinstance(v, Sequence):
            raise VocabError(f"{name}: expected a sequence, got {type(v).__name__}")
        return list(v)

    tokens = as_list(tokens, "tokenizer.ggml.tokens")
    token_types = as_list(token_types, "tokenizer.ggml.token_type")
    merges = as_list(merges, "tokenizer.ggml.merges")
    if not tokens:
        raise VocabError("tokenizer.ggml.tokens is empty")
    if not all(type(x) is str and x for x in tokens):
        i, x = next((i, x) for i, x in enumerate(tokens) if not (type(x) is str and x))
        raise VocabError(f"tokenizer.ggml.tokens[{i}] = {x!r} is not a non-empty string")
    if not all(type(x) is str for x in merges):
        i, x = next((i, x) for i, x in enumerate(merges) if type(x) is not str)
        raise VocabError(f"tokenizer.ggml.merges[{i}] = {x!r} is not a string")
    if len(token_types) != len(tokens):
        raise VocabError(f"tokenizer.ggml.token_type has {len(token_types)} entries for "
                         f"{len(tokens)} tokens")
    if not all(type(t) is int for t in token_types) or not set(token_types) <= set(_TYPES):
        i, ty = next((i, t) for i, t in enumerate(token_types)
                     if type(t) is not int or t not in _TYPES)
        raise VocabError(f"tokenizer.ggml.token_type[{i}] = {ty!r} (token {tokens[i]!r}): "
                         f"expected 1 (normal), 3 (control), 4 (user-defined) or 5 (unused)")
    return tokens, token_types, merges


# ----------------------------------------------------------------------------- the tiny vocab

_TINY_TEXT = """\
A small red fox ran across the field at dawn, and the grass was still wet with dew.
The old farmer watched it from the window of his kitchen while the kettle began to sing.
In the city, people wake up to the sound of traffic, trains and the smell of fresh bread.
She painted a picture of the mountains in winter: white peaks, blue shadows, a quiet lake.
We don't know where the river ends, but they'll find out when the summer comes again.
Light falls through the trees in the forest and draws long golden lines on the ground.
An astronaut floats above the earth, looking down at the clouds and the shining oceans.
The cat sleeps on the warm stones of the garden wall; a bird sings in the apple tree.
Children are playing in the park near the museum, running after a bright yellow ball.
A portrait of a woman with dark hair, wearing a green dress, standing in soft evening light.
There is a wooden boat on the shore, and the sea is calm under the pale morning sky.
The market sells oranges, lemons, tomatoes and flowers of every colour you can imagine.
He wrote a letter to his brother about the storm, the broken fence and the lost sheep.
A photograph of a street at night, with wet roads reflecting the lights of the shops.
The dragon rested on a hill of gold, its scales glowing like embers in a dying fire.
Snow covered the village, and smoke rose from the chimneys into the cold still air.
"""
"""English text the tiny vocab's merges are learnt from (written for this module)."""


def _learn_merges(text: str, n_merges: int) -> list[tuple[str, str]]:
    """Greedy byte-level BPE training, deterministic by construction: split ``text`` like
    the qwen2 pre-tokenizer, then repeatedly merge the most frequent adjacent pair, ties going
    to the smallest ``(left, right)`` in code-point order."""
    from tokenizers import Regex, pre_tokenizers

    split = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    counts = collections.Counter(piece for piece, _ in split.pre_tokenize_str(text))
    words = [[list(w), c] for w, c in sorted(counts.items())]
    merges: list[tuple[str, str]] = []
    while len(merges) < n_merges:
        pairs: collections.Counter = collections.Counter()
        for sym, c in words:
            for a, b in zip(sym, sym[1:]):
                pairs[(a, b)] += c
        if not pairs:
            raise ValueError(f"tiny_vocab: the built-in text yields only {len(merges)} merges, "
                             f"asked for {n_merges}")
        top = max(pairs.values())
        best = min(p for p, c in pairs.items() if c == top)
        merges.append(best)
        joined = best[0] + best[1]
        for w in words:
            sym, out, i = w[0], [], 0
            while i < len(sym):
                if i + 1 < len(sym) and (sym[i], sym[i + 1]) == best:
                    out.append(joined)
                    i += 2
                else:
                    out.append(sym[i])
                    i += 1
            w[0] = out
    return merges


def tiny_vocab(n_merges: int = 300, pad_to: int | None = None
               ) -> tuple[list[str], list[int], list[str]]:
    """A deterministic Qwen3-shaped vocab: ``(tokens, token_types, merges)``.

    Ids 0..255 are the byte-level symbols in byte order, then one token per new merge result
    (``n_merges`` merges learnt from a built-in English text), then :data:`QWEN3_ADDED_TOKENS`;
    ``pad_to``: append unused (type 5) ``[PAD<id>]`` tokens up to that many ids, as llama.cpp's
    converter pads Qwen's 151669 tokens to the model's 151936 rows."""
    if not _is_int(n_merges) or n_merges < 0:
        raise ValueError(f"tiny_vocab: n_merges must be an int >= 0, got {n_merges!r}")
    tokens = byte_alphabet()
    seen = set(tokens)
    merges = []
    for a, b in _learn_merges(_TINY_TEXT, n_merges):
        merges.append(f"{a} {b}")
        if a + b not in seen:
            seen.add(a + b)
            tokens.append(a + b)
    types = [TOKEN_NORMAL] * len(tokens)
    for t, ty in QWEN3_ADDED_TOKENS:
        tokens.append(t)
        types.append(ty)
    if pad_to is not None:
        if not _is_int(pad_to) or pad_to < len(tokens):
            raise ValueError(f"tiny_vocab: pad_to={pad_to!r} is below the {len(tokens)} tokens")
        while len(tokens) < pad_to:
            tokens.append(f"[PAD{len(tokens)}]")
            types.append(TOKEN_UNUSED)
    return tokens, types, merges


def vocab_metadata(tokens: Sequence[str], token_types: Sequence[int], merges: Sequence[str],
                   *, eos_id: int | None = None, pad_id: int | None = None,
                   bos_id: int | None = None, chat_template: str | None = None
                   ) -> dict[str, Any]:
    """The ``tokenizer.*`` metadata of a llama.cpp Qwen3 GGUF, for
    :func:`nxhpc.formats.gguf_io.write_gguf`'s ``metadata``. Ids default to the real files'
    choices: eos ``<|im_end|>``, padding and bos ``<|endoftext|>``. The fields are checked by
    building the tokenizer first (:class:`VocabError`)."""
    tok = Qwen3Tokenizer.from_fields(tokens, token_types, merges)
    eos = tok.special_ids["<|im_end|>"] if eos_id is None else eos_id
    pad = tok.special_ids["<|endoftext|>"] if pad_id is None else pad_id
    bos = tok.special_ids["<|endoftext|>"] if bos_id is None else bos_id
    for name, v in (("eos", eos), ("padding", pad), ("bos", bos)):
        if not _is_int(v) or not 0 <= v < len(tokens):
            raise VocabError(f"tokenizer.ggml.{name}_token_id = {v!r} is not a token id")
    meta: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": [str(t) for t in tokens],
        "tokenizer.ggml.token_type": [int(t) for t in token_types],
        "tokenizer.ggml.merges": [str(m) for m in merges],
        "tokenizer.ggml.eos_token_id": int(eos),
        "tokenizer.ggml.padding_token_id": int(pad),
        "tokenizer.ggml.bos_token_id": int(bos),
        "tokenizer.ggml.add_bos_token": False,
    }
    if not merges:           # GGUF cannot store an empty array; llama.cpp reads none as none
        del meta["tokenizer.ggml.merges"]
    if chat_template is not None:
        meta["tokenizer.chat_template"] = str(chat_template)
    return meta
