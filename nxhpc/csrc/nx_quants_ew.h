/* nx_quants_ew.h -- the SIMD dequantizers of the nine GGML block types (Q4_0 .. Q6_K), written
 * once for both vector widths (nx_simd.h): NXV_W lanes = NXV_W consecutive output elements, which
 * in every layout share one scale (sub-blocks are 16 or 32 elements, NXV_W is 8 or 16).
 *
 * Owns: the vector form of the decoding in nx_quants.c. Per-block scales use the spec's float32
 * products (scalar or lane-wise: the same IEEE ops, the same bits); each lane runs the spec's ops
 * in the spec's order (mul, then add/sub with the product as first operand).
 * Included exactly once by nx_quants_avx2.c and by nx_quants_avx512.c, after the pragma that turns
 * fp-contract off; each of them then defines the few width-specific steps declared below.
 * Must not: be included from generic files, fuse multiply and add, or read/write outside the
 * blocks given.
 */
#ifndef NX_QUANTS_EW_H
#define NX_QUANTS_EW_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "nx_quants.h"
#include "nx_simd.h"

#define NXQ_ALIGN __attribute__((aligned(4 * NXV_W))) /* a scale array nxv_store may write */

/* NXQ_EACH16(statements): the statements once per NXV_W-lane group of 16 elements, with
 * `const int g` = 0 .. 16/NXV_W - 1, repeated by the preprocessor instead of a loop (at 16 lanes
 * a loop of one trip compiles to other code than the straight line it means). */
#if NXV_W == 16
#define NXQ_EACH16(...) { const int g = 0; __VA_ARGS__ }
#else
#define NXQ_EACH16(...) { const int g = 0; __VA_ARGS__ } { const int g = 1; __VA_ARGS__ }
#endif

static inline float ld_f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

static inline uint32_t ld_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4); /* x86 is little-endian */
    return v;
}

/* The width-specific steps (defined by the including nx_quants_<isa>.c). */
/* dq + m, except that a NaN dq is returned as is (the spec's explicit NaN rule, nx_quants.h) */
static inline nxv nxq_add_m(nxv dq, nxv m);
/* NXQ_OR_QH(v, qh, j0, k16) (a macro, defined before the include): lane l of v OR-ed with
 * ((qh >> (j0 + l)) & 1) << 4, the fifth bit of Q5_0 / Q5_1; k16 = nxvi_set1(16). */
/* Q3_K: dl[i] = d * (scode_i - 32) for the 16 sub-blocks, scode_i = ((sc[i%8] >> 4*(i/8)) & 15)
 * | ((sc[8 + i%4] >> 2*(i/4)) & 3) << 4 (the spec's rule); reads exactly the 12 bytes at sc. */
static inline void nxq_scales_q3(const uint8_t *sc /* IN 12 bytes */, float d,
                                 float dl[16] /* OUT */);
/* Q4_K/Q5_K: dlml[j] = d * sc[j], dlml[8 + j] = dmin * mn[j] for the 8 sub-blocks (the spec's
 * rule: j < 4: sc = s[j] & 63, mn = s[j+4] & 63; j >= 4: sc = (s[j+4] & 15) | (s[j-4] >> 6) << 4,
 * mn = (s[j+4] >> 4) | (s[j] >> 6) << 4, s = the 12 bytes at p + 4). */
static inline void nxq_scales_k4(const uint8_t *p /* IN block */, float dlml[16] /* OUT */);

/* ------------------------------------------------------------------ 32-element types */

void NXV_FN(nx_dequant_q4_0)(const uint8_t *blocks /* IN */, float *out /* OUT */,
                             size_t nblocks) {
    const nxvi m15 = nxvi_set1(15), k8 = nxvi_set1(8);
    for (size_t b = 0; b < nblocks; b++) {
        const uint8_t *p = blocks + b * sizeof(nx_block_q4_0);
        float *o = out + b * NX_QK_LEGACY;
        const nxv d = NXV_PS(set1)(ld_f16(p));
        NXQ_EACH16(
            const nxvi v = nxvi_load_u8(p + 2 + NXV_W * g);
            const nxvi lo = nxvi_sub(nxvi_and(v, m15), k8);
            const nxvi hi = nxvi_sub(nxvi_srli(v, 4), k8);
            NXV_PS(storeu)(o + NXV_W * g, NXV_PS(mul)(d, nxvi_cvt(lo)));
            NXV_PS(storeu)(o + 16 + NXV_W * g, NXV_PS(mul)(d, nxvi_cvt(hi)));
        )
    }
}

