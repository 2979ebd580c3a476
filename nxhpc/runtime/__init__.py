"""Process runtime shared by inference and training: ``shm`` (the shared-memory arena), ``workers``
(the forked worker pool, the one ``bands()``), ``proc`` (deferred signals, die-with-parent,
reaping, exit text), ``outfile`` (result files checked up front, written atomically), ``memory``
(peak resident sets, the models' ``memory()`` report), ``peak`` (per-core peaks of this CPU,
measured at run time).
Must not import the compiled kernels at import time (``peak`` imports them on first use)."""
