"""The whole Z-Image denoiser on nxhpc's kernels: one transformer call, read like the paper.

Owns :class:`Denoiser` (``forward(latents, t, cap_feats)`` -> raw output, ``docs/denoiser.md``;
built from a GGUF path, the config inferred from the tensors by ``nxhpc.dit.config``; opening
by id or model directory is ``nxhpc.models.open_denoiser``), the model-level pieces around the
blocks -- the
timestep sinusoid, patchify/unpatchify, padding to 32 rows, the integer position ids of the
image and caption rows -- and the session that serves a token layout: ONE
:class:`~nxhpc.dit.plan.Engine` (one arena, one pool forked once) running the noise-refiner
plan on the image rows, the context-refiner plan on the caption rows, the main layers on the
joint rows, and the embedders and final layer as extra worker tasks.
Must not: compute model arithmetic in Python (every product, norm and nonlinearity of a call
runs in ``nxhpc._kernels``; Python only reshapes, pads with copies of the pad tokens and builds
the float64 RoPE table), copy a weight matrix, or import the float64 reference (it is the
independent check of this file).

Rows of one call (``u``, one arena buffer, nothing copied between stages)::

    u[0 : n_img]           image tokens (h, w) row-major      ids (Lp+1, h, w)
    u[n_img : Np]          x_pad_token rows                   ids (0, 0, 0)
    u[Np : Np+L]           caption rows                       ids (1+i, 0, 0)
    u[Np+L : Np+Lp]        cap_pad_token rows                 ids (1+i, 0, 0)

``Np``/``Lp``: ``n_img``/``L`` rounded up to a multiple of 32. The noise refiner runs in place
on ``u[:Np]``, the context refiner on ``u[Np:]``, the main layers on all of ``u`` (joint rows =
image rows then caption rows: no mask at batch 1, RoPE rides with each row), the final layer
on ``u[:n_img]``.

Parallel split (bands ``[i*m//n, (i+1)*m//n)``, every kernel band-invariant, so the output is
bit-identical for any worker count): the blocks as their stage table says; ``x_embed`` /
``cap_embed`` / ``final_norm`` / ``final_linear`` over rows (a row's matmul does not depend on
the rows beside it). The timestep MLP, the adaLN vectors and the final scale (``[D]``-sized)
run in the parent, also in C.

Caption rows across calls: the caption path (``cap_embed``, the pad rows, the context refiner)
depends on ``cap_feats`` alone -- no timestep, no latents -- so a session keeps the refined
caption rows ``u[Np:]`` of its last two captions (CFG's pair), each with a copy of the caption
it came from and the precision that ran it, and a call whose caption has the same bits at the
same precision copies them back instead of running that path again (a sampler's steps after
the first).
The noise refiner and the embedders never touch ``u[Np:]``, so the bits are those of a call
that ran it (``tests/test_denoiser.py``). ``Denoiser(reuse_caption=False)`` runs it every call.

Output: the raw model output in the diffusers convention (t = 1 - sigma, 0 = pure noise;
r ~ x0 - noise), NOT negated: diffusers' pipeline negates it before its scheduler.
"""
from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

import nxhpc
from nxhpc.dit.binding import LayerWeights, bind_gguf_layer, check_finite_weight
from nxhpc.dit.config import (DENOISER_TENSORS, STACKS, DenoiserConfig, file_norm_eps,
                              infer_config)
from nxhpc.nn.linear import (DEFAULT_PRECISION, DEFAULT_Q8_FLOAT_WEIGHTS, Q8Blocks,
                             check_precision, check_q8_float_weights)
from nxhpc.dit.plan import BlockPlan, Engine, check_eps
from nxhpc.dit.rope import position_ids, rope_table
from nxhpc.formats.closing import MapHolder
from nxhpc.formats.gguf_io import GGUFFile, ModelFileError, refuse_text_encoder
from nxhpc.formats.weights import WeightTensor
from nxhpc.nn.engine import EngineSession
from nxhpc.runtime.checks import (NonFiniteOutputError, check_bool, check_finite_output,
                                  check_float_array, check_workers)
from nxhpc.runtime import proc
from nxhpc.runtime.memory import memory_report
from nxhpc.runtime.workers import DEFAULT_SPAWN, SPAWN_MODES, check_timeout

__all__ = ["Denoiser", "DenoiserInputError", "DenoiserWeights", "NonFiniteOutputError",
           "TIMING_KEYS", "SEGMENTS", "patchify", "unpatchify",
           "timestep_sinusoid"]

#: The segments of one call, in order; ``Denoiser.last_timings`` has ``us_<segment>`` for each.
SEGMENTS = ("embed", "noise_refiner", "context_refiner", "layers", "final", "total")
TIMING_KEYS = tuple(f"us_{s}" for s in SEGMENTS)


