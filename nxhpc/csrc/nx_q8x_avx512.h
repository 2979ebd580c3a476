/* nx_q8x_avx512.h -- the AVX-512 pieces the q8 kernels of the avx512 and amx tables share
 * (nx_lowp_avx512.c: vpdpbusd; nx_lowp_amx.c: tdpbssd): the activation block scale with its max
 * in SIMD, the 16 x 8 dword transpose, each weight type's SIMD code decoder, the spec's scale
 * decoders and the B packer that lays a weight panel out as per-32-group k-quads.
 *
 * Owns: nothing of the contract (nx_lowp.h); only the exact decodings of the stored blocks
 * (nx_quants.h element order), which both tables must read identically.
 * Include only from translation units compiled with the avx512 flags (F/BW/VL/DQ, F16C).
 */
#ifndef NX_Q8X_AVX512_H
#define NX_Q8X_AVX512_H

#include <immintrin.h>
#include <string.h>

#include "nx_lowp.h"
#include "nx_q8_0.h"

/* nx_q8_0_act_scale (the spec) with the block max in SIMD: max |x| is exact in any order; a
 * block holding a NaN takes the scalar function (whose result is that NaN). */
static inline float nx_q8x_act_scale(const float *xb /* IN [32] */) {
    const __m512 a0 = _mm512_abs_ps(_mm512_loadu_ps(xb)), a1 = _mm512_abs_ps(_mm512_loadu_ps(xb + 16));
    if (_mm512_cmp_ps_mask(a0, a1, _CMP_UNORD_Q)) return nx_q8_0_act_scale(xb);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(a0, a1));
    const float d = amax / 127.0f;
    return d < 0x1p-126f ? 0.0f : d;
}

/* In-register 16 x 8 dword transpose: in[i] = 8 dwords of column i (i < 16), out[q] lane i =
 * in[i][q]. Columns come in as zmm pairs z[i] = [in[i] | in[i+8]]. */
