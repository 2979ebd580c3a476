"""The Qwen3 text encoder on nxhpc's kernels: ids -> ``hidden_states[-2]``, read like the paper.

Owns :class:`TextEncoderModel` (a llama.cpp qwen3 GGUF opened, its config inferred by
``nxhpc.qwen3.config``, every weight bound zero-copy; ``encode_ids(ids)`` -> float32
``[L, dim]``), the bound weights (:class:`Qwen3Weights`, :class:`LayerWeights`), the block as a
stage table (:data:`STAGES`, run by :class:`LayerPlan` on the shared
:class:`~nxhpc.nn.engine.Engine`), the rotate-half RoPE table (:func:`rope_table`) and the
session that serves up to a token count: ONE engine (one arena, one pool forked once) reused by
every call of that length or shorter.
Must not: compute model arithmetic in Python (the embedding gather, every norm, projection,
rotation, attention and residual of a call runs in ``nxhpc._kernels``; Python copies ids in
and features out, builds the float64 RoPE table once per session, and copies projection
columns into the joint row), copy or decode a weight matrix, import the float64 reference or
``nxhpc.models`` (ids and files are the registry's).

The forward (``docs/text_encoder.md``; Qwen3-4B: 36 blocks, 35 run)::

    x = token_embd[ids]                                   embed_rows, rows of the typed matrix
    for i in 0 .. n_layers-2:                             the last block is never needed
        n1 = rmsnorm(x, attn_norm)
        q, k, v = n1 @ Wq^T, n1 @ Wk^T, n1 @ Wv^T
        q, k = rope_half(rmsnorm_hd(q, q_norm)), rope_half(rmsnorm_hd(k, k_norm))
        x = x + attn_causal_gqa(q, k, v) @ Wo^T
        n2 = rmsnorm(x, ffn_norm)
        x = x + (silu(n2 @ Wgate^T) * (n2 @ Wup^T)) @ Wdown^T
    return x                                              hidden_states[-2]: no output_norm

One block as its stage table (generated from :data:`STAGES`; ``tests/test_qwen3.py`` keeps it in
sync)::

    stage        split over         timer           task
    norm1        token rows         us_attn         h = rmsnorm(x, attn_norm)
    qkv          qkv columns        us_attn         qkv = [h @ Wq^T | h @ Wk^T | h @ Wv^T]
    qknorm_rope  q+k heads          us_attn         q, k = rope_half(rmsnorm_hd(q|k)): [H|KVH, T, hd]
    sdpa         query heads        us_attn         attn = softmax(q k^T / sqrt(hd) + causal) v[h // (H/KVH)]
    out_proj     dim columns        us_attn         y = attn @ Wo^T
    attn_res     token rows         us_attn         mid = x + y
    ffn_norm     token rows         us_ffn          h = rmsnorm(mid, ffn_norm)
    w13          ffn columns        us_ffn          g = silu(h @ Wgate^T) * (h @ Wup^T)
    w2           dim columns        us_ffn          y = g @ Wdown^T
    ffn_res      token rows         us_ffn          x = mid + y

Splits are ``[i*m//n, (i+1)*m//n)`` and every kernel is band-invariant, so the features are
bit-identical for every worker count. The ``qkv`` stage runs each of the three projections on
the columns of the joint row its band covers, into that projection's own scratch, then copies
those columns into the joint row the q/k-norm and attention kernels read (the files store
``attn_q`` / ``attn_k`` / ``attn_v`` apart, often in different types; the matmul writes a whole
``[T, N]`` output). Residuals are the gated-residual kernel with the unit gate (exactly
``resid + y``, :mod:`nxhpc.nn.residual`). ``attn_res`` and ``ffn_norm``, both row-local
(:meth:`LayerPlan.row_local`), go to the workers as one command (``nxhpc.nn.engine.ROW_GROUPS``).

Memory: weights stay in the map in their stored type (workers share the pages); scratch per
token ``3*D + 2*(H + 2*KVH)*hd + (H + KVH)*hd + H*hd + F`` floats (Qwen3-4B: 156 KB, 80 MB
at 512 tokens), plus x, pe and ids.
"""
from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

