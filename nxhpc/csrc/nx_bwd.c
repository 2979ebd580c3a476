/* nx_bwd.c -- generic (scalar) spec of the backward kernels + their ISA dispatch (nx_bwd.h).
 * Owns: the reference arithmetic every SIMD variant is tested against, and which variant runs.
 * Must not: use ISA-specific instructions (compiled without ISA flags), allocate per row.
 * Compiled with -std=c11, so GCC does not contract a*b+c into FMAs: the float64 sums below
 * are exactly reproducible by the SIMD variants that claim bit-identity. */
#include "nx_bwd.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------ dispatch */

NX_DEFINE_DISPATCH(
    nx_bwd, "bwd", NX_BWD_SLOTS,
    {[NX_ISA_GENERIC] = &nx_bwd_table_generic,
     NX_X86_ONLY([NX_ISA_AVX2] = &nx_bwd_table_avx2, [NX_ISA_AVX512] = &nx_bwd_table_avx512, )})

int nx_rmsnorm_bwd_f32(nx_isa isa, const float *x, const float *w, const float *mod,
                       const float *dy, float *dx, float *dw, float *dmod, int64_t D, float eps,
                       int64_t r0, int64_t r1) {
    return nx_bwd_get(isa)->rmsnorm_backward(x, w, mod, dy, dx, dw, dmod, D, eps, r0, r1);
}

void nx_rope_bwd_f32(nx_isa isa, const float *dy, const float *pe, float *dx, int64_t T, int64_t hd,
                     int64_t r0, int64_t r1) {
    nx_bwd_get(isa)->rope_backward(dy, pe, dx, T, hd, r0, r1);
}

int nx_qknorm_rope_bwd_f32(nx_isa isa, const float *qkv, const float *q_w, const float *k_w,
                           const float *pe, const float *dq, const float *dk, float *dqkv,
                           float *dq_w, float *dk_w, int64_t T, int64_t H, int64_t KVH, int64_t hd,
                           float eps, int64_t h0, int64_t h1) {
    return nx_bwd_get(isa)->qknorm_rope_backward(qkv, q_w, k_w, pe, dq, dk, dqkv, dq_w, dk_w, T, H,
                                                 KVH, hd, eps, h0, h1);
}

void nx_swiglu_bwd_f32(nx_isa isa, const float *a, const float *b, const float *dout, float *da,
                       float *db, int64_t i0, int64_t i1) {
    nx_bwd_get(isa)->swiglu_backward(a, b, dout, da, db, i0, i1);
}

int nx_gated_residual_bwd_f32(nx_isa isa, const float *y, const float *gate, const float *dout,
                              float *dresid, float *dy, float *dgate, int64_t D, int64_t r0,
                              int64_t r1) {
    return nx_bwd_get(isa)->gated_residual_backward(y, gate, dout, dresid, dy, dgate, D, r0, r1);
}

int nx_attention_bwd_f32(nx_isa isa, const float *q, const float *k, const float *v,
                         const float *dout, const uint8_t *mask, float *dq, float *dk, float *dv,
                         int64_t T, int64_t H, int64_t KVH, int64_t hd, float scale, int64_t g0,
                         int64_t g1) {
    return nx_bwd_get(isa)->attention_backward(q, k, v, dout, mask, dq, dk, dv, T, H, KVH, hd,
                                               scale, g0, g1);
}

void nx_sum_partials_f32(const float *partials, float *out, int64_t n, int64_t D) {
    for (int64_t c = 0; c < D; c++) {
        double s = 0.0;
        for (int64_t b = 0; b < n; b++) s += (double)partials[b * D + c];
        out[c] = (float)s;
    }
}

/* ------------------------------------------------------------------ rmsnorm */

/* The fixed 16-lane combining tree of nx_bwd.h. */
static inline double nx_tree16(double *acc) {
    for (int l = 0; l < 8; l++) acc[l] += acc[l + 8];
    for (int l = 0; l < 4; l++) acc[l] += acc[l + 4];
    for (int l = 0; l < 2; l++) acc[l] += acc[l + 2];
    return acc[0] + acc[1];
}

