# C declarations shared by the kernel wrappers: the CPU probe, the ISA list and the registry of
# dispatch families. Each kernel family adds its own extern block in its .pxi file.
from libc.stdint cimport uint32_t

cdef extern from "nx_cpu.h" nogil:
    ctypedef enum nx_isa:
        NX_ISA_GENERIC
        NX_ISA_AVX2
        NX_ISA_AVX512
        NX_ISA_COUNT
    enum: NX_CPU_NFEATURES
    uint32_t nx_cpu_features()
    const char *nx_cpu_feature_name(int i)
    nx_isa nx_cpu_best_isa()
    int nx_cpu_isa_supported(nx_isa isa)
    const char *nx_isa_name(nx_isa isa)
    nx_isa nx_isa_parent(nx_isa isa)
    uint32_t nx_isa_needs(nx_isa isa)
    int nx_isa_rank(nx_isa isa)

cdef extern from "nx_dispatch.h" nogil:
    ctypedef struct nx_family_info:
        const char *name
        int nslots
        const char *(*slot_name)(int slot)
        nx_isa (*variant)(int slot, nx_isa isa)
    const nx_family_info *nx_families[]
    const int nx_nfamilies
    void nx_dispatch_init()
