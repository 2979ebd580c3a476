"""Model ids and directories, the block config inferred from tensors, synthetic models.

Owns: resolving a model id (built-in, ``$NXHPC_MODELS/<id>``, or a path) to a directory holding
``model.gguf`` + ``fixtures.safetensors``; inferring and validating :class:`BlockConfig` from
tensor shapes (Z-Image vs Lumina-2 from the adaLN naming); binding one layer's weights as
:class:`LayerWeights` (Q8_0 as zero-copy read-only views of the map); generating synthetic
models deterministically (weights quantized to Q8_0, ``pe`` from real position ids, reference
outputs from the float64 oracle ``nxhpc.dit.reference``); and the ``python -m nxhpc.models`` CLI.
It never runs the kernels.

Projection weights stored as F32/F16/BF16 in a user's file are quantized to Q8_0 at load (with
a warning; their names are listed in ``LayerWeights.requantized``) instead of failing.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import numpy as np

from nxhpc.dit import rope as _rope
from nxhpc.formats.fixtures import FIXTURES_FILE, FixtureStore
from nxhpc.formats.gguf_io import (PREFIX, Q8_0_BLOCK, QK8_0, GGUFFile, MissingTensorError, ModelError,
                           ModelFileError, ModelNotFoundError, Q8_0Tensor, dequantize_q8_0,
                           quantize_q8_0, write_gguf)

__all__ = [
    "BlockConfig", "LayerWeights", "Model", "open_model", "models_dir", "DEFAULT_MODEL_ID",
    "BUILTIN_MODELS", "SyntheticSpec", "make_synthetic", "ensure_builtin", "infer_config",
    "layer_tensor_names", "write_model_dir", "ModelError", "ModelNotFoundError", "ModelFileError",
    "MissingTensorError", "GGUF_FILE", "main",
]

GGUF_FILE = "model.gguf"
SPEC_FILE = "synthetic.json"
GENERATOR_VERSION = 2
DEFAULT_NORM_EPS = 1e-5

# short name -> tensor name inside layer i (adaLN naming depends on the variant)
_LAYER_SUFFIX = {
    "qkv": "attention.qkv.weight",
    "out": "attention.out.weight",
    "w1": "feed_forward.w1.weight",
    "w3": "feed_forward.w3.weight",
    "w2": "feed_forward.w2.weight",
    "attention_norm1": "attention_norm1.weight",
    "attention_norm2": "attention_norm2.weight",
    "ffn_norm1": "ffn_norm1.weight",
    "ffn_norm2": "ffn_norm2.weight",
    "q_norm": "attention.q_norm.weight",
    "k_norm": "attention.k_norm.weight",
}
_PROJECTIONS = ("qkv", "out", "w1", "w3", "w2")
_NORMS = ("attention_norm1", "attention_norm2", "ffn_norm1", "ffn_norm2", "q_norm", "k_norm")
_FLOAT_TYPES = ("F32", "F16", "BF16")


# ----------------------------------------------------------------------------- config

@dataclass(frozen=True)
class BlockConfig:
    """Dimensions of one DiT block (identical for every layer of a model)."""
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    n_layers: int
    adaln_in: int          # 256 (Z-Image) or 1024 (Lumina-2)
    variant: str           # "zimage" | "lumina2"
    adaln_silu: bool       # True for Lumina-2 (SiLU before the adaLN Linear)
    norm_eps: float = DEFAULT_NORM_EPS

    @property
    def qkv_width(self) -> int:
        """Rows of the fused qkv weight: ``(n_heads + 2 n_kv_heads) head_dim``."""
        return (self.n_heads + 2 * self.n_kv_heads) * self.head_dim

    def validate(self) -> "BlockConfig":
        """Raise ValueError unless the dims are consistent and Q8_0-compatible."""
        c = self
        errs = []
        if min(c.dim, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_dim, c.n_layers, c.adaln_in) < 1:
            errs.append("all dims must be positive")
        else:
            if c.n_heads * c.head_dim != c.dim:
                errs.append(f"n_heads*head_dim = {c.n_heads * c.head_dim} != dim {c.dim}")
            if c.n_heads % c.n_kv_heads:
                errs.append(f"n_heads {c.n_heads} not a multiple of n_kv_heads {c.n_kv_heads}")
            if c.head_dim % 2:
                errs.append(f"head_dim {c.head_dim} is odd")
            for nm in ("dim", "ffn_dim", "adaln_in"):
                if getattr(c, nm) % QK8_0:
                    errs.append(f"{nm} {getattr(c, nm)} is not a multiple of {QK8_0}")
        if c.variant not in ("zimage", "lumina2"):
            errs.append(f"variant {c.variant!r} is not 'zimage' or 'lumina2'")
        if not (0 < c.norm_eps < 1):
            errs.append(f"norm_eps {c.norm_eps} out of range")
        if errs:
            raise ValueError("BlockConfig: " + "; ".join(errs))
        return self

    def summary(self) -> str:
        """One line: variant, dims, heads, FFN, layers, adaLN, eps."""
        kv = "" if self.n_kv_heads == self.n_heads else f" (GQA, {self.n_kv_heads} kv heads)"
        return (f"{self.variant}: D={self.dim}, {self.n_heads} heads x {self.head_dim}{kv}, "
                f"FFN {self.ffn_dim}, {self.n_layers} layer{'s' if self.n_layers != 1 else ''}, "
                f"adaLN {self.adaln_in}{' (SiLU)' if self.adaln_silu else ''}, "
                f"eps {self.norm_eps:g}")


def layer_tensor_names(i: int, variant: str) -> dict[str, str]:
    """Short name -> canonical (prefix-free) tensor name for layer ``i``."""
    idx = 1 if variant == "lumina2" else 0
    names = {k: f"layers.{i}.{s}" for k, s in _LAYER_SUFFIX.items()}
    names["adaln_w"] = f"layers.{i}.adaLN_modulation.{idx}.weight"
    names["adaln_b"] = f"layers.{i}.adaLN_modulation.{idx}.bias"
    return names


def _expected_shapes(c: BlockConfig) -> dict[str, tuple[int, ...]]:
    return {"qkv": (c.qkv_width, c.dim), "out": (c.dim, c.dim), "w1": (c.ffn_dim, c.dim),
            "w3": (c.ffn_dim, c.dim), "w2": (c.dim, c.ffn_dim),
            "attention_norm1": (c.dim,), "attention_norm2": (c.dim,), "ffn_norm1": (c.dim,),
            "ffn_norm2": (c.dim,), "q_norm": (c.head_dim,), "k_norm": (c.head_dim,),
            "adaln_w": (4 * c.dim, c.adaln_in), "adaln_b": (4 * c.dim,)}


def infer_config(tensors: Mapping[str, tuple[tuple[int, ...], str]], where: str,
                 norm_eps: float | None = None) -> tuple[BlockConfig, dict[str, str]]:
    """Infer the block config from ``{canonical name: (shape, type name)}``.

    Returns the config and a report ``{field: how it was inferred}``. Checks every layer's
    tensors for presence, shape and type; raises :class:`MissingTensorError` /
    :class:`ModelFileError` naming ``where`` and the tensor.
    """
    layer_ids = set()
    for n in tensors:
        parts = n.split(".")
        if len(parts) > 2 and parts[0] == "layers" and parts[1].isdigit() \
                and n.endswith(".attention.qkv.weight"):
            layer_ids.add(int(parts[1]))
    if not layer_ids:
        raise MissingTensorError(f"{where}: no main-layer tensors "
                                 f"('layers.<i>.attention.qkv.weight', optionally prefixed "
                                 f"{PREFIX!r}) found among {len(tensors)} tensors")
    n_layers = max(layer_ids) + 1
    gaps = sorted(set(range(n_layers)) - layer_ids)
    if gaps:
        raise MissingTensorError(f"{where}: tensor 'layers.{gaps[0]}.attention.qkv.weight' "
                                 f"missing (layers present: {sorted(layer_ids)})")

    def get(name: str) -> tuple[tuple[int, ...], str]:
        if name not in tensors:
            raise MissingTensorError(f"{where}: required tensor {name!r} is missing")
        return tensors[name]

    report: dict[str, str] = {}
    has0, has1 = ("layers.0.adaLN_modulation.0.weight" in tensors,
                  "layers.0.adaLN_modulation.1.weight" in tensors)
    if has0 == has1:
        raise MissingTensorError(
            f"{where}: need exactly one of 'layers.0.adaLN_modulation.0.weight' (Z-Image) and "
            f"'layers.0.adaLN_modulation.1.weight' (Lumina-2, SiLU first); found "
            f"{'both' if has0 else 'neither'}")
    variant = "lumina2" if has1 else "zimage"
    report["variant"] = (f"{variant}: adaLN stored as adaLN_modulation.{1 if has1 else 0}.* "
                         f"({'SiLU before the Linear' if has1 else 'no SiLU'})")
    names0 = layer_tensor_names(0, variant)
    sh = {k: get(v)[0] for k, v in names0.items()}
    for k in _NORMS + ("adaln_b",):
        if len(sh[k]) != 1:
            raise ModelFileError(f"{where}: tensor {names0[k]!r} has shape {list(sh[k])}, "
                                 f"expected 1-D")
    for k in _PROJECTIONS + ("adaln_w",):
        if len(sh[k]) != 2:
            raise ModelFileError(f"{where}: tensor {names0[k]!r} has shape {list(sh[k])}, "
                                 f"expected 2-D")
    dim = sh["attention_norm1"][0]
    report["dim"] = f"{dim} from len(attention_norm1.weight)"
    head_dim = sh["q_norm"][0]
    report["head_dim"] = f"{head_dim} from len(attention.q_norm.weight)"
    if head_dim < 2 or head_dim % 2:
        raise ModelFileError(f"{where}: tensor {names0['q_norm']!r} has length {head_dim}; "
                             f"head_dim must be even")
    out_in = sh["out"][1]
    if out_in % head_dim:
        raise ModelFileError(f"{where}: tensor {names0['out']!r} has {out_in} inputs, not a "
                             f"multiple of head_dim {head_dim}")
    n_heads = out_in // head_dim
    report["n_heads"] = f"{n_heads} = attention.out.weight inputs {out_in} / head_dim"
    qkv_rows = sh["qkv"][0]
    rest = qkv_rows - n_heads * head_dim
    if qkv_rows % head_dim or rest <= 0 or rest % (2 * head_dim):
        raise ModelFileError(f"{where}: tensor {names0['qkv']!r} has {qkv_rows} rows, not "
                             f"(n_heads + 2*n_kv_heads)*head_dim with n_heads={n_heads}, "
                             f"head_dim={head_dim}")
    n_kv = rest // (2 * head_dim)
    report["n_kv_heads"] = (f"{n_kv} = (qkv rows {qkv_rows} / head_dim - n_heads) / 2"
                            f"{' (GQA)' if n_kv != n_heads else ''}")
    ffn = sh["w1"][0]
    report["ffn_dim"] = f"{ffn} from feed_forward.w1.weight rows"
    adaln_in = sh["adaln_w"][1]
    report["adaln_in"] = f"{adaln_in} from adaLN weight columns"
    report["n_layers"] = f"{n_layers} (layers.0..{n_layers - 1})"
    if norm_eps is None:
        norm_eps = DEFAULT_NORM_EPS
        report["norm_eps"] = f"{norm_eps:g} (default; not recorded in the file)"
    else:
        report["norm_eps"] = f"{norm_eps:g} (from metadata)"
    cfg = BlockConfig(dim=dim, n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim,
                      ffn_dim=ffn, n_layers=n_layers, adaln_in=adaln_in, variant=variant,
                      adaln_silu=variant == "lumina2", norm_eps=float(norm_eps))
    try:
        cfg.validate()
    except ValueError as e:
        raise ModelFileError(f"{where}: inferred config is not runnable: {e}") from None
    exp = _expected_shapes(cfg)
    for i in range(n_layers):
        for k, name in layer_tensor_names(i, variant).items():
            shape, tname = get(name)
            if tuple(shape) != exp[k]:
                raise ModelFileError(f"{where}: tensor {name!r} has shape {list(shape)}, "
                                     f"expected {list(exp[k])} for {cfg.summary()}")
            if tname not in _FLOAT_TYPES + ("Q8_0",):
                raise ModelFileError(f"{where}: tensor {name!r} has type {tname}; nxhpc "
                                     f"reads F32, F16, BF16 and Q8_0")
    return cfg, report


# ----------------------------------------------------------------------------- weights

@dataclass
class LayerWeights:
    """One layer's weights, bound once. Q8_0 matrices are raw ``uint8 [rows, cols//32*34]``
    (read-only views of the GGUF map when ``source == "gguf"``); norms float32."""
    qkv: np.ndarray
    out: np.ndarray
    w1: np.ndarray
    w3: np.ndarray
    w2: np.ndarray
    attention_norm1: np.ndarray
    attention_norm2: np.ndarray
    ffn_norm1: np.ndarray
    ffn_norm2: np.ndarray
    q_norm: np.ndarray
    k_norm: np.ndarray
    adaln_w: np.ndarray   # float32 [4D, adaln_in] or Q8_0 uint8 [4D, adaln_in//32*34]
    adaln_b: np.ndarray
    source: str
    layer: int = -1
    requantized: tuple[str, ...] = ()   # projections stored as floats, quantized at load


def _check_q8_scales(q: np.ndarray, where: str) -> None:
    d = q.view(Q8_0_BLOCK)["d"] if q.flags.c_contiguous else \
        np.ascontiguousarray(q).view(Q8_0_BLOCK)["d"]
    if not np.isfinite(d).all():
        raise ModelFileError(f"{where}: {int(np.count_nonzero(~np.isfinite(d)))} Q8_0 blocks "
                             f"have a NaN/Inf scale")


class Model:
    """A model directory: its GGUF weights and/or fixtures, and the inferred block config."""

    def __init__(self, path: Path | None, gguf: GGUFFile | None,
                 fixtures: FixtureStore | None) -> None:
        if gguf is None and fixtures is None:
            raise ModelNotFoundError(f"{path}: neither {GGUF_FILE} nor {FIXTURES_FILE} present")
        self.path = path
        self.gguf = gguf
        self.fixtures = fixtures
        self._checked: set[int] = set()
        eps, eps_src = None, None
        if gguf is not None:
            v = gguf.metadata.get("nxhpc.norm_eps")
            if isinstance(v, float):
                eps, eps_src = v, "GGUF"
        if eps is None and fixtures is not None:
            with contextlib.suppress(ModelError, ValueError):
                s = fixtures.metadata().get("norm_eps")
                if s is not None:
                    eps, eps_src = float(s), "fixtures"
        if gguf is not None:
            shapes = {n: (gguf.shape(n), gguf.type_name(n)) for n in gguf.names()}
            self.config, self.config_report = infer_config(shapes, str(gguf.path), eps)
            self.weights_source = "gguf"
        else:
            assert fixtures is not None
            shapes = {n: (fixtures.dims(n), "F32") for n in fixtures.names()
                      if n.startswith("layers.") and n.endswith((".weight", ".bias"))}
            self.config, self.config_report = infer_config(shapes, str(fixtures.path), eps)
            self.weights_source = "fixtures"
        if eps_src:
            self.config_report["norm_eps"] = f"{eps:g} (from {eps_src} metadata)"
        self.rope = self._rope_params()

    # -- metadata
    def _rope_params(self) -> tuple[float, tuple[int, ...]] | None:
        if self.gguf is None:
            return None
        th = self.gguf.metadata.get("nxhpc.rope_theta")
        ax = self.gguf.metadata.get("nxhpc.axes_dims")
        if isinstance(th, float) and isinstance(ax, list) and all(isinstance(a, int) for a in ax):
            return th, tuple(ax)
        return None

    @property
    def n_tokens(self) -> int | None:
        """Tokens of the stored activations (from ``pe`` or ``layers.0.blk_in``), or None."""
        if self.fixtures is None:
            return None
        for n in ("pe", "layers.0.blk_in"):
            if self.fixtures.has(n):
                return self.fixtures.dims(n)[0]
        return None

    # -- fixtures with shapes checked against the config
    def _fx(self) -> FixtureStore:
        if self.fixtures is None:
            raise MissingTensorError(f"{self.path}: model has no {FIXTURES_FILE}")
        return self.fixtures

    def t_emb(self) -> np.ndarray:
        """The adaLN input ``float32 [adaln_in]`` (256 Z-Image, 1024 Lumina-2)."""
        return self._fx().load("t_emb", (self.config.adaln_in,))

    def pe(self) -> np.ndarray:
        """The rotary table ``float32 [T, head_dim/2, 2, 2]`` (``[[cos, -sin], [sin, cos]]``)."""
        T = self.n_tokens
        return self._fx().load("pe", (T, self.config.head_dim // 2, 2, 2))

    def mask(self) -> np.ndarray | None:
        """The key mask as bool ``[T]`` (True = attend), or None when the model has none."""
        fx = self._fx()
        if not fx.has("mask"):
            return None
        m = fx.load("mask", (self.n_tokens,))
        if not np.isin(m, (0.0, 1.0)).all():
            raise ModelFileError(f"{fx.path}: fixture 'mask' must hold only 0/1 values")
        return m.astype(bool)

    def blk_in(self, i: int) -> np.ndarray:
        """Layer ``i``'s input activations ``float32 [T, D]``."""
        return self._fx().load(f"layers.{i}.blk_in", (self.n_tokens, self.config.dim))

    def adaln_m(self, i: int) -> np.ndarray:
        """Layer ``i``'s modulation vector ``float32 [4D]`` (the adaLN Linear's output)."""
        return self._fx().load(f"layers.{i}.adaln_m", (4 * self.config.dim,))

    def ref_out(self, i: int) -> np.ndarray:
        """Layer ``i``'s reference output ``float32 [T, D]``."""
        return self._fx().load(f"layers.{i}.ref_out", (self.n_tokens, self.config.dim))

    # -- weights
    def layer_weights(self, i: int, source: str = "auto") -> LayerWeights:
        """Bind layer ``i``'s weights from the GGUF (zero copy) or the fixtures.

        ``source``: ``"auto"`` (GGUF if present, else fixtures), ``"gguf"`` or ``"fixtures"``.
        Fixture weights are quantized to Q8_0 here with the ``gguf`` quantizer.
        """
        c = self.config
        if not isinstance(i, (int, np.integer)) or not 0 <= i < c.n_layers:
            raise IndexError(f"layer_weights: layer {i!r} out of range [0, {c.n_layers})")
        if source == "auto":
            source = "gguf" if self.gguf is not None else "fixtures"
        if source == "gguf":
            if self.gguf is None:
                raise MissingTensorError(f"{self.path}: model has no {GGUF_FILE}")
            return self._from_gguf(int(i))
        if source == "fixtures":
            return self._from_fixtures(int(i))
        raise ValueError(f"layer_weights: source must be 'auto', 'gguf' or 'fixtures', "
                         f"got {source!r}")

    def _from_gguf(self, i: int) -> LayerWeights:
        g = self.gguf
        assert g is not None
        c = self.config
        names = layer_tensor_names(i, c.variant)
        vals: dict[str, np.ndarray] = {}
        requant = []
        for k, name in names.items():
            tname = g.type_name(name)
            if k in _PROJECTIONS or k == "adaln_w":
                if tname == "Q8_0":
                    vals[k] = g.q8_0(name)
                    if i not in self._checked:
                        _check_q8_scales(vals[k], f"{g.path}: tensor {name!r}")
                elif k == "adaln_w":
                    vals[k] = self._finite(np.array(g.load_f32(name), np.float32), g.path, name)
                else:
                    w = self._finite(g.load_f32(name), g.path, name)
                    vals[k] = quantize_q8_0(w, name)
                    requant.append(name)
            else:
                vals[k] = self._finite(np.array(g.load_f32(name), np.float32), g.path, name)
        self._checked.add(i)
        if requant:
            warnings.warn(f"{g.path}: layer {i}: {len(requant)} projection weights stored as "
                          f"floats were quantized to Q8_0 at load ({', '.join(requant)})",
                          stacklevel=3)
        return LayerWeights(**vals, source="gguf", layer=i, requantized=tuple(requant))

    @staticmethod
    def _finite(a: np.ndarray, path: Any, name: str) -> np.ndarray:
        if not np.isfinite(a).all():
            raise ModelFileError(f"{path}: tensor {name!r} has NaN/Inf values")
        return a

    def _from_fixtures(self, i: int) -> LayerWeights:
        fx = self._fx()
        c = self.config
        exp = _expected_shapes(c)
        vals: dict[str, np.ndarray] = {}
        for k, name in layer_tensor_names(i, c.variant).items():
            a = fx.load(name, exp[k])
            if k in _PROJECTIONS:
                a = quantize_q8_0(a, name)
            vals[k] = a
        return LayerWeights(**vals, source="fixtures", layer=i)

    def block(self, i: int) -> Any:
        """The runnable block for layer ``i`` (``nxhpc.dit.block.Block``, imported lazily)."""
        from nxhpc.dit.block import Block
        return Block(self, i)

    def describe(self) -> str:
        """A human-readable report: config and how it was inferred, files, fixtures."""
        lines = [f"model: {self.path if self.path else '(no directory)'}",
                 f"config: {self.config.summary()}"]
        for k, v in self.config_report.items():
            lines.append(f"  {k:<11} {v}")
        if self.rope:
            lines.append(f"  rope        theta {self.rope[0]:g}, axes_dims {list(self.rope[1])}")
        if self.gguf is not None:
            g = self.gguf
            by_type: dict[str, int] = {}
            for n in g.names():
                by_type[g.type_name(n)] = by_type.get(g.type_name(n), 0) + 1
            types = ", ".join(f"{n} {t}" for t, n in sorted(by_type.items()))
            lines.append(f"gguf: {g.path} ({_mb(g.path)}), v{g.version}, arch "
                         f"{g.architecture!r}, prefix {g.prefix!r}, {len(g.names())} tensors "
                         f"({types})")
            c = self.config
            q8 = c.n_layers * ((c.qkv_width + c.dim + 3 * c.ffn_dim) * c.dim +
                               4 * c.dim * c.adaln_in)
            lines.append(f"  main-layer matrices (projections + adaLN): {q8 / 1e6:.1f}M "
                         f"parameters ({q8 // 32 * 34 / 1e6:.1f} MB as Q8_0)")
        if self.fixtures is not None:
            fx = self.fixtures
            lines.append(f"fixtures: {fx.path} ({_mb(fx.path)}), {len(fx.names())} tensors, "
                         f"T={self.n_tokens}")
            acts = [n for n in fx.names() if not n.endswith((".weight", ".bias"))]
            n_w = len(fx.names()) - len(acts)
            for n in sorted(acts, key=_natural_key):
                lines.append(f"  {n:<22} {list(fx.dims(n))}")
            if n_w:
                lines.append(f"  (+ {n_w} weight tensors under their GGUF names)")
        return "\n".join(lines)

    def close(self) -> None:
        """Release the GGUF map (views already handed out stay valid)."""
        if self.gguf is not None:
            self.gguf.close()

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Model({str(self.path)!r}, {self.config.summary()})"


