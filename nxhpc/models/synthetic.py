"""Synthetic models: deterministic random weights and their float64 reference outputs.

Owns :class:`SyntheticSpec` (everything that determines a synthetic model; same spec ->
byte-identical files) and :func:`make_synthetic`: weights stored in the types of the spec's
``types`` policy (nxhpc.models.typepolicy; default Q8_0, quantized by the ``gguf`` package),
``pe`` from real position ids, each layer's reference output from the float64 oracle
``nxhpc.dit.reference`` evaluated on the stored weights' exact values (decoded by
``gguf.quants.dequantize``), written as a model directory.
Must not: run the kernels (the references must not depend on the code they grade).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from nxhpc.dit import rope as _rope
from nxhpc.dit.config import DEFAULT_NORM_EPS, NORMS, BlockConfig, layer_tensor_names
from nxhpc.formats.gguf_io import Q8_0Tensor, QuantTensor, dequantize_q8_0, quantize_q8_0
from nxhpc.models import typepolicy
from nxhpc.models.modeldir import SPEC_FILE, check_replaceable, write_model_dir

__all__ = ["SyntheticSpec", "make_synthetic", "GENERATOR_VERSION"]

#: Part of every fingerprint: bump it when the generator's output changes.
GENERATOR_VERSION = 2

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
    types: str = "q8_0"                  # weight-type policy (nxhpc.models.typepolicy.POLICIES)

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
        cfg = BlockConfig(dim=self.dim, n_heads=H, n_kv_heads=kv, head_dim=self.dim // H,
                          ffn_dim=ffn, n_layers=self.n_layers, adaln_in=adaln,
                          variant=self.variant, adaln_silu=self.variant == "lumina2",
                          norm_eps=self.norm_eps)
        try:
            return cfg.validate()
        except ValueError as e:
            if self.ffn_dim or "ffn_dim" not in str(e):
                raise
            rule = "int(dim/3*8)" if self.variant == "zimage" else "4*dim rounded up to 256"
            raise ValueError(f"{e}. ffn_dim was not given: {ffn} is derived from dim {self.dim} "
                             f"({self.variant} rule: {rule}); give ffn_dim (--ffn) explicitly"
                             ) from None

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

    def disk_bytes(self) -> int:
        """A lower bound of the bytes the model directory takes: Q8_0 projections in the GGUF,
        the fixtures' activations, and the float32 weights when they are included."""
        c = self.config()
        T = self.n_tokens
        f32 = self.weights_bytes_f32()
        gguf = f32 // 4 // 32 * 34
        acts = 4 * (c.adaln_in + T * c.head_dim * 2 + c.n_layers * (2 * T * c.dim + 4 * c.dim))
        with_w = self.include_weights if self.include_weights is not None else f32 < 64 << 20
        return gguf + acts + (f32 if with_w else 0)

    def fingerprint(self) -> str:
        d = dataclasses.asdict(self)
        if d["types"] == "q8_0":             # the default: fingerprints of older specs unchanged
            del d["types"]
        d["generator_version"] = GENERATOR_VERSION
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    def validate(self) -> "SyntheticSpec":
        typepolicy.get_policy(self.types)
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
                say: Callable[[str], None], types: str = "q8_0"
                ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Draw layer i: returns (GGUF tensors by short name, float64 dequantized weights)."""
    stored: dict[str, Any] = {}
    f64: dict[str, np.ndarray] = {}
    names = layer_tensor_names(i, c.variant)

    def proj(k: str, rows: int, cols: int, gain: float = 1.0) -> None:
        gtype = typepolicy.tensor_type(types, names[k], (rows, cols))
        say(f"layer {i}: {k} [{rows} x {cols}] {gtype}")
        w = rng.standard_normal((rows, cols), dtype=np.float32)
        w *= np.float32(gain / math.sqrt(cols))
        if gtype == "Q8_0":                  # today's path, byte for byte
            q = quantize_q8_0(w, f"layers.{i}.{k}")
            del w
            stored[k] = Q8_0Tensor(q)
            f64[k] = dequantize_q8_0(q).astype(np.float64)
            return
        raw = typepolicy.encode(w, gtype, names[k])
        del w
        stored[k] = QuantTensor(raw, gtype)
        f64[k] = typepolicy.decode(raw, gtype, (rows, cols)).astype(np.float64)

    proj("qkv", c.qkv_width, c.dim)
    proj("out", c.dim, c.dim)
    proj("w1", c.ffn_dim, c.dim)
    proj("w3", c.ffn_dim, c.dim)
    proj("w2", c.dim, c.ffn_dim)
    for k in NORMS:
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
    check_replaceable(out_dir, replace)      # before the work, not after
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
        stored, w64 = _draw_layer(rng, c, i, say, spec.types)
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


