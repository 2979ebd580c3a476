"""The one authority for a DiT block's config: dims, divisibility rules, tensor names, shapes.

Owns :class:`BlockConfig` (dim, heads, kv heads, head_dim, FFN, adaLN width, eps, variant) and
everything derived from it: ``qkv_width``, the structural rules (:meth:`BlockConfig.validate`),
the tensor table of a block (:data:`BLOCK_TENSORS`: short name, name inside the block, role,
whether only modulated blocks have it), tensor names per stack prefix (``layers.N``,
``noise_refiner.N`` -- modulated; ``context_refiner.N`` -- no adaLN tensors), with or without
the ``model.diffusion_model.`` prefix, expected shapes, the check of one layer's bound weights
(:meth:`BlockConfig.check_layer`), and inferring the config from a file's tensor shapes
(:func:`infer_config`, :func:`check_stack`).
Must not: read files (it takes ``{name: (shape, type name)}``), import the compiled kernels, or
decode weights.

Extending to the whole denoiser (DENOISER.md): a ``DenoiserConfig`` holding a ``BlockConfig``
plus the refiner counts, ``in_channels``, ``patch``, ``cap_dim`` and the final layer belongs
here, next to this one; its stacks reuse :data:`BLOCK_STACKS`, :func:`stack_indices` and
:func:`check_stack`, and its non-block tensors get a table like :data:`BLOCK_TENSORS`.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from nxhpc.formats.gguf_io import PREFIX, MissingTensorError, ModelFileError
from nxhpc.formats.weights import RUNNABLE_TYPES, WeightTensor, as_weight_tensor, row_bytes

__all__ = ["BlockConfig", "TensorSpec", "BLOCK_TENSORS", "BLOCK_STACKS", "PROJECTIONS", "NORMS",
           "MODULATION", "DEFAULT_NORM_EPS", "MATMUL_BLOCK", "VARIANTS", "layer_tensor_names",
           "block_label", "stack_indices", "check_stack", "infer_config", "VECTOR_TYPES"]

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
