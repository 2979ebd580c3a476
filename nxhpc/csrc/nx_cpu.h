/* nx_cpu.h -- the one OS-aware CPU probe (CPUID + OSXSAVE/xgetbv, Linux AMX permission), cached,
 * and the ISA targets kernels are compiled for, each defined by the feature bits it needs.
 *
 * Owns: the feature bits, the ISA list (name, required bits, parent) and the NX_X86_ONLY switch.
 * Must not: decide per kernel which variant runs (that is the per-family dispatch tables,
 * nx_dispatch.h) or run any AMX / SIMD instruction (it is a probe only).
 */
#ifndef NX_CPU_H
#define NX_CPU_H

#include <stddef.h>
#include <stdint.h>

/* Feature bits reported by nx_cpu_features(): raw CPUID bits, plus the OS_* bits that say the OS
 * saves the register state (XCR0) and, for AMX, grants it to this process (Linux arch_prctl).
 * A feature is usable only together with its OS_* bit; the ISA masks below combine them. */
enum {
    NX_CPU_SSE2 = 1u << 0,
    NX_CPU_AVX = 1u << 1,
    NX_CPU_AVX2 = 1u << 2,
    NX_CPU_FMA = 1u << 3,
    NX_CPU_F16C = 1u << 4,
    NX_CPU_AVX512F = 1u << 5,
    NX_CPU_AVX512BW = 1u << 6,
    NX_CPU_AVX512VL = 1u << 7,
    NX_CPU_AVX512DQ = 1u << 8,
    NX_CPU_AVX512VNNI = 1u << 9,
    NX_CPU_AVX512BF16 = 1u << 10,
    NX_CPU_OS_YMM = 1u << 11, /* OS saves YMM state (XCR0 bits 1, 2) */
    NX_CPU_OS_ZMM = 1u << 12, /* OS saves opmask + ZMM state (XCR0 bits 5, 6, 7) */
    NX_CPU_AVX512VBMI = 1u << 13,
    NX_CPU_AVXVNNI = 1u << 14, /* VEX-encoded VNNI (CPUID 7.1 EAX bit 4) */
    NX_CPU_AMX_TILE = 1u << 15,
    NX_CPU_AMX_INT8 = 1u << 16,
    NX_CPU_AMX_BF16 = 1u << 17,
    NX_CPU_OS_AMX = 1u << 18,        /* OS saves tile state (XCR0 bits 17, 18) */
    NX_CPU_AMX_PERMITTED = 1u << 19, /* Linux granted XTILEDATA (arch_prctl ARCH_REQ_XCOMP_PERM) */
};
#define NX_CPU_NFEATURES 20

/* Name of feature bit i ("sse2", "avx512bf16", "os_amx", ...), i in [0, NX_CPU_NFEATURES). */
const char *nx_cpu_feature_name(int i);

/* x86 SIMD variants (the *_<isa>.c files) exist only in x86 builds; elsewhere the build leaves
 * those files out, the probe reports no SIMD, and dispatch code wraps every reference to them in
 * NX_X86_ONLY(...) so that none remains. */
#if defined(__x86_64__) || defined(__i386__) || defined(_M_X64) || defined(_M_IX86)
#define NX_X86 1
#define NX_X86_ONLY(...) __VA_ARGS__
#else
#define NX_X86 0
#define NX_X86_ONLY(...)
#endif

/* A function always inlined into its caller (drivers and micro-kernels whose sizes must be
 * compile-time constants there). */
#define NX_INLINE static inline __attribute__((always_inline))

/* Feature bits each ISA target needs (CPU and OS). The compile flags of a target's files are in
 * setup.py (ISA_FLAGS, by file-name suffix) and must not exceed these bits. */
#define NX_ISA_NEEDS_AVX2 (NX_CPU_AVX | NX_CPU_AVX2 | NX_CPU_FMA | NX_CPU_F16C | NX_CPU_OS_YMM)
#define NX_ISA_NEEDS_AVX512                                                                        \
    (NX_ISA_NEEDS_AVX2 | NX_CPU_AVX512F | NX_CPU_AVX512BW | NX_CPU_AVX512VL | NX_CPU_AVX512DQ |    \
     NX_CPU_AVX512VNNI | NX_CPU_OS_ZMM)

