"""Library entry points for downstream scripts: ``load_model``, ``load_denoiser``,
``load_text_encoder`` and ``load_vae`` (re-exported as ``nxhpc.load_model`` /
``nxhpc.load_denoiser`` / ``nxhpc.load_text_encoder`` / ``nxhpc.load_vae``).

Owns nothing but the public spelling: it delegates to ``nxhpc.models.open_model``; the returned
model's ``block(i)`` is an ``nxhpc.dit.block.Block`` whose ``forward`` returns ``(output, timings)``.
Several blocks of different kinds and token counts in one call (a denoiser: refiners on image and
caption rows, the main layers on the joint rows) run on one ``nxhpc.dit.plan.Engine``: bind the
weights (``model.layer_weights(i, prefix=...)``), describe each kind as a ``BlockPlan``, then
``Engine([(plan, T), ...], weights, buffers=...)`` forks one pool for all of them.
"""
from __future__ import annotations

import os

__all__ = ["load_model", "load_denoiser", "load_text_encoder", "load_vae"]


def load_model(id_or_path: str | os.PathLike, models_dir: str | os.PathLike | None = None,
               gguf_path: str | os.PathLike | None = None):
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
                  gguf_path: str | os.PathLike | None = None, **options):
    """Open the whole Z-Image transformer: a ``.gguf`` path (ComfyUI-GGUF or
    stable-diffusion.cpp layout), a model directory, or a built-in id (``tiny-dit``,
    ``zimage-dit-2l``). Returns an ``nxhpc.dit.denoiser.Denoiser`` (context manager).
    Example::

        with nxhpc.load_denoiser("z_image_turbo-Q8_0.gguf", workers=8) as den:
            r = den.forward(latents, t, cap_feats)   # [16, H, W], t = 1 - sigma, [L, 2560]
            print(den.last_timings)                  # us_embed ... us_total
    """
    from nxhpc.models.registry import open_denoiser
    return open_denoiser(model, workers=workers, models_dir=models_dir, gguf_path=gguf_path,
                         **options)


def load_text_encoder(path_or_id: str | os.PathLike, workers: int | None = None,
                      precision: str = "f32", *, models_dir: str | os.PathLike | None = None,
                      **options):
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
             precision: str = "f32", models_dir: str | os.PathLike | None = None):
    """Open the FLUX autoencoder's decoder: a BFL/ComfyUI ``ae.safetensors`` file, a diffusers
    VAE directory (``config.json`` + ``diffusion_pytorch_model.safetensors``, or a pipeline
    directory holding ``vae/``), float32/float16/bfloat16, or a built-in id (``tiny-vae``:
    random weights, generated on first use under ``models_dir`` / ``$NXHPC_MODELS``). Returns
    an ``nxhpc.vae.model.VaeDecoder`` (context manager). Example::

        with nxhpc.load_vae("ae.safetensors", workers=8) as vae:
            x = vae.decode(latents)                  # [16, h, w] -> float32 [3, 8h, 8w]
            nxhpc.vae.write_png("out.png", nxhpc.vae.to_uint8(x))
    """
    from nxhpc.models.registry import open_vae
    return open_vae(path_or_id, workers=workers, precision=precision, models_dir=models_dir)
