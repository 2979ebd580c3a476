"""Training primitives: the exact-integer Q16 tape, the ring all-reduce and data-parallel training over
shared memory or MPI. Imports ``nxhpc.runtime``, never the compiled kernels."""