void NXV_FN(nx_dequant_q4_1)(const uint8_t *blocks /* IN */, float *out /* OUT */,
                             size_t nblocks) {
    const nxvi m15 = nxvi_set1(15);
    for (size_t b = 0; b < nblocks; b++) {
        const uint8_t *p = blocks + b * sizeof(nx_block_q4_1);
        float *o = out + b * NX_QK_LEGACY;
        const nxv d = NXV_PS(set1)(ld_f16(p)), m = NXV_PS(set1)(ld_f16(p + 2));
        NXQ_EACH16(
            const nxvi v = nxvi_load_u8(p + 4 + NXV_W * g);
            const nxv dlo = NXV_PS(mul)(d, nxvi_cvt(nxvi_and(v, m15)));
            const nxv dhi = NXV_PS(mul)(d, nxvi_cvt(nxvi_srli(v, 4)));
            NXV_PS(storeu)(o + NXV_W * g, nxq_add_m(dlo, m));
            NXV_PS(storeu)(o + 16 + NXV_W * g, nxq_add_m(dhi, m));
        )
    }
}

void NXV_FN(nx_dequant_q5_0)(const uint8_t *blocks /* IN */, float *out /* OUT */,
                             size_t nblocks) {
    const nxvi m15 = nxvi_set1(15), k16 = nxvi_set1(16);
    for (size_t b = 0; b < nblocks; b++) {
        const uint8_t *p = blocks + b * sizeof(nx_block_q5_0);
        float *o = out + b * NX_QK_LEGACY;
        const nxv d = NXV_PS(set1)(ld_f16(p));
        const uint32_t qh = ld_u32(p + 2);
        NXQ_EACH16(
            const nxvi v = nxvi_load_u8(p + 6 + NXV_W * g);
            nxvi lo = nxvi_and(v, m15), hi = nxvi_srli(v, 4);
            lo = NXQ_OR_QH(lo, qh, NXV_W * g, k16);
            hi = NXQ_OR_QH(hi, qh, 16 + NXV_W * g, k16);
            NXV_PS(storeu)(o + NXV_W * g, NXV_PS(mul)(d, nxvi_cvt(nxvi_sub(lo, k16))));
            NXV_PS(storeu)(o + 16 + NXV_W * g, NXV_PS(mul)(d, nxvi_cvt(nxvi_sub(hi, k16))));
        )
    }
}

void NXV_FN(nx_dequant_q5_1)(const uint8_t *blocks /* IN */, float *out /* OUT */,
                             size_t nblocks) {
    const nxvi m15 = nxvi_set1(15), k16 = nxvi_set1(16);
    for (size_t b = 0; b < nblocks; b++) {
        const uint8_t *p = blocks + b * sizeof(nx_block_q5_1);
        float *o = out + b * NX_QK_LEGACY;
        const nxv d = NXV_PS(set1)(ld_f16(p)), m = NXV_PS(set1)(ld_f16(p + 2));
        const uint32_t qh = ld_u32(p + 4);
        NXQ_EACH16(
            const nxvi v = nxvi_load_u8(p + 8 + NXV_W * g);
            nxvi lo = nxvi_and(v, m15), hi = nxvi_srli(v, 4);
            lo = NXQ_OR_QH(lo, qh, NXV_W * g, k16);
            hi = NXQ_OR_QH(hi, qh, 16 + NXV_W * g, k16);
            const nxv dlo = NXV_PS(mul)(d, nxvi_cvt(lo)), dhi = NXV_PS(mul)(d, nxvi_cvt(hi));
            NXV_PS(storeu)(o + NXV_W * g, nxq_add_m(dlo, m));
            NXV_PS(storeu)(o + 16 + NXV_W * g, nxq_add_m(dhi, m));
        )
    }
}

/* ------------------------------------------------------------------ K-quants (256 elements) */

