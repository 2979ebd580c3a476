/* nx_ops_avx512.c -- AVX-512 (F/DQ/BW/VL) variants of the block's non-matmul kernels; exports
 * nx_ops_table_avx512.
 * Owns: qk-norm+RoPE in 16 lanes and the register-blocked flash-attention micro-block (6 rows x
 * 64 keys) run by the shared tiled driver (nx_attn_tiled.h). The element-wise kernels are the
 * shared nx_ops_ew.h at 16 lanes; the exp/tanh/silu polynomials, lane masks and the float64
 * reduction tree are shared with nx_bwd_avx512.c (nx_vmath_avx512.h).
 * Must not: be entered unless nx_cpu_isa_supported(NX_ISA_AVX512) (dispatch in nx_ops.c). */
#include "nx_ops.h"
#include "nx_attn_tiled.h"
#include "nx_ops_ew.h" /* rmsnorm, layernorm_mod, swiglu, gated_residual, norm_residual, vmath */
#include "nx_vmath_avx512.h"

#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------ qknorm + rope */

/* The adjacent-pairs row of nx_ops_ew.h's qknorm_rope in 16 lanes: per output lane 2i + r the
 * pair's matrix entries pe[., ., r, 0] / [r, 1] (the even / odd floats of pe's 32 at 2i) and
 * y[2i] / y[2i+1] (moveldup / movehdup). */
static inline void nxv_qknorm_rope_adjacent_row(const float *xr, float invf, const float *wt,
                                                const float *p, float *o, int64_t hd) {
    const __m512i ev = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i od = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    const __m512 inv = _mm512_set1_ps(invf);
    int64_t i = 0;
    for (; i + 16 <= hd; i += 16) {
        const __m512 y =
            _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(xr + i), inv), _mm512_loadu_ps(wt + i));
        const __m512 p0 = _mm512_loadu_ps(p + 2 * i), p1 = _mm512_loadu_ps(p + 2 * i + 16);
        const __m512 a = _mm512_permutex2var_ps(p0, ev, p1); /* pe[.,.,r,0] per output lane */
        const __m512 b = _mm512_permutex2var_ps(p0, od, p1); /* pe[.,.,r,1] */
        _mm512_storeu_ps(o + i, _mm512_add_ps(_mm512_mul_ps(a, _mm512_moveldup_ps(y)),
                                              _mm512_mul_ps(b, _mm512_movehdup_ps(y))));
    }
    for (; i < hd; i += 2) nx_qknorm_rope_pair(xr, invf, wt, p, o, i); /* tail: the spec */
}

/* ------------------------------------------------------------------ flash attention */

/* Register blocking: a micro-block of NX_BR query rows x a key tile of NX_BC keys (4 zmm):
 *   S = Q K^T   : 6x4 zmm accumulators, per d one broadcast of q[r,d] and 4 loads of packed K^T;
 *   softmax     : per row, online (running max m, running sum l, rescale alpha);
 *   O += P V    : 6 rows x 64 columns of hd (6x4 zmm), per key one broadcast of p[r,j], 4 loads of v.
 * Each row's arithmetic is the same whatever micro-block/tail it lands in (rows never interact). */
#define NX_BR 6
#define NX_BC 64
/* NX_QB: query rows sharing one pass over a K/V tile, multiple of NX_BR: 192 was fastest of
 * 6/24/48/96/192/384 at T=1024 hd=128 (214 vs 204 GFLOP/s at 48) */
#ifndef NX_QB
#define NX_QB 192
#endif

