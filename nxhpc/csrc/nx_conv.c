/* nx_conv.c -- generic (scalar) spec of the convolutional kernels (GroupNorm steps, im2col of a
 * 3x3 convolution, nearest x2 upsampling, residual add) + the family's dispatch.
 * Owns: the reference arithmetic of nx_conv.h, the generic table and the family's resolver.
 * Must not: use ISA-specific instructions (compiled without ISA flags), allocate per row.
 */
#include "nx_conv.h"
#include "nx_lowp.h" /* nx_matmul_bf16_rows; nx_matmul.h: nx_matmul_rows */

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------ dispatch */

NX_DEFINE_DISPATCH(nx_conv, "conv", NX_CONV_SLOTS,
                   {[NX_ISA_GENERIC] = &nx_conv_table_generic,
                    NX_X86_ONLY([NX_ISA_AVX2] = &nx_conv_table_avx2,
                                [NX_ISA_AVX512] = &nx_conv_table_avx512, )})

const nx_conv_table nx_conv_table_generic = {
    .gn_partials = nx_gn_partials_f32_generic,
    .gn_coeffs = nx_gn_coeffs_f32_generic,
    .affine_act = nx_affine_act_f32_generic,
    .im2col3x3 = nx_im2col3x3_f32_generic,
    .upsample2x = nx_upsample2x_f32_generic,
    .add = nx_add_f32_generic,
};

int nx_gn_partials_f32(nx_isa isa, const float *x, int64_t P, int64_t C, int64_t G, int64_t chunk,
                       double *part, int64_t k0, int64_t k1) {
    return nx_conv_get(isa)->gn_partials(x, P, C, G, chunk, part, k0, k1);
}

void nx_gn_coeffs_f32(nx_isa isa, const double *part, int64_t P, int64_t C, int64_t G,
                      int64_t chunk, const float *gamma, const float *beta, float eps, float *scale,
                      float *shift) {
    nx_conv_get(isa)->gn_coeffs(part, P, C, G, chunk, gamma, beta, eps, scale, shift);
}

void nx_affine_act_f32(nx_isa isa, const float *x, const float *scale, const float *shift,
                       float *out, int64_t C, int silu, int64_t r0, int64_t r1) {
    nx_conv_get(isa)->affine_act(x, scale, shift, out, C, silu, r0, r1);
}

void nx_im2col3x3_f32(nx_isa isa, const float *x, int64_t H, int64_t W, int64_t C, int up,
                      float *panel, int64_t p0, int64_t p1) {
    nx_conv_get(isa)->im2col3x3(x, H, W, C, up, panel, p0, p1);
}

/* the im2col rows of output pixels [p0 + t0, p0 + t0 + rows) */
typedef struct {
    nx_isa isa;
    const float *x;
    int64_t H, W, C, p0;
    int up;
} nx_im2col_src;

static void nx_im2col_rows(const void *ctx, size_t t0, size_t rows, float *dst) {
    const nx_im2col_src *s = (const nx_im2col_src *)ctx;
    const int64_t a = s->p0 + (int64_t)t0;
    nx_im2col3x3_f32(s->isa, s->x, s->H, s->W, s->C, s->up, dst, a, a + (int64_t)rows);
}

int nx_conv3x3_f32(nx_isa isa, uint32_t type, const float *x, int64_t H, int64_t W, int64_t C,
                   int up, const uint8_t *w, const float *bias, float *out, int64_t N, int64_t p0,
                   int64_t p1) {
    if (p1 <= p0) return 0;
    const nx_im2col_src src = {isa, x, H, W, C, p0, up};
    return nx_matmul_rows(isa, type, nx_im2col_rows, &src, w, bias, out + p0 * N,
                          (size_t)(p1 - p0), (size_t)(9 * C), (size_t)N, 0, (size_t)N);
}

int nx_conv3x3_bf16(nx_isa isa, uint32_t type, const float *x, int64_t H, int64_t W, int64_t C,
                    int up, const uint8_t *w, const float *bias, float *out, int64_t N, int64_t p0,
                    int64_t p1, unsigned flags) {
    if (p1 <= p0) return 0;
    const nx_im2col_src src = {isa, x, H, W, C, p0, up};
    return nx_matmul_bf16_rows(isa, type, nx_im2col_rows, &src, w, bias, out + p0 * N,
                               (size_t)(p1 - p0), (size_t)(9 * C), (size_t)N, 0, (size_t)N, flags);
}

void nx_upsample2x_f32(nx_isa isa, const float *x, int64_t H, int64_t W, int64_t C, float *out,
                       int64_t p0, int64_t p1) {
    nx_conv_get(isa)->upsample2x(x, H, W, C, out, p0, p1);
}

