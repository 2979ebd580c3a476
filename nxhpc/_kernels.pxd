# C declarations shared by the kernel wrappers. Each kernel family adds its own extern block
# in its .pxi file; this file holds only the CPU probe.
from libc.stdint cimport uint32_t

cdef extern from "nx_cpu.h" nogil:
    ctypedef enum nx_isa:
        NX_ISA_GENERIC
        NX_ISA_AVX2
        NX_ISA_AVX512
    uint32_t nx_cpu_features()
    nx_isa nx_cpu_best_isa()
    int nx_cpu_isa_supported(nx_isa isa)
    const char *nx_isa_name(nx_isa isa)
