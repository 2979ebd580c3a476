/* nx_matmul_avx2.c -- AVX2 + FMA variant of the matmul (8-wide vectors, 16 ymm registers);
 * exports nx_mm_table_avx2.
 *
 * Owns the matmul's AVX2 pieces for the shared blocked driver (nx_matmul_blocked): its tile
 * sizes and a 6 x 16 micro-kernel (12 ymm accumulators + 2 weight vectors + 1 broadcast); the
 * panel packers (generic: dequantize 8 rows x 256 values into a stack scratch, transpose 8 x 8;
 * fused Q8_0) are nx_matmul_pack.h at 8 lanes. Runs the contract's two-level fma sum
 * (nx_matmul.h) in vector lanes, so its output is bit-identical to the generic variant.
 * Must not: change the FMA order, allocate per tile.
 */
#include "nx_matmul.h"
#include "nx_matmul_pack.h" /* pack_rows, pack_q8_0 (both widths) */
#include "nx_simd.h"

#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

/* 6 x 16 micro-kernel (all 16 ymm registers). KC/NC measured on this project's host (T=256,
 * K in {3840, 10240}, N=3840): every KC in {256, 512, 1024} x NC in {128, 256} gave 118-121
 * GFLOP/s (the 2 x ymm FMA/cycle peak is ~131); 512 x 256 was among the best at both K. */
#define NX2_MR 6
#define NX2_NR 16
#define NX2_KC 512
#define NX2_NC 256
#define NX2_MC 264
_Static_assert(NX2_KC % NX_MM_KC_ALIGN == 0, "KC must hold whole chains and whole 256-blocks");
_Static_assert(NX2_NC % NX2_NR == 0, "NC must be a multiple of NR");
_Static_assert(NX2_MC % NX2_MR == 0, "MC must be a multiple of MR");

_Static_assert(NX2_NR == NXP_NR, "the shared packers write panels of 2 vectors");

/* ------------------------------------------------------------------ micro-kernel */

/* One chunk (kc <= NX_MM_CHAIN) of the two-level sum (see nx_matmul.h): p = fma chain from +0,
 * then C = first ? p : C + p. The k loop always runs
 * all NX2_MR rows (rows past mr read the zero padding of Ap and are never stored): a fixed-size
 * loop lets GCC keep the 12 accumulators in registers. Masks are built outside the k loop only. */
static void nx2_kern(int mr, int nr, size_t kc, const float *A /* IN [kc][MR] */,
                     const float *B /* IN [kc][16] */, float *C /* IN/OUT */, size_t ldc,
                     int first) {
    const int32_t lanes[8] = {0, 1, 2, 3, 4, 5, 6, 7};
    const __m256i lane = _mm256_loadu_si256((const __m256i *)lanes);
    __m256 c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51;
    c00 = c01 = c10 = c11 = c20 = c21 = c30 = c31 = c40 = c41 = c50 = c51 = _mm256_setzero_ps();
    /* one line per register row: */
    /* clang-format off */
    for (size_t k = 0; k < kc; k++) {
        const float *a = A + k * NX2_MR;
        __m256 b0 = _mm256_load_ps(B + k * NX2_NR), b1 = _mm256_load_ps(B + k * NX2_NR + 8), t;
        t = _mm256_broadcast_ss(a + 0); c00 = _mm256_fmadd_ps(t, b0, c00); c01 = _mm256_fmadd_ps(t, b1, c01);
        t = _mm256_broadcast_ss(a + 1); c10 = _mm256_fmadd_ps(t, b0, c10); c11 = _mm256_fmadd_ps(t, b1, c11);
        t = _mm256_broadcast_ss(a + 2); c20 = _mm256_fmadd_ps(t, b0, c20); c21 = _mm256_fmadd_ps(t, b1, c21);
        t = _mm256_broadcast_ss(a + 3); c30 = _mm256_fmadd_ps(t, b0, c30); c31 = _mm256_fmadd_ps(t, b1, c31);
        t = _mm256_broadcast_ss(a + 4); c40 = _mm256_fmadd_ps(t, b0, c40); c41 = _mm256_fmadd_ps(t, b1, c41);
        t = _mm256_broadcast_ss(a + 5); c50 = _mm256_fmadd_ps(t, b0, c50); c51 = _mm256_fmadd_ps(t, b1, c51);
    }
    __m256i m0 = _mm256_cmpgt_epi32(_mm256_set1_epi32(nr), lane);
    __m256i m1 = _mm256_cmpgt_epi32(_mm256_set1_epi32(nr - 8), lane);
    /* A whole-width tile (nr == 16) is read and written with plain moves, the same values. On
     * the AMD EPYC Zen 3 (family 25 model 1) a loop of masked 256-bit stores took 4.2-7.1 ns a
     * store against 0.4-0.7 ns for plain ones (benchmarks/probes/avx2_tile_stores.c); this
     * tile runs once per NX_MM_CHAIN (128) k-steps, 12 stores (and 12 loads after the first)
     * each time, and with plain moves T=256, K=N=3840 on Q4_K weights went from 74.5 to 85.8
     * GOP/s (one thread, best of 4 alternated rounds, benchmarks/ab_checkouts.py). The same for
     * the bf16 (nx_lowp_bf16_avx2.c) and q8 (nx_q8a_avx2.h) tiles. */
    const int whole = nr == NX2_NR;
#define NX2_LD(p, m) (whole ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, m))
#define NX2_SV(p, m, v) (whole ? _mm256_storeu_ps(p, v) : _mm256_maskstore_ps(p, m, v))
#define NX2_ST(r, a0, a1) if (mr > r) { \
        if (!first) { a0 = _mm256_add_ps(NX2_LD(C + r * ldc, m0), a0); \
                      a1 = _mm256_add_ps(NX2_LD(C + r * ldc + 8, m1), a1); } \
        NX2_SV(C + r * ldc, m0, a0); NX2_SV(C + r * ldc + 8, m1, a1); }
    NX2_ST(0, c00, c01) NX2_ST(1, c10, c11) NX2_ST(2, c20, c21)
    NX2_ST(3, c30, c31) NX2_ST(4, c40, c41) NX2_ST(5, c50, c51)
#undef NX2_ST
#undef NX2_LD
#undef NX2_SV
    /* clang-format on */
}

/* ------------------------------------------------------------------ the table */

static const nx_mm_tiling nx_mm_tiling_avx2 = {
    .mr = NX2_MR,
    .nr = NX2_NR,
    .kc = NX2_KC,
    .nc = NX2_NC,
    .mc = NX2_MC,
    .pack_rows = nx_mm_pack_rows_avx2,
    .pack_fused = {[NX_GGML_Q8_0] = nx_mm_pack_q8_0_avx2},
    .kern = nx2_kern,
};

int nx_matmul_avx2(const nx_mm_call *c) { return nx_matmul_blocked(&nx_mm_tiling_avx2, c); }

static int nx_matmul_packer_avx2(uint32_t type) {
    return nx_mm_tiling_packer(&nx_mm_tiling_avx2, type);
}

const nx_mm_table nx_mm_table_avx2 = {.matmul = nx_matmul_avx2,
                                      .matmul_packer = nx_matmul_packer_avx2};