class DenoiserInputError(ValueError):
    """A call's input (latents, t, cap_feats) does not fit the model; the message says how."""


# ------------------------------------------------------------------------------ the weights
@dataclass
class DenoiserWeights:
    """Every tensor of the model, bound once: matrices as stored (typed, zero-copy views of
    the map; never decoded), vectors float32. Shapes in torch order."""
    blocks: dict[tuple[str, int], LayerWeights]   # (stack, i) -> the block's weights
    x_emb: WeightTensor       # x_embedder.weight         [D, p*p*C]
    x_emb_b: np.ndarray       # x_embedder.bias           [D]
    t_mlp0: WeightTensor      # t_embedder.mlp.0.weight   [t_mid, t_freq]
    t_mlp0_b: np.ndarray      # t_embedder.mlp.0.bias     [t_mid]
    t_mlp2: WeightTensor      # t_embedder.mlp.2.weight   [adaln_in, t_mid]
    t_mlp2_b: np.ndarray      # t_embedder.mlp.2.bias     [adaln_in]
    cap_norm: np.ndarray      # cap_embedder.0.weight     [cap_dim]  (RMSNorm)
    cap_emb: WeightTensor     # cap_embedder.1.weight     [D, cap_dim]
    cap_emb_b: np.ndarray     # cap_embedder.1.bias       [D]
    x_pad: np.ndarray         # x_pad_token               [D]  (stored [1, D] or [D])
    cap_pad: np.ndarray       # cap_pad_token             [D]
    final_ada: WeightTensor   # final_layer.adaLN_modulation.1.weight  [D, adaln_in]
    final_ada_b: np.ndarray   # final_layer.adaLN_modulation.1.bias    [D]
    final_lin: WeightTensor   # final_layer.linear.weight [p*p*C, D]
    final_lin_b: np.ndarray   # final_layer.linear.bias   [p*p*C]

    #: field -> tensor name (canonical; DENOISER_TENSORS gives each one's role)
    FIELDS: ClassVar[dict[str, str]] = {
        "x_emb": "x_embedder.weight", "x_emb_b": "x_embedder.bias",
        "t_mlp0": "t_embedder.mlp.0.weight", "t_mlp0_b": "t_embedder.mlp.0.bias",
        "t_mlp2": "t_embedder.mlp.2.weight", "t_mlp2_b": "t_embedder.mlp.2.bias",
        "cap_norm": "cap_embedder.0.weight", "cap_emb": "cap_embedder.1.weight",
        "cap_emb_b": "cap_embedder.1.bias", "x_pad": "x_pad_token", "cap_pad": "cap_pad_token",
        "final_ada": "final_layer.adaLN_modulation.1.weight",
        "final_ada_b": "final_layer.adaLN_modulation.1.bias",
        "final_lin": "final_layer.linear.weight", "final_lin_b": "final_layer.linear.bias"}

    def matrices(self) -> dict[str, WeightTensor]:
        """Every non-block matrix by tensor name."""
        return {n: getattr(self, f) for f, n in self.FIELDS.items()
                if isinstance(getattr(self, f), WeightTensor)}


def _bind(g: GGUFFile, cfg: DenoiserConfig, kernels: Any) -> DenoiserWeights:
    """Bind every tensor of ``g``, whose table ``cfg`` was inferred from (so every tensor is
    present and shaped as the config says): types runnable, values finite. ModelFileError
    naming the tensor."""
    where = str(g.path)
    bc = cfg.block
    blocks: dict[tuple[str, int], LayerWeights] = {}
    for prefix in STACKS:
        for i in range(cfg.stacks[prefix]):
            blocks[(prefix, i)] = bind_gguf_layer(g, bc, i, prefix)
    have = kernels.weight_types()
    vals: dict[str, Any] = {}
    for field, name in DenoiserWeights.FIELDS.items():
        tname = g.type_name(name)
        if DENOISER_TENSORS[name] == "matrix":
            if tname not in have:
                raise ModelFileError(f"{where}: tensor {name!r} has type {tname}; nxhpc runs "
                                     f"{', '.join(have)} for this tensor")
            w = WeightTensor.from_gguf(g, name)
            check_finite_weight(w, f"{where}: tensor {name!r}")
            vals[field] = w
        else:
            try:
                v = np.array(g.load_f32(name), dtype=np.float32).reshape(-1)
            except ModelFileError as e:
                raise ModelFileError(f"{e} (tensor {name!r} is decoded to float32)") from None
            if not np.isfinite(v).all():
                raise ModelFileError(f"{where}: tensor {name!r} has NaN/Inf values")
            vals[field] = v
    return DenoiserWeights(blocks=blocks, **vals)