/* AMX (Sapphire Rapids and later): the tile unit with its int8 and bf16 dot products, granted to
 * the process by the OS (XCR0 tile state and, on Linux, the XTILEDATA permission the probe asks
 * for). Everything else an AMX file may use is AVX512BF16's. */
#define NX_ISA_NEEDS_AMX                                                                           \
    (NX_ISA_NEEDS_AVX512 | NX_CPU_AVX512BF16 | NX_CPU_AMX_TILE | NX_CPU_AMX_INT8 |                 \
     NX_CPU_AMX_BF16 | NX_CPU_OS_AMX | NX_CPU_AMX_PERMITTED)

/* The ISA targets: X(ID, "name", needed feature bits, parent, rank). Dispatch for a target walks
 * target -> parent -> ... -> GENERIC and takes each kernel from the first target that has it
 * (nx_dispatch.h), so the targets form a tree, not a total order: a new target (say AVX-VNNI
 * under AVX2, or AVX512_BF16 under AVX512) is one line here. Preference is explicit: the default
 * target is the supported one of highest rank (ranks are distinct, and a child ranks above its
 * parent, whose code it runs anyway; tests/test_kernels_dispatch.py checks both). The position
 * in the list means nothing beyond a parent coming before its children: an AVX-VNNI target
 * (rank 15, between AVX2's 10 and AVX512's 20) can be appended after AVX512BF16 and never wins
 * over AVX-512 on a CPU that has both. Adding an ISA: a line here (and a probe bit above if it
 * needs a new feature), its files `nx_<family>_<isa>.c` exporting one table per family, one
 * line in each such family's table list, and its suffix + flags in setup.py.
 * AVX512BF16's only table is the lowp family's (nx_lowp_avx512bf16.c: the bf16 matmul and
 * rounding); every other kernel inherits AVX512's. AMX's tables (nx_*_amx.c) hold only what the
 * tile unit speeds up; the rest inherits AVX512BF16's. */
#define NX_ISA_LIST(X)                                                                             \
    X(GENERIC, "generic", 0u, GENERIC, 0)                                                          \
    X(AVX2, "avx2", NX_ISA_NEEDS_AVX2, GENERIC, 10)                                                \
    X(AVX512, "avx512", NX_ISA_NEEDS_AVX512, AVX2, 20)                                             \
    X(AVX512BF16, "avx512bf16", NX_ISA_NEEDS_AVX512 | NX_CPU_AVX512BF16, AVX512, 30)            \
    X(AMX, "amx", NX_ISA_NEEDS_AMX, AVX512BF16, 40)                                                \
    X(AVXVNNI, "avxvnni", NX_ISA_NEEDS_AVX2 | NX_CPU_AVXVNNI, AVX2, 15)

#define NX_ISA_ENUM_(id, name, needs, parent, rank) NX_ISA_##id,
typedef enum {
    NX_ISA_LIST(NX_ISA_ENUM_) NX_ISA_COUNT
} nx_isa;
#undef NX_ISA_ENUM_

/* Raw probe result (bit set of NX_CPU_*), computed once and cached. Ignores NXHPC_DISABLE_SIMD. */
uint32_t nx_cpu_features(void);

/* 1 if every feature bit the target needs is present (ignoring NXHPC_DISABLE_SIMD), else 0. */
int nx_cpu_isa_supported(nx_isa isa);

/* The default target: GENERIC when NXHPC_DISABLE_SIMD is set (and not "0"), else the supported
 * target of highest rank (NX_ISA_LIST) whose rank is at most that of the target named by
 * NXHPC_MAX_ISA, when set (e.g. "avx512bf16" runs an AMX CPU on the kernels of one without). */
nx_isa nx_cpu_best_isa(void);

/* The target's preference rank (NX_ISA_LIST); -1 outside [0, NX_ISA_COUNT). */
int nx_isa_rank(nx_isa isa);

/* "generic" / "avx2" / "avx512" ...; "unknown" outside [0, NX_ISA_COUNT). */
const char *nx_isa_name(nx_isa isa);

/* The target a kernel missing at `isa` is taken from; GENERIC for GENERIC. */
nx_isa nx_isa_parent(nx_isa isa);

/* Feature bits the target needs. */
uint32_t nx_isa_needs(nx_isa isa);

#endif