void NXV_FN(nx_dequant_q2_K)(const uint8_t *blocks /* IN */, float *out /* OUT */,
                             size_t nblocks) {
    const nxvi m3 = nxvi_set1(3), m15 = nxvi_set1(15);
    float dl[16] NXQ_ALIGN, ml[16] NXQ_ALIGN;
    for (size_t b = 0; b < nblocks; b++) {
        const uint8_t *p = blocks + b * sizeof(nx_block_q2_K), *qs = p + 16;
        float *o = out + b * NX_QK_K;
        NXQ_EACH16(
            const nxvi sc = nxvi_load_u8(p + NXV_W * g);
            NXV_PS(store)(dl + NXV_W * g, NXV_PS(mul)(NXV_PS(set1)(ld_f16(p + 80)),
                                                      nxvi_cvt(nxvi_and(sc, m15))));
            NXV_PS(store)(ml + NXV_W * g, NXV_PS(mul)(NXV_PS(set1)(ld_f16(p + 82)),
                                                      nxvi_cvt(nxvi_srli(sc, 4))));
        )
        for (int h = 0; h < 2; h++)
            for (int g = 0; g < 32 / NXV_W; g++) { /* NXV_W-byte groups of qs[32h .. 32h+32) */
                const nxvi qv = nxvi_load_u8(qs + 32 * h + NXV_W * g);
                for (int s = 0; s < 4; s++) {
                    const int i = 8 * h + 2 * s + NXV_W * g / 16;
                    const nxvi q = nxvi_and(nxvi_srl(qv, 2 * s), m3);
                    const nxv dq = NXV_PS(mul)(NXV_PS(set1)(dl[i]), nxvi_cvt(q));
                    NXV_PS(storeu)(o + 128 * h + 32 * s + NXV_W * g, NXV_PS(sub)(dq, NXV_PS(set1)(ml[i])));
                }
            }
    }
}

void NXV_FN(nx_dequant_q3_K)(const uint8_t *blocks /* IN */, float *out /* OUT */,
                             size_t nblocks) {
    const nxvi m3 = nxvi_set1(3), m1 = nxvi_set1(1), k4 = nxvi_set1(4);
    float dl[16] NXQ_ALIGN;
    for (size_t b = 0; b < nblocks; b++) {
        const uint8_t *p = blocks + b * sizeof(nx_block_q3_K);
        const uint8_t *hm = p, *qs = p + 32, *sc = p + 96;
        float *o = out + b * NX_QK_K;
        nxq_scales_q3(sc, ld_f16(p + 108), dl);
        nxvi hw[32 / NXV_W]; /* the high-bit mask, loaded once (stores to o may alias it) */
        for (int g = 0; g < 32 / NXV_W; g++) hw[g] = nxvi_load_u8(hm + NXV_W * g);
        for (int h = 0; h < 2; h++)
            for (int g = 0; g < 32 / NXV_W; g++) {
                const nxvi qv = nxvi_load_u8(qs + 32 * h + NXV_W * g);
                for (int s = 0; s < 4; s++) {
                    const int i = 8 * h + 2 * s + NXV_W * g / 16;
                    const nxvi lo = nxvi_and(nxvi_srl(qv, 2 * s), m3);
                    const nxvi hi = nxvi_and(nxvi_srl(hw[g], 4 * h + s), m1);
                    const nxvi q = nxvi_sub(nxvi_or(lo, nxvi_slli(hi, 2)), k4);
                    NXV_PS(storeu)(o + 128 * h + 32 * s + NXV_W * g,
                               NXV_PS(mul)(NXV_PS(set1)(dl[i]), nxvi_cvt(q)));
                }
            }
    }
}

void NXV_FN(nx_dequant_q4_K)(const uint8_t *blocks /* IN */, float *out /* OUT */,
                             size_t nblocks) {
    const nxvi m15 = nxvi_set1(15);
    for (size_t b = 0; b < nblocks; b++) {
        const uint8_t *p = blocks + b * sizeof(nx_block_q4_K), *qs = p + 16;
        float *o = out + b * NX_QK_K;
        float dlml[16] NXQ_ALIGN;
        nxq_scales_k4(p, dlml);
        const float *dl = dlml, *ml = dlml + 8;
        for (int c = 0; c < 4; c++) {
            const nxv d0 = NXV_PS(set1)(dl[2 * c]), m0 = NXV_PS(set1)(ml[2 * c]);
            const nxv d1 = NXV_PS(set1)(dl[2 * c + 1]), m1 = NXV_PS(set1)(ml[2 * c + 1]);
            for (int g = 0; g < 32 / NXV_W; g++) {
                const nxvi qv = nxvi_load_u8(qs + 32 * c + NXV_W * g);
                const nxv lo = NXV_PS(mul)(d0, nxvi_cvt(nxvi_and(qv, m15)));
                const nxv hi = NXV_PS(mul)(d1, nxvi_cvt(nxvi_srli(qv, 4)));
                NXV_PS(storeu)(o + 64 * c + NXV_W * g, NXV_PS(sub)(lo, m0));
                NXV_PS(storeu)(o + 64 * c + 32 + NXV_W * g, NXV_PS(sub)(hi, m1));
            }
        }
    }
}

