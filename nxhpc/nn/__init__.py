"""Shared neural pieces on nxhpc's kernels, used by every model family.

Owns what the families share below their own forward code: today the typed-linear seam
(:mod:`nxhpc.nn.linear`: a band of ``x @ W^T`` for every stored weight type and precision,
the adaLN-style single-row linear). The block plans and the :class:`~nxhpc.dit.plan.Engine`
(one arena, one forked pool) still live in ``nxhpc.dit.plan``, where they are written for the
DiT block; they move here, split into a model-agnostic engine and per-family plans, with the
second family that runs on them (docs/architecture.md, "Homes for the model families").
Must not: import a model family (``nxhpc.dit``, ...), the registry (``nxhpc.models``) or files.
"""
