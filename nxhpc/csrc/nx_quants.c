/* nx_quants.c -- generic (scalar) dequantizers of the nine GGML block types: the spec that the
 * AVX2/AVX-512 variants reproduce bit for bit. Their traits rows and dispatch are the weight-type
 * tables' (nx_wtype.c).
 *
 * Owns: the element order and float32 operation order of each type's decoding, written to follow
 * gguf-py's numpy dequantizers op for op (see the contract in nx_quants.h). Compiled with no ISA
 * flags. Must not: use SIMD intrinsics, fuse multiply and add (fp-contract is off below), or touch
 * memory outside the nblocks blocks / outputs given.
 */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#endif
#pragma STDC FP_CONTRACT OFF

#include "nx_quants.h"
#include "nx_q8_0.h"   /* nx_f16_to_f32: the project's exact float16 -> float32 widening */

#include <string.h>

static inline float ld_f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return nx_f16_to_f32(h);
}

static inline uint32_t ld_u32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* ------------------------------------------------------------------ 32-element types */

void nx_dequant_q4_0_generic(const uint8_t *blocks /* IN */, float *out /* OUT */, size_t nblocks) {
    for (size_t b = 0; b < nblocks; b++) {
        const uint8_t *p = blocks + b * sizeof(nx_block_q4_0), *qs = p + 2;
        float *o = out + b * NX_QK_LEGACY;
        const float d = ld_f16(p);
        for (int j = 0; j < 32; j++) {
            const int q = (int)((qs[j % 16] >> (4 * (j / 16))) & 15) - 8;
            o[j] = d * (float)q;
        }
    }
}

void nx_dequant_q4_1_generic(const uint8_t *blocks /* IN */, float *out /* OUT */, size_t nblocks) {
    for (size_t b = 0; b < nblocks; b++) {
        const uint8_t *p = blocks + b * sizeof(nx_block_q4_1), *qs = p + 4;
        float *o = out + b * NX_QK_LEGACY;
        const float d = ld_f16(p), m = ld_f16(p + 2);
        for (int j = 0; j < 32; j++) {
            const int q = (qs[j % 16] >> (4 * (j / 16))) & 15;
            const float dq = d * (float)q;
            o[j] = dq != dq ? dq : dq + m;      /* NaN dq: its own payload (see .h) */
        }
    }
}

void nx_dequant_q5_0_generic(const uint8_t *blocks /* IN */, float *out /* OUT */, size_t nblocks) {
    for (size_t b = 0; b < nblocks; b++) {
        const uint8_t *p = blocks + b * sizeof(nx_block_q5_0), *qs = p + 6;
        float *o = out + b * NX_QK_LEGACY;
        const float d = ld_f16(p);
        const uint32_t qh = ld_u32(p + 2);
        for (int j = 0; j < 32; j++) {
            const int code = (int)(((qs[j % 16] >> (4 * (j / 16))) & 15) | ((qh >> j) & 1u) << 4);
            o[j] = d * (float)(code - 16);
        }
    }
}

void nx_dequant_q5_1_generic(const uint8_t *blocks /* IN */, float *out /* OUT */, size_t nblocks) {
    for (size_t b = 0; b < nblocks; b++) {
        const uint8_t *p = blocks + b * sizeof(nx_block_q5_1), *qs = p + 8;
        float *o = out + b * NX_QK_LEGACY;
        const float d = ld_f16(p), m = ld_f16(p + 2);
        const uint32_t qh = ld_u32(p + 4);
        for (int j = 0; j < 32; j++) {
            const int code = (int)(((qs[j % 16] >> (4 * (j / 16))) & 15) | ((qh >> j) & 1u) << 4);
            const float dq = d * (float)code;
            o[j] = dq != dq ? dq : dq + m;      /* NaN dq: its own payload (see .h) */
        }
    }
}

/* ------------------------------------------------------------------ K-quants (256 elements) */

void nx_dequant_q2_K_generic(const uint8_t *blocks /* IN */, float *out /* OUT */, size_t nblocks) {
    for (size_t b = 0; b < nblocks; b++) {
        const uint8_t *p = blocks + b * sizeof(nx_block_q2_K);
        const uint8_t *sc = p, *qs = p + 16;
        float *o = out + b * NX_QK_K;
        const float d = ld_f16(p + 80), dmin = ld_f16(p + 82);
        for (int i = 0; i < 16; i++) {                 /* sub-block i: elements 16i .. 16i+15 */
            const float dl = d * (float)(sc[i] & 15);
            const float ml = dmin * (float)(sc[i] >> 4);
            for (int e = 16 * i; e < 16 * i + 16; e++) {
                const int h = e / 128, s = (e / 32) % 4, l = e % 32;
                const int q = (qs[32 * h + l] >> (2 * s)) & 3;
                const float dq = dl * (float)q;
                o[e] = dq - ml;
            }
        }
    }
}