void NXV_FN(nx_dequant_q5_K)(const uint8_t *blocks /* IN */, float *out /* OUT */,
                             size_t nblocks) {
    const nxvi m15 = nxvi_set1(15), one = nxvi_set1(1);
    for (size_t b = 0; b < nblocks; b++) {
        const uint8_t *p = blocks + b * sizeof(nx_block_q5_K), *qh = p + 16, *qs = p + 48;
        float *o = out + b * NX_QK_K;
        float dlml[16] NXQ_ALIGN;
        nxq_scales_k4(p, dlml);
        const float *dl = dlml, *ml = dlml + 8;
        nxvi hw[32 / NXV_W]; /* the fifth bits, loaded once (stores to o may alias them) */
        for (int g = 0; g < 32 / NXV_W; g++) hw[g] = nxvi_load_u8(qh + NXV_W * g);
        for (int c = 0; c < 4; c++) {
            const nxv d0 = NXV_PS(set1)(dl[2 * c]), m0 = NXV_PS(set1)(ml[2 * c]);
            const nxv d1 = NXV_PS(set1)(dl[2 * c + 1]), m1 = NXV_PS(set1)(ml[2 * c + 1]);
            for (int g = 0; g < 32 / NXV_W; g++) {
                const nxvi qv = nxvi_load_u8(qs + 32 * c + NXV_W * g);
                const nxvi h0 = nxvi_slli(nxvi_and(nxvi_srl(hw[g], 2 * c), one), 4);
                const nxvi h1 = nxvi_slli(nxvi_and(nxvi_srl(hw[g], 2 * c + 1), one), 4);
                const nxvi q0 = nxvi_or(nxvi_and(qv, m15), h0);
                const nxvi q1 = nxvi_or(nxvi_srli(qv, 4), h1);
                const nxv lo = NXV_PS(mul)(d0, nxvi_cvt(q0)), hi = NXV_PS(mul)(d1, nxvi_cvt(q1));
                NXV_PS(storeu)(o + 64 * c + NXV_W * g, NXV_PS(sub)(lo, m0));
                NXV_PS(storeu)(o + 64 * c + 32 + NXV_W * g, NXV_PS(sub)(hi, m1));
            }
        }
    }
}

void NXV_FN(nx_dequant_q6_K)(const uint8_t *blocks /* IN */, float *out /* OUT */,
                             size_t nblocks) {
    const nxvi m15 = nxvi_set1(15), m3 = nxvi_set1(3), k32 = nxvi_set1(32);
    float dl[16] NXQ_ALIGN;
    for (size_t b = 0; b < nblocks; b++) {
        const uint8_t *p = blocks + b * sizeof(nx_block_q6_K), *ql = p, *qh = p + 128;
        float *o = out + b * NX_QK_K;
        const nxv d = NXV_PS(set1)(ld_f16(p + 208));
        for (int g = 0; g < 16 / NXV_W; g++)
            NXV_PS(store)(dl + NXV_W * g, NXV_PS(mul)(d, nxvi_cvt(nxvi_load_i8(p + 192 + NXV_W * g))));
        for (int h = 0; h < 2; h++)
            for (int r0 = 0; r0 < 128; r0 += NXV_W) {
                const nxvi lo =
                    nxvi_and(nxvi_srl(nxvi_load_u8(ql + 64 * h + r0 % 64), 4 * (r0 / 64)), m15);
                const nxvi hi =
                    nxvi_and(nxvi_srl(nxvi_load_u8(qh + 32 * h + r0 % 32), 2 * (r0 / 32)), m3);
                const nxvi q = nxvi_sub(nxvi_or(lo, nxvi_slli(hi, 4)), k32);
                NXV_PS(storeu)(o + 128 * h + r0, NXV_PS(mul)(NXV_PS(set1)(dl[8 * h + r0 / 16]), nxvi_cvt(q)));
            }
    }
}

#endif
