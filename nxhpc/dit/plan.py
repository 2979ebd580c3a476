"""The block as data (:class:`BlockPlan`, a stage table) and the :class:`Engine` that runs plans.

Owns: the stage table :data:`STAGES` -- the order of a block's parallel stages, how each one is
split over workers (its extent), which timing key it is charged to, and the task each worker
runs on its band -- and from it the timing keys and the table below; the per-call modulation
(adaLN ``m`` -> ``1 + scale`` and the gates, or none); the :class:`Engine`, which sizes ONE
:class:`~nxhpc.runtime.shm.SharedArena` for every ``(plan, tokens)`` it is told it will run,
forks ONE :class:`~nxhpc.runtime.workers.WorkerPool` after all weights are bound, and runs any
of those plans on views of its buffers (workers find buffers by name and row range).
Must not: parse files, compute anything in Python beyond O(D) modulation bookkeeping, or run
BLAS/OpenMP in workers (only ``nxhpc._kernels`` runs there).

Stage table (generated from :data:`STAGES`; ``tests/test_plan.py`` keeps it in sync)::

    stage        split over         timer           task
    norm1        token rows         us_prenorm_qkv  h = rmsnorm(x, attention_norm1) * (1+scale_msa)
    qkv          qkv columns        us_prenorm_qkv  qkv = h @ Wqkv^T
    qknorm_rope  q+k heads          us_qknorm_rope  q, k = rope(rmsnorm_hd(q|k)) as [H, T, hd] / [KVH, T, hd]
    sdpa         query heads        us_sdpa         attn = softmax(q k^T / sqrt(hd) [+ mask]) v
    out_proj     dim columns        us_attn_tail    atto = attn @ Wout^T
    attn_tail    token rows         us_attn_tail    mid = x + tanh(gate_msa) * rmsnorm(atto, attention_norm2)
    ffn_norm     token rows         us_ffn          h = rmsnorm(mid, ffn_norm1) * (1+scale_mlp)
    w13          ffn columns        us_ffn          f1 = h @ W1^T; f3 = h @ W3^T
    swiglu       ffn elements       us_ffn          f1 = silu(f1) * f3
    w2           dim columns        us_ffn          f2 = f1 @ W2^T
    ffn_tail     token rows         us_ffn          out = mid + tanh(gate_mlp) * rmsnorm(f2, ffn_norm2)

``block_us`` is the whole block (adaLN excluded: it is O(D) and computed before). Splits are
always ``[i*m//n, (i+1)*m//n)``; every kernel gives bit-identical results for any band split,
so the output is bit-identical for every worker count and both spawn modes.

Modulation. A modulated plan (``layers``, ``noise_refiner``) takes ``m = adaLN(t_emb)``,
``[scale_msa | gate_msa | scale_mlp | gate_mlp]``. An unmodulated plan (``context_refiner``)
runs the same stages with scale = 0 (the rmsnorm gets no ``mod``: multiplier 1) and gate
multiplier 1 without tanh: ``x += rmsnorm(attn(rmsnorm(x, n1)), n2)``. The gated-residual
kernel computes ``resid + tanh(g) * y``; the gate buffer of an unmodulated plan holds
:data:`UNIT_GATE`, whose float32 tanh is exactly 1.0 in every kernel variant (tanh(20) =
1 - 8.5e-18 rounds to 1; pinned by a test), so the stage is exactly ``resid + y``.

Memory. Scratch buffers are flat, sized for the largest ``(plan, T)`` need, and viewed with the
shape of the T being run; normalized outputs overwrite their inputs where the kernels allow it
(``rmsnorm`` of ``atto`` / ``f2`` and ``swiglu`` into ``f1`` in place; ``h`` is reused for
``h2``): per token ``6*D + KVH*hd + qkv_width + 2*F`` scratch floats (x, out and pe are the
caller's buffers).
"""
from __future__ import annotations

import functools
import math
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

import nxhpc
from nxhpc.dit.binding import LayerWeights
from nxhpc.dit.config import BLOCK_STACKS, BlockConfig, block_label, block_view
from nxhpc.nn.linear import (DEFAULT_PRECISION, adaln_linear, check_precision, check_runnable,
                              matmul)
from nxhpc.runtime.shm import SharedArena
from nxhpc.runtime.workers import DEFAULT_SPAWN, SPAWN_MODES, WorkerPool, check_timeout

__all__ = ["Stage", "STAGES", "EXTENTS", "TIMING_KEYS", "UNIT_GATE", "BlockPlan", "Engine",
           "stage_table", "check_eps", "narrow_finite", "EPS_RANGE"]