NX_INLINE void nx_qk_block(const int nr, const float *q, int64_t hd, const float *kt, float *S) {
    __m512 acc[NX_BR][4];
    for (int r = 0; r < nr; r++)
        for (int v = 0; v < 4; v++) acc[r][v] = _mm512_setzero_ps();
    for (int64_t d = 0; d < hd; d++) {
        const float *kd = kt + d * NX_BC;
        __m512 k0 = _mm512_load_ps(kd), k1 = _mm512_load_ps(kd + 16);
        __m512 k2 = _mm512_load_ps(kd + 32), k3 = _mm512_load_ps(kd + 48);
        for (int r = 0; r < nr; r++) {
            __m512 b = _mm512_set1_ps(q[r * hd + d]);
            acc[r][0] = _mm512_fmadd_ps(b, k0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(b, k1, acc[r][1]);
            acc[r][2] = _mm512_fmadd_ps(b, k2, acc[r][2]);
            acc[r][3] = _mm512_fmadd_ps(b, k3, acc[r][3]);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int v = 0; v < 4; v++) _mm512_store_ps(S + r * NX_BC + 16 * v, acc[r][v]);
}

/* O[r, c:c+16*nv] = O * alpha[r] + sum_j P[r, j] v[j, c:c+16*nv] (lanes beyond hd masked to 0);
 * nv in {1, 4} (a compile-time constant after inlining). */
NX_INLINE void nx_pv_block(const int nr, const int nv, const float *P, const float *alpha,
                           const float *vt, int64_t W, int64_t nk, int64_t c, int64_t hd, float *O,
                           int64_t hdp, uint64_t subk) {
    __m512 acc[NX_BR][4];
    __mmask16 mk[4];
#pragma GCC unroll 4
    for (int v = 0; v < nv; v++) mk[v] = nx_mask16(hd - c - 16 * v);
    for (int r = 0; r < nr; r++) {
        __m512 a = _mm512_set1_ps(alpha[r]);
#pragma GCC unroll 4
        for (int v = 0; v < nv; v++)
            acc[r][v] = _mm512_mul_ps(_mm512_load_ps(O + r * hdp + c + 16 * v), a);
    }
    /* subk: the keys whose weight may be subnormal in some row (nx_softmax_rows). Without any,
     * the loop of old; one loop testing subk per key ran 4-6% slower on diffuse rows (AMX
     * Xeon, one thread, 2 heads at T=1152: 12.1-12.6 against 11.6-12.1 ms). */
    if (!subk) {
        for (int64_t j = 0; j < nk; j++) {
            const float *vr = vt + j * W + c;
            __m512 vv[4];
#pragma GCC unroll 4
            for (int v = 0; v < nv; v++) vv[v] = _mm512_maskz_loadu_ps(mk[v], vr + 16 * v);
            for (int r = 0; r < nr; r++) {
                __m512 p = _mm512_set1_ps(P[r * NX_BC + j]);
#pragma GCC unroll 4
                for (int v = 0; v < nv; v++) acc[r][v] = _mm512_fmadd_ps(p, vv[v], acc[r][v]);
            }
        }
    } else
    for (int64_t j = 0; j < nk; j++) {
        const float *vr = vt + j * W + c;
        __m512 vv[4];
#pragma GCC unroll 4
        for (int v = 0; v < nv; v++) vv[v] = _mm512_maskz_loadu_ps(mk[v], vr + 16 * v);
        if (subk >> j & 1) { /* some row's weight of key j is subnormal */
            for (int r = 0; r < nr; r++) {
                const float pj = P[r * NX_BC + j];
                const __m512 p = _mm512_set1_ps(pj);
                if (pj > 0.0f && pj < 0x1p-126f) {
                    /* acc + p v rounds to acc exactly where |p v| < 2^-126 |v| is below half
                     * the spacing of the floats next to acc, >= |acc| 2^-25: |v| < |acc| 2^100
                     * in every lane; else the FMA (it costs an assist, its bits are the rule) */
                    __mmask16 all = 0xFFFF;
#pragma GCC unroll 4
                    for (int v = 0; v < nv; v++)
                        all &= _mm512_cmp_ps_mask(
                            _mm512_abs_ps(vv[v]),
                            _mm512_mul_ps(_mm512_abs_ps(acc[r][v]), _mm512_set1_ps(0x1p100f)),
                            _CMP_LT_OQ);
                    if (all == 0xFFFF) continue;
                }
#pragma GCC unroll 4
                for (int v = 0; v < nv; v++) acc[r][v] = _mm512_fmadd_ps(p, vv[v], acc[r][v]);
            }
            continue;
        }
        for (int r = 0; r < nr; r++) {
            __m512 p = _mm512_set1_ps(P[r * NX_BC + j]);
#pragma GCC unroll 4
            for (int v = 0; v < nv; v++) acc[r][v] = _mm512_fmadd_ps(p, vv[v], acc[r][v]);
        }
    }
    for (int r = 0; r < nr; r++)
#pragma GCC unroll 4
        for (int v = 0; v < nv; v++) _mm512_store_ps(O + r * hdp + c + 16 * v, acc[r][v]);
}

/* Online softmax of one micro-block's scores (in place: S -> P). The rescale factors
 * alpha[r] = exp(m_old - m_new) of all rows go through one vector exp. */
static inline uint64_t nx_softmax_rows(int nr, float *S, float scale, const float *madd,
                                       int64_t ms, float *m, float *l, float *alpha) {
    uint64_t subk = 0; /* keys with a subnormal weight in some row */
    const __m512 sc = _mm512_set1_ps(scale);
    float m_use[NX_BR], sums[NX_BR], dm[16] = {0};
    for (int r = 0; r < nr; r++) {
        float *s = S + r * NX_BC;
        const float *ma = madd + r * ms; /* this row's key mask (ms = 0: shared) */
        __m512 x0 = _mm512_fmadd_ps(_mm512_load_ps(s), sc, _mm512_load_ps(ma));
        __m512 x1 = _mm512_fmadd_ps(_mm512_load_ps(s + 16), sc, _mm512_load_ps(ma + 16));
        __m512 x2 = _mm512_fmadd_ps(_mm512_load_ps(s + 32), sc, _mm512_load_ps(ma + 32));
        __m512 x3 = _mm512_fmadd_ps(_mm512_load_ps(s + 48), sc, _mm512_load_ps(ma + 48));
        float mx =
            _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(x0, x1), _mm512_max_ps(x2, x3)));
        float m_new = mx > m[r] ? mx : m[r];
        m_use[r] = m_new == -INFINITY ? 0.0f : m_new; /* all keys masked so far: p = 0 */
        dm[r] = m[r] - m_use[r];
        m[r] = m_new;
        __m512 mu = _mm512_set1_ps(m_use[r]);
        int lo[4] = {0, 0, 0, 0}; /* a vector of possibly subnormal weights */
        __m512 p0 = nx_exp_nosub_any16(_mm512_sub_ps(x0, mu), &lo[0]);
        __m512 p1 = nx_exp_nosub_any16(_mm512_sub_ps(x1, mu), &lo[1]);
        __m512 p2 = nx_exp_nosub_any16(_mm512_sub_ps(x2, mu), &lo[2]);
        __m512 p3 = nx_exp_nosub_any16(_mm512_sub_ps(x3, mu), &lo[3]);
        for (int v = 0; v < 4; v++)
            if (lo[v]) subk |= (uint64_t)0xFFFF << (16 * v);
        _mm512_store_ps(s, p0);
        _mm512_store_ps(s + 16, p1);
        _mm512_store_ps(s + 32, p2);
        _mm512_store_ps(s + 48, p3);
        sums[r] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(p0, p1), _mm512_add_ps(p2, p3)));
    }
    _mm512_storeu_ps(dm, nx_exp_nosub16(_mm512_loadu_ps(dm)));
    for (int r = 0; r < nr; r++) {
        alpha[r] = dm[r];
        l[r] = l[r] * dm[r] + sums[r];
    }
    return subk;
}

