"""Models: ids and the registry, model directories, synthetic models, the Model facade, the CLI.

Layout: ``registry`` (built-in ids, the models root, :func:`open_model`), ``modeldir`` (file
names, all-or-nothing writing, locks), ``synthetic`` (:class:`SyntheticSpec`,
:func:`make_synthetic`), ``model`` (:class:`Model`), ``cli`` (``python -m nxhpc.models``),
``tap`` (recording a diffusers run; needs torch). The config and tensor names live in
``nxhpc.dit.config``, weight binding in ``nxhpc.dit.binding``; the model-file error classes
(``nxhpc.formats``) are re-exported here, as the errors of :func:`open_model` /
:func:`open_denoiser`. Nothing here imports the compiled kernels.
"""
from __future__ import annotations

from nxhpc.formats.gguf_io import MissingTensorError, ModelError, ModelFileError, ModelNotFoundError
from nxhpc.models.cli import main
from nxhpc.models.model import Model
from nxhpc.models.modeldir import GGUF_FILE, ModelsDirError, check_replaceable, write_model_dir
from nxhpc.models.registry import (BUILTINS, DEFAULT_MODEL_ID, builtin_ids, builtin_spec,
                                   ensure_builtin, models_dir, open_denoiser, open_model,
                                   resolve_model)
from nxhpc.models.synthetic import SyntheticSpec, make_synthetic

__all__ = [
    "Model", "open_model", "models_dir", "DEFAULT_MODEL_ID",
    "BUILTINS", "builtin_ids", "SyntheticSpec", "make_synthetic", "ensure_builtin",
    "write_model_dir", "check_replaceable", "ModelError",
    "ModelNotFoundError", "ModelFileError", "MissingTensorError", "ModelsDirError", "GGUF_FILE",
    "main",
    "resolve_model",
    "builtin_spec", "open_denoiser",
]
