/* nx_bwd_avx512.c -- AVX-512 (F/DQ) variants of the backward kernels (nx_bwd.h).
 * Owns: the vector forms of rmsnorm/rope/gated-residual backward (same arithmetic as the generic
 * spec, bit for bit), swiglu backward with a 16-lane exp polynomial, and the 6x64 micro-kernels
 * of the tiled float32 attention backward (driver: nx_attention_bwd_tiled in nx_bwd.h).
 * Must not: be entered unless nx_cpu_isa_supported(NX_ISA_AVX512)
 * (dispatch in nx_bwd.c). */
#define NX_BWD_TILED_DRIVER
#include "nx_bwd.h"
#include "nx_vmath_avx512.h" /* nx_mask16, nx_exp16, nx_cvt_lohi, nx_tree16_pd (shared with nx_ops_avx512.c) */

#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------ rmsnorm */

int nx_rmsnorm_bwd_f32_avx512(const float *x, const float *w, const float *mod, const float *dy,
                              float *dx, float *dw, float *dmod, int64_t D, float eps, int64_t r0,
                              int64_t r1) {
    if (!mod) dmod = NULL;
    double *aw = NULL, *am = NULL;
    if (dw || dmod) {
        aw = calloc((size_t)(2 * D + 16), sizeof(double));
        if (!aw) return -1;
        am = aw + D;
    }
    for (int64_t r = r0; r < r1; r++) {
        const float *xr = x + r * D, *gr = dy + r * D;
        float *o = dx + r * D;
        __m512d sl = _mm512_setzero_pd(), sh = _mm512_setzero_pd();
        __m512d cl = _mm512_setzero_pd(), ch = _mm512_setzero_pd();
        for (int64_t i = 0; i < D; i += 16) {
            __mmask16 m = nx_mask16(D - i);
            __m512d xl, xh, gl, gh, wl, wh;
            nx_cvt_lohi(_mm512_maskz_loadu_ps(m, xr + i), &xl, &xh);
            nx_cvt_lohi(_mm512_maskz_loadu_ps(m, gr + i), &gl, &gh);
            nx_cvt_lohi(_mm512_maskz_loadu_ps(m, w + i), &wl, &wh);
            gl = _mm512_mul_pd(gl, wl);
            gh = _mm512_mul_pd(gh, wh);
            if (mod) {
                __m512d ml, mh;
                nx_cvt_lohi(_mm512_maskz_loadu_ps(m, mod + i), &ml, &mh);
                gl = _mm512_mul_pd(gl, ml);
                gh = _mm512_mul_pd(gh, mh);
            }
            sl = _mm512_add_pd(sl, _mm512_mul_pd(xl, xl));
            sh = _mm512_add_pd(sh, _mm512_mul_pd(xh, xh));
            cl = _mm512_add_pd(cl, _mm512_mul_pd(gl, xl));
            ch = _mm512_add_pd(ch, _mm512_mul_pd(gh, xh));
        }
        const double inv = 1.0 / sqrt(nx_tree16_pd(sl, sh) / (double)D + (double)eps);
        const double coef = ((inv * inv) * nx_tree16_pd(cl, ch)) / (double)D;
        const __m512d vinv = _mm512_set1_pd(inv), vcoef = _mm512_set1_pd(coef);
        for (int64_t i = 0; i < D; i += 16) {
            __mmask16 m = nx_mask16(D - i);
            __mmask8 ml8 = (__mmask8)(m & 0xFF), mh8 = (__mmask8)(m >> 8);
            __m512d xl, xh, dl, dh, wl, wh;
            nx_cvt_lohi(_mm512_maskz_loadu_ps(m, xr + i), &xl, &xh);
            nx_cvt_lohi(_mm512_maskz_loadu_ps(m, gr + i), &dl, &dh);
            nx_cvt_lohi(_mm512_maskz_loadu_ps(m, w + i), &wl, &wh);
            __m512d hl = _mm512_mul_pd(_mm512_mul_pd(dl, xl), vinv); /* dy * xhat */
            __m512d hh = _mm512_mul_pd(_mm512_mul_pd(dh, xh), vinv);
            __m512d gl = _mm512_mul_pd(dl, wl), gh = _mm512_mul_pd(dh, wh);
            if (mod) {
                __m512d ml, mh;
                nx_cvt_lohi(_mm512_maskz_loadu_ps(m, mod + i), &ml, &mh);
                gl = _mm512_mul_pd(gl, ml);
                gh = _mm512_mul_pd(gh, mh);
                if (aw) {
                    _mm512_mask_storeu_pd(
                        aw + i, ml8,
                        _mm512_add_pd(_mm512_maskz_loadu_pd(ml8, aw + i), _mm512_mul_pd(hl, ml)));
                    _mm512_mask_storeu_pd(aw + i + 8, mh8,
                                          _mm512_add_pd(_mm512_maskz_loadu_pd(mh8, aw + i + 8),
                                                        _mm512_mul_pd(hh, mh)));
                }
                if (dmod) {
                    _mm512_mask_storeu_pd(
                        am + i, ml8,
                        _mm512_add_pd(_mm512_maskz_loadu_pd(ml8, am + i), _mm512_mul_pd(hl, wl)));
                    _mm512_mask_storeu_pd(am + i + 8, mh8,
                                          _mm512_add_pd(_mm512_maskz_loadu_pd(mh8, am + i + 8),
                                                        _mm512_mul_pd(hh, wh)));
                }
            } else if (aw) {
                _mm512_mask_storeu_pd(aw + i, ml8,
                                      _mm512_add_pd(_mm512_maskz_loadu_pd(ml8, aw + i), hl));
                _mm512_mask_storeu_pd(aw + i + 8, mh8,
                                      _mm512_add_pd(_mm512_maskz_loadu_pd(mh8, aw + i + 8), hh));
            }
            __m256 ol =
                _mm512_cvtpd_ps(_mm512_mul_pd(vinv, _mm512_sub_pd(gl, _mm512_mul_pd(xl, vcoef))));
            __m256 oh =
                _mm512_cvtpd_ps(_mm512_mul_pd(vinv, _mm512_sub_pd(gh, _mm512_mul_pd(xh, vcoef))));
            _mm512_mask_storeu_ps(o + i, m, _mm512_insertf32x8(_mm512_castps256_ps512(ol), oh, 1));
        }
    }
    nx_rmsnorm_bwd_finish(aw, am, dw, dmod, D);
    return 0;
}

