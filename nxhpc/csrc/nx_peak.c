/* nx_peak.c -- the table of peak kinds (nx_peak.h): name, ISA, operand sizes, operations per
 * iteration and the loop of each, and the support check.
 *
 * Owns: that table. Compiled with no ISA flags. Must not: run a loop whose ISA the probe has not
 * reported (nx_peak_run trusts its caller, which checks nx_peak_supported first), or use SIMD
 * intrinsics (the loops live in nx_peak_<isa>.c).
 */
#include "nx_peak.h"

#include <stdlib.h>
#include <string.h>

/* The loop of each kind: nx_peak_<name>_<isa> in nx_peak_<isa>.c; none outside x86 (the build
 * leaves those files out there, nx_cpu.h). */
#if NX_X86
#define NX_PEAK_FN_(name, isa) nx_peak_##name##_##isa
#else
#define NX_PEAK_FN_(name, isa) 0
#endif
#define NX_PEAK_FN_FMA_YMM NX_PEAK_FN_(fma_ymm, avx2)
#define NX_PEAK_FN_I8_YMM NX_PEAK_FN_(i8_ymm, avx2)
#define NX_PEAK_FN_FMA_ZMM NX_PEAK_FN_(fma_zmm, avx512)
#define NX_PEAK_FN_VNNI_ZMM NX_PEAK_FN_(vnni_zmm, avx512)
#define NX_PEAK_FN_BF16_ZMM NX_PEAK_FN_(bf16_zmm, avx512bf16)
#define NX_PEAK_FN_AMX_INT8 NX_PEAK_FN_(amx_int8, amx)
#define NX_PEAK_FN_AMX_BF16 NX_PEAK_FN_(amx_bf16, amx)
#define NX_PEAK_FN_VNNI_YMM NX_PEAK_FN_(vnni_ymm, avxvnni)

#define NX_PEAK_ROW_(id, name, isa, ab, bb, cb, ops)                                               \
    {name, NX_ISA_##isa, ab, bb, cb, ops, NX_PEAK_FN_##id},
static const nx_peak_info nx_peak_table[NX_PEAK_COUNT] = {NX_PEAK_KINDS(NX_PEAK_ROW_)};
#undef NX_PEAK_ROW_

const nx_peak_info *nx_peak_get(int kind) {
    return kind >= 0 && kind < NX_PEAK_COUNT ? &nx_peak_table[kind] : NULL;
}

int nx_peak_supported(int kind) {
    const nx_peak_info *p = nx_peak_get(kind);
    const char *e = getenv("NXHPC_DISABLE_SIMD");
    if (!p || !p->fn) return 0;
    if (e && *e && strcmp(e, "0") != 0) return 0; /* the same switch as nx_cpu_best_isa */
    return nx_cpu_isa_supported(p->isa);
}

void nx_peak_run(int kind, size_t iters, const void *a /* IN */, const void *b /* IN */,
                 void *acc /* INOUT */) {
    nx_peak_table[kind].fn(iters, a, b, acc);
}
