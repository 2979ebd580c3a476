"""The :class:`Model` facade: one model directory (or GGUF file) opened for running.

Owns: reading a model's files through ``nxhpc.formats`` (the GGUF map, the fixture store), the
config inferred from the tensors (``nxhpc.dit.config.infer_config``: a
:class:`~nxhpc.dit.config.DenoiserConfig`; a block model's holds only blocks), fixture accessors with
shapes checked against the config, binding a block's weights (``nxhpc.dit.binding``) and the
human-readable report. Must not: resolve ids (``nxhpc.models.registry``), generate models, or
run kernels (``block(i)`` hands out an ``nxhpc.dit.block.Block``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from pathlib import Path
from typing import Any

import numpy as np

from nxhpc.dit.binding import LayerWeights, bind_fixture_layer, bind_gguf_layer
from nxhpc.dit.config import check_stack, file_norm_eps, infer_config, tensor_names
from nxhpc.formats.closing import Closing
from nxhpc.formats.fixtures import FIXTURES_FILE, FixtureStore
from nxhpc.formats.gguf_io import (GGUFFile, MissingTensorError, ModelError, ModelFileError,
                                   ModelNotFoundError, refuse_text_encoder)
from nxhpc.models.modeldir import GGUF_FILE

__all__ = ["Model"]


class Model(Closing):
    """A model directory: its GGUF weights and/or fixtures, and the inferred block config.

    After :meth:`close` (or the end of its ``with`` block) binding weights -- ``block(i)``,
    ``layer_weights(i)`` -- raises RuntimeError saying so; fixtures can still be read.
    """

    _closed = False

    def __init__(self, path: Path | None, gguf: GGUFFile | None,
                 fixtures: FixtureStore | None) -> None:
        if gguf is None and fixtures is None:
            raise ModelNotFoundError(f"{path}: neither {GGUF_FILE} nor {FIXTURES_FILE} present")
        self.path = path
        # what messages name: the directory, else (a bare .gguf opened) the file
        self._where = str(path if path is not None else gguf.path if gguf is not None else "")
        self.gguf = gguf
        self.fixtures = fixtures
        self._checked: set[tuple[str, int]] = set()     # blocks whose values were scanned
        self._stacks_checked: set[str] = set()
        eps, eps_src = None, None
        if gguf is not None:
            eps = file_norm_eps(gguf.metadata, str(gguf.path))
            eps_src = "GGUF" if eps is not None else None
        if eps is None and fixtures is not None:
            with contextlib.suppress(ModelError, ValueError):
                s = fixtures.metadata().get("norm_eps")
                if s is not None:
                    eps, eps_src = float(s), "fixtures"
        if gguf is not None:
            refuse_text_encoder(gguf, "a DiT model")
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
        if self.rope is not None:             # the file's RoPE, not the variant's default
            try:
                self.config = dataclasses.replace(self.config, rope_theta=self.rope[0],
                                                  axes_dims=self.rope[1])
            except ValueError as e:
                raise ModelFileError(f"{gguf.path}: RoPE metadata (nxhpc.rope_theta, "
                                     f"nxhpc.axes_dims) do not fit the model: {e}") from None

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
    def stack_size(self, prefix: str = "layers") -> int:
        """Blocks in stack ``prefix`` (``layers``, ``noise_refiner``, ``context_refiner``)."""
        return self.config.stacks.get(prefix, 0)

    def layer_weights(self, i: int, source: str = "auto", *,
                      prefix: str = "layers") -> LayerWeights:
        """Bind block ``prefix.i``'s weights from the GGUF (zero copy) or the fixtures.

        ``source``: ``"auto"`` (GGUF if present, else fixtures), ``"gguf"`` or ``"fixtures"``.
        GGUF matrices stay in their stored type (views of the map, never requantized); fixture
        weights (float32 Q8_0 values) are quantized back to Q8_0 with the ``gguf`` quantizer.
        """
        if source == "auto":
            source = "gguf" if self.gguf is not None else "fixtures"
        if source not in ("gguf", "fixtures"):
            raise ValueError(f"layer_weights: source must be 'auto', 'gguf' or 'fixtures', "
                             f"got {source!r}")
        self._check_open("layer_weights")
        n = self.stack_size(prefix)
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not 0 <= i < n:
            raise IndexError(f"layer_weights: {prefix} index {i!r} out of range [0, {n})")
        i = int(i)
        if source == "gguf":
            if self.gguf is None:
                raise MissingTensorError(f"{self.path}: model has no {GGUF_FILE}")
            g = self.gguf
            if prefix != "layers" and prefix not in self._stacks_checked:
                shapes = {nm: (g.shape(nm), g.type_name(nm)) for nm in g.names()}
                check_stack(shapes, self.config.block, prefix, n, str(g.path))
                self._stacks_checked.add(prefix)
            first = (prefix, i) not in self._checked
            lw = bind_gguf_layer(g, self.config.block, i, prefix, check_values=first)
            self._checked.add((prefix, i))
            return lw
        return bind_fixture_layer(self._fx(), self.config.block, i, prefix)

    def block(self, i: int) -> Any:
        """The runnable block for layer ``i`` (``nxhpc.dit.block.Block``, imported lazily)."""
        self._check_open("block")
        from nxhpc.dit.block import Block
        return Block(self, i)

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"Model.{what}: the model {self._where} is closed (close() "
                               f"or the end of its with block released the weights map); open "
                               f"it again to bind weights")

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
            types = ", ".join(f"{t} {n}" for t, n in sorted(by_type.items()))
            lines.append(f"gguf: {g.path} ({_mb(g.path)}), v{g.version}, arch "
                         f"{g.architecture!r}, prefix {g.prefix!r}, {len(g.names())} tensors "
                         f"({types})")
            c = self.config
            mats = [name for i in range(c.n_layers)
                    for k, name in tensor_names("layers", i, c.variant).items()
                    if len(c.block.shapes()[k]) == 2]
            n_par = sum(math.prod(g.shape(m)) for m in mats)
            stored = sum(g.info(m).n_bytes for m in mats)
            mtypes = ", ".join(sorted({g.type_name(m) for m in mats}))
            lines.append(f"  main-layer matrices (projections + adaLN): {n_par / 1e6:.1f}M "
                         f"parameters ({stored / 1e6:.1f} MB as stored: {mtypes})")
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
        """Release the GGUF map (views already handed out stay valid). Idempotent."""
        self._closed = True
        if self.gguf is not None:
            self.gguf.close()

    def __repr__(self) -> str:
        return f"Model({self._where!r}, {self.config.summary()})"


def _mb(p: Path) -> str:
    return f"{p.stat().st_size / 1e6:.1f} MB"


def _natural_key(s: str) -> list[tuple[int, int | str]]:
    """``layers.10`` after ``layers.9``; numbers before words at the same place (a list of
    bare ints and strs would compare an int with a str there), ASCII digits only (``'²'`` is a
    digit to ``str.isdigit`` that ``int`` refuses)."""
    return [(0, int(t)) if t.isascii() and t.isdigit() and len(t) <= 18 else (1, t)
            for t in s.replace(".", " . ").split()]


