"""Models: ids and the registry, model directories, synthetic models, the Model facade, the CLI.

Layout: ``registry`` (built-in ids, the models root, :func:`open_model`), ``modeldir`` (file
names, all-or-nothing writing, locks), ``synthetic`` (:class:`SyntheticSpec`,
:func:`make_synthetic`), ``model`` (:class:`Model`), ``cli`` (``python -m nxhpc.models``),
``tap`` (recording a diffusers run; needs torch). The block config and tensor names live in
``nxhpc.dit.config``, weight binding in ``nxhpc.dit.binding``; they are re-exported here for
existing callers. Nothing here imports the compiled kernels.
"""
from __future__ import annotations

from nxhpc.dit.binding import LayerWeights
from nxhpc.dit.config import BlockConfig, infer_config, tensor_names
from nxhpc.formats.gguf_io import MissingTensorError, ModelError, ModelFileError, ModelNotFoundError
from nxhpc.models.cli import main
from nxhpc.models.model import Model
from nxhpc.models.modeldir import GGUF_FILE, ModelsDirError, check_replaceable, write_model_dir
from nxhpc.models.registry import (BUILTIN_DENOISERS, BUILTIN_MODELS, DEFAULT_MODEL_ID,
                                   builtin_spec, ensure_builtin, models_dir, open_denoiser,
                                   open_model, resolve_model)
from nxhpc.models.synthetic import (DenoiserSpec, SyntheticSpec, make_synthetic,
                                    make_synthetic_denoiser)

__all__ = [
    "BlockConfig", "LayerWeights", "Model", "open_model", "models_dir", "DEFAULT_MODEL_ID",
    "BUILTIN_MODELS", "SyntheticSpec", "make_synthetic", "ensure_builtin", "infer_config",
    "tensor_names", "write_model_dir", "check_replaceable", "ModelError",
    "ModelNotFoundError", "ModelFileError", "MissingTensorError", "ModelsDirError", "GGUF_FILE",
    "main",
    "BUILTIN_DENOISERS", "DenoiserSpec", "make_synthetic_denoiser", "resolve_model",
    "builtin_spec", "open_denoiser",
]
