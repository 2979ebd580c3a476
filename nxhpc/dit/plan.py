"""The DiT block as data (:class:`BlockPlan`, a stage table) and the DiT's :class:`Engine`.

Owns: the stage table :data:`STAGES` -- the order of a block's parallel stages, how each one is
split over workers (its extent), which timing key it is charged to, and the task each worker
runs on its band -- and from it the timing keys and the table below; the per-call modulation
(adaLN ``m`` -> ``1 + scale`` and the gates, or none) and its state buffers; the DiT's
:class:`Engine`: the model-agnostic :class:`nxhpc.nn.engine.Engine` (ONE arena sized for every
``(plan, tokens)`` it is told it will run, ONE pool forked after all weights are bound, workers
finding buffers by name and row range) narrowed to block plans, with the block's call
``run(plan, weights, x, pe, adaln_m=..., mask=..., out=...)`` and ``adaln``.
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
                                                    h = rmsnorm(mid, ffn_norm1) * (1+scale_mlp)
    w13          ffn columns        us_ffn          f1 = silu(h @ W1^T) * (h @ W3^T)
    w2           dim columns        us_ffn          f2 = f1 @ W2^T
    ffn_tail     token rows         us_ffn          out = mid + tanh(gate_mlp) * rmsnorm(f2, ffn_norm2)

``block_us`` is the whole block (adaLN excluded: it is O(D) and computed before). Splits are
always ``[i*m//n, (i+1)*m//n)``; every kernel gives bit-identical results for any band split,
so the output is bit-identical for every worker count and both spawn modes. The four
projections (``qkv``, ``out_proj``, ``w13``, ``w2``) split over token rows instead of their
columns when every worker gets at least :data:`nxhpc.nn.stages.PROJ_ROWS_PER_WORKER` rows
(:func:`nxhpc.nn.stages.proj_by_rows`; not across MPI ranks, whose exchange gathers columns):
a band is then whole output rows, and each worker packs only its own rows of the input. A
kernel computes a row's outputs the same whatever rows and columns are beside it, so this
changes no bit; ``Engine.last_split`` gives each stage's extent. Such a run's row-local stages
(:meth:`BlockPlan.row_local`: ``norm1``, ``qkv``; ``out_proj`` to ``ffn_tail``) go to the
workers as two dispatches instead of six (``nxhpc.nn.engine.ROW_GROUPS``): each worker runs
its rows through them with no wait between, so a block is four dispatches at that size. The
residual tails run ``kernels.norm_residual``: the norm, the gated residual and (``attn_tail``)
the FFN's input norm in one pass over each row, with the bits of the three kernels in turn.

Modulation. A modulated plan (``layers``, ``noise_refiner``) takes ``m = adaLN(t_emb)``,
``[scale_msa | gate_msa | scale_mlp | gate_mlp]``. An unmodulated plan (``context_refiner``)
runs the same stages with scale = 0 (the rmsnorm gets no ``mod``: multiplier 1) and gate
multiplier 1 without tanh: ``x += rmsnorm(attn(rmsnorm(x, n1)), n2)``. The gated-residual
kernel computes ``resid + tanh(g) * y``; the gate buffer of an unmodulated plan holds
:data:`UNIT_GATE`, whose float32 tanh is exactly 1.0 in every kernel variant (tanh(20) =
1 - 8.5e-18 rounds to 1; pinned by a test), so the stage is exactly ``resid + y``.

Memory. Scratch buffers are flat, sized for the largest ``(plan, T)`` need, and viewed with the
shape of the T being run; ``h`` is reused for ``h2``, and some values never reach the arena (the
normalized ``atto`` and ``f2``, kept in registers by ``norm_residual``; the up projection's
outputs, the SwiGLU being applied inside the ``w13`` projection): per token
``6*D + KVH*hd + qkv_width + F`` scratch floats (x, out and pe are the caller's buffers).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nxhpc.dit.binding import LayerWeights
from nxhpc.dit.config import BLOCK_STACKS, BlockConfig, block_label, block_view
from nxhpc.nn import engine as _engine
from nxhpc.nn.checks import EPS_RANGE, check_eps, finite_vector, narrow_finite
from nxhpc.nn.engine import Gather, IOSpec, Plan, Stage, serialized
from nxhpc.nn.linear import DEFAULT_PRECISION, adaln_linear, attention_precision, check_precision
from nxhpc.nn.residual import UNIT_GATE, UnitGateState
from nxhpc.nn.stages import Project, ProjectGLU, block_extents, proj_by_rows

__all__ = ["Stage", "STAGES", "EXTENTS", "TIMING_KEYS", "UNIT_GATE", "BlockPlan", "Engine",
           "stage_table", "check_eps", "narrow_finite", "EPS_RANGE"]

class RunContext(_engine.RunContext):
    """What a stage's task reads in a worker: kernels, config, weights, views, eps."""
    __slots__ = ("kernels", "cfg", "w", "eps", "x", "pe", "out", "mask", "buf", "mod_msa",
                 "mod_mlp", "gate_msa", "gate_mlp", "scale", "precision", "proj_rows")


