"""The whole Z-Image denoiser's config: re-exported from the one authority, ``nxhpc.dit.config``.

Owns nothing: :class:`DenoiserConfig`, :func:`infer_denoiser_config` and the denoiser's tensor
tables were folded into :mod:`nxhpc.dit.config` (next to :class:`~nxhpc.dit.config.BlockConfig`,
whose tensor table names the block tensors of both). Existing imports keep working.
Must not: define anything (a second definition would be a second authority).
"""
from __future__ import annotations

from nxhpc.dit.config import (ADALN_SUFFIXES, BLOCK_SUFFIXES, GGML_TYPE_NAMES, GROUPS,
                              OPTIONAL_TENSORS, PREFIX, DenoiserConfig, DenoiserConfigError,
                              block_tensor_names, infer_denoiser_config, strip_prefix)

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