int nx_rmsnorm_bwd_f32_generic(const float *x, const float *w, const float *mod, const float *dy,
                               float *dx, float *dw, float *dmod, int64_t D, float eps, int64_t r0,
                               int64_t r1) {
    if (!mod) dmod = NULL;
    double *aw = NULL, *am = NULL;
    if (dw || dmod) {
        aw = calloc((size_t)(2 * D), sizeof(double));
        if (!aw) return -1;
        am = aw + D;
    }
    for (int64_t r = r0; r < r1; r++) {
        const float *xr = x + r * D, *gr = dy + r * D;
        float *o = dx + r * D;
        double ss[16] = {0}, cs[16] = {0};
        for (int64_t i = 0; i < D; i++) { /* pass 1: sum x^2 and sum g*x, g = dy*w[*mod] */
            double xv = (double)xr[i];
            double g = (double)gr[i] * (double)w[i];
            if (mod) g = g * (double)mod[i];
            ss[i & 15] += xv * xv;
            cs[i & 15] += g * xv;
        }
        const double inv = 1.0 / sqrt(nx_tree16(ss) / (double)D + (double)eps);
        const double coef = ((inv * inv) * nx_tree16(cs)) / (double)D;
        for (int64_t i = 0; i < D; i++) { /* pass 2: parameter partials, then dx (may alias) */
            double xv = (double)xr[i];
            double dxh = ((double)gr[i] * xv) * inv; /* dy * xhat */
            double g = (double)gr[i] * (double)w[i];
            if (mod) {
                g = g * (double)mod[i];
                if (aw) aw[i] += dxh * (double)mod[i];
                if (dmod) am[i] += dxh * (double)w[i];
            } else if (aw) {
                aw[i] += dxh;
            }
            o[i] = (float)(inv * (g - xv * coef));
        }
    }
    nx_rmsnorm_bwd_finish(aw, am, dw, dmod, D);
    return 0;
}

/* ------------------------------------------------------------------ rope, qknorm + rope */

void nx_rope_bwd_f32_generic(const float *dy, const float *pe, float *dx, int64_t T, int64_t hd,
                             int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
        const float *p = pe + (r % T) * hd * 2; /* [hd/2][2][2] */
        const float *d = dy + r * hd;
        float *o = dx + r * hd;
        for (int64_t i = 0; i < hd / 2; i++) {
            float d0 = d[2 * i], d1 = d[2 * i + 1];
            o[2 * i] = p[4 * i] * d0 + p[4 * i + 2] * d1;
            o[2 * i + 1] = p[4 * i + 1] * d0 + p[4 * i + 3] * d1;
        }
    }
}

