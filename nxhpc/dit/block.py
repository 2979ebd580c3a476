"""The block pipeline: one DiT layer (docs/block.md) end to end on nxhpc's C kernels, in forked workers.

Owns: input validation, weight binding checks, the stage order and per-stage timings, the arena
layout, and chaining consecutive layers. Must not: parse files (``nxhpc.models`` does), compute
anything in Python/numpy beyond O(D) adaLN bookkeeping, or run BLAS/OpenMP inside workers (only
``nxhpc._kernels`` runs there).

Stage order and timing keys follow the source runner::

    us_prenorm_qkv  h = rmsnorm(x, attention_norm1) * (1+scale_msa); qkv = h @ Wqkv^T
    us_qknorm_rope  q, k = rope(rmsnorm_hd(q|k)) written as [H, T, hd] / [KVH, T, hd]
    us_sdpa         o = softmax(q k^T / sqrt(hd) [+ mask]) v          (bands of query heads)
    us_attn_tail    mid = x + tanh(gate_msa) * rmsnorm(o @ Wout^T, attention_norm2)
    us_ffn          h2 = rmsnorm(mid, ffn_norm1) * (1+scale_mlp); f = silu(h2 W1^T) * (h2 W3^T);
                    out = mid + tanh(gate_mlp) * rmsnorm(f @ W2^T, ffn_norm2)
    block_us        the whole block (adaLN excluded: it is O(D) and computed before)

Parallel split: matmuls by output columns (weight rows), qk-norm+RoPE by the combined head index
over ``H + KVH``, attention by query heads (``min(workers, H)`` workers), row-wise stages by token
rows, SwiGLU by flat elements; always ``[i*m//n, (i+1)*m//n)``. Because every kernel gives
bit-identical results for any band split, the output is bit-identical for every worker count and
both spawn modes. Every buffer lives in one :class:`~nxhpc.runtime.shm.SharedArena`; workers are forked
after the weights are bound (Q8_0 stays in the memory map, shared copy-on-write). Normalized
outputs overwrite their inputs where the kernels allow it (``rmsnorm`` of ``atto`` / ``f2`` and
``swiglu`` into ``f1`` run in place; ``h`` is reused for ``h2``): the arena holds
``T*(8*D + KVH*hd + qkv_width + 2*F)`` floats plus ``pe`` and ``mask`` instead of
``T*(11*D + KVH*hd + qkv_width + 3*F)`` (1.09 GB instead of 1.45 GB at Z-Image size, T=4096).
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from nxhpc.runtime.shm import SharedArena
from nxhpc.runtime.workers import DEFAULT_SPAWN, SPAWN_MODES, WorkerPool, check_timeout, usable_cpus

__all__ = ["Block", "BlockOutput", "BlockRunner", "run_layers", "adaln", "TIMING_KEYS", "check_config",
           "check_layer_weights", "validate_inputs"]

TIMING_KEYS = ("us_prenorm_qkv", "us_qknorm_rope", "us_sdpa", "us_attn_tail", "us_ffn",
               "block_us")


class BlockOutput(NamedTuple):
    """``output``: float32 [T, D] (a fresh array); ``timings``: microseconds per stage."""
    output: np.ndarray
    timings: dict


def _kernels_module():
    import nxhpc._kernels as k
    return k


# --------------------------------------------------------------------------------- validation
def check_config(cfg) -> None:
    """The block's structural requirements on a BlockConfig; ValueError naming the field."""
    D, H, KVH, hd, F = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim
    problems = []
    if D <= 0 or D % 32:
        problems.append(f"dim={D} must be a positive multiple of 32 (Q8_0 blocks)")
    if F <= 0 or F % 32:
        problems.append(f"ffn_dim={F} must be a positive multiple of 32")
    if H <= 0 or KVH <= 0 or H % KVH:
        problems.append(f"n_heads={H} must be a positive multiple of n_kv_heads={KVH}")
    if hd <= 0 or hd % 2:
        problems.append(f"head_dim={hd} must be positive and even (RoPE pairs)")
    if H * hd != D:
        problems.append(f"n_heads*head_dim={H}*{hd}={H * hd} must equal dim={D}")
    if cfg.adaln_in <= 0:
        problems.append(f"adaln_in={cfg.adaln_in} must be positive")
    if problems:
        raise ValueError("block config: " + "; ".join(problems))