/* ------------------------------------------------------------------ rope */

void nx_rope_bwd_f32_avx512(const float *dy, const float *pe, float *dx, int64_t T, int64_t hd,
                            int64_t r0, int64_t r1) {
    /* output lane L (pair L/2, component c = L%2) needs pe[.., 0, c] at 2L - c and pe[.., 1, c]
     * at 2L - c + 2 within the 32 pe floats of its 8 pairs */
    const __m512i ia = _mm512_setr_epi32(0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29);
    const __m512i ib =
        _mm512_setr_epi32(2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    for (int64_t r = r0; r < r1; r++) {
        const float *p = pe + (r % T) * hd * 2;
        const float *d = dy + r * hd;
        float *o = dx + r * hd;
        int64_t i = 0;
        for (; i + 16 <= hd; i += 16) {
            __m512 v = _mm512_loadu_ps(d + i);
            __m512 p0 = _mm512_loadu_ps(p + 2 * i), p1 = _mm512_loadu_ps(p + 2 * i + 16);
            __m512 a = _mm512_permutex2var_ps(p0, ia, p1), b = _mm512_permutex2var_ps(p0, ib, p1);
            _mm512_storeu_ps(o + i, _mm512_add_ps(_mm512_mul_ps(a, _mm512_moveldup_ps(v)),
                                                  _mm512_mul_ps(b, _mm512_movehdup_ps(v))));
        }
        for (; i < hd; i += 2) { /* tail: the generic arithmetic */
            float d0 = d[i], d1 = d[i + 1];
            o[i] = p[2 * i] * d0 + p[2 * i + 2] * d1;
            o[i + 1] = p[2 * i + 1] * d0 + p[2 * i + 3] * d1;
        }
    }
}

/* ------------------------------------------------------------------ swiglu */

#include "nx_bwd_ew.h" /* swiglu_backward (both widths) */

/* ------------------------------------------------------------------ gated residual */

int nx_gated_residual_bwd_f32_avx512(const float *y, const float *gate, const float *dout,
                                     float *dresid, float *dy, float *dgate, int64_t D, int64_t r0,
                                     int64_t r1) {
    const int64_t Dp = (D + 15) / 16 * 16;
    double *acc = calloc((size_t)Dp, sizeof(double));
    float *tg = calloc((size_t)Dp, sizeof(float));
    if (!acc || !tg) {
        free(acc);
        free(tg);
        return -1;
    }
    for (int64_t c = 0; c < D; c++) tg[c] = (float)tanh((double)gate[c]); /* as generic */
    for (int64_t r = r0; r < r1; r++) {
        const float *g = dout + r * D, *yr = y + r * D;
        float *o = dy + r * D;
        float *dr = dresid ? dresid + r * D : NULL;
        for (int64_t c = 0; c < D; c += 16) {
            __mmask16 m = nx_mask16(D - c);
            __m512 gv = _mm512_maskz_loadu_ps(m, g + c), yv = _mm512_maskz_loadu_ps(m, yr + c);
            __m512d gl, gh, yl, yh;
            nx_cvt_lohi(gv, &gl, &gh);
            nx_cvt_lohi(yv, &yl, &yh);
            _mm512_storeu_pd(acc + c,
                             _mm512_add_pd(_mm512_loadu_pd(acc + c), _mm512_mul_pd(gl, yl)));
            _mm512_storeu_pd(acc + c + 8,
                             _mm512_add_pd(_mm512_loadu_pd(acc + c + 8), _mm512_mul_pd(gh, yh)));
            if (dr) _mm512_mask_storeu_ps(dr + c, m, gv);
            _mm512_mask_storeu_ps(o + c, m, _mm512_mul_ps(gv, _mm512_loadu_ps(tg + c)));
        }
    }
    if (dgate)
        for (int64_t c = 0; c < D; c++) {
            double chv = cosh((double)gate[c]);
            dgate[c] = (float)(acc[c] * (1.0 / (chv * chv)));
        }
    free(acc);
    free(tg);
    return 0;
}

/* ------------------------------------------------------------------ attention */

/* Micro-kernels of the shared tiled driver (nx_bwd.h): micro-blocks of 6 query rows x 64 keys
 * (4 zmm per row), so QK^T keeps 24 accumulators and the dK^T/dV^T update holds the 6x64 block
 * of dS (or P) in 24 zmm during one pass over d. */
#define NX_BBR 6
#define NX_BBC 64
#ifndef NX_BQB
#define NX_BQB                                                                                     \
    48 /* query rows per block, multiple of NX_BBR: 24/48/96/192 measured within 3% of
                     * each other at hd=128, T=1024 and 4096 (213-229 GFLOP/s, 10*T^2*hd per head) */
#endif
_Static_assert(NX_BQB % NX_BBR == 0, "query block must hold whole micro-blocks");

/* S[r, 0:64] = sum_d X[r, d] * YT[d, 0:64], r < 6 (X rows hd apart, S rows ld apart, aligned). */
static inline void nx_b_qk(const float *X, int64_t hd, const float *YT, float *S, int64_t ld) {
    __m512 acc[NX_BBR][4];
    for (int r = 0; r < NX_BBR; r++)
        for (int v = 0; v < 4; v++) acc[r][v] = _mm512_setzero_ps();
    for (int64_t d = 0; d < hd; d++) {
        const float *yd = YT + d * NX_BBC;
        __m512 y0 = _mm512_load_ps(yd), y1 = _mm512_load_ps(yd + 16);
        __m512 y2 = _mm512_load_ps(yd + 32), y3 = _mm512_load_ps(yd + 48);
        for (int r = 0; r < NX_BBR; r++) {
            __m512 b = _mm512_set1_ps(X[r * hd + d]);
            acc[r][0] = _mm512_fmadd_ps(b, y0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(b, y1, acc[r][1]);
            acc[r][2] = _mm512_fmadd_ps(b, y2, acc[r][2]);
            acc[r][3] = _mm512_fmadd_ps(b, y3, acc[r][3]);
        }
    }
    for (int r = 0; r < NX_BBR; r++)
        for (int v = 0; v < 4; v++) _mm512_store_ps(S + r * ld + 16 * v, acc[r][v]);
}

/* ZT[d, 0:64] += sum_r X[r, d] * P[r, 0:64] for d < hd (the 6x64 block of P lives in 24 zmm). */
static inline void nx_b_outer(const float *X, int64_t hd, const float *P, int64_t ld, float *ZT) {
    __m512 p[NX_BBR][4];
    for (int r = 0; r < NX_BBR; r++)
        for (int v = 0; v < 4; v++) p[r][v] = _mm512_load_ps(P + r * ld + 16 * v);
    for (int64_t d = 0; d < hd; d++) {
        float *zd = ZT + d * NX_BBC;
        __m512 z0 = _mm512_load_ps(zd), z1 = _mm512_load_ps(zd + 16);
        __m512 z2 = _mm512_load_ps(zd + 32), z3 = _mm512_load_ps(zd + 48);
        for (int r = 0; r < NX_BBR; r++) {
            __m512 b = _mm512_set1_ps(X[r * hd + d]);
            z0 = _mm512_fmadd_ps(b, p[r][0], z0);
            z1 = _mm512_fmadd_ps(b, p[r][1], z1);
            z2 = _mm512_fmadd_ps(b, p[r][2], z2);
            z3 = _mm512_fmadd_ps(b, p[r][3], z3);
        }
        _mm512_store_ps(zd, z0);
        _mm512_store_ps(zd + 16, z1);
        _mm512_store_ps(zd + 32, z2);
        _mm512_store_ps(zd + 48, z3);
    }
}

/* O[r, c:c+16nv] += sum_{j<nk} P[r, j] * Y[j, c:c+16nv], r < 6 (Y rows hd apart, lanes past hd
 * masked; O rows hdp apart, aligned); nv in {1, 4}, a constant after inlining. */
NX_INLINE void nx_b_pv(const int nv, const float *P, int64_t ld, const float *Y, int64_t hd,
                       int64_t nk, int64_t c, float *O, int64_t hdp) {
    __m512 acc[NX_BBR][4];
    __mmask16 mk[4];
#pragma GCC unroll 4
    for (int v = 0; v < nv; v++) mk[v] = nx_mask16(hd - c - 16 * v);
    for (int r = 0; r < NX_BBR; r++)
#pragma GCC unroll 4
        for (int v = 0; v < nv; v++) acc[r][v] = _mm512_load_ps(O + r * hdp + c + 16 * v);
    for (int64_t j = 0; j < nk; j++) {
        const float *yr = Y + j * hd + c;
        __m512 yv[4];
#pragma GCC unroll 4
        for (int v = 0; v < nv; v++) yv[v] = _mm512_maskz_loadu_ps(mk[v], yr + 16 * v);
        for (int r = 0; r < NX_BBR; r++) {
            __m512 b = _mm512_set1_ps(P[r * ld + j]);
#pragma GCC unroll 4
            for (int v = 0; v < nv; v++) acc[r][v] = _mm512_fmadd_ps(b, yv[v], acc[r][v]);
        }
    }
    for (int r = 0; r < NX_BBR; r++)
#pragma GCC unroll 4
        for (int v = 0; v < nv; v++) _mm512_store_ps(O + r * hdp + c + 16 * v, acc[r][v]);
}

/* nx_b_softmax_ds: phase 2 for one row, nx_bwd_ew.h (both widths) */

/* dQ rows: 64-column chunks (4 zmm) then 16-column remainders */
static inline void nx_b_pv_rows(const float *P, int64_t ld, const float *Y, int64_t hd, int64_t nk,
                                float *O, int64_t hdp) {
    int64_t c = 0;
    for (; c + 64 <= hdp; c += 64) nx_b_pv(4, P, ld, Y, hd, nk, c, O, hdp);
    for (; c < hdp; c += 16) nx_b_pv(1, P, ld, Y, hd, nk, c, O, hdp);
}

static const nx_attn_bwd_tiling nx_attn_bwd_tiling_avx512 = {
    NX_BBR, NX_BBC, NX_BQB, 16, nx_b_qk, nx_b_outer, nx_b_pv_rows, nx_b_softmax_ds};

int nx_attention_bwd_f32_avx512(const float *q, const float *k, const float *v, const float *dout,
                                const uint8_t *mask, float *dq, float *dk, float *dv, int64_t T,
                                int64_t H, int64_t KVH, int64_t hd, float scale, int64_t g0,
                                int64_t g1) {
    return nx_attention_bwd_tiled(&nx_attn_bwd_tiling_avx512, q, k, v, dout, mask, dq, dk, dv, T, H,
                                  KVH, hd, scale, g0, g1);
}

/* qknorm_rope_backward has no AVX-512 variant (inherits: avx2 has none either -> generic). */
const nx_bwd_table nx_bwd_table_avx512 = {
    .rmsnorm_backward = nx_rmsnorm_bwd_f32_avx512,
    .rope_backward = nx_rope_bwd_f32_avx512,
    .swiglu_backward = nx_swiglu_bwd_f32_avx512,
    .gated_residual_backward = nx_gated_residual_bwd_f32_avx512,
    .attention_backward = nx_attention_bwd_f32_avx512,
};
