"""Built-in autoencoders: the spec of a small random FLUX-style VAE and its generator.

Owns :class:`VaeSpec` (everything that determines the file: the decoder's channels, levels,
latent channels, the stored dtype, the seed; with a fingerprint, as the other built-in kinds
have) and :func:`make_vae_model`, which writes a model directory holding ``ae.safetensors`` in
the BFL/ComfyUI single-file layout (LDM key names, the mid attention's linears as 1x1 convs;
decoder tensors only) and ``synthetic.json``, all-or-nothing
(``nxhpc.models.modeldir.build_model_dir``). Every tensor is drawn from its own generator, so
the same spec gives the same bytes. Must not: run kernels, or import torch or diffusers (a
fresh machine generates it with numpy and ``safetensors`` only).
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

from nxhpc.models.modeldir import (SPEC_FILE, VAE_FILE, build_model_dir, check_replaceable,
                                   process_umask)
from nxhpc.vae.config import FLUX_SCALING, FLUX_SHIFT, VaeConfig, ldm_name, tensor_names

__all__ = ["VaeSpec", "make_vae_model", "VAE_KIND", "VAE_GENERATOR_VERSION", "VAE_FILE",
           "draw_vae_tensor"]

#: The ``kind`` of an autoencoder spec in the built-in table.
VAE_KIND = "vae"
#: Part of every autoencoder fingerprint: bump it when :func:`make_vae_model`'s bytes change.
VAE_GENERATOR_VERSION = 1
#: numpy dtype of each stored dtype written.
_NP_DTYPES = {"F32": np.float32, "F16": np.float16}


@dataclass(frozen=True)
class VaeSpec:
    """Everything that determines a built-in autoencoder's ``ae.safetensors`` (same spec ->
    the same bytes). Channels as diffusers' ``block_out_channels`` (highest resolution first);
    every GroupNorm has 32 groups, as a BFL file (which carries no config) is read."""
    block_out_channels: tuple[int, ...] = (32, 32, 64, 64)   # 4 levels: 8x upscaling
    layers_per_block: int = 2            # the decoder has 3 ResNets a level, as FLUX's
    latent_channels: int = 16            # z: [16, h, w], Z-Image's latents
    dtype: str = "F32"                   # stored dtype of every tensor (F32 or F16)
    out_gain: float = 0.5                # conv_out's weight scale: keeps pixels mostly in [-1, 1]
    seed: int = 0

    @property
    def kind(self) -> str:
        return VAE_KIND

    main_file = VAE_FILE
    """The file a current model directory of this kind must hold."""

    def fields(self) -> dict[str, Any]:
        """The spec's fields by name (what ``synthetic.json`` stores)."""
        d = dataclasses.asdict(self)
        d["block_out_channels"] = list(d["block_out_channels"])
        return d

    def config(self) -> VaeConfig:
        """The decoder's config as nxhpc infers it from the written file."""
        return VaeConfig(latent_channels=self.latent_channels,
                         block_out_channels=tuple(self.block_out_channels),
                         layers_per_block=self.layers_per_block, norm_num_groups=32,
                         scaling_factor=FLUX_SCALING, shift_factor=FLUX_SHIFT)

    def validate(self) -> "VaeSpec":
        """ValueError unless the spec makes a file nxhpc reads: channels multiples of 32, at
        least one level, a stored dtype written here."""
        ch = tuple(self.block_out_channels)
        if not ch or any(isinstance(c, bool) or int(c) < 32 or int(c) % 32 for c in ch):
            raise ValueError(f"VaeSpec: block_out_channels {list(ch)} must be positive "
                             f"multiples of 32 (the GroupNorms' 32 groups)")
        if self.layers_per_block < 0 or self.latent_channels < 1:
            raise ValueError(f"VaeSpec: layers_per_block {self.layers_per_block} must be >= 0 "
                             f"and latent_channels {self.latent_channels} >= 1")
        if self.dtype not in _NP_DTYPES:
            raise ValueError(f"VaeSpec: dtype {self.dtype!r} is not one of "
                             f"{', '.join(_NP_DTYPES)}")
        if not (math.isfinite(self.out_gain) and self.out_gain > 0):
            raise ValueError(f"VaeSpec: out_gain must be positive, got {self.out_gain}")
        return self

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """LDM name -> stored shape of every tensor of the file, in the network's order."""
        from nxhpc.vae.config import expected_shape
        cfg = self.config()
        out = {}
        for name in tensor_names(cfg):
            s = expected_shape(cfg, name)
            if ".attentions.0." in name and len(s) == 2:
                s = s + (1, 1)                  # the BFL file stores them as 1x1 convs
            out[ldm_name(name, cfg.levels)] = s
        return out

    def weights_bytes_f32(self) -> int:
        """Bytes of every tensor as float32."""
        return 4 * sum(math.prod(s) for s in self.shapes().values())

    def disk_bytes(self) -> int:
        """A lower bound of the model directory's bytes (the tensors in their stored dtype)."""
        return self.weights_bytes_f32() * np.dtype(_NP_DTYPES[self.dtype]).itemsize // 4

    def fingerprint(self) -> str:
        """16 hex digits of the sha256 of the fields, the kind and the generator's version."""
        d = self.fields()
        d["kind"] = self.kind
        d["generator_version"] = VAE_GENERATOR_VERSION
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    def spec_file_text(self) -> str:
        """The ``synthetic.json`` of the model directory (its fingerprint says if it is stale)."""
        info = {"spec": self.fields(), "kind": self.kind, "fingerprint": self.fingerprint(),
                "generator_version": VAE_GENERATOR_VERSION}
        return json.dumps(info, indent=1, sort_keys=True) + "\n"


