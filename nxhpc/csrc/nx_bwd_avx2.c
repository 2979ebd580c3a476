/* nx_bwd_avx2.c -- AVX2+FMA variants of the backward kernels where scalar code is far slower:
 * swiglu (8-lane exp polynomial instead of libm) and attention (4x16 micro-kernels of the tiled
 * float32 driver nx_attention_bwd_tiled in nx_bwd.h, sized for 16 ymm registers); exports
 * nx_bwd_table_avx2 with those two slots, the others inherit generic. Must not: be entered unless
 * nx_cpu_isa_supported(NX_ISA_AVX2) (dispatch in nx_bwd.c). */
#define NX_BWD_TILED_DRIVER
#include "nx_bwd.h"
#include "nx_vmath_avx2.h" /* nx_mask8, nx_exp8, nx_hmax8, nx_hsum8 (shared with nx_ops_avx2.c) */

#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------ swiglu */

#include "nx_bwd_ew.h" /* swiglu_backward (both widths) */

/* ------------------------------------------------------------------ attention */

/* Micro-blocks of 4 query rows x 16 keys (2 ymm per row): 8 accumulators + 2 loads + 1
 * broadcast fit the 16 ymm registers in every kernel. */
#define NX_B2R 4
#define NX_B2C 16
#define NX_B2QB 48 /* query rows per block, multiple of NX_B2R (as the AVX-512 variant) */
_Static_assert(NX_B2QB % NX_B2R == 0, "query block must hold whole micro-blocks");

_Static_assert(NX_B2R <= 4 && NX_B2C == 16, "the score tile is nx_dot_4x16's");

static inline void nx_b2_qk(const float *X, int64_t hd, const float *YT, float *S, int64_t ld) {
    nx_dot_4x16(NX_B2R, X, hd, YT, S, ld);
}

static inline void nx_b2_outer(const float *X, int64_t hd, const float *P, int64_t ld, float *ZT) {
    __m256 p[NX_B2R][2];
    for (int r = 0; r < NX_B2R; r++) {
        p[r][0] = _mm256_load_ps(P + r * ld);
        p[r][1] = _mm256_load_ps(P + r * ld + 8);
    }
    for (int64_t d = 0; d < hd; d++) {
        float *zd = ZT + d * NX_B2C;
        __m256 z0 = _mm256_load_ps(zd), z1 = _mm256_load_ps(zd + 8);
        for (int r = 0; r < NX_B2R; r++) {
            __m256 bb = _mm256_broadcast_ss(X + r * hd + d);
            z0 = _mm256_fmadd_ps(bb, p[r][0], z0);
            z1 = _mm256_fmadd_ps(bb, p[r][1], z1);
        }
        _mm256_store_ps(zd, z0);
        _mm256_store_ps(zd + 8, z1);
    }
}

/* O[r, c:c+8nv] += sum_{j<nk} P[r, j] Y[j, c:c+8nv]; lanes past hd masked; nv in {1, 2}. */
NX_INLINE void nx_b2_pv(const int nv, const float *P, int64_t ld, const float *Y, int64_t hd,
                        int64_t nk, int64_t c, float *O, int64_t hdp) {
    __m256 acc[NX_B2R][2];
    __m256i mk[2];
    for (int v = 0; v < nv; v++) mk[v] = nx_mask8(hd - c - 8 * v);
    for (int r = 0; r < NX_B2R; r++)
        for (int v = 0; v < nv; v++) acc[r][v] = _mm256_load_ps(O + r * hdp + c + 8 * v);
    for (int64_t j = 0; j < nk; j++) {
        __m256 yv[2];
        for (int v = 0; v < nv; v++) yv[v] = _mm256_maskload_ps(Y + j * hd + c + 8 * v, mk[v]);
        for (int r = 0; r < NX_B2R; r++) {
            __m256 bb = _mm256_broadcast_ss(P + r * ld + j);
            for (int v = 0; v < nv; v++) acc[r][v] = _mm256_fmadd_ps(bb, yv[v], acc[r][v]);
        }
    }
    for (int r = 0; r < NX_B2R; r++)
        for (int v = 0; v < nv; v++) _mm256_store_ps(O + r * hdp + c + 8 * v, acc[r][v]);
}

static inline void nx_b2_pv_rows(const float *P, int64_t ld, const float *Y, int64_t hd, int64_t nk,
                                 float *O, int64_t hdp) {
    int64_t c = 0;
    for (; c + 16 <= hdp; c += 16) nx_b2_pv(2, P, ld, Y, hd, nk, c, O, hdp);
    for (; c < hdp; c += 8) nx_b2_pv(1, P, ld, Y, hd, nk, c, O, hdp);
}

/* nx_b2_softmax_ds: phase 2 for one row, nx_bwd_ew.h (both widths) */

static const nx_attn_bwd_tiling nx_attn_bwd_tiling_avx2 = {
    NX_B2R, NX_B2C, NX_B2QB, 8, nx_b2_qk, nx_b2_outer, nx_b2_pv_rows, nx_b2_softmax_ds};

int nx_attention_bwd_f32_avx2(const float *q, const float *k, const float *v, const float *dout,
                              const uint8_t *mask, float *dq, float *dk, float *dv, int64_t T,
                              int64_t H, int64_t KVH, int64_t hd, float scale, int64_t g0,
                              int64_t g1) {
    return nx_attention_bwd_tiled(&nx_attn_bwd_tiling_avx2, q, k, v, dout, mask, dq, dk, dv, T, H,
                                  KVH, hd, scale, g0, g1);
}

/* Only swiglu and attention have AVX2 variants; the other slots inherit generic. */
const nx_bwd_table nx_bwd_table_avx2 = {
    .swiglu_backward = nx_swiglu_bwd_f32_avx2,
    .attention_backward = nx_attention_bwd_f32_avx2,
};
