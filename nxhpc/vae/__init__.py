"""The FLUX autoencoder family (home reserved; the decoder itself is issue 17's work).

Will own (``../shared/design/AUTOENCODER.md``; written up in ``docs/`` when it lands): the
decoder's config from the checkpoint's shapes (and a diffusers ``config.json`` where present),
reading the BFL/ComfyUI ``ae.safetensors`` (LDM key names) and diffusers ``vae/`` layouts, and
``decode(z)`` in the order the network reads -- ``z / 0.3611 + 0.1159``, conv_in, the mid block
(ResNet blocks around one single-head attention, tiled), four up levels (ResNet blocks,
nearest x2 + conv), GroupNorm + SiLU, conv_out -- with convolutions as matmul panels on the
shared kernels.
Must not: import ``nxhpc.models``, or materialize a whole im2col matrix or score matrix.
"""
