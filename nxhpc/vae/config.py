"""The FLUX autoencoder decoder's config and tensor names, inferred from a checkpoint's keys.

Owns :class:`VaeConfig` (the decoder's shape, its latent scaling and shift), the canonical
tensor names (diffusers' ``decoder.*`` names, :func:`tensor_names`), the LDM (BFL / ComfyUI
``ae.safetensors``) spelling of each (:func:`ldm_name`: ``up_blocks.{i}`` is LDM's
``up.{n-1-i}``), and :func:`infer_config` from the shapes (and a diffusers ``config.json``).
Must not: import compiled code, the registry, or another family.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from nxhpc.formats.gguf_io import BLOCK_INDEX, MissingTensorError, ModelFileError

__all__ = ["VaeConfig", "FLUX_SCALING", "FLUX_SHIFT", "DIFFUSERS_SCALING", "latent_factors",
           "tensor_names", "ldm_name",
           "infer_config", "count_levels", "expected_shape", "detect_layout", "LAYOUTS",
           "resnet_names", "attention_names"]

#: The FLUX VAE's latent scaling and shift (diffusers ``AutoencoderKL`` config of FLUX.1 and
#: Z-Image): the decoder reads ``z / scaling + shift``.
FLUX_SCALING = 0.3611
FLUX_SHIFT = 0.1159
#: diffusers' ``AutoencoderKL`` default scaling: what a ``config.json`` without the key holds
#: once diffusers reads it (its shift default, None, is no shift).
DIFFUSERS_SCALING = 0.18215

_F32_MAX = 3.4028234663852886e38            # float32's largest finite value
_F32_NORMAL_MIN = 1.1754943508222875e-38     # float32's smallest positive normal value

#: The two key layouts read: diffusers' names and the LDM names of the BFL single file.
LAYOUTS = ("diffusers", "ldm")


@dataclass(frozen=True)
class VaeConfig:
    """The decoder's shape. Channels are listed as diffusers' ``block_out_channels`` (highest
    resolution first); the decoder runs them reversed (``up_blocks.0`` has the most)."""
    latent_channels: int = 16                       # z: [latent_channels, h, w]
    block_out_channels: tuple[int, ...] = (128, 256, 512, 512)
    layers_per_block: int = 2                       # the decoder has this + 1 ResNets a level
    norm_num_groups: int = 32                       # every GroupNorm
    out_channels: int = 3                           # pixels: [out_channels, 8h, 8w] for 4 levels
    mid_attention: bool = True                      # one single-head attention in the mid block
    scaling_factor: float = FLUX_SCALING
    shift_factor: float = FLUX_SHIFT
    eps: float = 1e-6                               # every GroupNorm's epsilon

    @property
    def levels(self) -> int:
        return len(self.block_out_channels)

    @property
    def up_channels(self) -> tuple[int, ...]:
        """Output channels of ``up_blocks.0, 1, ...`` (block_out_channels reversed)."""
        return tuple(reversed(self.block_out_channels))

    @property
    def upscale(self) -> int:
        """Pixels per latent along each side: 2^(levels - 1)."""
        return 2 ** (self.levels - 1)

    def level_in_channels(self, i: int) -> int:
        """Input channels of ``up_blocks.{i}``: the previous level's output (the mid block's
        width for level 0)."""
        return self.up_channels[max(i - 1, 0)]


def resnet_names(prefix: str, cin: int, cout: int) -> list[str]:
    """The tensors of one ResnetBlock2D under ``prefix`` (diffusers names)."""
    parts = ["norm1", "conv1", "norm2", "conv2"] + (["conv_shortcut"] if cin != cout else [])
    return [f"{prefix}.{p}.{wb}" for p in parts for wb in ("weight", "bias")]


def attention_names(prefix: str) -> list[str]:
    """The tensors of the mid block's attention under ``prefix`` (diffusers names)."""
    return [f"{prefix}.{p}.{wb}" for p in ("group_norm", "to_q", "to_k", "to_v", "to_out.0")
            for wb in ("weight", "bias")]


