/* nx_matmul_avx512.c -- AVX-512 (F/BW/VL/DQ) variant of the matmul; exports nx_mm_table_avx512.
 *
 * Owns the matmul's AVX-512 pieces for the shared blocked driver (nx_matmul_blocked): its tile
 * sizes and the register-blocked MR x 32 micro-kernel that runs the contract's fma chain in
 * vector lanes (one lane = one output column). The panel packers (generic: dequantize 16 rows x
 * 256 values with the type's dequantize into a stack scratch, then transpose 16 x 16 in
 * registers; fused Q8_0: decode and transpose in registers) are nx_matmul_pack.h at 16 lanes.
 * Entered only after the CPU probe reports AVX-512 + OS ZMM support. Must not: change the
 * per-output FMA order (see nx_matmul.h), allocate per tile, or use threads.
 */
#include "nx_matmul.h"
#include "nx_matmul_pack.h" /* pack_rows, pack_q8_0 (both widths) */
#include "nx_simd.h"

#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

/* Blocking, measured on this project's Zen 5 host (2 x 512-bit FMA/cycle, 48 KiB L1d, 1 MiB L2;
 * thread-CPU time, best of 5, T=256, K in {3840, 10240}, N in {3840, 11520}):
 *   MR x NR = 12 x 32: 24 zmm accumulators + 2 weight vectors + 1 broadcast. MR=14 measured the
 *     same (within 1%), so the smaller tail tile wins.
 *   KC = 1024: k-depth of one pass (C tile read-modify-written K/KC times; A micro-panel
 *     MR*KC*4 = 48 KiB streams through L1). 1024: 239/241/233 GFLOP/s; 512: 232/238/231;
 *     256: 222/-/-; 128: 219/-/-.
 *   NC = 128: columns per dequantized weight panel (KC*NC*4 = 512 KiB, L2); 64..256 within 1%.
 *   MC = 264: tokens per packed activation block (MC*K*4 bytes); weights are dequantized once per
 *     block, so T <= MC dequantizes each weight exactly once. 132 and 528 were 1-3% slower.
 * On the AMX Xeon (family 6 model 167, `fma_zmm` 216.7 GFLOP/s a core; 2026-12-05), one thread,
 * the zimage-1l-q4km file's Q4_K w1 (N=10240) / Q6_K w2 / Q4_K out-proj at T=256 and 1152:
 * 125-137 GFLOP/s (0.58-0.63 of `fma_zmm`). perf: this micro-kernel 83% of the samples, the
 * Q4_K dequantize 9%, the panel packer 3%. The micro-kernel alone on L1-resident operands runs
 * 178-181 GFLOP/s at 128-step chains (0.82-0.84), and a /tmp loop of its form at 6 x 64, 8 x 48
 * and 14 x 32 ran 181-188: the loop is at that ceiling. Tried, none kept: KC 256 / 512, NC 256,
 * MR 14 (all within 2%); a B micro-panel held in L1 (a timing build: the same); the k loop
 * unrolled 2-8 (the same); the tiles' running sums kept in a packed buffer between chains and
 * written to `out` once (bit-identical): one thread +3-4% on N=10240 with numpy outputs, and
 * no change in a 2-worker block (`blockrun zimage-1l-q4km-1k 2 --precision f32 --repeat 3`:
 * 1.659-1.669 s against 1.660-1.662, alternating). */
#ifndef NX_MR
#define NX_MR 12
#endif
#define NX_NR 32
#ifndef NX_KC
#define NX_KC 1024
#endif
#ifndef NX_NC
#define NX_NC 128
#endif
#ifndef NX_MC
#define NX_MC 264
#endif
_Static_assert(NX_MR >= 12 && NX_MR <= 14, "micro-kernel cases cover MR in 12..14");
_Static_assert(NX_KC % NX_MM_KC_ALIGN == 0, "KC must hold whole chains and whole 256-blocks");
_Static_assert(NX_NC % NX_NR == 0, "NC must be a multiple of NR");
_Static_assert(NX_MC % NX_MR == 0, "MC must be a multiple of MR");

_Static_assert(NX_NR == NXP_NR, "the shared packers write panels of 2 vectors");

/* ------------------------------------------------------------------ micro-kernel */