def draw_vae_tensor(spec: VaeSpec, index: int, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Tensor ``index`` (LDM ``name``) of the file, float32, from its own generator: conv
    weights N(0, 1/fan_in) (``conv_out`` times ``spec.out_gain``), biases N(0, 0.1^2), GroupNorm
    weights 1 + N(0, 0.2^2)."""
    rng = np.random.default_rng([spec.seed, index])
    z = rng.standard_normal(shape, dtype=np.float32)
    if len(shape) == 1:
        is_norm = ".norm" in name or name.startswith("decoder.norm_out.")
        if is_norm and name.endswith(".weight"):
            return (np.float32(1.0) + np.float32(0.2) * z).astype(np.float32)
        return z * np.float32(0.1)
    gain = spec.out_gain if name.startswith("decoder.conv_out.") else 1.0
    return z * np.float32(gain / math.sqrt(math.prod(shape[1:])))


def make_vae_model(out_dir: str | os.PathLike, spec: VaeSpec,
                   progress: Callable[[str], None] | None = None, *,
                   replace: bool = False) -> Path:
    """Write the model directory of ``spec`` at ``out_dir``: ``ae.safetensors`` (BFL layout,
    decoder tensors in ``spec.dtype``, metadata ``nxhpc.synthetic``: the fingerprint) and ``synthetic.json``;
    built in a temporary sibling and renamed into place (``replace`` swaps out an existing
    model directory once the new one is complete)."""
    from safetensors.numpy import save_file
    spec.validate()
    out_dir = Path(out_dir)
    check_replaceable(out_dir, replace)
    say = progress or (lambda s: None)
    t0 = time.monotonic()
    np_dtype = _NP_DTYPES[spec.dtype]

    def write(tmp: Path) -> None:
        say(f"writing {VAE_FILE} (FLUX-style decoder {list(spec.block_out_channels)}, "
            f"z={spec.latent_channels}, {spec.dtype})")
        tensors = {name: np.ascontiguousarray(draw_vae_tensor(spec, i, name, shape)
                                              .astype(np_dtype))
                   for i, (name, shape) in enumerate(spec.shapes().items())}
        # one metadata key: safetensors writes its metadata map in no fixed order
        save_file(tensors, str(tmp / VAE_FILE),
                  metadata={"nxhpc.synthetic": spec.fingerprint()})
        os.chmod(tmp / VAE_FILE, 0o666 & ~process_umask())
        (tmp / SPEC_FILE).write_text(spec.spec_file_text())
    build_model_dir(out_dir, write, replace=replace)
    say(f"done in {time.monotonic() - t0:.1f} s: {out_dir}")
    return out_dir
