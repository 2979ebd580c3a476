"""Process runtime shared by inference and training: the shared-memory arena, the forked worker pool,
process helpers. Must not import the compiled kernels."""
