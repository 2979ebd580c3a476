"""The Qwen3 text encoder's config: the one authority on its dims and tensor names.

Owns :class:`Qwen3Config` (dims with shape comments; ``layers_needed``: the blocks run for
``hidden_states[-2]``), the llama.cpp tensor table (:data:`LAYER_TENSORS`, :func:`layer_names`,
:data:`GLOBAL_TENSORS`) and the one inference :func:`infer_config`: a GGUF's ``qwen3.*``
metadata gives the dims, every tensor's shape is then checked against them, and every problem
is a one-line :class:`~nxhpc.formats.gguf_io.ModelFileError` (or
:class:`~nxhpc.formats.gguf_io.MissingTensorError`) naming the key or tensor.
Must not: read files (it takes the metadata and ``{name: (shape, type name)}``), import the
compiled kernels, or decode weights.

Inference (``docs/text_encoder.md``, "The file"):

- ``general.architecture`` must be ``qwen3``;
- n_layers = ``qwen3.block_count``, dim = ``qwen3.embedding_length``, ffn =
  ``qwen3.feed_forward_length``, n_heads / n_kv_heads = ``qwen3.attention.head_count`` /
  ``head_count_kv``, eps = ``qwen3.attention.layer_norm_rms_epsilon``, rope_theta =
  ``qwen3.rope.freq_base``, context_length = ``qwen3.context_length``;
- head_dim = ``qwen3.attention.key_length`` (= ``value_length`` when given), else the length of
  ``blk.0.attn_q_norm.weight`` (Qwen3's head_dim is not dim / n_heads: 128 vs 2560 / 32);
- RoPE is plain: a ``rope.scaling.factor`` (YaRN, linear) other than 1, or a
  ``rope.dimension_count`` other than head_dim, is refused;
- vocab = rows of ``token_embd.weight`` (= ``qwen3.vocab_size`` when given);
- then every tensor of every block ``0 .. n_layers-1`` and ``output_norm.weight`` must be
  present with the shape those dims imply, matrices in a type the kernels run, vectors in a
  type decoded to float32. Other tensors (``output.weight`` of an untied head) are ignored.
"""
from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from nxhpc.formats.gguf_io import BLOCK_INDEX, MissingTensorError, ModelFileError
from nxhpc.formats.weights import RUNNABLE_TYPES

_BLK_INDEX = re.compile(rf"blk\.{BLOCK_INDEX}\.")     # ('²' is a str.isdigit() digit)

__all__ = ["Qwen3Config", "TensorSpec", "LAYER_TENSORS", "GLOBAL_TENSORS", "ARCH",
           "VECTOR_TYPES", "METADATA_KEYS", "layer_names", "infer_config"]

ARCH = "qwen3"
#: Types a 1-D tensor (a norm weight) may be stored in; it is decoded to float32 when bound.
VECTOR_TYPES = ("F32", "F16", "BF16", "Q8_0")


class TensorSpec(NamedTuple):
    """One tensor of a block: ``key`` (field of the bound weights), ``suffix`` (the name after
    ``blk.N.``), ``role`` ("matrix": run as stored; "vector": float32)."""
    key: str
    suffix: str
    role: str


LAYER_TENSORS: tuple[TensorSpec, ...] = (
    TensorSpec("attn_norm", "attn_norm.weight", "vector"),       # [D]
    TensorSpec("wq", "attn_q.weight", "matrix"),                 # [H*hd, D]
    TensorSpec("wk", "attn_k.weight", "matrix"),                 # [KVH*hd, D]
    TensorSpec("wv", "attn_v.weight", "matrix"),                 # [KVH*hd, D]
    TensorSpec("q_norm", "attn_q_norm.weight", "vector"),        # [hd]
    TensorSpec("k_norm", "attn_k_norm.weight", "vector"),        # [hd]
    TensorSpec("wo", "attn_output.weight", "matrix"),            # [D, H*hd]
    TensorSpec("ffn_norm", "ffn_norm.weight", "vector"),         # [D]
    TensorSpec("w_gate", "ffn_gate.weight", "matrix"),           # [F, D]
    TensorSpec("w_up", "ffn_up.weight", "matrix"),               # [F, D]
    TensorSpec("w_down", "ffn_down.weight", "matrix"),           # [D, F]
)
#: The tensors outside the blocks: the embedding (one row per token) and the final norm (never
#: run: ``hidden_states[-2]`` has no final norm, but a Qwen3 file has it).
GLOBAL_TENSORS = {"token_embd.weight": "matrix", "output_norm.weight": "vector"}