NX_INLINE void nx_attn_micro(const int nr, const float *q, int64_t hd, const float *kt, float *S,
                             float scale, const float *madd, int64_t ms, float *m, float *l,
                             float *alpha, const float *vt, int64_t W, int64_t nk, float *O,
                             int64_t hdp) {
    nx_qk_block(nr, q, hd, kt, S);
    const uint64_t subk = nx_softmax_rows(nr, S, scale, madd, ms, m, l, alpha);
    int64_t c = 0;
    for (; c + 64 <= hdp; c += 64) nx_pv_block(nr, 4, S, alpha, vt, W, nk, c, hd, O, hdp, subk);
    /* remainder one vector at a time: measured faster than a 2-vector chunk at hd=96 (193 vs 161) */
    for (; c < hdp; c += 16) nx_pv_block(nr, 1, S, alpha, vt, W, nk, c, hd, O, hdp, subk);
}

NX_INLINE void nx_attn_micro_any(int nr, const float *q, int64_t hd, const float *kt, float *S,
                                 float scale, const float *madd, int64_t ms, float *m, float *l,
                                 float *alpha, const float *vt, int64_t W, int64_t nk, float *O,
                                 int64_t hdp) {
    switch (nr) { /* constant row counts so the accumulators stay in registers */
    case 6: nx_attn_micro(6, q, hd, kt, S, scale, madd, ms, m, l, alpha, vt, W, nk, O, hdp); break;
    case 5: nx_attn_micro(5, q, hd, kt, S, scale, madd, ms, m, l, alpha, vt, W, nk, O, hdp); break;
    case 4: nx_attn_micro(4, q, hd, kt, S, scale, madd, ms, m, l, alpha, vt, W, nk, O, hdp); break;
    case 3: nx_attn_micro(3, q, hd, kt, S, scale, madd, ms, m, l, alpha, vt, W, nk, O, hdp); break;
    case 2: nx_attn_micro(2, q, hd, kt, S, scale, madd, ms, m, l, alpha, vt, W, nk, O, hdp); break;
    default: nx_attn_micro(1, q, hd, kt, S, scale, madd, ms, m, l, alpha, vt, W, nk, O, hdp); break;
    }
}

_Static_assert(NX_QB <= NX_ATTN_MAX_QB && NX_QB % NX_BR == 0, "query block size");
static const nx_attn_tiling nx_attn_tiling_avx512 = {NX_BR, NX_BC, NX_QB, nx_attn_micro_any};

int nx_attention_f32_avx512(const float *q, const float *k, const float *qkv, const uint8_t *mask,
                            float *out, int64_t T, int64_t H, int64_t KVH, int64_t hd, float scale,
                            int64_t h0, int64_t h1, int64_t t0, int64_t t1, int causal) {
    return nx_attention_tiled(&nx_attn_tiling_avx512, q, k, qkv, mask, out, T, H, KVH, hd, scale,
                              h0, h1, t0, t1, causal);
}

const nx_ops_table nx_ops_table_avx512 = NX_OPS_TABLE(avx512);
