"""The diffusion transformer: config and tensor names, weight binding, RoPE tables, the block and its plan,
the float64 reference, the diffusers oracle wiring, grading."""