import nxhpc
from nxhpc.formats.closing import MapHolder
from nxhpc.formats.gguf_io import GGUFFile, ModelFileError
from nxhpc.formats.weights import WeightTensor, check_finite_weight
from nxhpc.nn import engine as _engine
from nxhpc.nn.checks import check_eps
from nxhpc.nn.engine import Engine, EngineSession, IOSpec, Plan, Stage
from nxhpc.nn.linear import (DEFAULT_PRECISION, DEFAULT_Q8_FLOAT_WEIGHTS, Q8Blocks,
                             attention_precision, check_precision, check_q8_float_weights, matmul)
from nxhpc.nn.residual import UnitGateState, residual_add
from nxhpc.nn.stages import Project, ProjectGLU, block_extents
from nxhpc.qwen3.config import LAYER_TENSORS, Qwen3Config, infer_config, layer_names
from nxhpc.runtime.checks import check_bool, check_workers
from nxhpc.runtime.memory import memory_report
from nxhpc.runtime.workers import DEFAULT_SPAWN, SPAWN_MODES, check_timeout

__all__ = ["TextEncoderModel", "TextEncoderInputError", "LayerWeights", "Qwen3Weights",
           "LayerPlan", "STAGES", "EXTENTS", "TIMING_KEYS", "rope_table", "stage_table",
           "DEFAULT_MAX_TOKENS"]

#: Tokens a session is sized for unless asked otherwise: diffusers' ZImagePipeline truncates
#: the templated prompt to 512 tokens.
DEFAULT_MAX_TOKENS = 512


class TextEncoderInputError(ValueError):
    """Token ids that do not fit the model (empty, out of the vocab, longer than the context,
    not integers); the message says which."""


# ------------------------------------------------------------------------------ the weights
@dataclass
class LayerWeights:
    """One block's weights, bound once: matrices as stored (:class:`WeightTensor`, zero-copy
    views of the map), norm weights float32. Shapes in torch order (Qwen3-4B)."""
    attn_norm: np.ndarray     # blk.N.attn_norm.weight     [D]          (2560)
    wq: WeightTensor          # blk.N.attn_q.weight        [H*hd, D]    (4096, 2560)
    wk: WeightTensor          # blk.N.attn_k.weight        [KVH*hd, D]  (1024, 2560)
    wv: WeightTensor          # blk.N.attn_v.weight        [KVH*hd, D]  (1024, 2560)
    q_norm: np.ndarray        # blk.N.attn_q_norm.weight   [hd]         (128)
    k_norm: np.ndarray        # blk.N.attn_k_norm.weight   [hd]         (128)
    wo: WeightTensor          # blk.N.attn_output.weight   [D, H*hd]    (2560, 4096)
    ffn_norm: np.ndarray      # blk.N.ffn_norm.weight      [D]
    w_gate: WeightTensor      # blk.N.ffn_gate.weight      [F, D]       (9728, 2560)
    w_up: WeightTensor        # blk.N.ffn_up.weight        [F, D]
    w_down: WeightTensor      # blk.N.ffn_down.weight      [D, F]       (2560, 9728)
    layer: int = field(default=-1)

    def matrices(self) -> dict[str, WeightTensor]:
        """Short key -> every matrix of the block."""
        return {t.key: getattr(self, t.key) for t in LAYER_TENSORS if t.role == "matrix"}

    def check(self, cfg: Qwen3Config, where: str) -> None:
        """ValueError naming the tensor unless every field has the config's shape."""
        shapes = cfg.shapes()
        for f in fields(self):
            if f.name == "layer":
                continue
            v, want = getattr(self, f.name), shapes[f.name]
            got = v.shape if isinstance(v, (WeightTensor, np.ndarray)) else None
            ok = isinstance(v, WeightTensor) if len(want) == 2 else \
                isinstance(v, np.ndarray) and v.dtype == np.float32
            if not ok or tuple(got) != want:
                raise ValueError(f"{where}: {f.name} must be "
                                 f"{'a WeightTensor' if len(want) == 2 else 'float32'} "
                                 f"{list(want)}, got {type(v).__name__} "
                                 f"{list(got) if got is not None else ''}")


#: A block's projections (what the matmul precision applies to).
PROJECTIONS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


@dataclass
class Qwen3Weights:
    """Every tensor the encoder runs, bound once: the embedding as stored (one row per token,
    gathered by ``embed_rows``) and the first ``layers_needed`` blocks."""
    token_embd: WeightTensor            # token_embd.weight [vocab, D]
    layers: dict[int, LayerWeights]     # 0 .. n_layers-2


