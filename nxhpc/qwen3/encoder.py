"""The text encoder as users reach it: a prompt in, Z-Image's caption features out.

Owns :class:`TextEncoder`, the one object behind ``nxhpc.load_text_encoder`` and
``python -m nxhpc.encode``: the tokenizer (``nxhpc.qwen3.tokenizer``, built from the same
file's ``tokenizer.ggml.*`` fields) and the model (``nxhpc.qwen3.model.TextEncoderModel``: one
worker pool and one arena reused by every prompt) of one llama.cpp-layout Qwen3 GGUF, and the
lock that serializes calls from several threads. Must not: resolve ids or directories (the
registry's ``nxhpc.models.registry.open_text_encoder`` does), compute model arithmetic (the
model does), or import ``nxhpc.models``.
"""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from nxhpc.formats.closing import Closing
from nxhpc.formats.gguf_io import ModelFileError
from nxhpc.nn.linear import DEFAULT_PRECISION, check_precision
from nxhpc.qwen3.config import Qwen3Config
from nxhpc.qwen3.model import TextEncoderModel
from nxhpc.qwen3.tokenizer import MAX_TOKENS, Qwen3Tokenizer
from nxhpc.runtime import proc

__all__ = ["TextEncoder", "MAX_TOKENS"]


class TextEncoder(Closing):
    """Z-Image's text encoder from a llama.cpp-layout Qwen3 GGUF (weights and tokenizer from
    the one file): ``tokenize(prompt)`` -> the ids ``ZImagePipeline`` feeds it (chat template
    applied, the first 512 kept), ``encode(prompt)`` -> their ``hidden_states[-2]``, float32
    ``[L, dim]`` (what ``nxhpc.sample --cap-feats`` and ``Denoiser.forward`` take).

    ``path``: the GGUF; ``directory``: the model directory it came from, if any (reported
    only). ``workers`` (default: the usable CPUs), ``precision`` (``"f32"``, ``"bf16"``,
    ``"q8"``: the projections' matmuls; settable between calls) and ``options``
    (``spawn``, ``stage_timeout``, ``max_tokens``, ``check_values``) are
    :class:`~nxhpc.qwen3.model.TextEncoderModel`'s. The file is checked whole when opened
    (config, every tensor, the vocab; a tokenizer with more ids than the embedding has rows is
    refused): a :class:`~nxhpc.formats.gguf_io.ModelFileError` naming what is wrong.

    The first call forks the workers and makes the arena; later calls reuse them. One object
    may be shared by threads: calls are serialized by a lock (each waits for the one before).
    Use it as a context manager or call :meth:`close`, which releases the workers, the arena
    and the map (so the encoder's memory is given back before the denoiser runs).
    """

    def __init__(self, path: str | os.PathLike, *, workers: int | None = None,
                 precision: str = DEFAULT_PRECISION, directory: str | os.PathLike | None = None,
                 **options: Any) -> None:
        self._lock = threading.Lock()
        self._owner = os.getpid()
        self.directory = Path(directory) if directory is not None else None
        self.last_timings: dict[str, int] = {}
        self._model: TextEncoderModel | None = TextEncoderModel(
            path, workers=workers, precision=precision, **options)
        try:
            m = self._model
            self.tokenizer = Qwen3Tokenizer.from_gguf(m.gguf)
            if self.tokenizer.vocab_size > m.config.vocab:
                raise ModelFileError(f"{m.path}: the tokenizer has {self.tokenizer.vocab_size} "
                                     f"tokens but 'token_embd.weight' has {m.config.vocab} "
                                     f"rows: ids beyond the embedding", "token_embd.weight")
        except BaseException:
            self._model.close()
            self._model = None
            raise
        self.config: Qwen3Config = m.config
        self.path: Path = Path(m.path)
        self.workers: int = m.workers

    # -- prompts
    def tokenize(self, prompt: str) -> list[int]:
        """The ids of ``prompt`` as ``ZImagePipeline._encode_prompt`` makes them: the chat
        template around it, encoded whole, the first :data:`MAX_TOKENS` (512) kept. TypeError
        for a non-string, ValueError for a NUL character or a lone surrogate."""
        self._check_open()
        return self.tokenizer.tokenize(prompt, MAX_TOKENS)

    def templated_length(self, prompt: str) -> int:
        """Tokens of the templated prompt before truncation (above 512: the tail is cut)."""
        return self.tokenize_counted(prompt)[1]

    def tokenize_counted(self, prompt: str) -> tuple[list[int], int]:
        """:meth:`tokenize`'s ids and :meth:`templated_length`, from one encoding."""
        self._check_open()
        return self.tokenizer.tokenize_counted(prompt, MAX_TOKENS)

    def encode(self, prompt: str) -> np.ndarray:
        """The caption features of ``prompt``: ``hidden_states[-2]`` of :meth:`tokenize`'s
        ids, float32 ``[L, dim]`` (a fresh array; L <= 512). ``last_timings`` (microseconds):
        ``us_tokenize``, ``us_embed``, ``us_layers``, ``us_total``."""
        t0 = time.perf_counter_ns()
        ids = self.tokenize(prompt)
        us_tok = (time.perf_counter_ns() - t0) // 1000
        return self._encode(ids, us_tok)

    def encode_ids(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """``hidden_states[-2]`` of token ids as given (no template, no truncation):
        float32 ``[L, dim]``; ``TextEncoderInputError`` for ids that do not fit the model."""
        return self._encode(ids, 0)

    def _encode(self, ids: Any, us_tok: int) -> np.ndarray:
        proc.check_owner(self._owner, "TextEncoder.encode", "TextEncoder")
        with self._lock:
            m = self._check_open()
            out = m.encode_ids(ids)
            t = dict(m.last_timings)
            self.last_timings = {"us_tokenize": int(us_tok), **t,
                                 "us_total": int(us_tok) + t["us_total"]}
            return out

    # -- settings and state
    @property
    def precision(self) -> str:
        """The projections' matmul precision (``f32``, ``bf16``, ``q8``); settable."""
        return self._check_open().precision

    @precision.setter
    def precision(self, value: str) -> None:
        p = check_precision(value, "TextEncoder: precision")
        # before the lock: one a parent thread held at a fork is never released in the child
        proc.check_owner(self._owner, "TextEncoder.precision", "TextEncoder")
        with self._lock:
            self._check_open().precision = p

    @property
    def model(self) -> TextEncoderModel:
        """The underlying :class:`~nxhpc.qwen3.model.TextEncoderModel` (ids in, features out)."""
        return self._check_open()

    def memory(self) -> dict[str, float | None]:
        """MB: the mapped GGUF, the arena, this process's peak resident set."""
        return self._check_open().memory()

    def _check_open(self) -> TextEncoderModel:
        m = self._model
        if m is None:
            raise RuntimeError("TextEncoder: closed (open it again to encode)")
        return m

    # -- lifetime
    def close(self) -> None:
        """Stop the workers, release the arena and the map (waits for a running call).
        Idempotent. In a forked child: nothing (the parent's to close)."""
        if os.getpid() != self._owner:
            return
        with self._lock:
            m, self._model = self._model, None
            if m is not None:
                m.close()

    @property
    def closed(self) -> bool:
        return self._model is None

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.workers} workers, {self.precision}"
        return f"<TextEncoder {self.path}: {self.config.summary()}; {state}>"
