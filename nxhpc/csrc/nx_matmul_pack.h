/* nx_matmul_pack.h -- the matmul's weight-panel packers, written once for both vector widths
 * (nx_simd.h): a panel is NR = 2 * NXV_W columns (32 for AVX-512, 16 for AVX2) in two halves of
 * NXV_W columns, each transposed in registers NXV_W x NXV_W at a time. Included exactly once by
 * nx_matmul_avx2.c and nx_matmul_avx512.c, whose tilings (nx_matmul.h, nx_mm_tiling) name them
 * NXV_FN(nx_mm_pack_rows) / NXV_FN(nx_mm_pack_q8_0).
 *
 * Both write the layout nx_matmul.h defines for pack_b: columns [j0, j0+nc) x blocks [b0, b0+kb)
 * into Bp[p*kc*NR + k*NR + j] = w[j0 + NR*p + j, blck_elems*b0 + k], columns past nc zero. The
 * values are the type's dequantized values, exact, so either packer gives the same panel.
 * Must not: be included from generic files, allocate (the scratch is on the stack).
 */
#ifndef NX_MATMUL_PACK_H
#define NX_MATMUL_PACK_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "nx_matmul.h"
#include "nx_simd.h"

#define NXP_NR (2 * NXV_W) /* panel width of both micro-kernels */

/* Columns of panel half c0.. that exist: 0..NXV_W. */
static inline int NXV_FN(nx_mm_half_cols_)(size_t nc, size_t c0) {
    return c0 >= nc ? 0 : (nc - c0 >= NXV_W ? NXV_W : (int)(nc - c0));
}

/* The generic packer (any weight type, nx_mm_tiling.pack_rows): per half panel and span of
 * <= NX_MM_PACK_SPAN k-values, c->dequant the rows' blocks into an NXV_W x NX_MM_PACK_SPAN stack
 * scratch, then transpose NXV_W x NXV_W tiles into the panel (masked at the k tail). */
static void NXV_FN(nx_mm_pack_rows)(const nx_mm_call *c, size_t j0, size_t nc, size_t b0, size_t kb,
                                    float *Bp /* OUT */) {
    const size_t E = c->wt->blck_elems, BB = c->wt->blck_bytes, kc = kb * E;
    float scratch[NXV_W * NX_MM_PACK_SPAN] __attribute__((aligned(64)));
    for (size_t p = 0; p * NXP_NR < nc; p++) {
        float *dst = Bp + p * kc * NXP_NR;
        for (int h = 0; h < 2; h++) {
            const size_t c0 = p * NXP_NR + (size_t)h * NXV_W;
            const int ncol = NXV_FN(nx_mm_half_cols_)(nc, c0);
            if (ncol == 0) {
                for (size_t k = 0; k < kc; k++) nxv_store(dst + k * NXP_NR + h * NXV_W, nxv_zero());
                continue;
            }
            for (size_t s0 = 0; s0 < kc; s0 += NX_MM_PACK_SPAN) {
                const size_t span = kc - s0 < NX_MM_PACK_SPAN ? kc - s0 : NX_MM_PACK_SPAN;
                const uint8_t *base = c->w + (j0 + c0) * c->rowbytes + (b0 + s0 / E) * BB;
                for (int i = 0; i < ncol; i++)
                    c->dequant(base + (size_t)i * c->rowbytes, scratch + i * NX_MM_PACK_SPAN,
                               span / E);
                for (size_t k0 = 0; k0 < span; k0 += NXV_W) {
                    const nxv_mask m = nxv_mask_n((int64_t)(span - k0));
                    nxv r[NXV_W];
                    for (int i = 0; i < NXV_W; i++)
                        r[i] = i < ncol ? nxv_load_n(scratch + i * NX_MM_PACK_SPAN + k0, m)
                                        : nxv_zero();
                    nxv_transpose(r);
                    const size_t nk = span - k0 < NXV_W ? span - k0 : NXV_W;
                    for (size_t k = 0; k < nk; k++)
                        nxv_store(dst + (s0 + k0 + k) * NXP_NR + h * NXV_W, r[k]);
                }
            }
        }
    }
}

/* The fused Q8_0 packer (nx_mm_tiling.pack_fused[NX_GGML_Q8_0]): d * q decoded (exact) and
 * transposed in registers, NXV_W quants of NXV_W rows at a time; the scale is widened by F16C
 * (quiets an sNaN scale, which the product quiets anyway). */
static void NXV_FN(nx_mm_pack_q8_0)(const nx_mm_call *c, size_t j0, size_t nc, size_t b0, size_t kb,
                                    float *Bp /* OUT */) {
    const size_t kc = kb * NX_QK8_0, rowbytes = c->rowbytes;
    for (size_t p = 0; p * NXP_NR < nc; p++) {
        float *dst = Bp + p * kc * NXP_NR;
        for (int h = 0; h < 2; h++) {
            const size_t c0 = p * NXP_NR + (size_t)h * NXV_W;
            const int ncol = NXV_FN(nx_mm_half_cols_)(nc, c0);
            for (size_t b = 0; b < kb; b++) {
                float *db = dst + b * NX_QK8_0 * NXP_NR + h * NXV_W;
                if (ncol == 0) {
                    for (int k = 0; k < NX_QK8_0; k++) nxv_store(db + k * NXP_NR, nxv_zero());
                    continue;
                }
                const uint8_t *base =
                    c->w + (j0 + c0) * rowbytes + (b0 + b) * sizeof(nx_block_q8_0);
                for (int q = 0; q < NX_QK8_0; q += NXV_W) {
                    nxv r[NXV_W];
                    for (int i = 0; i < NXV_W; i++) {
                        if (i < ncol) {
                            const uint8_t *blk = base + (size_t)i * rowbytes;
                            uint16_t dh;
                            memcpy(&dh, blk, 2);
                            r[i] = nxv_load_q8(blk + 2 + q, nxv_set1(_cvtsh_ss(dh)));
                        } else {
                            r[i] = nxv_zero();
                        }
                    }
                    nxv_transpose(r);
                    for (int k = 0; k < NXV_W; k++) nxv_store(db + (q + k) * NXP_NR, r[k]);
                }
            }
        }
    }
}

#endif