def _vector(g: GGUFFile, name: str) -> np.ndarray:
    try:
        v = np.array(g.load_f32(name), dtype=np.float32).reshape(-1)
    except ModelFileError as e:
        raise ModelFileError(f"{e} (tensor {name!r} is decoded to float32)", name) from None
    if not np.isfinite(v).all():
        raise ModelFileError(f"{g.path}: tensor {name!r} has NaN/Inf values", name)
    return v


def _matrix(g: GGUFFile, name: str, check_values: bool) -> WeightTensor:
    w = WeightTensor.from_gguf(g, name)
    if check_values:
        check_finite_weight(w, f"{g.path}: tensor {name!r}")
    return w


def bind_weights(g: GGUFFile, cfg: Qwen3Config, kernels: Any, *,
                 check_values: bool = True) -> Qwen3Weights:
    """Bind every tensor the encoder runs from ``g`` (whose table ``cfg`` was inferred from):
    matrices zero copy in a type the kernels run, vectors float32, values finite (scanned on
    the stored bits when ``check_values``). ModelFileError naming the tensor."""
    have = kernels.weight_types()
    for name in ["token_embd.weight"] + [n for i in range(cfg.layers_needed)
                                         for n in layer_names(i).values()]:
        if len(g.shape(name)) == 2 and g.type_name(name) not in have:   # infer_config's list
            raise ModelFileError(f"{g.path}: tensor {name!r} has type {g.type_name(name)}; "
                                 f"the kernels run {', '.join(have)}", name)
    layers: dict[int, LayerWeights] = {}
    for i in range(cfg.layers_needed):
        vals: dict[str, Any] = {}
        for t in LAYER_TENSORS:
            name = layer_names(i)[t.key]
            vals[t.key] = _matrix(g, name, check_values) if t.role == "matrix" \
                else _vector(g, name)
        lw = LayerWeights(**vals, layer=i)
        try:
            lw.check(cfg, f"{g.path}: block {i}")
        except ValueError as e:                       # pragma: no cover - infer_config checked
            raise ModelFileError(str(e)) from None
        layers[i] = lw
    return Qwen3Weights(_matrix(g, "token_embd.weight", check_values), layers)


# ------------------------------------------------------------------------------ one block
class RunContext(_engine.RunContext):
    """What a stage's task reads in a worker: kernels, config, weights, views, eps, precision."""
    __slots__ = ("kernels", "cfg", "w", "eps", "x", "pe", "buf", "unit_gate", "scale",
                 "precision", "parts")


def _norm1(c: RunContext, lo: int, hi: int) -> None:
    c.kernels.rmsnorm(c.x, c.w.attn_norm, c.buf["h"], c.eps, r0=lo, r1=hi)


def _qkv(c: RunContext, lo: int, hi: int) -> None:
    qkv = c.buf["qkv"]
    for name, w, c0 in c.parts:             # (scratch, weight, first joint column)
        a, b = max(lo, c0), min(hi, c0 + w.rows)
        if a < b:
            part = c.buf[name]
            matmul(c.kernels, c.buf["h"], w, part, a - c0, b - c0, c.precision)
            qkv[:, a:b] = part[:, a - c0:b - c0]


def _qknorm_rope(c: RunContext, lo: int, hi: int) -> None:
    c.kernels.qknorm_rope(c.buf["qkv"], c.w.q_norm, c.w.k_norm, c.pe, c.buf["q"], c.buf["k"],
                          c.cfg.n_heads, c.cfg.n_kv_heads, c.eps, h0=lo, h1=hi,
                          rope_pairs="half")


def _sdpa(c: RunContext, lo: int, hi: int) -> None:
    c.kernels.attention(c.buf["q"], c.buf["k"], c.buf["qkv"], c.buf["attn"], c.cfg.n_kv_heads,
                        c.scale, h0=lo, h1=hi, causal=True,
                        precision=attention_precision(c.precision))


def _attn_res(c: RunContext, lo: int, hi: int) -> None:
    residual_add(c.kernels, c.x, c.buf["y"], c.unit_gate, c.buf["mid"], lo, hi)