def tensor_names(cfg: VaeConfig) -> list[str]:
    """Every decoder tensor of ``cfg``, by its diffusers name, in the order the network reads."""
    top = cfg.up_channels[0]
    names = [f"decoder.conv_in.{wb}" for wb in ("weight", "bias")]
    names += resnet_names("decoder.mid_block.resnets.0", top, top)
    if cfg.mid_attention:
        names += attention_names("decoder.mid_block.attentions.0")
    names += resnet_names("decoder.mid_block.resnets.1", top, top)
    for i, cout in enumerate(cfg.up_channels):
        cin = cfg.level_in_channels(i)
        for j in range(cfg.layers_per_block + 1):
            names += resnet_names(f"decoder.up_blocks.{i}.resnets.{j}", cin if j == 0 else cout,
                                  cout)
        if i < cfg.levels - 1:
            names += [f"decoder.up_blocks.{i}.upsamplers.0.conv.{wb}" for wb in ("weight", "bias")]
    names += [f"decoder.{p}.{wb}" for p in ("conv_norm_out", "conv_out")
              for wb in ("weight", "bias")]
    return names


def expected_shape(cfg: VaeConfig, name: str) -> tuple[int, ...]:
    """The diffusers shape of decoder tensor ``name`` under ``cfg``."""
    top = cfg.up_channels[0]
    suffix = name.rsplit(".", 1)[1]

    def conv(cout: int, cin: int, k: int) -> tuple[int, ...]:
        return (cout, cin, k, k) if suffix == "weight" else (cout,)

    if name.startswith("decoder.conv_in."):
        return conv(top, cfg.latent_channels, 3)
    if name.startswith("decoder.conv_out."):
        return conv(cfg.out_channels, cfg.up_channels[-1], 3)
    if name.startswith("decoder.conv_norm_out."):
        return (cfg.up_channels[-1],)
    if name.startswith("decoder.mid_block.attentions.0."):
        if ".group_norm." in name or suffix == "bias":
            return (top,)
        return (top, top)
    m = re.match(r"decoder\.(?:mid_block|up_blocks\.(\d+))\.(resnets\.(\d+)|upsamplers\.0)\.(\w+)\.",
                 name)
    if not m:
        raise KeyError(name)
    level = m.group(1)
    if level is None:
        cin = cout = top
    else:
        i = int(level)
        cout = cfg.up_channels[i]
        cin = cfg.level_in_channels(i) if m.group(3) == "0" else cout
    if m.group(2) == "upsamplers.0":
        return conv(cout, cout, 3)
    part = m.group(4)
    if part == "norm1":
        return (cin,)
    if part == "norm2":
        return (cout,)
    if part == "conv1":
        return conv(cout, cin, 3)
    if part == "conv2":
        return conv(cout, cout, 3)
    return conv(cout, cin, 1)            # conv_shortcut


_LDM_RESNET = {"conv_shortcut": "nin_shortcut"}
_LDM_ATTN = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}


def ldm_name(name: str, levels: int) -> str:
    """The LDM (BFL ``ae.safetensors``) key of diffusers decoder tensor ``name``: LDM counts
    ``up.{k}`` from the highest resolution and runs them in reverse, so diffusers'
    ``up_blocks.{i}`` is ``up.{levels - 1 - i}``; the mid attention's linears are 1x1 convs."""
    n = name
    n = n.replace("decoder.conv_norm_out.", "decoder.norm_out.")
    n = n.replace("decoder.mid_block.resnets.0.", "decoder.mid.block_1.")
    n = n.replace("decoder.mid_block.resnets.1.", "decoder.mid.block_2.")
    if n.startswith("decoder.mid_block.attentions.0."):
        rest = n[len("decoder.mid_block.attentions.0."):]
        part, wb = rest.rsplit(".", 1)
        return f"decoder.mid.attn_1.{_LDM_ATTN[part]}.{wb}"
    m = re.match(r"decoder\.up_blocks\.(\d+)\.(.*)$", n)
    if m:
        k = levels - 1 - int(m.group(1))
        rest = m.group(2)
        rest = re.sub(r"^resnets\.(\d+)\.", r"block.\1.", rest)
        rest = rest.replace("upsamplers.0.conv.", "upsample.conv.")
        for a, b in _LDM_RESNET.items():
            rest = rest.replace(f"{a}.", f"{b}.")
        return f"decoder.up.{k}.{rest}"
    if ".conv_shortcut." in n:
        n = n.replace(".conv_shortcut.", ".nin_shortcut.")
    return n


#: Prefixes a decoder may sit under in a file (whole-model checkpoints, ComfyUI VAE files).
PREFIXES = ("", "first_stage_model.", "vae.")


