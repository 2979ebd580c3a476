/* nx_ops_ew.h -- the element-wise forward kernels written once for both vector widths (nx_simd.h):
 * rmsnorm, layernorm_mod, swiglu, gated_residual, norm_residual, the exp/tanh test hook and the
 * row loop of rotate-half RoPE (called by each file's qknorm_rope). Included exactly once
 * by nx_ops_avx2.c and by nx_ops_avx512.c, which defines NXV_FN(nx_swiglu_f32) as
 * nx_swiglu_f32_avx2 / nx_swiglu_f32_avx512 (declared in nx_ops.h).
 *
 * Each loop runs whole vectors, then one masked tail vector; every lane does the operations of
 * the generic spec (nx_ops.c) in the same order, so results do not depend on the width, and
 * rmsnorm / layernorm_mod are bit-identical to generic (the others use the vector exp/tanh).
 * Must not: be included from generic files, allocate per row.
 */
#ifndef NX_OPS_EW_H
#define NX_OPS_EW_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "nx_ops.h"
#include "nx_simd.h"

/* ------------------------------------------------------------------ vector math (test hook) */

void NXV_FN(nx_vmath_f32)(int which, const float *x, float *out, int64_t n) {
    int64_t i = 0;
    for (; i + NXV_W <= n; i += NXV_W) {
        const nxv v = nxv_loadu(x + i);
        nxv_storeu(out + i, which == 0 ? nxv_exp(v) : which == 1 ? nxv_tanh(v) : nxv_exp_nosub(v));
    }
    if (i < n) {
        const nxv_mask m = nxv_mask_n(n - i);
        const nxv v = nxv_load_n(x + i, m);
        nxv_store_n(out + i, m,
                    which == 0 ? nxv_exp(v) : which == 1 ? nxv_tanh(v) : nxv_exp_nosub(v));
    }
}

/* ------------------------------------------------------------------ rmsnorm */

/* ((x * inv) * w) [* mod] in float32, as the spec. */
void NXV_FN(nx_rmsnorm_f32)(const float *x, const float *w, const float *mod, float *out, int64_t D,
                            float eps, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
        const float *xr = x + r * D;
        float *o = out + r * D;
        const nxv inv = nxv_set1(nxv_rms_inv(xr, D, eps));
        int64_t i = 0;
        for (; i + NXV_W <= D; i += NXV_W) {
            nxv v = nxv_mul(nxv_mul(nxv_loadu(xr + i), inv), nxv_loadu(w + i));
            if (mod) v = nxv_mul(v, nxv_loadu(mod + i));
            nxv_storeu(o + i, v);
        }
        if (i < D) {
            const nxv_mask m = nxv_mask_n(D - i);
            nxv v = nxv_mul(nxv_mul(nxv_load_n(xr + i, m), inv), nxv_load_n(w + i, m));
            if (mod) v = nxv_mul(v, nxv_load_n(mod + i, m));
            nxv_store_n(o + i, m, v);
        }
    }
}

/* ------------------------------------------------------------------ layernorm_mod */

void NXV_FN(nx_layernorm_mod_f32)(const float *x, const float *mod, float *out, int64_t D,
                                  float eps, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
        const float *xr = x + r * D;
        float *o = out + r * D;
        double mean, var;
        nxv_ln_stats(xr, D, &mean, &var);
        const nxv rs = nxv_set1((float)(1.0 / sqrt(var + (double)eps)));
        const nxvd_half mu = nxv_set1_f64(mean);
        int64_t i = 0;
        for (; i + NXV_W <= D; i += NXV_W)
            nxv_storeu(o + i, nxv_mul(nxv_mul(nxv_sub_f64(nxv_loadu(xr + i), mu), rs),
                                      nxv_loadu(mod + i)));
        if (i < D) {
            const nxv_mask m = nxv_mask_n(D - i);
            nxv_store_n(o + i, m,
                        nxv_mul(nxv_mul(nxv_sub_f64(nxv_load_n(xr + i, m), mu), rs),
                                nxv_load_n(mod + i, m)));
        }
    }
}

/* ------------------------------------------------------------------ rotate-half RoPE */