def _mb(p: Path) -> str:
    return f"{p.stat().st_size / 1e6:.1f} MB"


def _natural_key(s: str) -> list:
    return [int(t) if t.isdigit() else t for t in s.replace(".", " . ").split()]


# ----------------------------------------------------------------------------- synthetic

@dataclass(frozen=True)
class SyntheticSpec:
    """Everything that determines a synthetic model; same spec -> byte-identical files."""
    variant: str = "zimage"
    dim: int = 384
    n_heads: int = 6
    n_kv_heads: int | None = None        # None: = n_heads
    ffn_dim: int | None = None           # None: int(D/3*8) (Z-Image) or 4*D rounded up to 256
    n_layers: int = 2
    n_caption: int = 13
    grid: tuple[int, int, int] = (1, 4, 8)
    seed: int = 0
    adaln_in: int | None = None          # None: 256 (Z-Image) or 1024 (Lumina-2)
    norm_eps: float = DEFAULT_NORM_EPS
    mask_pad: int = 0                    # trailing caption tokens masked out as padding
    prefix: bool = True                  # write names with 'model.diffusion_model.'
    include_weights: bool | None = None  # None: only when the float32 weights are < 64 MB
    rope_theta: float | None = None      # None: the variant's
    axes_dims: tuple[int, ...] | None = None

    def config(self) -> BlockConfig:
        H = self.n_heads
        kv = self.n_kv_heads or H
        if self.ffn_dim:
            ffn = self.ffn_dim
        elif self.variant == "zimage":
            ffn = int(self.dim / 3 * 8)
        else:
            ffn = -(-4 * self.dim // 256) * 256
        adaln = self.adaln_in or (1024 if self.variant == "lumina2" else 256)
        if self.dim % H:
            raise ValueError(f"SyntheticSpec: dim {self.dim} not divisible by n_heads {H}")
        return BlockConfig(dim=self.dim, n_heads=H, n_kv_heads=kv, head_dim=self.dim // H,
                           ffn_dim=ffn, n_layers=self.n_layers, adaln_in=adaln,
                           variant=self.variant, adaln_silu=self.variant == "lumina2",
                           norm_eps=self.norm_eps).validate()

    @property
    def n_tokens(self) -> int:
        return self.n_caption + math.prod(self.grid)

    def rope_params(self) -> tuple[float, tuple[int, ...]]:
        c = self.config()
        theta = self.rope_theta or _rope.VARIANT_ROPE[self.variant][0]
        axes = self.axes_dims or _rope.default_axes_dims(c.head_dim, self.variant)
        if sum(axes) != c.head_dim:
            raise ValueError(f"SyntheticSpec: axes_dims {axes} do not sum to head_dim "
                             f"{c.head_dim}")
        return float(theta), tuple(int(a) for a in axes)

    def weights_bytes_f32(self) -> int:
        c = self.config()
        per = (c.qkv_width + c.dim + 2 * c.ffn_dim) * c.dim + c.dim * c.ffn_dim + \
            4 * c.dim * c.adaln_in
        return 4 * per * c.n_layers

    def fingerprint(self) -> str:
        d = dataclasses.asdict(self)
        d["generator_version"] = GENERATOR_VERSION
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    def validate(self) -> "SyntheticSpec":
        self.config()
        self.rope_params()
        if self.n_caption < 0 or len(self.grid) != 3 or min(self.grid) < 1:
            raise ValueError(f"SyntheticSpec: bad token layout n_caption={self.n_caption}, "
                             f"grid={self.grid}")
        if not 0 <= self.mask_pad <= self.n_caption:
            raise ValueError(f"SyntheticSpec: mask_pad {self.mask_pad} must be within the "
                             f"{self.n_caption} caption tokens")
        return self


def _draw_layer(rng: np.random.Generator, c: BlockConfig, i: int,
                say: Callable[[str], None]) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Draw layer i: returns (GGUF tensors by short name, float64 dequantized weights)."""
    stored: dict[str, Any] = {}
    f64: dict[str, np.ndarray] = {}

    def proj(k: str, rows: int, cols: int, gain: float = 1.0) -> None:
        say(f"layer {i}: {k} [{rows} x {cols}]")
        w = rng.standard_normal((rows, cols), dtype=np.float32)
        w *= np.float32(gain / math.sqrt(cols))
        q = quantize_q8_0(w, f"layers.{i}.{k}")
        del w
        stored[k] = Q8_0Tensor(q)
        f64[k] = dequantize_q8_0(q).astype(np.float64)

    proj("qkv", c.qkv_width, c.dim)
    proj("out", c.dim, c.dim)
    proj("w1", c.ffn_dim, c.dim)
    proj("w3", c.ffn_dim, c.dim)
    proj("w2", c.dim, c.ffn_dim)
    for k in _NORMS:
        n = c.head_dim if k in ("q_norm", "k_norm") else c.dim
        w = (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)
        stored[k] = w
        f64[k] = w.astype(np.float64)
    # adaLN: modest modulation (|scale| ~ 0.4, tanh(gate) well inside (-1, 1))
    proj("adaln_w", 4 * c.dim, c.adaln_in, gain=0.4)
    b = (0.1 * rng.standard_normal(4 * c.dim)).astype(np.float32)
    stored["adaln_b"] = b
    f64["adaln_b"] = b.astype(np.float64)
    return stored, f64


def make_synthetic(out_dir: str | os.PathLike, spec: SyntheticSpec,
                   progress: Callable[[str], None] | None = None, *,
                   replace: bool = False) -> Path:
    """Write a synthetic model directory (``model.gguf`` + ``fixtures.safetensors`` +
    ``synthetic.json``) for ``spec`` at ``out_dir`` (which must not exist yet, unless
    ``replace``: an existing model directory is then swapped out once the new one is complete).

    Built in a temporary sibling directory and renamed into place, so readers never see a
    half-written model. Reference outputs chain: layer i+1's ``blk_in`` is layer i's
    ``ref_out`` (float64 evaluation rounded to float32), and each ``ref_out`` is the float64
    evaluation of its own layer on exactly the stored float32 ``blk_in``.
    """
    from nxhpc.dit.reference import adaln_f64, block_forward_f64
    spec.validate()
    out_dir = Path(out_dir)
    _check_replaceable(out_dir, replace)      # before the work, not after
    say = progress or (lambda s: None)
    c = spec.config()
    T = spec.n_tokens
    theta, axes = spec.rope_params()
    rng = np.random.default_rng(spec.seed)
    t0 = time.monotonic()

    t_emb = rng.standard_normal(c.adaln_in).astype(np.float32)
    x = rng.standard_normal((T, c.dim)).astype(np.float32)
    pe32 = _rope.rope_table(_rope.position_ids(spec.n_caption, spec.grid), axes, theta
                            ).astype(np.float32)
    mask = None
    if spec.mask_pad:
        mask = np.ones(T, dtype=np.float32)
        mask[spec.n_caption - spec.mask_pad:spec.n_caption] = 0.0
    include_w = spec.include_weights if spec.include_weights is not None else \
        spec.weights_bytes_f32() < 64 << 20

    gguf_tensors: dict[str, Any] = {}
    fx: dict[str, np.ndarray] = {"t_emb": t_emb, "pe": pe32}
    if mask is not None:
        fx["mask"] = mask
    for i in range(c.n_layers):
        stored, w64 = _draw_layer(rng, c, i, say)
        for k, name in layer_tensor_names(i, c.variant).items():
            gguf_tensors[name] = stored[k]
            if include_w:
                fx[name] = w64[k].astype(np.float32)
        say(f"layer {i}: float64 reference (T={T})")
        m = adaln_f64(t_emb, w64["adaln_w"], w64["adaln_b"], silu=c.adaln_silu)
        out = block_forward_f64(x, w64, c, adaln_m=m, pe=pe32, mask=mask)
        del w64
        fx[f"layers.{i}.blk_in"] = x
        fx[f"layers.{i}.adaln_m"] = m.astype(np.float32)
        x = out.astype(np.float32)
        fx[f"layers.{i}.ref_out"] = x
        if not np.isfinite(x).all():  # pragma: no cover - a generator bug, not user input
            raise RuntimeError(f"make_synthetic: non-finite reference output at layer {i}")

    meta = {"general.name": f"nxhpc synthetic {c.variant}", "nxhpc.synthetic": True,
            "nxhpc.seed": int(spec.seed), "nxhpc.norm_eps": float(c.norm_eps),
            "nxhpc.rope_theta": float(theta), "nxhpc.axes_dims": list(axes),
            "nxhpc.n_caption": int(spec.n_caption), "nxhpc.grid": list(spec.grid),
            "nxhpc.fingerprint": spec.fingerprint()}
    write_model_dir(
        out_dir, gguf_tensors, fx, prefix=spec.prefix, gguf_metadata=meta,
        fixture_metadata={"norm_eps": repr(float(c.norm_eps)), "source": "nxhpc synthetic",
                          "fingerprint": spec.fingerprint()},
        extra_files={SPEC_FILE: json.dumps(
            {"spec": dataclasses.asdict(spec), "fingerprint": spec.fingerprint(),
             "generator_version": GENERATOR_VERSION}, indent=1, sort_keys=True) + "\n"},
        replace=replace, progress=say)
    say(f"done in {time.monotonic() - t0:.1f} s: {out_dir}")
    return out_dir


def write_model_dir(out_dir: str | os.PathLike, gguf_tensors: Mapping[str, Any],
                    fixtures: Mapping[str, np.ndarray], *, prefix: bool = True,
                    gguf_metadata: Mapping[str, Any] | None = None,
                    fixture_metadata: Mapping[str, str] | None = None,
                    extra_files: Mapping[str, str] | None = None, replace: bool = False,
                    progress: Callable[[str], None] | None = None) -> Path:
    """Write a model directory: ``model.gguf`` (:func:`~nxhpc.formats.gguf_io.write_gguf` of
    ``gguf_tensors``), ``fixtures.safetensors`` and any ``extra_files`` (name -> text).

    Built in a temporary sibling and renamed into place, so readers never see a half-written
    model and a failure leaves nothing behind. An existing ``out_dir`` raises FileExistsError
    unless ``replace``, in which case it is swapped out only once the new one is complete
    (and only if it is a model directory: one never replaces a folder of other files).
    """
    out_dir = Path(out_dir)
    say = progress or (lambda s: None)
    _check_replaceable(out_dir, replace)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    old = tmp.with_name(tmp.name + "-old")
    try:
        say(f"writing {GGUF_FILE}")
        write_gguf(tmp / GGUF_FILE, gguf_tensors, prefix=prefix, metadata=gguf_metadata)
        say(f"writing {FIXTURES_FILE}")
        FixtureStore.save(tmp / FIXTURES_FILE, fixtures, metadata=fixture_metadata)
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
        os.chmod(tmp, 0o755)
        if out_dir.exists():
            os.rename(out_dir, old)
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not out_dir.exists():
            os.rename(old, out_dir)                     # put the previous model back
        raise
    shutil.rmtree(old, ignore_errors=True)
    return out_dir


def _check_replaceable(out_dir: Path, replace: bool) -> None:
    """FileExistsError unless ``out_dir`` is absent, or ``replace`` and it is an empty or
    model directory (holding ``model.gguf`` or ``fixtures.safetensors``)."""
    if not out_dir.exists() and not out_dir.is_symlink():
        return
    if not replace:
        raise FileExistsError(f"{out_dir} already exists")
    if out_dir.is_symlink() or not out_dir.is_dir() or (
            any(out_dir.iterdir()) and not ((out_dir / GGUF_FILE).is_file()
                                            or (out_dir / FIXTURES_FILE).is_file())):
        raise FileExistsError(f"{out_dir} exists and is not a model directory (no {GGUF_FILE} "
                              f"or {FIXTURES_FILE}); refusing to replace it")


# ----------------------------------------------------------------------------- built-ins

BUILTIN_MODELS: dict[str, SyntheticSpec] = {
    # README default: runs in well under a second; T=45 = 13 caption + 4x8 image tokens
    "tiny": SyntheticSpec(variant="zimage", dim=384, n_heads=6, n_layers=2, n_caption=13,
                          grid=(1, 4, 8), seed=1),
    # Lumina-2 style: GQA 4 query / 2 kv heads of 96, SiLU adaLN from 1024, padded caption mask
    "tiny-gqa": SyntheticSpec(variant="lumina2", dim=384, n_heads=4, n_kv_heads=2,
                              ffn_dim=1024, n_layers=2, n_caption=11, grid=(1, 5, 6),
                              seed=2, mask_pad=3, prefix=False),
    # real head_dim 128 and RoPE axes; T=150 = 22 caption + 8x16 image tokens
    "mid": SyntheticSpec(variant="zimage", dim=768, n_heads=6, n_layers=3, n_caption=22,
                         grid=(1, 8, 16), seed=3),
    # real Z-Image dims (D=3840, 30x128, FFN 10240), T=256 = 32 caption + 14x16 image tokens
    "zimage-1l": SyntheticSpec(variant="zimage", dim=3840, n_heads=30, n_layers=1,
                               n_caption=32, grid=(1, 14, 16), seed=4),
}
DEFAULT_MODEL_ID = "tiny"


def models_dir() -> Path:
    """``$NXHPC_MODELS`` or ``~/.cache/nxhpc/models``."""
    env = os.environ.get("NXHPC_MODELS")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "nxhpc" / "models"


_models_root = models_dir


@contextlib.contextmanager
def _locked(root: Path, model_id: str) -> Iterator[None]:
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{model_id}.lock", "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _builtin_current(d: Path, spec: SyntheticSpec) -> bool:
    try:
        info = json.loads((d / SPEC_FILE).read_text())
        return info.get("fingerprint") == spec.fingerprint() and (d / GGUF_FILE).is_file()
    except (OSError, ValueError):
        return False


def ensure_builtin(model_id: str, root: Path | None = None, force: bool = False,
                   progress: Callable[[str], None] | None = None) -> Path:
    """Return the directory of built-in ``model_id``, generating it first if needed.

    Safe under concurrency: one process generates (under a lock file), others wait and reuse.
    A directory written by an older generator (fingerprint mismatch) is regenerated.
    """
    if model_id not in BUILTIN_MODELS:
        raise ModelNotFoundError(f"{model_id!r} is not a built-in model id "
                                 f"(built-ins: {', '.join(BUILTIN_MODELS)})")
    spec = BUILTIN_MODELS[model_id]
    root = Path(root) if root is not None else models_dir()
    d = root / model_id
    if not force and _builtin_current(d, spec):
        return d
    with _locked(root, model_id):
        if not force and _builtin_current(d, spec):
            return d
        if progress is None and spec.weights_bytes_f32() > 256 << 20:
            progress = _stderr_progress(model_id)
        try:
            make_synthetic(d, spec, progress=progress, replace=True)
        except FileExistsError as e:
            raise ModelError(f"built-in model {model_id!r}: {e}") from None
    return d


def _stderr_progress(model_id: str) -> Callable[[str], None]:
    t0 = time.monotonic()

    def say(msg: str) -> None:
        print(f"[nxhpc.models {model_id} {time.monotonic() - t0:6.1f}s] {msg}",
              file=sys.stderr, flush=True)
    return say


def open_model(id_or_path: str | os.PathLike, models_dir: str | os.PathLike | None = None,
               gguf_path: str | os.PathLike | None = None) -> Model:
    """Open a model by id or path.

    Resolution: a bare name is looked up as ``<models_dir>/<name>`` (built-in ids are generated
    there on first use, and regenerated if stale); otherwise ``id_or_path`` must be a model
    directory or a ``.gguf`` file. ``gguf_path`` overrides the directory's ``model.gguf``.
    """
    root = Path(models_dir) if models_dir is not None else _models_root()
    s = os.fspath(id_or_path)
    p = Path(s)
    d: Path | None = None
    gpath: Path | None = None
    bare = bool(s) and os.sep not in s and not s.startswith(".") and p.suffix != ".gguf"
    if bare and s in BUILTIN_MODELS:
        d = ensure_builtin(s, root)
    elif bare and (root / s).is_dir():
        d = root / s
    elif p.is_dir():
        d = p
    elif p.is_file() and p.suffix == ".gguf":
        gpath = p
    else:
        raise ModelNotFoundError(
            f"model {s!r} not found: not a built-in id ({', '.join(BUILTIN_MODELS)}), not a "
            f"directory under {root}, and not a model directory or .gguf file path")
    if gguf_path is not None:
        gpath = Path(gguf_path)
        if not gpath.is_file():
            raise ModelNotFoundError(f"gguf_path {gpath}: no such file")
    elif d is not None and (d / GGUF_FILE).is_file():
        gpath = d / GGUF_FILE
    fx = FixtureStore(d / FIXTURES_FILE) if d is not None and (d / FIXTURES_FILE).is_file() \
        else None
    g = GGUFFile(gpath) if gpath is not None else None
    if g is None and fx is None:
        raise ModelNotFoundError(f"{d}: neither {GGUF_FILE} nor {FIXTURES_FILE} found")
    return Model(d, g, fx)


# ----------------------------------------------------------------------------- CLI

def _cmd_list(args: argparse.Namespace) -> int:
    root = Path(args.models_dir) if args.models_dir else models_dir()
    print(f"models dir: {root}")
    print(f"{'id':<11} {'variant':<8} {'D':>5} {'heads':>7} {'FFN':>6} {'L':>2} {'T':>4} "
          f"{'weights(Q8_0)':>13}  status")
    for mid, spec in BUILTIN_MODELS.items():
        c = spec.config()
        q8 = spec.weights_bytes_f32() // 4 // 32 * 34
        heads = f"{c.n_heads}/{c.n_kv_heads}" if c.n_kv_heads != c.n_heads else str(c.n_heads)
        st = "generated" if _builtin_current(root / mid, spec) else "generated on first use"
        flag = " (default)" if mid == DEFAULT_MODEL_ID else ""
        print(f"{mid:<11} {c.variant:<8} {c.dim:>5} {heads:>7} {c.ffn_dim:>6} "
              f"{c.n_layers:>2} {spec.n_tokens:>4} {q8 / 1e6:>10.1f} MB  {st}{flag}")
    if root.is_dir():
        others = sorted(p.name for p in root.iterdir() if p.is_dir()
                        and not p.name.startswith(".") and p.name not in BUILTIN_MODELS)
        for o in others:
            print(f"{o:<11} (directory)")
    return 0


def _cmd_show(args: argparse.Namespace) -> int:
    with open_model(args.model, models_dir=args.models_dir, gguf_path=args.gguf) as m:
        print(m.describe())
    return 0


def _cmd_make(args: argparse.Namespace) -> int:
    root = Path(args.models_dir) if args.models_dir else models_dir()
    custom = {k: getattr(args, k) for k in ("variant", "dim", "n_heads", "n_kv_heads",
                                            "ffn_dim", "n_layers", "n_caption", "grid",
                                            "seed", "adaln_in", "norm_eps", "mask_pad")
              if getattr(args, k) is not None}
    if args.no_prefix:
        custom["prefix"] = False
    if args.weights is not None:
        custom["include_weights"] = args.weights
    say = _stderr_progress(args.id)
    if args.id in BUILTIN_MODELS and not custom and args.out is None:
        d = ensure_builtin(args.id, root, force=args.force, progress=say)
    else:
        base = BUILTIN_MODELS.get(args.id, SyntheticSpec())
        if "grid" in custom:
            custom["grid"] = tuple(custom["grid"])
        d = Path(args.out) if args.out else root / args.id
        spec = dataclasses.replace(base, **custom)
        try:
            _check_replaceable(d, args.force)
            spec.validate()
            make_synthetic(d, spec, progress=say, replace=args.force)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        except FileExistsError as e:
            hint = "" if args.force else " (use --force to replace it)"
            print(f"error: {e}{hint}", file=sys.stderr)
            return 2
    with open_model(d) as m:
        print(m.describe())
    return 0


def _grid(s: str) -> tuple[int, int, int]:
    try:
        g = tuple(int(v) for v in s.lower().split("x"))
    except ValueError:
        g = ()
    if len(g) != 3 or min(g) < 1:
        raise argparse.ArgumentTypeError(f"grid must look like FxHxW (e.g. 1x4x8), got {s!r}")
    return g  # type: ignore[return-value]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m nxhpc.models",
        description="List, inspect and generate nxhpc model directories "
                    "(model.gguf + fixtures.safetensors).")
    p.add_argument("--models-dir", help="model root (default: $NXHPC_MODELS or "
                                        "~/.cache/nxhpc/models)")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="built-in ids and directories present")
    sh = sub.add_parser("show", help="config (and how it was inferred), files, fixtures")
    sh.add_argument("model", help="model id, model directory, or .gguf file")
    sh.add_argument("--gguf", help="use this GGUF instead of the directory's model.gguf")
    mk = sub.add_parser("make", help="generate a synthetic model (a built-in id, or custom dims)")
    mk.add_argument("id", help="model id (directory name under the models dir)")
    mk.add_argument("--variant", choices=("zimage", "lumina2"))
    mk.add_argument("--dim", type=int)
    mk.add_argument("--heads", dest="n_heads", type=int)
    mk.add_argument("--kv-heads", dest="n_kv_heads", type=int)
    mk.add_argument("--ffn", dest="ffn_dim", type=int)
    mk.add_argument("--layers", dest="n_layers", type=int)
    mk.add_argument("--caption", dest="n_caption", type=int, help="caption tokens")
    mk.add_argument("--grid", type=_grid, help="image token grid FxHxW, e.g. 1x4x8")
    mk.add_argument("--seed", type=int)
    mk.add_argument("--adaln-in", type=int)
    mk.add_argument("--eps", dest="norm_eps", type=float)
    mk.add_argument("--mask-pad", type=int, help="mask the last N caption tokens")
    mk.add_argument("--no-prefix", action="store_true",
                    help="write tensor names without 'model.diffusion_model.'")
    mk.add_argument("--weights", action=argparse.BooleanOptionalAction, default=None,
                    help="also store float32 weights in the fixtures (default: if < 64 MB)")
    mk.add_argument("--out", help="output directory (default: <models dir>/<id>)")
    mk.add_argument("--force", action="store_true", help="replace an existing directory")
    return p


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: ``python -m nxhpc.models list | show <id> | make <id> [...]``."""
    args = build_parser().parse_args(argv)
    try:
        return {"list": _cmd_list, "show": _cmd_show, "make": _cmd_make}[args.cmd](args)
    except ModelError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover - python -m nxhpc.models runs __main__.py
    sys.exit(main())
