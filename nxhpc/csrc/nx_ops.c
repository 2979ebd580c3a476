/* nx_ops.c -- generic (scalar) spec of the block's non-matmul kernels + their ISA dispatch.
 * Owns: the reference arithmetic every SIMD variant is tested against, the generic table and the
 * family's resolver (nx_dispatch.h).
 * Must not: use ISA-specific instructions (compiled without ISA flags), allocate per row. */
#include "nx_ops.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------ dispatch */

NX_DEFINE_DISPATCH(
    nx_ops, "ops", NX_OPS_SLOTS,
    {[NX_ISA_GENERIC] = &nx_ops_table_generic,
     NX_X86_ONLY([NX_ISA_AVX2] = &nx_ops_table_avx2, [NX_ISA_AVX512] = &nx_ops_table_avx512, )})

void nx_rmsnorm_f32(nx_isa isa, const float *x, const float *w, const float *mod, float *out,
                    int64_t D, float eps, int64_t r0, int64_t r1) {
    nx_ops_get(isa)->rmsnorm(x, w, mod, out, D, eps, r0, r1);
}

void nx_qknorm_rope_f32(nx_isa isa, const float *qkv, const float *q_w, const float *k_w,
                        const float *pe, float *q_out, float *k_out, int64_t T, int64_t H,
                        int64_t KVH, int64_t hd, float eps, int64_t h0, int64_t h1, int half) {
    nx_ops_get(isa)->qknorm_rope(qkv, q_w, k_w, pe, q_out, k_out, T, H, KVH, hd, eps, h0, h1, half);
}

int nx_attention_f32(nx_isa isa, const float *q, const float *k, const float *qkv,
                     const uint8_t *mask, float *out, int64_t T, int64_t H, int64_t KVH, int64_t hd,
                     float scale, int64_t h0, int64_t h1, int64_t t0, int64_t t1, int causal) {
    return nx_ops_get(isa)->attention(q, k, qkv, mask, out, T, H, KVH, hd, scale, h0, h1, t0, t1,
                                      causal);
}

void nx_swiglu_f32(nx_isa isa, const float *a, const float *b, float *out, int64_t i0, int64_t i1) {
    nx_ops_get(isa)->swiglu(a, b, out, i0, i1);
}

int nx_gated_residual_f32(nx_isa isa, const float *resid, const float *y, const float *gate,
                          float *out, int64_t D, int64_t r0, int64_t r1) {
    return nx_ops_get(isa)->gated_residual(resid, y, gate, out, D, r0, r1);
}

int nx_norm_residual_f32(nx_isa isa, const float *y, const float *w, const float *resid,
                         const float *gate, float *out, const float *w2, const float *mod2, float *h,
                         int64_t D, float eps, int64_t r0, int64_t r1) {
    return nx_ops_get(isa)->norm_residual(y, w, resid, gate, out, w2, mod2, h, D, eps, r0, r1);
}

void nx_vmath_f32(nx_isa isa, int which, const float *x, float *out, int64_t n) {
    nx_ops_get(isa)->vmath(which, x, out, n);
}

void nx_layernorm_mod_f32(nx_isa isa, const float *x, const float *mod, float *out, int64_t D,
                          float eps, int64_t r0, int64_t r1) {
    nx_ops_get(isa)->layernorm_mod(x, mod, out, D, eps, r0, r1);
}

/* ------------------------------------------------------------------ rmsnorm */

/* 1 / sqrt(sum(x^2)/n + eps), sum in float64 over 16 lanes (lane = i % 16), fixed tree.
 * The SIMD variants reproduce exactly this order. */
static float nx_rms_inv_generic(const float *x, int64_t n, float eps) {
    double acc[16] = {0};
    for (int64_t i = 0; i < n; i++) {
        double v = (double)x[i];
        acc[i & 15] += v * v;
    }
    for (int l = 0; l < 8; l++) acc[l] += acc[l + 8];
    for (int l = 0; l < 4; l++) acc[l] += acc[l + 4];
    for (int l = 0; l < 2; l++) acc[l] += acc[l + 2];
    double ss = acc[0] + acc[1];
    return (float)(1.0 / sqrt(ss / (double)n + (double)eps));
}

