"""Run a slice of a model's block stack from its tapped input and grade it at a layer boundary.

Owns :func:`run_stack`, the orchestration behind ``python -m nxhpc.blockrun``: layers ``0..N-1``
of an open :class:`nxhpc.models.Model` from ``layers.0.blk_in``, each with its own adaLN (from
``t_emb`` and the layer's weights, or the tapped ``layers.N.adaln_m``), on the block engine
(:func:`nxhpc.dit.block.run_layers`); choosing and loading the references (the next layer's
tapped input, else the layer's ``ref_out``, or a named fixture / ``.npy`` file); grading every
layer against its own reference and the final output against the chosen one
(:mod:`nxhpc.dit.grade`); and the self-check of layer 0's adaLN recomputed from the GGUF against
the tapped fixture. It also owns :data:`PRECISION_TOL`, the default tolerance per precision.
Must not: parse arguments, print, write files, or open models by id (the caller passes an open
model). Its public entry checks its arguments once (:mod:`nxhpc.runtime.checks`); the engine
below trusts them.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from nxhpc.dit.config import block_view
from nxhpc.dit.grade import DEFAULT_TOL, Grade, count_exceeding, error_row, grade
from nxhpc.formats.fixtures import FIXTURES_FILE
from nxhpc.nn.linear import (DEFAULT_PRECISION, DEFAULT_Q8_FLOAT_WEIGHTS, PRECISIONS, Q8Blocks,
                             attention_kernel, check_q8_float_weights)
from nxhpc.runtime import checks
from nxhpc.runtime.workers import DEFAULT_SPAWN, SPAWN_MODES

__all__ = ["PRECISION_TOL", "StackInputError", "StackRangeError", "StackRun", "run_stack",
           "reference_for"]

#: Default tolerance per precision (max_rel of the graded output). f32 keeps DEFAULT_TOL. bf16 / q8:
#: about 2x the max_rel measured for one block vs the float64 reference (docs/kernels.md,
#: "Precisions through the block"): bf16 1.2e-2 / 1.5e-2 / 1.7e-2 and q8 3.3e-2 / 4.4e-2 /
#: 5.1e-2 on tiny / mid / zimage-1l (max_rel grows slowly with the element count: it is the
#: tail of ~T*D errors whose RMS is 0.2% (bf16) / 0.6% (q8) of the output's).
PRECISION_TOL = {"f32": DEFAULT_TOL, "bf16": 3e-2, "q8": 1e-1}


class StackInputError(checks.CheckError):
    """The model's inputs do not fit its config (a fixture of the wrong shape, a bad eps)."""


class StackRangeError(ValueError):
    """A slice the model does not have (e.g. more layers than it holds)."""


@dataclass
class StackRun:
    """What :func:`run_stack` measured: ``report`` (the run's configuration and timings, in
    print order), ``output`` (the last layer's output), ``grade`` of it against ``reference``
    (None when not graded), and ``per_layer`` (one row per layer: ``layer``, ``block_us`` and,
    when the layer has a reference, its error row; only for more than one layer)."""
    report: dict
    output: np.ndarray
    grade: Grade | None
    reference: str
    per_layer: list[dict] = field(default_factory=list)


def _has(model, name: str) -> bool:
    return model.fixtures is not None and model.fixtures.has(name)


def reference_for(model, layer: int) -> str | None:
    """The default reference of ``layer``'s output: ``layers.{L+1}.blk_in``, else
    ``layers.{L}.ref_out``, else None."""
    for name in (f"layers.{layer + 1}.blk_in", f"layers.{layer}.ref_out"):
        if _has(model, name):
            return name
    return None


def _load_ref(model, name: str, shape: tuple[int, int]) -> np.ndarray:
    """A fixture by name, or a ``.npy`` file (kept at its own float precision): a name ending
    in ``.npy`` or holding a path separator is a file (``InputFileMissing`` when it is missing
    or not a regular file, not "no such fixture")."""
    from nxhpc.formats.gguf_io import MissingTensorError, ModelFileError
    if name.endswith(".npy") or os.sep in name:
        checks.check_input_file(name, "reference", "a .npy file")
        a = checks.load_npy(name, "reference", error=ModelFileError)
        if a.shape != shape or a.dtype.kind != "f":
            raise ModelFileError(f"reference {name}: {a.dtype} {a.shape}, expected a "
                                 f"floating-point array of shape {shape}")
        bad = int(a.size - np.count_nonzero(np.isfinite(a)))
        if bad:
            raise ModelFileError(f"reference {name}: {bad} of {a.size} elements are NaN or "
                                 f"inf; a reference must be finite")
        return a
    if not _has(model, name):
        raise MissingTensorError(f"reference {name!r}: no such fixture in "
                                 f"{model.fixtures.path if model.fixtures else model.path}")
    return model.fixtures.load(name, shape)