/* One chunk of the contract's two-level sum (kc <= NX_MM_CHAIN) for C[0:mr, 0:32], masked to
 * the valid columns:  p = +0;  p = fma(A[k][r], B[k][j], p) for k < kc;  C = first ? p : C + p. */
NX_INLINE void nx_kern(const int mr, size_t kc, const float *A /* IN [kc][MR] */,
                       const float *B /* IN [kc][32] */, float *C /* IN/OUT */, size_t ldc,
                       __mmask16 m0, __mmask16 m1, int first) {
    __m512 c0[NX_MR], c1[NX_MR];
    for (int r = 0; r < NX_MR; r++) {
        if (r < mr) {
            c0[r] = _mm512_setzero_ps();
            c1[r] = _mm512_setzero_ps();
        }
    }
    for (size_t k = 0; k < kc; k++) {
        __m512 b0 = _mm512_load_ps(B + k * NX_NR), b1 = _mm512_load_ps(B + k * NX_NR + 16);
        for (int r = 0; r < NX_MR; r++) {
            if (r < mr) {
                __m512 a = _mm512_set1_ps(A[k * NX_MR + r]);
                c0[r] = _mm512_fmadd_ps(a, b0, c0[r]);
                c1[r] = _mm512_fmadd_ps(a, b1, c1[r]);
            }
        }
    }
    for (int r = 0; r < NX_MR; r++) {
        if (r < mr) {
            if (!first) {
                c0[r] = _mm512_add_ps(_mm512_maskz_loadu_ps(m0, C + r * ldc), c0[r]);
                c1[r] = _mm512_add_ps(_mm512_maskz_loadu_ps(m1, C + r * ldc + 16), c1[r]);
            }
            _mm512_mask_storeu_ps(C + r * ldc, m0, c0[r]);
            _mm512_mask_storeu_ps(C + r * ldc + 16, m1, c1[r]);
        }
    }
}

/* clang-format off */
#define NX_KERN_CASE(M) case M: nx_kern(M, kc, A, B, C, ldc, m0, m1, first); break;

/* The driver's kern (see nx_mm_tiling): masks for the nr valid columns, then the micro-kernel
 * compiled for this row count. */
static void nx_kern_any(int mr, int nr, size_t kc, const float *A, const float *B, float *C,
                        size_t ldc, int first) {
    const __mmask16 m0 = nr >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << nr) - 1u);
    const __mmask16 m1 = nr >= 32 ? (__mmask16)0xffff
                       : nr > 16 ? (__mmask16)((1u << (nr - 16)) - 1u) : (__mmask16)0;
    switch (mr) {
#if NX_MR >= 14
    NX_KERN_CASE(14)
#endif
#if NX_MR >= 13
    NX_KERN_CASE(13)
#endif
    NX_KERN_CASE(12) NX_KERN_CASE(11) NX_KERN_CASE(10) NX_KERN_CASE(9) NX_KERN_CASE(8)
    NX_KERN_CASE(7) NX_KERN_CASE(6) NX_KERN_CASE(5) NX_KERN_CASE(4) NX_KERN_CASE(3)
    NX_KERN_CASE(2) NX_KERN_CASE(1)
    default: __builtin_unreachable();   /* 1 <= mr <= NX_MR by construction */
    }
}
#undef NX_KERN_CASE
/* clang-format on */

/* ------------------------------------------------------------------ the table */

static const nx_mm_tiling nx_mm_tiling_avx512 = {
    .mr = NX_MR,
    .nr = NX_NR,
    .kc = NX_KC,
    .nc = NX_NC,
    .mc = NX_MC,
    .pack_rows = nx_mm_pack_rows_avx512,
    .pack_fused = {[NX_GGML_Q8_0] = nx_mm_pack_q8_0_avx512},
    .kern = nx_kern_any,
};

int nx_matmul_avx512(const nx_mm_call *c) { return nx_matmul_blocked(&nx_mm_tiling_avx512, c); }

static int nx_matmul_packer_avx512(uint32_t type) {
    return nx_mm_tiling_packer(&nx_mm_tiling_avx512, type);
}

const nx_mm_table nx_mm_table_avx512 = {.matmul = nx_matmul_avx512,
                                        .matmul_packer = nx_matmul_packer_avx512};