void nx_rmsnorm_f32_generic(const float *x, const float *w, const float *mod, float *out, int64_t D,
                            float eps, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
        const float *xr = x + r * D;
        float *o = out + r * D;
        float inv = nx_rms_inv_generic(xr, D, eps);
        if (mod) {
            for (int64_t i = 0; i < D; i++) o[i] = ((xr[i] * inv) * w[i]) * mod[i];
        } else {
            for (int64_t i = 0; i < D; i++) o[i] = (xr[i] * inv) * w[i];
        }
    }
}

/* ------------------------------------------------------------------ layernorm_mod */

/* The fixed 16-lane combining tree (l + l+8), (l + l+4), (l + l+2), (l0 + l1). */
static double nx_tree16_generic(double *acc) {
    for (int l = 0; l < 8; l++) acc[l] += acc[l + 8];
    for (int l = 0; l < 4; l++) acc[l] += acc[l + 4];
    for (int l = 0; l < 2; l++) acc[l] += acc[l + 2];
    return acc[0] + acc[1];
}

/* mean and population variance of x[0:n] in float64, the order of nx_ops.h (SIMD: nx_ln_stats16 /
 * nx_ln_stats8 reproduce it). Compiled with -std=c11: no contraction of d*d + q into an FMA. */
static void nx_ln_stats_generic(const float *x, int64_t n, double *mean, double *var) {
    double s[16] = {0}, q[16] = {0};
    for (int64_t i = 0; i < n; i++) s[i & 15] += (double)x[i];
    const double mu = nx_tree16_generic(s) / (double)n;
    for (int64_t i = 0; i < n; i++) {
        const double d = (double)x[i] - mu;
        q[i & 15] += d * d;
    }
    *mean = mu;
    *var = nx_tree16_generic(q) / (double)n;
}

void nx_layernorm_mod_f32_generic(const float *x, const float *mod, float *out, int64_t D,
                                  float eps, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
        const float *xr = x + r * D;
        float *o = out + r * D;
        double mean, var;
        nx_ln_stats_generic(xr, D, &mean, &var);
        const float rs = (float)(1.0 / sqrt(var + (double)eps));
        for (int64_t i = 0; i < D; i++) o[i] = ((float)((double)xr[i] - mean) * rs) * mod[i];
    }
}

/* ------------------------------------------------------------------ qknorm + rope */

void nx_qknorm_rope_f32_generic(const float *qkv, const float *q_w, const float *k_w,
                                const float *pe, float *q_out, float *k_out, int64_t T, int64_t H,
                                int64_t KVH, int64_t hd, float eps, int64_t h0, int64_t h1,
                                int half) {
    const int64_t W = (H + 2 * KVH) * hd;
    for (int64_t j = h0; j < h1; j++) {
        const float *wt = j < H ? q_w : k_w;
        float *dst = j < H ? q_out + j * T * hd : k_out + (j - H) * T * hd;
        for (int64_t t = 0; t < T; t++) {
            const float *xr = qkv + t * W + j * hd;
            const float *p = pe + t * hd * 2; /* [hd/2][2][2] */
            float *o = dst + t * hd;
            float inv = nx_rms_inv_generic(xr, hd, eps);
            if (half) {
                for (int64_t i = 0; i < hd / 2; i++)
                    nx_qknorm_rope_half_pair(xr, inv, wt, p, o, i, hd / 2);
            } else {
                for (int64_t i = 0; i < hd; i += 2) nx_qknorm_rope_pair(xr, inv, wt, p, o, i);
            }
        }
    }
}

/* ------------------------------------------------------------------ attention */

#define NX_ATTN_GEN_TILE 64