/* One head row of qk-norm + rotate-half RoPE (pairs (i, i + hd/2), nx_ops.h): y = (x * inv) * w
 * for both halves, pair matrices de-interleaved from pe's [hd/2][2][2] layout, then
 * (p0 * y0) + (p1 * y1) lane-wise, unfused: the spec's operations (nx_qknorm_rope_half_pair,
 * which also runs the tail), so every width gives the generic bits. */
static inline void nxv_qknorm_rope_half_row(const float *xr /* IN [hd] */, float invf,
                                            const float *wt /* IN [hd] */,
                                            const float *p /* IN [hd/2][2][2] */,
                                            float *o /* OUT [hd] */, int64_t hd) {
    const int64_t h = hd / 2;
    const nxv inv = nxv_set1(invf);
    int64_t i = 0;
    for (; i + NXV_W <= h; i += NXV_W) {
        const nxv y0 = nxv_mul(nxv_mul(nxv_loadu(xr + i), inv), nxv_loadu(wt + i));
        const nxv y1 = nxv_mul(nxv_mul(nxv_loadu(xr + h + i), inv), nxv_loadu(wt + h + i));
        nxv c[4]; /* c[2r + s][lane] = pe[t, i + lane, r, s] */
        nxv_deinterleave4(p + 4 * i, c);
        nxv_storeu(o + i, nxv_add(nxv_mul(c[0], y0), nxv_mul(c[1], y1)));
        nxv_storeu(o + h + i, nxv_add(nxv_mul(c[2], y0), nxv_mul(c[3], y1)));
    }
    for (; i < h; i++) nx_qknorm_rope_half_pair(xr, invf, wt, p, o, i, h);
}

/* The adjacent-pairs row (pairs (2i, 2i+1), the DiT's), defined by the including file (its
 * permutes differ by width): o[2i+r] = (pe[t,i,r,0] * y[2i]) + (pe[t,i,r,1] * y[2i+1]),
 * y = (x * r) * w, unfused; the tail by nx_qknorm_rope_pair (the spec). */
static inline void nxv_qknorm_rope_adjacent_row(const float *xr /* IN [hd] */, float invf,
                                                const float *wt /* IN [hd] */,
                                                const float *p /* IN [hd/2][2][2] */,
                                                float *o /* OUT [hd] */, int64_t hd);

#ifndef NX_QKR_TB
#define NX_QKR_TB 16
#endif

/* qknorm + RoPE (nx_ops.h) over heads [h0, h1): blocks of NX_QKR_TB tokens, head by head. The
 * reads advance through TB rows of qkv at once and each head's writes are TB * hd floats in a
 * row. Head-major over all T, each head's rows are W floats apart -- 46 KB for Z-Image -- one
 * demand miss per row; token-major, the 60 heads' output rows are T * hd floats apart -- 2 MB
 * -- and fight for the same cache sets. AMX Xeon, T=4128, 60 heads, one thread, avx512 / avx2:
 * head-major 46.0 / 59.0 ms, token-major 39.4 / 43.4, blocks of 16 29.5-29.9 / 30.6 (8: the
 * same, 32: 31.4, 64: 38). Each output's operations do not depend on the order. */
void NXV_FN(nx_qknorm_rope_f32)(const float *qkv, const float *q_w, const float *k_w,
                                const float *pe, float *q_out, float *k_out, int64_t T,
                                int64_t H, int64_t KVH, int64_t hd, float eps, int64_t h0,
                                int64_t h1, int half) {
    const int64_t W = (H + 2 * KVH) * hd;
    for (int64_t t0 = 0; t0 < T; t0 += NX_QKR_TB)
        for (int64_t j = h0; j < h1; j++)
            for (int64_t t = t0; t < t0 + NX_QKR_TB && t < T; t++) {
                const float *p = pe + t * hd * 2;
                const float *wt = j < H ? q_w : k_w;
                const float *xr = qkv + t * W + j * hd;
                float *o = (j < H ? q_out + j * T * hd : k_out + (j - H) * T * hd) + t * hd;
                const float invf = nxv_rms_inv(xr, hd, eps);
                if (half)
                    nxv_qknorm_rope_half_row(xr, invf, wt, p, o, hd);
                else
                    nxv_qknorm_rope_adjacent_row(xr, invf, wt, p, o, hd);
            }
}