# ------------------------------------------------------------------------------ stage tasks
# task(c, lo, hi): one band [lo, hi) of the stage's extent, in a worker.
def _norm1(c: RunContext, lo: int, hi: int) -> None:
    c.kernels.rmsnorm(c.x, c.w.attention_norm1, c.buf["h"], c.eps, mod=c.mod_msa, r0=lo, r1=hi)


def _qknorm_rope(c: RunContext, lo: int, hi: int) -> None:
    c.kernels.qknorm_rope(c.buf["qkv"], c.w.q_norm, c.w.k_norm, c.pe, c.buf["q"], c.buf["k"],
                          c.cfg.n_heads, c.cfg.n_kv_heads, c.eps, h0=lo, h1=hi)


def _sdpa(c: RunContext, lo: int, hi: int) -> None:
    c.kernels.attention(c.buf["q"], c.buf["k"], c.buf["qkv"], c.buf["attn"], c.cfg.n_kv_heads,
                        c.scale, mask=c.mask, h0=lo, h1=hi,
                        precision=attention_precision(c.precision))


def _attn_tail(c: RunContext, lo: int, hi: int) -> None:
    # the bits of rmsnorm(atto), gated_residual, then the FFN's norm, in one pass over each row
    c.kernels.norm_residual(c.buf["atto"], c.w.attention_norm2, c.x, c.gate_msa, c.buf["mid"],
                            c.eps, w2=c.w.ffn_norm1, mod2=c.mod_mlp, h=c.buf["h"], r0=lo, r1=hi)


def _ffn_tail(c: RunContext, lo: int, hi: int) -> None:
    c.kernels.norm_residual(c.buf["f2"], c.w.ffn_norm2, c.buf["mid"], c.gate_mlp, c.out, c.eps,
                            r0=lo, r1=hi)


# ------------------------------------------------------------------------------ the table
#: extent name -> (description, m(cfg, T)): the range [0, m) a stage splits over workers
EXTENTS: dict[str, tuple[str, Callable[[BlockConfig, int], int]]] = block_extents(
    lambda cfg: cfg.ffn_dim)


STAGES: tuple[Stage, ...] = (
    Stage("norm1", "rows", "us_prenorm_qkv", _norm1,
          "h = rmsnorm(x, attention_norm1) * (1+scale_msa)"),
    Stage("qkv", "qkv_cols", "us_prenorm_qkv", Project("h", (("qkv", "qkv"),)),
          "qkv = h @ Wqkv^T"),
    Stage("qknorm_rope", "qk_heads", "us_qknorm_rope", _qknorm_rope,
          "q, k = rope(rmsnorm_hd(q|k)) as [H, T, hd] / [KVH, T, hd]"),
    Stage("sdpa", "query_heads", "us_sdpa", _sdpa,
          "attn = softmax(q k^T / sqrt(hd) [+ mask]) v"),
    Stage("out_proj", "dim_cols", "us_attn_tail", Project("attn", (("out", "atto"),)),
          "atto = attn @ Wout^T"),
    Stage("attn_tail", "rows", "us_attn_tail", _attn_tail,
          "mid = x + tanh(gate_msa) * rmsnorm(atto, attention_norm2)\n"
          "h = rmsnorm(mid, ffn_norm1) * (1+scale_mlp)"),
    Stage("w13", "ffn_cols", "us_ffn", ProjectGLU("h", "w1", "w3", "f1"),
          "f1 = silu(h @ W1^T) * (h @ W3^T)"),
    Stage("w2", "dim_cols", "us_ffn", Project("f1", (("w2", "f2"),)), "f2 = f1 @ W2^T"),
    Stage("ffn_tail", "rows", "us_ffn", _ffn_tail,
          "out = mid + tanh(gate_mlp) * rmsnorm(f2, ffn_norm2)"),
)


#: Timing keys of a block run, in stage order, then ``block_us`` (the whole block).
TIMING_KEYS = _engine.timing_keys(STAGES)


def stage_table(stages: Iterable[Stage] = STAGES) -> str:
    """The stage table as the module docstring shows it."""
    return _engine.stage_table(stages, {k: v[0] for k, v in EXTENTS.items()})


def _cols(name: str, width: Callable[[BlockConfig], int], unit: int | None = None
          ) -> Callable[[BlockConfig, int], tuple[Gather, ...]]:
    """A stage split by columns of ``name`` [T, width] (``unit`` columns per extent index)."""
    return lambda cfg, T: (Gather(name, (T, width(cfg)), 1, 0,
                                  cfg.head_dim if unit is None else unit),)


