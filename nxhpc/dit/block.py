"""One DiT layer (docs/block.md) end to end on nxhpc's C kernels, in forked workers: the
model-facing API (:class:`Block`, :func:`run_layers`, :class:`BlockRunner`).

Owns: input validation (shapes, NaN/inf, mask, workers, eps, spawn), the adaLN modulation of a
layer, keeping workers between calls (``with Block(...)``) and chaining consecutive layers.
The block itself -- its stage table, timing keys, modulation and arena layout -- is the
:class:`~nxhpc.dit.plan.BlockPlan` run by an :class:`~nxhpc.dit.plan.Engine` (see
``nxhpc/dit/plan.py`` for the stage table); config and shape rules are
:class:`~nxhpc.dit.config.BlockConfig`'s. Must not: parse files (``nxhpc.models`` does), or
compute anything in Python/numpy beyond O(D) bookkeeping.

Every buffer lives in one :class:`~nxhpc.runtime.shm.SharedArena`; workers are forked after the
weights are bound (matrices stay in the memory map in their stored type, shared copy-on-write).
"""
from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

import nxhpc
from nxhpc.dit.config import block_view
from nxhpc.formats.closing import Closing
from nxhpc.nn.linear import DEFAULT_PRECISION, adaln_linear, check_precision
from nxhpc.dit.plan import TIMING_KEYS, BlockPlan, Engine, check_eps, narrow_finite
from nxhpc.runtime import proc
from nxhpc.runtime.checks import check_finite_output, check_workers
from nxhpc.runtime.workers import DEFAULT_SPAWN, SPAWN_MODES, check_timeout

__all__ = ["Block", "BlockOutput", "BlockRunner", "run_layers", "adaln", "TIMING_KEYS",
           "check_layer_weights", "validate_inputs"]


class BlockOutput(NamedTuple):
    """``output``: float32 [T, D] (a fresh array, or the caller's ``out=``); ``timings``:
    microseconds per stage."""
    output: np.ndarray
    timings: dict


# --------------------------------------------------------------------------------- validation
def check_layer_weights(w, cfg, layer: int) -> None:
    """Check every tensor of a LayerWeights against the config; ValueError naming the tensor."""
    cfg.check_layer(w, f"layer {layer}")


def _finite_f32(name: str, a: Any, shape: tuple[int, ...]) -> np.ndarray:
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray, got {type(a).__name__}")
    if a.dtype.kind != "f":
        raise TypeError(f"{name} must be a floating-point array, got dtype={a.dtype}")
    if a.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {a.shape}")
    return narrow_finite(name, a)            # checked after narrowing to float32