def _q8_shape(rows: int, cols: int) -> tuple[int, int]:
    return (rows, cols // 32 * 34)


def check_layer_weights(w, cfg, layer: int) -> None:
    """Check every tensor of a LayerWeights against the config; ValueError naming the tensor."""
    D, F, hd = cfg.dim, cfg.ffn_dim, cfg.head_dim
    qkvw = (cfg.n_heads + 2 * cfg.n_kv_heads) * hd
    want_q8 = {"qkv": _q8_shape(qkvw, D), "out": _q8_shape(D, D), "w1": _q8_shape(F, D),
               "w3": _q8_shape(F, D), "w2": _q8_shape(D, F)}
    for name, shape in want_q8.items():
        a = getattr(w, name, None)
        if not isinstance(a, np.ndarray) or a.dtype != np.uint8 or a.shape != shape:
            got = (f"{a.dtype} {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__)
            raise ValueError(f"layer {layer}: weight {name!r} must be Q8_0 uint8 {shape}, got {got}")
        if not a.flags.c_contiguous:
            raise ValueError(f"layer {layer}: weight {name!r} is not C-contiguous")
    want_f = {"attention_norm1": D, "attention_norm2": D, "ffn_norm1": D, "ffn_norm2": D,
              "q_norm": hd, "k_norm": hd, "adaln_b": 4 * D}
    for name, n in want_f.items():
        a = getattr(w, name, None)
        if not isinstance(a, np.ndarray) or a.dtype != np.float32 or a.shape != (n,):
            got = (f"{a.dtype} {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__)
            raise ValueError(f"layer {layer}: weight {name!r} must be float32 ({n},), got {got}")
    a = w.adaln_w
    ok = isinstance(a, np.ndarray) and (
        (a.dtype == np.float32 and a.shape == (4 * D, cfg.adaln_in))
        or (a.dtype == np.uint8 and a.shape == _q8_shape(4 * D, cfg.adaln_in)))
    if not ok:
        got = f"{a.dtype} {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
        raise ValueError(f"layer {layer}: weight 'adaln_w' must be float32 {(4 * D, cfg.adaln_in)} "
                         f"or Q8_0 uint8 {_q8_shape(4 * D, cfg.adaln_in)}, got {got}")


def _finite_f32(name: str, a: Any, shape: tuple[int, ...]) -> np.ndarray:
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray, got {type(a).__name__}")
    if a.dtype.kind != "f":
        raise TypeError(f"{name} must be a floating-point array, got dtype={a.dtype}")
    if a.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {a.shape}")
    fin = np.isfinite(a)
    if not fin.all():
        bad = np.argwhere(~fin)
        raise ValueError(f"{name} has {len(bad)} non-finite values (NaN/inf), first at index "
                         f"{tuple(int(i) for i in bad[0])}; refusing to run")
    return np.ascontiguousarray(a, dtype=np.float32)


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


def _check_workers(workers) -> int:
    if workers is None:
        return usable_cpus()
    if isinstance(workers, bool) or not isinstance(workers, (int, np.integer)) or workers < 1:
        raise ValueError(f"workers must be an int >= 1, got {workers!r}")
    return int(workers)


def _check_spawn(spawn) -> str:
    if spawn is None:
        return DEFAULT_SPAWN
    if spawn not in SPAWN_MODES:
        raise ValueError(f"spawn must be one of {SPAWN_MODES}, got {spawn!r}")
    return spawn


def _check_eps(eps, cfg) -> float:
    if eps is None:
        eps = cfg.norm_eps
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) \
            or eps <= 0:
        raise ValueError(f"eps must be a positive finite number, got {eps!r}")
    return float(eps)


def adaln(cfg, weights, t_emb: np.ndarray, *, kernels=None) -> np.ndarray:
    """m = adaLN(t_emb) with a layer's weights (SiLU first when ``cfg.adaln_silu``): float32 [4D].

    The weight is used as stored (Q8_0 straight from the map, or float32): ``adaln_linear``
    gives bit-identical output for a Q8_0 weight and its float32 dequantization, so the GGUF
    path and the fixture path give the same modulation, and no dequantized copy is made.
    """
    k = kernels if kernels is not None else _kernels_module()
    t = _finite_f32("t_emb", t_emb, (cfg.adaln_in,))
    m = np.empty(4 * cfg.dim, dtype=np.float32)
    k.adaln_linear(t, np.ascontiguousarray(weights.adaln_w), weights.adaln_b, m,
                   silu_input=bool(cfg.adaln_silu))
    return m


# --------------------------------------------------------------------------------- the runner
class BlockRunner:
    """Arena + workers + bound weights for running layers of one model at ``T`` tokens.

    Create it after the layers' weights are bound: the pool forks here. ``run(layer, adaln)``
    runs one block on ``arena["x"]`` into ``arena["out"]``; :func:`run_layers` chains them.
    ``stage_timeout`` (seconds, None = none) bounds each parallel stage: a worker that hangs
    is killed and reported as a :class:`~nxhpc.runtime.workers.WorkerError`.
    """

    def __init__(self, cfg, layers: dict, T: int, *, workers: int, spawn: str = DEFAULT_SPAWN,
                 kernels=None, stage_timeout: float | None = None) -> None:
        check_config(cfg)
        spawn = _check_spawn(spawn)
        stage_timeout = check_timeout(stage_timeout)
        for i, w in layers.items():
            check_layer_weights(w, cfg, i)
        self.cfg = cfg
        self.T = T
        self.workers = _check_workers(workers)
        self.spawn = spawn
        self.k = kernels if kernels is not None else _kernels_module()
        self.layers = dict(layers)
        D, H, KVH, hd, F = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim
        self.qkv_width = (H + 2 * KVH) * hd
        self._use_mask = False
        # h: normed input of the qkv matmul, then of the FFN (h2); atto/f2: projection outputs,
        # normalized in place; f1: w1 output, then silu(f1) * f3 in place.
        self.arena = SharedArena({
            "x": (T, D), "h": (T, D), "qkv": (T, self.qkv_width), "q": (H, T, hd),
            "k": (KVH, T, hd), "attn": (T, H * hd), "atto": (T, D), "mid": (T, D),
            "f1": (T, F), "f3": (T, F), "f2": (T, D), "out": (T, D), "pe": (T, hd // 2, 2, 2),
            "mask": ((T,), np.uint8), "adaln": (4 * D,), "mod_msa": (D,), "mod_mlp": (D,),
        })
        try:
            a = self.arena
            self._v = {name: a[name] for name in a}
            self._v["gate_msa"] = a["adaln"][D:2 * D]
            self._v["gate_mlp"] = a["adaln"][3 * D:4 * D]
            self.pool = WorkerPool(self.workers, self._tasks(), mode=spawn,
                                   stage_timeout=stage_timeout)
        except BaseException:
            self._v.clear()
            self.arena.close()
            raise

    # Each task runs in a worker on its band; arg = (layer, eps, use_mask).
    def _tasks(self) -> dict[str, Callable[[int, int, Any], None]]:
        k, v, cfg = self.k, self._v, self.cfg
        H, KVH = cfg.n_heads, cfg.n_kv_heads
        scale = 1.0 / math.sqrt(cfg.head_dim)

        def norm1(lo, hi, arg):
            w = self.layers[arg[0]]
            k.rmsnorm(v["x"], w.attention_norm1, v["h"], arg[1], mod=v["mod_msa"], r0=lo, r1=hi)

        def qkv(lo, hi, arg):
            k.q8_0_matmul(v["h"], self.layers[arg[0]].qkv, v["qkv"], n0=lo, n1=hi)

        def qknorm_rope(lo, hi, arg):
            w = self.layers[arg[0]]
            k.qknorm_rope(v["qkv"], w.q_norm, w.k_norm, v["pe"], v["q"], v["k"], H, KVH, arg[1],
                          h0=lo, h1=hi)

        def sdpa(lo, hi, arg):
            k.attention(v["q"], v["k"], v["qkv"], v["attn"], KVH, scale,
                        mask=v["mask"] if arg[2] else None, h0=lo, h1=hi)

        def out_proj(lo, hi, arg):
            k.q8_0_matmul(v["attn"], self.layers[arg[0]].out, v["atto"], n0=lo, n1=hi)

        def attn_tail(lo, hi, arg):
            w = self.layers[arg[0]]
            k.rmsnorm(v["atto"], w.attention_norm2, v["atto"], arg[1], r0=lo, r1=hi)
            k.gated_residual(v["x"], v["atto"], v["gate_msa"], v["mid"], r0=lo, r1=hi)

        def ffn_norm(lo, hi, arg):
            w = self.layers[arg[0]]
            k.rmsnorm(v["mid"], w.ffn_norm1, v["h"], arg[1], mod=v["mod_mlp"], r0=lo, r1=hi)

        def w13(lo, hi, arg):
            w = self.layers[arg[0]]
            k.q8_0_matmul(v["h"], w.w1, v["f1"], n0=lo, n1=hi)
            k.q8_0_matmul(v["h"], w.w3, v["f3"], n0=lo, n1=hi)

        def swiglu(lo, hi, arg):
            k.swiglu(v["f1"], v["f3"], v["f1"], i0=lo, i1=hi)

        def w2(lo, hi, arg):
            k.q8_0_matmul(v["f1"], self.layers[arg[0]].w2, v["f2"], n0=lo, n1=hi)

        def ffn_tail(lo, hi, arg):
            w = self.layers[arg[0]]
            k.rmsnorm(v["f2"], w.ffn_norm2, v["f2"], arg[1], r0=lo, r1=hi)
            k.gated_residual(v["mid"], v["f2"], v["gate_mlp"], v["out"], r0=lo, r1=hi)

        return {"norm1": norm1, "qkv": qkv, "qknorm_rope": qknorm_rope, "sdpa": sdpa,
                "out_proj": out_proj, "attn_tail": attn_tail, "ffn_norm": ffn_norm, "w13": w13,
                "swiglu": swiglu, "w2": w2, "ffn_tail": ffn_tail}

    def adaln(self, layer: int, t_emb: np.ndarray) -> np.ndarray:
        """m = adaLN(t_emb) for ``layer`` (SiLU first for Lumina-2), float32 [4D], via the kernel."""
        return adaln(self.cfg, self.layers[layer], t_emb, kernels=self.k)

    def set_inputs(self, x: np.ndarray, pe: np.ndarray, mask: np.ndarray | None) -> None:
        """Copy validated float32 x / pe and the uint8 mask into the arena."""
        np.copyto(self._v["x"], x)
        np.copyto(self._v["pe"], pe)
        if mask is not None:
            np.copyto(self._v["mask"], mask)
        self._use_mask = mask is not None

    def run(self, layer: int, adaln_m: np.ndarray, eps: float) -> dict:
        """One block on arena x -> arena out with modulation ``adaln_m`` [4D]. Returns timings."""
        if layer not in self.layers:
            raise KeyError(f"BlockRunner: layer {layer} was not bound (have {sorted(self.layers)})")
        cfg, v, T, p = self.cfg, self._v, self.T, self.pool
        D = cfg.dim
        np.copyto(v["adaln"], adaln_m)
        one = np.float32(1.0)
        np.add(one, v["adaln"][0:D], out=v["mod_msa"])
        np.add(one, v["adaln"][2 * D:3 * D], out=v["mod_mlp"])
        arg = (layer, eps, self._use_mask)
        now = time.perf_counter_ns
        t0 = now()
        p.run("norm1", T, arg=arg)
        p.run("qkv", self.qkv_width, arg=arg)
        t1 = now()
        p.run("qknorm_rope", cfg.n_heads + cfg.n_kv_heads, arg=arg)
        t2 = now()
        p.run("sdpa", cfg.n_heads, arg=arg)
        t3 = now()
        p.run("out_proj", D, arg=arg)
        p.run("attn_tail", T, arg=arg)
        t4 = now()
        p.run("ffn_norm", T, arg=arg)
        p.run("w13", cfg.ffn_dim, arg=arg)
        p.run("swiglu", T * cfg.ffn_dim, arg=arg)
        p.run("w2", D, arg=arg)
        p.run("ffn_tail", T, arg=arg)
        t5 = now()
        us = lambda a, b: (b - a) // 1000  # noqa: E731
        return {"us_prenorm_qkv": us(t0, t1), "us_qknorm_rope": us(t1, t2), "us_sdpa": us(t2, t3),
                "us_attn_tail": us(t3, t4), "us_ffn": us(t4, t5), "block_us": us(t0, t5)}

    @property
    def output(self) -> np.ndarray:
        """The arena's output buffer (a view: copy it before the next run)."""
        return self._v["out"]

    def advance(self) -> None:
        """Make the last output the next layer's input (x := out)."""
        np.copyto(self._v["x"], self._v["out"])

    def close(self) -> None:
        """Stop the workers, then unlink and unmap the arena. Idempotent.

        The views are dropped in place (the task closures share the dict), so the mapping is
        released now rather than at the next cyclic garbage collection.
        """
        try:
            pool = getattr(self, "pool", None)
            if pool is not None:
                pool.close()
        finally:
            self._v.clear()
            self.arena.close()

    def __enter__(self) -> "BlockRunner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_layers(model, layers: Sequence[int], x: np.ndarray, pe: np.ndarray, *,
               t_emb: np.ndarray | None = None, adaln_ms: dict | None = None,
               mask: np.ndarray | None = None, workers: int | None = None,
               spawn: str | None = None, eps: float | None = None, source: str = "auto",
               on_layer: Callable[[int, np.ndarray, dict], None] | None = None,
               kernels=None, weights: dict | None = None,
               stage_timeout: float | None = None, repeat: int = 1) -> BlockOutput:
    """Run consecutive ``layers`` of ``model``: layer i's output is layer i+1's input.

    Each layer's modulation comes from ``t_emb`` with that layer's adaLN weights, or from
    ``adaln_ms[i]`` (precomputed, [4D]) when ``t_emb`` is None. ``on_layer(i, out, timings)`` is
    called after each layer with a view of its output (copy it to keep it). Workers are forked
    once for the whole chain; ``weights`` ({layer: LayerWeights}) skips binding them again;
    ``stage_timeout`` as in :class:`BlockRunner`. ``repeat`` > 1 runs the whole chain that many
    times on the same workers and arena and keeps the fastest time of every stage (the first run
    pays page faults and cold caches); the output is the same bits every time, and ``on_layer``
    is called during the last run only. Returns the last layer's output and a dict of summed
    timings plus ``"per_layer"`` (a list of per-layer timing dicts).
    """
    cfg = model.config
    check_config(cfg)
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
    n = _check_workers(workers)
    eps = _check_eps(eps, cfg)
    spawn = _check_spawn(spawn)
    if isinstance(repeat, bool) or not isinstance(repeat, (int, np.integer)) or repeat < 1:
        raise ValueError(f"run_layers: repeat must be an integer >= 1, got {repeat!r}")
    if weights is None:
        weights = {i: model.layer_weights(i, source) for i in layers}   # bound before the fork
    runner = BlockRunner(cfg, weights, x.shape[0], workers=n, spawn=spawn, kernels=kernels,
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
                t = runner.run(i, mods[i], eps)
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
    its workers and releases everything before returning.
    """

    def __init__(self, model, index: int, *, source: str = "auto", kernels=None) -> None:
        cfg = model.config
        check_config(cfg)
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)) \
                or not 0 <= index < cfg.n_layers:
            raise ValueError(f"Block: layer index must be an int in [0, {cfg.n_layers}), "
                             f"got {index!r}")
        self.model = model
        self.index = int(index)
        self.config = cfg
        self.weights = model.layer_weights(self.index, source)
        check_layer_weights(self.weights, cfg, self.index)
        self._kernels = kernels
        self._keep = False
        self._runner: BlockRunner | None = None
        self._runner_key: tuple | None = None

    @property
    def kernels(self):
        return self._kernels if self._kernels is not None else _kernels_module()

    def adaln(self, t_emb: np.ndarray) -> np.ndarray:
        """m = adaLN(t_emb) (Z-Image: Linear; Lumina-2: SiLU then Linear): float32 [4*dim]."""
        return adaln(self.config, self.weights, t_emb, kernels=self._kernels)

    def forward(self, x: np.ndarray, t_emb: np.ndarray | None = None,
                pe: np.ndarray | None = None, mask: np.ndarray | None = None, *,
                adaln_m: np.ndarray | None = None, workers: int | None = None,
                spawn: str | None = None, eps: float | None = None,
                stage_timeout: float | None = None) -> BlockOutput:
        """Run the block on ``x`` [T, dim]; returns ``BlockOutput(output, timings)``.

        ``t_emb`` [adaln_in] (or ``adaln_m`` [4*dim] precomputed), ``pe`` [T, hd/2, 2, 2] RoPE
        table, ``mask`` [T] bool (True = attend) or None, ``workers`` (default: usable CPUs),
        ``spawn`` "pool" | "stage", ``eps`` (default: the model's norm eps), ``stage_timeout``
        (seconds per parallel stage, default none: a hung worker is killed and reported as
        ``WorkerError``). Inputs with NaN/inf or wrong shapes raise ValueError/TypeError before
        anything runs.
        """
        cfg = self.config
        if pe is None:
            raise ValueError(f"pe (RoPE table [T, {cfg.head_dim // 2}, 2, 2]) is required")
        x, pe, mask, t_emb, adaln_m = validate_inputs(cfg, x, pe, mask, t_emb, adaln_m)
        n = _check_workers(workers)
        eps = _check_eps(eps, cfg)
        spawn = _check_spawn(spawn)
        stage_timeout = check_timeout(stage_timeout)
        m = self.adaln(t_emb) if adaln_m is None else adaln_m
        key = (x.shape[0], n, spawn, stage_timeout)
        runner = self._runner if self._runner_key == key else None
        if runner is None:
            self._release()
            runner = BlockRunner(cfg, {self.index: self.weights}, x.shape[0], workers=n,
                                 spawn=spawn, kernels=self._kernels, stage_timeout=stage_timeout)
            if self._keep:
                self._runner, self._runner_key = runner, key
        try:
            runner.set_inputs(x, pe, mask)
            t = runner.run(self.index, m, eps)
            out = runner.output.copy()
        except BaseException:
            if runner is self._runner:
                self._release()
            else:
                runner.close()
            raise
        if runner is not self._runner:
            runner.close()
        return BlockOutput(out, t)

    def _release(self) -> None:
        r, self._runner, self._runner_key = self._runner, None, None
        if r is not None:
            r.close()

    def close(self) -> None:
        """Release kept workers and arena (only relevant inside ``with``)."""
        self._keep = False
        self._release()

    def __enter__(self) -> "Block":
        self._keep = True
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Block layer {self.index} of {self.config.variant} dim={self.config.dim}>"