#: A gate value whose tanh rounds to exactly 1.0f (see the module docstring).
UNIT_GATE = 20.0


class RunContext:
    """What a stage's task reads in a worker: kernels, config, weights, views, eps."""
    __slots__ = ("kernels", "cfg", "w", "eps", "x", "pe", "out", "mask", "buf", "mod_msa",
                 "mod_mlp", "gate_msa", "gate_mlp", "scale", "precision")

    def __init__(self, **kw: Any) -> None:
        for k, v in kw.items():
            setattr(self, k, v)


# ------------------------------------------------------------------------------ stage tasks
# task(c, lo, hi): one band [lo, hi) of the stage's extent, in a worker.
def _norm1(c: RunContext, lo: int, hi: int) -> None:
    c.kernels.rmsnorm(c.x, c.w.attention_norm1, c.buf["h"], c.eps, mod=c.mod_msa, r0=lo, r1=hi)


def _qkv(c: RunContext, lo: int, hi: int) -> None:
    matmul(c.kernels, c.buf["h"], c.w.qkv, c.buf["qkv"], lo, hi, c.precision)


def _qknorm_rope(c: RunContext, lo: int, hi: int) -> None:
    c.kernels.qknorm_rope(c.buf["qkv"], c.w.q_norm, c.w.k_norm, c.pe, c.buf["q"], c.buf["k"],
                          c.cfg.n_heads, c.cfg.n_kv_heads, c.eps, h0=lo, h1=hi)


def _sdpa(c: RunContext, lo: int, hi: int) -> None:
    c.kernels.attention(c.buf["q"], c.buf["k"], c.buf["qkv"], c.buf["attn"], c.cfg.n_kv_heads,
                        c.scale, mask=c.mask, h0=lo, h1=hi)


def _out_proj(c: RunContext, lo: int, hi: int) -> None:
    matmul(c.kernels, c.buf["attn"], c.w.out, c.buf["atto"], lo, hi, c.precision)


def _attn_tail(c: RunContext, lo: int, hi: int) -> None:
    atto = c.buf["atto"]
    c.kernels.rmsnorm(atto, c.w.attention_norm2, atto, c.eps, r0=lo, r1=hi)
    c.kernels.gated_residual(c.x, atto, c.gate_msa, c.buf["mid"], r0=lo, r1=hi)


def _ffn_norm(c: RunContext, lo: int, hi: int) -> None:
    c.kernels.rmsnorm(c.buf["mid"], c.w.ffn_norm1, c.buf["h"], c.eps, mod=c.mod_mlp, r0=lo,
                      r1=hi)


def _w13(c: RunContext, lo: int, hi: int) -> None:
    matmul(c.kernels, c.buf["h"], c.w.w1, c.buf["f1"], lo, hi, c.precision)
    matmul(c.kernels, c.buf["h"], c.w.w3, c.buf["f3"], lo, hi, c.precision)


def _swiglu(c: RunContext, lo: int, hi: int) -> None:
    f1 = c.buf["f1"]
    c.kernels.swiglu(f1, c.buf["f3"], f1, i0=lo, i1=hi)


def _w2(c: RunContext, lo: int, hi: int) -> None:
    matmul(c.kernels, c.buf["f1"], c.w.w2, c.buf["f2"], lo, hi, c.precision)


def _ffn_tail(c: RunContext, lo: int, hi: int) -> None:
    f2 = c.buf["f2"]
    c.kernels.rmsnorm(f2, c.w.ffn_norm2, f2, c.eps, r0=lo, r1=hi)
    c.kernels.gated_residual(c.buf["mid"], f2, c.gate_mlp, c.out, r0=lo, r1=hi)


# ------------------------------------------------------------------------------ the table
#: extent name -> (description, m(cfg, T)): the range [0, m) a stage splits over workers
EXTENTS: dict[str, tuple[str, Callable[[BlockConfig, int], int]]] = {
    "rows": ("token rows", lambda cfg, T: T),
    "qkv_cols": ("qkv columns", lambda cfg, T: cfg.qkv_width),
    "qk_heads": ("q+k heads", lambda cfg, T: cfg.n_heads + cfg.n_kv_heads),
    "query_heads": ("query heads", lambda cfg, T: cfg.n_heads),
    "dim_cols": ("dim columns", lambda cfg, T: cfg.dim),
    "ffn_cols": ("ffn columns", lambda cfg, T: cfg.ffn_dim),
    "ffn_elems": ("ffn elements", lambda cfg, T: T * cfg.ffn_dim),
}


