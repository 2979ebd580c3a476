"""A drop-in transformer for diffusers' ``ZImagePipeline``, computed by nxhpc on the CPU.

Owns :class:`NxhpcZImageTransformer`: the surface ``ZImagePipeline`` uses on its transformer
(diffusers 0.42: ``in_channels`` and ``dtype`` read, then ``transformer(x_list, timestep,
cap_list, joint_attention_kwargs=..., return_dict=False)[0]``), with the forward signature and
return type of ``ZImageTransformer2DModel`` and its ``config`` keys, backed by ONE open
``nxhpc.dit.denoiser.Denoiser`` (weights mapped once, one worker pool and arena reused for every
call). The user keeps diffusers for the text encoder, scheduler and VAE.

Must not: put torch in the hot path (tensors are converted to float32 numpy at the boundary,
the denoiser computes, the result goes back as a tensor on the input's device and dtype), or
import torch / diffusers at module import (they are the optional extra ``nxhpc[diffusers]``;
without them constructing the class raises ImportError naming the extra).

It is deliberately NOT a ``torch.nn.Module``: ``DiffusionPipeline.to()``, ``.device``,
``.dtype`` and ``enable_model_cpu_offload`` act only on ``nn.Module`` components, so
``pipe.to("cpu")`` / ``pipe.to(torch.bfloat16)`` leave it alone (it always computes in float32
on the CPU, and returns outputs on the latents' device), and no accelerate hook is attached to
it. ``NxhpcZImageTransformer.to()`` itself accepts only the CPU and float32 and says why
otherwise.

Batches: items are run one at a time at batch 1 (caption lengths differ under CFG: prompt and
negative prompt); diffusers pads the batch and masks the pad keys, which gives each item the
same result as batch 1 (the ``ReferenceTransformer`` tests show it).
"""
from __future__ import annotations

import numbers
import os
import sys
import warnings
from typing import Any

import numpy as np

__all__ = ["EXTRA_HINT", "NxhpcZImageTransformer"]

EXTRA_HINT = "pip install 'nxhpc[diffusers]'"


def _require():
    """``(torch, Transformer2DModelOutput, FrozenDict)``, or ImportError naming the extra."""
    try:
        import torch
        from diffusers.configuration_utils import FrozenDict
        from diffusers.models.modeling_outputs import Transformer2DModelOutput
    except ImportError as e:
        raise ImportError(f"nxhpc.diffusers needs torch and diffusers (the optional extra "
                          f"'diffusers'): {EXTRA_HINT} ({e})") from None
    return torch, Transformer2DModelOutput, FrozenDict