static inline void nx_tr16x8(const __m256i in[16], __m512i out[8]) {
    __m512i z[8], t[8], u[8];
    for (int i = 0; i < 8; i++)
        z[i] = _mm512_inserti64x4(_mm512_castsi256_si512(in[i]), in[i + 8], 1);
    /* 8 x 8 transposes inside each 256-bit half */
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(z[2 * i], z[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(z[2 * i], z[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {
        u[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i + 0], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i + 0], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    /* u[c] and u[4+c] (c < 4), 128-bit lanes: u[c] = [quad c, cols 0-3 | quad 4+c, cols 0-3 |
     * quad c, cols 8-11 | quad 4+c, cols 8-11]; u[4+c] the same for cols 4-7 / 12-15.
     * Recombine: out[c] = [u[c].0 | u[4+c].0 | u[c].2 | u[4+c].2], out[4+c] with lanes 1 and 3. */
    const __m512i lo = _mm512_set_epi64(13, 12, 5, 4, 9, 8, 1, 0);
    const __m512i hi = _mm512_set_epi64(15, 14, 7, 6, 11, 10, 3, 2);
    for (int c = 0; c < 4; c++) {
        out[c] = _mm512_permutex2var_epi64(u[c], lo, u[4 + c]);
        out[c + 4] = _mm512_permutex2var_epi64(u[c], hi, u[4 + c]);
    }
}

/* ---- unsigned codes u[e] = qw[e] + off of one block (the element order of nx_quants.h) */
static inline __m256i nx_u_nib32(const uint8_t *qs) { /* 16 bytes -> 32 nibbles, low first */
    const __m128i q = _mm_loadu_si128((const __m128i *)qs), m = _mm_set1_epi8(15);
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_and_si128(q, m)),
                                   _mm_and_si128(_mm_srli_epi16(q, 4), m), 1);
}
static inline __m256i nx_u_bit4(const uint8_t *qh, __m256i v) { /* bit j of qh -> bit 4 of v[j] */
    uint32_t h;
    memcpy(&h, qh, 4);
    return _mm256_mask_add_epi8(v, (__mmask32)h, v, _mm256_set1_epi8(16));
}
/* The 32-element types return their block's codes in a register (no store/reload). */
static inline __m256i nx_u_q4_0(const uint8_t *p) { return nx_u_nib32(p + 2); }
static inline __m256i nx_u_q4_1(const uint8_t *p) { return nx_u_nib32(p + 4); }
static inline __m256i nx_u_q5_0(const uint8_t *p) { return nx_u_bit4(p + 2, nx_u_nib32(p + 6)); }
static inline __m256i nx_u_q5_1(const uint8_t *p) { return nx_u_bit4(p + 4, nx_u_nib32(p + 8)); }
static inline __m256i nx_ld32(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline void nx_st32(uint8_t *p, __m256i v) { _mm256_storeu_si256((__m256i *)p, v); }
static inline void nx_u_q4_K(const uint8_t *p, uint8_t *u) {
    const __m256i m = _mm256_set1_epi8(15);
    for (int c = 0; c < 4; c++) {
        const __m256i v = nx_ld32(p + 16 + 32 * c);
        nx_st32(u + 64 * c, _mm256_and_si256(v, m));
        nx_st32(u + 64 * c + 32, _mm256_and_si256(_mm256_srli_epi16(v, 4), m));
    }
}
static inline void nx_u_q5_K(const uint8_t *p, uint8_t *u) {
    const __m256i m = _mm256_set1_epi8(15), h = nx_ld32(p + 16), b4 = _mm256_set1_epi8(16);
    for (int c = 0; c < 4; c++) {
        const __m256i v = nx_ld32(p + 48 + 32 * c);
        for (int s = 0; s < 2; s++) {
            const int j = 2 * c + s;
            const __m256i lo = _mm256_and_si256(s ? _mm256_srli_epi16(v, 4) : v, m);
            const __mmask32 hb = _mm256_test_epi8_mask(h, _mm256_set1_epi8((char)(1 << j)));
            nx_st32(u + 32 * j, _mm256_mask_add_epi8(lo, hb, lo, b4));
        }
    }
}
static inline void nx_u_q6_K(const uint8_t *p, uint8_t *u) {
    const __m256i m4 = _mm256_set1_epi8(15), m2 = _mm256_set1_epi8(3);
    for (int h = 0; h < 2; h++) {
        const __m256i qh = nx_ld32(p + 128 + 32 * h);
        for (int k = 0; k < 4; k++) {
            __m256i lo = nx_ld32(p + 64 * h + 32 * (k & 1));
            if (k >> 1) lo = _mm256_srli_epi16(lo, 4);
            lo = _mm256_and_si256(lo, m4);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * k), m2);
            nx_st32(u + 128 * h + 32 * k, _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)));
        }
    }
}
static inline void nx_u_q3_K(const uint8_t *p, uint8_t *u) {
    const __m256i m2 = _mm256_set1_epi8(3), b2 = _mm256_set1_epi8(4), hm = nx_ld32(p);
    for (int h = 0; h < 2; h++) {
        const __m256i q = nx_ld32(p + 32 + 32 * h);
        for (int s = 0; s < 4; s++) {
            const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(q, 2 * s), m2);
            const __mmask32 hb = _mm256_test_epi8_mask(hm, _mm256_set1_epi8((char)(1 << (4 * h + s))));
            nx_st32(u + 128 * h + 32 * s, _mm256_mask_add_epi8(lo, hb, lo, b2));
        }
    }
}
static inline void nx_u_q2_K(const uint8_t *p, uint8_t *u) {
    const __m256i m2 = _mm256_set1_epi8(3);
    for (int h = 0; h < 2; h++) {
        const __m256i q = nx_ld32(p + 16 + 32 * h);
        for (int s = 0; s < 4; s++)
            nx_st32(u + 128 * h + 32 * s, _mm256_and_si256(_mm256_srli_epi16(q, 2 * s), m2));
    }
}

/* ---- scales sw[i] and mins mw[i] of one block: the spec's arithmetic (nx_lowp.c, nx_q8w_scales_*;
 * every product exact), inlined into the packers. */
