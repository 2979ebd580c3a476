"""The one config authority of the DiT models: dims, divisibility rules, tensor names, shapes.

Owns :class:`DenoiserConfig`, the config of a model -- a whole Z-Image denoiser
(``docs/denoiser.md``, "Configs": blocks, refiner counts, ``in_channels``, ``patch``,
``cap_dim``, t-embedder widths, RoPE, eps) or a block model holding only blocks (the
embedders None; ``variant`` Lumina-2 possible) -- with the block count per stack
(:attr:`DenoiserConfig.stacks`) and the tensors and torch shapes it implies
(:meth:`DenoiserConfig.tensor_shapes`); :class:`BlockConfig`, the view every block of a model
shares (:attr:`DenoiserConfig.block`: dim, heads, kv heads, head_dim, FFN, adaLN width, eps,
variant; ``qkv_width``, the runnable rules of :meth:`BlockConfig.validate`, the check of one
layer's bound weights :meth:`BlockConfig.check_layer`); the block's tensor table
(:data:`BLOCK_TENSORS`: short name, name inside the block, role, whether only modulated blocks
have it) and the one tensor naming :func:`tensor_names` (``layers.N``, ``noise_refiner.N`` --
modulated; ``context_refiner.N`` -- no adaLN tensors; with or without the
``model.diffusion_model.`` prefix); and the one inference :func:`infer_config` (a tensor table
-> the config, raising the ``nxhpc.formats`` error classes naming the tensor), with
:func:`check_stack`.
Must not: read files (it takes ``{name: (shape, type name)}``), import the compiled kernels, or
decode weights.

Config inference (``docs/denoiser.md``, "Config inference"):

- dim D = len(``layers.0.attention_norm1.weight``); head_dim = len(``layers.0.attention.q_norm
  .weight``); n_heads = attention.out inputs / head_dim; n_kv_heads from the fused qkv rows
  ``(n_heads + 2 n_kv_heads) head_dim``; ffn_dim = rows of ``layers.0.feed_forward.w1.weight``;
  the variant from where the adaLN Linear sits (``adaLN_modulation.0``: Z-Image, ``.1``:
  Lumina-2, SiLU first);
- layer and refiner counts from the block indices present (0..n-1, no gaps);
- a whole denoiser: in_channels C and patch p from ``x_embedder.weight [D, p*p*C]`` (the
  product is ambiguous, so ``patch`` is given, Z-Image: 2, and C = columns / p^2); cap_dim =
  columns of ``cap_embedder.1.weight``; t-embedder widths from ``t_embedder.mlp.0 [mid, freq]``
  and ``t_embedder.mlp.2 [adaln_in, mid]`` (Z-Image: 256 -> 1024 -> 256);
- everything else (every block of every stack, final layer ``[p*p*C, D]``, pad tokens
  ``[1, D]`` or ``[D]``) is then checked against the shapes the config implies.
"""
from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from nxhpc.formats.gguf_io import BLOCK_INDEX, PREFIX, MissingTensorError, ModelFileError
from nxhpc.formats.weights import RUNNABLE_TYPES, WeightTensor, as_weight_tensor, row_bytes

__all__ = ["DenoiserConfig", "BlockConfig", "TensorSpec", "BLOCK_TENSORS", "BLOCK_STACKS",
           "STACKS", "PROJECTIONS", "NORMS", "MODULATION", "DEFAULT_NORM_EPS", "MATMUL_BLOCK",
           "VARIANTS", "VECTOR_TYPES", "DENOISER_TENSORS", "PREFIX",
           "tensor_names", "block_label", "block_view", "check_stack",
           "infer_config",
           "strip_prefix"]

DEFAULT_NORM_EPS = 1e-5
#: Every length a matmul reduces over (dim, ffn_dim, adaln_in) is a multiple of this: the
#: smallest block of a quantized type (Q8_0, Q4_0, ...). A type with longer blocks (K-quants:
#: 256) is checked per tensor against its own geometry when it is bound.
MATMUL_BLOCK = 32
VARIANTS = ("zimage", "lumina2")
#: Types a 1-D tensor (norm weight, bias) may be stored in; it is decoded to float32 at bind.
VECTOR_TYPES = ("F32", "F16", "BF16", "Q8_0")


class TensorSpec(NamedTuple):
    """One tensor of a block: ``key`` (field of ``LayerWeights``), ``suffix`` (name inside the
    block; ``{ada}`` is the variant's adaLN index), ``role`` ("matrix": run as stored, or
    "vector": float32), ``modulation`` (only modulated blocks have it)."""
    key: str
    suffix: str
    role: str
    modulation: bool


BLOCK_TENSORS: tuple[TensorSpec, ...] = (
    TensorSpec("qkv", "attention.qkv.weight", "matrix", False),
    TensorSpec("out", "attention.out.weight", "matrix", False),
    TensorSpec("w1", "feed_forward.w1.weight", "matrix", False),
    TensorSpec("w3", "feed_forward.w3.weight", "matrix", False),
    TensorSpec("w2", "feed_forward.w2.weight", "matrix", False),
    TensorSpec("attention_norm1", "attention_norm1.weight", "vector", False),
    TensorSpec("attention_norm2", "attention_norm2.weight", "vector", False),
    TensorSpec("ffn_norm1", "ffn_norm1.weight", "vector", False),
    TensorSpec("ffn_norm2", "ffn_norm2.weight", "vector", False),
    TensorSpec("q_norm", "attention.q_norm.weight", "vector", False),
    TensorSpec("k_norm", "attention.k_norm.weight", "vector", False),
    TensorSpec("adaln_w", "adaLN_modulation.{ada}.weight", "matrix", True),
    TensorSpec("adaln_b", "adaLN_modulation.{ada}.bias", "vector", True),
)
PROJECTIONS = ("qkv", "out", "w1", "w3", "w2")
NORMS = ("attention_norm1", "attention_norm2", "ffn_norm1", "ffn_norm2", "q_norm", "k_norm")
MODULATION = ("adaln_w", "adaln_b")
#: Stack prefix -> whether its blocks are modulated (docs/denoiser.md: the context refiner is not).
BLOCK_STACKS: dict[str, bool] = {"layers": True, "noise_refiner": True, "context_refiner": False}
_ROLE = {t.key: t.role for t in BLOCK_TENSORS}
_SUFFIX = {t.key: t.suffix for t in BLOCK_TENSORS}


