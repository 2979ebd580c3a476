/* nx_cpu.h -- one OS-aware CPU probe (CPUID + OSXSAVE/xgetbv), cached; the ISA levels kernels dispatch on. */
#ifndef NX_CPU_H
#define NX_CPU_H

#include <stdint.h>
#include <stddef.h>

/* Feature bits reported by nx_cpu_features(). */
enum {
    NX_CPU_SSE2       = 1u << 0,
    NX_CPU_AVX        = 1u << 1,
    NX_CPU_AVX2       = 1u << 2,
    NX_CPU_FMA        = 1u << 3,
    NX_CPU_F16C       = 1u << 4,
    NX_CPU_AVX512F    = 1u << 5,
    NX_CPU_AVX512BW   = 1u << 6,
    NX_CPU_AVX512VL   = 1u << 7,
    NX_CPU_AVX512DQ   = 1u << 8,
    NX_CPU_AVX512VNNI = 1u << 9,
    NX_CPU_AVX512BF16 = 1u << 10,
    NX_CPU_OS_YMM     = 1u << 11,   /* OS saves YMM state (XCR0 bits 1,2) */
    NX_CPU_OS_ZMM     = 1u << 12,   /* OS saves opmask + ZMM state (XCR0 bits 5,6,7) */
};

/* x86 SIMD variants (the *_avx2.c / *_avx512.c files) exist only in x86 builds; elsewhere the build
 * leaves those files out, the probe reports no SIMD, and dispatch code wraps every call into them
 * in NX_X86_ONLY(...) so that no reference to them remains. */
#if defined(__x86_64__) || defined(__i386__) || defined(_M_X64) || defined(_M_IX86)
#define NX_X86 1
#define NX_X86_ONLY(...) __VA_ARGS__
#else
#define NX_X86 0
#define NX_X86_ONLY(...)
#endif

/* ISA levels kernels are compiled for; each kernel family picks the highest usable one. */
typedef enum { NX_ISA_GENERIC = 0, NX_ISA_AVX2 = 1, NX_ISA_AVX512 = 2 } nx_isa;

/* Raw probe result (bit set of NX_CPU_*), computed once and cached. Ignores NXHPC_DISABLE_SIMD. */
uint32_t nx_cpu_features(void);

/* Highest ISA level that is both supported (CPU + OS) and allowed (NXHPC_DISABLE_SIMD unset / "0").
 * AVX2 level = AVX2 + FMA + F16C + OS YMM; AVX512 level = AVX2 level + F/BW/VL/DQ/VNNI + OS ZMM. */
nx_isa nx_cpu_best_isa(void);

/* 1 if the ISA level can run on this CPU/OS (ignoring NXHPC_DISABLE_SIMD), else 0. */
int nx_cpu_isa_supported(nx_isa isa);

/* "generic" / "avx2" / "avx512" */
const char *nx_isa_name(nx_isa isa);

#endif