def check_slice(model, layers: int | str = 1) -> int:
    """The number of layers ``layers`` (an int >= 1 or ``'all'``) means for ``model``;
    StackRangeError beyond its depth, StackInputError for a config the block cannot run."""
    cfg = model.config
    try:
        block_view(cfg)                   # the block's runnable rules, on the block view
    except ValueError as e:
        raise StackInputError(f"{model.path}: {e}") from None
    n = cfg.n_layers if layers == "all" else checks.check_count(layers, "layers")
    if n > cfg.n_layers:
        raise StackRangeError(f"--layers {n}: the model has only {cfg.n_layers} layers")
    return n


def run_stack(model, *, layers: int | str = 1, workers: int | None = None,
              spawn: str = DEFAULT_SPAWN, eps: float | None = None,
              precision: str = DEFAULT_PRECISION, source: str = "auto", adaln: str = "auto",
              reference: str | None = None, tol: float | None = None,
              stage_timeout: float | None = None, repeat: int = 1,
              on_layer: Callable[[dict, int], None] | None = None,
              q8_float_weights: str = DEFAULT_Q8_FLOAT_WEIGHTS,
              grade_output: bool = True) -> StackRun:
    """Run layers ``0..layers-1`` of ``model`` (an open ``nxhpc.models.Model``) from
    ``layers.0.blk_in`` and grade the last output against ``reference`` (a fixture name or a
    ``.npy`` path; default :func:`reference_for` the last layer) with ``tol`` (default
    :data:`PRECISION_TOL` of ``precision``). ``adaln``: ``'t_emb'`` (each layer's adaLN from
    ``t_emb``), ``'fixture'`` (the tapped ``layers.N.adaln_m``) or ``'auto'`` (t_emb when
    present). ``q8_float_weights``: how ``q8`` runs float projections (``nxhpc.nn.linear``:
    ``"int8"`` copies made here, before the fork, or ``"bf16"`` as stored).
    ``on_layer(row, n_layers)`` after each layer (the row of :class:`StackRun`'s
    ``per_layer``). ``grade_output=False`` (an MPI rank other than 0, which reports nothing):
    the last output is not graded and the reference not read (a ``.npy`` reference need exist
    on rank 0 only); the result's ``grade`` is None.
    Raises the ``formats`` errors (``MissingTensorError`` for a missing input or
    reference), :class:`StackInputError`, :class:`StackRangeError`, ``WorkerError``."""
    from nxhpc.dit.block import adaln as adaln_vector, run_layers, validate_inputs
    from nxhpc.dit.plan import check_eps
    from nxhpc.formats.gguf_io import MissingTensorError
    workers = checks.check_workers(workers)
    checks.check_choice(spawn, SPAWN_MODES, "spawn")
    checks.check_choice(precision, PRECISIONS, "precision")
    q8_float_weights = check_q8_float_weights(q8_float_weights)
    checks.check_choice(source, ("auto", "gguf", "fixtures"), "source")
    checks.check_choice(adaln, ("auto", "t_emb", "fixture"), "adaln")
    repeat = checks.check_count(repeat, "repeat")
    stage_timeout = checks.check_seconds(stage_timeout, "stage_timeout")
    tol = PRECISION_TOL[precision] if tol is None else checks.check_positive(tol, "tol")
    n_layers = check_slice(model, layers)
    cfg = model.config
    ids = list(range(n_layers))
    if eps is None:
        eps = cfg.norm_eps
        try:
            check_eps(eps)
        except ValueError as e:
            raise StackInputError(f"{model.path}: the model's norm eps: {e}") from None
    else:
        try:
            check_eps(eps)
        except ValueError as e:
            raise StackInputError(f"eps: {e}") from None
    if model.fixtures is None:          # a bare .gguf: no directory, no fixtures beside it
        where = model.path if model.path is not None else getattr(model.gguf, "path", "model")
        raise MissingTensorError(f"{where}: no {FIXTURES_FILE} (the block input "
                                 f"'layers.0.blk_in' and the references are fixtures): run a "
                                 f"model directory that has one, or give the .gguf as "
                                 f"gguf_path after a model directory")
    if not model.fixtures.has("layers.0.blk_in"):
        raise MissingTensorError(f"{model.path}: missing fixture 'layers.0.blk_in' "
                                 f"(the block input)")
    x = model.blk_in(0)
    T = x.shape[0]
    pe = model.pe()
    mask = model.mask()

    report: dict = {"model": str(model.path), "variant": cfg.variant, "dim": cfg.dim,
                    "tokens": T, "heads": cfg.n_heads, "kv_heads": cfg.n_kv_heads,
                    "head_dim": cfg.head_dim, "qkv_width": cfg.qkv_width,
                    "ffn_dim": cfg.ffn_dim, "workers": workers, "spawn": spawn,
                    "layers": n_layers, "repeat": repeat, "eps": eps,
                    "precision": precision, "attention": attention_kernel(precision),
                    "mask": mask is not None,
                    "gguf_tensors": len(model.gguf.names()) if model.gguf is not None else 0}

    # modulation source
    use_t = adaln in ("auto", "t_emb") and _has(model, "t_emb")
    if adaln == "t_emb" and not use_t:
        raise MissingTensorError(f"{model.path}: --adaln t_emb but fixture 't_emb' is missing")
    t_emb = model.t_emb() if use_t else None
    adaln_ms = None
    if not use_t:
        missing = [f"layers.{i}.adaln_m" for i in ids if not _has(model, f"layers.{i}.adaln_m")]
        if missing:
            raise MissingTensorError(f"{model.path}: need fixture 't_emb' or {', '.join(missing)}")
        adaln_ms = {i: model.adaln_m(i) for i in ids}
    report["adaln"] = "t_emb" if use_t else "fixture"
    try:                                  # the fixtures against the model's config
        validate_inputs(cfg, x, pe, mask, t_emb=t_emb,
                        adaln_m=None if use_t else adaln_ms[ids[0]])
    except (ValueError, TypeError) as e:
        raise StackInputError(f"{model.path}: {e}") from None

    weights = {i: model.layer_weights(i, source) for i in ids}
    report["weights"] = weights[0].source
    if precision == "q8":
        import nxhpc
        from nxhpc.dit.binding import LayerWeights
        weights = Q8Blocks(weights, LayerWeights.PROJECTIONS).get(nxhpc.kernels(),
                                                                  q8_float_weights, workers)
    report["q8_float_weights"] = q8_float_weights

    # self-check of the source runner: layer 0's adaLN from the GGUF vs the tapped fixture
    if model.gguf is not None and _has(model, "t_emb") and _has(model, "layers.0.adaln_m"):
        g0 = weights[0] if weights[0].source == "gguf" else model.layer_weights(0, "gguf")
        calc = adaln_vector(cfg, g0, model.t_emb())
        report["adaln_gguf_vs_fixture_fail_1e3"] = count_exceeding(calc, model.adaln_m(0), 1e-3,
                                                                   "layers.0.adaln_m")

    # references
    final_ref = reference or reference_for(model, ids[-1])
    if final_ref is None:
        raise MissingTensorError(f"{model.path}: no reference for layer {ids[-1]}: neither "
                                 f"'layers.{ids[-1] + 1}.blk_in' nor "
                                 f"'layers.{ids[-1]}.ref_out' exists (name one: reference=, "
                                 f"blockrun's reference_name)")
    ref_final = _load_ref(model, final_ref, (T, cfg.dim)) if grade_output else None
    per_refs = {}
    if n_layers > 1:
        for i in ids:
            name = reference_for(model, i)
            if name is not None:
                per_refs[i] = name

    table: list[dict] = []

    def layer_done(i, out, timings):
        row = {"layer": i, "block_us": timings["block_us"]}
        if i in per_refs:
            ref = model.fixtures.load(per_refs[i], (T, cfg.dim))
            row.update(error_row(out, ref))
            row["reference"] = per_refs[i]
        table.append(row)
        if on_layer is not None:
            on_layer(row, n_layers)

    res = run_layers(model, ids, x, pe, t_emb=t_emb, adaln_ms=adaln_ms, mask=mask,
                     workers=workers, spawn=spawn, eps=eps, on_layer=layer_done,
                     weights=weights, stage_timeout=stage_timeout, repeat=repeat,
                     precision=precision)
    for k, v in res.timings.items():
        if k != "per_layer":
            report[k] = v
    g = grade(res.output, ref_final, tol=tol, reference=final_ref) if grade_output else None
    return StackRun(report, res.output, g, final_ref, table if n_layers > 1 else [])
