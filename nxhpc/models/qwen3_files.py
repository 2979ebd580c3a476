"""Qwen3 text-encoder GGUFs in llama.cpp's layout, for tests and built-ins, and their read-back.

Owns :func:`random_qwen3_weights` (every parameter of a Qwen3 of given dims, seeded),
:func:`qwen3_metadata` (the ``general.*`` / ``qwen3.*`` keys llama.cpp's converter writes,
in its value types), :func:`tiny_tokenizer` (the tokenizer fields of the tokenizer's tiny vocab
at a given size),
:func:`write_qwen3_gguf` (weights -> a file through the one writer
``nxhpc.formats.gguf_io.write_gguf``, any GGML type per tensor, the caller's tokenizer fields)
and :func:`read_qwen3_gguf` (every tensor read back with ``gguf.GGUFReader`` and decoded with
``gguf.quants.dequantize`` to float64: the exact weights a loader must reproduce). Also the
built-in text encoders' spec (:class:`TextEncoderSpec`: everything that determines the file,
with a fingerprint) and their generator :func:`make_text_encoder` (a model directory written
all-or-nothing, as ``nxhpc.models.synthetic.make_synthetic`` writes the DiT built-ins).
Must not: use nxhpc's GGUF reader or kernels when reading back (it is the independent side),
or infer the config (``nxhpc.qwen3.config`` does).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from nxhpc.formats.gguf_io import LazyTensor, write_gguf
from nxhpc.models.modeldir import GGUF_FILE, SPEC_FILE, build_model_dir, check_replaceable
from nxhpc.models.zimage_files import package_metadata, package_tensor_f64
from nxhpc.qwen3.config import ARCH, Qwen3Config, layer_names
from nxhpc.qwen3.tokenizer import QWEN3_ADDED_TOKENS, tiny_vocab, vocab_metadata

__all__ = ["random_qwen3_weights", "qwen3_metadata", "tiny_tokenizer", "write_qwen3_gguf",
           "read_qwen3_gguf", "Qwen3File", "TextEncoderSpec", "make_text_encoder",
           "TEXT_ENCODER_KIND", "TE_GENERATOR_VERSION"]

#: The ``kind`` of a text-encoder spec in the built-in table (beside "block" and "denoiser").
TEXT_ENCODER_KIND = "text_encoder"
#: Part of every text-encoder fingerprint: bump it when :func:`make_text_encoder`'s bytes change.
TE_GENERATOR_VERSION = 1


def random_qwen3_weights(cfg: Qwen3Config, seed: int = 0, *, norm_spread: float = 0.3,
                         embed_scale: float = 1.0) -> dict[str, np.ndarray]:
    """Every tensor of a Qwen3 of ``cfg``'s dims (all blocks and ``output_norm``), float32 by
    llama.cpp name: matrices N(0, 1/fan_in), the embedding N(0, embed_scale^2), every norm
    weight ``1 + norm_spread * N(0, 1)`` (so that no norm is the identity and a missing one
    shows)."""
    rng = np.random.default_rng(seed)
    shapes = cfg.shapes()
    out: dict[str, np.ndarray] = {
        "token_embd.weight": rng.standard_normal((cfg.vocab, cfg.dim)) * embed_scale}
    for i in range(cfg.n_layers):
        for key, name in layer_names(i).items():
            s = shapes[key]
            if len(s) == 2:
                out[name] = rng.standard_normal(s) / np.sqrt(s[1])
            else:
                out[name] = 1.0 + norm_spread * rng.standard_normal(s)
    out["output_norm.weight"] = 1.0 + norm_spread * rng.standard_normal(cfg.dim)
    return {k: v.astype(np.float32) for k, v in out.items()}


def qwen3_metadata(cfg: Qwen3Config, name: str = "nxhpc synthetic qwen3") -> dict[str, Any]:
    """The hyper-parameter keys of a llama.cpp qwen3 file, in the value types its converter
    writes (uint32 counts, float32 epsilon and RoPE base)."""
    u32, f32 = np.uint32, np.float32
    a = f"{ARCH}."
    return {"general.name": name,
            a + "block_count": u32(cfg.n_layers), a + "context_length": u32(cfg.context_length),
            a + "embedding_length": u32(cfg.dim), a + "feed_forward_length": u32(cfg.ffn),
            a + "attention.head_count": u32(cfg.n_heads),
            a + "attention.head_count_kv": u32(cfg.n_kv_heads),
            a + "attention.key_length": u32(cfg.head_dim),
            a + "attention.value_length": u32(cfg.head_dim),
            a + "rope.freq_base": f32(cfg.rope_theta),
            a + "attention.layer_norm_rms_epsilon": f32(cfg.eps)}


def tiny_tokenizer(vocab: int = 582) -> dict[str, Any]:
    """The ``tokenizer.*`` metadata of the tokenizer's deterministic tiny vocab
    (``nxhpc.qwen3.tokenizer.tiny_vocab``: the 256 byte symbols, learnt merges, Qwen3's 26
    added tokens) with exactly ``vocab`` entries (at least 282; 582 with the default 300
    merges), so a file written with it tokenizes and encodes like a real one."""
    added = len(QWEN3_ADDED_TOKENS)
    n_merges = vocab - 256 - added
    if n_merges < 0:
        raise ValueError(f"tiny_tokenizer: vocab {vocab} is below the 256 byte symbols and the "
                         f"{added} added tokens")
    tokens, types, merges = tiny_vocab(n_merges)
    if len(tokens) < vocab:               # a merge that made no new token: pad with unused ids
        tokens, types, merges = tiny_vocab(n_merges, pad_to=vocab)
    return vocab_metadata(tokens, types, merges)


def write_qwen3_gguf(path: str | os.PathLike, cfg: Qwen3Config,
                     weights: Mapping[str, np.ndarray] | None = None, *, seed: int = 0,
                     matrix_type: str = "F32", types: Mapping[str, str] | None = None,
                     tokenizer: Mapping[str, Any] | None = None,
                     metadata: Mapping[str, Any] | None = None,
                     overrides: Mapping[str, Any] | None = None) -> Path:
    """Write a llama.cpp-layout qwen3 GGUF: ``weights`` (llama.cpp names -> float arrays;
    default :func:`random_qwen3_weights` of ``seed``), every 2-D tensor stored as
    ``matrix_type`` and every 1-D one F32 unless ``types`` names its type (any GGML type the
    codec ``nxhpc.formats.layouts.encode`` writes); ``general.architecture = qwen3`` and
    :func:`qwen3_metadata`, then ``tokenizer`` (e.g. :func:`tiny_tokenizer` of ``cfg.vocab``,
    or ``nxhpc.qwen3.tokenizer.vocab_metadata`` of a real vocab) and ``metadata`` (added
    last: may replace a key, ``general.architecture`` included).
    ``overrides``: tensor name -> any :func:`~nxhpc.formats.gguf_io.write_gguf` value (e.g. a
    ``QuantTensor`` of another type) or None (leave the tensor out) -- for bad-file tests.
    Returns the path."""
    w = dict(random_qwen3_weights(cfg, seed) if weights is None else weights)
    tensors: dict[str, Any] = {}
    for name, a in w.items():
        a = np.ascontiguousarray(a, dtype=np.float32)
        gtype = (types or {}).get(name, matrix_type if a.ndim == 2 else "F32")
        tensors[name] = LazyTensor(a.shape, gtype, lambda a=a: a)
    for name, v in (overrides or {}).items():
        if v is None:
            tensors.pop(name, None)
        else:
            tensors[name] = v
    meta = qwen3_metadata(cfg)
    meta.update(tokenizer or {})
    meta.update(metadata or {})
    arch = meta.pop("general.architecture", ARCH)        # a caller may write another arch
    return write_gguf(path, tensors, prefix="", arch=arch, metadata=meta)


@dataclass
class Qwen3File:
    """A qwen3 GGUF read back by the ``gguf`` package: ``weights`` (name -> exact dequantized
    values, float64, torch shape), ``types`` (name -> GGML type name), ``metadata`` (every
    key's decoded value: strings, numbers, lists)."""
    path: Path
    weights: dict[str, np.ndarray]
    types: dict[str, str]
    metadata: dict[str, Any]


def read_qwen3_gguf(path: str | os.PathLike, *, names: Any = None) -> Qwen3File:
    """Read ``path`` with ``gguf.GGUFReader`` and decode tensors (``names``: an iterable of the
    ones wanted; default all) with ``gguf.quants.dequantize`` to float64."""
    r = gguf.GGUFReader(os.fspath(path), "r")
    want = None if names is None else set(names)
    weights: dict[str, np.ndarray] = {}
    types: dict[str, str] = {}
    for t in r.tensors:
        types[t.name] = t.tensor_type.name
        if want is not None and t.name not in want:
            continue
        weights[t.name] = package_tensor_f64(t)[1]
    return Qwen3File(Path(path), weights, types, package_metadata(r))


# ------------------------------------------------------------------------------ built-ins
@dataclass(frozen=True)
class TextEncoderSpec:
    """Everything that determines a built-in text encoder's file (same spec -> the same bytes):
    the Qwen3 dims, the tiny vocab's size (:func:`tiny_tokenizer`), the seed of
    :func:`random_qwen3_weights` and the stored type of every matrix (the embedding too; the
    norm weights are F32). ``kind`` is :data:`TEXT_ENCODER_KIND`."""
    dim: int = 320                 # D (the width of the features: a denoiser's cap_dim)
    n_layers: int = 3              # blocks in the file; all but the last run
    n_heads: int = 4               # query heads
    n_kv_heads: int = 2            # key/value heads (grouped: 2 query heads each)
    head_dim: int = 64             # H * hd = 256 != D, as in Qwen3-4B
    ffn: int = 768                 # SwiGLU width
    vocab: int = 582               # the tiny vocab: 256 bytes, 300 merges, 26 added tokens
    eps: float = 1e-6
    rope_theta: float = 1e6
    context_length: int = 1024     # above diffusers' 512-token truncation
    matrix_type: str = "Q8_0"      # every 2-D tensor, token_embd included
    seed: int = 0

    @property
    def kind(self) -> str:
        return TEXT_ENCODER_KIND

    def fields(self) -> dict[str, Any]:
        """The spec's fields by name (what ``synthetic.json`` stores)."""
        return dataclasses.asdict(self)

    def config(self) -> Qwen3Config:
        """The model's config as the spec gives it (the file rounds eps and base to float32)."""
        return Qwen3Config(vocab=self.vocab, dim=self.dim, n_layers=self.n_layers,
                           n_heads=self.n_heads, n_kv_heads=self.n_kv_heads,
                           head_dim=self.head_dim, ffn=self.ffn, eps=self.eps,
                           rope_theta=self.rope_theta, context_length=self.context_length)

    def validate(self) -> "TextEncoderSpec":
        """ValueError unless the spec makes a runnable file: runnable dims, a known matrix type
        whose blocks fill every row, a vocab that holds the tiny tokenizer."""
        from nxhpc.formats.weights import RUNNABLE_TYPES, block_geometry
        cfg = self.config().validate()
        if self.matrix_type not in RUNNABLE_TYPES:
            raise ValueError(f"TextEncoderSpec: matrix_type {self.matrix_type!r} is not one of "
                             f"{', '.join(RUNNABLE_TYPES)}")
        elems = block_geometry(self.matrix_type)[0]
        cols = {cfg.dim, cfg.q_width, cfg.ffn}
        if any(c % elems for c in cols):
            raise ValueError(f"TextEncoderSpec: {self.matrix_type} rows hold blocks of {elems} "
                             f"values; row lengths {sorted(cols)} must be multiples of it")
        tiny_tokenizer(self.vocab)                 # ValueError if the vocab cannot hold it
        return self

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Tensor name -> torch shape of every tensor of the file."""
        cfg = self.config()
        out = dict(cfg.global_shapes())
        for i in range(cfg.n_layers):
            out.update({name: cfg.shapes()[key] for key, name in layer_names(i).items()})
        return out

    def weights_bytes_f32(self) -> int:
        """Bytes of the file's matrices as float32."""
        return 4 * sum(math.prod(s) for s in self.shapes().values() if len(s) == 2)

    def disk_bytes(self) -> int:
        """A lower bound of the model directory's bytes: every tensor in its stored type."""
        from nxhpc.formats.weights import block_geometry
        elems, nbytes = block_geometry(self.matrix_type)
        return sum(math.prod(s) // elems * nbytes if len(s) == 2 else 4 * math.prod(s)
                   for s in self.shapes().values())

    def fingerprint(self) -> str:
        """16 hex digits of the sha256 of the fields, the kind and the generator's version."""
        d = self.fields()
        d["kind"] = self.kind
        d["generator_version"] = TE_GENERATOR_VERSION
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    def spec_file_text(self) -> str:
        """The ``synthetic.json`` of the model directory (its fingerprint says if it is stale)."""
        info = {"spec": self.fields(), "kind": self.kind, "fingerprint": self.fingerprint(),
                "generator_version": TE_GENERATOR_VERSION}
        return json.dumps(info, indent=1, sort_keys=True) + "\n"


def make_text_encoder(out_dir: str | os.PathLike, spec: TextEncoderSpec,
                      progress: Callable[[str], None] | None = None, *,
                      replace: bool = False) -> Path:
    """Write the model directory of ``spec`` at ``out_dir``: ``model.gguf`` (a llama.cpp-layout
    qwen3 file, :func:`write_qwen3_gguf` of :func:`random_qwen3_weights` and
    :func:`tiny_tokenizer`) and ``synthetic.json``; built in a temporary sibling and renamed
    into place (``nxhpc.models.modeldir.build_model_dir``: all-or-nothing; ``replace`` swaps
    out an existing model directory once the new one is complete)."""
    spec.validate()
    out_dir = Path(out_dir)
    check_replaceable(out_dir, replace)
    say = progress or (lambda s: None)
    t0 = time.monotonic()
    cfg = spec.config()

    def write(tmp: Path) -> None:
        say(f"writing {GGUF_FILE} ({cfg.summary()}, {spec.matrix_type})")
        write_qwen3_gguf(tmp / GGUF_FILE, cfg, seed=spec.seed, matrix_type=spec.matrix_type,
                         tokenizer=tiny_tokenizer(spec.vocab),
                         metadata={"general.name": "nxhpc synthetic qwen3 text encoder",
                                   "nxhpc.synthetic": True,
                                   "nxhpc.fingerprint": spec.fingerprint()})
        (tmp / SPEC_FILE).write_text(spec.spec_file_text())
    build_model_dir(out_dir, write, replace=replace)
    say(f"done in {time.monotonic() - t0:.1f} s: {out_dir}")
    return out_dir