def detect_layout(keys: Mapping[str, Any] | list[str], where: str) -> tuple[str, str]:
    """(layout, prefix) of a checkpoint's keys: ``"ldm"`` if it has ``decoder.mid.block_1``,
    ``"diffusers"`` if ``decoder.mid_block.resnets.0``; ModelFileError naming what is missing."""
    ks = set(keys)
    for prefix in PREFIXES:
        if f"{prefix}decoder.mid.block_1.norm1.weight" in ks:
            return "ldm", prefix
        if f"{prefix}decoder.mid_block.resnets.0.norm1.weight" in ks:
            return "diffusers", prefix
    raise MissingTensorError(
        f"{where}: not a FLUX/SD autoencoder checkpoint: no decoder found (neither the LDM key "
        f"'decoder.mid.block_1.norm1.weight' nor the diffusers key "
        f"'decoder.mid_block.resnets.0.norm1.weight', under any of the prefixes "
        f"{[p for p in PREFIXES if p]})", tensor="decoder.mid_block.resnets.0.norm1.weight")


def count_levels(keys: Iterable[str], layout: str, where: str) -> int:
    """The number of up levels: the distinct ``decoder.up.{k}`` (LDM) or ``decoder.up_blocks.{i}``
    (diffusers) holding a first ResNet; they must be numbered 0 .. n-1."""
    pat = (rf"decoder\.up\.{BLOCK_INDEX}\.block\.0\.norm1\.weight$" if layout == "ldm"
           else rf"decoder\.up_blocks\.{BLOCK_INDEX}\.resnets\.0\.norm1\.weight$")
    found = sorted({int(m.group(1)) for k in keys if (m := re.match(pat, k))})
    if not found:
        key = ("decoder.up.0.block.0.norm1.weight" if layout == "ldm"
               else "decoder.up_blocks.0.resnets.0.norm1.weight")
        raise MissingTensorError(f"{where}: missing tensor {key!r} (no up blocks)", tensor=key)
    if found != list(range(len(found))) or len(found) > 16:
        raise ModelFileError(f"{where}: up blocks numbered {found}, expected 0 .. n-1")
    return len(found)


#: The config.json keys the decoder reads, with the JSON type each must have: "int" (not a
#: bool; the minimum after it), "ints" (a list of positive ints), "bool", "number" (int or float).
_CONFIG_KEYS = {"block_out_channels": ("ints", 1), "latent_channels": ("int", 1),
                "layers_per_block": ("int", 0), "norm_num_groups": ("int", 1),
                "use_post_quant_conv": ("bool", None), "mid_block_add_attention": ("bool", None),
                "scaling_factor": ("number", None), "shift_factor": ("number", None)}


def _checked_config_json(cj: dict, where: str) -> dict:
    """``cj`` if every key the decoder reads has its JSON type (:data:`_CONFIG_KEYS`; null means
    absent); else ModelFileError naming the key. No coercion: ``"false"`` is not false, 8.9 is
    not 8."""
    def is_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    for key, (kind, low) in _CONFIG_KEYS.items():
        v = cj.get(key)
        if v is None:
            continue
        if kind == "int":
            ok = is_int(v) and v >= low
            want = f"an integer >= {low}"
        elif kind == "ints":
            ok = isinstance(v, list) and len(v) > 0 and all(is_int(c) and c >= low for c in v)
            want = "a list of positive integers"
        elif kind == "bool":
            ok = isinstance(v, bool)
            want = "true or false"
        else:
            ok = isinstance(v, (int, float)) and not isinstance(v, bool)
            want = "a number"
        if not ok:
            raise ModelFileError(f"{where}: config.json {key} is {json.dumps(v)[:80]}, "
                                 f"expected {want}")
    return cj


