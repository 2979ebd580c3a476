"""Tap a real diffusers Z-Image run into an nxhpc model directory.

Owns: hooking a ``diffusers`` ``ZImageTransformer2DModel`` for one forward call, recording each
main layer's input (``layers.{i}.blk_in``), its adaLN output (``layers.{i}.adaln_m``) and output
(``layers.{i}.ref_out``), the adaLN input (``t_emb``), the rotary table the run used (``pe``),
the key mask if any, and the model's final output (``final_out``); then writing ``model.gguf``
(the whole model in the original / ComfyUI naming, 2-D weights as Q8_0) and
``fixtures.safetensors``. Needs torch + diffusers (imported lazily); never runs the kernels.

The tapped ``ref_out`` comes from the model's own float weights. Grading a Q8_0 run against
it therefore includes the weights' quantization error (~1e-3 relative); call
:func:`snap_weights_to_q8_0` on the model first to make the run use exactly the weights the GGUF
stores, which leaves only float32-level differences.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from nxhpc.formats.gguf_io import Q8_0Tensor, dequantize_q8_0, quantize_q8_0, should_quantize
from nxhpc.models.modeldir import check_replaceable, write_model_dir
from nxhpc.dit.rope import pe_from_complex

__all__ = ["tap_zimage", "snap_weights_to_q8_0", "original_state_dict"]


def _np(t: Any) -> np.ndarray:
    return t.detach().to("cpu").float().contiguous().numpy()


def _original_tensors(model: Any) -> Iterator[tuple[str, Any]]:
    """``(original name, torch tensor)`` one at a time (no whole-model copy); see
    :func:`original_state_dict` for the renaming."""
    import torch
    sd = model.state_dict()                      # references to the parameters, not copies
    single = len(getattr(model, "all_x_embedder", {})) == 1
    for k, v in sd.items():
        if k.endswith(".attention.to_q.weight"):
            base = k[: -len("to_q.weight")]
            yield base + "qkv.weight", torch.cat(
                [v, sd[base + "to_k.weight"], sd[base + "to_v.weight"]])
            continue
        if k.endswith((".attention.to_k.weight", ".attention.to_v.weight")):
            continue
        n = (k.replace(".attention.to_out.0.", ".attention.out.")
             .replace(".attention.norm_q.", ".attention.q_norm.")
             .replace(".attention.norm_k.", ".attention.k_norm."))
        if single:
            for a, b in (("all_x_embedder.", "x_embedder."), ("all_final_layer.", "final_layer.")):
                if n.startswith(a):
                    n = b + n[len(a):].split(".", 1)[1]
        yield n, v


def original_state_dict(model: Any) -> dict[str, np.ndarray]:
    """The model's weights as float32 numpy under the original Z-Image checkpoint names.

    The inverse of diffusers' single-file conversion: ``to_q/to_k/to_v`` fused into
    ``attention.qkv.weight`` (rows q;k;v), ``to_out.0`` -> ``out``, ``norm_q/norm_k`` ->
    ``q_norm/k_norm``, ``all_x_embedder.2-1`` -> ``x_embedder``, ``all_final_layer.2-1`` ->
    ``final_layer`` (when the model has a single patch size). Holds the whole model in float32;
    :func:`tap_zimage` converts one tensor at a time instead.
    """
    return {n: _np(t) for n, t in _original_tensors(model)}


def snap_weights_to_q8_0(model: Any) -> int:
    """Round, in place, every 2-D weight the GGUF writer would quantize to its Q8_0 value.

    Afterwards the model computes with exactly the weights a tapped ``model.gguf`` holds.
    ``to_q/to_k/to_v`` are judged by the shape of the fused ``qkv`` the file stores (Q8_0
    blocks run along rows, so rounding each part equals rounding the fused matrix). Returns
    the number of tensors changed. Mutates ``model``.
    """
    import torch
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    n = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            shape = tuple(p.shape)
            if name.endswith((".attention.to_q.weight", ".attention.to_k.weight",
                              ".attention.to_v.weight")):
                base = name[: -len("to_q.weight")]
                shape = (sum(shapes[f"{base}to_{a}.weight"][0] for a in "qkv"), shape[1])
            if p.ndim == 2 and should_quantize(shape):
                w = _np(p)
                p.copy_(torch.from_numpy(dequantize_q8_0(quantize_q8_0(w, name))).to(p.dtype))
                n += 1
    return n


def tap_zimage(model: Any, x: Sequence[Any], t: Any, cap_feats: Sequence[Any],
               out_dir: str | os.PathLike, *, prefix: bool = True, include_weights: bool = False,
               overwrite: bool = False, progress: Callable[[str], None] | None = None,
               **forward_kwargs: Any) -> Path:
    """Run ``model(x, t, cap_feats, **forward_kwargs)`` once, record it, write ``out_dir``.

    ``model`` is a diffusers ``ZImageTransformer2DModel`` (any size, float32/bf16/f16 weights);
    ``x`` and ``cap_feats`` are lists of one tensor each (batch size 1). ``prefix`` writes
    tensor names with ``model.diffusion_model.``; ``include_weights`` also stores each layer's
    weights (their dequantized Q8_0 values) in the fixtures. ``overwrite`` replaces an
    existing model directory (only one holding ``model.gguf`` or ``fixtures.safetensors``),
    once the new one is complete. Weights are converted one tensor at a time, so beyond the
    model itself the peak memory is about the Q8_0 file's size. Returns the directory.
    """
    import torch
    say = progress or (lambda s: None)
    if not hasattr(model, "layers") or not hasattr(model, "config"):
        raise TypeError(f"tap_zimage: model must be a diffusers ZImageTransformer2DModel, "
                        f"got {type(model).__name__}")
    if len(x) != 1 or len(cap_feats) != 1:
        raise ValueError(f"tap_zimage: batch size must be 1, got {len(x)} images and "
                         f"{len(cap_feats)} captions")
    if isinstance(x[0], (list, tuple)):
        raise ValueError("tap_zimage: omni mode (nested image lists) is not supported")
    out_dir = Path(out_dir)
    check_replaceable(out_dir, overwrite)        # before the run, not after
    n_layers = len(model.layers)
    rec: dict[int, dict[str, np.ndarray | None]] = {i: {} for i in range(n_layers)}
    handles = []

    def pre(i: int) -> Callable:
        def hook(_m: Any, args: tuple, kwargs: dict) -> None:
            names = ("x", "attn_mask", "freqs_cis", "adaln_input", "noise_mask")
            got = dict(zip(names, args))
            got.update({k: v for k, v in kwargs.items() if k in names})
            if got.get("noise_mask") is not None:
                raise ValueError("tap_zimage: per-token (omni) modulation is not supported")
            r = rec[i]
            r["blk_in"] = _np(got["x"][0])
            m = got.get("attn_mask")
            r["mask"] = None if m is None else m[0].detach().cpu().numpy().astype(np.float32)
            f = got["freqs_cis"][0].detach().cpu()
            r["pe"] = pe_from_complex(f.to(torch.complex64).numpy()).astype(np.float32)
            r["t_emb"] = _np(got["adaln_input"][0])
        return hook

    def post(i: int) -> Callable:
        def hook(_m: Any, _args: tuple, output: Any) -> None:
            rec[i]["ref_out"] = _np(output[0])
        return hook

    def ada(i: int) -> Callable:
        def hook(_m: Any, _args: tuple, output: Any) -> None:
            rec[i]["adaln_m"] = _np(output[0])
        return hook

    try:
        for i, layer in enumerate(model.layers):
            handles.append(layer.register_forward_pre_hook(pre(i), with_kwargs=True))
            handles.append(layer.register_forward_hook(post(i)))
            handles.append(layer.adaLN_modulation.register_forward_hook(ada(i)))
        say(f"running the model ({n_layers} main layers)")
        with torch.no_grad():
            res = model(list(x), t, list(cap_feats), **forward_kwargs)
    finally:
        for h in handles:
            h.remove()
    sample = res[0] if isinstance(res, (tuple, list)) else res.sample
    final = _np(sample[0])

    fx: dict[str, np.ndarray] = {}
    r0 = rec[0]
    for i in range(n_layers):
        r = rec[i]
        missing = {"blk_in", "ref_out", "adaln_m", "pe", "t_emb"} - set(r)
        if missing:
            raise RuntimeError(f"tap_zimage: layer {i} was not observed ({sorted(missing)})")
        if not (np.array_equal(r["pe"], r0["pe"]) and np.array_equal(r["t_emb"], r0["t_emb"])):
            raise RuntimeError(f"tap_zimage: layer {i} saw a different pe/t_emb than layer 0")
        fx[f"layers.{i}.blk_in"] = r["blk_in"]
        fx[f"layers.{i}.adaln_m"] = r["adaln_m"]
        fx[f"layers.{i}.ref_out"] = r["ref_out"]
    fx["t_emb"] = r0["t_emb"]
    fx["pe"] = r0["pe"]
    if r0.get("mask") is not None:
        fx["mask"] = r0["mask"]
    fx["final_out"] = final

    say("converting weights to the original naming and Q8_0")
    stored: dict[str, Any] = {}
    for name, t in _original_tensors(model):     # one float32 tensor alive at a time
        w = _np(t)
        if should_quantize(w.shape):
            q = quantize_q8_0(w, name)
            stored[name] = Q8_0Tensor(q)
            if include_weights and name.startswith("layers."):
                fx[name] = dequantize_q8_0(q)
        else:
            stored[name] = w
            if include_weights and name.startswith("layers."):
                fx[name] = w
        del w, t
    cfg = model.config
    meta = {"general.name": "Z-Image (tapped by nxhpc)", "nxhpc.tapped": True,
            "nxhpc.norm_eps": float(cfg.norm_eps), "nxhpc.rope_theta": float(cfg.rope_theta),
            "nxhpc.axes_dims": [int(a) for a in cfg.axes_dims]}
    return write_model_dir(
        out_dir, stored, fx, prefix=prefix, gguf_metadata=meta, replace=overwrite,
        fixture_metadata={
            "norm_eps": repr(float(cfg.norm_eps)), "source": "tapped diffusers run",
            "config": json.dumps({k: (list(v) if isinstance(v, tuple) else v)
                                  for k, v in dict(cfg).items() if not k.startswith("_")},
                                 sort_keys=True, default=str)},
        progress=say)
