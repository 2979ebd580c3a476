"""The Qwen3 text encoder family (home reserved; the encoder itself is issue 16's work).

Will own, in the order the model reads (``../shared/design/TEXT_ENCODER.md``; written up in
``docs/`` when it lands): the config from a llama.cpp GGUF's ``qwen3.*`` metadata and tensor
shapes, the byte-level BPE tokenizer built from the same file's ``tokenizer.ggml.*`` entries
(with the ``tokenizers`` package), the chat template and truncation of diffusers'
``ZImagePipeline._encode_prompt``, and the forward -- token embedding gather, 35 of the 36
blocks (RMSNorm, q/k-norm + rotate-half RoPE, causal grouped-query attention, SwiGLU) --
returning ``hidden_states[-2]``, the caption features the denoiser takes.
Must not: import ``nxhpc.models`` (ids and files are the registry's) or copy the typed-linear,
attention or engine code of ``nxhpc.nn`` / ``nxhpc.dit.plan`` (it runs on them).
"""