def _ffn_norm(c: RunContext, lo: int, hi: int) -> None:
    c.kernels.rmsnorm(c.buf["mid"], c.w.ffn_norm, c.buf["h"], c.eps, r0=lo, r1=hi)


def _ffn_res(c: RunContext, lo: int, hi: int) -> None:
    residual_add(c.kernels, c.buf["mid"], c.buf["y"], c.unit_gate, c.x, lo, hi)


#: extent name -> (description, m(cfg, T)): the range [0, m) a stage splits over workers
EXTENTS: dict[str, tuple[str, Callable[[Qwen3Config, int], int]]] = block_extents(
    lambda cfg: cfg.ffn)

STAGES: tuple[Stage, ...] = (
    Stage("norm1", "rows", "us_attn", _norm1, "h = rmsnorm(x, attn_norm)"),
    Stage("qkv", "qkv_cols", "us_attn", _qkv, "qkv = [h @ Wq^T | h @ Wk^T | h @ Wv^T]"),
    Stage("qknorm_rope", "qk_heads", "us_attn", _qknorm_rope,
          "q, k = rope_half(rmsnorm_hd(q|k)): [H|KVH, T, hd]"),
    Stage("sdpa", "query_heads", "us_attn", _sdpa,
          "attn = softmax(q k^T / sqrt(hd) + causal) v[h // (H/KVH)]"),
    Stage("out_proj", "dim_cols", "us_attn", Project("attn", (("wo", "y"),)), "y = attn @ Wo^T"),
    Stage("attn_res", "rows", "us_attn", _attn_res, "mid = x + y"),
    Stage("ffn_norm", "rows", "us_ffn", _ffn_norm, "h = rmsnorm(mid, ffn_norm)"),
    Stage("w13", "ffn_cols", "us_ffn", ProjectGLU("h", "w_gate", "w_up", "g"),
          "g = silu(h @ Wgate^T) * (h @ Wup^T)"),
    Stage("w2", "dim_cols", "us_ffn", Project("g", (("w_down", "y"),)), "y = g @ Wdown^T"),
    Stage("ffn_res", "rows", "us_ffn", _ffn_res, "x = mid + y"),
)

#: Timing keys of one block, in stage order, then ``block_us``.
TIMING_KEYS = _engine.timing_keys(STAGES)


def stage_table() -> str:
    """The stage table as the module docstring shows it."""
    return _engine.stage_table(STAGES, {k: v[0] for k, v in EXTENTS.items()})