class NxhpcZImageTransformer:
    """``ZImageTransformer2DModel``'s place in ``ZImagePipeline``, running nxhpc.

    ``NxhpcZImageTransformer(denoiser)`` wraps an open ``Denoiser`` (it is closed with this
    object: :meth:`close` or ``with``); :meth:`from_gguf` opens one from a GGUF path, a model
    directory or a built-in id. Attributes: ``in_channels`` / ``out_channels``, ``dtype``
    (``torch.float32``), ``device`` (``cpu``), ``config`` (a diffusers ``FrozenDict`` with
    ``ZImageTransformer2DModel``'s config keys), ``denoiser``, ``last_timings``.
    """

    _nxhpc_drop_in = True

    def __init__(self, denoiser) -> None:
        torch, _, FrozenDict = _require()
        if isinstance(denoiser, (str, bytes, os.PathLike)) or not hasattr(denoiser, "config") \
                or not callable(getattr(denoiser, "forward", None)):
            hint = (" (for a GGUF path, model directory or built-in id use "
                    "NxhpcZImageTransformer.from_gguf)"
                    if isinstance(denoiser, (str, bytes, os.PathLike)) else "")
            raise TypeError(f"NxhpcZImageTransformer: expected an open nxhpc Denoiser "
                            f"(nxhpc.load_denoiser(...), or an object with its config and "
                            f"forward), got {type(denoiser).__name__}{hint}")
        if getattr(denoiser, "closed", False):
            raise ValueError("NxhpcZImageTransformer: the Denoiser given is closed")
        cfg = denoiser.config
        self.denoiser = denoiser
        self.in_channels = int(cfg.in_channels)
        self.out_channels = int(cfg.in_channels)
        self.dtype = torch.float32
        self.device = torch.device("cpu")
        self.all_patch_size = (int(cfg.patch),)
        self.all_f_patch_size = (1,)
        self.dim = int(cfg.dim)
        self.n_heads = int(cfg.n_heads)
        self.config = FrozenDict(
            all_patch_size=self.all_patch_size, all_f_patch_size=self.all_f_patch_size,
            in_channels=self.in_channels, dim=self.dim, n_layers=int(cfg.n_layers),
            n_refiner_layers=int(cfg.n_noise_refiner), n_heads=self.n_heads,
            n_kv_heads=int(cfg.n_kv_heads), norm_eps=float(cfg.norm_eps), qk_norm=True,
            cap_feat_dim=int(cfg.cap_dim), siglip_feat_dim=None,
            rope_theta=float(cfg.rope_theta), t_scale=float(cfg.t_scale),
            axes_dims=[int(a) for a in cfg.axes_dims], axes_lens=[1536, 512, 512],
            _class_name="ZImageTransformer2DModel")
        self.training = False

    @classmethod
    def from_gguf(cls, path_or_id: str | os.PathLike, workers: int | None = None, *,
                  models_dir: str | os.PathLike | None = None, **options: Any
                  ) -> NxhpcZImageTransformer:
        """Open the denoiser (``nxhpc.models.open_denoiser``) from a GGUF file, a model
        directory or a built-in id (e.g. ``tiny-dit``); ``workers`` default: the usable CPUs.
        ``options`` go to the Denoiser as they are: ``precision`` (``"f32"`` default, ``"bf16"``,
        ``"q8"``), ``q8_float_weights``, ``reuse_caption``, ``stage_timeout``, ``spawn``,
        ``norm_eps``."""
        _require()
        from nxhpc.models.registry import open_denoiser
        den = open_denoiser(os.fspath(path_or_id), workers=workers, models_dir=models_dir,
                            **options)
        try:
            return cls(den)
        except BaseException:
            den.close()
            raise

    # -- lifetime
    def close(self) -> None:
        """Close the denoiser (stops its workers, releases its shared memory). Idempotent."""
        den, self.denoiser = self.denoiser, None
        if den is not None:
            den.close()

    def __enter__(self) -> NxhpcZImageTransformer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        c = self.config
        closed = self.denoiser is None or getattr(self.denoiser, "closed", False)
        return (f"NxhpcZImageTransformer(dim={c.dim}, n_layers={c.n_layers}, "
                f"cap_feat_dim={c.cap_feat_dim}, {'closed' if closed else 'open'})")

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError("NxhpcZImageTransformer cannot be pickled or copied: its Denoiser holds "
                        "this process's mapped file, shared memory and workers; open one in "
                        "each process instead (NxhpcZImageTransformer.from_gguf)")

    # -- the nn.Module-like calls code may make on a transformer
    def to(self, *args, **kwargs) -> NxhpcZImageTransformer:
        """Accepts only the CPU and float32 (nxhpc computes there): as devices, dtypes or a
        tensor's (``to(tensor)``, as ``torch.nn.Module.to``); returns self."""
        torch, _, _ = _require()
        kwargs.pop("non_blocking", None)
        given = list(args) + [kwargs.pop("device", None), kwargs.pop("dtype", None)]
        for a in list(given):
            if isinstance(a, torch.Tensor):          # Module.to(tensor): its dtype and device
                given += [a.dtype, a.device]
        for a in given:
            if a is None or isinstance(a, torch.Tensor):
                continue
            if isinstance(a, torch.dtype):
                if a != torch.float32:
                    raise ValueError(f"NxhpcZImageTransformer.to({a}): nxhpc computes in "
                                     f"float32 from the GGUF's stored weights; only "
                                     f"torch.float32 is accepted")
                continue
            dev = torch.device(a)
            if dev.type != "cpu":
                raise ValueError(f"NxhpcZImageTransformer.to({a}): nxhpc runs on the CPU "
                                 f"only; keep the transformer on 'cpu' (the pipeline's other "
                                 f"components may live elsewhere: outputs follow the "
                                 f"latents' device)")
        if kwargs:
            raise TypeError(f"NxhpcZImageTransformer.to: unsupported arguments {sorted(kwargs)}")
        return self

    def cpu(self) -> NxhpcZImageTransformer:
        return self

    def eval(self) -> NxhpcZImageTransformer:
        return self

    def requires_grad_(self, requires_grad: bool = True) -> NxhpcZImageTransformer:
        if requires_grad:
            raise ValueError("NxhpcZImageTransformer: inference only, no gradients")
        return self

    @property
    def last_timings(self) -> dict:
        return dict(getattr(self.denoiser, "last_timings", None) or {})

    # -- the call
    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, x, t, cap_feats, return_dict: bool = True,
                controlnet_block_samples: Any = None, siglip_feats: Any = None,
                image_noise_mask: Any = None, patch_size: int = 2, f_patch_size: int = 1,
                joint_attention_kwargs: dict | None = None):
        """``ZImageTransformer2DModel.forward``: ``x`` a list of B ``[C, 1, H, W]`` tensors,
        ``t`` a ``[B]`` tensor (or a number) of t = 1 - sigma, ``cap_feats`` a list of B
        ``[L_i, cap_dim]`` tensors -> ``Transformer2DModelOutput(sample=[B x [C, 1, H, W]])``,
        or ``(list,)`` with ``return_dict=False``; the raw output, not negated. Controlnet and
        SigLIP/omni inputs are not supported (NotImplementedError; an empty controlnet dict is
        nothing, as in diffusers). ``joint_attention_kwargs['scale']`` scales LoRA layers, of
        which the drop-in has none: a warning, as diffusers warns without the PEFT backend."""
        torch, Output, _ = _require()
        den = self.denoiser        # once: a close() from another thread mid-batch sets it to
        if den is None:            # None; the Denoiser itself then says it was closed
            raise RuntimeError("NxhpcZImageTransformer: closed")
        if isinstance(controlnet_block_samples, dict) and not controlnet_block_samples:
            controlnet_block_samples = None           # no block samples: diffusers adds none
        unsupported = [n for n, v in (("controlnet_block_samples", controlnet_block_samples),
                                      ("siglip_feats", siglip_feats),
                                      ("image_noise_mask", image_noise_mask)) if v is not None]
        if unsupported:
            raise NotImplementedError(f"NxhpcZImageTransformer: {', '.join(unsupported)} not "
                                      f"supported (plain text-to-image only)")
        if patch_size not in self.all_patch_size or f_patch_size != 1:
            raise ValueError(f"NxhpcZImageTransformer: patch_size {patch_size} / f_patch_size "
                             f"{f_patch_size}: the model has patch {self.all_patch_size[0]}, "
                             f"f_patch 1")
        scale = (joint_attention_kwargs or {}).get("scale", 1.0)
        if scale != 1.0:
            via_call = sys._getframe(1).f_code is NxhpcZImageTransformer.__call__.__code__
            warnings.warn(f"NxhpcZImageTransformer: joint_attention_kwargs['scale'] = {scale!r} "
                          f"has no effect: it scales LoRA layers, and the GGUF drop-in has none "
                          f"(diffusers ignores it too without them)",
                          stacklevel=3 if via_call else 2)     # the caller's line, not ours
        xs, caps = list(x), list(cap_feats)
        if xs and isinstance(xs[0], (list, tuple)):
            raise NotImplementedError("NxhpcZImageTransformer: omni mode (nested lists) is not "
                                      "supported")
        B = len(xs)
        ts = [v for v in _timesteps(torch, t)]
        if len(ts) == 1:
            ts = ts * B
        if B == 0 or not (len(caps) == len(ts) == B):
            raise ValueError(f"NxhpcZImageTransformer: batch sizes differ or are empty: {B} "
                             f"latents, {len(ts)} timesteps, {len(caps)} captions")
        bad = [(i, v) for i, v in enumerate(ts) if not 0.0 <= v <= 1.0]   # NaN too
        if bad:
            i, v = bad[0]
            raise ValueError(f"NxhpcZImageTransformer: timestep item {i} is t = {v:g}, i.e. "
                             f"sigma = 1 - t = {1 - v:g}: the model takes sigma in [0, 1] (a "
                             f"pipeline's sigmas= / timesteps above 1 or below 0 do not fit)")
        out = []
        for i, (lat, ti, cap) in enumerate(zip(xs, ts, caps)):
            if not torch.is_tensor(lat) or lat.ndim != 4 or lat.shape[1] != 1:
                shape = tuple(lat.shape) if torch.is_tensor(lat) else type(lat).__name__
                raise ValueError(f"NxhpcZImageTransformer: latents item {i} is {shape}, "
                                 f"expected a [C, 1, H, W] tensor")
            a = _as_numpy(torch, lat, f"latents item {i}")
            c = _as_numpy(torch, cap, f"cap_feats item {i}")
            r = den.forward(a, float(ti), c)
            out.append(torch.from_numpy(np.asarray(r, dtype=np.float32).reshape(a.shape))
                       .to(device=lat.device, dtype=lat.dtype))
        return Output(sample=out) if return_dict else (out,)


