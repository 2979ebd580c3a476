"""nxhpc: run diffusion-transformer (DiT) blocks on the CPU from Q8_0 GGUF weights.

Hot paths are C kernels behind validating Cython wrappers (``nxhpc._kernels``), chosen at run
time by CPU features (``cpu_features()``, ``kernel_variants()``; ``NXHPC_DISABLE_SIMD=1`` forces
the scalar path).
"""
try:
    from nxhpc._kernels import cpu_features, kernel_variants, supported_isas
except ModuleNotFoundError as _e:  # the source tree without its compiled extension
    if _e.name != "nxhpc._kernels":
        raise
    import os as _os
    raise ImportError(
        f"nxhpc's compiled kernels (nxhpc._kernels) are not built in "
        f"{_os.path.dirname(__file__)}: this is probably a source checkout shadowing an "
        f"installed nxhpc. Build it in place with `pip install -e .` (or `python setup.py "
        f"build_ext --inplace`), or run from outside the checkout.") from None
from nxhpc.api import load_model

__version__ = "0.1.0"

__all__ = ["load_model", "cpu_features", "kernel_variants", "supported_isas", "__version__"]