void nx_dequant_q3_K_generic(const uint8_t *blocks /* IN */, float *out /* OUT */, size_t nblocks) {
    for (size_t b = 0; b < nblocks; b++) {
        const uint8_t *p = blocks + b * sizeof(nx_block_q3_K);
        const uint8_t *hm = p, *qs = p + 32, *sc = p + 96;
        float *o = out + b * NX_QK_K;
        const float d = ld_f16(p + 108);
        for (int i = 0; i < 16; i++) {
            const int scode = ((sc[i % 8] >> (4 * (i / 8))) & 15) | ((sc[8 + i % 4] >> (2 * (i / 4))) & 3) << 4;
            const float dl = d * (float)(scode - 32);
            for (int e = 16 * i; e < 16 * i + 16; e++) {
                const int h = e / 128, s = (e / 32) % 4, l = e % 32;
                const int lo = (qs[32 * h + l] >> (2 * s)) & 3;
                const int hi = (hm[l] >> (4 * h + s)) & 1;
                const int q = lo - ((hi ^ 1) << 2);
                o[e] = dl * (float)q;
            }
        }
    }
}

/* Q4_K/Q5_K 6-bit scale and min of sub-block j (0..7) from the 12-byte packing. */
static inline void scale_min_k4(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 15) | (s[j - 4] >> 6) << 4;
        *mn = (s[j + 4] >> 4) | (s[j] >> 6) << 4;
    }
}

void nx_dequant_q4_K_generic(const uint8_t *blocks /* IN */, float *out /* OUT */, size_t nblocks) {
    for (size_t b = 0; b < nblocks; b++) {
        const uint8_t *p = blocks + b * sizeof(nx_block_q4_K);
        const uint8_t *scales = p + 4, *qs = p + 16;
        float *o = out + b * NX_QK_K;
        const float d = ld_f16(p), dmin = ld_f16(p + 2);
        for (int j = 0; j < 8; j++) {                  /* sub-block j: elements 32j .. 32j+31 */
            int sc, mn;
            scale_min_k4(scales, j, &sc, &mn);
            const float dl = d * (float)sc;
            const float ml = dmin * (float)mn;
            for (int e = 32 * j; e < 32 * j + 32; e++) {
                const int c = e / 64, s = (e / 32) % 2, l = e % 32;
                const int q = (qs[32 * c + l] >> (4 * s)) & 15;
                const float dq = dl * (float)q;
                o[e] = dq - ml;
            }
        }
    }
}

void nx_dequant_q5_K_generic(const uint8_t *blocks /* IN */, float *out /* OUT */, size_t nblocks) {
    for (size_t b = 0; b < nblocks; b++) {
        const uint8_t *p = blocks + b * sizeof(nx_block_q5_K);
        const uint8_t *scales = p + 4, *qh = p + 16, *qs = p + 48;
        float *o = out + b * NX_QK_K;
        const float d = ld_f16(p), dmin = ld_f16(p + 2);
        for (int j = 0; j < 8; j++) {
            int sc, mn;
            scale_min_k4(scales, j, &sc, &mn);
            const float dl = d * (float)sc;
            const float ml = dmin * (float)mn;
            for (int e = 32 * j; e < 32 * j + 32; e++) {
                const int c = e / 64, s = (e / 32) % 2, l = e % 32;
                const int q = ((qs[32 * c + l] >> (4 * s)) & 15) | ((qh[l] >> j) & 1) << 4;
                const float dq = dl * (float)q;
                o[e] = dq - ml;
            }
        }
    }
}

void nx_dequant_q6_K_generic(const uint8_t *blocks /* IN */, float *out /* OUT */, size_t nblocks) {
    for (size_t b = 0; b < nblocks; b++) {
        const uint8_t *p = blocks + b * sizeof(nx_block_q6_K);
        const uint8_t *ql = p, *qh = p + 128;
        const int8_t *sc = (const int8_t *)(p + 192);
        float *o = out + b * NX_QK_K;
        const float d = ld_f16(p + 208);
        for (int i = 0; i < 16; i++) {
            const float dl = d * (float)sc[i];
            for (int e = 16 * i; e < 16 * i + 16; e++) {
                const int h = e / 128, r = e % 128;
                const int code = ((ql[64 * h + r % 64] >> (4 * (r / 64))) & 15)
                               | ((qh[32 * h + r % 32] >> (2 * (r / 32))) & 3) << 4;
                o[e] = dl * (float)(code - 32);
            }
        }
    }
}
