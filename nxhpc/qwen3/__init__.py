"""The Qwen3 text encoder family: Z-Image's caption features from a llama.cpp GGUF.

Owns, in the order the model reads (``docs/text_encoder.md``: the facts and their sources):

- ``config``: :class:`~nxhpc.qwen3.config.Qwen3Config`, inferred from the file's ``qwen3.*``
  metadata and checked against every tensor shape (``infer_config``);
- ``tokenizer``: the byte-level BPE built from the same file's ``tokenizer.ggml.*`` fields
  (with the ``tokenizers`` package), the chat template and truncation of diffusers'
  ``ZImagePipeline._encode_prompt``;
- ``model``: :class:`~nxhpc.qwen3.model.TextEncoderModel` -- the forward on the shared engine
  (embedding-row gather, 35 of the 36 blocks: RMSNorm, q/k-norm + rotate-half RoPE, causal
  grouped-query attention, SwiGLU), returning ``hidden_states[-2]`` (no final norm), the
  caption features the denoiser takes;
- ``encoder``: :class:`~nxhpc.qwen3.encoder.TextEncoder` -- prompt in, features out (the
  tokenizer and the model of one file, one worker pool reused, a lock for threads): what
  ``nxhpc.load_text_encoder`` and ``python -m nxhpc.encode`` return and run;
- oracles apart from the engine: ``reference`` (float64 numpy) and ``oracle`` (transformers'
  ``Qwen3Model`` wiring).

Must not: import ``nxhpc.models`` (ids and files are the registry's) or ``nxhpc.dit``, or copy
the typed-linear, attention or engine code of ``nxhpc.nn`` (it runs on it).
"""
