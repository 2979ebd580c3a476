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

import importlib
from typing import Any

# name -> the submodule that defines it. Imported on first use (PEP 562), not with the package:
# importing the package then starts no chain of submodule imports, so two threads importing
# parts of it at once cannot deadlock on each other's module locks (a library call and a CLI
# in two threads once met an import deadlock here).
_WHERE = {
    "MissingTensorError": "nxhpc.formats.gguf_io", "ModelError": "nxhpc.formats.gguf_io",
    "ModelFileError": "nxhpc.formats.gguf_io", "ModelNotFoundError": "nxhpc.formats.gguf_io",
    "main": "nxhpc.models.cli", "Model": "nxhpc.models.model",
    "GGUF_FILE": "nxhpc.models.modeldir", "ModelsDirError": "nxhpc.models.modeldir",
    "check_replaceable": "nxhpc.models.modeldir", "write_model_dir": "nxhpc.models.modeldir",
    "BUILTINS": "nxhpc.models.registry", "DEFAULT_MODEL_ID": "nxhpc.models.registry",
    "builtin_ids": "nxhpc.models.registry", "builtin_spec": "nxhpc.models.registry",
    "ensure_builtin": "nxhpc.models.registry", "models_dir": "nxhpc.models.registry",
    "open_denoiser": "nxhpc.models.registry", "open_model": "nxhpc.models.registry",
    "resolve_model": "nxhpc.models.registry",
    "SyntheticSpec": "nxhpc.models.synthetic", "make_synthetic": "nxhpc.models.synthetic",
}

__all__ = [
    "Model", "open_model", "models_dir", "DEFAULT_MODEL_ID",
    "BUILTINS", "builtin_ids", "SyntheticSpec", "make_synthetic", "ensure_builtin",
    "write_model_dir", "check_replaceable", "ModelError",
    "ModelNotFoundError", "ModelFileError", "MissingTensorError", "ModelsDirError", "GGUF_FILE",
    "main",
    "resolve_model",
    "builtin_spec", "open_denoiser",
]


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'nxhpc.models' has no attribute {name!r}")
    value = getattr(importlib.import_module(where), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
