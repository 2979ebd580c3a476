"""The FLUX autoencoder family: its decoder on nxhpc's kernels (docs/autoencoder.md).

Owns the decoder's config from the checkpoint's shapes and a diffusers ``config.json``
(``config``), reading the BFL/ComfyUI ``ae.safetensors`` (LDM key names) and diffusers ``vae/``
layouts zero copy (``files``), ``VaeDecoder.decode(z)`` in the order the network reads --
``z / 0.3611 + 0.1159``, conv_in, the mid block (ResNet blocks around one single-head attention,
tiled), four up levels (ResNet blocks, nearest x2 + conv), GroupNorm + SiLU, conv_out -- with
convolutions as matmuls of im2col rows on the shared kernels (``model``), the float64 reference
(``reference``), and the picture (``image``: ``to_uint8``, ``write_png``).
Must not: import ``nxhpc.models``, or materialize a whole im2col matrix or score matrix.
"""
from nxhpc.vae.image import to_uint8, write_png

__all__ = ["to_uint8", "write_png"]