/* ------------------------------------------------------------------ swiglu, gated residual */

void NXV_FN(nx_swiglu_f32)(const float *a, const float *b, float *out, int64_t i0, int64_t i1) {
    int64_t i = i0;
    for (; i + NXV_W <= i1; i += NXV_W)
        nxv_storeu(out + i, nxv_mul(nxv_silu(nxv_loadu(a + i)), nxv_loadu(b + i)));
    if (i < i1) {
        const nxv_mask m = nxv_mask_n(i1 - i);
        nxv_store_n(out + i, m, nxv_mul(nxv_silu(nxv_load_n(a + i, m)), nxv_load_n(b + i, m)));
    }
}

/* tanh(gate) once per call, in a 64-byte aligned buffer the caller frees (NULL if it could not
 * be allocated): D rounded up to whole vectors, plus one (aligned_alloc wants a multiple of the
 * alignment). */
static float *NXV_FN(nx_tanh_table)(const float *gate, int64_t D) {
    float *tg = aligned_alloc(64, (size_t)((D + NXV_W - 1) / NXV_W * NXV_W + 16) * sizeof(float));
    if (!tg) return NULL;
    for (int64_t c = 0; c < D; c += NXV_W) {
        const nxv_mask m = nxv_mask_n(D - c);
        nxv_store_n(tg + c, m, nxv_tanh(nxv_load_n(gate + c, m)));
    }
    return tg;
}

int NXV_FN(nx_gated_residual_f32)(const float *resid, const float *y, const float *gate, float *out,
                                  int64_t D, int64_t r0, int64_t r1) {
    float *tg = NXV_FN(nx_tanh_table)(gate, D);
    if (!tg) return -1;
    for (int64_t r = r0; r < r1; r++) {
        const float *rr = resid + r * D, *yr = y + r * D;
        float *o = out + r * D;
        int64_t c = 0;
        for (; c + NXV_W <= D; c += NXV_W)
            nxv_storeu(o + c, nxv_fmadd(nxv_loadu(tg + c), nxv_loadu(yr + c), nxv_loadu(rr + c)));
        if (c < D) {
            const nxv_mask m = nxv_mask_n(D - c);
            nxv_store_n(
                o + c, m,
                nxv_fmadd(nxv_load_n(tg + c, m), nxv_load_n(yr + c, m), nxv_load_n(rr + c, m)));
        }
    }
    free(tg);
    return 0;
}

/* rmsnorm(y, w) and gated_residual of one row in registers (the operations of both, in their
 * order: ((y * inv) * w), then fma(tanh(gate), that, resid)), then the optional second norm by
 * this file's rmsnorm itself (the row just written is in L1). */
int NXV_FN(nx_norm_residual_f32)(const float *y, const float *w, const float *resid,
                                 const float *gate, float *out, const float *w2, const float *mod2,
                                 float *h, int64_t D, float eps, int64_t r0, int64_t r1) {
    float *tg = NXV_FN(nx_tanh_table)(gate, D);
    if (!tg) return -1;
    for (int64_t r = r0; r < r1; r++) {
        const float *yr = y + r * D, *rr = resid + r * D;
        float *o = out + r * D;
        const nxv inv = nxv_set1(nxv_rms_inv(yr, D, eps));
        int64_t c = 0;
        for (; c + NXV_W <= D; c += NXV_W) {
            const nxv v = nxv_mul(nxv_mul(nxv_loadu(yr + c), inv), nxv_loadu(w + c));
            nxv_storeu(o + c, nxv_fmadd(nxv_loadu(tg + c), v, nxv_loadu(rr + c)));
        }
        if (c < D) {
            const nxv_mask m = nxv_mask_n(D - c);
            const nxv v = nxv_mul(nxv_mul(nxv_load_n(yr + c, m), inv), nxv_load_n(w + c, m));
            nxv_store_n(o + c, m,
                        nxv_fmadd(nxv_load_n(tg + c, m), v, nxv_load_n(rr + c, m)));
        }
        if (w2) NXV_FN(nx_rmsnorm_f32)(out, w2, mod2, h, D, eps, r, r + 1);
    }
    free(tg);
    return 0;
}

#endif