@dataclass(frozen=True)
class LayerPlan(UnitGateState, Plan):
    """A Qwen3 block as data for the shared engine: config and stages. Inputs (:meth:`io`):
    ``x`` [T, D] (updated in place) and ``pe`` [T, hd/2, 2, 2]; state: the unit gate [D];
    params of a run: ``(eps, precision)``."""
    config: Qwen3Config
    stages: tuple[Stage, ...] = field(default=STAGES, repr=False)

    @property
    def label(self) -> str:
        return "qwen3 block"

    def extent(self, stage: Stage, T: int, params: tuple | None = None) -> int:
        return EXTENTS[stage.extent][1](self.config, T)

    def row_local(self, stage: Stage, params: tuple) -> bool:
        """The norms and residual adds (split over token rows, each band its own rows): the
        attention's residual and the FFN's norm run as one dispatch (``ROW_GROUPS``)."""
        return stage.extent == "rows"

    def scratch(self, T: int) -> dict[str, tuple[int, ...]]:
        c = self.config
        D, H, KVH, hd, F = c.dim, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn
        return {"h": (T, D), "q_lin": (T, c.q_width), "k_lin": (T, c.kv_width),
                "v_lin": (T, c.kv_width), "qkv": (T, c.qkv_width), "q": (H, T, hd),
                "k": (KVH, T, hd), "attn": (T, c.q_width), "y": (T, D), "mid": (T, D),
                "g": (T, F)}

    def io(self, T: int) -> dict[str, IOSpec]:
        return {"x": IOSpec((T, self.config.dim)),
                "pe": IOSpec((T, self.config.head_dim // 2, 2, 2))}

    def state(self) -> dict[str, Any]:
        return {"unit_gate": (self.config.dim,)}

    def bind(self, key: Hashable, weights: Any, kernels: Any) -> LayerWeights:
        if not isinstance(weights, LayerWeights):
            raise TypeError(f"Engine: weights[{key!r}] must be qwen3 LayerWeights, got "
                            f"{type(weights).__name__}")
        weights.check(self.config, f"block {key!r}")
        return weights

    def matrices(self, weights: LayerWeights) -> dict[str, WeightTensor]:
        return weights.matrices()

    def context(self, kernels: Any, weights: LayerWeights, T: int,
                buf: Mapping[str, np.ndarray], io: Mapping[str, np.ndarray | None],
                state: Mapping[str, np.ndarray], params: tuple) -> RunContext:
        eps, precision = params
        c = self.config
        parts = (("q_lin", weights.wq, 0), ("k_lin", weights.wk, c.q_width),
                 ("v_lin", weights.wv, c.q_width + c.kv_width))
        return RunContext(kernels=kernels, cfg=c, w=weights, eps=eps, x=io["x"], pe=io["pe"],
                          buf=buf, unit_gate=state["unit_gate"],
                          scale=1.0 / math.sqrt(c.head_dim), precision=precision, parts=parts)


def rope_table(T: int, head_dim: int, theta: float) -> np.ndarray:
    """pe[t, i] = [[cos, -sin], [sin, cos]] of angle ``t * theta^(-2i/hd)``, i < hd/2, for
    positions 0 .. T-1: the rotation of pair (i, i + hd/2) (``rope_pairs="half"``). Angles and
    cos/sin in float64, then rounded to float32 [T, hd/2, 2, 2]."""
    inv = float(theta) ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    a = np.arange(T, dtype=np.float64)[:, None] * inv[None, :]
    c, s = np.cos(a), np.sin(a)
    return np.stack([np.stack([c, -s], -1), np.stack([s, c], -1)], -2).astype(np.float32)


# ------------------------------------------------------------------------------ one session
class _Session(EngineSession):
    """Everything calls of up to ``capacity`` tokens need, built once: the engine (arena +
    pool, the embedding gather as an extra task) and the RoPE table of positions 0 ..
    capacity-1 (written into the arena)."""

    def __init__(self, model: "TextEncoderModel", capacity: int) -> None:
        cfg = model.config
        self.capacity = capacity
        self.plan = LayerPlan(cfg)
        emb = model.weights.token_embd
        kernels = model.kernels

        def embed(eng: Engine, lo: int, hi: int, L: int) -> None:
            """x[t] = token_embd[ids[t]], token rows t in [lo, hi)."""
            kernels.embed_rows(emb.data, emb.type_name, eng.buffer("ids")[:L],
                               eng.buffer("x")[:L], lo, hi)
        hd = cfg.head_dim
        self.engine = Engine([(self.plan, capacity)], model.weights.layers,
                             buffers={"x": (capacity, cfg.dim), "pe": (capacity, hd // 2, 2, 2),
                                      "ids": ((capacity,), np.int32)},
                             workers=model.workers, spawn=model.spawn,
                             stage_timeout=model.stage_timeout, tasks={"embed": embed})
        try:
            np.copyto(self.engine.buffer("pe"), rope_table(capacity, hd, cfg.rope_theta))
        except BaseException:
            self.engine.close()
            raise



# ------------------------------------------------------------------------------ the model
class TextEncoderModel(MapHolder):
    """Z-Image's text encoder (Qwen3) from a llama.cpp-layout GGUF: ``encode_ids(ids)`` ->
    ``hidden_states[-2]``, float32 ``[L, dim]``.

    ``path``: the GGUF (``general.architecture = qwen3``; F32/F16/BF16/Q8_0/Q4_0..Q5_1/
    Q2_K..Q6_K tensors; IQ* types are refused naming the tensor and type). ``workers``
    (default: the usable CPUs), ``precision`` (``"f32"`` default, ``"bf16"``, ``"q8"``:
    ``nxhpc.nn.linear``; may be changed between calls) is the projections' matmul precision
    -- the embedding gather, norms, RoPE and residuals stay float32; the attention follows it
    (``linear.attention_precision``). ``q8_float_weights`` (``"int8"`` default, or ``"bf16"``)
    is how ``q8`` runs F32/F16/BF16 projections (an F16/BF16 file): on Q8_0 copies made once, in
    the parent, at the first ``q8`` call (kept until :meth:`close`; the session forked before
    is replaced), or as stored in ``bf16``; settable between calls. ``max_tokens``: the
    session's size (default :data:`DEFAULT_MAX_TOKENS`, at most the model's context): calls of
    up to that many ids reuse one arena and one pool of workers forked once; a longer call (up
    to ``context_length``) replaces them with a larger session. ``spawn`` / ``stage_timeout``
    as for the worker pool; ``check_values`` scans every weight for NaN/Inf when the file is
    opened (reads the whole file once).

    Use as a context manager or call :meth:`close`, which stops the workers and releases the
    arena and the map (also after an error or an interrupt: the arena's segment is unlinked
    when it is made, so nothing outlives the process either way). ``last_timings``:
    microseconds of the last call (``us_embed``, ``us_layers``, ``us_total``). Not
    thread-safe across calls: use one model per thread, or serialize.
    """

    def __init__(self, path: str | os.PathLike, *, workers: int | None = None,
                 precision: str = DEFAULT_PRECISION, max_tokens: int | None = None,
                 spawn: str = DEFAULT_SPAWN, stage_timeout: float | None = None,
                 check_values: bool = True,
                 q8_float_weights: str = DEFAULT_Q8_FLOAT_WEIGHTS) -> None:
        self.workers = check_workers(workers, "TextEncoderModel: workers")
        self.precision = check_precision(precision, "TextEncoderModel: precision")
        self.q8_float_weights = check_q8_float_weights(q8_float_weights,
                                                       "TextEncoderModel: q8_float_weights")
        if spawn is None:                            # as Denoiser and Block read it
            spawn = DEFAULT_SPAWN
        if spawn not in SPAWN_MODES:
            raise ValueError(f"TextEncoderModel: spawn must be one of {SPAWN_MODES}, got "
                             f"{spawn!r}")
        self.spawn = spawn
        check_values = check_bool(check_values, "TextEncoderModel: check_values")
        self.stage_timeout = check_timeout(stage_timeout)
        self._session: _Session | None = None
        self.last_timings: dict[str, int] = {}
        self.kernels = nxhpc.kernels()
        self.gguf: GGUFFile | None = GGUFFile(path)
        try:
            g = self.gguf
            table = {n: (g.shape(n), g.type_name(n)) for n in g.names()}
            self.config = infer_config(g.metadata, table, str(g.path))
            try:
                self.eps = check_eps(self.config.eps)
            except ValueError as e:
                raise ModelFileError(f"{g.path}: metadata qwen3.attention."
                                     f"layer_norm_rms_epsilon: {e}") from None
            if max_tokens is None:
                max_tokens = min(DEFAULT_MAX_TOKENS, self.config.context_length)
            if isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer)) \
                    or not 1 <= max_tokens <= self.config.context_length:
                raise ValueError(f"TextEncoderModel: max_tokens must be an integer in [1, "
                                 f"context_length={self.config.context_length}], got "
                                 f"{max_tokens!r}")
            self.max_tokens = int(max_tokens)
            self.weights = bind_weights(g, self.config, self.kernels, check_values=check_values)
            self._q8_layers = Q8Blocks(self.weights.layers, PROJECTIONS)
        except BaseException:
            self.gguf.close()
            self.gguf = None
            raise

    @property
    def path(self) -> Path | None:
        return self.gguf.path if self.gguf is not None else None

    @property
    def metadata(self) -> dict[str, Any]:
        """The file's metadata as nxhpc's checked reader decodes it (arrays of more than 64
        items are summarized; the tokenizer reads those itself)."""
        if self.gguf is None:
            raise RuntimeError("TextEncoderModel: closed")
        return dict(self.gguf.metadata)

    # -- checks of one call's input
    def _ids(self, ids: Any) -> np.ndarray:
        if isinstance(ids, np.ndarray):
            if ids.ndim != 1 or ids.dtype.kind not in "iu":
                raise TextEncoderInputError(f"ids must be a 1-D array of integers, got "
                                            f"{ids.dtype} of shape {list(ids.shape)}")
            a = ids.astype(np.int64)
        elif isinstance(ids, Sequence) and not isinstance(ids, (str, bytes)):
            for i, v in enumerate(ids):
                if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                    raise TextEncoderInputError(f"ids[{i}] = {v!r} is not an integer token id")
            a = np.array([int(v) if -2**62 < int(v) < 2**62 else -1 for v in ids],
                         dtype=np.int64)
        else:
            raise TextEncoderInputError(f"ids must be a sequence of token ids (ints), got "
                                        f"{type(ids).__name__}")
        if a.size == 0:
            raise TextEncoderInputError(
                "ids is empty: the encoder needs at least one token (the templated prompt "
                "always has the chat-template tokens)")
        V, ctx = self.config.vocab, self.config.context_length
        bad = np.flatnonzero((a < 0) | (a >= V))
        if bad.size:
            i = int(bad[0])
            raise TextEncoderInputError(f"ids[{i}] = {ids[i]!r} is outside the vocab [0, {V}) "
                                        f"({bad.size} ids out of range)")
        if a.size > ctx:
            raise TextEncoderInputError(f"{a.size} ids exceed the model's context length "
                                        f"{ctx}")
        return a.astype(np.int32)

    def session(self, L: int) -> _Session:
        """The engine serving ``L`` tokens: the current one if it is large enough, else a new
        one of ``max(L, max_tokens)`` tokens (the old one is closed first)."""
        if self.gguf is None:
            raise RuntimeError("TextEncoderModel: closed")
        s = self._session
        if s is not None and s.usable and L <= s.capacity:
            return s
        self._session = None
        if s is not None:
            s.close()
        self._session = _Session(self, max(L, self.max_tokens))
        return self._session

    # -- one call
    def encode_ids(self, ids: Sequence[int]) -> np.ndarray:
        """``hidden_states[-2]`` of ``ids`` (positions 0 .. L-1): float32 ``[L, dim]``, a fresh
        array. TextEncoderInputError for ids that do not fit the model (nothing runs)."""
        ids32 = self._ids(ids)
        prec = check_precision(self.precision, "TextEncoderModel.precision")
        if prec == "q8":          # float projections: their Q8_0 copies, or not (Q8Blocks)
            layers = self._q8_layers.get(self.kernels, check_q8_float_weights(
                self.q8_float_weights, "TextEncoderModel.q8_float_weights"), self.workers)
            if layers is not self.weights.layers:
                s, self._session = self._session, None     # its workers hold the old ones
                if s is not None:
                    s.close()
                self.weights = replace(self.weights, layers=layers)
        cfg, L = self.config, int(ids32.size)
        s = self.session(L)
        eng = s.engine
        x, pe = eng.buffer("x")[:L], eng.buffer("pe")[:L]
        now = time.perf_counter_ns
        t0 = now()

        # 1. embedding: x[t] = token_embd[ids[t]] (rows of the stored matrix, decoded exactly)
        np.copyto(eng.buffer("ids")[:L], ids32)
        eng.run_task("embed", L, L)
        t1 = now()

        # 2. blocks 0 .. n_layers-2 on the residual stream, in place (stage table above)
        for i in range(cfg.layers_needed):
            eng.run_plan(s.plan, i, L, {"x": x, "pe": pe}, (self.eps, prec))
        t2 = now()

        # 3. hidden_states[-2]: the residual stream as it is -- no output_norm, no last block
        out = x.copy()
        self.last_timings = {"us_embed": (t1 - t0) // 1000, "us_layers": (t2 - t1) // 1000,
                             "us_total": (now() - t0) // 1000}
        return out

    __call__ = encode_ids

    # -- memory
    def memory(self) -> dict[str, float | None]:
        """MB: the mapped GGUF (``weights_mb``), the session's arena (``arena_mb``) and this
        process's peak resident set (``peak_rss_mb``, Linux VmHWM)."""
        s = self._session
        return memory_report(self.gguf.path.stat().st_size if self.gguf is not None else 0,
                             s.engine.arena.nbytes if s is not None and s.usable else None)

    # -- lifetime
    def close(self) -> None:
        """Stop the workers, release the arena and the map. Idempotent."""
        s, self._session = self._session, None
        try:
            if s is not None:
                s.close()
        finally:
            self._q8_layers = None
            self._drop_map()

    def __repr__(self) -> str:
        where = self.gguf.path if self.gguf is not None else "closed"
        return f"<TextEncoderModel {where}: {self.config.summary()}; {self.workers} workers>"

