"""nxhpc: run diffusion transformers (Z-Image; Lumina-2 blocks) on the CPU from GGUF weights.

Hot paths are C kernels behind validating Cython wrappers (``nxhpc._kernels``), chosen at run
time by CPU features (``cpu_features()``, ``kernel_variants()``; ``NXHPC_DISABLE_SIMD=1`` forces
the scalar path). The kernels load lazily: ``import nxhpc`` and the pure-Python tools
(``python -m nxhpc.models list``, ``python -m nxhpc.ddp``) work in a tree whose extension is not
built; the clear "not built" error appears on first use of a kernel.

Library doors: ``load_model`` (one block), ``load_denoiser``, ``load_text_encoder``,
``load_vae`` and ``generate_image`` (a prompt to uint8 pixels, as ``python -m nxhpc.generate``).

Layout: ``runtime`` (shared-memory arena, worker pool, boundary checks), ``formats`` (GGUF,
fixtures, block layouts), ``nn`` (the typed-linear seam, the engine), ``dit`` (config, block,
stack runs, denoiser, sampler, references, grading), ``qwen3`` (the Qwen3 text encoder:
tokenizer, model, ``TextEncoder``), ``vae`` (the FLUX decoder: ``VaeDecoder``), ``models`` (ids,
model directories, synthetic models), ``train`` (Q16 tape, ring, DDP), ``cli`` (the one CLI
layer); CLIs ``blockrun``, ``denoise``, ``sample``, ``encode``, ``decode``, ``generate``,
``models``, ``ddp`` (each also a console command, and ``nxhpc <command>``).
"""
from __future__ import annotations

import importlib as _importlib
import os as _os

__version__ = "0.1.0"

__all__ = ["load_model", "load_denoiser", "load_text_encoder", "load_vae", "generate_image",
           "cpu_features",
           "kernel_variants", "supported_isas", "kernels", "__version__"]

_KERNEL_FUNCS = ("cpu_features", "kernel_variants", "supported_isas")


def kernels():
    """The compiled kernel module ``nxhpc._kernels``; ImportError saying how to build it if absent."""
    try:
        return _importlib.import_module("nxhpc._kernels")
    except ModuleNotFoundError as e:  # the source tree without its compiled extension
        if e.name != "nxhpc._kernels":
            raise
        raise ImportError(
            f"nxhpc's compiled kernels (nxhpc._kernels) are not built in "
            f"{_os.path.dirname(__file__)}: this is probably a source checkout shadowing an "
            f"installed nxhpc. Build it in place with `pip install -e .` (or `python setup.py "
            f"build_ext --inplace`), or run from outside the checkout.") from None


def _api_function(name: str):
    """``nxhpc.<name>``: calls ``nxhpc.api.<name>`` (looked up at each call), with its name,
    docstring and signature (``__wrapped__``: ``help()``, ``inspect.signature``, IDEs)."""
    import functools

    def call(*args, **kwargs):
        return getattr(_importlib.import_module("nxhpc.api"), name)(*args, **kwargs)
    return functools.update_wrapper(call, getattr(_importlib.import_module("nxhpc.api"), name))


load_model = _api_function("load_model")
load_denoiser = _api_function("load_denoiser")
load_text_encoder = _api_function("load_text_encoder")
load_vae = _api_function("load_vae")
generate_image = _api_function("generate_image")


def __getattr__(name: str):
    if name in _KERNEL_FUNCS:
        return getattr(kernels(), name)
    raise AttributeError(f"module 'nxhpc' has no attribute {name!r}")
