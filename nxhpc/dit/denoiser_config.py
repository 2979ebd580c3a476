"""The whole Z-Image denoiser's config, inferred from a file's tensor table.

Owns :class:`DenoiserConfig` (every dimension of the model, the tensor names and torch shapes
it implies) and :func:`infer_denoiser_config`, which reads a ``{name: (torch shape, GGML type
name)}`` table (names with or without ``model.diffusion_model.``) and either returns the config
or raises :class:`DenoiserConfigError` naming the offending tensor. Pure Python: it opens no
file, decodes no data and never imports torch or the kernels.

Inference (``docs``: ``DENOISER.md`` "Tensor names"):

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

__all__ = [
    "ADALN_SUFFIXES",
    "BLOCK_SUFFIXES",
    "GGML_TYPE_NAMES",
    "GROUPS",
    "OPTIONAL_TENSORS",
    "PREFIX",
    "DenoiserConfig",
    "DenoiserConfigError",
    "block_tensor_names",
    "infer_denoiser_config",
    "strip_prefix",
]

PREFIX = "model.diffusion_model."
"""Name prefix of stable-diffusion.cpp's converter (ComfyUI-GGUF writes none)."""

# short name (nxhpc.dit.reference.WEIGHT_KEYS) -> name inside one block
BLOCK_SUFFIXES: dict[str, str] = {
    "qkv": "attention.qkv.weight",
    "out": "attention.out.weight",
    "q_norm": "attention.q_norm.weight",
    "k_norm": "attention.k_norm.weight",
    "attention_norm1": "attention_norm1.weight",
    "attention_norm2": "attention_norm2.weight",
    "ffn_norm1": "ffn_norm1.weight",
    "ffn_norm2": "ffn_norm2.weight",
    "w1": "feed_forward.w1.weight",
    "w2": "feed_forward.w2.weight",
    "w3": "feed_forward.w3.weight",
}
"""The 11 tensors every block has (the context refiner has only these)."""

ADALN_SUFFIXES: dict[str, str] = {
    "adaln_w": "adaLN_modulation.0.weight",
    "adaln_b": "adaLN_modulation.0.bias",
}
"""The 2 adaLN tensors of a modulated block (main layers, noise refiner)."""

GROUPS: dict[str, bool] = {"layers": True, "noise_refiner": True, "context_refiner": False}
"""Block groups and whether their blocks are modulated."""

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
    problem was found at (``None`` when none applies); the message always names it."""

    def __init__(self, message: str, tensor: str | None = None) -> None:
        super().__init__(message)
        self.tensor = tensor


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
        """Short name -> torch shape of one block's tensors."""
        D, F = self.dim, self.ffn_dim
        s = {"qkv": (self.qkv_width, D), "out": (D, self.n_heads * self.head_dim),
             "q_norm": (self.head_dim,), "k_norm": (self.head_dim,),
             "attention_norm1": (D,), "attention_norm2": (D,), "ffn_norm1": (D,),
             "ffn_norm2": (D,), "w1": (F, D), "w2": (D, F), "w3": (F, D)}
        if modulated:
            s.update(adaln_w=(4 * D, self.adaln_in), adaln_b=(4 * D,))
        return s

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

    def as_block_config(self):
        """The main layers' :class:`nxhpc.models.BlockConfig` (same dims, eps, adaLN width)."""
        from nxhpc.models import BlockConfig
        return BlockConfig(dim=self.dim, n_heads=self.n_heads, n_kv_heads=self.n_kv_heads,
                           head_dim=self.head_dim, ffn_dim=self.ffn_dim, n_layers=self.n_layers,
                           adaln_in=self.adaln_in, variant="zimage", adaln_silu=False,
                           norm_eps=self.norm_eps)

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
            raise DenoiserConfigError(f"{where}: required tensor {name!r} is missing", name)
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
                                      f"{sorted(ids)})", miss)
        counts[g] = n
    if counts["layers"] == 0:
        raise DenoiserConfigError(f"{where}: no main-layer tensors: required tensor "
                                  f"'layers.0.{BLOCK_SUFFIXES['qkv']}' is missing (optional "
                                  f"prefix {PREFIX!r}; {len(t)} tensors given)",
                                  f"layers.0.{BLOCK_SUFFIXES['qkv']}")
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