int nx_qknorm_rope_bwd_f32_generic(const float *qkv, const float *q_w, const float *k_w,
                                   const float *pe, const float *dq, const float *dk, float *dqkv,
                                   float *dq_w, float *dk_w, int64_t T, int64_t H, int64_t KVH,
                                   int64_t hd, float eps, int64_t h0, int64_t h1) {
    const int64_t W = (H + 2 * KVH) * hd;
    double *gr = calloc((size_t)(3 * hd), sizeof(double));
    if (!gr) return -1;
    double *aq = gr + hd, *ak = gr + 2 * hd;
    for (int64_t j = h0; j < h1; j++) {
        const int is_q = j < H;
        const float *wt = is_q ? q_w : k_w;
        const float *src = is_q ? dq + j * T * hd : dk + (j - H) * T * hd;
        double *acc = is_q ? aq : ak;
        for (int64_t t = 0; t < T; t++) {
            const float *xr = qkv + t * W + j * hd;
            const float *p = pe + t * hd * 2;
            const float *d = src + t * hd;
            float *o = dqkv + t * W + j * hd;
            for (int64_t i = 0; i < hd / 2; i++) { /* transposed rotation, float64 */
                double d0 = (double)d[2 * i], d1 = (double)d[2 * i + 1];
                gr[2 * i] = (double)p[4 * i] * d0 + (double)p[4 * i + 2] * d1;
                gr[2 * i + 1] = (double)p[4 * i + 1] * d0 + (double)p[4 * i + 3] * d1;
            }
            double ss[16] = {0}, cs[16] = {0};
            for (int64_t i = 0; i < hd; i++) {
                double xv = (double)xr[i];
                ss[i & 15] += xv * xv;
                cs[i & 15] += (gr[i] * (double)wt[i]) * xv;
            }
            const double inv = 1.0 / sqrt(nx_tree16(ss) / (double)hd + (double)eps);
            const double coef = ((inv * inv) * nx_tree16(cs)) / (double)hd;
            for (int64_t i = 0; i < hd; i++) {
                double xv = (double)xr[i];
                acc[i] += (gr[i] * xv) * inv;
                o[i] = (float)(inv * (gr[i] * (double)wt[i] - xv * coef));
            }
        }
    }
    if (dq_w)
        for (int64_t i = 0; i < hd; i++) dq_w[i] = (float)aq[i];
    if (dk_w)
        for (int64_t i = 0; i < hd; i++) dk_w[i] = (float)ak[i];
    free(gr);
    return 0;
}

/* ------------------------------------------------------------------ swiglu */

void nx_swiglu_bwd_f32_generic(const float *a, const float *b, const float *dout, float *da,
                               float *db, int64_t i0, int64_t i1) {
    const float big = 3.4028234663852886e38f;
    for (int64_t i = i0; i < i1; i++) {
        float av = a[i], bv = b[i], g = dout[i];
        float xc = av < -big ? -big : av; /* -inf -> -FLT_MAX (silu(-inf) = -0), NaN kept */
        float x = xc > big ? big : xc;    /* +inf -> FLT_MAX only inside silu' */
        float e = expf(-fabsf(x));
        float d = 1.0f / (1.0f + e);
        float s = x >= 0.0f ? d : e * d;  /* sigmoid(x) */
        float sc = x >= 0.0f ? e * d : d; /* 1 - sigmoid(x) */
        float silu = xc * s;
        float dsilu = s * (1.0f + x * sc);
        da[i] = (g * bv) * dsilu;
        db[i] = g * silu;
    }
}

/* ------------------------------------------------------------------ gated residual */

/* Per-column float64 tables shared with the AVX-512 variant: tg = (float)tanh(gate),
 * s2 = sech^2(gate) = 1/cosh^2 (no cancellation; 0 once cosh overflows). */
int nx_gated_residual_bwd_f32_generic(const float *y, const float *gate, const float *dout,
                                      float *dresid, float *dy, float *dgate, int64_t D, int64_t r0,
                                      int64_t r1) {
    double *acc = calloc((size_t)(D > 0 ? D : 1), sizeof(double));
    float *tg = malloc(sizeof(float) * (size_t)(D > 0 ? D : 1));
    if (!acc || !tg) {
        free(acc);
        free(tg);
        return -1;
    }
    for (int64_t c = 0; c < D; c++) tg[c] = (float)tanh((double)gate[c]);
    for (int64_t r = r0; r < r1; r++) {
        const float *g = dout + r * D, *yr = y + r * D;
        float *o = dy + r * D;
        float *dr = dresid ? dresid + r * D : NULL;
        for (int64_t c = 0; c < D; c++) {
            float gv = g[c];
            acc[c] += (double)gv * (double)yr[c];
            if (dr) dr[c] = gv;
            o[c] = gv * tg[c];
        }
    }
    if (dgate)
        for (int64_t c = 0; c < D; c++) {
            double ch = cosh((double)gate[c]);
            dgate[c] = (float)(acc[c] * (1.0 / (ch * ch)));
        }
    free(acc);
    free(tg);
    return 0;
}

/* ------------------------------------------------------------------ attention */

