"""File formats: GGUF reading/writing on the ``gguf`` package, the safetensors fixture store, GGML block
layouts. Must not import the compiled kernels."""
