"""Small random FLUX-style autoencoders for the decoder tests, built by diffusers and stored as
the files people have: a diffusers ``vae/`` directory and a BFL/ComfyUI single file (LDM names,
encoder keys included), in float32 / float16 / bfloat16.

The LDM names are written by nxhpc's mapping (``nxhpc.vae.config.ldm_name``) and checked here
against diffusers' own ``convert_ldm_vae_checkpoint`` (the independent reference of that
mapping) every time a file is made. Owns nothing the decoder uses.
"""
import json
from pathlib import Path

import numpy as np
import torch
from diffusers import AutoencoderKL
from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint
from safetensors.torch import save_file

from nxhpc.vae.config import ldm_name

SMALL = dict(block_out_channels=(32, 32, 64, 64), norm_num_groups=8, latent_channels=16)
TORCH_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def make_vae(seed=0, block_out_channels=(32, 32, 64, 64), norm_num_groups=8, latent_channels=16):
    """A FLUX-style AutoencoderKL in float64 with every parameter random (norms included)."""
    n = len(block_out_channels)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * n,
                        up_block_types=("UpDecoderBlock2D",) * n,
                        block_out_channels=tuple(block_out_channels), layers_per_block=2,
                        latent_channels=latent_channels, norm_num_groups=norm_num_groups,
                        use_quant_conv=False, use_post_quant_conv=False,
                        mid_block_add_attention=True, scaling_factor=0.3611,
                        shift_factor=0.1159).double().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in vae.named_parameters():
            if p.ndim == 1:
                base = 1.0 if name.endswith("weight") and "norm" in name else 0.0
                p.copy_(base + 0.3 * torch.randn(p.shape, generator=g, dtype=torch.float64))
            else:
                fan_in = p[0].numel()
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) / fan_in ** 0.5)
    return vae


def rounded(vae, dtype):
    """A float64 copy of ``vae`` whose weights are rounded to ``dtype`` ("F32" | "F16" |
    "BF16"): the reference for a file stored in that dtype."""
    ref = make_vae(0, **{k: vae.config[k] for k in SMALL})
    sd = {k: v.to(TORCH_DTYPES[dtype]).double() for k, v in vae.state_dict().items()}
    ref.load_state_dict(sd)
    return ref


def ldm_state_dict(vae, dtype):
    """The BFL single-file state dict (LDM names; decoder by nxhpc's mapping, checked against
    diffusers' conversion; the encoder's keys carried along under theirs)."""
    levels = len(vae.config["block_out_channels"])
    sd = {k: v.to(TORCH_DTYPES[dtype]).contiguous() for k, v in vae.state_dict().items()}
    out = {}
    for k, v in sd.items():
        if k.startswith("decoder."):
            name = ldm_name(k, levels)
            if ".mid.attn_1." in name and v.ndim == 2:
                v = v[:, :, None, None].contiguous()
            out[name] = v
        else:
            out[k] = v                    # encoder keys: present, ignored by the decoder
    conv = convert_ldm_vae_checkpoint({k: v for k, v in out.items() if k.startswith("decoder.")},
                                      dict(vae.config))
    dec = {k: v for k, v in sd.items() if k.startswith("decoder.")}
    assert set(conv) == set(dec), sorted(set(conv) ^ set(dec))[:6]
    for k, v in dec.items():
        assert torch.equal(conv[k].reshape(v.shape), v), k
    return out


def write_vae(vae, root, layout, dtype):
    """Store ``vae`` under ``root`` as ``layout`` ("diffusers" | "ldm") in ``dtype``; returns the
    path to open (the directory, or the ``ae.safetensors`` file)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    if layout == "diffusers":
        d = root / "vae"
        d.mkdir(exist_ok=True)
        sd = {k: v.to(TORCH_DTYPES[dtype]).contiguous() for k, v in vae.state_dict().items()}
        save_file(sd, str(d / "diffusion_pytorch_model.safetensors"))
        cfg = {k: (list(v) if isinstance(v, tuple) else v) for k, v in vae.config.items()
               if not k.startswith("_")}
        (d / "config.json").write_text(json.dumps(cfg))
        return d
    f = root / "ae.safetensors"
    save_file(ldm_state_dict(vae, dtype), str(f))
    return f


def diffusers_decode(vae, latents):
    """diffusers' decode of sampler-space latents [16, h, w] in float64 -> [3, 8h, 8w]."""
    z = torch.from_numpy(np.asarray(latents, dtype=np.float64))[None]
    with torch.no_grad():
        x = vae.decode(z / vae.config.scaling_factor + vae.config.shift_factor).sample
    return x[0].numpy()
