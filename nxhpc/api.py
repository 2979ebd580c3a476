"""Library entry points for downstream scripts: ``load_model``, ``load_denoiser``,
``load_text_encoder``, ``load_vae`` and ``generate_image`` (re-exported as
``nxhpc.load_model`` / ``nxhpc.load_denoiser`` / ``nxhpc.load_text_encoder`` /
``nxhpc.load_vae`` / ``nxhpc.generate_image``).

The loaders delegate to ``nxhpc.models.registry``'s ``open_*``; ``generate_image`` runs the
three models in the order ``python -m nxhpc.generate`` does. ``load_model``'s returned
model's ``block(i)`` is an ``nxhpc.dit.block.Block`` whose ``forward`` returns ``(output, timings)``.
Several blocks of different kinds and token counts in one call (a denoiser: refiners on image and
caption rows, the main layers on the joint rows) run on one ``nxhpc.dit.plan.Engine``: bind the
weights (``model.layer_weights(i, prefix=...)``), describe each kind as a ``BlockPlan``, then
``Engine([(plan, T), ...], weights, buffers=...)`` forks one pool for all of them.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:                     # the return types, named without importing them at run time
    import numpy as np

    from nxhpc.dit.denoiser import Denoiser
    from nxhpc.models.model import Model
    from nxhpc.qwen3.encoder import TextEncoder
    from nxhpc.vae.model import VaeDecoder

__all__ = ["load_model", "load_denoiser", "load_text_encoder", "load_vae", "generate_image",
           "TINY", "TINY_PX", "DEFAULT_PX"]

#: The built-in components used when no model argument is given (random weights).
TINY = {"model": "tiny-dit", "text_encoder": "tiny-te", "vae": "tiny-vae"}
#: The default image side of the tiny fallback (the real models' default is 1024).
TINY_PX = 64
DEFAULT_PX = 1024


def load_model(id_or_path: str | os.PathLike, models_dir: str | os.PathLike | None = None,
               gguf_path: str | os.PathLike | None = None) -> Model:
    """Open a model: a built-in id (generated on first use), ``$NXHPC_MODELS/<id>``, or a path.

    Returns an ``nxhpc.models.Model`` (use it as a context manager or call ``close()``). Raises
    ``ModelNotFoundError`` / ``ModelFileError`` / ``MissingTensorError`` (all ``ModelError``).
    Example::

        model = nxhpc.load_model("tiny")
        out, timings = model.block(0).forward(model.blk_in(0), model.t_emb(), model.pe(),
                                              mask=model.mask(), workers=2)
    """
    from nxhpc.models import open_model
    return open_model(id_or_path, models_dir=models_dir, gguf_path=gguf_path)


def load_denoiser(model: str | os.PathLike, *, workers: int | None = None,
                  models_dir: str | os.PathLike | None = None,
                  gguf_path: str | os.PathLike | None = None, **options: Any) -> Denoiser:
    """Open the whole Z-Image transformer: a ``.gguf`` path (ComfyUI-GGUF or
    stable-diffusion.cpp layout), a model directory, or a built-in id (``tiny-dit``,
    ``zimage-dit-2l``). ``workers``: processes per call (default: the usable CPUs).
    ``options`` (each as ``Denoiser`` documents it): ``precision`` (``"f32"`` default,
    ``"bf16"``, ``"q8"``; ``nxhpc.nn.linear.fastest_precision()`` names the fastest here),
    ``q8_float_weights`` (``"int8"`` / ``"bf16"``), ``reuse_caption``, ``spawn``,
    ``stage_timeout`` (seconds a parallel stage may take; None: no limit), ``norm_eps``.
    Returns an ``nxhpc.dit.denoiser.Denoiser`` (context manager). Example::

        with nxhpc.load_denoiser("z_image_turbo-Q8_0.gguf", workers=8) as den:
            r = den.forward(latents, t, cap_feats)   # [16, H, W], t = 1 - sigma, [L, 2560]
            print(den.last_timings)                  # us_embed ... us_total
    """
    from nxhpc.models.registry import open_denoiser
    return open_denoiser(model, workers=workers, models_dir=models_dir, gguf_path=gguf_path,
                         **options)


def load_text_encoder(path_or_id: str | os.PathLike, workers: int | None = None,
                      precision: str = "f32", *, models_dir: str | os.PathLike | None = None,
                      **options: Any) -> TextEncoder:
    """Open Z-Image's text encoder (Qwen3): a llama.cpp-layout ``.gguf`` path (Qwen3-4B in
    F16, BF16, Q8_0, Q6_K, Q5_K_M, Q4_K_M, Q3_K; IQ types are refused naming the type), a
    directory holding one, or a built-in id (``tiny-te``: generated on first use under
    ``models_dir`` / ``$NXHPC_MODELS``). Returns an ``nxhpc.qwen3.encoder.TextEncoder``
    (context manager): ``tokenize(prompt)`` -> ids (chat template, first 512),
    ``encode(prompt)`` -> float32 ``[L, dim]`` caption features, ``config``, ``close()``.
    ``options``: ``spawn``, ``stage_timeout``, ``max_tokens``, ``check_values``,
    ``q8_float_weights``. Example::

        with nxhpc.load_text_encoder("Qwen3-4B-Q8_0.gguf", workers=8) as te:
            cap_feats = te.encode("a red fox in the snow")      # [L, 2560] float32
        with nxhpc.load_denoiser("z_image_turbo-Q8_0.gguf", workers=8) as den:
            r = den.forward(latents, t, cap_feats)
    """
    from nxhpc.models.registry import open_text_encoder
    return open_text_encoder(path_or_id, workers=workers, precision=precision,
                             models_dir=models_dir, **options)


def load_vae(path_or_id: str | os.PathLike, *, workers: int | None = None,
             precision: str = "f32", models_dir: str | os.PathLike | None = None,
             stage_timeout: float | None = None) -> VaeDecoder:
    """Open the FLUX autoencoder's decoder: a BFL/ComfyUI ``ae.safetensors`` file, a diffusers
    VAE directory (``config.json`` + ``diffusion_pytorch_model.safetensors``, or a pipeline
    directory holding ``vae/``), float32/float16/bfloat16, or a built-in id (``tiny-vae``:
    random weights, generated on first use under ``models_dir`` / ``$NXHPC_MODELS``).
    ``precision``: ``"f32"`` (default, exact weights) or ``"bf16"`` (activations and weights
    rounded to bfloat16 in every convolution; there is no ``q8`` convolution).
    ``stage_timeout``: seconds one parallel step may take before the workers are killed and
    the decode fails (None: no limit). Returns an ``nxhpc.vae.model.VaeDecoder`` (context
    manager). Example::

        with nxhpc.load_vae("ae.safetensors", workers=8) as vae:
            x = vae.decode(latents)                  # [16, h, w] -> float32 [3, 8h, 8w]
            nxhpc.vae.write_png("out.png", nxhpc.vae.to_uint8(x))
    """
    from nxhpc.models.registry import open_vae
    return open_vae(path_or_id, workers=workers, precision=precision, models_dir=models_dir,
                    stage_timeout=stage_timeout)


def generate_image(prompt: str, *, model: str | os.PathLike | None = None,
                   text_encoder: str | os.PathLike | None = None,
                   vae: str | os.PathLike | None = None, height: int | None = None,
                   width: int | None = None, seed: int | None = None, noise: Any = None,
                   steps: int = 8, shift: float = 3.0, guidance_scale: float = 0.0,
                   negative_prompt: str | None = None, precision: str = "f32",
                   q8_float_weights: str | None = None, workers: int | None = None,
                   models_dir: str | os.PathLike | None = None,
                   on_step: Callable[[int, int, float], None] | None = None,
                   stage_timeout: float | None = None) -> np.ndarray:
    """A prompt to a picture, as ``python -m nxhpc.generate`` makes it (the same bits), without
    torch: uint8 ``[height, width, 3]`` (``PIL.Image.fromarray`` takes it;
    ``nxhpc.vae.write_png(path, pixels)`` writes it).

    ``model``, ``text_encoder``, ``vae``: the Z-Image transformer (GGUF path, directory or
    id), the Qwen3 text encoder (llama.cpp GGUF, directory or id) and the FLUX autoencoder
    (``ae.safetensors``, a diffusers VAE directory or id) -- all three, or none for the
    built-in tiny components (random weights: a noise picture, 64x64 by default).
    ``height``/``width``: both or neither, multiples of 16 (default 1024). ``seed`` (None:
    0) draws the noise as the CLI does, or ``noise`` gives it (``[16, height/8, width/8]``).
    ``steps``, ``shift``: the Turbo schedule; ``guidance_scale`` G > 0 with an optional
    ``negative_prompt`` turns on classifier-free guidance as diffusers' ``ZImagePipeline``
    does (two transformer calls a step). ``precision``: ``f32`` (exact), ``bf16`` or ``q8``
    (under ``q8`` the decoder runs ``nxhpc.nn.conv.decoder_precision("q8")``: ``bf16`` where
    that is faster, else ``f32``); ``q8_float_weights`` (``"int8"`` default, or
    ``"bf16"``) as for ``load_denoiser`` and ``load_text_encoder``. ``workers``: processes per
    model (default: the usable CPUs). ``on_step(i, n, seconds)`` after each step.
    ``stage_timeout``: seconds one parallel stage of any model may take before its workers are
    killed and the call fails with ``WorkerError`` (a hung worker; default None: no limit).

    Every argument is checked, and every model found, before any model is opened; the
    decoder's and the transformer's memory before the encoding. Each model is opened once and
    released before the next one's buffers are built (the text encoder, then the transformer,
    then the decoder), as the CLI does. For many pictures, ``python -m nxhpc.generate
    --prompts/--seeds`` opens each model once for all.
    Raises TypeError / ValueError for bad arguments (``SampleInputError`` for noise or
    features that do not fit the model), :class:`ModelError` subclasses for model files,
    ``NonFiniteOutputError`` when the latents or pixels leave float32's range, and
    ``ShmSpaceError`` when the shared memory cannot hold a model's buffers. Example::

        pixels = nxhpc.generate_image("a red fox in the snow", model="z_image_turbo-Q8_0.gguf",
                                      text_encoder="Qwen3-4B-Q8_0.gguf", vae="ae.safetensors",
                                      seed=42, precision="q8")
        PIL.Image.fromarray(pixels).save("fox.png")
    """
    import numpy as np

    from nxhpc.dit.sampler import (MAX_PIXELS, check_guidance_scale, check_noise, initial_noise,
                                   latent_shape, sample, turbo_sigmas)
    from nxhpc.formats.gguf_io import ModelFileError
    from nxhpc.models.registry import open_denoiser, open_vae, resolve_model, resolve_vae
    from nxhpc.nn.conv import decoder_precision
    from nxhpc.nn.linear import check_precision, check_q8_float_weights
    from nxhpc.qwen3.tokenizer import check_text
    from nxhpc.runtime.checks import check_workers
    from nxhpc.runtime.workers import check_timeout
    from nxhpc.vae.image import to_uint8

    # every check that needs no model first
    check_text(prompt, "prompt")
    g = check_guidance_scale(guidance_scale)
    if negative_prompt is not None:
        check_text(negative_prompt, "negative_prompt")
        if g == 0:
            raise ValueError("negative_prompt needs guidance_scale > 0 (guidance is off)")
    names = {"model": model, "text_encoder": text_encoder, "vae": vae}
    tiny = all(v is None for v in names.values())
    if tiny:
        names = dict(TINY)
    elif any(v is None for v in names.values()):
        missing = ", ".join(k for k, v in names.items() if v is None)
        raise ValueError(f"give all of model, text_encoder and vae, or none (the built-in tiny "
                         f"components); missing: {missing}")
    if (height is None) != (width is None):
        raise ValueError("give both height and width (or neither)")
    if noise is not None and seed is not None:
        raise ValueError("give seed or noise, not both (a seed draws the noise)")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))
                             or seed < 0):
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    turbo_sigmas(steps, shift)
    if height is not None:           # FLUX's 8x and the 2x2 patch; the CLI's size limit
        latent_shape(height, width)
        if max(height, width) > MAX_PIXELS:
            raise ValueError(f"height/width must be at most {MAX_PIXELS} pixels, got "
                             f"{height}x{width}")
    if on_step is not None and not callable(on_step):
        raise TypeError(f"on_step must be callable (i, n, seconds), got {on_step!r}")
    check_precision(precision)
    if q8_float_weights is not None:
        check_q8_float_weights(q8_float_weights)
    workers = check_workers(workers)      # None: the usable CPUs; at most max_workers()
    stage_timeout = check_timeout(stage_timeout)
    # every model found (a built-in generated) before any is opened
    resolve_model(names["model"], models_dir)
    resolve_model(names["text_encoder"], models_dir)
    resolve_vae(names["vae"], models_dir)

    import nxhpc
    kw: dict[str, Any] = {"workers": workers, "models_dir": models_dir,
                          "stage_timeout": stage_timeout}
    lowp = {} if q8_float_weights is None else {"q8_float_weights": q8_float_weights}
    with open_denoiser(names["model"], precision=precision, **lowp, **kw) as den, \
            open_vae(names["vae"], precision=decoder_precision(precision),
                     **kw) as dec:
        cfg, up = den.config, dec.config.upscale
        if dec.config.latent_channels != cfg.in_channels:
            raise ModelFileError(f"vae {names['vae']}: its decoder reads "
                                 f"{dec.config.latent_channels} latent channels but the "
                                 f"transformer makes {cfg.in_channels}")
        if noise is not None:
            shape = None if height is None else latent_shape(height, width, cfg.in_channels,
                                                             up, cfg.patch)
            x0 = check_noise(noise, cfg, shape)
        else:
            px = TINY_PX if tiny else DEFAULT_PX
            shape = latent_shape(height or px, width or px, cfg.in_channels, up, cfg.patch)
            x0 = initial_noise(0 if seed is None else seed, shape)
        dec.check_room(x0.shape[1], x0.shape[2])     # before the encoding and the steps,
        den.check_room(x0.shape[1], x0.shape[2])     # as the CLI does
        with nxhpc.load_text_encoder(names["text_encoder"], precision=precision, **lowp,
                                     **kw) as te:
            if te.config.dim != cfg.cap_dim:
                raise ModelFileError(f"text_encoder {names['text_encoder']}: its features are "
                                     f"{te.config.dim} wide but the transformer's cap_dim is "
                                     f"{cfg.cap_dim}: these models do not go together")
            cap = te.encode(prompt)
            neg = te.encode(negative_prompt or "") if g > 0 else None
        latents = sample(den, cap, x0, steps=steps, shift=shift, on_step=on_step,
                         guidance_scale=g, negative_feats=neg)
        den.close()                  # the transformer's buffers go before the decoder's
        return to_uint8(dec.decode(latents))
