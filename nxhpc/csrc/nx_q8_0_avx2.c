/* nx_q8_0_avx2.c -- AVX2 + FMA variant of the Q8_0 matmul (8-wide vectors, 16 ymm registers).
 *
 * Owns the matmul's AVX2 pieces for the shared blocked driver (nx_q8_0_matmul_blocked): the
 * weight-panel packer and a 6 x 16 micro-kernel (12 ymm accumulators + 2 weight vectors +
 * 1 broadcast). Runs the contract's two-level fma sum (nx_q8_0.h) in vector lanes, so its output
 * is bit-identical to the generic variant. Quantize/dequantize have no
 * AVX2 variant (they fall back to generic). Must not: change the FMA order, allocate per tile.
 */
#include "nx_q8_0.h"

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
_Static_assert(NX2_KC % NX_Q8_0_CHAIN == 0, "KC must be a multiple of the chain chunk");
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

static inline __m256 nx2_deq8(const uint8_t *q /* IN 8 int8 */, __m256 d) {
    __m128i b = _mm_loadl_epi64((const __m128i *)q);
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), d);
}

/* Dequantize columns [j0, j0+nc) x blocks [b0, b0+kb) into Bp: panel p (16 columns) at
 * Bp + p*kc*16, element [k*16 + j] = w[j0 + 16p + j, 32*b0 + k]; columns past nc are zero. */
static void nx2_pack_b(const uint8_t *w /* IN */, size_t rowbytes, size_t j0, size_t nc, size_t b0,
                       size_t kb, float *Bp /* OUT */) {
    const size_t kc = kb * NX_QK8_0;
    for (size_t p = 0; p * NX2_NR < nc; p++) {
        float *dst = Bp + p * kc * NX2_NR;
        for (int h = 0; h < 2; h++) {
            size_t c0 = p * NX2_NR + (size_t)h * 8;
            int ncol = c0 >= nc ? 0 : (nc - c0 >= 8 ? 8 : (int)(nc - c0));
            for (size_t b = 0; b < kb; b++) {
                float *db = dst + b * NX_QK8_0 * NX2_NR + h * 8;
                const uint8_t *base = w + (j0 + c0) * rowbytes + (b0 + b) * NX_Q8_0_BLOCK_BYTES;
                for (int q = 0; q < 4; q++) {
                    __m256 r[8];
                    for (int i = 0; i < 8; i++) {
                        if (i < ncol) {
                            const uint8_t *blk = base + (size_t)i * rowbytes;
                            uint16_t dh;
                            memcpy(&dh, blk, 2);
                            r[i] = nx2_deq8(blk + 2 + q * 8, _mm256_set1_ps(_cvtsh_ss(dh)));
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

/* One chunk (kc <= NX_Q8_0_CHAIN) of the two-level sum (see nx_q8_0.h): p = fma chain from +0,
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
}

static const nx_q8_0_tiling nx2_tiling = {NX2_MR, NX2_NR, NX2_KC, NX2_NC, NX2_MC, nx2_pack_b,
                                          nx2_kern};

int nx_q8_0_matmul_avx2(const float *x /* IN [T*K] */, const uint8_t *w /* IN [N rows] */,
                        float *out /* OUT [T*N] */, size_t T, size_t K, size_t N,
                        size_t n0, size_t n1) {
    return nx_q8_0_matmul_blocked(&nx2_tiling, x, w, out, T, K, N, n0, n1);
}
