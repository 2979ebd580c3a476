/* nx_peak.h -- register-only peak loops: how many operations per second one core can issue of
 * each vector / tile instruction the kernels are built on, measured on the CPU at hand.
 *
 * Owns: the list of peak kinds (below), each kind's operand layout and recurrence (the contract
 * tests/test_peak.py checks against closed forms), and the one table mapping a kind to its ISA
 * and its loop (nx_peak.c). Must not: touch memory inside the timed loop (operands and
 * accumulators are loaded into registers / tiles before it and stored after it), allocate, use
 * threads, or be part of the kernel dispatch families (a peak loop has no generic variant: a kind
 * the CPU lacks is unsupported, not emulated).
 *
 * Every loop has the signature
 *     void loop(size_t iters, const void *a, const void *b, void *acc)
 * and runs `iters` iterations of the kind's recurrence on all of its independent accumulators
 * (enough chains to cover the instruction's latency at full issue rate), starting from acc and
 * writing the final accumulators back to acc, so that the work cannot be optimised away.
 * a and b are broadcast operands shared by every chain. Layouts (C order) and recurrences:
 *
 *   fma_ymm   (avx2)        a, b float32[8];   acc float32[12][8]     12 ymm chains
 *             acc[c][l] := fmaf(acc[c][l], a[l], b[l])           (vfmadd213ps, one rounding)
 *   i8_ymm    (avx2)        a uint8[32], b int8[32]; acc int16[12][16]  12 ymm chains
 *             acc[c][l] := acc[c][l] + sat16(a[2l] b[2l] + a[2l+1] b[2l+1])
 *                                 (vpmaddubsw + vpaddw, the add wrapping mod 2^16: the int8 dot
 *                                 of the AVX2 q8 kernels, which widen every few steps)
 *   fma_zmm   (avx512)      a, b float32[16];  acc float32[16][16]    16 zmm chains
 *             acc[c][l] := fmaf(acc[c][l], a[l], b[l])
 *   vnni_zmm  (avx512)      a uint8[64], b int8[64]; acc int32[16][16]  16 zmm chains
 *             acc[c][l] += sum_{i<4} a[4l+i] * b[4l+i]           (vpdpbusd, wraps mod 2^32)
 *   bf16_zmm  (avx512bf16)  a, b bfloat16 bits uint16[32]; acc float32[16][16]  16 zmm chains
 *             acc[c][l] := vdpbf16ps step over the pair (2l, 2l+1)  (nx_lowp.h `bf16` contract)
 *   vnni_ymm  (avxvnni)     a uint8[32], b int8[32]; acc int32[12][8]  12 ymm chains
 *             acc[c][l] += sum_{i<4} a[4l+i] * b[4l+i]           (VEX vpdpbusd, wraps mod 2^32:
 *                                 the int8 dot of the AVX-VNNI q8 kernel)
 *   amx_int8  (amx)         a int8[2][16][64] (tiles A0, A1: 16 rows x 64 k);
 *                           b int8[2][16][64] (tiles B0, B1: 16 k-quads x 16 columns x 4 bytes);
 *                           acc int32[4][16][16] (tiles C0..C3, Ci*2+j += Ai . Bj)
 *             acc[2i+j][m][n] += sum_{k<64} a[i][m][k] * b[j][k/4][4n + k%4]   (tdpbssd, wraps)
 *   amx_bf16  (amx)         a uint16[2][16][32] bf16 bits (k pairs per row);
 *                           b uint16[2][16][32] (16 k-pairs x 16 columns x 2);
 *                           acc float32[4][16][16]
 *             acc[2i+j][m][n] += sum_{k<32} a[i][m][k] * b[j][k/2][2n + k%2]   (tdpbf16ps; the
 *             order and rounding of the 32 products inside one instruction are the hardware's:
 *             exact whenever every partial sum is an integer below 2^24, which is what the
 *             tests use)
 *
 * Operations counted per iteration (2 per multiply-add, FLOP or integer OP):
 *   fma_ymm 12*8*2 = 192; i8_ymm 12*16*2*2 = 768; fma_zmm 16*16*2 = 512; vnni_zmm 16*16*4*2 = 2048;
 *   bf16_zmm 16*16*2*2 = 1024; amx_int8 4*16*16*64*2 = 131072; amx_bf16 4*16*16*32*2 = 65536;
 *   vnni_ymm 12*8*4*2 = 768.
 * Chains: FMA and VNNI latencies are 4-5 cycles at up to 2 issues per cycle, so 12 ymm (the 16
 * ymm registers of AVX2 less a and b) and 16 zmm chains keep both ports busy; AMX takes the
 * 2 x 2 blocking of oneDNN's kernels (4 C, 2 A, 2 B tiles: all 8 tile registers).
 */