def _as_numpy(torch, v, what: str) -> np.ndarray:
    """A floating-point tensor as a C-contiguous numpy array for the denoiser, checked before
    any conversion: float32 and float64 as they are (the denoiser refuses float64 values beyond
    float32's range), float16 / bfloat16 widened to float32 (exact); anything else -- integers,
    bool, complex, not a tensor -- ValueError (a cast would run on truncated values)."""
    if not torch.is_tensor(v):
        raise ValueError(f"NxhpcZImageTransformer: {what} is a {type(v).__name__}, expected a "
                         f"floating-point tensor")
    if not v.is_floating_point():
        raise ValueError(f"NxhpcZImageTransformer: {what} has dtype {v.dtype}, expected a "
                         f"floating-point tensor (float32, bfloat16, float16, float64)")
    v = v.detach().to("cpu")
    if v.dtype not in (torch.float32, torch.float64):
        v = v.to(torch.float32)
    a = np.ascontiguousarray(v.numpy())
    with np.errstate(over="ignore"):
        over = int(np.count_nonzero(np.isfinite(a) & ~np.isfinite(a.astype(np.float32))))
    if over:
        raise ValueError(f"NxhpcZImageTransformer: {what} has {over} values beyond float32's "
                         f"range (|x| > 3.4e38): nxhpc computes in float32")
    return a


def _timesteps(torch, t) -> list[float]:
    """``t`` (a real number, or a real tensor / array of one or B values) as floats; ValueError
    for a bool, a complex or a non-number (``True`` is not the timestep 1.0)."""
    if isinstance(t, (bool, np.bool_)):
        raise ValueError(f"NxhpcZImageTransformer: timestep {t!r} is a bool, expected t = "
                         f"1 - sigma as a number or a floating-point tensor")
    if isinstance(t, numbers.Real):
        return [float(t)]
    tv = torch.as_tensor(t).detach()
    if tv.dtype == torch.bool or tv.is_complex():
        raise ValueError(f"NxhpcZImageTransformer: timestep has dtype {tv.dtype}, expected "
                         f"real numbers t = 1 - sigma")
    return tv.reshape(-1).to("cpu", torch.float64).tolist()