class Stage(NamedTuple):
    """One parallel stage: ``name`` (worker task and error label), ``extent`` (a key of
    :data:`EXTENTS`), ``timer`` (timing key), ``task(ctx, lo, hi)``, ``doc`` (its formula)."""
    name: str
    extent: str
    timer: str
    task: Callable[[RunContext, int, int], None]
    doc: str


STAGES: tuple[Stage, ...] = (
    Stage("norm1", "rows", "us_prenorm_qkv", _norm1,
          "h = rmsnorm(x, attention_norm1) * (1+scale_msa)"),
    Stage("qkv", "qkv_cols", "us_prenorm_qkv", _qkv, "qkv = h @ Wqkv^T"),
    Stage("qknorm_rope", "qk_heads", "us_qknorm_rope", _qknorm_rope,
          "q, k = rope(rmsnorm_hd(q|k)) as [H, T, hd] / [KVH, T, hd]"),
    Stage("sdpa", "query_heads", "us_sdpa", _sdpa,
          "attn = softmax(q k^T / sqrt(hd) [+ mask]) v"),
    Stage("out_proj", "dim_cols", "us_attn_tail", _out_proj, "atto = attn @ Wout^T"),
    Stage("attn_tail", "rows", "us_attn_tail", _attn_tail,
          "mid = x + tanh(gate_msa) * rmsnorm(atto, attention_norm2)"),
    Stage("ffn_norm", "rows", "us_ffn", _ffn_norm, "h = rmsnorm(mid, ffn_norm1) * (1+scale_mlp)"),
    Stage("w13", "ffn_cols", "us_ffn", _w13, "f1 = h @ W1^T; f3 = h @ W3^T"),
    Stage("swiglu", "ffn_elems", "us_ffn", _swiglu, "f1 = silu(f1) * f3"),
    Stage("w2", "dim_cols", "us_ffn", _w2, "f2 = f1 @ W2^T"),
    Stage("ffn_tail", "rows", "us_ffn", _ffn_tail,
          "out = mid + tanh(gate_mlp) * rmsnorm(f2, ffn_norm2)"),
)


def _timing_keys(stages: Iterable[Stage]) -> tuple[str, ...]:
    keys: list[str] = []
    for s in stages:
        if s.timer not in keys:
            keys.append(s.timer)
    return tuple(keys) + ("block_us",)


#: Timing keys of a block run, in stage order, then ``block_us`` (the whole block).
TIMING_KEYS = _timing_keys(STAGES)


def stage_table(stages: Iterable[Stage] = STAGES) -> str:
    """The stage table as the module docstring shows it."""
    rows = [("stage", "split over", "timer", "task")]
    rows += [(s.name, EXTENTS[s.extent][0], s.timer, s.doc) for s in stages]
    return "\n".join(f"{a:<12} {b:<18} {c:<15} {d}".rstrip() for a, b, c, d in rows)


def _scratch(cfg: BlockConfig, T: int) -> dict[str, tuple[int, ...]]:
    """Scratch buffer shapes of one block run at ``T`` tokens."""
    D, H, KVH, hd, F = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim
    return {"h": (T, D), "qkv": (T, cfg.qkv_width), "q": (H, T, hd), "k": (KVH, T, hd),
            "attn": (T, H * hd), "atto": (T, D), "mid": (T, D), "f1": (T, F), "f3": (T, F),
            "f2": (T, D)}


# ------------------------------------------------------------------------------ the plan
@dataclass(frozen=True)
class BlockPlan:
    """One kind of block as data: its config, stack ``prefix``, ``modulated`` flag and stages.

    ``config``: a :class:`BlockConfig` (a model's :class:`~nxhpc.dit.config.DenoiserConfig` is
    taken as its block view). ``modulated`` defaults to the stack's kind (``context_refiner``: False). The plan holds no
    memory and no processes: an :class:`Engine` runs it at any token count it was sized for.
    """
    config: BlockConfig
    prefix: str = "layers"
    modulated: bool | None = None
    stages: tuple[Stage, ...] = field(default=STAGES, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "config", block_view(self.config))
        self.config.validate()
        if self.modulated is None:
            if self.prefix not in BLOCK_STACKS:
                raise ValueError(f"BlockPlan: unknown stack prefix {self.prefix!r} (known: "
                                 f"{', '.join(BLOCK_STACKS)}); pass modulated= explicitly")
            object.__setattr__(self, "modulated", BLOCK_STACKS[self.prefix])
        for s in self.stages:
            if s.extent not in EXTENTS:
                raise ValueError(f"BlockPlan: stage {s.name!r} has unknown extent {s.extent!r}")

    @property
    def timing_keys(self) -> tuple[str, ...]:
        return _timing_keys(self.stages)

    def extent(self, stage: Stage, T: int) -> int:
        """The ``m`` of ``stage`` at ``T`` tokens (its band range is ``[0, m)``)."""
        return EXTENTS[stage.extent][1](self.config, T)

    def scratch(self, T: int) -> dict[str, tuple[int, ...]]:
        """Scratch buffer shapes for a run at ``T`` tokens."""
        return _scratch(self.config, T)

    def tensor_names(self, index: int, *, model_prefix: bool = False) -> dict[str, str]:
        """Short name -> tensor name of block ``prefix.index`` of this kind."""
        return self.config.tensor_names(index, self.prefix, modulated=self.modulated,
                                        model_prefix=model_prefix)