def infer_config(shapes: Mapping[str, tuple[int, ...]], layout: str, where: str,
                 config_json: Mapping[str, Any] | None = None) -> VaeConfig:
    """The decoder's config from its tensors' shapes (``shapes``: stored name, prefix removed ->
    shape, in ``layout``'s naming) and, where given, a diffusers ``config.json`` (which must
    agree with the shapes). Every tensor's shape is then checked; errors name the tensor as the
    file spells it."""
    levels = count_levels(shapes, layout, where)

    def stored(name: str, n: int = levels) -> str:
        return ldm_name(name, n) if layout == "ldm" else name

    def shape_of(name: str) -> tuple[int, ...] | None:
        s = shapes.get(stored(name))
        return None if s is None else tuple(int(d) for d in s)

    def need(name: str) -> tuple[int, ...]:
        s = shape_of(name)
        if s is None:
            key = stored(name)
            raise MissingTensorError(f"{where}: missing tensor {key!r}", tensor=key)
        return s

    cin_shape = need("decoder.conv_in.weight")
    if len(cin_shape) != 4 or cin_shape[2:] != (3, 3):
        raise ModelFileError(f"{where}: tensor {stored('decoder.conv_in.weight')!r} has shape "
                             f"{list(cin_shape)}, expected [C, z, 3, 3]",
                             tensor=stored("decoder.conv_in.weight"))
    # up_channels[i] from up_blocks.i.resnets.0.conv1 (output channels)
    up = []
    for i in range(levels):
        s = need(f"decoder.up_blocks.{i}.resnets.0.conv1.weight")
        up.append(int(s[0]))
    per_level = 0
    while shape_of(f"decoder.up_blocks.0.resnets.{per_level}.norm1.weight") is not None:
        per_level += 1
    out_shape = need("decoder.conv_out.weight")
    groups = 32
    scaling, shift = FLUX_SCALING, FLUX_SHIFT
    # the mid attention is there if any of its tensors is (a missing one is then named below)
    mid_attn = any(shape_of(n) is not None
                   for n in attention_names("decoder.mid_block.attentions.0"))
    if config_json is not None:
        cj = _checked_config_json(config_json, where)
        boc = cj.get("block_out_channels")
        if boc is not None and tuple(boc) != tuple(reversed(up)):
            raise ModelFileError(f"{where}: config.json block_out_channels {list(boc)} disagree "
                                 f"with the tensors' {list(reversed(up))}")
        lc = cj.get("latent_channels")
        if lc is not None and int(lc) != int(cin_shape[1]):
            raise ModelFileError(f"{where}: config.json latent_channels {lc} disagrees with "
                                 f"decoder.conv_in.weight's {cin_shape[1]}")
        lpb = cj.get("layers_per_block")
        if lpb is not None and int(lpb) + 1 != per_level:
            raise ModelFileError(f"{where}: config.json layers_per_block {lpb} disagrees with "
                                 f"the {per_level} ResNets per up block")
        if cj.get("use_post_quant_conv", False):
            raise ModelFileError(f"{where}: config.json has use_post_quant_conv=true; the FLUX "
                                 f"decoder has no post-quant conv (not supported)")
        _check_flux_decoder(cj, int(out_shape[0]) if out_shape else 0, where)
        groups = int(cj.get("norm_num_groups") or groups)      # null: absent
        scaling, shift = latent_factors(cj, where)
        if cj.get("mid_block_add_attention") is not None and \
                cj["mid_block_add_attention"] != mid_attn:
            raise ModelFileError(f"{where}: config.json mid_block_add_attention="
                                 f"{cj['mid_block_add_attention']} but the mid attention's "
                                 f"tensors are {'present' if mid_attn else 'absent'}")
    if "post_quant_conv.weight" in shapes or "post_quant_conv.bias" in shapes:
        raise ModelFileError(f"{where}: the checkpoint has a post_quant_conv (an SD-style "
                             f"autoencoder); the FLUX decoder has none (not supported)",
                             tensor=stored("post_quant_conv.weight"))
    if int(cin_shape[1]) < 1 or int(cin_shape[0]) < 1:
        raise ModelFileError(f"{where}: tensor {stored('decoder.conv_in.weight')!r} has shape "
                             f"{list(cin_shape)}: an empty dimension",
                             tensor=stored("decoder.conv_in.weight"))
    if not out_shape or int(out_shape[0]) not in (1, 3):
        raise ModelFileError(f"{where}: tensor {stored('decoder.conv_out.weight')!r} has shape "
                             f"{list(out_shape)}: the decoder writes images of 3 channels (RGB) "
                             f"or 1 (grayscale), not {out_shape[0] if out_shape else 0}",
                             tensor=stored("decoder.conv_out.weight"))
    cfg = VaeConfig(latent_channels=int(cin_shape[1]),
                    block_out_channels=tuple(reversed(up)),
                    layers_per_block=per_level - 1, norm_num_groups=groups,
                    out_channels=int(out_shape[0]), mid_attention=mid_attn,
                    scaling_factor=scaling, shift_factor=shift)
    if int(cin_shape[0]) != cfg.up_channels[0]:
        raise ModelFileError(f"{where}: tensor {stored('decoder.conv_in.weight')!r} has "
                             f"{cin_shape[0]} output channels but up block 0 has "
                             f"{cfg.up_channels[0]}", tensor=stored("decoder.conv_in.weight"))
    if min(up) < 1:
        raise ModelFileError(f"{where}: up block channels {up}: an empty dimension")
    bad = [c for c in up if c % groups]
    if bad:
        raise ModelFileError(f"{where}: channel counts {bad} are not multiples of "
                             f"norm_num_groups={groups}")
    names = tensor_names(cfg)
    for name in names:
        s = need(name)
        want = expected_shape(cfg, name)
        if tuple(s) != want and not (".attentions.0." in name and tuple(s) == want + (1, 1)):
            key = stored(name)
            raise ModelFileError(f"{where}: tensor {key!r} has shape {list(s)}, expected "
                                 f"{list(want)} for this decoder ({cfg.block_out_channels})",
                                 tensor=key)
    # a decoder tensor the FLUX decoder has no place for (attention in the up blocks, a
    # fourth ResNet in a level but the first) changes the network: refused, never skipped
    known = {stored(n) for n in names}
    extra = sorted(k for k in shapes if k.startswith("decoder.") and k not in known)
    if extra:
        more = f" and {len(extra) - 1} more" if len(extra) > 1 else ""
        raise ModelFileError(f"{where}: tensor {extra[0]!r}{more} is not part of a FLUX-style "
                             f"decoder (this one: {cfg.block_out_channels}, "
                             f"{cfg.layers_per_block + 1} ResNets a level, "
                             f"{'a' if cfg.mid_attention else 'no'} mid attention): another "
                             f"architecture, not supported", tensor=extra[0])
    return cfg


