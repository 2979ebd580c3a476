/* nx_conv_ew.h -- the convolutional kernels that pay for vectors, written once for both widths
 * (nx_simd.h): the GroupNorm partials, the affine map + SiLU, the im2col panel of a 3x3
 * convolution and the add.
 * Included exactly once by nx_conv_avx2.c and by nx_conv_avx512.c (NXV_FN names the variant).
 *
 * affine_act: every lane runs the spec's (x * scale) + shift unfused, then the vector silu
 * (nx_vmath_<isa>.h, the swiglu's), so the affine part is bit-identical to generic and silu agrees
 * to its tolerance. im2col3x3: the 9 taps of NXV_W channels are loaded as NXV_W rows (taps past
 * 8 zero), transposed in registers (nxv_transpose) and stored as each channel's 9 taps; channels
 * past the last whole vector run the spec's scalar copy. Copies only: bit-identical to generic.
 * gn_partials: the spec's float64 chains, one per channel, several channels a vector (the rows
 * in order; x - mean, its square and the sum three roundings), the group sums over channels in
 * order as scalars: bit-identical to generic. add: one float32 add per element.
 * Must not: be included from generic files, allocate per row.
 */
#ifndef NX_CONV_EW_H
#define NX_CONV_EW_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "nx_conv.h"
#include "nx_simd.h"

void NXV_FN(nx_affine_act_f32)(const float *x, const float *scale, const float *shift, float *out,
                               int64_t C, int silu, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
        const float *xr = x + r * C;
        float *o = out + r * C;
        int64_t c = 0;
        for (; c + NXV_W <= C; c += NXV_W) {
            nxv y = nxv_add(nxv_mul(nxv_loadu(xr + c), nxv_loadu(scale + c)), nxv_loadu(shift + c));
            nxv_storeu(o + c, silu ? nxv_silu(y) : y);
        }
        if (c < C) {
            const nxv_mask m = nxv_mask_n(C - c);
            nxv y = nxv_add(nxv_mul(nxv_load_n(xr + c, m), nxv_load_n(scale + c, m)),
                            nxv_load_n(shift + c, m));
            nxv_store_n(o + c, m, silu ? nxv_silu(y) : y);
        }
    }
}

void NXV_FN(nx_im2col3x3_f32)(const float *x, int64_t H, int64_t W, int64_t C, int up,
                              float *panel, int64_t p0, int64_t p1) {
    const int64_t Ho = H << up, Wo = W << up, K = 9 * C;
    for (int64_t p = p0; p < p1; p++) {
        const int64_t yo = p / Wo, xo = p % Wo;
        float *row = panel + (p - p0) * K;
        const float *src[9]; /* the tap's source pixel, NULL in the zero padding */
        for (int tap = 0; tap < 9; tap++) {
            const int64_t ys = yo + tap / 3 - 1, xs = xo + tap % 3 - 1;
            src[tap] = (ys < 0 || ys >= Ho || xs < 0 || xs >= Wo)
                           ? NULL
                           : x + ((ys >> up) * W + (xs >> up)) * C;
        }
        int64_t c0 = 0;
        for (; c0 + NXV_W <= C; c0 += NXV_W) {
            nxv r[NXV_W];
            for (int tap = 0; tap < NXV_W; tap++)
                r[tap] = tap < 9 && src[tap] ? nxv_loadu(src[tap] + c0) : nxv_zero();
#if NXV_W >= 9
            nxv_transpose(r); /* r[j] lanes 0..8 = channel c0 + j's taps */
            const nxv_mask m9 = nxv_mask_n(9);
            for (int j = 0; j < NXV_W; j++) nxv_store_n(row + (c0 + j) * 9, m9, r[j]);
#else
            float last[NXV_W]; /* tap 8 of each channel */
            if (src[8])
                memcpy(last, src[8] + c0, sizeof last);
            else
                memset(last, 0, sizeof last);
            nxv_transpose(r); /* r[j] = channel c0 + j's taps 0 .. NXV_W-1 */
            for (int j = 0; j < NXV_W; j++) {
                nxv_storeu(row + (c0 + j) * 9, r[j]);
                row[(c0 + j) * 9 + 8] = last[j];
            }
#endif
        }
        for (int tap = 0; tap < 9; tap++)
            for (int64_t c = c0; c < C; c++) row[c * 9 + tap] = src[tap] ? src[tap][c] : 0.0f;
    }
}

/* float64 vectors of half the float32 width (the GroupNorm partials' chains) */
#if NXV_W == 16
typedef __m512d nxd;
#define NXD_W 8
#define nxd_cvt(p) _mm512_cvtps_pd(_mm256_loadu_ps(p))
#define nxd_load(p) _mm512_loadu_pd(p)
#define nxd_store(p, v) _mm512_storeu_pd(p, v)
#define nxd_add _mm512_add_pd
#define nxd_sub _mm512_sub_pd
#define nxd_mul _mm512_mul_pd
#else
typedef __m256d nxd;
#define NXD_W 4
#define nxd_cvt(p) _mm256_cvtps_pd(_mm_loadu_ps(p))
#define nxd_load(p) _mm256_loadu_pd(p)
#define nxd_store(p, v) _mm256_storeu_pd(p, v)
#define nxd_add _mm256_add_pd
#define nxd_sub _mm256_sub_pd
#define nxd_mul _mm256_mul_pd
#endif

/* gn_partials' two row steps (nx_gn_partials_chunks, nx_conv.h) with NXD_W channels' chains a
 * vector and the spec's scalar steps for the channels past the last whole vector: the same
 * operations per channel, so the same bits (this file is built without FMA contraction:
 * -std=c11). */
static void NXV_FN(nx_gn_sum_row)(const float *xr, const double *mc, double *acc, int64_t C) {
    (void)mc;
    int64_t c = 0;
    for (; c + NXD_W <= C; c += NXD_W)
        nxd_store(acc + c, nxd_add(nxd_load(acc + c), nxd_cvt(xr + c)));
    nx_gn_sum_cols(xr, acc, c, C);
}

static void NXV_FN(nx_gn_dev_row)(const float *xr, const double *mc, double *acc, int64_t C) {
    int64_t c = 0;
    for (; c + NXD_W <= C; c += NXD_W) {
        const nxd d = nxd_sub(nxd_cvt(xr + c), nxd_load(mc + c));
        nxd_store(acc + c, nxd_add(nxd_load(acc + c), nxd_mul(d, d)));
    }
    nx_gn_dev_cols(xr, mc, acc, c, C);
}

int NXV_FN(nx_gn_partials_f32)(const float *x, int64_t P, int64_t C, int64_t G, int64_t chunk,
                               double *part, int64_t k0, int64_t k1) {
    return nx_gn_partials_chunks(x, P, C, G, chunk, part, k0, k1, NXV_FN(nx_gn_sum_row),
                                 NXV_FN(nx_gn_dev_row));
}

void NXV_FN(nx_add_f32)(const float *a, const float *b, float *out, int64_t i0, int64_t i1) {
    int64_t i = i0;
    for (; i + NXV_W <= i1; i += NXV_W)
        nxv_storeu(out + i, nxv_add(nxv_loadu(a + i), nxv_loadu(b + i)));
    if (i < i1) {
        const nxv_mask m = nxv_mask_n(i1 - i);
        nxv_store_n(out + i, m, nxv_add(nxv_load_n(a + i, m), nxv_load_n(b + i, m)));
    }
}

#endif