# ------------------------------------------------------------------------------ the engine
class BufRef(NamedTuple):
    """Rows ``[r0, r1)`` of arena buffer ``name`` (how a view travels to the workers)."""
    name: str
    r0: int
    r1: int


class RunArgs(NamedTuple):
    """What every stage of one run needs to find its inputs (by name, in any process)."""
    weights: Hashable
    tokens: int
    modulated: bool
    eps: float
    precision: str
    x: BufRef
    pe: BufRef
    out: BufRef
    mask: BufRef | None

    def wire(self) -> tuple:
        """Plain nested tuples, what crosses the pipe to the workers: measured 1.8 us to pickle
        and unpickle against 15.5 us for the NamedTuples (once per worker per stage)."""
        return self[:5] + tuple(None if r is None else tuple(r) for r in self[5:])

    @classmethod
    def from_wire(cls, t: tuple) -> "RunArgs":
        return cls(*t[:5], *(None if r is None else BufRef(*r) for r in t[5:]))


def narrow_finite(name: str, a: np.ndarray) -> np.ndarray:
    """``a`` as C-contiguous float32, checked finite *after* narrowing (a float64 1e300 passes
    a float64 check and becomes inf); ValueError naming ``name``, the count and the first index."""
    with np.errstate(over="ignore"):
        a32 = np.ascontiguousarray(a, dtype=np.float32)
    fin = np.isfinite(a32)
    if not fin.all():
        bad = np.argwhere(~fin.reshape(a32.shape) if a32.ndim else ~fin.reshape(1))
        where = tuple(int(i) for i in bad[0])
        if np.isfinite(np.asarray(a)[where] if a32.ndim else a):
            why = (f"beyond float32's range |v| <= {float(np.finfo(np.float32).max):.4g}: "
                   f"finite as {a.dtype}, inf once narrowed to float32, the kernels' type")
        else:
            why = "NaN/inf"
        raise ValueError(f"{name} has {len(bad)} non-finite values ({why}), first at index "
                         f"{where}; refusing to run")
    return a32


def _finite_vector(name: str, a: Any, n: int) -> np.ndarray:
    if not isinstance(a, np.ndarray) or a.dtype.kind != "f" or a.shape != (n,):
        got = f"{a.dtype} {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
        raise ValueError(f"{name} must be a floating-point array of shape ({n},), got {got}")
    return narrow_finite(name, a)


#: The range of ``eps`` the kernels accept: positive normal float32 values. Below the smallest
#: normal it is subnormal or 0 once narrowed (a zero row -- padding -- then turns NaN); from
#: float32's largest value up it rounds to inf.
EPS_RANGE = (float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max))


def check_eps(eps: Any) -> float:
    """``eps`` as a float if float32 holds it as a positive normal number (:data:`EPS_RANGE`);
    else ValueError naming the range. (The value itself is passed on unchanged.)"""
    if isinstance(eps, bool) or not isinstance(eps, (int, float, np.integer, np.floating)) \
            or not math.isfinite(float(eps)) or float(eps) <= 0:
        raise ValueError(f"eps must be a positive finite number, got {eps!r}")
    e = float(eps)
    with np.errstate(over="ignore", under="ignore"):
        e32 = np.float32(e)
    lo, hi = EPS_RANGE
    if not np.isfinite(e32):
        raise ValueError(f"eps {e:g} is inf in float32 (the kernels' type): it must lie in "
                         f"[{lo:.4g}, {hi:.4g}]")
    if e32 < lo:
        why = "0 (a zero row -- padding -- would turn NaN)" if e32 == 0 else "subnormal"
        raise ValueError(f"eps {e:g} is {why} in float32 (the kernels' type): it must lie in "
                         f"[{lo:.4g}, {hi:.4g}]")
    return e


