"""File formats: GGUF reading/writing on the ``gguf`` package (``gguf_io``), the typed weight tensor
(``weights``), the safetensors fixture store (``fixtures``), GGML block layouts (``ggml_blocks``),
the ``with`` mixin of every closable object (``closing``).
Must not import the compiled kernels."""