def block_label(prefix: str, index: int) -> str:
    """How errors name a block: ``layer 3`` for the main stack, ``noise_refiner.1`` otherwise."""
    return f"layer {index}" if prefix == "layers" else f"{prefix}.{index}"


def _modulated(prefix: str, modulated: bool | None) -> bool:
    if modulated is not None:
        return bool(modulated)
    if prefix not in BLOCK_STACKS:
        raise ValueError(f"unknown block stack prefix {prefix!r} (known: "
                         f"{', '.join(BLOCK_STACKS)}); pass modulated= explicitly")
    return BLOCK_STACKS[prefix]


@dataclass(frozen=True)
class BlockConfig:
    """Dimensions of one DiT block (identical for every block of a model, refiners included).

    ``n_layers`` is the main stack's depth (the block itself does not depend on it).
    """
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

    # -- derived sizes
    @property
    def qkv_width(self) -> int:
        """Rows of the fused qkv weight: ``(n_heads + 2 n_kv_heads) head_dim``."""
        return (self.n_heads + 2 * self.n_kv_heads) * self.head_dim

    @property
    def adaln_width(self) -> int:
        """Outputs of the adaLN Linear: ``[scale_msa | gate_msa | scale_mlp | gate_mlp]`` = 4D."""
        return 4 * self.dim

    # -- rules
    def validate(self) -> "BlockConfig":
        """Raise ValueError (naming every broken rule) unless the dims are runnable."""
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
                errs.append(f"head_dim {c.head_dim} is odd (RoPE rotates pairs)")
            for nm in ("dim", "ffn_dim", "adaln_in"):
                if getattr(c, nm) % MATMUL_BLOCK:
                    errs.append(f"{nm} {getattr(c, nm)} is not a multiple of {MATMUL_BLOCK} "
                                f"(the matmul block)")
        if c.variant not in VARIANTS:
            errs.append(f"variant {c.variant!r} is not one of {VARIANTS}")
        if not (0 < c.norm_eps < 1):
            errs.append(f"norm_eps {c.norm_eps} out of range (0, 1)")
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

    # -- tensors
    def tensor_specs(self, modulated: bool = True) -> tuple[TensorSpec, ...]:
        """The block's tensors (without the adaLN pair when not ``modulated``)."""
        return tuple(t for t in BLOCK_TENSORS if modulated or not t.modulation)

    def shapes(self, modulated: bool = True) -> dict[str, tuple[int, ...]]:
        """Short name -> torch shape (``[out, in]`` for matrices)."""
        D, F, hd = self.dim, self.ffn_dim, self.head_dim
        every = {"qkv": (self.qkv_width, D), "out": (D, self.n_heads * hd), "w1": (F, D),
                 "w3": (F, D), "w2": (D, F), "attention_norm1": (D,), "attention_norm2": (D,),
                 "ffn_norm1": (D,), "ffn_norm2": (D,), "q_norm": (hd,), "k_norm": (hd,),
                 "adaln_w": (self.adaln_width, self.adaln_in), "adaln_b": (self.adaln_width,)}
        return {t.key: every[t.key] for t in self.tensor_specs(modulated)}

    def tensor_names(self, index: int, prefix: str = "layers", *, modulated: bool | None = None,
                     model_prefix: bool = False) -> dict[str, str]:
        """Short name -> tensor name of block ``prefix.index`` (``model_prefix``: with
        ``model.diffusion_model.``). ``modulated`` defaults to the stack's kind."""
        return tensor_names(prefix, index, self.variant, modulated=modulated,
                            model_prefix=model_prefix)

    def check_layer(self, weights: Any, where: str = "layer 0",
                    modulated: bool | None = None) -> None:
        """Check every tensor of a bound layer (a ``LayerWeights``) against this config.

        Matrices (typed :class:`~nxhpc.formats.weights.WeightTensor`, or a bare uint8 Q8_0 /
        float32 array) must have the expected torch shape, a runnable type, and rows of whole
        blocks of that type; vectors must be float32 1-D of the expected length. ``modulated``
        defaults to whether the weights carry adaLN tensors. ValueError names the tensor.
        """
        if modulated is None:
            modulated = getattr(weights, "adaln_w", None) is not None
        exp = self.shapes(modulated)
        for key, shape in exp.items():
            a = getattr(weights, key, None)
            if _ROLE[key] == "matrix":
                _check_matrix(a, key, shape, where)
            elif (not isinstance(a, np.ndarray) or a.dtype != np.float32 or a.shape != shape):
                got = (f"{a.dtype} {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__)
                raise ValueError(f"{where}: weight {key!r} must be float32 {shape}, got {got}")
        if not modulated:
            extra = [k for k in MODULATION if getattr(weights, k, None) is not None]
            if extra:
                raise ValueError(f"{where}: an unmodulated block has no adaLN tensors, but "
                                 f"{extra} are bound")


def _check_matrix(a: Any, key: str, shape: tuple[int, ...], where: str) -> None:
    rows, cols = shape
    name = a.name if isinstance(a, WeightTensor) else key
    try:
        w = as_weight_tensor(a, name)
    except (TypeError, ValueError) as e:
        got = f"{a.dtype} {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
        raise ValueError(f"{where}: weight {key!r} must be Q8_0 uint8 "
                         f"{(rows, row_bytes('Q8_0', cols))}, a float32 {shape} array or a "
                         f"WeightTensor of shape {list(shape)}, got {got} ({e})") from None
    if w.type_name not in RUNNABLE_TYPES:
        raise ValueError(f"{where}: weight {key!r} has type {w.type_name}; the block runs "
                         f"{', '.join(RUNNABLE_TYPES)} [tensor {w.name}]")
    try:
        want = (rows, row_bytes(w.ggml_type, cols))
    except ValueError as e:
        raise ValueError(f"{where}: weight {key!r} [tensor {w.name}]: {e}") from None
    if w.shape != shape:
        raise ValueError(f"{where}: weight {key!r} must be {w.type_name} uint8 {want} (torch "
                         f"shape {list(shape)}), got uint8 {w.data.shape} (torch shape "
                         f"{list(w.shape)}) [tensor {w.name}]")


def tensor_names(stack: str, i: int, variant: str = "zimage", *,
                 modulated: bool | None = None, model_prefix: bool = False) -> dict[str, str]:
    """Short name -> tensor name of block ``stack.i`` (``layers``, ``noise_refiner``,
    ``context_refiner``): the one tensor naming of every block of every model.

    Canonical (prefix-free) unless ``model_prefix``. ``variant`` places the adaLN Linear
    (``adaLN_modulation.0`` for Z-Image, ``.1`` after Lumina-2's SiLU). ``modulated`` defaults
    to the stack's kind (:data:`BLOCK_STACKS`): ``context_refiner`` blocks have no
    ``adaLN_modulation`` tensors.
    """
    mod = _modulated(stack, modulated)
    ada = 1 if variant == "lumina2" else 0
    head = (PREFIX if model_prefix else "") + f"{stack}.{int(i)}."
    return {t.key: head + t.suffix.format(ada=ada) for t in BLOCK_TENSORS
            if mod or not t.modulation}


def check_stack(tensors: Mapping[str, tuple[tuple[int, ...], str]], cfg: BlockConfig,
                prefix: str, count: int, where: str, *, modulated: bool | None = None) -> None:
    """Every tensor of blocks ``prefix.0 .. prefix.count-1`` is present, shaped and typed as
    ``cfg`` says; :class:`MissingTensorError` / :class:`ModelFileError` naming ``where`` and
    the tensor (its ``tensor`` attribute too)."""
    mod = _modulated(prefix, modulated)
    exp = cfg.shapes(mod)
    for i in range(count):
        for key, name in tensor_names(prefix, i, cfg.variant, modulated=mod).items():
            if name not in tensors:
                raise MissingTensorError(f"{where}: required tensor {name!r} is missing", name)
            shape, tname = tensors[name]
            if tuple(shape) != exp[key]:
                raise ModelFileError(f"{where}: tensor {name!r} has shape {list(shape)}, "
                                     f"expected {list(exp[key])} for {cfg.summary()}", name)
            allowed = RUNNABLE_TYPES if _ROLE[key] == "matrix" else VECTOR_TYPES
            if tname not in allowed:
                raise ModelFileError(f"{where}: tensor {name!r} has type {tname}; nxhpc runs "
                                     f"{', '.join(allowed)} for this tensor", name)
            if _ROLE[key] == "matrix":
                try:
                    row_bytes(tname, exp[key][1])
                except ValueError as e:
                    raise ModelFileError(f"{where}: tensor {name!r}: {e}", name) from None


# ============================================================================== the model
# A model is the blocks above plus, for a whole denoiser (docs/denoiser.md), the embedders, the
# pad tokens and the final layer. A block model is the same model holding only blocks.

DENOISER_TENSORS: dict[str, str] = {
    "x_embedder.weight": "matrix", "x_embedder.bias": "vector",
    "t_embedder.mlp.0.weight": "matrix", "t_embedder.mlp.0.bias": "vector",
    "t_embedder.mlp.2.weight": "matrix", "t_embedder.mlp.2.bias": "vector",
    "cap_embedder.0.weight": "vector",
    "cap_embedder.1.weight": "matrix", "cap_embedder.1.bias": "vector",
    "x_pad_token": "vector", "cap_pad_token": "vector",
    "final_layer.adaLN_modulation.1.weight": "matrix",
    "final_layer.adaLN_modulation.1.bias": "vector",
    "final_layer.linear.weight": "matrix", "final_layer.linear.bias": "vector",
}
"""The non-block tensors of a whole denoiser and their role: a "matrix" is run as stored (a
typed weight), a "vector" is decoded to float32 (pad tokens ``[1, D]`` or ``[D]`` are
vectors)."""

#: The block stacks in the order a whole call runs them (image rows, caption rows, joint rows).
STACKS = ("noise_refiner", "context_refiner", "layers")
#: A block's tensors in the order tensor tables and files list them (the order generated
#: models draw them in: changing it changes every built-in denoiser).
_FILE_ORDER = ("qkv", "out", "q_norm", "k_norm", "attention_norm1", "attention_norm2",
               "ffn_norm1", "ffn_norm2", "w1", "w2", "w3", "adaln_w", "adaln_b")


def _default_rope(head_dim: int, variant: str) -> tuple[float, tuple[int, ...]]:
    from nxhpc.dit.rope import VARIANT_ROPE, default_axes_dims
    return VARIANT_ROPE[variant][0], default_axes_dims(head_dim, variant)


@dataclass(frozen=True)
class DenoiserConfig:
    """The one config of a DiT model (``docs/denoiser.md``, "Configs"): every block's dims, the
    block count of each stack and, for a whole denoiser, its embedders. Shape comments are torch
    order (``[out, in]`` for a Linear weight).

    A block model (only ``layers.*``, e.g. the built-in ``tiny``) leaves ``in_channels``,
    ``patch`` and ``cap_dim`` None (:attr:`whole` is False). :attr:`block` is the view every
    block shares (:class:`BlockConfig`), :attr:`stacks` the block count per stack.
    ``variant``: ``"zimage"`` or ``"lumina2"`` (SiLU before a 1024-wide adaLN; block models
    only). ``rope_theta`` / ``axes_dims`` default to the variant's."""
    dim: int                 # D
    n_heads: int             # H
    n_kv_heads: int          # KVH (Z-Image: = H)
    head_dim: int            # hd = D / H
    ffn_dim: int             # feed_forward.w1 rows (Z-Image: int(D/3*8))
    n_layers: int            # main layers (Z-Image: 30)
    n_noise_refiner: int = 0     # modulated refiner blocks on image rows (2)
    n_context_refiner: int = 0   # unmodulated refiner blocks on caption rows (2)
    in_channels: int | None = None   # C latent channels (16); out channels are the same
    patch: int | None = None         # p (2)
    cap_dim: int | None = None       # caption feature width (2560: Qwen3-4B)
    t_freq_dim: int = 256    # sinusoid width fed to t_embedder.mlp.0
    t_mid_dim: int = 1024    # t_embedder.mlp.0 rows
    adaln_in: int = 256      # t_emb width = t_embedder.mlp.2 rows = adaLN input
    norm_eps: float = DEFAULT_NORM_EPS   # every RMSNorm (blocks, q/k norms, cap_embedder.0)
    final_eps: float = 1e-6  # final LayerNorm (no affine)
    rope_theta: float | None = None            # None -> the variant's (Z-Image 256)
    axes_dims: tuple[int, ...] | None = None   # None -> the variant's ([32,48,48] at hd 128)
    t_scale: float = 1000.0
    seq_multiple: int = 32   # image and caption rows are padded to a multiple of this
    max_period: float = 10000.0
    variant: str = "zimage"

    def __post_init__(self) -> None:
        hd = self.head_dim
        rope_ok = self.variant in VARIANTS and isinstance(hd, int) and hd >= 6 and hd % 2 == 0
        if self.rope_theta is None and rope_ok:
            object.__setattr__(self, "rope_theta", _default_rope(hd, self.variant)[0])
        if self.axes_dims is None and rope_ok:
            object.__setattr__(self, "axes_dims", _default_rope(hd, self.variant)[1])
        elif self.axes_dims is not None:
            object.__setattr__(self, "axes_dims", tuple(int(a) for a in self.axes_dims))
        self.validate()

    # -- derived
    @property
    def whole(self) -> bool:
        """Whether this is a whole denoiser (embedders, pad tokens, final layer), not only
        blocks."""
        return self.cap_dim is not None

    @property
    def adaln_silu(self) -> bool:
        """SiLU before the blocks' adaLN Linear (Lumina-2)."""
        return self.variant == "lumina2"

    @property
    def stacks(self) -> dict[str, int]:
        """Blocks per stack, in :data:`STACKS` order."""
        return {"noise_refiner": self.n_noise_refiner,
                "context_refiner": self.n_context_refiner, "layers": self.n_layers}

    @property
    def qkv_width(self) -> int:
        """Rows of the fused qkv weight: ``(H + 2 KVH) hd``."""
        return (self.n_heads + 2 * self.n_kv_heads) * self.head_dim

    @property
    def out_channels(self) -> int | None:
        return self.in_channels

    @property
    def patch_dim(self) -> int:
        """Values per patch token: ``p*p*C`` (x_embedder columns, final_layer rows)."""
        self._need_whole("patch_dim")
        return self.patch * self.patch * self.in_channels

    def _need_whole(self, what: str) -> None:
        if not self.whole:
            raise ValueError(f"DenoiserConfig.{what}: a block model has no embedders")

    def validate(self) -> DenoiserConfig:
        """Raise ValueError (naming every broken rule) unless the dimensions are consistent."""
        errs = []
        ints = ["dim", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "n_layers",
                "n_noise_refiner", "n_context_refiner", "t_freq_dim", "t_mid_dim", "adaln_in",
                "seq_multiple"]
        emb = ("in_channels", "patch", "cap_dim")
        given = [n for n in emb if getattr(self, n) is not None]
        if given and len(given) != len(emb):
            raise ValueError(f"DenoiserConfig: give all of {list(emb)} (a whole denoiser) or "
                             f"none (a block model), got {given}")
        ints += given
        bad = [n for n in ints if not isinstance(getattr(self, n), int)
               or isinstance(getattr(self, n), bool)]
        if bad:
            raise ValueError(f"DenoiserConfig: fields {bad} must be int")
        if self.variant not in VARIANTS:
            raise ValueError(f"DenoiserConfig: variant {self.variant!r} is not one of "
                             f"{VARIANTS}")
        if min(getattr(self, n) for n in ints if n not in ("n_noise_refiner",
                                                            "n_context_refiner")) < 1:
            errs.append("all dims must be positive")
        elif min(self.n_noise_refiner, self.n_context_refiner) < 0:
            errs.append("refiner counts must be >= 0")
        else:
            if self.n_heads * self.head_dim != self.dim:
                errs.append(f"n_heads*head_dim = {self.n_heads * self.head_dim} != dim "
                            f"{self.dim}")
            if self.n_heads % self.n_kv_heads:
                errs.append(f"n_heads {self.n_heads} not a multiple of n_kv_heads "
                            f"{self.n_kv_heads}")
            if self.head_dim % 2:
                errs.append(f"head_dim {self.head_dim} is odd")
            if self.t_freq_dim % 2:
                errs.append(f"t_freq_dim {self.t_freq_dim} is odd")
            ax = self.axes_dims
            if ax is None or len(ax) != 3 or sum(ax) != self.head_dim or \
                    any(a <= 0 or a % 2 for a in ax):
                errs.append(f"axes_dims {ax} must be 3 positive even dims summing to head_dim "
                            f"{self.head_dim}")
        for n in ("norm_eps", "final_eps"):
            if not 0 < getattr(self, n) < 1:
                errs.append(f"{n} {getattr(self, n)} out of (0, 1)")
        for n in ("rope_theta", "t_scale", "max_period"):
            v = getattr(self, n) or 0
            if not (v > 0 and math.isfinite(v)):
                errs.append(f"{n} {getattr(self, n)} must be positive and finite")
        if errs:
            raise ValueError("DenoiserConfig: " + "; ".join(errs))
        return self

    # -- the block view and the tensors the config implies
    def as_block_config(self, validate: bool = True) -> BlockConfig:
        """The :class:`BlockConfig` every block of this model shares (refiners included; its
        ``n_layers`` is the main stack's depth). ``validate``: also apply the block's runnable
        rules (:meth:`BlockConfig.validate`: dims multiples of the matmul block, ...)."""
        c = BlockConfig(dim=self.dim, n_heads=self.n_heads, n_kv_heads=self.n_kv_heads,
                        head_dim=self.head_dim, ffn_dim=self.ffn_dim, n_layers=self.n_layers,
                        adaln_in=self.adaln_in, variant=self.variant,
                        adaln_silu=self.adaln_silu, norm_eps=self.norm_eps)
        return c.validate() if validate else c

    @property
    def block(self) -> BlockConfig:
        """The validated block view (:meth:`as_block_config`)."""
        return self.as_block_config()

    def block_shapes(self, modulated: bool) -> dict[str, tuple[int, ...]]:
        """Short name -> torch shape of one block's tensors (:meth:`BlockConfig.shapes`)."""
        return self.as_block_config(validate=False).shapes(modulated)

    def tensor_shapes(self, *, norm_final: bool = False) -> dict[str, tuple[int, ...]]:
        """Every canonical (prefix-free) tensor name -> torch shape, in the model's order:
        embedders, pad tokens, noise refiner, context refiner, layers, final layer (a block
        model: its blocks only). Pad tokens are listed as ``[1, D]`` (files may also store
        ``[D]``); ``norm_final.weight [D]`` is included only when asked (optional, unused)."""
        D = self.dim
        out: dict[str, tuple[int, ...]] = {}
        if self.whole:
            out.update({
                "x_embedder.weight": (D, self.patch_dim), "x_embedder.bias": (D,),
                "t_embedder.mlp.0.weight": (self.t_mid_dim, self.t_freq_dim),
                "t_embedder.mlp.0.bias": (self.t_mid_dim,),
                "t_embedder.mlp.2.weight": (self.adaln_in, self.t_mid_dim),
                "t_embedder.mlp.2.bias": (self.adaln_in,),
                "cap_embedder.0.weight": (self.cap_dim,),
                "cap_embedder.1.weight": (D, self.cap_dim), "cap_embedder.1.bias": (D,),
                "x_pad_token": (1, D), "cap_pad_token": (1, D)})
        for stack, n in self.stacks.items():
            shapes = self.block_shapes(BLOCK_STACKS[stack])
            for i in range(n):
                names = tensor_names(stack, i, self.variant)
                for k in _FILE_ORDER:
                    if k in names:
                        out[names[k]] = shapes[k]
        if self.whole:
            P = self.patch_dim
            out.update({"final_layer.adaLN_modulation.1.weight": (D, self.adaln_in),
                        "final_layer.adaLN_modulation.1.bias": (D,),
                        "final_layer.linear.weight": (P, D), "final_layer.linear.bias": (P,)})
            if norm_final:
                out["norm_final.weight"] = (D,)
        return out

    def n_params(self) -> int:
        """Parameters of the model (without the optional ``norm_final.weight``)."""
        return sum(math.prod(s) for s in self.tensor_shapes().values())

    # -- bridges
    @classmethod
    def zimage(cls, n_layers: int = 30, **overrides) -> DenoiserConfig:
        """The real Z-Image-Turbo dimensions (``n_layers`` configurable for benchmarks)."""
        kw = dict(dim=3840, n_heads=30, n_kv_heads=30, head_dim=128, ffn_dim=10240,
                  n_layers=n_layers, n_noise_refiner=2, n_context_refiner=2, in_channels=16,
                  patch=2, cap_dim=2560)
        kw.update(overrides)
        return cls(**kw)

    def diffusers_kwargs(self) -> dict:
        """Constructor kwargs of diffusers' ``ZImageTransformer2DModel`` for this config.
        ValueError for what diffusers cannot express (a block model, Lumina-2, GQA, unequal
        refiner counts, FFN other than int(D/3*8), t-embedder widths other than
        256 -> 1024 -> min(D, 256), final eps other than 1e-6)."""
        why = []
        if not self.whole or self.variant != "zimage":
            why.append("not a whole Z-Image denoiser")
        if self.n_kv_heads != self.n_heads:
            why.append("GQA (diffusers' Z-Image attention is MHA)")
        if self.n_noise_refiner != self.n_context_refiner:
            why.append("unequal refiner counts")
        if self.ffn_dim != int(self.dim / 3 * 8):
            why.append(f"ffn_dim {self.ffn_dim} != int(D/3*8) = {int(self.dim / 3 * 8)}")
        if (self.t_freq_dim, self.t_mid_dim, self.adaln_in) != (256, 1024, min(self.dim, 256)):
            why.append(f"t-embedder widths {self.t_freq_dim}->{self.t_mid_dim}->"
                       f"{self.adaln_in}")
        if self.final_eps != 1e-6 or self.seq_multiple != 32 or self.max_period != 10000.0:
            why.append("final_eps / seq_multiple / max_period fixed in diffusers")
        if why:
            raise ValueError("diffusers' ZImageTransformer2DModel cannot express: "
                             + "; ".join(why))
        return dict(all_patch_size=(self.patch,), all_f_patch_size=(1,),
                    in_channels=self.in_channels, dim=self.dim, n_layers=self.n_layers,
                    n_refiner_layers=self.n_noise_refiner, n_heads=self.n_heads,
                    n_kv_heads=self.n_kv_heads, norm_eps=self.norm_eps, qk_norm=True,
                    cap_feat_dim=self.cap_dim, rope_theta=self.rope_theta,
                    t_scale=self.t_scale, axes_dims=list(self.axes_dims),
                    axes_lens=[1536, 512, 512])

    def summary(self) -> str:
        """One line (a block model: its block's :meth:`BlockConfig.summary`)."""
        if not self.whole:
            return self.as_block_config(validate=False).summary()
        return (f"zimage denoiser: D={self.dim}, {self.n_heads} heads x {self.head_dim}"
                f"{'' if self.n_kv_heads == self.n_heads else f' ({self.n_kv_heads} kv)'}, "
                f"FFN {self.ffn_dim}, {self.n_layers} layers + {self.n_noise_refiner} noise / "
                f"{self.n_context_refiner} context refiners, C={self.in_channels}, "
                f"patch {self.patch}, cap_dim {self.cap_dim}, t {self.t_freq_dim}->"
                f"{self.t_mid_dim}->{self.adaln_in}, axes {list(self.axes_dims)}")


def block_view(cfg: BlockConfig | DenoiserConfig) -> BlockConfig:
    """The :class:`BlockConfig` of ``cfg`` (itself, or a model config's block view), checked
    against the block's runnable rules (ValueError): what the block-level entry points
    (``BlockPlan``, ``BlockRunner``, ``Block``, ``run_layers``) take."""
    if isinstance(cfg, DenoiserConfig):
        return cfg.block
    if not isinstance(cfg, BlockConfig):
        raise TypeError(f"expected a BlockConfig or DenoiserConfig, got {type(cfg).__name__}")
    return cfg.validate()


# ----------------------------------------------------------------------------- inference

def strip_prefix(name: str) -> str:
    """``model.diffusion_model.X`` -> ``X``; other names unchanged."""
    return name.removeprefix(PREFIX)


_BLOCK_RE = re.compile(rf"^(layers|noise_refiner|context_refiner)\.{BLOCK_INDEX}\.(.+)$")


def _fmt(shape: Iterable[int]) -> str:
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"


def _canonical_table(tensors: Mapping[str, Any], where: str
                     ) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{canonical name: (shape, TYPE NAME)}``; every malformed entry a ModelFileError."""
    t: dict[str, tuple[tuple[int, ...], str]] = {}
    for raw, val in tensors.items():
        name = strip_prefix(str(raw))
        try:
            shape, tname = val
            shape = tuple(int(d) for d in shape)
        except (TypeError, ValueError):
            raise ModelFileError(f"{where}: tensor {raw!r}: expected (shape, type name), got "
                                 f"{val!r}", raw) from None
        if not shape or any(d < 1 for d in shape):
            raise ModelFileError(f"{where}: tensor {raw!r} has shape {list(shape)}", raw)
        tname = str(tname).upper()
        if tname not in GGMLQuantizationType.__members__:
            raise ModelFileError(f"{where}: tensor {raw!r} has unknown GGML type {tname!r}", raw)
        bs = GGML_QUANT_SIZES[GGMLQuantizationType[tname]][0]
        if bs > 1 and shape[-1] % bs:
            raise ModelFileError(f"{where}: tensor {raw!r} is {tname} but its rows have "
                                 f"{shape[-1]} values, not a multiple of {bs}", raw)
        if name in t:
            raise ModelFileError(f"{where}: tensor {name!r} appears twice (with and without "
                                 f"the {PREFIX!r} prefix)", name)
        t[name] = (shape, tname)
    return t


def _stack_counts(t: Mapping[str, Any], where: str) -> dict[str, int]:
    """Blocks per stack from the indices present; a gap is a MissingTensorError."""
    idx: dict[str, set[int]] = {s: set() for s in STACKS}
    for name in t:
        m = _BLOCK_RE.match(name)
        if m:
            idx[m.group(1)].add(int(m.group(2)))
    counts: dict[str, int] = {}
    for s, ids in idx.items():
        n = max(ids) + 1 if ids else 0
        if len(ids) != n:     # the first gap from the indices present (a name's index may be
            #                   huge: `range(n)` would be a gigabyte-sized set)
            shown = sorted(ids)
            gap = next(i for i, k in enumerate(shown) if i != k)
            miss = f"{s}.{gap}.{_SUFFIX['qkv']}"
            listed = (str(shown) if len(shown) <= 12
                      else f"[{', '.join(map(str, shown[:6]))}, ..., {shown[-1]}]")
            raise MissingTensorError(f"{where}: tensor {miss!r} missing: block {s}.{gap} "
                                     f"absent while {s}.{max(ids)} is present (indices "
                                     f"{listed})", miss)
        counts[s] = n
    return counts


def file_norm_eps(metadata: Mapping[str, Any], where: str) -> float | None:
    """A GGUF's ``nxhpc.norm_eps`` (nxhpc's own synthetic and tapped files record their
    RMSNorm eps; published files do not: None), checked at load as the kernels will take it: a
    float that float32 holds as a positive normal number. A string, an int or an eps out of
    that range is a :class:`ModelFileError` (exit 4), never a fallback to the default or a
    failure at the first call."""
    from nxhpc.nn.checks import check_eps
    v = metadata.get("nxhpc.norm_eps")
    if v is None:
        return None
    if not isinstance(v, float):    # a string or an int is not the file's eps
        raise ModelFileError(f"{where}: metadata 'nxhpc.norm_eps' is {type(v).__name__} "
                             f"{str(v)[:40]!r}, expected a float")
    try:
        return check_eps(v)
    except ValueError as e:
        raise ModelFileError(f"{where}: metadata 'nxhpc.norm_eps': {e}") from None


def infer_config(tensors: Mapping[str, tuple[tuple[int, ...], str]], where: str = "tensors",
                 norm_eps: float | None = None, *, patch: int = 2, whole: bool | None = None,
                 n_layers: int | None = None, n_refiner: int | None = None,
                 allow_extra: bool | None = None) -> tuple[DenoiserConfig, dict[str, str]]:
    """The one config inference: ``{name: (torch shape, GGML type name)}`` -> the model's
    :class:`DenoiserConfig` and a report ``{field: how it was inferred}``.

    Names may carry :data:`PREFIX` (stripped here). The blocks' dims come from ``layers.0``
    (``docs/denoiser.md``, "Config inference"); every block of every stack is then checked for
    presence, shape and a runnable type. ``whole`` (None: whether any embedder tensor is
    present) asks for a whole denoiser: embedders, pad tokens and final layer inferred and
    checked too, the refiner counts equal and >= 1. ``patch`` resolves the ``p*p*C`` ambiguity
    of ``x_embedder``; ``norm_eps`` is not recorded in files (None: the default).
    ``n_layers`` / ``n_refiner``, when given (e.g. from metadata), must agree with the tensors.
    Unknown tensors are an error in a whole model unless ``allow_extra``. Every problem raises
    :class:`MissingTensorError` or :class:`ModelFileError` whose message starts with ``where``
    and names the tensor (also its ``tensor`` attribute).
    """
    t = _canonical_table(tensors, where)
    if whole is None:
        whole = any(n in t for n in DENOISER_TENSORS)
    if allow_extra is None:
        allow_extra = not whole

    def need(name: str) -> tuple[int, ...]:
        if name not in t:
            raise MissingTensorError(f"{where}: required tensor {name!r} is missing", name)
        return t[name][0]

    def ndim(name: str, n: int) -> tuple[int, ...]:
        s = need(name)
        if len(s) != n:
            raise ModelFileError(f"{where}: tensor {name!r} has shape {_fmt(s)}, expected "
                                 f"{n}-D", name)
        return s

    counts = _stack_counts(t, where)
    qkv0 = f"layers.0.{_SUFFIX['qkv']}"
    if counts["layers"] == 0:
        raise MissingTensorError(f"{where}: no main-layer tensors: required tensor {qkv0!r} "
                                 f"is missing (optional prefix {PREFIX!r}; {len(t)} tensors "
                                 f"given)", qkv0)
    if n_layers is not None and n_layers != counts["layers"]:
        bad = f"layers.{min(n_layers, counts['layers'])}.{_SUFFIX['qkv']}"
        raise ModelFileError(f"{where}: {n_layers} main layers declared but the tensors hold "
                             f"{counts['layers']} (tensor {bad!r} "
                             f"{'missing' if n_layers > counts['layers'] else 'present'})", bad)

    # the variant: where the blocks' adaLN Linear sits
    report: dict[str, str] = {}
    ada0, ada1 = (f"layers.0.adaLN_modulation.{k}.weight" for k in (0, 1))
    if (ada0 in t) == (ada1 in t):
        raise (ModelFileError if ada0 in t else MissingTensorError)(
            f"{where}: need exactly one of {ada0!r} (Z-Image) and {ada1!r} (Lumina-2, SiLU "
            f"first); found {'both' if ada0 in t else 'neither'}", ada0)
    variant = "lumina2" if ada1 in t else "zimage"
    if whole and variant == "lumina2":
        raise ModelFileError(f"{where}: tensor {ada1!r} is Lumina-2 naming (adaLN behind a "
                             f"SiLU); nxhpc runs Lumina-2 blocks, not a whole Lumina-2 model",
                             ada1)
    report["variant"] = (f"{variant}: adaLN stored as adaLN_modulation.{1 if ada1 in t else 0}"
                         f".* ({'SiLU before the Linear' if ada1 in t else 'no SiLU'})")

    # the blocks' dims, from layers.0
    names0 = tensor_names("layers", 0, variant)
    for k, name in names0.items():
        ndim(name, 2 if _ROLE[k] == "matrix" else 1)
    sh = {k: t[v][0] for k, v in names0.items()}
    dim = sh["attention_norm1"][0]
    report["dim"] = f"{dim} from len(attention_norm1.weight)"
    head_dim = sh["q_norm"][0]
    report["head_dim"] = f"{head_dim} from len(attention.q_norm.weight)"
    if head_dim < 6 or head_dim % 2:
        raise ModelFileError(f"{where}: tensor {names0['q_norm']!r} has length {head_dim}; "
                             f"head_dim must be even and >= 6", names0["q_norm"])
    out_in = sh["out"][1]
    if out_in % head_dim:
        raise ModelFileError(f"{where}: tensor {names0['out']!r} has {out_in} inputs, not a "
                             f"multiple of head_dim {head_dim}", names0["out"])
    n_heads = out_in // head_dim
    report["n_heads"] = f"{n_heads} = attention.out.weight inputs {out_in} / head_dim"
    qkv_rows = sh["qkv"][0]
    rest = qkv_rows - n_heads * head_dim
    if qkv_rows % head_dim or rest <= 0 or rest % (2 * head_dim) or \
            n_heads % (rest // (2 * head_dim)):
        raise ModelFileError(f"{where}: tensor {names0['qkv']!r} has {qkv_rows} rows, not "
                             f"(n_heads + 2*n_kv_heads)*head_dim with n_heads={n_heads}, "
                             f"head_dim={head_dim}", names0["qkv"])
    n_kv = rest // (2 * head_dim)
    report["n_kv_heads"] = (f"{n_kv} = (qkv rows {qkv_rows} / head_dim - n_heads) / 2"
                            f"{' (GQA)' if n_kv != n_heads else ''}")
    ffn = sh["w1"][0]
    report["ffn_dim"] = f"{ffn} from feed_forward.w1.weight rows"
    adaln_in = sh["adaln_w"][1]
    report["adaln_in"] = f"{adaln_in} from adaLN weight columns"
    report["n_layers"] = f"{counts['layers']} (layers.0..{counts['layers'] - 1})"
    if norm_eps is None:
        norm_eps = DEFAULT_NORM_EPS
        report["norm_eps"] = f"{norm_eps:g} (default; not recorded in the file)"
    else:
        report["norm_eps"] = f"{norm_eps:g} (from metadata)"

    kw: dict[str, Any] = dict(dim=dim, n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim,
                              ffn_dim=ffn, n_layers=counts["layers"], adaln_in=adaln_in,
                              norm_eps=float(norm_eps), variant=variant,
                              n_noise_refiner=counts["noise_refiner"],
                              n_context_refiner=counts["context_refiner"])
    if whole:
        nr, cr = counts["noise_refiner"], counts["context_refiner"]
        if nr == cr == 0 and n_refiner is None:     # the main layers alone: a block model
            bad = f"noise_refiner.0.{_SUFFIX['qkv']}"
            raise ModelFileError(
                f"{where}: not a whole denoiser: it has {counts['layers']} main layers and no "
                f"refiner blocks (Z-Image has >= 1 noise and context refiner; a file of main "
                f"layers alone is a block model: python -m nxhpc.blockrun); tensor {bad!r} "
                f"missing", bad)
        want_r = n_refiner if n_refiner is not None else max(nr, cr)
        for s, n in (("noise_refiner", nr), ("context_refiner", cr)):
            if n != want_r or n == 0:
                bad = f"{s}.{min(n, want_r) if n else 0}.{_SUFFIX['qkv']}"
                state = "present" if n > want_r else "missing"
                raise ModelFileError(
                    f"{where}: refiner counts disagree: noise_refiner has {nr} blocks, "
                    f"context_refiner {cr}" + (f", {n_refiner} declared" if n_refiner is not None
                                               else "") +
                    f" (Z-Image has one refiner count, >= 1): tensor {bad!r} {state}", bad)
        t_mid, t_freq = ndim("t_embedder.mlp.0.weight", 2)
        xin = ndim("x_embedder.weight", 2)[1]
        if xin % (patch * patch):
            raise ModelFileError(f"{where}: tensor 'x_embedder.weight' has {xin} columns, not "
                                 f"patch*patch*C for patch {patch}", "x_embedder.weight")
        kw.update(in_channels=xin // (patch * patch), patch=patch,
                  cap_dim=ndim("cap_embedder.1.weight", 2)[1], t_freq_dim=t_freq,
                  t_mid_dim=t_mid)
        report["embedders"] = (f"C={kw['in_channels']} (x_embedder columns / patch^2, patch "
                               f"{patch}), cap_dim {kw['cap_dim']}, t {t_freq}->{t_mid}->"
                               f"{adaln_in}")
    report["stacks"] = ", ".join(f"{s} {n}" for s, n in counts.items())
    try:
        cfg = DenoiserConfig(**kw)
        cfg.as_block_config()
    except ValueError as e:
        raise ModelFileError(f"{where}: inferred config is not runnable: {e}") from None

    # every block: present, shaped, typed (a block model's refiners, if any, are checked when
    # they are bound: see nxhpc.models.Model.layer_weights)
    for s, n in cfg.stacks.items():
        if whole or s == "layers":
            check_stack(t, cfg.block, s, n, where)
    if whole:
        expected = cfg.tensor_shapes(norm_final="norm_final.weight" in t)
        D = cfg.dim
        for name, shape in expected.items():
            got = need(name)
            if got != shape and not (name.endswith("pad_token") and got == (D,)):
                alt = f" or {_fmt((D,))}" if name.endswith("pad_token") else ""
                raise ModelFileError(f"{where}: tensor {name!r} has shape {_fmt(got)}, "
                                     f"expected {_fmt(shape)}{alt} for {cfg.summary()}", name)
        extra = [n for n in t if n not in expected]
        for name in extra:
            m = _BLOCK_RE.match(name)
            if m and m.group(1) == "context_refiner" and m.group(3).startswith("adaLN_"):
                raise ModelFileError(f"{where}: tensor {name!r}: the context refiner is "
                                     f"unmodulated and carries no adaLN tensors", name)
        if extra and not allow_extra:
            more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
            raise ModelFileError(f"{where}: unexpected tensor {extra[0]!r}{more} for "
                                 f"{cfg.summary()}", extra[0])
    return cfg, report