static inline float nx_h2f(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}
/* Each writes sw[i * st] (and mw[i * st]): the packer's staging is part-major, 16 columns wide. */
static inline void nx_s_d(const uint8_t *p, float *sw, float *mw, int st) {
    (void)mw, (void)st;
    sw[0] = nx_h2f(p);
}
static inline void nx_s_dm(const uint8_t *p, float *sw, float *mw, int st) {
    (void)st;
    sw[0] = nx_h2f(p);
    mw[0] = nx_h2f(p + 2);
}
static inline void nx_s_k4(const uint8_t *p, float *sw, float *mw, int st) {
    const uint8_t *s = p + 4;
    const float d = nx_h2f(p), dmin = nx_h2f(p + 2);
    for (int j = 0; j < 8; j++) {
        const int sc = j < 4 ? s[j] & 63 : (s[j + 4] & 15) | (s[j - 4] >> 6) << 4;
        const int mn = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | (s[j] >> 6) << 4;
        sw[j * st] = d * (float)sc;
        mw[j * st] = -(dmin * (float)mn);
    }
}
static inline void nx_s_q6_K(const uint8_t *p, float *sw, float *mw, int st) {
    (void)mw;
    const float d = nx_h2f(p + 208);
    for (int i = 0; i < 16; i++) sw[i * st] = d * (float)(int8_t)p[192 + i];
}
static inline void nx_s_q3_K(const uint8_t *p, float *sw, float *mw, int st) {
    (void)mw;
    const uint8_t *sc = p + 96;
    const float d = nx_h2f(p + 108);
    for (int i = 0; i < 16; i++) {
        const int code = ((sc[i % 8] >> (4 * (i / 8))) & 15) | ((sc[8 + i % 4] >> (2 * (i / 4))) & 3)
                                                                   << 4;
        sw[i * st] = d * (float)(code - 32);
    }
}
static inline void nx_s_q2_K(const uint8_t *p, float *sw, float *mw, int st) {
    const float d = nx_h2f(p + 80), dmin = nx_h2f(p + 82);
    for (int i = 0; i < 16; i++) {
        sw[i * st] = d * (float)(p[i] & 15);
        mw[i * st] = -(dmin * (float)(p[i] >> 4));
    }
}

#ifndef NX_Q8X_PF
#define NX_Q8X_PF 1 /* weight blocks prefetched ahead per column by the B packer (1, 2, 4: within noise) */
#endif

/* B packer: per 16-column vector, per weight block: each column's codes (SIMD) and scales (the
 * spec's decoder: exact products, the same on every ISA), then one 16 x 8 dword transpose per
 * 32-group. k0 and kc are multiples of the block (KC % 256 == 0, K % elems == 0).
 * Panel group (NR = 16 * NV columns): uint32 quads[8][NR] (bytes 4q..4q+3 of column j: the
 * codes u = qw + off, or, with SUB = off, the signed codes qw themselves), float sw[H][NR],
 * float mw[H][NR] (types with a min): NX_Q8X_BG(H, M, NR) bytes. Columns past ncols are zero. */