def _whole(cfg: BlockConfig, T: int) -> None:
    return None


#: stage name -> its split across MPI ranks (None: whole on every rank; see BlockPlan.split)
_SPLITS: dict[str, Callable[[BlockConfig, int], tuple[Gather, ...] | None]] = {
    "norm1": _whole,
    "qkv": _cols("qkv", lambda c: c.qkv_width, 1),
    "qknorm_rope": _whole,
    "sdpa": _cols("attn", lambda c: c.n_heads * c.head_dim),
    "out_proj": _cols("atto", lambda c: c.dim, 1),
    "attn_tail": _whole,
    "w13": _cols("f1", lambda c: c.ffn_dim, 1),
    "w2": _cols("f2", lambda c: c.dim, 1),
    "ffn_tail": _whole,
}


def _scratch(cfg: BlockConfig, T: int) -> dict[str, tuple[int, ...]]:
    """Scratch buffer shapes of one block run at ``T`` tokens."""
    D, H, KVH, hd, F = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim
    return {"h": (T, D), "qkv": (T, cfg.qkv_width), "q": (H, T, hd), "k": (KVH, T, hd),
            "attn": (T, H * hd), "atto": (T, D), "mid": (T, D), "f1": (T, F), "f2": (T, D)}


def _proj_by_rows(stage: Stage, params: tuple) -> bool:
    """``stage`` is a projection and the run's params split projections over token rows."""
    return bool(params[3]) and isinstance(stage.task, (Project, ProjectGLU))


# ------------------------------------------------------------------------------ the plan
@dataclass(frozen=True)
class BlockPlan(UnitGateState, Plan):
    """One kind of block as data: its config, stack ``prefix``, ``modulated`` flag and stages.

    ``config``: a :class:`BlockConfig` (a model's :class:`~nxhpc.dit.config.DenoiserConfig` is
    taken as its block view). ``modulated`` defaults to the stack's kind (``context_refiner``:
    False). The plan holds no memory and no processes: an :class:`Engine` runs it at any token
    count it was sized for. Its inputs (:meth:`io`): ``x`` [T, D], ``pe`` [T, hd/2, 2, 2],
    ``out`` [T, D] and an optional ``mask`` uint8 [T]; its state: the modulation buffers.
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
    def label(self) -> str:
        return self.prefix

    def extent(self, stage: Stage, T: int, params: tuple | None = None) -> int:
        """The ``m`` of ``stage`` at ``T`` tokens (its band range is ``[0, m)``): a projection
        of a run whose ``params`` split projections over token rows (``proj_rows``, set by
        :meth:`Engine.run` from :func:`nxhpc.nn.stages.proj_by_rows`) has ``T``."""
        if params is not None and _proj_by_rows(stage, params):
            return T
        return EXTENTS[stage.extent][1](self.config, T)

    def row_local(self, stage: Stage, params: tuple) -> bool:
        """The norms and residual tails (split over token rows), and the projections of a run
        that splits them over token rows: each band reads and writes its own rows only."""
        return stage.extent == "rows" or _proj_by_rows(stage, params)

    def scratch(self, T: int) -> dict[str, tuple[int, ...]]:
        """Scratch buffer shapes for a run at ``T`` tokens."""
        return _scratch(self.config, T)

    def split(self, stage: Stage, T: int) -> tuple[Gather, ...] | None:
        """Across MPI ranks: the projections (by columns) and attention (by query heads) are
        split, each followed by a gather of what it wrote; the norms, RoPE and the residual
        tails (O(T*D) element-wise work, cheaper to repeat than to exchange) run whole on every
        rank. Per block that exchanges ``qkv``, ``attn``, ``atto``, ``f1`` (after the SwiGLU,
        which the ``w13`` projection applies) and ``f2``: ``T * (qkv_width + H*hd + 2*D + F)``
        floats (``benchmarks/README.md``)."""
        return _SPLITS.get(stage.name, _whole)(self.config, T)

    def tensor_names(self, index: int, *, model_prefix: bool = False) -> dict[str, str]:
        """Short name -> tensor name of block ``prefix.index`` of this kind."""
        return self.config.tensor_names(index, self.prefix, modulated=self.modulated,
                                        model_prefix=model_prefix)



    def io(self, T: int) -> dict[str, IOSpec]:
        D, hd = self.config.dim, self.config.head_dim
        return {"x": IOSpec((T, D)), "pe": IOSpec((T, hd // 2, 2, 2)), "out": IOSpec((T, D)),
                "mask": IOSpec((T,), np.uint8, optional=True)}

    def state(self) -> dict[str, Any]:
        """adaLN output ``m`` [4D], the multipliers ``1 + scale`` [D] and the unit gate [D]."""
        D = self.config.dim
        return {"adaln": (4 * D,), "mod_msa": (D,), "mod_mlp": (D,), "unit_gate": (D,)}

    def bind(self, key: Hashable, weights: Any, kernels: Any) -> LayerWeights:
        """A block's :class:`LayerWeights` checked against the config, matrices typed."""
        if not isinstance(weights, LayerWeights):
            raise TypeError(f"Engine: weights[{key!r}] must be LayerWeights, got "
                            f"{type(weights).__name__}")
        if weights.layer >= 0:
            label = weights.label
        elif isinstance(key, int):
            label = block_label(weights.prefix, key)
        else:
            label = f"weights {key!r}"
        self.config.check_layer(weights, label)
        return weights.typed()

    def matrices(self, weights: LayerWeights) -> dict[str, Any]:
        return weights.matrices()

    def context(self, kernels: Any, weights: LayerWeights, T: int,
                buf: Mapping[str, np.ndarray], io: Mapping[str, np.ndarray | None],
                state: Mapping[str, np.ndarray], params: tuple) -> RunContext:
        """params = (modulated, eps, precision, proj_rows)."""
        modulated, eps, precision, proj_rows = params
        D = self.config.dim
        ada = state["adaln"]
        return RunContext(
            kernels=kernels, cfg=self.config, w=weights, eps=eps, x=io["x"], pe=io["pe"],
            out=io["out"], mask=io["mask"], buf=buf,
            mod_msa=state["mod_msa"] if modulated else None,
            mod_mlp=state["mod_mlp"] if modulated else None,
            gate_msa=ada[D:2 * D] if modulated else state["unit_gate"],
            gate_mlp=ada[3 * D:4 * D] if modulated else state["unit_gate"],
            scale=1.0 / math.sqrt(self.config.head_dim), precision=precision,
            proj_rows=proj_rows)


