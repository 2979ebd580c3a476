"""Synthetic models: deterministic random weights and their float64 reference outputs.

Owns :class:`SyntheticSpec`, the one spec of a synthetic model (everything that determines
it; same spec -> byte-identical files), of either kind: a block model (only ``layers.*``;
``cap_dim`` None) or a whole Z-Image denoiser (``cap_dim`` given: embedders, refiners, final
layer) -- :attr:`SyntheticSpec.kind` says which, as ``DenoiserConfig.whole`` does for configs.
And the one generator :func:`make_synthetic`, which writes a model directory of either kind:

- a block model: weights drawn layer by layer from one generator, stored in the types of the
  spec's ``types`` policy (nxhpc.formats.layouts; default Q8_0, quantized by the ``gguf``
  package), ``pe`` from real position ids, each layer's reference output from the float64
  oracle ``nxhpc.dit.reference`` evaluated on the stored weights' exact values (decoded by
  ``gguf.quants.dequantize``);
- a whole denoiser: each tensor drawn from its own generator, stored as a published file
  layout of ``nxhpc.models.zimage_files`` by the ``gguf`` package and streamed tensor by
  tensor; stored deterministic inputs and, for small models, the float64 output of
  ``nxhpc.dit.denoiser_ref`` on the weights read back by the ``gguf`` package
  (:func:`read_denoiser_fixtures` reads those inputs back checked).

The two drawing schemes stay apart because each one's draws are what the built-in models'
bytes are made of. Must not: run the kernels (the references must not depend on the code they
grade).
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
from nxhpc.dit.config import DEFAULT_NORM_EPS, NORMS, BlockConfig, DenoiserConfig, tensor_names
from nxhpc.formats import layouts
from nxhpc.formats.fixtures import FIXTURES_FILE, FixtureStore
from nxhpc.formats.gguf_io import (LazyTensor, ModelFileError, Q8_0Tensor, QuantTensor,
                                   dequantize_q8_0, quantize_q8_0, write_gguf)
from nxhpc.models.modeldir import GGUF_FILE, SPEC_FILE, build_model_dir, check_replaceable

__all__ = ["SyntheticSpec", "make_synthetic", "GENERATOR_VERSION", "KINDS",
           "DenoiserFixtures", "read_denoiser_fixtures"]

#: Part of every fingerprint (both kinds): bump it when the generator's output changes
#: (block models 2: the ``types`` policies; denoisers 2: the stored inputs moved from
#: denoiser_fixtures.npz into the one fixture store).
GENERATOR_VERSION = 2
KINDS = ("block", "denoiser")

#: The fields that determine each kind (what its fingerprint and ``synthetic.json`` hold);
#: a field outside its spec's kind must keep its default.
_SHARED = ("dim", "n_heads", "ffn_dim", "n_layers", "n_caption", "seed", "qk_norm_scale")
_FIELDS: dict[str, tuple[str, ...]] = {
    "block": _SHARED + ("variant", "n_kv_heads", "grid", "adaln_in", "norm_eps", "mask_pad",
                        "prefix", "include_weights", "rope_theta", "axes_dims", "types"),
    "denoiser": _SHARED + ("cap_dim", "n_refiner", "in_channels", "patch", "layout",
                           "latent_hw", "timestep", "reference"),
}
#: Caption tokens when ``n_caption`` is not given.
_DEFAULT_CAPTION = {"block": 13, "denoiser": 19}


@dataclass(frozen=True)
class SyntheticSpec:
    """Everything that determines a synthetic model; same spec -> byte-identical files.

    ``cap_dim`` None: a block model (``kind == "block"``), else a whole Z-Image denoiser
    (``kind == "denoiser"``). Dims as :class:`~nxhpc.dit.config.DenoiserConfig`; the fields
    under "block model" and "denoiser" apply to that kind only (:meth:`validate` refuses a
    non-default value of the other kind's). The stored inputs: a block model's ``n_caption``
    caption + ``grid`` image tokens; a denoiser's latents ``[in_channels, *latent_hw]``,
    ``n_caption`` caption rows of ``cap_dim`` and ``timestep``.
    """
    # -- both kinds
    dim: int = 384
    n_heads: int = 6
    ffn_dim: int | None = None           # None: int(D/3*8) (Z-Image) or 4*D rounded up to 256
    n_layers: int = 2                    # main layers
    n_caption: int | None = None         # caption tokens; None: 13 (block), 19 (denoiser)
    seed: int = 0
    qk_norm_scale: float = 1.0           # q_norm / k_norm weights times this: the scores' spread
                                         # times its square (4: sharp heads, whose softmax
                                         # weights underflow; docs/kernels.md)
    # -- a block model
    variant: str = "zimage"
    n_kv_heads: int | None = None        # None: = n_heads
    grid: tuple[int, int, int] = (1, 4, 8)
    adaln_in: int | None = None          # None: 256 (Z-Image) or 1024 (Lumina-2)
    norm_eps: float = DEFAULT_NORM_EPS
    mask_pad: int = 0                    # trailing caption tokens masked out as padding
    prefix: bool = True                  # write names with 'model.diffusion_model.'
    include_weights: bool | None = None  # None: only when the float32 weights are < 64 MB
    rope_theta: float | None = None      # None: the variant's
    axes_dims: tuple[int, ...] | None = None
    types: str = "q8_0"                  # weight-type policy (nxhpc.formats.layouts.POLICY_NAMES)
    # -- a whole denoiser
    cap_dim: int | None = None           # caption feature width; given: a whole denoiser
    n_refiner: int = 2                   # blocks of each refiner (noise and context)
    in_channels: int = 16
    patch: int = 2
    layout: str = "comfyui-q8_0"         # a file layout (nxhpc.formats.layouts.LAYOUTS)
    latent_hw: tuple[int, int] = (14, 10)
    timestep: float = 0.6
    reference: bool = True               # store the float64 output (small models only)

    def __post_init__(self) -> None:
        if self.n_caption is None:
            object.__setattr__(self, "n_caption", _DEFAULT_CAPTION[self.kind])

    @classmethod
    def zimage_dit(cls, n_layers: int, **kw: Any) -> "SyntheticSpec":
        """A whole denoiser of real Z-Image dimensions (D=3840, 30x128 heads, FFN 10240, cap_dim
        2560, 2+2 refiners) with ``n_layers`` main layers; stored inputs of a 512x512 image
        (64x64 latents: 1024 image tokens) and a 100-token caption; no float64 reference."""
        base = dict(dim=3840, n_heads=30, ffn_dim=10240, n_layers=n_layers, n_refiner=2,
                    cap_dim=2560, seed=40 + n_layers, latent_hw=(64, 64), n_caption=100,
                    timestep=0.5, reference=False)
        base.update(kw)
        return cls(**base)

    @property
    def kind(self) -> str:
        """``"denoiser"`` when the spec has embedders (``cap_dim`` given), else ``"block"``."""
        return "block" if self.cap_dim is None else "denoiser"

    def fields(self) -> dict[str, Any]:
        """The fields of this spec's kind, by name (what ``synthetic.json`` stores)."""
        d = dataclasses.asdict(self)
        return {k: d[k] for k in _FIELDS[self.kind]}

    # -- the config
    def config(self) -> DenoiserConfig:
        """The model's config (a block model: no embedders) with the spec's RoPE."""
        c = self._block()
        theta, axes = self.rope_params()
        emb = {} if self.kind == "block" else dict(
            n_noise_refiner=self.n_refiner, n_context_refiner=self.n_refiner,
            in_channels=self.in_channels, patch=self.patch, cap_dim=self.cap_dim)
        return DenoiserConfig(dim=c.dim, n_heads=c.n_heads, n_kv_heads=c.n_kv_heads,
                              head_dim=c.head_dim, ffn_dim=c.ffn_dim, n_layers=c.n_layers,
                              adaln_in=c.adaln_in, norm_eps=c.norm_eps, variant=c.variant,
                              rope_theta=theta, axes_dims=axes, **emb)

    def _block(self) -> BlockConfig:
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

    def rope_params(self) -> tuple[float, tuple[int, ...]]:
        """``(theta, axes_dims)``: the spec's, or the variant's defaults."""
        c = self._block()
        theta = self.rope_theta or _rope.VARIANT_ROPE[self.variant][0]
        axes = self.axes_dims or _rope.default_axes_dims(c.head_dim, self.variant)
        if sum(axes) != c.head_dim:
            raise ValueError(f"SyntheticSpec: axes_dims {axes} do not sum to head_dim "
                             f"{c.head_dim}")
        return float(theta), tuple(int(a) for a in axes)

    # -- sizes
    @property
    def token_grid(self) -> tuple[int, int, int]:
        """The image tokens' grid (frames, rows, columns): a denoiser's latent patches."""
        if self.kind == "block":
            return self.grid
        h, w = self.latent_hw
        return (1, h // self.patch, w // self.patch)

    @property
    def n_tokens(self) -> int:
        """Tokens of the stored inputs before padding: caption + image tokens."""
        return self.n_caption + math.prod(self.token_grid)

    def _file_layout(self) -> layouts.FileLayout:
        return layouts.get_layout(self.types, policy=True) if self.kind == "block" else \
            layouts.get_layout(self.layout)

    def weights_bytes_f32(self) -> int:
        """Bytes of the model's 2-D weights as float32."""
        return 4 * sum(math.prod(s) for s in self.config().tensor_shapes().values()
                       if len(s) == 2)

    def disk_bytes(self) -> int:
        """A lower bound of the bytes the model directory takes: every tensor in its stored
        type, plus the fixtures (a block model's activations and, when included, float32
        weights; a denoiser's inputs and reference)."""
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
        lay = self._file_layout()
        c = self.config()
        total = 0
        for name, shape in c.tensor_shapes().items():
            stored = tuple(lay.stored_shape(name, shape))
            elems, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[lay.type_for(name, stored)]]
            total += math.prod(stored) // elems * nbytes
        if self.kind == "denoiser":
            h, w = self.latent_hw
            lat = self.in_channels * h * w
            return total + 4 * lat + 4 * self.n_caption * self.cap_dim + \
                (8 * lat if self.reference else 0)
        T = self.n_tokens
        acts = 4 * (c.adaln_in + T * c.head_dim * 2 + c.n_layers * (2 * T * c.dim + 4 * c.dim))
        return total + acts + (self.weights_bytes_f32() if self._include_weights() else 0)

    def _include_weights(self) -> bool:
        if self.include_weights is not None:
            return self.include_weights
        return self.weights_bytes_f32() < 64 << 20

    # -- identity
    def fingerprint(self) -> str:
        """16 hex digits of the sha256 of the kind's fields and :data:`GENERATOR_VERSION`."""
        d = self.fields()
        if d["qk_norm_scale"] == 1.0:        # the default: fingerprints of older specs unchanged
            del d["qk_norm_scale"]
        if self.kind == "block":
            if d["types"] == "q8_0":         # likewise
                del d["types"]
        else:
            d["kind"] = self.kind
        d["generator_version"] = GENERATOR_VERSION
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    def _spec_file_text(self) -> str:
        info: dict[str, Any] = {"spec": self.fields(), "fingerprint": self.fingerprint(),
                                "generator_version": GENERATOR_VERSION}
        if self.kind != "block":             # block models' files predate kinds
            info["kind"] = self.kind
        return json.dumps(info, indent=1, sort_keys=True) + "\n"

    def validate(self) -> "SyntheticSpec":
        """Raise ValueError unless the spec makes a model: runnable dims, a known type policy
        or layout, a token layout that fits, no field of the other kind set."""
        defaults = SyntheticSpec()
        other = [f.name for f in dataclasses.fields(self) if f.name not in _FIELDS[self.kind]
                 and getattr(self, f.name) != getattr(defaults, f.name)]
        if other:
            why = "cap_dim is given" if self.kind == "denoiser" else "cap_dim is not given"
            verb = "does" if len(other) == 1 else "do"
            raise ValueError(f"SyntheticSpec: {', '.join(other)} {verb} not apply to a "
                             f"{self.kind} model ({why})")
        self._file_layout()
        self.config()
        if not (isinstance(self.qk_norm_scale, (int, float)) and
                math.isfinite(self.qk_norm_scale) and 0 < self.qk_norm_scale <= 1e3):
            raise ValueError(f"SyntheticSpec: qk_norm_scale must be a finite number in "
                             f"(0, 1000], got {self.qk_norm_scale!r}")
        if self.kind == "block":
            if self.n_caption < 0 or len(self.grid) != 3 or min(self.grid) < 1:
                raise ValueError(f"SyntheticSpec: bad token layout n_caption={self.n_caption}, "
                                 f"grid={self.grid}")
            if not 0 <= self.mask_pad <= self.n_caption:
                raise ValueError(f"SyntheticSpec: mask_pad {self.mask_pad} must be within the "
                                 f"{self.n_caption} caption tokens")
            return self
        h, w = self.latent_hw
        if min(h, w) < self.patch or h % self.patch or w % self.patch:
            raise ValueError(f"SyntheticSpec: latent_hw {self.latent_hw} must be positive "
                             f"multiples of the patch {self.patch}")
        if self.n_caption < 1 or not 0.0 <= self.timestep <= 1.0:
            raise ValueError(f"SyntheticSpec: a denoiser needs n_caption >= 1 and timestep in "
                             f"[0, 1], got {self.n_caption}, {self.timestep}")
        return self


def make_synthetic(out_dir: str | os.PathLike, spec: SyntheticSpec,
                   progress: Callable[[str], None] | None = None, *,
                   replace: bool = False) -> Path:
    """Write the synthetic model directory of ``spec`` (either kind) at ``out_dir``:
    ``model.gguf``, ``fixtures.safetensors`` and ``synthetic.json``.

    ``out_dir`` must not exist yet, unless ``replace``: an existing model directory is then
    swapped out once the new one is complete. Built in a temporary sibling directory and
    renamed into place, so readers never see a half-written model. A block model's fixtures
    hold the inputs and each layer's reference (:func:`_write_block_model`), a denoiser's its
    stored inputs and, when ``spec.reference``, its float64 output (:func:`_write_denoiser`).
    """
    spec.validate()
    out_dir = Path(out_dir)
    check_replaceable(out_dir, replace)      # before the work, not after
    say = progress or (lambda s: None)
    t0 = time.monotonic()
    write = _write_block_model if spec.kind == "block" else _write_denoiser
    build_model_dir(out_dir, lambda tmp: write(tmp, spec, say), replace=replace)
    say(f"done in {time.monotonic() - t0:.1f} s: {out_dir}")
    return out_dir


# ============================================================================== block models

def _draw_layer(rng: np.random.Generator, c: BlockConfig, i: int,
                say: Callable[[str], None], types: str = "q8_0", qk_norm_scale: float = 1.0
                ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Draw layer i: returns (GGUF tensors by short name, float64 dequantized weights). The
    q_norm / k_norm weights are drawn as the other norms' and then multiplied by
    ``qk_norm_scale`` (1: the same bytes as before the option)."""
    stored: dict[str, Any] = {}
    f64: dict[str, np.ndarray] = {}
    names = tensor_names("layers", i, c.variant)

    def proj(k: str, rows: int, cols: int, gain: float = 1.0) -> None:
        gtype = layouts.get_layout(types, policy=True).type_for(names[k], (rows, cols))
        say(f"layer {i}: {k} [{rows} x {cols}] {gtype}")
        w = rng.standard_normal((rows, cols), dtype=np.float32)
        w *= np.float32(gain / math.sqrt(cols))
        if gtype == "Q8_0":                  # today's path, byte for byte
            q = quantize_q8_0(w, f"layers.{i}.{k}")
            del w
            stored[k] = Q8_0Tensor(q)
            f64[k] = dequantize_q8_0(q).astype(np.float64)
            return
        raw = layouts.encode(w, gtype, names[k])
        del w
        stored[k] = QuantTensor(raw, gtype)
        f64[k] = layouts.decode(raw, gtype, (rows, cols)).astype(np.float64)

    proj("qkv", c.qkv_width, c.dim)
    proj("out", c.dim, c.dim)
    proj("w1", c.ffn_dim, c.dim)
    proj("w3", c.ffn_dim, c.dim)
    proj("w2", c.dim, c.ffn_dim)
    for k in NORMS:
        n = c.head_dim if k in ("q_norm", "k_norm") else c.dim
        w = (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)
        if k in ("q_norm", "k_norm") and qk_norm_scale != 1.0:
            w *= np.float32(qk_norm_scale)
        stored[k] = w
        f64[k] = w.astype(np.float64)
    # adaLN: modest modulation (|scale| ~ 0.4, tanh(gate) well inside (-1, 1))
    proj("adaln_w", 4 * c.dim, c.adaln_in, gain=0.4)
    b = (0.1 * rng.standard_normal(4 * c.dim)).astype(np.float32)
    stored["adaln_b"] = b
    f64["adaln_b"] = b.astype(np.float64)
    return stored, f64


def _write_block_model(tmp: Path, spec: SyntheticSpec, say: Callable[[str], None]) -> None:
    """A block model into ``tmp``: every weight and input drawn in turn from one generator.

    Reference outputs chain: layer i+1's ``blk_in`` is layer i's ``ref_out`` (float64
    evaluation rounded to float32), and each ``ref_out`` is the float64 evaluation of its own
    layer on exactly the stored float32 ``blk_in``.
    """
    from nxhpc.dit.reference import adaln_f64, block_forward_f64
    c = spec.config()
    T = spec.n_tokens
    theta, axes = spec.rope_params()
    rng = np.random.default_rng(spec.seed)

    t_emb = rng.standard_normal(c.adaln_in).astype(np.float32)
    x = rng.standard_normal((T, c.dim)).astype(np.float32)
    pe32 = _rope.rope_table(_rope.position_ids(spec.n_caption, spec.grid), axes, theta
                            ).astype(np.float32)
    mask = None
    if spec.mask_pad:
        mask = np.ones(T, dtype=np.float32)
        mask[spec.n_caption - spec.mask_pad:spec.n_caption] = 0.0
    include_w = spec._include_weights()

    gguf_tensors: dict[str, Any] = {}
    fx: dict[str, np.ndarray] = {"t_emb": t_emb, "pe": pe32}
    if mask is not None:
        fx["mask"] = mask
    for i in range(c.n_layers):
        stored, w64 = _draw_layer(rng, c.block, i, say, spec.types, spec.qk_norm_scale)
        for k, name in tensor_names("layers", i, c.variant).items():
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

    fp = spec.fingerprint()
    say(f"writing {GGUF_FILE}")
    write_gguf(tmp / GGUF_FILE, gguf_tensors, prefix=spec.prefix, metadata={
        "general.name": f"nxhpc synthetic {c.variant}", "nxhpc.synthetic": True,
        "nxhpc.seed": int(spec.seed), "nxhpc.norm_eps": float(c.norm_eps),
        "nxhpc.rope_theta": float(theta), "nxhpc.axes_dims": list(axes),
        "nxhpc.n_caption": int(spec.n_caption), "nxhpc.grid": list(spec.grid),
        "nxhpc.fingerprint": fp})
    say(f"writing {FIXTURES_FILE}")
    FixtureStore.save(tmp / FIXTURES_FILE, fx, metadata={
        "norm_eps": repr(float(c.norm_eps)), "source": "nxhpc synthetic", "fingerprint": fp})
    (tmp / SPEC_FILE).write_text(spec._spec_file_text())


# ============================================================================== whole denoisers

def _draw_tensor(spec: SyntheticSpec, index: int, name: str, shape: tuple[int, ...]
                 ) -> np.ndarray:
    """Tensor ``index`` of the model, float32, from its own generator (so tensors can be drawn
    one at a time, in any order). Every parameter is random, with scales that keep the random
    model's activations O(1) (as ``nxhpc.dit.oracle.random_zimage_model``): Linear weights
    N(0, 1/fan_in) (adaLN ones N(0, 0.25/fan_in)), biases N(0, 0.1^2), norm weights
    1 + N(0, 0.2^2) (q_norm / k_norm ones times ``qk_norm_scale``), pad tokens N(0, 1)."""
    rng = np.random.default_rng([spec.seed, index])
    z = rng.standard_normal(shape, dtype=np.float32)
    if name.endswith("pad_token"):
        return z
    if len(shape) == 1 and name.endswith(".bias"):
        return z * np.float32(0.1)
    if len(shape) == 1:
        z *= np.float32(0.2)
        z += np.float32(1.0)
        if spec.qk_norm_scale != 1.0 and name.endswith(("q_norm.weight", "k_norm.weight")):
            z *= np.float32(spec.qk_norm_scale)
        return z
    gain = 0.5 if "adaLN_modulation" in name else 1.0
    z *= np.float32(gain / math.sqrt(shape[1]))
    return z


def _draw_inputs(spec: SyntheticSpec) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([spec.seed, 1 << 30])
    h, w = spec.latent_hw
    return {"latents": rng.standard_normal((spec.in_channels, h, w)).astype(np.float32),
            "cap_feats": rng.standard_normal((spec.n_caption, spec.cap_dim)).astype(np.float32),
            "timestep": np.float64(spec.timestep)}


def _write_denoiser_gguf(path: Path, spec: SyntheticSpec, say: Callable[[str], None]) -> None:
    """Stream every tensor into ``path`` in ``spec.layout``'s names, shapes and types through
    the one writer (``nxhpc.formats.gguf_io.write_gguf``: each tensor drawn and encoded when
    it is written, one in memory at a time)."""
    lay = layouts.get_layout(spec.layout)
    shapes = spec.config().tensor_shapes()
    tensors: dict[str, LazyTensor] = {}
    for i, (name, shape) in enumerate(shapes.items()):
        stored = tuple(lay.stored_shape(name, shape))
        tensors[name] = LazyTensor(stored, lay.type_for(name, stored),
                                   lambda i=i, name=name, stored=stored:
                                   _draw_tensor(spec, i, name, stored))
    big = {lay.prefix + n for n, s in shapes.items() if len(s) == 2 and math.prod(s) >= 1 << 22}

    def progress(name: str, i: int, n: int) -> None:
        if name in big:
            say(f"tensor {i}/{n}: {name.removeprefix(lay.prefix)}")
    write_gguf(path, tensors, prefix=lay.prefix, arch=lay.arch, progress=progress,
               metadata={"general.name": f"nxhpc synthetic denoiser {spec.fingerprint()}",
                         "nxhpc.synthetic": True, "nxhpc.fingerprint": spec.fingerprint()})


def _write_denoiser(tmp: Path, spec: SyntheticSpec, say: Callable[[str], None]) -> None:
    """A whole denoiser into ``tmp``: ``model.gguf`` in ``spec.layout``; fixtures ``latents``,
    ``cap_feats``, ``timestep`` and, when ``spec.reference``, ``reference``: the float64 output
    of ``nxhpc.dit.denoiser_ref`` on the weights as the ``gguf`` package reads them back."""
    say(f"writing {GGUF_FILE} ({spec.config().summary()}, layout {spec.layout})")
    _write_denoiser_gguf(tmp / GGUF_FILE, spec, say)
    fx = _draw_inputs(spec)
    if spec.reference:
        from nxhpc.dit.denoiser_ref import denoiser_forward_f64
        from nxhpc.models.zimage_files import read_zimage_gguf
        say("float64 reference (nxhpc.dit.denoiser_ref on the gguf package's read-back)")
        f = read_zimage_gguf(tmp / GGUF_FILE)
        ref = denoiser_forward_f64(fx["latents"], float(fx["timestep"]), fx["cap_feats"],
                                   f.weights, spec.config())
        if not np.isfinite(ref).all():  # pragma: no cover - a generator bug
            raise RuntimeError("make_synthetic: non-finite denoiser reference output")
        fx["reference"] = ref
    FixtureStore.save(tmp / FIXTURES_FILE, fx, float64=("timestep", "reference"),
                      metadata={"source": "nxhpc synthetic denoiser",
                                "fingerprint": spec.fingerprint()})
    (tmp / SPEC_FILE).write_text(spec._spec_file_text())


@dataclass
class DenoiserFixtures:
    """A denoiser directory's stored inputs and (optional) float64 reference output."""
    path: Path
    latents: np.ndarray               # float32 [C, H, W]
    timestep: float
    cap_feats: np.ndarray             # float32 [L, cap_dim]
    reference: np.ndarray | None      # float64 [C, H, W], or None


def read_denoiser_fixtures(path: str | os.PathLike) -> DenoiserFixtures:
    """Read a denoiser directory's stored inputs from its fixture store (``fixtures.safetensors``,
    ``nxhpc.formats.fixtures``); ModelFileError / MissingTensorError naming the file and the
    fixture for anything malformed, missing or non-finite."""
    fx = FixtureStore(path)
    lat = fx.load("latents")
    cap = fx.load("cap_feats")
    t = fx.load("timestep", (), float64=True)
    ref = fx.load("reference", lat.shape, float64=True) if fx.has("reference") else None
    if lat.ndim != 3 or cap.ndim != 2:
        raise ModelFileError(f"{fx.path}: denoiser fixtures have shapes latents {lat.shape}, "
                             f"cap_feats {cap.shape}; expected [C, H, W], [L, cap_dim]")
    return DenoiserFixtures(fx.path, lat, float(t), cap, ref)