#define NX_Q8X_BG(H, M, NR) ((8 + (H) * (1 + (M))) * (NR) * 4)
static inline __attribute__((always_inline)) void
nx_q8x_pack_b_t(const nx_mm_call *c, size_t j0, size_t ncols, size_t k0, size_t kc,
                uint8_t *Bp /* OUT */, const int NV, const int E, const int H, const int M, const int SUB,
                void (*dec)(const uint8_t *, uint8_t *), __m256i (*dec32)(const uint8_t *),
                void (*scales)(const uint8_t *, float *, float *, int)) {
    const uint8_t *w = c->w;
    const size_t rowbytes = c->rowbytes, bb = c->wt->blck_bytes;
    const size_t blk0 = k0 / (size_t)E, nblk = kc / (size_t)E;
    const int GB = E / 32, NS = GB * H;
    const int NR = 16 * NV;
    const size_t BG = NX_Q8X_BG(H, M, NR);
    const __m256i sub = _mm256_set1_epi8((char)SUB);
    _Alignas(64) uint8_t u[16][256];
    _Alignas(64) float sw[16][16], mw[16][16]; /* [part i of the block][column j] */
    for (int v = 0; v < NV; v++) {
        const size_t c0 = (size_t)v * 16;
        const int nv = c0 >= ncols ? 0 : (ncols - c0 >= 16 ? 16 : (int)(ncols - c0));
        for (size_t bi = 0; bi < nblk; bi++) {
            __m256i in[16];
            for (int j = 0; j < 16; j++) {
                if (j < nv) {
                    const uint8_t *blk = w + (j0 + c0 + j) * rowbytes + (blk0 + bi) * bb;
                    if (bi + NX_Q8X_PF < nblk) /* the row's block NX_Q8X_PF ahead */
                        for (size_t o = 0; o < bb; o += 64)
                            _mm_prefetch((const char *)(blk + NX_Q8X_PF * bb + o), _MM_HINT_T0);
                    if (E == 32)
                        in[j] = SUB ? _mm256_sub_epi8(dec32(blk), sub) : dec32(blk);
                    else
                        dec(blk, u[j]);
                    scales(blk, &sw[0][j], &mw[0][j], 16);
                } else {
                    if (E == 32)
                        in[j] = _mm256_setzero_si256();
                    else
                        memset(u[j], 0, (size_t)E);
                    for (int i = 0; i < NS; i++) sw[i][j] = mw[i][j] = 0.0f;
                }
            }
            for (int gl = 0; gl < GB; gl++) {
                uint8_t *g = Bp + (bi * (size_t)GB + (size_t)gl) * BG;
                if (E != 32)
                    for (int j = 0; j < 16; j++) {
                        in[j] = _mm256_load_si256((const __m256i *)(u[j] + 32 * gl));
                        if (SUB && j < nv) in[j] = _mm256_sub_epi8(in[j], sub);
                    }
                __m512i out[8];
                nx_tr16x8(in, out);
                for (int q = 0; q < 8; q++)
                    _mm512_store_si512((__m512i *)(g + (q * NR + c0) * 4), out[q]);
                float *f = (float *)(g + 8 * NR * 4);
                for (int h = 0; h < H; h++) {
                    _mm512_store_ps(f + h * NR + c0, _mm512_load_ps(sw[gl * H + h]));
                    if (M)
                        _mm512_store_ps(f + (H + h) * NR + c0,
                                        _mm512_load_ps(mw[gl * H + h]));
                }
            }
        }
    }
}

/* The q8 weight types these kernels take beyond Q8_0, one row each: X(T, t, E, H, M, OFF, D, D32,
 * S) = GGML type, name, block elements, parts per 32-group, has a min, the panels' code offset
 * (nx_lowp.h: u = qw + OFF), the 256-block decoder (or NULL), the 32-block decoder (or NULL), and
 * the scale decoder nx_s_<S>. Each kernel file generates its packers and dispatch from it. */
#define NX_Q8X_TYPES(X)                                                                            \
    X(Q4_0, q4_0, 32, 1, 0, 8, NULL, nx_u_q4_0, d)                                                 \
    X(Q5_0, q5_0, 32, 1, 0, 16, NULL, nx_u_q5_0, d)                                                \
    X(Q4_1, q4_1, 32, 1, 1, 0, NULL, nx_u_q4_1, dm)                                                \
    X(Q5_1, q5_1, 32, 1, 1, 0, NULL, nx_u_q5_1, dm)                                                \
    X(Q4_K, q4_K, 256, 1, 1, 0, nx_u_q4_K, NULL, k4)                                               \
    X(Q5_K, q5_K, 256, 1, 1, 0, nx_u_q5_K, NULL, k4)                                               \
    X(Q6_K, q6_K, 256, 2, 0, 32, nx_u_q6_K, NULL, q6_K)                                            \
    X(Q3_K, q3_K, 256, 2, 0, 4, nx_u_q3_K, NULL, q3_K)                                             \
    X(Q2_K, q2_K, 256, 2, 1, 0, nx_u_q2_K, NULL, q2_K)

#endif