def validate_inputs(cfg, x, pe, mask=None, t_emb=None, adaln_m=None):
    """Check and convert a block's inputs; returns (x, pe, mask_u8|None, t_emb|None, adaln|None).

    x [T, D] and pe [T, hd/2, 2, 2]: finite floating arrays (converted to float32); exactly one of
    t_emb [adaln_in] / adaln_m [4D]; mask None or [T] of bool / 0-1 values (True = attend).
    """
    if not isinstance(x, np.ndarray) or x.ndim != 2:
        raise ValueError(f"x must be a 2-D array [tokens, dim={cfg.dim}], got "
                         f"{x.shape if isinstance(x, np.ndarray) else type(x).__name__}")
    T = x.shape[0]
    if T < 1:
        raise ValueError(f"x must have at least one token, got shape {x.shape}")
    x = _finite_f32("x", x, (T, cfg.dim))
    pe = _finite_f32("pe", pe, (T, cfg.head_dim // 2, 2, 2))
    if (t_emb is None) == (adaln_m is None):
        raise ValueError("give exactly one of t_emb (adaLN input) and adaln_m (precomputed "
                         f"modulation [4*dim={4 * cfg.dim}])")
    if t_emb is not None:
        t_emb = _finite_f32("t_emb", t_emb, (cfg.adaln_in,))
    if adaln_m is not None:
        adaln_m = _finite_f32("adaln_m", adaln_m, (4 * cfg.dim,))
    if mask is not None:
        m = np.asarray(mask)
        if m.shape != (T,):
            raise ValueError(f"mask must have shape ({T},) (one flag per key token), got {m.shape}")
        if m.dtype != np.bool_:
            if m.dtype.kind not in "biuf" or not np.all((m == 0) | (m == 1)):
                raise ValueError(f"mask must be bool or hold only 0/1 (1 = attend), "
                                 f"got dtype={m.dtype} with other values")
        mask = np.ascontiguousarray(m != 0, dtype=np.uint8)
    return x, pe, mask, t_emb, adaln_m


def _check_out(out: Any, shape: tuple[int, ...]) -> np.ndarray | None:
    """``Block.forward``'s ``out=``: None, or a writeable C-contiguous float32 array of x's
    ``shape``; TypeError / ValueError before anything runs."""
    if out is None:
        return None
    if not isinstance(out, np.ndarray):
        raise TypeError(f"out must be a numpy.ndarray, got {type(out).__name__}")
    if out.dtype != np.float32:
        raise TypeError(f"out must be float32, got dtype={out.dtype}")
    if out.shape != shape:
        raise ValueError(f"out must have x's shape {shape}, got {out.shape}")
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError("out must be C-contiguous and writeable")
    return out


def _check_spawn(spawn) -> str:
    if spawn is None:
        return DEFAULT_SPAWN
    if spawn not in SPAWN_MODES:
        raise ValueError(f"spawn must be one of {SPAWN_MODES}, got {spawn!r}")
    return spawn


def _check_eps(eps, cfg) -> float:
    """The model's eps when None; a positive number float32 holds as a normal value
    (:func:`nxhpc.dit.plan.check_eps`), else ValueError."""
    return check_eps(cfg.norm_eps if eps is None else eps)


def adaln(cfg, weights, t_emb: np.ndarray) -> np.ndarray:
    """m = adaLN(t_emb) with a layer's weights (SiLU first when ``cfg.adaln_silu``): float32 [4D].

    The weight is used as stored (Q8_0 straight from the map, or float32): ``adaln_linear``
    gives bit-identical output for a Q8_0 weight and its float32 dequantization, so the GGUF
    path and the fixture path give the same modulation, and no dequantized copy is made.
    """
    t = _finite_f32("t_emb", t_emb, (cfg.adaln_in,))
    if weights.adaln_w is None:
        raise ValueError("adaln: these weights have no adaLN tensors (an unmodulated block)")
    w = weights.typed()
    m = np.empty(4 * cfg.dim, dtype=np.float32)
    adaln_linear(nxhpc.kernels(), t, w.adaln_w, w.adaln_b, m, silu_input=bool(cfg.adaln_silu))
    return m


# --------------------------------------------------------------------------------- the runner
class BlockRunner:
    """Arena + workers + bound weights for running main layers of one model at ``T`` tokens.

    A one-need :class:`~nxhpc.dit.plan.Engine` with buffers ``x``, ``out``, ``pe`` and ``mask``.
    Create it after the layers' weights are bound: the pool forks here. ``run(layer, adaln)``
    runs one block on ``x`` into ``out``; :func:`run_layers` chains them. ``stage_timeout``
    (seconds, None = none) bounds each parallel stage: a worker that hangs is killed and
    reported as a :class:`~nxhpc.runtime.workers.WorkerError`. ``close()`` is idempotent and
    safe on a runner whose ``__init__`` did not finish (an interrupt, an error).
    """

    # Defaults at class level: a runner whose __init__ raised (or was interrupted) early still
    # answers every attribute close() reads.
    engine: Engine | None = None

    def __init__(self, cfg, layers: dict, T: int, *, workers: int, spawn: str = DEFAULT_SPAWN,
                 stage_timeout: float | None = None) -> None:
        cfg = block_view(cfg)
        spawn = _check_spawn(spawn)
        self.cfg = cfg
        self.T = T
        self.workers = check_workers(workers)
        self.spawn = spawn
        self.layers = dict(layers)
        self.qkv_width = cfg.qkv_width
        self.plan = BlockPlan(cfg, "layers", modulated=True)
        D, hd = cfg.dim, cfg.head_dim
        self._use_mask = False
        try:
            self.engine = e = Engine([(self.plan, T)], self.layers, workers=self.workers,
                                     spawn=spawn, stage_timeout=stage_timeout,
                                     buffers={"x": (T, D), "out": (T, D),
                                              "pe": (T, hd // 2, 2, 2), "mask": ((T,), np.uint8)})
            self.arena = e.arena
            self.pool = e.pool
        except BaseException:
            self.close()
            raise

    def adaln(self, layer: int, t_emb: np.ndarray) -> np.ndarray:
        """m = adaLN(t_emb) for ``layer`` (SiLU first for Lumina-2), float32 [4D], via the kernel."""
        return self.engine.adaln(layer, t_emb)

    def set_inputs(self, x: np.ndarray, pe: np.ndarray, mask: np.ndarray | None) -> None:
        """Copy validated float32 x / pe and the uint8 mask into the arena."""
        e = self.engine
        np.copyto(e.buffer("x"), x)
        np.copyto(e.buffer("pe"), pe)
        if mask is not None:
            np.copyto(e.buffer("mask"), mask)
        self._use_mask = mask is not None

    def run(self, layer: int, adaln_m: np.ndarray, eps: float,
            precision: str = DEFAULT_PRECISION) -> dict:
        """One block on arena x -> arena out with modulation ``adaln_m`` [4D], projections in
        ``precision`` (nxhpc.nn.linear.PRECISIONS). Returns timings."""
        if layer not in self.layers:
            raise KeyError(f"BlockRunner: layer {layer} was not bound (have {sorted(self.layers)})")
        e = self.engine
        return e.run(self.plan, layer, e.buffer("x"), e.buffer("pe"), adaln_m=adaln_m,
                     mask=e.buffer("mask") if self._use_mask else None, out=e.buffer("out"),
                     eps=eps, precision=precision)

    @property
    def output(self) -> np.ndarray:
        """The arena's output buffer (a view: copy it before the next run)."""
        return self.engine.buffer("out")

    def advance(self) -> None:
        """Make the last output the next layer's input (x := out)."""
        np.copyto(self.engine.buffer("x"), self.engine.buffer("out"))

    def close(self) -> None:
        """Stop the workers, then unlink and unmap the arena. Idempotent."""
        if self.engine is not None:
            self.engine.close()

    def __enter__(self) -> "BlockRunner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_layers(model, layers: Sequence[int], x: np.ndarray, pe: np.ndarray, *,
               t_emb: np.ndarray | None = None, adaln_ms: dict | None = None,
               mask: np.ndarray | None = None, workers: int | None = None,
               spawn: str | None = None, eps: float | None = None, source: str = "auto",
               on_layer: Callable[[int, np.ndarray, dict], None] | None = None,
               weights: dict | None = None,
               stage_timeout: float | None = None, repeat: int = 1,
               precision: str = DEFAULT_PRECISION) -> BlockOutput:
    """Run consecutive ``layers`` of ``model``: layer i's output is layer i+1's input.

    Each layer's modulation comes from ``t_emb`` with that layer's adaLN weights, or from
    ``adaln_ms[i]`` (precomputed, [4D]) when ``t_emb`` is None. ``on_layer(i, out, timings)`` is
    called after each layer with a view of its output (copy it to keep it). Workers are forked
    once for the whole chain; ``weights`` ({layer: LayerWeights}) skips binding them again;
    ``stage_timeout`` as in :class:`BlockRunner`. ``repeat`` > 1 runs the whole chain that many
    times on the same workers and arena and keeps the fastest time of every stage (the first run
    pays page faults and cold caches); the output is the same bits every time, and ``on_layer``
    is called during the last run only. ``precision`` ("f32" default, "bf16", "q8") is the
    projections' matmul precision (nxhpc.nn.linear). Returns the last layer's output and a dict
    of summed timings plus ``"per_layer"`` (a list of per-layer timing dicts).
    """
    precision = check_precision(precision, "run_layers: precision")
    cfg = block_view(model.config)
    layers = [int(i) for i in layers]
    if not layers:
        raise ValueError("run_layers: no layers given")
    for i in layers:
        if not 0 <= i < cfg.n_layers:
            raise ValueError(f"run_layers: layer {i} out of range [0, {cfg.n_layers})")
    if t_emb is None:
        if adaln_ms is None or any(i not in adaln_ms for i in layers):
            missing = [i for i in layers if adaln_ms is None or i not in adaln_ms]
            raise ValueError(f"run_layers: need t_emb or adaln_ms for layers {missing}")
        x, pe, mask, _, _ = validate_inputs(cfg, x, pe, mask, adaln_m=adaln_ms[layers[0]])
        ms = {i: _finite_f32(f"adaln_ms[{i}]", adaln_ms[i], (4 * cfg.dim,)) for i in layers}
    else:
        x, pe, mask, t_emb, _ = validate_inputs(cfg, x, pe, mask, t_emb=t_emb)
        ms = None
    n = check_workers(workers)
    eps = _check_eps(eps, cfg)
    spawn = _check_spawn(spawn)
    if isinstance(repeat, bool) or not isinstance(repeat, (int, np.integer)) or repeat < 1:
        raise ValueError(f"run_layers: repeat must be an integer >= 1, got {repeat!r}")
    if weights is None:
        weights = {i: model.layer_weights(i, source) for i in layers}   # bound before the fork
    runner = BlockRunner(cfg, weights, x.shape[0], workers=n, spawn=spawn,
                         stage_timeout=stage_timeout)
    try:
        mods = {i: runner.adaln(i, t_emb) if ms is None else ms[i] for i in layers}
        per_layer: list[dict] = []
        for r in range(int(repeat)):
            last = r == repeat - 1
            runner.set_inputs(x, pe, mask)
            for j, i in enumerate(layers):
                if j:
                    runner.advance()
                t = runner.run(i, mods[i], eps, precision)
                if r == 0:
                    per_layer.append(t)
                else:
                    per_layer[j] = {k: min(v, t[k]) for k, v in per_layer[j].items()}
                if last and on_layer is not None:
                    on_layer(i, runner.output, per_layer[j])
        out = runner.output.copy()
    finally:
        runner.close()
    total = {key: sum(t[key] for t in per_layer) for key in TIMING_KEYS}
    total["per_layer"] = per_layer
    return BlockOutput(out, total)


class Block:
    """Layer ``index`` of ``model``, weights bound once: ``Block(model, i).forward(x, t_emb, pe)``.

    Used as a context manager, the arena and workers are kept between ``forward`` calls with
    the same token count and worker settings (and released on exit); otherwise each call forks
    its workers and releases everything before returning. ``with`` blocks nest: workers are
    kept until the outermost one exits (or :meth:`close` is called).

    Threads: one Block runs one call at a time. ``forward`` and ``close`` hold a lock, so
    calls from several threads are serialized (each waits for the one before; every caller
    gets its own output array). Use one Block per thread to run in parallel.
    """

    def __init__(self, model, index: int, *, source: str = "auto") -> None:
        cfg = block_view(model.config)
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)) \
                or not 0 <= index < cfg.n_layers:
            raise ValueError(f"Block: layer index must be an int in [0, {cfg.n_layers}), "
                             f"got {index!r}")
        self._lock = threading.RLock()
        self._owner = os.getpid()
        self._depth = 0                       # open ``with`` blocks
        self._keep = False
        self._runner: BlockRunner | None = None
        self._runner_key: tuple | None = None
        self.model = model
        self.index = int(index)
        self.config = cfg
        self.weights = model.layer_weights(self.index, source)
        check_layer_weights(self.weights, cfg, self.index)
        #: the last forward's stages: wall time vs the bands' own time
        #: (:class:`nxhpc.nn.engine.StageSplit`)
        self.last_split: tuple = ()

    def adaln(self, t_emb: np.ndarray) -> np.ndarray:
        """m = adaLN(t_emb) (Z-Image: Linear; Lumina-2: SiLU then Linear): float32 [4*dim]."""
        return adaln(self.config, self.weights, t_emb)

    def forward(self, x: np.ndarray, t_emb: np.ndarray | None = None,
                pe: np.ndarray | None = None, mask: np.ndarray | None = None, *,
                adaln_m: np.ndarray | None = None, workers: int | None = None,
                spawn: str | None = None, eps: float | None = None,
                stage_timeout: float | None = None,
                precision: str = DEFAULT_PRECISION,
                out: np.ndarray | None = None) -> BlockOutput:
        """Run the block on ``x`` [T, dim]; returns ``BlockOutput(output, timings)``.

        ``t_emb`` [adaln_in] (or ``adaln_m`` [4*dim] precomputed), ``pe`` [T, hd/2, 2, 2] RoPE
        table, ``mask`` [T] bool (True = attend) or None, ``workers`` (default: usable CPUs),
        ``spawn`` "pool" | "stage", ``eps`` (default: the model's norm eps; a positive value
        float32 holds as a normal number, see :data:`nxhpc.dit.plan.EPS_RANGE`),
        ``stage_timeout`` (seconds per parallel stage, default none: a hung worker is killed
        and reported as ``WorkerError``). Inputs with NaN/inf -- also values that become inf
        in float32, the kernels' type -- or wrong shapes raise ValueError/TypeError before
        anything runs; finite inputs that overflow inside the block raise
        ``nxhpc.runtime.checks.NonFiniteOutputError`` (the NaN output is its ``output``).
        ``precision`` "f32" (default) | "bf16" | "q8" (the projections' matmuls,
        nxhpc.nn.linear). Serialized with other threads' calls (see the class docstring).
        """
        proc.check_owner(self._owner, "Block.forward", "Block")
        precision = check_precision(precision, "Block.forward: precision")
        cfg = self.config
        if pe is None:
            raise ValueError(f"pe (RoPE table [T, {cfg.head_dim // 2}, 2, 2]) is required")
        x, pe, mask, t_emb, adaln_m = validate_inputs(cfg, x, pe, mask, t_emb, adaln_m)
        out = _check_out(out, x.shape)
        n = check_workers(workers)
        eps = _check_eps(eps, cfg)
        spawn = _check_spawn(spawn)
        stage_timeout = check_timeout(stage_timeout)
        m = self.adaln(t_emb) if adaln_m is None else adaln_m
        key = (x.shape[0], n, spawn, stage_timeout)
        with self._lock:
            runner = None
            try:
                runner = self._runner if self._runner_key == key else None
                if runner is None:
                    self._release()
                    runner = BlockRunner(cfg, {self.index: self.weights}, x.shape[0],
                                         workers=n, spawn=spawn, stage_timeout=stage_timeout)
                    if self._keep:
                        self._runner, self._runner_key = runner, key
                runner.set_inputs(x, pe, mask)
                t = runner.run(self.index, m, eps, precision)
                self.last_split = runner.engine.last_split
                if out is None:
                    out = runner.output.copy()
                else:
                    np.copyto(out, runner.output)
            except BaseException:
                if runner is not None and runner is self._runner:
                    self._release()
                elif runner is not None:
                    runner.close()
                raise
            if runner is not self._runner:
                runner.close()
        check_finite_output(out, "Block.forward", "finite inputs overflowed float32 "
                            "inside the block; the output is the error's .output")
        return BlockOutput(out, t)

    def _release(self) -> None:
        with self._lock:
            r, self._runner, self._runner_key = self._runner, None, None
            if r is not None:
                r.close()

    def close(self) -> None:
        """Release kept workers and arena, and stop keeping them (also inside ``with``). In a
        forked child: nothing (the parent's to release)."""
        if os.getpid() != self._owner:
            return
        with self._lock:
            self._depth = 0
            self._keep = False
            self._release()

    def __enter__(self) -> "Block":
        # before the lock: one a parent thread held at a fork is never released in the child
        proc.check_owner(self._owner, "Block.__enter__", "Block")
        with self._lock:
            self._depth += 1
            self._keep = True
        return self

    def __exit__(self, *exc) -> None:
        if os.getpid() != self._owner:      # a forked child leaving the parent's ``with``
            return
        with self._lock:
            self._depth = max(0, self._depth - 1)
            if self._depth == 0:
                self.close()

    def __repr__(self) -> str:
        return f"<Block layer {self.index} of {self.config.variant} dim={self.config.dim}>"

    # pickle, copy.copy, copy.deepcopy: a TypeError, as every object holding workers (a copy
    # shared the kept runner: closing one broke the other with a KeyError)
    __reduce_ex__ = Closing.__reduce_ex__