/* The spec: one query row at a time, everything in float64. Per kv head g: dk/dv accumulate over
 * the group's query heads (ascending) and rows (ascending) in float64 scratch, then round once. */
int nx_attention_bwd_f32_generic(const float *q, const float *k, const float *v, const float *dout,
                                 const uint8_t *mask, float *dq, float *dk, float *dv, int64_t T,
                                 int64_t H, int64_t KVH, int64_t hd, float scale, int64_t g0,
                                 int64_t g1) {
    const int64_t group = H / KVH;
    double *p = malloc(sizeof(double) * (size_t)(2 * T + hd + 2 * T * hd));
    if (!p) return -1;
    double *dp = p + T, *dqa = dp + T, *dka = dqa + hd, *dva = dka + T * hd;
    const double sc = (double)scale;
    for (int64_t g = g0; g < g1; g++) {
        const float *kg = k + g * T * hd, *vg = v + g * T * hd;
        memset(dka, 0, sizeof(double) * (size_t)(2 * T * hd));
        for (int64_t h = g * group; h < (g + 1) * group; h++) {
            for (int64_t t = 0; t < T; t++) {
                const float *qr = q + (h * T + t) * hd, *dor = dout + (h * T + t) * hd;
                float *dqr = dq + (h * T + t) * hd;
                double m = -INFINITY;
                for (int64_t j = 0; j < T; j++) {
                    if (mask && !mask[j]) {
                        p[j] = -INFINITY;
                        continue;
                    }
                    double s = 0.0;
                    for (int64_t d = 0; d < hd; d++) s += (double)qr[d] * (double)kg[j * hd + d];
                    p[j] = s * sc;
                    if (p[j] > m) m = p[j];
                }
                if (m == -INFINITY) { /* every key masked: the output row is constant 0 */
                    for (int64_t d = 0; d < hd; d++) dqr[d] = 0.0f;
                    continue;
                }
                double l = 0.0;
                for (int64_t j = 0; j < T; j++) {
                    p[j] = exp(p[j] - m);
                    l += p[j];
                }
                double delta = 0.0;
                for (int64_t j = 0; j < T; j++) {
                    p[j] /= l;
                    double s = 0.0;
                    if (p[j] != 0.0)
                        for (int64_t d = 0; d < hd; d++)
                            s += (double)dor[d] * (double)vg[j * hd + d];
                    dp[j] = s;
                    delta += p[j] * s;
                }
                for (int64_t d = 0; d < hd; d++) dqa[d] = 0.0;
                for (int64_t j = 0; j < T; j++) {
                    if (p[j] == 0.0) continue; /* masked (or underflowed) key: no gradient */
                    const double ds = p[j] * (dp[j] - delta);
                    const float *kr = kg + j * hd;
                    double *dkr = dka + j * hd, *dvr = dva + j * hd;
                    for (int64_t d = 0; d < hd; d++) {
                        dqa[d] += ds * (double)kr[d];
                        dkr[d] += ds * (double)qr[d];
                        dvr[d] += p[j] * (double)dor[d];
                    }
                }
                for (int64_t d = 0; d < hd; d++) dqr[d] = (float)(dqa[d] * sc);
            }
        }
        for (int64_t i = 0; i < T * hd; i++) {
            dk[g * T * hd + i] = (float)(dka[i] * sc);
            dv[g * T * hd + i] = (float)dva[i];
        }
    }
    free(p);
    return 0;
}

const nx_bwd_table nx_bwd_table_generic = {
    .rmsnorm_backward = nx_rmsnorm_bwd_f32_generic,
    .rope_backward = nx_rope_bwd_f32_generic,
    .qknorm_rope_backward = nx_qknorm_rope_bwd_f32_generic,
    .swiglu_backward = nx_swiglu_bwd_f32_generic,
    .gated_residual_backward = nx_gated_residual_bwd_f32_generic,
    .attention_backward = nx_attention_bwd_f32_generic,
};