#ifndef NX_PEAK_H
#define NX_PEAK_H

#include <stddef.h>
#include <stdint.h>

#include "nx_cpu.h"

typedef void (*nx_peak_fn)(size_t iters, const void *a /* IN */, const void *b /* IN */,
                           void *acc /* INOUT */);

/* X(ID, "name", ISA, a bytes, b bytes, acc bytes, ops per iteration) */
#define NX_PEAK_KINDS(X)                                                                           \
    X(FMA_YMM, "fma_ymm", AVX2, 32, 32, 12 * 32, 192)                                              \
    X(I8_YMM, "i8_ymm", AVX2, 32, 32, 12 * 32, 768)                                                \
    X(FMA_ZMM, "fma_zmm", AVX512, 64, 64, 16 * 64, 512)                                            \
    X(VNNI_ZMM, "vnni_zmm", AVX512, 64, 64, 16 * 64, 2048)                                         \
    X(BF16_ZMM, "bf16_zmm", AVX512BF16, 64, 64, 16 * 64, 1024)                                     \
    X(AMX_INT8, "amx_int8", AMX, 2048, 2048, 4096, 131072)                                         \
    X(AMX_BF16, "amx_bf16", AMX, 2048, 2048, 4096, 65536)                                          \
    X(VNNI_YMM, "vnni_ymm", AVXVNNI, 32, 32, 12 * 32, 768)

#define NX_PEAK_ENUM_(id, name, isa, ab, bb, cb, ops) NX_PEAK_##id,
typedef enum { NX_PEAK_KINDS(NX_PEAK_ENUM_) NX_PEAK_COUNT } nx_peak_kind;
#undef NX_PEAK_ENUM_

typedef struct {
    const char *name;
    nx_isa isa;          /* the ISA target whose file holds the loop (nx_cpu.h) */
    size_t a_bytes, b_bytes, acc_bytes;
    uint64_t ops_per_iter;
    nx_peak_fn fn;       /* NULL where the build has no such loop (non-x86) */
} nx_peak_info;

/* The kind's row; NULL outside [0, NX_PEAK_COUNT). */
const nx_peak_info *nx_peak_get(int kind);

/* 1 if the loop of `kind` exists in this build and may run here: its ISA is supported by the CPU
 * and OS (nx_cpu_isa_supported) and NXHPC_DISABLE_SIMD is not set (every kind is SIMD). */
int nx_peak_supported(int kind);

/* Runs the loop of a supported kind (callers check nx_peak_supported and the buffer sizes). */
void nx_peak_run(int kind, size_t iters, const void *a /* IN */, const void *b /* IN */,
                 void *acc /* INOUT */);

/* The loops, one file per ISA target (compiled with that target's flags, setup.py). */
void nx_peak_fma_ymm_avx2(size_t iters, const void *a, const void *b, void *acc);
void nx_peak_i8_ymm_avx2(size_t iters, const void *a, const void *b, void *acc);
void nx_peak_fma_zmm_avx512(size_t iters, const void *a, const void *b, void *acc);
void nx_peak_vnni_zmm_avx512(size_t iters, const void *a, const void *b, void *acc);
void nx_peak_bf16_zmm_avx512bf16(size_t iters, const void *a, const void *b, void *acc);
void nx_peak_amx_int8_amx(size_t iters, const void *a, const void *b, void *acc);
void nx_peak_amx_bf16_amx(size_t iters, const void *a, const void *b, void *acc);
void nx_peak_vnni_ymm_avxvnni(size_t iters, const void *a, const void *b, void *acc);

#endif
