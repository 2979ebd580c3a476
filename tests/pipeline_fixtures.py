"""A tiny random diffusers ``ZImagePipeline`` built fully offline, for end-to-end tests.

Owns the construction of every pipeline part without a download: a byte-level tokenizer built
with the ``tokenizers`` package (every UTF-8 byte is a token, Qwen's special tokens, a Qwen3-
style chat template so ``apply_chat_template(..., enable_thinking=True)`` works), a small
random Qwen3 text encoder (``transformers.Qwen3Model``), a tiny random ``AutoencoderKL`` with
the FLUX-VAE config keys the pipeline reads (16 latent channels, 8x downsampling,
``scaling_factor`` 0.3611, ``shift_factor`` 0.1159), the Turbo scheduler
(``FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=False)``), and a random
``ZImageTransformer2DModel`` (``nxhpc.dit.oracle.random_zimage_model``) or any drop-in
transformer; and :class:`ReferenceTransformer`, the minimal drop-in (the exact surface the
pipeline uses), running the float64 reference. Test tooling only: nothing here is imported by
the package.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from nxhpc.dit.config import DenoiserConfig

__all__ = [
    "CHAT_TEMPLATE",
    "PIPE_TEXT_DIM",
    "ReferenceTransformer",
    "TinyPipeline",
    "make_scheduler",
    "make_text_encoder",
    "make_tiny_pipeline",
    "make_tokenizer",
    "make_vae",
    "pipeline_config",
    "with_transformer",
]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\n\n</think>\n\n' }}{% endif %}{% endif %}")
"""Qwen3's chat layout (user turn, then the assistant header; an empty think block only when
thinking is disabled — the Z-Image pipeline passes ``enable_thinking=True``)."""

PIPE_TEXT_DIM = 128
"""Hidden size of the tiny text encoder = the transformer's cap_dim in the pipeline."""

_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")


def pipeline_config(**overrides) -> DenoiserConfig:
    """The transformer config used with the tiny pipeline: the structure-keeping small config
    of ``docs/denoiser.md`` (D=384, 6 heads x 64, 2 layers, 2+2 refiners) with cap_dim =
    :data:`PIPE_TEXT_DIM`."""
    kw = dict(dim=384, n_heads=6, n_kv_heads=6, head_dim=64, ffn_dim=1024, n_layers=2,
              n_noise_refiner=2, n_context_refiner=2, in_channels=16, patch=2,
              cap_dim=PIPE_TEXT_DIM)
    kw.update(overrides)
    return DenoiserConfig(**kw)


def make_tokenizer():
    """A ``PreTrainedTokenizerFast``: byte-level BPE without merges (261 tokens), pad
    ``<|endoftext|>``, right padding, :data:`CHAT_TEMPLATE`."""
    from tokenizers import Tokenizer, decoders, models
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(_SPECIALS))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>",
                                   eos_token="<|im_end|>", chat_template=CHAT_TEMPLATE,
                                   padding_side="right", model_max_length=512)


