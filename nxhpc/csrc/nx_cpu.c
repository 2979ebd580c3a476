/* nx_cpu.c -- the one CPU probe. CPUID feature bits are only trusted together with OSXSAVE +
 * xgetbv, which tell whether the OS actually saves the wider register state on context switch;
 * AMX tile data additionally needs the Linux per-process permission (arch_prctl).
 * Owns: the probe, its cache, the ISA table built from NX_ISA_LIST. Must not: execute any SIMD
 * or AMX instruction (a probe only; no tile configuration is ever loaded).
 */
#define _GNU_SOURCE /* syscall() under -std=c11 */
#include "nx_cpu.h"

#include <limits.h>
#include <stdlib.h>
#include <string.h>

static const char *const nx_feature_names[NX_CPU_NFEATURES] = {
    "sse2",     "avx",      "avx2",       "fma",        "f16c",   "avx512f",       "avx512bw",
    "avx512vl", "avx512dq", "avx512vnni", "avx512bf16", "os_ymm", "os_zmm",        "avx512vbmi",
    "avxvnni",  "amx_tile", "amx_int8",   "amx_bf16",   "os_amx", "amx_permitted",
};
_Static_assert(NX_CPU_AMX_PERMITTED == 1u << (NX_CPU_NFEATURES - 1), "feature names out of date");

const char *nx_cpu_feature_name(int i) {
    return i >= 0 && i < NX_CPU_NFEATURES ? nx_feature_names[i] : "unknown";
}

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>

static uint64_t nx_xgetbv0(void) {
    uint32_t eax, edx;
    __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
    return ((uint64_t)edx << 32) | eax;
}

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define NX_ARCH_GET_XCOMP_PERM 0x1022
#define NX_ARCH_REQ_XCOMP_PERM 0x1023
#define NX_XFEATURE_XTILEDATA 18

/* Linux (5.16+) hands out the 8 KiB tile-data state only on request, per process. Asks once;
 * 1 if granted (already, or now). Old kernels answer EINVAL: not permitted. */
static int nx_linux_amx_permitted(void) {
    unsigned long bits = 0;
    if (syscall(SYS_arch_prctl, NX_ARCH_GET_XCOMP_PERM, &bits) == 0 &&
        (bits & (1ul << NX_XFEATURE_XTILEDATA)))
        return 1;
    if (syscall(SYS_arch_prctl, NX_ARCH_REQ_XCOMP_PERM, NX_XFEATURE_XTILEDATA) != 0) return 0;
    bits = 0;
    return syscall(SYS_arch_prctl, NX_ARCH_GET_XCOMP_PERM, &bits) == 0 &&
           (bits & (1ul << NX_XFEATURE_XTILEDATA)) != 0;
}
#else
static int nx_linux_amx_permitted(void) { return 1; } /* no per-process permission step */
#endif