#: config field -> metadata key (after ``qwen3.``) of the integer/float hyper-parameters.
METADATA_KEYS = {"n_layers": "block_count", "dim": "embedding_length",
                 "ffn": "feed_forward_length", "n_heads": "attention.head_count",
                 "n_kv_heads": "attention.head_count_kv",
                 "context_length": "context_length",
                 "eps": "attention.layer_norm_rms_epsilon", "rope_theta": "rope.freq_base"}


def layer_names(index: int) -> dict[str, str]:
    """Short key -> tensor name of block ``index`` (``blk.{index}.attn_q.weight``, ...)."""
    return {t.key: f"blk.{index}.{t.suffix}" for t in LAYER_TENSORS}


@dataclass(frozen=True)
class Qwen3Config:
    """Dims of a Qwen3 text encoder (Qwen3-4B in the comments)."""
    vocab: int             # token_embd rows (151936)
    dim: int               # D, the residual width (2560)
    n_layers: int          # blocks in the file (36)
    n_heads: int           # H, query heads (32)
    n_kv_heads: int        # KVH, key/value heads (8); query head h reads kv head h // (H/KVH)
    head_dim: int          # hd (128); H*hd need not be D
    ffn: int               # F, the SwiGLU width (9728)
    eps: float             # RMSNorm epsilon (1e-6), every norm
    rope_theta: float      # RoPE base (1e6), rotate-half pairs (i, i + hd/2)
    context_length: int    # the longest position the model was trained for (40960)

    # -- derived sizes
    @property
    def layers_needed(self) -> int:
        """Blocks run for ``hidden_states[-2]``: all but the last (35 of 36)."""
        return self.n_layers - 1

    @property
    def q_width(self) -> int:
        """Rows of ``attn_q``: ``H * hd``."""
        return self.n_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """Rows of ``attn_k`` / ``attn_v``: ``KVH * hd``."""
        return self.n_kv_heads * self.head_dim

    @property
    def qkv_width(self) -> int:
        """Columns of the joint projection row ``[q | k | v]``: ``(H + 2 KVH) hd``."""
        return self.q_width + 2 * self.kv_width

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Short key -> torch shape of every tensor of one block."""
        D, F, hd = self.dim, self.ffn, self.head_dim
        return {"attn_norm": (D,), "wq": (self.q_width, D), "wk": (self.kv_width, D),
                "wv": (self.kv_width, D), "q_norm": (hd,), "k_norm": (hd,),
                "wo": (D, self.q_width), "ffn_norm": (D,), "w_gate": (F, D), "w_up": (F, D),
                "w_down": (D, F)}

    def global_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"token_embd.weight": (self.vocab, self.dim), "output_norm.weight": (self.dim,)}

    # -- rules
    def validate(self) -> "Qwen3Config":
        """ValueError naming every broken rule unless the dims are runnable."""
        c, errs = self, []
        ints = ("vocab", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn",
                "context_length")
        if any(isinstance(getattr(c, n), bool) or not isinstance(getattr(c, n), int)
               or getattr(c, n) < 1 for n in ints):
            errs.append(f"{', '.join(ints)} must be positive integers")
        else:
            if c.n_heads % c.n_kv_heads:
                errs.append(f"n_heads {c.n_heads} is not a multiple of n_kv_heads "
                            f"{c.n_kv_heads}")
            if c.head_dim % 2:
                errs.append(f"head_dim {c.head_dim} is odd (RoPE rotates pairs)")
            if c.n_layers < 2:
                errs.append(f"n_layers {c.n_layers} < 2: hidden_states[-2] needs a block "
                            f"before the last")
        for n in ("eps", "rope_theta"):
            v = getattr(c, n)
            if isinstance(v, bool) or not isinstance(v, (int, float)) \
                    or not math.isfinite(v) or v <= 0:
                errs.append(f"{n} must be a positive finite number, got {v!r}")
        if isinstance(c.eps, (int, float)) and not c.eps < 1:
            errs.append(f"eps {c.eps} is not below 1")
        if errs:
            raise ValueError("Qwen3Config: " + "; ".join(errs))
        return self

    def summary(self) -> str:
        """One line: dims, heads, FFN, layers, eps, RoPE base."""
        return (f"qwen3 dim={self.dim} layers={self.n_layers} (runs {self.layers_needed}) "
                f"heads={self.n_heads}/{self.n_kv_heads}x{self.head_dim} ffn={self.ffn} "
                f"vocab={self.vocab} eps={self.eps:g} rope_theta={self.rope_theta:g} "
                f"context={self.context_length}")


def _meta_number(meta: Mapping[str, Any], key: str, where: str, integer: bool) -> Any:
    full = f"{ARCH}.{key}"
    if full not in meta:
        raise ModelFileError(f"{where}: metadata key {full!r} is missing (a llama.cpp qwen3 "
                             f"file has it)")
    v = meta[full]
    ok = (isinstance(v, int) and not isinstance(v, bool)) if integer else \
        (isinstance(v, (int, float)) and not isinstance(v, bool))
    if not ok or not math.isfinite(v) or v <= 0:
        what = "a positive integer" if integer else "a positive number"
        raise ModelFileError(f"{where}: metadata {full} = {v!r} is not {what}")
    return int(v) if integer else float(v)


def _check_plain_rope(meta: Mapping[str, Any], head_dim: int, where: str) -> None:
    """ModelFileError for RoPE metadata that changes the rotation nxhpc computes (Qwen3's plain
    RoPE over the whole head): a context-extension scaling (YaRN, linear: llama.cpp applies
    ``rope.scaling.factor``, or the older ``rope.scale_linear``, whatever the type says) or a
    rotary width other than head_dim. A factor of 1 (or 0, llama.cpp's "none") changes
    nothing and is accepted."""
    a = f"{ARCH}.rope."
    for key in ("scaling.factor", "scale_linear"):
        f = meta.get(a + key)
        if f is not None and f not in (0, 1):
            kind = meta.get(a + "scaling.type", "linear")
            raise ModelFileError(f"{where}: metadata {a}{key} = {f!r} ({a}scaling.type "
                                 f"{kind!r}): RoPE context-extension scaling is not supported "
                                 f"(nxhpc runs Qwen3's plain RoPE; a file converted without "
                                 f"rope scaling runs)")
    dims = meta.get(a + "dimension_count")
    if dims is not None and dims != head_dim:
        raise ModelFileError(f"{where}: metadata {a}dimension_count = {dims!r} but head_dim is "
                             f"{head_dim}: RoPE over part of the head is not Qwen3's (not "
                             f"supported)")


def infer_config(metadata: Mapping[str, Any], tensors: Mapping[str, tuple[tuple[int, ...], str]],
                 where: str = "file") -> Qwen3Config:
    """The config of a llama.cpp qwen3 file from its ``metadata`` and tensor table
    ``{name: (torch shape, GGML type name)}``, every tensor checked (module docstring).
    :class:`ModelFileError` / :class:`MissingTensorError` whose message starts with ``where``
    and names the key or tensor (its ``tensor`` attribute too)."""
    arch = metadata.get("general.architecture")
    if arch != ARCH:
        got = "missing" if arch is None else repr(arch)
        raise ModelFileError(f"{where}: general.architecture is {got}, not {ARCH!r}: not a "
                             f"Qwen3 text encoder")
    vals: dict[str, Any] = {}
    for field, key in METADATA_KEYS.items():
        vals[field] = _meta_number(metadata, key, where, field not in ("eps", "rope_theta"))

    def need(name: str) -> tuple[tuple[int, ...], str]:
        if name not in tensors:
            raise MissingTensorError(f"{where}: required tensor {name!r} is missing", name)
        shape, tname = tensors[name]
        return tuple(int(s) for s in shape), tname

    # head_dim: the metadata's key/value length, else the q-norm's length
    hd_meta = [metadata.get(f"{ARCH}.attention.{k}") for k in ("key_length", "value_length")]
    q_norm0 = need("blk.0.attn_q_norm.weight")[0]
    if hd_meta[0] is not None:
        hd = _meta_number(metadata, "attention.key_length", where, True)
        if hd_meta[1] is not None and \
                _meta_number(metadata, "attention.value_length", where, True) != hd:
            raise ModelFileError(f"{where}: metadata {ARCH}.attention.key_length = {hd} and "
                                 f"value_length = {hd_meta[1]} disagree (Qwen3: equal)")
    elif len(q_norm0) == 1:
        hd = q_norm0[0]
    else:
        raise ModelFileError(f"{where}: tensor 'blk.0.attn_q_norm.weight' has shape "
                             f"{list(q_norm0)}, expected 1-D [head_dim]",
                             "blk.0.attn_q_norm.weight")
    emb = need("token_embd.weight")[0]
    if len(emb) != 2:
        raise ModelFileError(f"{where}: tensor 'token_embd.weight' has shape {list(emb)}, "
                             f"expected 2-D [vocab, dim]", "token_embd.weight")
    vocab = emb[0]
    if f"{ARCH}.vocab_size" in metadata:
        v = _meta_number(metadata, "vocab_size", where, True)
        if v != vocab:
            raise ModelFileError(f"{where}: metadata {ARCH}.vocab_size = {v} but "
                                 f"'token_embd.weight' has {vocab} rows", "token_embd.weight")
    a = f"{ARCH}."
    rules = [(vals["n_layers"] >= 2, f"{a}block_count = {vals['n_layers']}: hidden_states[-2] "
                                     f"needs at least 2 blocks"),
             (vals["n_heads"] % vals["n_kv_heads"] == 0,
              f"{a}attention.head_count = {vals['n_heads']} is not a multiple of "
              f"{a}attention.head_count_kv = {vals['n_kv_heads']}"),
             (hd % 2 == 0, f"head_dim {hd} ({a}attention.key_length or the q-norm's length) is "
                           f"odd: RoPE rotates pairs"),
             (vals["eps"] < 1, f"{a}attention.layer_norm_rms_epsilon = {vals['eps']} is not "
                               f"below 1")]
    for ok, why in rules:
        if not ok:
            raise ModelFileError(f"{where}: metadata {why}")
    _check_plain_rope(metadata, hd, where)
    cfg = Qwen3Config(vocab=vocab, head_dim=hd, **vals)
    try:
        cfg.validate()
    except ValueError as e:
        raise ModelFileError(f"{where}: {e}") from None
    # every tensor against the dims, block by block (a hostile block_count fails at the first
    # block that is not there, before anything is built for it)
    shapes = cfg.shapes()
    roles = {t.key: t.role for t in LAYER_TENSORS}

    def check(name: str, shape: tuple[int, ...], role: str) -> None:
        got, tname = need(name)
        if got != shape:
            raise ModelFileError(f"{where}: tensor {name!r} has shape {list(got)}, but the "
                                 f"metadata's dims ({cfg.summary()}) imply {list(shape)}", name)
        allowed = RUNNABLE_TYPES if role == "matrix" else VECTOR_TYPES
        if tname not in allowed:
            what = "matrix" if role == "matrix" else "1-D tensor"
            raise ModelFileError(f"{where}: tensor {name!r} has type {tname}, which nxhpc does "
                                 f"not run for a {what} (it runs {', '.join(allowed)})", name)
    for name, shape in cfg.global_shapes().items():
        check(name, shape, GLOBAL_TENSORS[name])
    for i in range(cfg.n_layers):
        for key, name in layer_names(i).items():
            check(name, shapes[key], roles[key])
    extra = sorted(n for n in tensors if (m := _BLK_INDEX.match(n)) is not None
                   and int(m.group(1)) >= cfg.n_layers)
    if extra:
        raise ModelFileError(f"{where}: tensor {extra[0]!r} lies beyond "
                             f"{ARCH}.block_count = {cfg.n_layers}", extra[0])
    return cfg