# ------------------------------------------------------------------------------ the engine
class Engine(_engine.Engine):
    """The shared :class:`nxhpc.nn.engine.Engine` running DiT block plans: ONE arena and ONE
    forked pool serving several block plans at several token counts.

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

    plan_type = BlockPlan

    def adaln(self, weights: Any, t_emb: np.ndarray) -> np.ndarray:
        """m = adaLN(t_emb) with a modulated block's weights (SiLU first for Lumina-2): [4D]."""
        w = self.bound(weights)
        if not w.modulated:
            raise ValueError(f"Engine.adaln: {w.label} is unmodulated (no adaLN tensors)")
        t = finite_vector("t_emb", t_emb, self.config.adaln_in)
        m = np.empty(4 * self.config.dim, dtype=np.float32)
        adaln_linear(self.kernels, t, w.adaln_w, w.adaln_b, m, silu_input=self.config.adaln_silu)
        return m

    @serialized
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
        if self.pool is None or self.arena is None or self.arena.closed:
            raise RuntimeError("Engine.run: the engine is closed")
        precision = check_precision(precision, "Engine.run: precision")
        if plan.config != self.config:
            raise ValueError("Engine.run: the plan's config is not the engine's")
        cfg, D = self.config, self.config.dim
        w = self.bound(weights)
        if w.modulated != plan.modulated:
            raise ValueError(f"Engine.run: a {'modulated' if plan.modulated else 'unmodulated'} "
                             f"{plan.prefix} plan cannot run {w.label}, which "
                             f"{'has' if w.modulated else 'has no'} adaLN tensors")
        if not isinstance(x, np.ndarray) or x.ndim != 2:
            raise ValueError(f"Engine.run: x must be a [T, {D}] view of an engine buffer")
        T = x.shape[0]
        if T < 1:
            raise ValueError(f"Engine.run: x must have at least one token, got shape {x.shape}")
        eps = check_eps(cfg.norm_eps if eps is None else eps)
        # projections over token rows where every worker gets enough of them; across MPI ranks
        # they keep their columns (the exchange gathers columns)
        proj_rows = self.ranks is None and proj_by_rows(T, self.pool.n_workers)
        wire = self.prepare(plan, weights, T, {"x": x, "pe": pe, "out": x if out is None else out,
                                               "mask": mask},
                            (bool(plan.modulated), eps, precision, proj_rows))
        state = self._state
        if plan.modulated:
            if adaln_m is None:
                raise ValueError(f"Engine.run: the modulated {plan.prefix} plan needs adaln_m "
                                 f"[{4 * D}]")
            m = finite_vector("adaln_m", adaln_m, 4 * D)
            np.copyto(state["adaln"], m)
            one = np.float32(1.0)
            np.add(one, state["adaln"][0:D], out=state["mod_msa"])
            np.add(one, state["adaln"][2 * D:3 * D], out=state["mod_mlp"])
        elif adaln_m is not None:
            raise ValueError(f"Engine.run: the unmodulated {plan.prefix} plan takes no adaln_m")
        return self.execute(plan, T, wire)