def latent_factors(cj: Mapping[str, Any], where: str) -> tuple[float, float]:
    """(scaling, shift) of a diffusers VAE ``config.json`` as diffusers' ``AutoencoderKL``
    reads it: an absent scaling is its default 0.18215, an absent or null shift no shift; a
    null scaling is refused (nothing can divide by it). The one rule for nxhpc's decoder and
    ``nxhpc.dit.sampler.decode_png``."""
    if "scaling_factor" in cj and cj["scaling_factor"] is None:
        raise ModelFileError(f"{where}: config.json scaling_factor is null: the latents are "
                             f"divided by it (FLUX's autoencoder: 0.3611)")
    _checked_config_json({k: cj[k] for k in ("scaling_factor", "shift_factor") if k in cj},
                         where)
    scaling = float(cj.get("scaling_factor", DIFFUSERS_SCALING))
    shift = float(cj.get("shift_factor") or 0.0)
    # the decoder computes z / scaling + shift in float32: both must be float32 numbers there
    # (a scaling below float32's normal range is 0 or subnormal, 1/it infinite)
    if not (_F32_NORMAL_MIN <= scaling <= _F32_MAX and abs(shift) <= _F32_MAX):
        raise ModelFileError(f"{where}: scaling_factor {scaling} / shift_factor {shift}: the "
                             f"scaling must be a positive normal float32 number "
                             f"({_F32_NORMAL_MIN:.3g} .. {_F32_MAX:.3g}) and the shift a "
                             f"finite float32 one")
    return scaling, shift


#: config.json settings of diffusers' AutoencoderKL that change the decoder, and the one value
#: each has in FLUX's (the only one nxhpc's decoder computes).
_FLUX_SETTINGS = {"_class_name": ("AutoencoderKL",), "act_fn": ("silu", "swish")}


def _check_flux_decoder(cj: Mapping[str, Any], out_channels: int, where: str) -> None:
    """ModelFileError for a config.json whose decoder is not the one the tensors and nxhpc's
    kernels compute: another class or activation, up blocks of another type, or an
    ``out_channels`` that disagrees with ``conv_out`` (diffusers' loader refuses that too)."""
    for key, want in _FLUX_SETTINGS.items():       # diffusers builds SiLU for "swish" too
        if key in cj and cj[key] not in want:
            raise ModelFileError(f"{where}: config.json {key} is {json.dumps(cj[key])[:80]}; "
                                 f"nxhpc's decoder computes FLUX's autoencoder ({key} "
                                 f"{json.dumps(want[0])}) only")
    ups = cj.get("up_block_types")
    if ups is not None and (not isinstance(ups, list)
                            or any(u != "UpDecoderBlock2D" for u in ups)):
        raise ModelFileError(f"{where}: config.json up_block_types is {json.dumps(ups)[:120]}; "
                             f"nxhpc's decoder runs UpDecoderBlock2D levels only")
    oc = cj.get("out_channels")
    if oc is not None and oc != out_channels:
        raise ModelFileError(f"{where}: config.json out_channels {json.dumps(oc)[:40]} disagrees "
                             f"with decoder.conv_out's {out_channels} output channels")

