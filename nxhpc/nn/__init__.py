"""Shared neural pieces on nxhpc's kernels, used by every model family.

Owns what the families share below their own forward code: the typed-linear seam
(:mod:`nxhpc.nn.linear`: a band of ``x @ W^T`` for every stored weight type and precision,
the adaLN-style single-row linear), the model-agnostic engine (:mod:`nxhpc.nn.engine`:
:class:`~nxhpc.nn.engine.Stage`, the :class:`~nxhpc.nn.engine.Plan` a family's block plan
implements, and the :class:`~nxhpc.nn.engine.Engine` -- one arena, one forked pool, bands,
named buffers, extra tasks), the stage tasks that read the same in every block
(:mod:`nxhpc.nn.stages`: projections, the gated SwiGLU projection) and the input checks the
plans share (:mod:`nxhpc.nn.checks`).
The families' plans live with them: the DiT's ``BlockPlan`` in ``nxhpc.dit.plan``, the Qwen3
text encoder's ``LayerPlan`` in ``nxhpc.qwen3.model``.
Must not: import a model family (``nxhpc.dit``, ``nxhpc.qwen3``, ...), the registry
(``nxhpc.models``) or files.
"""