static uint32_t nx_probe(void) {
    uint32_t a, b, c, d, f = 0;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    if (d & (1u << 26)) f |= NX_CPU_SSE2;
    const int osxsave = (c >> 27) & 1;
    if (c & (1u << 28)) f |= NX_CPU_AVX;
    if (c & (1u << 12)) f |= NX_CPU_FMA;
    if (c & (1u << 29)) f |= NX_CPU_F16C;
    const uint64_t xcr0 = osxsave ? nx_xgetbv0() : 0;
    const int os_ymm = (xcr0 & 0x6) == 0x6;             /* SSE + AVX state */
    const int os_zmm = os_ymm && (xcr0 & 0xE0) == 0xE0; /* opmask, ZMM_Hi256, Hi16_ZMM */
    const int os_amx = (xcr0 & 0x60000) == 0x60000;     /* XTILECFG (17), XTILEDATA (18) */
    if (os_ymm) f |= NX_CPU_OS_YMM;
    if (os_zmm) f |= NX_CPU_OS_ZMM;
    if (__get_cpuid_max(0, NULL) >= 7) {
        __cpuid_count(7, 0, a, b, c, d);
        const uint32_t max_sub = a;
        if (b & (1u << 5)) f |= NX_CPU_AVX2;
        if (b & (1u << 16)) f |= NX_CPU_AVX512F;
        if (b & (1u << 17)) f |= NX_CPU_AVX512DQ;
        if (b & (1u << 30)) f |= NX_CPU_AVX512BW;
        if (b & (1u << 31)) f |= NX_CPU_AVX512VL;
        if (c & (1u << 1)) f |= NX_CPU_AVX512VBMI;
        if (c & (1u << 11)) f |= NX_CPU_AVX512VNNI;
        if (d & (1u << 22)) f |= NX_CPU_AMX_BF16;
        if (d & (1u << 24)) f |= NX_CPU_AMX_TILE;
        if (d & (1u << 25)) f |= NX_CPU_AMX_INT8;
        if (max_sub >= 1) {
            __cpuid_count(7, 1, a, b, c, d);
            if (a & (1u << 4)) f |= NX_CPU_AVXVNNI;
            if (a & (1u << 5)) f |= NX_CPU_AVX512BF16;
        }
    }
    if ((f & NX_CPU_AMX_TILE) && os_amx) {
        f |= NX_CPU_OS_AMX;
        if (nx_linux_amx_permitted()) f |= NX_CPU_AMX_PERMITTED;
    }
    return f;
}
#else
static uint32_t nx_probe(void) { return 0; }
#endif

static uint32_t nx_features_cache;
static int nx_features_done;

uint32_t nx_cpu_features(void) {
    /* Racy-but-idempotent init: every caller computes the same value. Kernels run in forked
     * processes, not threads, and the extension probes at import, before any fork. */
    if (!nx_features_done) {
        nx_features_cache = nx_probe();
        nx_features_done = 1;
    }
    return nx_features_cache;
}

#define NX_ISA_ROW_(id, name, needs, parent, rank) {name, (needs), NX_ISA_##parent, rank},
static const struct {
    const char *name;
    uint32_t needs;
    nx_isa parent;
    int rank;
} nx_isas[NX_ISA_COUNT] = {NX_ISA_LIST(NX_ISA_ROW_)};
#undef NX_ISA_ROW_

static int nx_isa_valid(nx_isa isa) { return (int)isa >= 0 && (int)isa < NX_ISA_COUNT; }

int nx_cpu_isa_supported(nx_isa isa) {
    if (!nx_isa_valid(isa)) return 0;
    return (nx_cpu_features() & nx_isas[isa].needs) == nx_isas[isa].needs;
}

nx_isa nx_cpu_best_isa(void) {
    const char *e = getenv("NXHPC_DISABLE_SIMD");
    if (e && *e && strcmp(e, "0") != 0) return NX_ISA_GENERIC;
    /* NXHPC_MAX_ISA=<name>: no ISA above that one's rank (an unknown name caps nothing; the
     * Python layer rejects it at import) */
    const char *m = getenv("NXHPC_MAX_ISA");
    int cap = INT_MAX;
    for (int i = 0; m && *m && i < NX_ISA_COUNT; i++)
        if (strcmp(m, nx_isas[i].name) == 0) cap = nx_isas[i].rank;
    nx_isa best = NX_ISA_GENERIC;
    for (int i = 1; i < NX_ISA_COUNT; i++)
        if (nx_cpu_isa_supported((nx_isa)i) && nx_isas[i].rank > nx_isas[best].rank &&
            nx_isas[i].rank <= cap)
            best = (nx_isa)i;
    return best;
}

int nx_isa_rank(nx_isa isa) { return nx_isa_valid(isa) ? nx_isas[isa].rank : -1; }

const char *nx_isa_name(nx_isa isa) { return nx_isa_valid(isa) ? nx_isas[isa].name : "unknown"; }

nx_isa nx_isa_parent(nx_isa isa) {
    return nx_isa_valid(isa) ? nx_isas[isa].parent : NX_ISA_GENERIC;
}

uint32_t nx_isa_needs(nx_isa isa) { return nx_isa_valid(isa) ? nx_isas[isa].needs : 0xffffffffu; }
