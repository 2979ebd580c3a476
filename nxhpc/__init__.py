"""nxhpc: run diffusion-transformer (DiT) blocks on the CPU from Q8_0 GGUF weights.

Hot paths are C kernels behind validating Cython wrappers (``nxhpc._kernels``), chosen at run
time by CPU features (``cpu_features()``, ``kernel_variants()``; ``NXHPC_DISABLE_SIMD=1`` forces
the scalar path).
"""
from nxhpc._kernels import cpu_features, kernel_variants, supported_isas
from nxhpc.api import load_model

__version__ = "0.1.0"

__all__ = ["load_model", "cpu_features", "kernel_variants", "supported_isas", "__version__"]