int nx_attention_f32_generic(const float *q, const float *k, const float *qkv, const uint8_t *mask,
                             float *out, int64_t T, int64_t H, int64_t KVH, int64_t hd, float scale,
                             int64_t h0, int64_t h1, int64_t t0, int64_t t1, int causal) {
    const int64_t W = (H + 2 * KVH) * hd, group = H / KVH, OW = H * hd;
    float *acc = malloc(sizeof(float) * (size_t)hd);
    float s[NX_ATTN_GEN_TILE];
    if (!acc) return -1;
    for (int64_t h = h0; h < h1; h++) {
        const int64_t g = h / group;
        const float *kh = k + g * T * hd;
        const float *vh = qkv + (H + KVH) * hd + g * hd;
        for (int64_t t = t0; t < t1; t++) {
            const float *qr = q + (h * T + t) * hd;
            float m = -INFINITY, l = 0.0f;
            const int64_t nkeys = causal ? t + 1 : T; /* keys [0, nkeys) exist for this row */
            for (int64_t d = 0; d < hd; d++) acc[d] = 0.0f;
            for (int64_t j0 = 0; j0 < nkeys; j0 += NX_ATTN_GEN_TILE) {
                int64_t n = nkeys - j0 < NX_ATTN_GEN_TILE ? nkeys - j0 : NX_ATTN_GEN_TILE;
                float mx = -INFINITY;
                for (int64_t jj = 0; jj < n; jj++) {
                    const float *kr = kh + (j0 + jj) * hd;
                    float dot = 0.0f;
                    for (int64_t d = 0; d < hd; d++) dot += qr[d] * kr[d];
                    s[jj] = (mask && !mask[j0 + jj]) ? -INFINITY : dot * scale;
                    if (s[jj] > mx) mx = s[jj];
                }
                float m_new = mx > m ? mx : m;
                float m_use = m_new == -INFINITY ? 0.0f : m_new; /* all masked so far: p = 0 */
                float alpha = expf(m - m_use);
                float sum = 0.0f;
                for (int64_t d = 0; d < hd; d++) acc[d] *= alpha;
                for (int64_t jj = 0; jj < n; jj++) {
                    float p = expf(s[jj] - m_use);
                    sum += p;
                    const float *vr = vh + (j0 + jj) * W;
                    for (int64_t d = 0; d < hd; d++) acc[d] += p * vr[d];
                }
                l = l * alpha + sum;
                m = m_new;
            }
            float *o = out + t * OW + h * hd;
            if (l == 0.0f) {
                for (int64_t d = 0; d < hd; d++) o[d] = 0.0f;
            } else {
                float inv = 1.0f / l;
                for (int64_t d = 0; d < hd; d++) o[d] = acc[d] * inv;
            }
        }
    }
    free(acc);
    return 0;
}

/* ------------------------------------------------------------------ swiglu, gated residual */

static inline float nx_silu_generic(float x) {
    float e = expf(-fabsf(x));
    float num = x < 0.0f ? fmaxf(x, -3.4028234663852886e38f) * e : x;
    return num / (1.0f + e);
}

void nx_swiglu_f32_generic(const float *a, const float *b, float *out, int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; i++) out[i] = nx_silu_generic(a[i]) * b[i];
}

/* tanh(gate) once per call, in a buffer the caller frees (NULL if it could not be allocated) */
static float *nx_tanh_table_generic(const float *gate, int64_t D) {
    float *tg = malloc(sizeof(float) * (size_t)(D > 0 ? D : 1));
    if (!tg) return NULL;
    for (int64_t c = 0; c < D; c++) tg[c] = tanhf(gate[c]);
    return tg;
}

int nx_gated_residual_f32_generic(const float *resid, const float *y, const float *gate, float *out,
                                  int64_t D, int64_t r0, int64_t r1) {
    float *tg = nx_tanh_table_generic(gate, D);
    if (!tg) return -1;
    for (int64_t r = r0; r < r1; r++)
        for (int64_t c = 0; c < D; c++) out[r * D + c] = resid[r * D + c] + tg[c] * y[r * D + c];
    free(tg);
    return 0;
}

/* rmsnorm (no mod) and gated_residual of one row, never stored in between: each product is
 * rounded to float32 as it would be when stored (no contraction under -std=c11), then the
 * optional second norm by nx_rmsnorm_f32_generic itself. */
int nx_norm_residual_f32_generic(const float *y, const float *w, const float *resid,
                                 const float *gate, float *out, const float *w2, const float *mod2,
                                 float *h, int64_t D, float eps, int64_t r0, int64_t r1) {
    float *tg = nx_tanh_table_generic(gate, D);
    if (!tg) return -1;
    for (int64_t r = r0; r < r1; r++) {
        const float *yr = y + r * D, *rr = resid + r * D;
        float *o = out + r * D;
        const float inv = nx_rms_inv_generic(yr, D, eps);
        for (int64_t c = 0; c < D; c++) {
            const float v = (yr[c] * inv) * w[c];
            o[c] = rr[c] + tg[c] * v;
        }
        if (w2) nx_rmsnorm_f32_generic(out, w2, mod2, h, D, eps, r, r + 1);
    }
    free(tg);
    return 0;
}

void nx_vmath_f32_generic(int which, const float *x, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = which == 1 ? tanhf(x[i]) : expf(x[i]);
}

const nx_ops_table nx_ops_table_generic = NX_OPS_TABLE(generic);
