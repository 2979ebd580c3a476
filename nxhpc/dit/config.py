"""The one authority for a DiT block's config: dims, divisibility rules, tensor names, shapes.

Owns :class:`BlockConfig` (dim, heads, kv heads, head_dim, FFN, adaLN width, eps, variant) and
everything derived from it: ``qkv_width``, the structural rules (:meth:`BlockConfig.validate`),
the tensor table of a block (:data:`BLOCK_TENSORS`: short name, name inside the block, role,
whether only modulated blocks have it), tensor names per stack prefix (``layers.N``,
``noise_refiner.N`` -- modulated; ``context_refiner.N`` -- no adaLN tensors), with or without
the ``model.diffusion_model.`` prefix, expected shapes, the check of one layer's bound weights
(:meth:`BlockConfig.check_layer`), and inferring the config from a file's tensor shapes
(:func:`infer_config`, :func:`check_stack`).
Also owns the whole denoiser's config (``DENOISER.md``): :class:`DenoiserConfig` (every
dimension of the model: the shared :class:`BlockConfig` via :meth:`DenoiserConfig.as_block_config`,
refiner counts, ``in_channels``, ``patch``, ``cap_dim``, t-embedder widths, RoPE, eps), the
tensor names and torch shapes it implies (:meth:`DenoiserConfig.tensor_shapes`, block tensors
named by :data:`BLOCK_TENSORS` through :func:`block_tensor_names`), and
:func:`infer_denoiser_config` (a tensor table -> the config, or :class:`DenoiserConfigError`
naming the tensor).
Must not: read files (it takes ``{name: (shape, type name)}``), import the compiled kernels, or
decode weights.

Denoiser config inference (``DENOISER.md`` "Tensor names"):

- dim D = len(``layers.0.attention_norm1.weight``); head_dim = len(``layers.0.attention.q_norm
  .weight``); n_heads = D / head_dim; n_kv_heads from the fused qkv rows
  ``(n_heads + 2 n_kv_heads) head_dim``; ffn_dim = rows of ``layers.0.feed_forward.w1.weight``;
- layer and refiner counts from the block indices present (0..n-1, no gaps);
- in_channels C and patch p from ``x_embedder.weight [D, p*p*C]``: the product is ambiguous, so
  ``patch`` is given (Z-Image: 2) and C = columns / p^2;
- cap_dim = columns of ``cap_embedder.1.weight``; t-embedder widths from ``t_embedder.mlp.0``
  ``[mid, freq]`` and ``t_embedder.mlp.2 [adaln_in, mid]`` (Z-Image: 256 -> 1024 -> 256);
- everything else (final layer ``[p*p*C, D]``, adaLN ``[4D, adaln_in]``, pad tokens ``[1, D]``
  or ``[D]``) is then checked against the shapes the config implies.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from nxhpc.formats.gguf_io import PREFIX, MissingTensorError, ModelFileError
from nxhpc.formats.weights import RUNNABLE_TYPES, WeightTensor, as_weight_tensor, row_bytes

__all__ = ["BlockConfig", "TensorSpec", "BLOCK_TENSORS", "BLOCK_STACKS", "PROJECTIONS", "NORMS",
           "MODULATION", "DEFAULT_NORM_EPS", "MATMUL_BLOCK", "VARIANTS", "layer_tensor_names",
           "block_label", "stack_indices", "check_stack", "infer_config", "VECTOR_TYPES",
           # the whole denoiser
           "DenoiserConfig", "DenoiserConfigError", "infer_denoiser_config", "block_tensor_names",
           "strip_prefix", "PREFIX", "BLOCK_SUFFIXES", "ADALN_SUFFIXES", "GROUPS",
           "OPTIONAL_TENSORS", "GGML_TYPE_NAMES", "DENOISER_TENSORS"]

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
#: Stack prefix -> whether its blocks are modulated (DENOISER.md: the context refiner is not).
BLOCK_STACKS: dict[str, bool] = {"layers": True, "noise_refiner": True, "context_refiner": False}
_ROLE = {t.key: t.role for t in BLOCK_TENSORS}


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

    @property
    def adaln_index(self) -> int:
        """Index of the adaLN Linear in ``adaLN_modulation.{i}``: 1 after Lumina-2's SiLU."""
        return 1 if self.variant == "lumina2" else 0

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
        return layer_tensor_names(index, self.variant, prefix, modulated=modulated,
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


def layer_tensor_names(i: int, variant: str, prefix: str = "layers", *,
                       modulated: bool | None = None,
                       model_prefix: bool = False) -> dict[str, str]:
    """Short name -> tensor name for block ``prefix.i`` (canonical, prefix-free by default).

    ``modulated`` defaults to the stack's kind (:data:`BLOCK_STACKS`): ``context_refiner``
    blocks have no ``adaLN_modulation`` tensors.
    """
    mod = _modulated(prefix, modulated)
    ada = 1 if variant == "lumina2" else 0
    head = (PREFIX if model_prefix else "") + f"{prefix}.{int(i)}."
    return {t.key: head + t.suffix.format(ada=ada) for t in BLOCK_TENSORS
            if mod or not t.modulation}


def stack_indices(names: Iterable[str], prefix: str) -> list[int]:
    """Block indices ``i`` with a ``{prefix}.{i}.attention.qkv.weight`` among ``names``."""
    out = set()
    for n in names:
        n = n[len(PREFIX):] if n.startswith(PREFIX) else n
        parts = n.split(".")
        if len(parts) > 2 and parts[0] == prefix and parts[1].isdigit() \
                and n.endswith(".attention.qkv.weight"):
            out.add(int(parts[1]))
    return sorted(out)


def check_stack(tensors: Mapping[str, tuple[tuple[int, ...], str]], cfg: BlockConfig,
                prefix: str, count: int, where: str, *, modulated: bool | None = None) -> None:
    """Every tensor of blocks ``prefix.0 .. prefix.count-1`` is present, shaped and typed as
    ``cfg`` says; :class:`MissingTensorError` / :class:`ModelFileError` naming ``where`` and
    the tensor."""
    mod = _modulated(prefix, modulated)
    exp = cfg.shapes(mod)
    for i in range(count):
        for key, name in layer_tensor_names(i, cfg.variant, prefix, modulated=mod).items():
            if name not in tensors:
                raise MissingTensorError(f"{where}: required tensor {name!r} is missing")
            shape, tname = tensors[name]
            if tuple(shape) != exp[key]:
                raise ModelFileError(f"{where}: tensor {name!r} has shape {list(shape)}, "
                                     f"expected {list(exp[key])} for {cfg.summary()}")
            allowed = RUNNABLE_TYPES if _ROLE[key] == "matrix" else VECTOR_TYPES
            if tname not in allowed:
                raise ModelFileError(f"{where}: tensor {name!r} has type {tname}; nxhpc runs "
                                     f"{', '.join(allowed)} for this tensor")
            if _ROLE[key] == "matrix":
                try:
                    row_bytes(tname, exp[key][1])
                except ValueError as e:
                    raise ModelFileError(f"{where}: tensor {name!r}: {e}") from None


def infer_config(tensors: Mapping[str, tuple[tuple[int, ...], str]], where: str,
                 norm_eps: float | None = None) -> tuple[BlockConfig, dict[str, str]]:
    """Infer the block config from ``{canonical name: (shape, type name)}``.

    Returns the config and a report ``{field: how it was inferred}``. Checks every main
    layer's tensors for presence, shape and type; raises :class:`MissingTensorError` /
    :class:`ModelFileError` naming ``where`` and the tensor.
    """
    layer_ids = set(stack_indices(tensors, "layers"))
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
    for k, name in names0.items():
        ndim = 2 if _ROLE[k] == "matrix" else 1
        if len(sh[k]) != ndim:
            raise ModelFileError(f"{where}: tensor {name!r} has shape {list(sh[k])}, "
                                 f"expected {ndim}-D")
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
    check_stack(tensors, cfg, "layers", n_layers, where)
    return cfg, report


# ============================================================================== the denoiser
# The whole Z-Image denoiser (DENOISER.md): the blocks above plus embedders, pad tokens and the
# final layer. Block tensors are named by BLOCK_TENSORS (one table); the order below is the one
# files and tensor tables list them in.

_DENOISER_BLOCK_ORDER = ("qkv", "out", "q_norm", "k_norm", "attention_norm1", "attention_norm2",
                         "ffn_norm1", "ffn_norm2", "w1", "w2", "w3")
_SUFFIX = {t.key: t.suffix for t in BLOCK_TENSORS}

BLOCK_SUFFIXES: dict[str, str] = {k: _SUFFIX[k] for k in _DENOISER_BLOCK_ORDER}
"""The 11 tensors every block has (the context refiner has only these), from :data:`BLOCK_TENSORS`."""

ADALN_SUFFIXES: dict[str, str] = {k: _SUFFIX[k].format(ada=0) for k in MODULATION}
"""The 2 adaLN tensors of a modulated Z-Image block (main layers, noise refiner)."""

GROUPS: dict[str, bool] = BLOCK_STACKS
"""Block groups and whether their blocks are modulated (the same table as :data:`BLOCK_STACKS`)."""

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
"""The non-block tensors of the denoiser and their role: a "matrix" is run as stored (a typed
weight), a "vector" is decoded to float32 (pad tokens ``[1, D]`` or ``[D]`` are vectors)."""

OPTIONAL_TENSORS = ("norm_final.weight",)
"""Present in some files, unused by the model (diffusers drops it too)."""

GGML_TYPE_NAMES = ("F32", "F16", "BF16", "F64", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q8_1",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K", "IQ2_XXS", "IQ2_XS",
                   "IQ3_XXS", "IQ1_S", "IQ4_NL", "IQ3_S", "IQ2_S", "IQ4_XS", "IQ1_M", "TQ1_0",
                   "TQ2_0", "MXFP4")
"""GGML type names a tensor table may carry (the loader decides which it can decode)."""

# values per block for the block-quantized types (row length must be a multiple)
_BLOCK_SIZE = {"Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32, "Q8_0": 32, "Q8_1": 32,
               "Q2_K": 256, "Q3_K": 256, "Q4_K": 256, "Q5_K": 256, "Q6_K": 256, "Q8_K": 256,
               "IQ2_XXS": 256, "IQ2_XS": 256, "IQ3_XXS": 256, "IQ1_S": 256, "IQ4_NL": 32,
               "IQ3_S": 256, "IQ2_S": 256, "IQ4_XS": 256, "IQ1_M": 256, "TQ1_0": 256,
               "TQ2_0": 256, "MXFP4": 32}


class DenoiserConfigError(ValueError):
    """A tensor table does not describe a Z-Image denoiser. ``tensor`` names the tensor the
    problem was found at (``None`` when none applies); the message always names it.
    ``missing``: the problem is an absent tensor (a loader reports it as
    :class:`~nxhpc.formats.gguf_io.MissingTensorError`), not a malformed one."""

    def __init__(self, message: str, tensor: str | None = None, *, missing: bool = False
                 ) -> None:
        super().__init__(message)
        self.tensor = tensor
        self.missing = bool(missing)


def block_tensor_names(group: str, i: int, modulated: bool | None = None) -> dict[str, str]:
    """Short name -> canonical tensor name for block ``i`` of ``group`` (``layers``,
    ``noise_refiner``, ``context_refiner``); adaLN included when the group is modulated."""
    if group not in GROUPS:
        raise ValueError(f"block_tensor_names: unknown group {group!r} (one of {list(GROUPS)})")
    mod = GROUPS[group] if modulated is None else modulated
    sfx = dict(BLOCK_SUFFIXES, **ADALN_SUFFIXES) if mod else BLOCK_SUFFIXES
    return {k: f"{group}.{i}.{s}" for k, s in sfx.items()}


def _default_axes(head_dim: int) -> tuple[int, int, int]:
    from nxhpc.dit.rope import default_axes_dims
    return default_axes_dims(head_dim, "zimage")


@dataclass(frozen=True)
class DenoiserConfig:
    """Every dimension of a Z-Image denoiser (``DENOISER.md``). Shape comments are torch
    order (``[out, in]`` for a Linear weight)."""
    dim: int                 # D
    n_heads: int             # H
    n_kv_heads: int          # KVH (Z-Image: = H)
    head_dim: int            # hd = D / H
    ffn_dim: int             # feed_forward.w1 rows (Z-Image: int(D/3*8))
    n_layers: int            # main layers (Z-Image: 30)
    n_noise_refiner: int     # modulated refiner blocks on image rows (2)
    n_context_refiner: int   # unmodulated refiner blocks on caption rows (2)
    in_channels: int         # C latent channels (16); out channels are the same
    patch: int               # p (2)
    cap_dim: int             # caption feature width (2560: Qwen3-4B)
    t_freq_dim: int = 256    # sinusoid width fed to t_embedder.mlp.0
    t_mid_dim: int = 1024    # t_embedder.mlp.0 rows
    adaln_in: int = 256      # t_emb width = t_embedder.mlp.2 rows = adaLN input
    norm_eps: float = 1e-5   # every RMSNorm (blocks, q/k norms, cap_embedder.0)
    final_eps: float = 1e-6  # final LayerNorm (no affine)
    rope_theta: float = 256.0
    axes_dims: tuple[int, ...] | None = None   # None -> [hd/4, 3hd/8, rest] ([32,48,48])
    t_scale: float = 1000.0
    seq_multiple: int = 32   # image and caption rows are padded to a multiple of this
    max_period: float = 10000.0
    # duck-typed BlockConfig fields used by nxhpc.dit.reference / nxhpc.dit.oracle
    variant: str = field(default="zimage", init=False)
    adaln_silu: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        if self.axes_dims is None and isinstance(self.head_dim, int) and self.head_dim >= 6 \
                and self.head_dim % 2 == 0:
            object.__setattr__(self, "axes_dims", _default_axes(self.head_dim))
        elif self.axes_dims is not None:
            object.__setattr__(self, "axes_dims", tuple(int(a) for a in self.axes_dims))
        self.validate()

    # -- derived sizes
    @property
    def qkv_width(self) -> int:
        """Rows of the fused qkv weight: ``(H + 2 KVH) hd``."""
        return (self.n_heads + 2 * self.n_kv_heads) * self.head_dim

    @property
    def out_channels(self) -> int:
        return self.in_channels

    @property
    def patch_dim(self) -> int:
        """Values per patch token: ``p*p*C`` (x_embedder columns, final_layer rows)."""
        return self.patch * self.patch * self.in_channels

    def validate(self) -> DenoiserConfig:
        """Raise :class:`DenoiserConfigError` unless the dimensions are consistent."""
        errs = []
        ints = ("dim", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "n_layers",
                "n_noise_refiner", "n_context_refiner", "in_channels", "patch", "cap_dim",
                "t_freq_dim", "t_mid_dim", "adaln_in", "seq_multiple")
        bad = [n for n in ints if not isinstance(getattr(self, n), int)
               or isinstance(getattr(self, n), bool)]
        if bad:
            raise DenoiserConfigError(f"DenoiserConfig: fields {bad} must be int")
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
            if not getattr(self, n) > 0:
                errs.append(f"{n} {getattr(self, n)} must be positive")
        if errs:
            raise DenoiserConfigError("DenoiserConfig: " + "; ".join(errs))
        return self

    # -- the tensors the config implies
    def block_shapes(self, modulated: bool) -> dict[str, tuple[int, ...]]:
        """Short name -> torch shape of one block's tensors (:meth:`BlockConfig.shapes`)."""
        return self.as_block_config(validate=False).shapes(modulated)

    def tensor_shapes(self, *, norm_final: bool = False) -> dict[str, tuple[int, ...]]:
        """Every canonical (prefix-free) tensor name -> torch shape, in the model's order:
        embedders, pad tokens, noise refiner, context refiner, layers, final layer.
        Pad tokens are listed as ``[1, D]`` (files may also store ``[D]``);
        ``norm_final.weight [D]`` is included only when asked (it is optional and unused)."""
        D, P = self.dim, self.patch_dim
        out: dict[str, tuple[int, ...]] = {
            "x_embedder.weight": (D, P), "x_embedder.bias": (D,),
            "t_embedder.mlp.0.weight": (self.t_mid_dim, self.t_freq_dim),
            "t_embedder.mlp.0.bias": (self.t_mid_dim,),
            "t_embedder.mlp.2.weight": (self.adaln_in, self.t_mid_dim),
            "t_embedder.mlp.2.bias": (self.adaln_in,),
            "cap_embedder.0.weight": (self.cap_dim,),
            "cap_embedder.1.weight": (D, self.cap_dim), "cap_embedder.1.bias": (D,),
            "x_pad_token": (1, D), "cap_pad_token": (1, D),
        }
        for group, n in (("noise_refiner", self.n_noise_refiner),
                         ("context_refiner", self.n_context_refiner),
                         ("layers", self.n_layers)):
            shapes = self.block_shapes(GROUPS[group])
            for i in range(n):
                for k, name in block_tensor_names(group, i).items():
                    out[name] = shapes[k]
        out.update({"final_layer.adaLN_modulation.1.weight": (D, self.adaln_in),
                    "final_layer.adaLN_modulation.1.bias": (D,),
                    "final_layer.linear.weight": (P, D), "final_layer.linear.bias": (P,)})
        if norm_final:
            out["norm_final.weight"] = (D,)
        return out

    def n_params(self) -> int:
        """Parameters of the model (without the optional ``norm_final.weight``)."""
        total = 0
        for s in self.tensor_shapes().values():
            n = 1
            for d in s:
                n *= d
            total += n
        return total

    # -- bridges
    @classmethod
    def zimage(cls, n_layers: int = 30, **overrides) -> DenoiserConfig:
        """The real Z-Image-Turbo dimensions (``n_layers`` configurable for benchmarks)."""
        kw = dict(dim=3840, n_heads=30, n_kv_heads=30, head_dim=128, ffn_dim=10240,
                  n_layers=n_layers, n_noise_refiner=2, n_context_refiner=2, in_channels=16,
                  patch=2, cap_dim=2560)
        kw.update(overrides)
        return cls(**kw)

    def as_block_config(self, validate: bool = True) -> BlockConfig:
        """The :class:`BlockConfig` every block of this model shares (refiners included; its
        ``n_layers`` is the main stack's depth). ``validate``: also apply the block's runnable
        rules (:meth:`BlockConfig.validate`: dims multiples of the matmul block, ...)."""
        c = BlockConfig(dim=self.dim, n_heads=self.n_heads, n_kv_heads=self.n_kv_heads,
                        head_dim=self.head_dim, ffn_dim=self.ffn_dim, n_layers=self.n_layers,
                        adaln_in=self.adaln_in, variant="zimage", adaln_silu=False,
                        norm_eps=self.norm_eps)
        return c.validate() if validate else c

    def diffusers_kwargs(self) -> dict:
        """Constructor kwargs of diffusers' ``ZImageTransformer2DModel`` for this config.
        Raises :class:`DenoiserConfigError` for what diffusers cannot express (GQA, unequal
        refiner counts, FFN other than int(D/3*8), t-embedder widths other than
        256 -> 1024 -> min(D, 256), final eps other than 1e-6)."""
        why = []
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
            raise DenoiserConfigError("diffusers' ZImageTransformer2DModel cannot express: "
                                      + "; ".join(why))
        return dict(all_patch_size=(self.patch,), all_f_patch_size=(1,),
                    in_channels=self.in_channels, dim=self.dim, n_layers=self.n_layers,
                    n_refiner_layers=self.n_noise_refiner, n_heads=self.n_heads,
                    n_kv_heads=self.n_kv_heads, norm_eps=self.norm_eps, qk_norm=True,
                    cap_feat_dim=self.cap_dim, rope_theta=self.rope_theta,
                    t_scale=self.t_scale, axes_dims=list(self.axes_dims),
                    axes_lens=[1536, 512, 512])

    def summary(self) -> str:
        return (f"zimage denoiser: D={self.dim}, {self.n_heads} heads x {self.head_dim}"
                f"{'' if self.n_kv_heads == self.n_heads else f' ({self.n_kv_heads} kv)'}, "
                f"FFN {self.ffn_dim}, {self.n_layers} layers + {self.n_noise_refiner} noise / "
                f"{self.n_context_refiner} context refiners, C={self.in_channels}, "
                f"patch {self.patch}, cap_dim {self.cap_dim}, t {self.t_freq_dim}->"
                f"{self.t_mid_dim}->{self.adaln_in}, axes {list(self.axes_dims)}")


# ----------------------------------------------------------------------------- inference

def strip_prefix(name: str) -> str:
    """``model.diffusion_model.X`` -> ``X``; other names unchanged."""
    return name.removeprefix(PREFIX)


_BLOCK_RE = re.compile(r"^(layers|noise_refiner|context_refiner)\.(\d+)\.(.+)$")


def _fmt(shape: Iterable[int]) -> str:
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"


def infer_denoiser_config(tensors: Mapping[str, tuple[tuple[int, ...], str]], *,
                          patch: int = 2, norm_eps: float = 1e-5,
                          n_layers: int | None = None, n_refiner: int | None = None,
                          allow_extra: bool = False, where: str = "tensors") -> DenoiserConfig:
    """Infer and fully check the Z-Image denoiser config from ``{name: (torch shape, type)}``.

    Names may carry :data:`PREFIX` (stripped here). ``patch`` resolves the ``p*p*C`` ambiguity
    of ``x_embedder``; ``norm_eps`` is not recorded in files. ``n_layers`` / ``n_refiner``,
    when given (e.g. from metadata), must agree with the tensors. Unknown tensors are an error
    unless ``allow_extra``. Every problem raises :class:`DenoiserConfigError` whose message
    starts with ``where`` and names the tensor.
    """
    t: dict[str, tuple[tuple[int, ...], str]] = {}
    for raw, val in tensors.items():
        name = strip_prefix(str(raw))
        try:
            shape, tname = val
            shape = tuple(int(d) for d in shape)
        except (TypeError, ValueError):
            raise DenoiserConfigError(f"{where}: tensor {raw!r}: expected (shape, type name), "
                                      f"got {val!r}", raw) from None
        if not shape or any(d < 1 for d in shape):
            raise DenoiserConfigError(f"{where}: tensor {raw!r} has shape {list(shape)}", raw)
        tname = str(tname).upper()
        if tname not in GGML_TYPE_NAMES:
            raise DenoiserConfigError(f"{where}: tensor {raw!r} has unknown GGML type "
                                      f"{tname!r}", raw)
        bs = _BLOCK_SIZE.get(tname)
        if bs and shape[-1] % bs:
            raise DenoiserConfigError(f"{where}: tensor {raw!r} is {tname} but its rows have "
                                      f"{shape[-1]} values, not a multiple of {bs}", raw)
        if name in t:
            raise DenoiserConfigError(f"{where}: tensor {name!r} appears twice (with and "
                                      f"without the {PREFIX!r} prefix)", name)
        t[name] = (shape, tname)

    def need(name: str) -> tuple[int, ...]:
        if name not in t:
            raise DenoiserConfigError(f"{where}: required tensor {name!r} is missing", name,
                                      missing=True)
        return t[name][0]

    def ndim(name: str, n: int) -> tuple[int, ...]:
        s = need(name)
        if len(s) != n:
            raise DenoiserConfigError(f"{where}: tensor {name!r} has shape {_fmt(s)}, expected "
                                      f"{n}-D", name)
        return s

    # Lumina-2 has the same block names but a SiLU'd 1024-wide adaLN stored at index 1
    for name in t:
        m = _BLOCK_RE.match(name)
        if m and m.group(3).startswith("adaLN_modulation.1."):
            raise DenoiserConfigError(f"{where}: tensor {name!r} is Lumina-2 naming (adaLN "
                                      f"behind a SiLU); this is not a Z-Image denoiser", name)

    # block counts per group, from the indices present
    idx: dict[str, set[int]] = {g: set() for g in GROUPS}
    for name in t:
        m = _BLOCK_RE.match(name)
        if m:
            idx[m.group(1)].add(int(m.group(2)))
    counts: dict[str, int] = {}
    for g, ids in idx.items():
        n = max(ids) + 1 if ids else 0
        gaps = sorted(set(range(n)) - ids)
        if gaps:
            miss = f"{g}.{gaps[0]}.{BLOCK_SUFFIXES['qkv']}"
            raise DenoiserConfigError(f"{where}: tensor {miss!r} missing: block {g}.{gaps[0]} "
                                      f"absent while {g}.{max(ids)} is present (indices "
                                      f"{sorted(ids)})", miss, missing=True)
        counts[g] = n
    if counts["layers"] == 0:
        raise DenoiserConfigError(f"{where}: no main-layer tensors: required tensor "
                                  f"'layers.0.{BLOCK_SUFFIXES['qkv']}' is missing (optional "
                                  f"prefix {PREFIX!r}; {len(t)} tensors given)",
                                  f"layers.0.{BLOCK_SUFFIXES['qkv']}", missing=True)
    if n_layers is not None and n_layers != counts["layers"]:
        bad = f"layers.{min(n_layers, counts['layers'])}.{BLOCK_SUFFIXES['qkv']}"
        raise DenoiserConfigError(f"{where}: {n_layers} main layers declared but the tensors "
                                  f"hold {counts['layers']} (tensor {bad!r} "
                                  f"{'missing' if n_layers > counts['layers'] else 'present'})",
                                  bad)
    nr, cr = counts["noise_refiner"], counts["context_refiner"]
    want_r = n_refiner if n_refiner is not None else max(nr, cr)
    for g, n in (("noise_refiner", nr), ("context_refiner", cr)):
        if n != want_r or n == 0:
            k = min(n, want_r) if n else 0
            bad = f"{g}.{k}.{BLOCK_SUFFIXES['qkv']}"
            state = "present" if n > want_r else "missing"
            raise DenoiserConfigError(
                f"{where}: refiner counts disagree: noise_refiner has {nr} blocks, "
                f"context_refiner {cr}" + (f", {n_refiner} declared" if n_refiner is not None
                                           else "") +
                f" (Z-Image has one refiner count, >= 1): tensor {bad!r} {state}", bad)

    # dims from specific tensors
    D = ndim("layers.0.attention_norm1.weight", 1)[0]
    hd = ndim("layers.0.attention.q_norm.weight", 1)[0]
    if hd < 6 or hd % 2 or D % hd:
        raise DenoiserConfigError(f"{where}: tensor 'layers.0.attention.q_norm.weight' gives "
                                  f"head_dim {hd}: must be even, >= 6 and divide dim {D}",
                                  "layers.0.attention.q_norm.weight")
    H = D // hd
    qkv_rows = ndim("layers.0.attention.qkv.weight", 2)[0]
    rest = qkv_rows - H * hd
    if qkv_rows % hd or rest <= 0 or rest % (2 * hd) or H % (rest // (2 * hd)):
        raise DenoiserConfigError(f"{where}: tensor 'layers.0.attention.qkv.weight' has "
                                  f"{qkv_rows} rows, not (n_heads + 2*n_kv_heads)*head_dim "
                                  f"with n_heads={H}, head_dim={hd}",
                                  "layers.0.attention.qkv.weight")
    KVH = rest // (2 * hd)
    ffn = ndim("layers.0.feed_forward.w1.weight", 2)[0]
    adaln_in = ndim("layers.0.adaLN_modulation.0.weight", 2)[1]
    t_mid, t_freq = ndim("t_embedder.mlp.0.weight", 2)
    xin = ndim("x_embedder.weight", 2)[1]
    if xin % (patch * patch):
        raise DenoiserConfigError(f"{where}: tensor 'x_embedder.weight' has {xin} columns, "
                                  f"not patch*patch*C for patch {patch}", "x_embedder.weight")
    C = xin // (patch * patch)
    cap_dim = ndim("cap_embedder.1.weight", 2)[1]
    try:
        cfg = DenoiserConfig(dim=D, n_heads=H, n_kv_heads=KVH, head_dim=hd, ffn_dim=ffn,
                             n_layers=counts["layers"], n_noise_refiner=nr,
                             n_context_refiner=cr, in_channels=C, patch=patch, cap_dim=cap_dim,
                             t_freq_dim=t_freq, t_mid_dim=t_mid, adaln_in=adaln_in,
                             norm_eps=float(norm_eps))
    except DenoiserConfigError as e:
        raise DenoiserConfigError(f"{where}: inferred config is not valid: {e}") from None

    # every expected tensor present with its shape
    expected = cfg.tensor_shapes(norm_final="norm_final.weight" in t)
    for name, shape in expected.items():
        got = need(name)
        ok = got == shape or (name.endswith("pad_token") and got == (D,))
        if not ok:
            alt = f" or {_fmt((D,))}" if name.endswith("pad_token") else ""
            raise DenoiserConfigError(f"{where}: tensor {name!r} has shape {_fmt(got)}, "
                                      f"expected {_fmt(shape)}{alt} for {cfg.summary()}", name)
    extra = [n for n in t if n not in expected]
    for name in extra:
        m = _BLOCK_RE.match(name)
        if m and m.group(1) == "context_refiner" and m.group(3).startswith("adaLN_modulation"):
            raise DenoiserConfigError(f"{where}: tensor {name!r}: the context refiner is "
                                      f"unmodulated and carries no adaLN tensors", name)
    if extra and not allow_extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise DenoiserConfigError(f"{where}: unexpected tensor {extra[0]!r}{more} for "
                                  f"{cfg.summary()}", extra[0])
    return cfg