def _serialized(method: Callable[..., Any]) -> Callable[..., Any]:
    """An Engine method run under the engine's lock (one call at a time, across threads)."""
    @functools.wraps(method)
    def serialized(self: "Engine", *args: Any, **kwargs: Any) -> Any:
        lock = self._lock
        if lock is None:                    # __init__ never got that far
            raise RuntimeError(f"Engine.{method.__name__}: the engine is closed")
        with lock:
            return method(self, *args, **kwargs)
    return serialized


class Engine:
    """ONE arena and ONE forked pool serving several block plans at several token counts.

    ``needs``: the ``(plan, T)`` pairs that will run (scratch is sized for the largest; every
    plan must share one :class:`BlockConfig`). ``weights``: ``{key: LayerWeights}`` -- every
    block's weights, bound before the fork (checked here against the config). ``buffers``:
    the caller's arena buffers (``SharedArena`` specs), e.g. ``{"x": (T1 + T2, D), "pe": (T1 +
    T2, hd // 2, 2, 2), "mask": ((T,), np.uint8)}``: inputs/outputs are views of them
    (:meth:`buffer`), so a plan can run on a row range of a joint buffer in place.
    ``workers`` / ``spawn`` / ``stage_timeout`` as for :class:`~nxhpc.runtime.workers.WorkerPool`.
    ``tasks``: extra named worker tasks ``fn(engine, lo, hi, arg)`` beside the block stages
    (e.g. a model's embedders and final layer), forked with the pool and run by
    :meth:`run_task`; in a worker ``engine`` is that process's engine (:meth:`buffer` works).

    Threads: one engine runs one call at a time. :meth:`run` and :meth:`close` hold a lock, so
    calls from several threads are serialized (each waits for the one before to finish; a
    ``close`` waits for a running call); the buffers are shared, so a caller filling them from
    several threads must order that itself. Lifetime: ``close()`` (or ``with``) releases the
    workers and the arena at once; an engine dropped without it (or whose ``__init__`` was
    interrupted) is released when its last reference goes -- it holds no reference cycle.

    Example (a denoiser call: image rows, caption rows, then the joint rows)::

        img, cap, joint = (BlockPlan(cfg, p) for p in ("noise_refiner", "context_refiner",
                                                       "layers"))
        with Engine([(img, T1), (cap, T2), (joint, T1 + T2)], weights,
                    buffers={"u": (T1 + T2, D), "pe": (T1 + T2, hd // 2, 2, 2)}) as eng:
            u, pe = eng.buffer("u"), eng.buffer("pe")
            ...                                   # write inputs into u and pe
            eng.run(img, ("noise_refiner", 0), u[:T1], pe[:T1], adaln_m=m)
            eng.run(cap, ("context_refiner", 0), u[T1:], pe[T1:])
            eng.run(joint, ("layers", 0), u, pe, adaln_m=m0)
    """

    # Defaults at class level: an engine whose __init__ raised (or was interrupted) early still
    # answers every attribute close() and the properties read.
    pool: WorkerPool | None = None
    arena: SharedArena | None = None
    _ctx: dict = {}
    _views: dict = {}
    _lock: Any = None

    def __init__(self, needs: Iterable[tuple[BlockPlan, int]],
                 weights: Mapping[Hashable, LayerWeights], *,
                 buffers: Mapping[str, Any] | None = None, workers: int = 1,
                 spawn: str = DEFAULT_SPAWN, stage_timeout: float | None = None,
                 tasks: Mapping[str, Callable[["Engine", int, int, Any], None]] | None = None
                 ) -> None:
        extra_tasks = dict(tasks or {})
        needs = [(p, int(T)) for p, T in needs]
        if not needs:
            raise ValueError("Engine: needs no (plan, T) pairs")
        for p, T in needs:
            if not isinstance(p, BlockPlan):
                raise TypeError(f"Engine: needs must be (BlockPlan, T) pairs, got "
                                f"{type(p).__name__}")
            if T < 1:
                raise ValueError(f"Engine: token count must be >= 1, got {T}")
        cfg = needs[0][0].config
        if any(p.config != cfg for p, _ in needs):
            raise ValueError("Engine: every plan of one engine must share one BlockConfig")
        if spawn not in SPAWN_MODES:
            raise ValueError(f"spawn must be one of {SPAWN_MODES}, got {spawn!r}")
        stage_timeout = check_timeout(stage_timeout)
        self._lock = threading.RLock()
        self.config = cfg
        self.needs = needs
        self.kernels = nxhpc.kernels()
        # weights: checked and typed once, in the parent, before the fork
        self._weights: dict[Hashable, LayerWeights] = {}
        self._given: dict[Hashable, LayerWeights] = {}
        self._by_id: dict[int, Hashable] = {}
        for key, w in weights.items():
            if not isinstance(w, LayerWeights):
                raise TypeError(f"Engine: weights[{key!r}] must be LayerWeights, got "
                                f"{type(w).__name__}")
            if w.layer >= 0:
                label = w.label
            elif isinstance(key, int):
                label = block_label(w.prefix, key)
            else:
                label = f"weights {key!r}"
            cfg.check_layer(w, label)
            typed = w.typed()
            for k, m in typed.matrices().items():
                check_runnable(self.kernels, m, adaln=k == "adaln_w")
            self._weights[key] = typed
            self._given[key] = w         # held, so id(w) cannot be reused while we map it
            self._by_id[id(w)] = key
        # tasks: the union of the plans' stage tables (one task per stage name)
        tasks: dict[str, Callable[[int, int, Any], None]] = {}
        seen: dict[str, Stage] = {}
        for p, _ in needs:
            for s in p.stages:
                if s.name in seen and seen[s.name].task is not s.task:
                    raise ValueError(f"Engine: two plans define stage {s.name!r} differently")
                seen[s.name] = s
                tasks[s.name] = self._task(s.task)
        self._extra: dict[str, Callable[..., None]] = {}
        for name, fn in extra_tasks.items():
            if name in seen or not callable(fn):
                raise ValueError(f"Engine: extra task {name!r} must be a callable whose name is "
                                 f"not a stage's ({', '.join(seen)})")
            self._extra[name] = fn
            tasks[name] = self._extra_task(fn)
        # the arena: flat scratch sized for the largest need + modulation + caller buffers
        self._cap = {n: 0 for n in _scratch(cfg, 1)}
        for p, T in needs:
            for n, shape in p.scratch(T).items():
                self._cap[n] = max(self._cap[n], math.prod(shape))
        D = cfg.dim
        spec: dict[str, Any] = {n: (c,) for n, c in self._cap.items()}
        spec.update({"adaln": (4 * D,), "mod_msa": (D,), "mod_mlp": (D,), "unit_gate": (D,)})
        for n, s in (buffers or {}).items():
            if n in spec:
                raise ValueError(f"Engine: buffer name {n!r} is reserved (scratch: "
                                 f"{', '.join(spec)})")
            spec[n] = s
        self._user = list(buffers or {})
        self._ctx: dict[tuple, RunContext] = {}
        self._views: dict[int, dict[str, np.ndarray]] = {}
        try:
            # If an interrupt lands between a constructor's return and the store, the object is
            # dropped at once and its own finalizer releases it (see the class docstring).
            self.arena = a = SharedArena(spec)
            self._v = {n: a[n] for n in a}
            self._v["unit_gate"][:] = np.float32(UNIT_GATE)
            self._addr = {n: (buf.__array_interface__["data"][0], buf)
                          for n, buf in self._v.items() if n in self._user}
            self.pool = WorkerPool(workers, tasks, mode=spawn, stage_timeout=stage_timeout)
        except BaseException:
            self.close()
            raise

    # -- worker side
    def _task(self, fn: Callable[[RunContext, int, int], None]) -> Callable[[int, int, Any], None]:
        # A weak reference: the pool holds the tasks, so a strong one would make engine -> pool
        # -> task -> engine a cycle, and an engine dropped without close() (an interrupt between
        # Engine() returning and the caller's store) would keep its workers and arena until the
        # cyclic garbage collector happened to run. Workers run inside the frame that forked
        # them, where the engine is alive.
        ref = weakref.ref(self)

        def run_band(lo: int, hi: int, wire: tuple) -> None:
            engine = ref()
            if engine is None:
                raise RuntimeError("Engine: the engine was released while its workers ran")
            fn(engine._context(wire), lo, hi)
        return run_band

    def _extra_task(self, fn: Callable[["Engine", int, int, Any], None]
                    ) -> Callable[[int, int, Any], None]:
        def run_band(lo: int, hi: int, arg: Any) -> None:
            fn(self, lo, hi, arg)
        return run_band

    def _scratch_views(self, T: int) -> dict[str, np.ndarray]:
        views = self._views.get(T)
        if views is None:
            views = {n: self._v[n][:math.prod(s)].reshape(s)
                     for n, s in _scratch(self.config, T).items()}
            self._views[T] = views
        return views

    def _context(self, wire: tuple) -> RunContext:
        """The stage context of one run (built once per process and run, then cached)."""
        c = self._ctx.get(wire)
        if c is None:
            arg = RunArgs.from_wire(wire)
            views, D = self._v, self.config.dim

            def ref(r: BufRef | None) -> np.ndarray | None:
                return None if r is None else views[r.name][r.r0:r.r1]
            ada = views["adaln"]
            c = RunContext(
                kernels=self.kernels, cfg=self.config, w=self._weights[arg.weights],
                eps=arg.eps, x=ref(arg.x), pe=ref(arg.pe), out=ref(arg.out), mask=ref(arg.mask),
                buf=self._scratch_views(arg.tokens),
                mod_msa=views["mod_msa"] if arg.modulated else None,
                mod_mlp=views["mod_mlp"] if arg.modulated else None,
                gate_msa=ada[D:2 * D] if arg.modulated else views["unit_gate"],
                gate_mlp=ada[3 * D:4 * D] if arg.modulated else views["unit_gate"],
                scale=1.0 / math.sqrt(self.config.head_dim), precision=arg.precision)
            self._ctx[wire] = c
        return c

    # -- parent side
    def buffer(self, name: str) -> np.ndarray:
        """The caller's arena buffer ``name`` (a writeable view; shared with the workers)."""
        if name not in self._user:
            raise KeyError(f"Engine: no buffer {name!r} (buffers: {', '.join(self._user)})")
        return self._v[name]

    def _ref(self, what: str, view: Any, shape: tuple[int, ...], dtype: Any) -> BufRef:
        """Which arena buffer and rows ``view`` is; ValueError unless it is whole rows of one."""
        if not isinstance(view, np.ndarray) or view.dtype != dtype or view.shape != shape:
            got = f"{view.dtype} {view.shape}" if isinstance(view, np.ndarray) \
                else type(view).__name__
            raise ValueError(f"Engine.run: {what} must be {np.dtype(dtype)} {shape}, got {got}")
        p = view.__array_interface__["data"][0]
        for name, (base, buf) in self._addr.items():
            if buf.shape[1:] != shape[1:] or buf.dtype != view.dtype:
                continue
            row = buf.strides[0]
            off = p - base
            if 0 <= off < buf.nbytes and off % row == 0 and view.flags.c_contiguous:
                r0 = off // row
                if r0 + shape[0] <= buf.shape[0]:
                    return BufRef(name, int(r0), int(r0 + shape[0]))
        raise ValueError(f"Engine.run: {what} must be a row range of one of the engine's "
                         f"buffers ({', '.join(self._user) or 'none declared'}), with their "
                         f"trailing shape: workers reach buffers by name")

    def weights_key(self, weights: Any) -> Hashable:
        """The registry key of ``weights`` (a key, or a registered LayerWeights object)."""
        if isinstance(weights, LayerWeights):
            key = self._by_id.get(id(weights))
            if key is None:
                raise KeyError("Engine.run: these LayerWeights were not given to the engine "
                               "(weights must be bound before the workers fork)")
            return key
        if weights not in self._weights:
            raise KeyError(f"Engine.run: no weights under key {weights!r} (have "
                           f"{sorted(self._weights, key=repr)})")
        return weights

    def adaln(self, weights: Any, t_emb: np.ndarray) -> np.ndarray:
        """m = adaLN(t_emb) with a modulated block's weights (SiLU first for Lumina-2): [4D]."""
        w = self._weights[self.weights_key(weights)]
        if not w.modulated:
            raise ValueError(f"Engine.adaln: {w.label} is unmodulated (no adaLN tensors)")
        t = _finite_vector("t_emb", t_emb, self.config.adaln_in)
        m = np.empty(4 * self.config.dim, dtype=np.float32)
        adaln_linear(self.kernels, t, w.adaln_w, w.adaln_b, m, silu_input=self.config.adaln_silu)
        return m

    @_serialized
    def run(self, plan: BlockPlan, weights: Any, x: np.ndarray, pe: np.ndarray, *,
            adaln_m: np.ndarray | None = None, mask: np.ndarray | None = None,
            out: np.ndarray | None = None, eps: float | None = None,
            precision: str = DEFAULT_PRECISION) -> dict[str, int]:
        """One block of ``plan`` with ``weights`` on ``x`` [T, D] -> ``out`` (default: ``x``,
        in place). ``x``, ``pe`` [T, hd/2, 2, 2], ``out`` and ``mask`` (uint8 [T], 1 = attend)
        are views of the engine's buffers; ``adaln_m`` [4D] for a modulated plan, None for an
        unmodulated one. ``precision`` ("f32" default, "bf16", "q8": nxhpc.nn.linear) is the
        projections' matmul precision; norms, RoPE, attention, residuals and adaLN stay float32.
        Returns microseconds per timing key. Serialized with other threads' calls (see the class
        docstring)."""
        if self.pool is None or self.arena.closed:
            raise RuntimeError("Engine.run: the engine is closed")
        precision = check_precision(precision, "Engine.run: precision")
        if plan.config != self.config:
            raise ValueError("Engine.run: the plan's config is not the engine's")
        cfg, D = self.config, self.config.dim
        key = self.weights_key(weights)
        w = self._weights[key]
        if w.modulated != plan.modulated:
            raise ValueError(f"Engine.run: a {'modulated' if plan.modulated else 'unmodulated'} "
                             f"{plan.prefix} plan cannot run {w.label}, which "
                             f"{'has' if w.modulated else 'has no'} adaLN tensors")
        if not isinstance(x, np.ndarray) or x.ndim != 2:
            raise ValueError(f"Engine.run: x must be a [T, {D}] view of an engine buffer")
        T = x.shape[0]
        if T < 1:
            raise ValueError(f"Engine.run: x must have at least one token, got shape {x.shape}")
        xr = self._ref("x", x, (T, D), np.float32)
        per = (T, cfg.head_dim // 2, 2, 2)
        pr = self._ref("pe", pe, per, np.float32)
        orf = xr if out is None else self._ref("out", out, (T, D), np.float32)
        mr = None if mask is None else self._ref("mask", mask, (T,), np.uint8)
        for n, shape in plan.scratch(T).items():
            if math.prod(shape) > self._cap[n]:
                raise ValueError(f"Engine.run: {plan.prefix} at T={T} needs more scratch than "
                                 f"this engine was sized for (needs: "
                                 f"{[(p.prefix, t) for p, t in self.needs]})")
        eps = check_eps(cfg.norm_eps if eps is None else eps)
        views = self._v
        if plan.modulated:
            if adaln_m is None:
                raise ValueError(f"Engine.run: the modulated {plan.prefix} plan needs adaln_m "
                                 f"[{4 * D}]")
            m = _finite_vector("adaln_m", adaln_m, 4 * D)
            np.copyto(views["adaln"], m)
            one = np.float32(1.0)
            np.add(one, views["adaln"][0:D], out=views["mod_msa"])
            np.add(one, views["adaln"][2 * D:3 * D], out=views["mod_mlp"])
        elif adaln_m is not None:
            raise ValueError(f"Engine.run: the unmodulated {plan.prefix} plan takes no adaln_m")
        wire = RunArgs(key, T, bool(plan.modulated), eps, precision, xr, pr, orf, mr).wire()
        now = time.perf_counter_ns
        spent = dict.fromkeys(plan.timing_keys, 0)
        t_start = now()
        for s in plan.stages:
            t0 = now()
            self.pool.run(s.name, plan.extent(s, T), arg=wire)
            spent[s.timer] += now() - t0
        spent["block_us"] = now() - t_start
        return {k: ns // 1000 for k, ns in spent.items()}

    def run_task(self, name: str, m: int, arg: Any = None) -> int:
        """Run extra task ``name`` (given as ``tasks=``) over ``[0, m)`` in the workers (bands
        ``[i*m//n, (i+1)*m//n)``); ``arg`` is a small picklable value. Returns microseconds."""
        if self.pool is None or self.arena.closed:
            raise RuntimeError("Engine.run_task: the engine is closed")
        if name not in self._extra:
            raise KeyError(f"Engine.run_task: no extra task {name!r} (have "
                           f"{sorted(self._extra)})")
        t0 = time.perf_counter_ns()
        self.pool.run(name, int(m), arg=arg)
        return (time.perf_counter_ns() - t0) // 1000

    def _release_views(self) -> None:
        """Drop every view of the arena in place (tasks share these dicts), so unmapping the
        segment releases it now rather than at the next cyclic garbage collection."""
        for c in self._ctx.values():
            for name in RunContext.__slots__:
                setattr(c, name, None)
        self._ctx.clear()
        self._views.clear()
        getattr(self, "_v", {}).clear()
        getattr(self, "_addr", {}).clear()

    def close(self) -> None:
        """Stop the workers, then unlink and unmap the arena. Idempotent; waits for a call
        running in another thread; safe on an engine whose ``__init__`` did not finish."""
        lock = self._lock
        if lock is None:                  # __init__ stopped before anything was acquired
            return
        with lock:
            try:
                if self.pool is not None:
                    self.pool.close()
            finally:
                self._release_views()
                if self.arena is not None:
                    self.arena.close()

    @property
    def closed(self) -> bool:
        return self.arena is None or self.arena.closed

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        needs = ", ".join(f"{p.prefix}@{T}" for p, T in self.needs)
        return (f"<Engine {needs}; {len(self._weights)} blocks; arena "
                f"{self.arena.nbytes / 1e6:.1f} MB>")
