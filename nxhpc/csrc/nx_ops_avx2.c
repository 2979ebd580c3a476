/* nx_ops_avx2.c -- AVX2+FMA variants of the block's non-matmul kernels; exports nx_ops_table_avx2.
 * Owns: qk-norm+RoPE in 8 lanes and, for 16-register machines, the register-blocked
 * flash-attention micro-block (4 rows x 16 keys) run by the shared tiled driver (nx_attn_tiled.h).
 * The element-wise kernels are the shared nx_ops_ew.h at 8 lanes; the 8-lane exp/tanh/silu
 * polynomials, lane masks and horizontal max/sum are shared with nx_bwd_avx2.c (nx_vmath_avx2.h).
 * Must not: be entered unless nx_cpu_isa_supported(NX_ISA_AVX2) (dispatch: nx_ops.c). */
#include "nx_ops.h"
#include "nx_attn_tiled.h"
#include "nx_ops_ew.h" /* rmsnorm, layernorm_mod, swiglu, gated_residual, norm_residual, vmath */
#include "nx_vmath_avx2.h"

#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------ qknorm + rope */

/* The adjacent-pairs row of nx_ops_ew.h's qknorm_rope in 8 lanes (as the AVX-512 one, the even
 * / odd floats gathered by two shuffles and a cross-lane permute). */
static inline void nxv_qknorm_rope_adjacent_row(const float *xr, float invf, const float *wt,
                                                const float *p, float *o, int64_t hd) {
    const __m256 inv = _mm256_set1_ps(invf);
    int64_t i = 0;
    for (; i + 8 <= hd; i += 8) {
        const __m256 y =
            _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + i), inv), _mm256_loadu_ps(wt + i));
        const __m256 p0 = _mm256_loadu_ps(p + 2 * i), p1 = _mm256_loadu_ps(p + 2 * i + 8);
        const __m256 a = _mm256_castpd_ps(_mm256_permute4x64_pd(
            _mm256_castps_pd(_mm256_shuffle_ps(p0, p1, _MM_SHUFFLE(2, 0, 2, 0))), 0xD8));
        const __m256 b = _mm256_castpd_ps(_mm256_permute4x64_pd(
            _mm256_castps_pd(_mm256_shuffle_ps(p0, p1, _MM_SHUFFLE(3, 1, 3, 1))), 0xD8));
        _mm256_storeu_ps(o + i, _mm256_add_ps(_mm256_mul_ps(a, _mm256_moveldup_ps(y)),
                                              _mm256_mul_ps(b, _mm256_movehdup_ps(y))));
    }
    for (; i < hd; i += 2) nx_qknorm_rope_pair(xr, invf, wt, p, o, i); /* tail: the spec */
}

/* ------------------------------------------------------------------ flash attention */

/* 16 ymm registers: micro-block of 4 query rows x 16 keys (2 ymm): S = Q K^T with 8 accumulators;
 * O += P V over 16 columns of hd at a time (8 accumulators). Rows never interact. */
#define NX2_BR 4
#define NX2_BC 16
#ifndef NX2_QB /* query rows sharing one pass over a K/V tile, multiple of NX2_BR */
#define NX2_QB 64
#endif

_Static_assert(NX2_BR <= 4 && NX2_BC == 16, "the score tile is nx_dot_4x16's");