void nx_add_f32(nx_isa isa, const float *a, const float *b, float *out, int64_t i0, int64_t i1) {
    nx_conv_get(isa)->add(a, b, out, i0, i1);
}

/* ------------------------------------------------------------------ GroupNorm */

static void nx_gn_sum_row(const float *xr, const double *mc, double *acc, int64_t C) {
    (void)mc;
    nx_gn_sum_cols(xr, acc, 0, C);
}

static void nx_gn_dev_row(const float *xr, const double *mc, double *acc, int64_t C) {
    nx_gn_dev_cols(xr, mc, acc, 0, C);
}

int nx_gn_partials_f32_generic(const float *x, int64_t P, int64_t C, int64_t G, int64_t chunk,
                               double *part, int64_t k0, int64_t k1) {
    return nx_gn_partials_chunks(x, P, C, G, chunk, part, k0, k1, nx_gn_sum_row, nx_gn_dev_row);
}

void nx_gn_coeffs_f32_generic(const double *part, int64_t P, int64_t C, int64_t G, int64_t chunk,
                              const float *gamma, const float *beta, float eps, float *scale,
                              float *shift) {
    const int64_t cpg = C / G, nchunks = (P + chunk - 1) / chunk;
    for (int64_t g = 0; g < G; g++) {
        double na = 0.0, ma = 0.0, m2a = 0.0;
        for (int64_t k = 0; k < nchunks; k++) {
            const int64_t rows = (k + 1) * chunk <= P ? chunk : P - k * chunk;
            const double nb = (double)(rows * cpg);
            const double mb = part[(k * G + g) * 2], m2b = part[(k * G + g) * 2 + 1];
            if (na == 0.0) {
                na = nb;
                ma = mb;
                m2a = m2b;
                continue;
            }
            const double n = na + nb, d = mb - ma;
            ma = ma + d * (nb / n);
            m2a = m2a + m2b + d * d * (na * nb / n);
            na = n;
        }
        const double var = na > 0.0 ? m2a / na : 0.0;
        const double r = 1.0 / sqrt(var + (double)eps);
        for (int64_t c = g * cpg; c < (g + 1) * cpg; c++) {
            const double a = (double)gamma[c] * r;
            scale[c] = (float)a;
            shift[c] = (float)((double)beta[c] - ma * a);
        }
    }
}

/* silu(y) = (y < 0 ? y*e : y) / (1 + e), e = exp(-|y|): never overflows; silu(-inf) = -0. */
static inline float nx_conv_silu(float y) {
    const float e = expf(-fabsf(y));
    const float num = y < 0.0f ? fmaxf(y, -3.4028234663852886e38f) * e : y;
    return num / (1.0f + e);
}

void nx_affine_act_f32_generic(const float *x, const float *scale, const float *shift, float *out,
                               int64_t C, int silu, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
        const float *xr = x + r * C;
        float *o = out + r * C;
        for (int64_t c = 0; c < C; c++) {
            const float t = xr[c] * scale[c];
            const float y = t + shift[c];
            o[c] = silu ? nx_conv_silu(y) : y;
        }
    }
}

/* ------------------------------------------------------------------ im2col, upsampling, add */

void nx_im2col3x3_f32_generic(const float *x, int64_t H, int64_t W, int64_t C, int up,
                              float *panel, int64_t p0, int64_t p1) {
    const int64_t Ho = H << up, Wo = W << up, K = 9 * C;
    for (int64_t p = p0; p < p1; p++) {
        const int64_t yo = p / Wo, xo = p % Wo;
        float *row = panel + (p - p0) * K;
        for (int64_t tap = 0; tap < 9; tap++) {
            const int64_t ys = yo + tap / 3 - 1, xs = xo + tap % 3 - 1;
            if (ys < 0 || ys >= Ho || xs < 0 || xs >= Wo) {
                for (int64_t c = 0; c < C; c++) row[c * 9 + tap] = 0.0f;
                continue;
            }
            const float *src = x + ((ys >> up) * W + (xs >> up)) * C;
            for (int64_t c = 0; c < C; c++) row[c * 9 + tap] = src[c];
        }
    }
}

void nx_upsample2x_f32_generic(const float *x, int64_t H, int64_t W, int64_t C, float *out,
                               int64_t p0, int64_t p1) {
    (void)H;
    const int64_t Wo = 2 * W;
    for (int64_t p = p0; p < p1; p++) {
        const int64_t yo = p / Wo, xo = p % Wo;
        memcpy(out + p * C, x + ((yo >> 1) * W + (xo >> 1)) * C, sizeof(float) * (size_t)C);
    }
}

void nx_add_f32_generic(const float *a, const float *b, float *out, int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; i++) out[i] = a[i] + b[i];
}