def make_text_encoder(vocab_size: int, seed: int = 0, hidden: int = PIPE_TEXT_DIM):
    """A random 3-layer ``Qwen3Model`` (hidden ``hidden``, 4 heads x 32, 2 kv heads) in eval
    mode, float32. The pipeline reads ``hidden_states[-2]``."""
    import torch
    from transformers import Qwen3Config, Qwen3Model
    cfg = Qwen3Config(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=hidden // 4, max_position_embeddings=512, rope_theta=10000.0,
                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    return Qwen3Model(cfg).eval()


def make_vae(seed: int = 0):
    """A tiny random ``AutoencoderKL`` shaped like the FLUX VAE where the pipeline looks:
    3 -> 16 latent channels, 4 blocks (``vae_scale_factor`` 8), scaling 0.3611, shift
    0.1159, no quant convs. Channels 16 per block, 1 layer per block."""
    import torch
    from diffusers import AutoencoderKL
    torch.manual_seed(seed)
    return AutoencoderKL(in_channels=3, out_channels=3, latent_channels=16,
                         down_block_types=("DownEncoderBlock2D",) * 4,
                         up_block_types=("UpDecoderBlock2D",) * 4,
                         block_out_channels=(16, 16, 16, 16), layers_per_block=1,
                         norm_num_groups=8, sample_size=64, scaling_factor=0.3611,
                         shift_factor=0.1159, use_quant_conv=False,
                         use_post_quant_conv=False).eval()


def make_scheduler():
    """Z-Image-Turbo's scheduler: flow-matching Euler, static shift 3.0."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0,
                                           use_dynamic_shifting=False)


@dataclass
class TinyPipeline:
    """The pipeline and what it was built from: ``weights`` are the transformer's canonical
    float64 weights (None when a transformer was supplied)."""
    pipe: Any
    cfg: DenoiserConfig
    transformer: Any
    weights: dict[str, np.ndarray] | None


def make_tiny_pipeline(transformer=None, seed: int = 0, cfg: DenoiserConfig | None = None,
                       ) -> TinyPipeline:
    """``ZImagePipeline`` with the tiny offline parts. ``transformer``: a drop-in to test
    (default: a random diffusers ``ZImageTransformer2DModel`` in float32, every parameter
    randomized, from ``seed``)."""
    import torch
    from diffusers import ZImagePipeline

    from nxhpc.dit.oracle import random_zimage_model

    cfg = pipeline_config() if cfg is None else cfg
    weights = None
    if transformer is None:
        transformer, weights = random_zimage_model(cfg, seed, dtype=torch.float32)
    tok = make_tokenizer()
    pipe = ZImagePipeline(scheduler=make_scheduler(), vae=make_vae(seed),
                          text_encoder=make_text_encoder(len(tok), seed, cfg.cap_dim),
                          tokenizer=tok, transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    return TinyPipeline(pipe, cfg, transformer, weights)


def with_transformer(tiny: TinyPipeline, transformer) -> Any:
    """A ``ZImagePipeline`` sharing ``tiny``'s text encoder, tokenizer and VAE (same weights,
    no rebuild), with a fresh scheduler and ``transformer``."""
    from diffusers import ZImagePipeline
    c = tiny.pipe.components
    pipe = ZImagePipeline(scheduler=make_scheduler(), vae=c["vae"],
                          text_encoder=c["text_encoder"], tokenizer=c["tokenizer"],
                          transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe


class ReferenceTransformer:
    """The smallest drop-in ``ZImagePipeline`` accepts, running ``nxhpc.dit.denoiser_ref``:
    exactly the surface the pipeline (diffusers 0.42) uses on its transformer, and nothing
    more. It is the template and the yardstick for ``nxhpc.diffusers``.

    - attributes read: ``in_channels`` (an attribute, not ``config.in_channels``) and
      ``dtype`` (latents are cast to it before each call);
    - called as ``transformer(x, timestep, cap_feats, joint_attention_kwargs=None,
      return_dict=False)``: ``x`` a list of B float ``[C, 1, H, W]`` tensors, ``timestep`` a
      float32 ``[B]`` tensor holding ``t = 1 - sigma``, ``cap_feats`` a list of B float32
      ``[L_i, cap_dim]`` tensors (L_i differ under CFG: B = 2, prompt then negative prompt);
    - returns ``(list of B [C, 1, H, W] tensors,)`` (``return_dict=True``: an object whose
      ``.sample`` is that list), raw output, NOT negated (the pipeline negates it).

    Items are run one at a time (batch 1 each): diffusers' padded batch with its attention
    mask gives the same result per item. It need not be a ``torch.nn.Module``.
    """

    def __init__(self, cfg: DenoiserConfig, weights: dict[str, np.ndarray]) -> None:
        import torch
        self.cfg = cfg
        self.weights = weights
        self.in_channels = cfg.in_channels
        self.dtype = torch.float32
        self.calls: list[tuple[int, tuple[float, ...]]] = []

    def __call__(self, x, timestep, cap_feats, *, return_dict: bool = True,
                 joint_attention_kwargs=None, **unused):
        import torch
        from diffusers.models.modeling_outputs import Transformer2DModelOutput

        from nxhpc.dit.denoiser_ref import denoiser_forward_f64
        if unused:
            raise TypeError(f"ReferenceTransformer: unsupported arguments {sorted(unused)}")
        ts = [float(v) for v in timestep.reshape(-1)]
        if not (len(x) == len(cap_feats) == len(ts)):
            raise ValueError(f"ReferenceTransformer: batch sizes differ: {len(x)} latents, "
                             f"{len(ts)} timesteps, {len(cap_feats)} captions")
        self.calls.append((len(x), tuple(ts)))
        out = []
        for lat, t, cap in zip(x, ts, cap_feats):
            if lat.ndim != 4 or lat.shape[1] != 1:
                raise ValueError(f"ReferenceTransformer: latents are {tuple(lat.shape)}, "
                                 f"expected [C, 1, H, W]")
            r = denoiser_forward_f64(lat[:, 0].double().numpy(), t, cap.double().numpy(),
                                     self.weights, self.cfg)
            out.append(torch.from_numpy(r.astype(np.float32))[:, None].to(lat.dtype))
        return Transformer2DModelOutput(sample=out) if return_dict else (out,)


@dataclass
class ZImageCase:
    """One random Z-Image written as a published layout, with its oracles: ``path`` the GGUF,
    ``file`` its read-back (``file.weights``: the exact dequantized float64 weights; the
    denoiser under test must reproduce a forward on these), ``diffusers`` a float64
    ``ZImageTransformer2DModel`` holding exactly those weights, ``original`` the unquantized
    canonical weights."""
    cfg: DenoiserConfig
    layout: str
    path: Any
    file: Any
    diffusers: Any
    original: dict[str, np.ndarray]


def zimage_file_case(directory, cfg: DenoiserConfig, layout: str = "comfyui-q8_0",
                     seed: int = 0, float64_sinusoid: bool = False) -> ZImageCase:
    """Random diffusers model (every parameter randomized) -> ``layout`` GGUF in
    ``directory`` -> read back -> float64 diffusers on the dequantized weights."""
    from pathlib import Path

    from nxhpc.dit.oracle import diffusers_zimage, random_zimage_model
    from nxhpc.models.zimage_files import read_zimage_gguf, write_zimage_gguf
    _, w = random_zimage_model(cfg, seed)
    path = write_zimage_gguf(Path(directory) / f"zimage-{layout}-{seed}.gguf", w, layout)
    f = read_zimage_gguf(path)
    return ZImageCase(cfg, layout, path, f,
                      diffusers_zimage(cfg, f.weights, float64_sinusoid=float64_sinusoid), w)