NX_INLINE void nx2_pv_block(const int nr, const float *P, const float *alpha, const float *vt,
                            int64_t W, int64_t nk, int64_t c, int64_t hd, float *O, int64_t hdp,
                            unsigned subk) {
    __m256 acc[NX2_BR][2];
    __m256i m0 = nx_mask8(hd - c), m1 = nx_mask8(hd - c - 8);
    /* all 16 columns inside hd (every block when hd % 16 == 0, as the DiT's 128): plain loads of
     * the same values, 0-6% faster on AMD Zen 3 (docs/kernels.md); else the masked ones */
    const int whole = hd - c >= 16;
#define NX2_LDV(vr, v0, v1)                                                                        \
    __m256 v0 = whole ? _mm256_loadu_ps(vr) : _mm256_maskload_ps(vr, m0),                          \
           v1 = whole ? _mm256_loadu_ps((vr) + 8) : _mm256_maskload_ps((vr) + 8, m1)
    for (int r = 0; r < nr; r++) {
        __m256 a = _mm256_set1_ps(alpha[r]);
        acc[r][0] = _mm256_mul_ps(_mm256_load_ps(O + r * hdp + c), a);
        acc[r][1] = _mm256_mul_ps(_mm256_load_ps(O + r * hdp + c + 8), a);
    }
    if (!subk) {
        for (int64_t j = 0; j < nk; j++) {
            const float *vr = vt + j * W + c;
            NX2_LDV(vr, v0, v1);
            for (int r = 0; r < nr; r++) {
                __m256 p = _mm256_broadcast_ss(P + r * NX2_BC + j);
                acc[r][0] = _mm256_fmadd_ps(p, v0, acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(p, v1, acc[r][1]);
            }
        }
    } else { /* some weights may be subnormal: nx_pv_block's (nx_ops_avx512.c) skip rule */
        const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
        const __m256 big = _mm256_set1_ps(0x1p100f);
        for (int64_t j = 0; j < nk; j++) {
            const float *vr = vt + j * W + c;
            NX2_LDV(vr, v0, v1);
            for (int r = 0; r < nr; r++) {
                const float pj = P[r * NX2_BC + j];
                if ((subk >> j & 1) && pj > 0.0f && pj < 0x1p-126f) {
                    const __m256 c0 = _mm256_cmp_ps(_mm256_and_ps(v0, absm),
                                                    _mm256_mul_ps(_mm256_and_ps(acc[r][0], absm), big),
                                                    _CMP_LT_OQ);
                    const __m256 c1 = _mm256_cmp_ps(_mm256_and_ps(v1, absm),
                                                    _mm256_mul_ps(_mm256_and_ps(acc[r][1], absm), big),
                                                    _CMP_LT_OQ);
                    if (_mm256_movemask_ps(_mm256_and_ps(c0, c1)) == 0xFF) continue;
                }
                __m256 p = _mm256_set1_ps(pj);
                acc[r][0] = _mm256_fmadd_ps(p, v0, acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(p, v1, acc[r][1]);
            }
        }
    }
    for (int r = 0; r < nr; r++) {
        _mm256_store_ps(O + r * hdp + c, acc[r][0]);
        _mm256_store_ps(O + r * hdp + c + 8, acc[r][1]);
    }
}
#undef NX2_LDV

/* Online softmax of one micro-block's scores (in place: S -> P); the rescale factors
 * alpha[r] = exp(m_old - m_new) of all rows go through one vector exp. */
static inline unsigned nx2_softmax_rows(int nr, float *S, float scale, const float *madd,
                                        int64_t ms, float *m, float *l, float *alpha) {
    const __m256 sc = _mm256_set1_ps(scale);
    unsigned subk = 0; /* keys whose weight may be subnormal in some row (nx_exp_nosub_any) */
    float sums[NX2_BR], dm[8] = {0};
    for (int r = 0; r < nr; r++) {
        float *s = S + r * NX2_BC;
        const float *ma = madd + r * ms; /* this row's key mask (ms = 0: shared) */
        __m256 x0 = _mm256_fmadd_ps(_mm256_load_ps(s), sc, _mm256_load_ps(ma));
        __m256 x1 = _mm256_fmadd_ps(_mm256_load_ps(s + 8), sc, _mm256_load_ps(ma + 8));
        float mx = nx_hmax8(_mm256_max_ps(x0, x1));
        float m_new = mx > m[r] ? mx : m[r];
        float m_use = m_new == -INFINITY ? 0.0f : m_new; /* all keys masked so far: p = 0 */
        dm[r] = m[r] - m_use;
        m[r] = m_new;
        __m256 mu = _mm256_set1_ps(m_use);
        int lo0 = 0, lo1 = 0;
        __m256 p0 = nx_exp_nosub_any8(_mm256_sub_ps(x0, mu), &lo0);
        __m256 p1 = nx_exp_nosub_any8(_mm256_sub_ps(x1, mu), &lo1);
        subk |= (lo0 ? 0x00FFu : 0u) | (lo1 ? 0xFF00u : 0u);
        _mm256_store_ps(s, p0);
        _mm256_store_ps(s + 8, p1);
        sums[r] = nx_hsum8(_mm256_add_ps(p0, p1));
    }
    _mm256_storeu_ps(dm, nx_exp_nosub8(_mm256_loadu_ps(dm)));
    for (int r = 0; r < nr; r++) {
        alpha[r] = dm[r];
        l[r] = l[r] * dm[r] + sums[r];
    }
    return subk;
}

NX_INLINE void nx2_attn_micro(const int nr, const float *q, int64_t hd, const float *kt, float *S,
                              float scale, const float *madd, int64_t ms, float *m, float *l,
                              float *alpha, const float *vt, int64_t W, int64_t nk, float *O,
                              int64_t hdp) {
    nx_dot_4x16(nr, q, hd, kt, S, NX2_BC);
    const unsigned subk = nx2_softmax_rows(nr, S, scale, madd, ms, m, l, alpha);
    for (int64_t c = 0; c < hdp; c += 16)
        nx2_pv_block(nr, S, alpha, vt, W, nk, c, hd, O, hdp, subk);
}

NX_INLINE void nx2_attn_micro_any(int nr, const float *q, int64_t hd, const float *kt, float *S,
                                  float scale, const float *madd, int64_t ms, float *m, float *l,
                                  float *alpha, const float *vt, int64_t W, int64_t nk, float *O,
                                  int64_t hdp) {
    switch (nr) {
    case 4: nx2_attn_micro(4, q, hd, kt, S, scale, madd, ms, m, l, alpha, vt, W, nk, O, hdp); break;
    case 3: nx2_attn_micro(3, q, hd, kt, S, scale, madd, ms, m, l, alpha, vt, W, nk, O, hdp); break;
    case 2: nx2_attn_micro(2, q, hd, kt, S, scale, madd, ms, m, l, alpha, vt, W, nk, O, hdp); break;
    default:
        nx2_attn_micro(1, q, hd, kt, S, scale, madd, ms, m, l, alpha, vt, W, nk, O, hdp);
        break;
    }
}

_Static_assert(NX2_QB <= NX_ATTN_MAX_QB && NX2_QB % NX2_BR == 0, "query block size");
static const nx_attn_tiling nx2_attn_tiling_avx2 = {NX2_BR, NX2_BC, NX2_QB, nx2_attn_micro_any};

int nx_attention_f32_avx2(const float *q, const float *k, const float *qkv, const uint8_t *mask,
                          float *out, int64_t T, int64_t H, int64_t KVH, int64_t hd, float scale,
                          int64_t h0, int64_t h1, int64_t t0, int64_t t1, int causal) {
    return nx_attention_tiled(&nx2_attn_tiling_avx2, q, k, qkv, mask, out, T, H, KVH, hd, scale,
                              h0, h1, t0, t1, causal);
}

const nx_ops_table nx_ops_table_avx2 = NX_OPS_TABLE(avx2);
