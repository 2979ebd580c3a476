"""The external oracle: transformers' ``Qwen3Model`` loaded with a GGUF's exact weights.

Owns the wiring between llama.cpp tensor names and transformers' module names
(:data:`HF_NAMES`), :func:`transformers_model` (a ``Qwen3Model`` of a
:class:`~nxhpc.qwen3.config.Qwen3Config` with every parameter loaded, strict, in the dtype
asked for) and :func:`hidden_states_m2` (what ``ZImagePipeline._encode_prompt`` takes from
it: ``hidden_states[-2]``). Must not: import engine code (it grades it), or be imported at
module import by anything but tests and benchmarks (torch and transformers are optional
extras; they are imported inside the functions).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from nxhpc.qwen3.config import Qwen3Config, layer_names

__all__ = ["HF_NAMES", "transformers_config", "transformers_model", "hidden_states_m2"]

#: short key of a block tensor -> its module under ``layers.N.`` in transformers' Qwen3Model
HF_NAMES = {"attn_norm": "input_layernorm", "wq": "self_attn.q_proj",
            "wk": "self_attn.k_proj", "wv": "self_attn.v_proj", "wo": "self_attn.o_proj",
            "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm",
            "ffn_norm": "post_attention_layernorm", "w_gate": "mlp.gate_proj",
            "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}


def transformers_config(cfg: Qwen3Config) -> Any:
    """``transformers.Qwen3Config`` of the same dims (tied embeddings, no attention bias)."""
    from transformers import Qwen3Config as HFConfig
    return HFConfig(vocab_size=cfg.vocab, hidden_size=cfg.dim, intermediate_size=cfg.ffn,
                    num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                    num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                    rms_norm_eps=float(cfg.eps), rope_theta=float(cfg.rope_theta),
                    max_position_embeddings=cfg.context_length, tie_word_embeddings=True,
                    attention_bias=False)


def transformers_model(cfg: Qwen3Config, weights: Mapping[str, np.ndarray], *,
                       dtype: Any = None, attn: str = "eager") -> Any:
    """A ``transformers.Qwen3Model`` in ``dtype`` (default torch.float64) holding ``weights``
    (llama.cpp name -> array; every parameter must be there, strictly), in eval mode."""
    import torch
    from transformers import Qwen3Model
    dtype = torch.float64 if dtype is None else dtype
    hc = transformers_config(cfg)
    hc._attn_implementation = attn
    model = Qwen3Model(hc).to(dtype).eval()
    sd = {"embed_tokens.weight": weights["token_embd.weight"],
          "norm.weight": weights["output_norm.weight"]}
    for i in range(cfg.n_layers):
        for key, name in layer_names(i).items():
            sd[f"layers.{i}.{HF_NAMES[key]}.weight"] = weights[name]
    model.load_state_dict({k: torch.from_numpy(np.asarray(v, dtype=np.float64)).to(dtype)
                           for k, v in sd.items()}, strict=True)
    return model


def hidden_states_m2(model: Any, ids: Sequence[int]) -> np.ndarray:
    """``model(ids, output_hidden_states=True).hidden_states[-2][0]`` as float64 ``[L, D]``."""
    import torch
    with torch.no_grad():
        out = model(torch.as_tensor(np.asarray(ids, dtype=np.int64))[None],
                    output_hidden_states=True)
    hs = out.hidden_states
    if len(hs) != model.config.num_hidden_layers + 1:   # pragma: no cover - transformers changed
        raise RuntimeError(f"Qwen3Model returned {len(hs)} hidden states, expected "
                           f"{model.config.num_hidden_layers + 1}")
    return hs[-2][0].to(torch.float64).numpy()
