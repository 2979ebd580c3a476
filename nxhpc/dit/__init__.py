"""The diffusion transformer: ``config`` (the one authority for dims, tensor names and shapes),
``binding`` (a block's weights from GGUF or fixtures), ``linear`` (the typed-matmul seam), ``plan``
(the block as a stage table; the Engine: one arena + one pool for several plans), ``block``
(Block / run_layers), ``rope``, ``reference`` (float64), ``oracle`` (diffusers), ``grade``."""
