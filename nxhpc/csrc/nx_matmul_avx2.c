/* nx_matmul_avx2.c -- AVX2 + FMA variant of the matmul (8-wide vectors, 16 ymm registers);
 * exports nx_mm_table_avx2.
 *
 * Owns the matmul's AVX2 pieces for the shared blocked driver (nx_matmul_blocked): a 6 x 16
 * micro-kernel (12 ymm accumulators + 2 weight vectors + 1 broadcast), the generic panel packer
 * (any weight type: dequantize 8 rows x 256 values into a stack scratch, transpose 8 x 8) and the
 * fused Q8_0 packer. Runs the contract's two-level fma sum (nx_matmul.h) in vector lanes, so its
 * output is bit-identical to the generic variant. Must not: change the FMA order, allocate per
 * tile.
 */
#include "nx_matmul.h"
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

/* In-register 8x8 transpose: r[i][j] -> r[j][i]. */
static inline void nx2_tr8(__m256 r[8]) {
    __m256 t[8], s[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {
        s[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        s[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        s[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        s[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    /* s[4g + c], 128-bit lane L = rows 4g..4g+3 of column 4L + c */
    for (int c = 0; c < 4; c++) {
        r[c] = _mm256_permute2f128_ps(s[c], s[4 + c], 0x20);
        r[4 + c] = _mm256_permute2f128_ps(s[c], s[4 + c], 0x31);
    }
}

/* Columns [c0, c0+ncol) of panel half h (8 columns) that exist: ncol in 0..8. */
static inline int nx2_half_cols(size_t nc, size_t c0) {
    return c0 >= nc ? 0 : (nc - c0 >= 8 ? 8 : (int)(nc - c0));
}

/* ------------------------------------------------------------------ packers */

/* The generic packer (any weight type): per 8-column half of each 16-column panel and span of
 * <= 256 k-values, c->dequant the rows into an 8 x 256 stack scratch, then transpose 8 x 8
 * tiles into Bp[k*16 + j]. Columns past nc are zero. */
static void nx2_pack_rows(const nx_mm_call *c, size_t j0, size_t nc, size_t b0, size_t kb,
                          float *Bp /* OUT */) {
    const size_t E = c->wt->blck_elems, BB = c->wt->blck_bytes, kc = kb * E;
    float scratch[8 * NX_MM_PACK_SPAN] __attribute__((aligned(32)));
    for (size_t p = 0; p * NX2_NR < nc; p++) {
        float *dst = Bp + p * kc * NX2_NR;
        for (int h = 0; h < 2; h++) {
            const size_t c0 = p * NX2_NR + (size_t)h * 8;
            const int ncol = nx2_half_cols(nc, c0);
            if (ncol == 0) {
                for (size_t k = 0; k < kc; k++)
                    _mm256_store_ps(dst + k * NX2_NR + h * 8, _mm256_setzero_ps());
                continue;
            }
            for (size_t s0 = 0; s0 < kc; s0 += NX_MM_PACK_SPAN) {
                const size_t span = kc - s0 < NX_MM_PACK_SPAN ? kc - s0 : NX_MM_PACK_SPAN;
                const uint8_t *base = c->w + (j0 + c0) * c->rowbytes + (b0 + s0 / E) * BB;
                for (int i = 0; i < ncol; i++)
                    c->dequant(base + (size_t)i * c->rowbytes, scratch + i * NX_MM_PACK_SPAN,
                               span / E);
                for (size_t k0 = 0; k0 < span; k0 += 8) {
                    const __m256i m = nx_mask8((int64_t)(span - k0));
                    __m256 r[8];
                    for (int i = 0; i < 8; i++)
                        r[i] = i < ncol ? _mm256_maskload_ps(scratch + i * NX_MM_PACK_SPAN + k0, m)
                                        : _mm256_setzero_ps();
                    nx2_tr8(r);
                    const size_t nk = span - k0 < 8 ? span - k0 : 8;
                    for (size_t k = 0; k < nk; k++)
                        _mm256_store_ps(dst + (s0 + k0 + k) * NX2_NR + h * 8, r[k]);
                }
            }
        }
    }
}

/* Fused Q8_0 packer: dequantize (exact) and transpose in registers, columns [j0, j0+nc) x blocks
 * [b0, b0+kb) into Bp: panel p (16 columns) at Bp + p*kc*16, element [k*16 + j] =
 * w[j0 + 16p + j, 32*b0 + k]; columns past nc are zero. */
static void nx2_pack_q8_0(const nx_mm_call *c, size_t j0, size_t nc, size_t b0, size_t kb,
                          float *Bp /* OUT */) {
    const size_t kc = kb * NX_QK8_0, rowbytes = c->rowbytes;
    for (size_t p = 0; p * NX2_NR < nc; p++) {
        float *dst = Bp + p * kc * NX2_NR;
        for (int h = 0; h < 2; h++) {
            const size_t c0 = p * NX2_NR + (size_t)h * 8;
            const int ncol = nx2_half_cols(nc, c0);
            for (size_t b = 0; b < kb; b++) {
                float *db = dst + b * NX_QK8_0 * NX2_NR + h * 8;
                const uint8_t *base =
                    c->w + (j0 + c0) * rowbytes + (b0 + b) * sizeof(nx_block_q8_0);
                for (int q = 0; q < 4; q++) {
                    __m256 r[8];
                    for (int i = 0; i < 8; i++) {
                        if (i < ncol) {
                            const uint8_t *blk = base + (size_t)i * rowbytes;
                            uint16_t dh;
                            memcpy(&dh, blk, 2);
                            r[i] = nxv_load_q8(blk + 2 + q * 8, _mm256_set1_ps(_cvtsh_ss(dh)));
                        } else {
                            r[i] = _mm256_setzero_ps();
                        }
                    }
                    nx2_tr8(r);
                    for (int k = 0; k < 8; k++) _mm256_store_ps(db + (q * 8 + k) * NX2_NR, r[k]);
                }
            }
        }
    }
}

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
#define NX2_ST(r, a0, a1) if (mr > r) { \
        if (!first) { a0 = _mm256_add_ps(_mm256_maskload_ps(C + r * ldc, m0), a0); \
                      a1 = _mm256_add_ps(_mm256_maskload_ps(C + r * ldc + 8, m1), a1); } \
        _mm256_maskstore_ps(C + r * ldc, m0, a0); _mm256_maskstore_ps(C + r * ldc + 8, m1, a1); }
    NX2_ST(0, c00, c01) NX2_ST(1, c10, c11) NX2_ST(2, c20, c21)
    NX2_ST(3, c30, c31) NX2_ST(4, c40, c41) NX2_ST(5, c50, c51)
#undef NX2_ST
    /* clang-format on */
}

/* ------------------------------------------------------------------ the table */

static const nx_mm_tiling nx_mm_tiling_avx2 = {
    .mr = NX2_MR,
    .nr = NX2_NR,
    .kc = NX2_KC,
    .nc = NX2_NC,
    .mc = NX2_MC,
    .pack_rows = nx2_pack_rows,
    .pack_fused = {[NX_GGML_Q8_0] = nx2_pack_q8_0},
    .kern = nx2_kern,
};

int nx_matmul_avx2(const nx_mm_call *c) { return nx_matmul_blocked(&nx_mm_tiling_avx2, c); }

static int nx_matmul_packer_avx2(uint32_t type) {
    return nx_mm_tiling_packer(&nx_mm_tiling_avx2, type);
}

const nx_mm_table nx_mm_table_avx2 = {.matmul = nx_matmul_avx2,
                                      .matmul_packer = nx_matmul_packer_avx2};