# ------------------------------------------------------------------------------ model pieces
def timestep_sinusoid(t: float, cfg: DenoiserConfig) -> np.ndarray:
    """``[cos(a) | sin(a)]``, ``a_k = t_scale * t * max_period^(-k/half)``, k < half =
    t_freq_dim/2: float32 ``[t_freq_dim]`` (angles and cos/sin in float64, then rounded)."""
    half = cfg.t_freq_dim // 2
    a = (cfg.t_scale * float(t)) * np.exp(-math.log(cfg.max_period)
                                          * np.arange(half, dtype=np.float64) / half)
    return np.concatenate([np.cos(a), np.sin(a)]).astype(np.float32)


def patchify(latents: np.ndarray, p: int, out: np.ndarray) -> np.ndarray:
    """``out[h*Wt + w, (ph*p + pw)*C + c] = latents[c, p*h + ph, p*w + pw]`` (patch tokens in
    row-major grid order, each patch flattened as (ph, pw, c))."""
    C, H, W = latents.shape
    grid = latents.reshape(C, H // p, p, W // p, p)          # [c, h, ph, w, pw]
    np.copyto(out.reshape(H // p, W // p, p, p, C), grid.transpose(1, 3, 2, 4, 0))
    return out


def unpatchify(y: np.ndarray, C: int, H: int, W: int, p: int) -> np.ndarray:
    """The inverse: ``out[c, p*h + ph, p*w + pw] = y[h*Wt + w, (ph*p + pw)*C + c]``."""
    tok = y.reshape(H // p, W // p, p, p, C)                 # [h, w, ph, pw, c]
    return np.ascontiguousarray(tok.transpose(4, 0, 2, 1, 3)).reshape(C, H, W)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


# ------------------------------------------------------------------------------ one layout
class _Tasks:
    """The non-block worker tasks of one token layout (registered before the fork: a worker
    reaches the weights through the inherited map and the buffers through its engine)."""

    def __init__(self, kernels: Any, w: DenoiserWeights, cfg: DenoiserConfig, n_img: int,
                 Np: int) -> None:
        self.k, self.w, self.cfg, self.n_img, self.Np = kernels, w, cfg, n_img, Np

    def table(self) -> dict:
        return {"x_embed": self.x_embed, "cap_embed": self.cap_embed,
                "final_norm": self.final_norm, "final_linear": self.final_linear}

    def x_embed(self, eng: Engine, lo: int, hi: int, arg: Any) -> None:
        """u[r] = patches[r] @ Wx^T + bx, image rows r in [lo, hi)."""
        w = self.w.x_emb
        self.k.matmul(eng.buffer("patches")[lo:hi], w.data, w.type_name,
                      eng.buffer("u")[lo:hi], bias=self.w.x_emb_b)

    def cap_embed(self, eng: Engine, lo: int, hi: int, arg: Any) -> None:
        """u[Np + r] = rmsnorm(cap[r], cap_embedder.0) @ Wc^T + bc, caption rows r in [lo, hi)."""
        h = eng.buffer("cap_h")
        self.k.rmsnorm(eng.buffer("cap_in"), self.w.cap_norm, h, self.cfg.norm_eps,
                       r0=lo, r1=hi)
        w = self.w.cap_emb
        self.k.matmul(h[lo:hi], w.data, w.type_name, eng.buffer("u")[self.Np + lo:self.Np + hi],
                      bias=self.w.cap_emb_b)

    def final_norm(self, eng: Engine, lo: int, hi: int, arg: Any) -> None:
        """u[r] = layernorm(u[r], eps 1e-6, no affine) * (1 + scale), image rows [lo, hi)."""
        y = eng.buffer("u")[:self.n_img]
        self.k.layernorm_mod(y, eng.buffer("final_mod"), y, self.cfg.final_eps, r0=lo, r1=hi)

    def final_linear(self, eng: Engine, lo: int, hi: int, arg: Any) -> None:
        """y[r] = u[r] @ Wf^T + bf, image rows r in [lo, hi)."""
        w = self.w.final_lin
        self.k.matmul(eng.buffer("u")[lo:hi], w.data, w.type_name, eng.buffer("y")[lo:hi],
                      bias=self.w.final_lin_b)


@dataclass(frozen=True)
class _Layout:
    """The token layout of latents ``[C, H, W]`` with ``L`` caption rows: the patch grid, the
    image and caption rows padded (``Np``, ``Lp``), the three stacks' plans, the engine's
    ``(plan, rows)`` needs and the call's own buffers."""
    grid: tuple[int, int]
    n_img: int
    Np: int
    Lp: int
    plans: dict[str, BlockPlan]
    needs: list[tuple[BlockPlan, int]]
    buffers: dict[str, tuple[int, ...]]


def _layout(cfg: DenoiserConfig, H: int, W: int, L: int) -> _Layout:
    p = cfg.patch
    grid = (H // p, W // p)
    n_img = grid[0] * grid[1]
    Np, Lp = _round_up(n_img, cfg.seq_multiple), _round_up(L, cfg.seq_multiple)
    T = Np + Lp
    plans = {s: BlockPlan(cfg.block, s) for s in STACKS}
    rows = {"noise_refiner": Np, "context_refiner": Lp, "layers": T}
    needs = [(plans[s], rows[s]) for s in STACKS if cfg.stacks[s]]
    D, hd, P = cfg.dim, cfg.head_dim, cfg.patch_dim
    buffers = {"u": (T, D), "pe": (T, hd // 2, 2, 2), "patches": (n_img, P),
               "cap_in": (Lp, cfg.cap_dim), "cap_h": (Lp, cfg.cap_dim), "final_mod": (D,),
               "y": (n_img, P)}
    return _Layout(grid, n_img, Np, Lp, plans, needs, buffers)


class _Session(EngineSession):
    """Everything one token layout ``(H, W, Lp)`` needs, built once and reused across calls:
    the engine (arena + pool), the three plans, the RoPE table (written into the arena). A
    caption of any length L that pads to ``Lp`` rows runs on it: the position ids, the rows
    every block runs and the arena depend on ``Lp`` alone (a call fills ``cap_in[:L]`` and
    the pad rows ``[L, Lp)``)."""

    def __init__(self, den: "Denoiser", H: int, W: int, L: int) -> None:
        cfg = den.config
        lay = _layout(cfg, H, W, L)
        self.grid, self.n_img, self.Np, self.Lp, self.plans = \
            lay.grid, lay.n_img, lay.Np, lay.Lp, lay.plans
        self.key = (H, W, self.Lp)
        # the refined caption rows u[Np:] of the last CAPTIONS_KEPT captions, newest last:
        # (key, caption copy, rows copy)
        self.captions: list[tuple[tuple, np.ndarray, np.ndarray]] = []
        needs, buffers = lay.needs, lay.buffers
        tasks = _Tasks(den.kernels, den.weights, cfg, self.n_img, self.Np)
        self.engine = Engine(needs, den.weights.blocks, buffers=buffers, workers=den.workers,
                             spawn=den.spawn, stage_timeout=den.stage_timeout,
                             tasks=tasks.table())
        try:
            ids = position_ids(self.Lp, (1, *self.grid), multiple=cfg.seq_multiple)
            pe = rope_table(np.concatenate([ids[self.Lp:], ids[:self.Lp]]), cfg.axes_dims,
                            cfg.rope_theta)
            np.copyto(self.engine.buffer("pe"), pe.astype(np.float32))
        except BaseException:
            self.engine.close()
            raise



def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """The two float32 arrays hold the same bits (+0.0 and -0.0 differ; no NaN reaches here)."""
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


# ------------------------------------------------------------------------------ the model
def _check_float(what: str, a: np.ndarray) -> None:
    if a.dtype.kind != "f":
        raise DenoiserInputError(f"{what} must be floating point (float32), got dtype {a.dtype}")


class Denoiser(MapHolder):
    """The Z-Image transformer from one GGUF: ``forward(latents, t, cap_feats)``.

    Weights are bound once (zero copy); a token layout ``(H, W, Lp)`` (Lp: the caption's
    length L rounded up to the model's multiple, 32) gets one engine -- one
    shared-memory arena and one pool of ``workers`` processes forked once -- reused by every
    call with that layout (a sampler's steps); the :attr:`MAX_LAYOUTS` most recently used
    layouts keep theirs (CFG's prompt and negative prompt), an older one is closed. Use as a
    context manager or call :meth:`close`. ``precision`` (``"f32"`` default, ``"bf16"``,
    ``"q8"``: ``nxhpc.nn.linear``; may be changed between calls) is the blocks' projection
    matmul precision (the attention follows it); embedders, final layer, norms, RoPE, adaLN
    stay float32. ``q8_float_weights`` (``"int8"`` default, or ``"bf16"``: ``nxhpc.nn.linear``)
    is how ``q8`` runs the blocks' F32/F16/BF16 projections (the refiners of ComfyUI-layout
    files, every block of a float file): on Q8_0 copies made once, in the parent, at the first
    ``q8`` call (+1.0625 bytes per value, kept until :meth:`close`), or on the stored values in
    ``bf16``; settable between calls. ``reuse_caption`` (default True; settable): a call whose
    ``cap_feats`` has the bits of one of the last :attr:`CAPTIONS_KEPT` captions run with this
    layout, at the same precision, reuses that call's refined caption rows instead of running
    the caption embedder and the context refiner again (they do not depend on ``t`` or the
    latents; the output bits are the same); ``last_caption_reused`` says whether the last call
    did.
    ``last_timings``: microseconds of the last call per segment (``us_embed``,
    ``us_noise_refiner``, ``us_context_refiner``, ``us_layers``, ``us_final``, ``us_total``);
    ``last_stage_timings``: per block segment (``noise_refiner``, ``context_refiner``,
    ``layers``) the block timing keys of :mod:`nxhpc.dit.plan` (``us_prenorm_qkv`` ..
    ``block_us``) summed over its blocks, and ``rows``, the tokens each of its blocks ran.
    """

    # settable between calls, each checked when it is set (a bad value was taken and failed
    # only at the next call)
    @property
    def precision(self) -> str:
        """The blocks' projection matmul precision (``f32``, ``bf16``, ``q8``)."""
        return self._precision

    @precision.setter
    def precision(self, value: str) -> None:
        self._precision = check_precision(value, "Denoiser.precision")

    @property
    def q8_float_weights(self) -> str:
        """How ``q8`` runs float projections (``int8`` copies or ``bf16``)."""
        return self._q8_float_weights

    @q8_float_weights.setter
    def q8_float_weights(self, value: str) -> None:
        self._q8_float_weights = check_q8_float_weights(value, "Denoiser.q8_float_weights")

    @property
    def reuse_caption(self) -> bool:
        """Whether a call reuses a recent caption's refined rows (same bits)."""
        return self._reuse_caption

    @reuse_caption.setter
    def reuse_caption(self, value: bool) -> None:
        self._reuse_caption = check_bool(value, "Denoiser.reuse_caption")

    def __init__(self, gguf_path: str | os.PathLike, *, workers: int | None = None,
                 directory: str | os.PathLike | None = None, spawn: str = DEFAULT_SPAWN,
                 stage_timeout: float | None = None, norm_eps: float | None = None,
                 precision: str = DEFAULT_PRECISION,
                 q8_float_weights: str = DEFAULT_Q8_FLOAT_WEIGHTS,
                 reuse_caption: bool = True) -> None:
        self.workers = check_workers(workers, "Denoiser: workers")   # the one rule
        self.reuse_caption = reuse_caption           # each checked by its setter
        self.last_caption_reused = False
        self.precision = precision
        self.q8_float_weights = q8_float_weights
        if spawn is None:
            spawn = DEFAULT_SPAWN
        if spawn not in SPAWN_MODES:                 # refused here, not at the first call
            raise ValueError(f"Denoiser: spawn must be one of {SPAWN_MODES}, got {spawn!r}")
        self.spawn = spawn
        self.stage_timeout = check_timeout(stage_timeout)
        if norm_eps is not None:                     # the caller's, checked as the caller's
            try:
                norm_eps = check_eps(norm_eps)
            except (TypeError, ValueError) as e:
                raise ValueError(f"Denoiser: norm_eps: {e}") from None
        self.directory = Path(directory) if directory is not None else None
        # the most recent token layouts' engines, newest last: classifier-free guidance
        # alternates two captions, whose padded lengths may differ, and each layout must keep
        # its workers and arena
        self._sessions: list[_Session] = []
        self.last_timings: dict[str, int] = {}
        self.last_stage_timings: dict[str, dict[str, int]] = {}
        # one call at a time: forward fills arena buffers, then issues many engine calls, and
        # session() replaces engines; a second thread must wait (a web server's pipeline)
        self._lock = threading.RLock()
        self._owner = os.getpid()
        self.kernels = nxhpc.kernels()
        self.gguf = GGUFFile(gguf_path)
        try:
            g = self.gguf
            if norm_eps is None:      # the file's (checked), else the default
                norm_eps = file_norm_eps(g.metadata, str(g.path))
            refuse_text_encoder(g, "a Z-Image denoiser")
            table = {n: (g.shape(n), g.type_name(n)) for n in g.names()}
            self.config, _ = infer_config(table, str(g.path), norm_eps, whole=True)
            self.weights = _bind(g, self.config, self.kernels)
            self._q8_blocks = Q8Blocks(self.weights.blocks, LayerWeights.PROJECTIONS)
        except BaseException:
            self.gguf.close()
            raise

    # -- checks of one call's inputs
    def _latents(self, latents: Any) -> tuple[np.ndarray, tuple[int, ...]]:
        cfg = self.config
        a = np.asarray(latents)
        C, p = cfg.in_channels, cfg.patch
        _check_float("latents", a)
        shape = a.shape
        if a.ndim == 4 and a.shape[1] == 1:
            a = a[:, 0]
        if a.ndim != 3 or a.shape[0] != C:
            raise DenoiserInputError(f"latents must be [{C}, H, W] or [{C}, 1, H, W], got "
                                     f"shape {list(shape)}")
        H, W = a.shape[1:]
        if H < p or W < p or H % p or W % p:
            raise DenoiserInputError(f"latents are [{C}, {H}, {W}]: H and W must be positive "
                                     f"multiples of the patch size {p} (even)")
        return check_float_array(a, "latents", error=DenoiserInputError), shape

    def _caption(self, cap_feats: Any) -> np.ndarray:
        d = self.config.cap_dim
        a = np.asarray(cap_feats)
        _check_float("cap_feats", a)
        if a.ndim != 2 or a.shape[1] != d or a.shape[0] < 1:
            raise DenoiserInputError(f"cap_feats must be [L >= 1, {d}] (the model's cap_dim "
                                     f"is {d}), got shape {list(a.shape)}")
        return check_float_array(a, "cap_feats", error=DenoiserInputError)

    @staticmethod
    def _timestep(t: Any) -> float:
        if t is None or isinstance(t, (bool, np.bool_, str, bytes)) or \
                (isinstance(t, np.ndarray) and t.dtype.kind not in "iuf"):
            raise DenoiserInputError(f"t must be a number in [0, 1], got {t!r}")
        try:
            v = float(np.asarray(t, dtype=np.float64).reshape(()))
        except (TypeError, ValueError):
            raise DenoiserInputError(f"t must be a number in [0, 1], got {t!r}") from None
        if not (math.isfinite(v) and 0.0 <= v <= 1.0):
            raise DenoiserInputError(f"t must be in [0, 1] (t = 1 - sigma; 0 is pure noise), "
                                     f"got {v}")
        return v

    #: How many token layouts keep their engine (workers + arena): two serve CFG's pair.
    MAX_LAYOUTS = 2
    #: How many captions' refined rows each layout keeps: two serve CFG's pair when the prompt
    #: and the negative prompt pad to the same length (one layout, captions alternating).
    CAPTIONS_KEPT = 2

    @property
    def _session(self) -> _Session | None:
        """The most recently used layout's engine (None before the first call)."""
        return self._sessions[-1] if self._sessions else None

    def _check_owner(self, what: str) -> None:
        """Refuse use from a forked child before any lock or buffer is touched: the arena and
        the workers are the parent's (a lock held by a parent thread at the fork would never
        be released in the child)."""
        proc.check_owner(self._owner, f"Denoiser.{what}", "Denoiser")

    def session(self, H: int, W: int, L: int) -> _Session:
        """The engine serving latents ``[C, H, W]`` with ``L`` caption rows: one per ``(H, W,
        Lp)``, ``Lp`` = L rounded up to the model's multiple (32), so captions of 20 and 30
        tokens share one; built on first use; the :attr:`MAX_LAYOUTS` most recently used
        layouts are kept, older ones closed."""
        self._check_owner("session")
        p = self.config.patch
        for name, v, least in (("H", H, p), ("W", W, p), ("L", L, 1)):
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) \
                    or v < least or (name != "L" and v % p):
                want = f"a positive multiple of the patch size {p}" if name != "L" else \
                    "an int >= 1"
                raise DenoiserInputError(f"Denoiser.session: {name} must be {want}, got {v!r}")
        with self._lock:
            return self._session_for(int(H), int(W), int(L))

    def _session_for(self, H: int, W: int, L: int) -> _Session:
        if self.gguf is None:
            raise RuntimeError("Denoiser: closed")
        key = (H, W, _round_up(L, self.config.seq_multiple))
        for s in self._sessions:
            if s.key == key and s.usable:
                self._sessions.remove(s)
                self._sessions.append(s)
                return s
        keep = [s for s in self._sessions if s.usable][-(self.MAX_LAYOUTS - 1):]
        drop = [s for s in self._sessions if s not in keep]
        self._sessions = keep
        for s in drop:
            s.close()
        s = _Session(self, H, W, L)
        self._sessions.append(s)
        return s

    def _q8_weights(self) -> None:
        """Before a ``q8`` call: the blocks' float projections carry their Q8_0 copies under
        ``q8_float_weights="int8"`` (made once, kept until :meth:`close`) and carry none under
        ``"bf16"``. When that changes the weights, the engines forked before are closed (their
        workers hold the old ones) and rebuilt on demand."""
        choice = check_q8_float_weights(self.q8_float_weights, "Denoiser.q8_float_weights")
        blocks = self._q8_blocks.get(self.kernels, choice, threads=self.workers)
        if blocks is not self.weights.blocks:
            sessions, self._sessions = self._sessions, []
            for s in sessions:
                s.close()
            self.weights = replace(self.weights, blocks=blocks)

    # -- one call
    def forward(self, latents: Any, t: float, cap_feats: Any) -> np.ndarray:
        """One transformer call: latents ``[C, H, W]`` (or ``[C, 1, H, W]``) float32, ``t`` in
        [0, 1] (t = 1 - sigma), cap_feats ``[L, cap_dim]`` float32 -> the raw output, float32,
        the input's shape (diffusers convention: not negated). DenoiserInputError for inputs
        that do not fit the model (nothing runs); NonFiniteOutputError
        (``nxhpc.runtime.checks``: ``count``, ``size``, ``output``) when finite inputs give a
        NaN/inf output (an overflow inside the model), never the NaN array itself.
        Thread-safe: calls from several threads are serialized (one runs at a time)."""
        self._check_owner("forward")
        with self._lock:
            return self._forward(latents, t, cap_feats)

    def _forward(self, latents: Any, t: float, cap_feats: Any) -> np.ndarray:
        if self.gguf is None:                # before the q8 copies look at the weights
            raise RuntimeError("Denoiser: closed")
        self.last_caption_reused = False
        lat, in_shape = self._latents(latents)
        cap = self._caption(cap_feats)
        t = self._timestep(t)
        prec = check_precision(self.precision, "Denoiser.precision")
        keep_caption = check_bool(self.reuse_caption, "Denoiser.reuse_caption")  # settable
        if prec == "q8":
            self._q8_weights()
        cfg, w, k = self.config, self.weights, self.kernels
        C, H, W = lat.shape
        L = cap.shape[0]
        s = self._session_for(H, W, L)
        eng = s.engine
        n_img, Np = s.n_img, s.Np
        u, pe = eng.buffer("u"), eng.buffer("pe")
        now = time.perf_counter_ns
        marks = [now()]
        stage_us: dict[str, dict[str, int]] = {}

        def block(seg: str, tm: dict[str, int], rows: int) -> None:
            acc = stage_us.setdefault(seg, {"rows": rows})
            for key, us in tm.items():
                acc[key] = acc.get(key, 0) + us

        # 1. embedders: t -> temb (parent, C); patches -> X; caption -> Cp; pads; adaLN vectors
        temb = self._t_embed(t)
        patchify(lat, cfg.patch, eng.buffer("patches"))
        eng.run_task("x_embed", n_img)
        u[n_img:Np] = w.x_pad
        # the caption path depends on the caption alone: the last call's refined rows serve a
        # caption with the same bits at the same precision (the refiners' weights follow it)
        cap_key = (prec, self.q8_float_weights if prec == "q8" else None)
        kept = next((c for c in s.captions if c[0] == cap_key and _same_bits(c[1], cap)),
                    None) if keep_caption else None
        reuse = kept is not None
        if not reuse:
            np.copyto(eng.buffer("cap_in")[:L], cap)
            eng.run_task("cap_embed", L)
            u[Np + L:] = w.cap_pad
        mods = {key: eng.adaln(key, temb) for key, lw in w.blocks.items() if lw.modulated}
        marks.append(now())

        # 2. noise refiner: modulated blocks on the image rows (pads included)
        for i in range(cfg.n_noise_refiner):
            block("noise_refiner", eng.run(s.plans["noise_refiner"], ("noise_refiner", i),
                                           u[:Np], pe[:Np], adaln_m=mods[("noise_refiner", i)],
                                           precision=prec), Np)
        marks.append(now())

        # 3. context refiner: unmodulated blocks on the caption rows (or the kept rows back)
        if reuse:
            np.copyto(u[Np:], kept[2])
        else:
            for i in range(cfg.n_context_refiner):
                block("context_refiner", eng.run(s.plans["context_refiner"],
                                                 ("context_refiner", i), u[Np:], pe[Np:],
                                                 precision=prec), u.shape[0] - Np)
            if keep_caption:
                s.captions = s.captions[-(self.CAPTIONS_KEPT - 1):] + [
                    (cap_key, cap.copy(), u[Np:].copy())]
        self.last_caption_reused = reuse
        marks.append(now())

        # 4. main layers on the joint rows (image rows, then caption rows)
        for i in range(cfg.n_layers):
            block("layers", eng.run(s.plans["layers"], ("layers", i), u, pe,
                                    adaln_m=mods[("layers", i)], precision=prec), u.shape[0])
        marks.append(now())

        # 5. final layer on the image tokens: layernorm * (1 + Linear(silu(temb))), Linear
        mod = eng.buffer("final_mod")
        k.adaln_linear(temb, w.final_ada.data, w.final_ada.type_name, w.final_ada_b, mod,
                       silu_input=True)
        np.add(np.float32(1.0), mod, out=mod)
        eng.run_task("final_norm", n_img)
        eng.run_task("final_linear", n_img)
        out = unpatchify(eng.buffer("y"), C, H, W, cfg.patch)
        marks.append(now())

        spent = [(b - a) // 1000 for a, b in zip(marks, marks[1:])]
        self.last_timings = dict(zip(TIMING_KEYS, spent + [(marks[-1] - marks[0]) // 1000]))
        self.last_stage_timings = stage_us
        return check_finite_output(   # an overflow inside: never a silent NaN image
            out.reshape(in_shape), "Denoiser.forward",
            f"finite inputs overflowed float32 inside the model; max |latents| "
            f"{float(np.abs(lat).max()):.3g}, max |cap_feats| {float(np.abs(cap).max()):.3g}")

    __call__ = forward

    def _t_embed(self, t: float) -> np.ndarray:
        """temb = mlp.2(silu(mlp.0(sinusoid(t)))), no SiLU after: float32 [adaln_in]."""
        cfg, w, k = self.config, self.weights, self.kernels
        h = np.empty(cfg.t_mid_dim, dtype=np.float32)
        k.adaln_linear(timestep_sinusoid(t, cfg), w.t_mlp0.data, w.t_mlp0.type_name,
                       w.t_mlp0_b, h, silu_input=False)
        temb = np.empty(cfg.adaln_in, dtype=np.float32)
        k.adaln_linear(h, w.t_mlp2.data, w.t_mlp2.type_name, w.t_mlp2_b, temb, silu_input=True)
        return temb

    # -- memory
    def arena_bytes(self, H: int, W: int, L: int = 512) -> int:
        """The bytes of the shared-memory arena a call on latents ``[C, H, W]`` with ``L``
        caption rows reserves (default: the text encoder's most), without building it."""
        from nxhpc.nn.engine import arena_layout
        from nxhpc.runtime.checks import check_count
        from nxhpc.runtime.shm import arena_bytes
        lay = _layout(self.config, check_count(H, "H"), check_count(W, "W"), check_count(L, "L"))
        return arena_bytes(arena_layout(lay.needs, lay.buffers)[0])

    def check_room(self, H: int, W: int, L: int = 512, *, copies: int = 1) -> int:
        """Raise now the :class:`~nxhpc.runtime.shm.ShmSpaceError` the arena of latents
        ``[C, H, W]`` would meet (``copies`` denoisers on this host at once), e.g. before a
        long text encoding; returns the bytes. Nothing is reserved."""
        from nxhpc.runtime.checks import check_count
        from nxhpc.runtime.shm import check_room
        copies = check_count(copies, "copies")
        need = self.arena_bytes(H, W, L)
        check_room(need, f"the denoiser's arena at {H}x{W} latents"
                   + (f" ({copies} at once on this host)" if copies > 1 else ""),
                   copies=copies)
        return need * copies

    def memory(self) -> dict[str, float | None]:
        """MB: the mapped GGUF (``weights_mb``), the current layout's arena (``arena_mb``), the
        peak resident set of this process (``peak_rss_mb``, Linux VmHWM: mapped weight pages
        touched + arena + Python) and the largest of the workers' (``worker_peak_rss_mb``;
        None without forked workers). Shared pages count in every process that touches them."""
        s = self._session
        pids = [p for p in (s.engine.pool.pids if s is not None and s.usable else []) if p > 0]
        return memory_report(self.gguf.path.stat().st_size if self.gguf is not None else 0,
                             s.engine.arena.nbytes if s is not None else None, pids)

    # -- lifetime
    def close(self) -> None:
        """Stop the workers, release the arena and the map: the GGUFFile and every weight view
        of it are dropped, so the file is unmapped here, not when the object is collected.
        Idempotent; waits for a call running in another thread."""
        if os.getpid() != self._owner:       # a forked child: the parent's to close
            return
        with self._lock:
            self._close()

    def _close(self) -> None:
        sessions, self._sessions = self._sessions, []
        try:
            for s in sessions:
                s.close()
        finally:
            self.weights = None               # views of the map (zero-copy weights)
            self._q8_blocks = None
            self._drop_map()

    def __repr__(self) -> str:
        where = (self.directory or self.gguf.path) if self.gguf is not None else \
            f"{self.directory} (closed)" if self.directory is not None else "closed"
        return f"<Denoiser {where}: {self.config.summary()}; {self.workers} workers>"

