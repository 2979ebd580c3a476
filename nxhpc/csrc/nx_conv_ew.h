/* nx_conv_ew.h -- the convolutional kernels that pay for vectors, written once for both widths
 * (nx_simd.h): the GroupNorm affine map + SiLU and the im2col panel of a 3x3 convolution.
 * Included exactly once by nx_conv_avx2.c and by nx_conv_avx512.c (NXV_FN names the variant).
 *
 * affine_act: every lane runs the spec's (x * scale) + shift unfused, then the vector silu
 * (nx_vmath_<isa>.h, the swiglu's), so the affine part is bit-identical to generic and silu agrees
 * to its tolerance. im2col3x3: the 9 taps of NXV_W channels are loaded as NXV_W rows (taps past
 * 8 zero), transposed in registers (nxv_transpose) and stored as each channel's 9 taps; channels
 * past the last whole vector run the spec's scalar copy. Copies only: bit-identical to generic.
 * Must not: be included from generic files, allocate per row.
 */
#ifndef NX_CONV_EW_H
#define NX_CONV_EW_H

#include <stdint.h>
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

#endif
