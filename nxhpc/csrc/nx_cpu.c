/* nx_cpu.c -- the one CPU probe. CPUID feature bits are only trusted together with OSXSAVE + xgetbv,
 * which tell whether the OS actually saves the wider register state on context switch. */
#include "nx_cpu.h"

#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>

static uint64_t nx_xgetbv0(void) {
    uint32_t eax, edx;
    __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
    return ((uint64_t)edx << 32) | eax;
}

static uint32_t nx_probe(void) {
    uint32_t a, b, c, d, f = 0;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    if (d & (1u << 26)) f |= NX_CPU_SSE2;
    int osxsave = (c >> 27) & 1;
    int avx = (c >> 28) & 1, fma = (c >> 12) & 1, f16c = (c >> 29) & 1;
    uint64_t xcr0 = osxsave ? nx_xgetbv0() : 0;
    int os_ymm = (xcr0 & 0x6) == 0x6;
    int os_zmm = os_ymm && ((xcr0 & 0xE0) == 0xE0);
    if (os_ymm) f |= NX_CPU_OS_YMM;
    if (os_zmm) f |= NX_CPU_OS_ZMM;
    if (avx) f |= NX_CPU_AVX;
    if (fma) f |= NX_CPU_FMA;
    if (f16c) f |= NX_CPU_F16C;
    if (__get_cpuid_max(0, NULL) >= 7) {
        __cpuid_count(7, 0, a, b, c, d);
        if (b & (1u << 5)) f |= NX_CPU_AVX2;
        if (b & (1u << 16)) f |= NX_CPU_AVX512F;
        if (b & (1u << 17)) f |= NX_CPU_AVX512DQ;
        if (b & (1u << 30)) f |= NX_CPU_AVX512BW;
        if (b & (1u << 31)) f |= NX_CPU_AVX512VL;
        if (c & (1u << 11)) f |= NX_CPU_AVX512VNNI;
        __cpuid_count(7, 1, a, b, c, d);
        if (a & (1u << 5)) f |= NX_CPU_AVX512BF16;
    }
    return f;
}
#else
static uint32_t nx_probe(void) { return 0; }
#endif

static uint32_t nx_features_cache;
static int nx_features_done;

uint32_t nx_cpu_features(void) {
    /* Racy-but-idempotent init: every thread computes the same value. Kernels run in forked
     * processes, not threads, and the parent probes before forking. */
    if (!nx_features_done) {
        nx_features_cache = nx_probe();
        nx_features_done = 1;
    }
    return nx_features_cache;
}

int nx_cpu_isa_supported(nx_isa isa) {
    uint32_t f = nx_cpu_features();
    const uint32_t l2 = NX_CPU_AVX | NX_CPU_AVX2 | NX_CPU_FMA | NX_CPU_F16C | NX_CPU_OS_YMM;
    const uint32_t l3 = l2 | NX_CPU_AVX512F | NX_CPU_AVX512BW | NX_CPU_AVX512VL | NX_CPU_AVX512DQ |
                        NX_CPU_AVX512VNNI | NX_CPU_OS_ZMM;
    switch (isa) {
    case NX_ISA_GENERIC: return 1;
    case NX_ISA_AVX2: return (f & l2) == l2;
    case NX_ISA_AVX512: return (f & l3) == l3;
    }
    return 0;
}

nx_isa nx_cpu_best_isa(void) {
    const char *e = getenv("NXHPC_DISABLE_SIMD");
    if (e && *e && strcmp(e, "0") != 0) return NX_ISA_GENERIC;
    if (nx_cpu_isa_supported(NX_ISA_AVX512)) return NX_ISA_AVX512;
    if (nx_cpu_isa_supported(NX_ISA_AVX2)) return NX_ISA_AVX2;
    return NX_ISA_GENERIC;
}

const char *nx_isa_name(nx_isa isa) {
    switch (isa) {
    case NX_ISA_GENERIC: return "generic";
    case NX_ISA_AVX2: return "avx2";
    case NX_ISA_AVX512: return "avx512";
    }
    return "unknown";
}
