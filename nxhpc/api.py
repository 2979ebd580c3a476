"""Library entry points for downstream scripts: ``load_model`` (re-exported as ``nxhpc.load_model``).

Owns nothing but the public spelling: it delegates to ``nxhpc.models.open_model``; the returned
model's ``block(i)`` is an ``nxhpc.dit.block.Block`` whose ``forward`` returns ``(output, timings)``.
Several blocks of different kinds and token counts in one call (a denoiser: refiners on image and
caption rows, the main layers on the joint rows) run on one ``nxhpc.dit.plan.Engine``: bind the
weights (``model.layer_weights(i, prefix=...)``), describe each kind as a ``BlockPlan``, then
``Engine([(plan, T), ...], weights, buffers=...)`` forks one pool for all of them.
"""
from __future__ import annotations

import os

__all__ = ["load_model"]


def load_model(id_or_path: str | os.PathLike, models_dir: str | os.PathLike | None = None,
               gguf_path: str | os.PathLike | None = None):
    """Open a model: a built-in id (generated on first use), ``$NXHPC_MODELS/<id>``, or a path.

    Returns an ``nxhpc.models.Model`` (use it as a context manager or call ``close()``). Raises
    ``ModelNotFoundError`` / ``ModelFileError`` / ``MissingTensorError`` (all ``ModelError``).
    Example::

        model = nxhpc.load_model("tiny")
        out, timings = model.block(0).forward(model.blk_in(0), model.t_emb(), model.pe(),
                                              mask=model.mask(), workers=2)
    """
    from nxhpc.models import open_model
    return open_model(id_or_path, models_dir=models_dir, gguf_path=gguf_path)
