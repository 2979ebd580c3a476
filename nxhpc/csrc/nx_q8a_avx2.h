/* nx_q8a_avx2.h -- the `q8` matmul on 256-bit integer dots, every weight type q8 takes: the
 * AVX2 kernel (vpmaddubsw / vpmaddwd, nx_lowp_avx2.c) and, compiled again with NX_Q8A_VNNI 1,
 * the AVX-VNNI one (VEX vpdpbusd, nx_lowp_avxvnni.c: Intel Alder Lake and later client CPUs,
 * which have AVX-VNNI but no AVX-512). Included once by each of those files, with its flags.
 *
 * Owns: the 256-bit q8 panel layouts, register tiles and packers, the exactness argument of
 * the int8 dots (nx_lowp_avx2.c's header; vpdpbusd sums each lane's four u8 x s8 products into
 * its int32 exactly, so it needs neither the int16 stage nor its overflow bound F), and the
 * entry point NX_Q8A_ENTRY. Both dots give every part's exact integer sum, so both give the
 * spec's bits. Must not: change the per-output block order or arithmetic of nx_lowp.h,
 * allocate per tile, or use threads.
 */
#ifndef NX_Q8A_AVX2_H
#define NX_Q8A_AVX2_H

#include "nx_lowp.h"

#include <immintrin.h>
#include <string.h>

#include "nx_q8_0.h"

#ifndef NX_Q8A_VNNI
#define NX_Q8A_VNNI 0
#endif
#if NX_Q8A_VNNI
#define NX_Q8A_ENTRY nx_matmul_q8_avxvnni
#else
#define NX_Q8A_ENTRY nx_matmul_q8_avx2
#endif

/* ------------------------------------------------------------------ tiles
 * MR tokens x NR = 8 * NV columns. Measured on an AMD EPYC Zen 3 (family 25 model 1, 2 cores,
 * AVX2; single runs there move by 15-45%), one thread, T=256, K=N=3840, GOP/s Q8_0 / Q4_K /
 * Q6_K / Q4_0: 3 x 16: 98 / 135 / 118 / 151; 4 x 16: 97 / 114 / 118 / 144; 2 x 16: 89 / 103 /
 * 111 / 143; 4 x 8: 91 / 131 / 113 / 141; 6 x 8: 72 / 102 / 103 / 102 (before the int16 sums were
 * fenced with NX_KEEP, gcc summed each group's products as a tree, spilled them all and ran at
 * 68-123). 3 x 16 was the fastest on three of the four types; it still spills some of its 6
 * float accumulators around the int16 loop (16 ymm registers).
 * KC = 1024, NC = 128, MC = 252 were set, not tuned. */
#ifndef NX_Q8A_MR
#define NX_Q8A_MR 3
#endif
#ifndef NX_Q8A_NV
#define NX_Q8A_NV 2
#endif
#define NX_Q8A_NR (8 * NX_Q8A_NV)
#ifndef NX_Q8A_KC
#define NX_Q8A_KC 1024
#endif
#ifndef NX_Q8A_NC
#define NX_Q8A_NC 128
#endif
#ifndef NX_Q8A_MC
#define NX_Q8A_MC 252
#endif
_Static_assert(NX_Q8A_KC % 256 == 0, "KC must hold whole blocks of every type");
_Static_assert(NX_Q8A_NC % NX_Q8A_NR == 0, "NC must be a multiple of NR");
_Static_assert(NX_Q8A_MC % NX_Q8A_MR == 0, "MC must be a multiple of MR");

/* Per 32-k group (one activation block):
 *   A micro-panel: int32 quads[8][MR] (qx bytes 4q..4q+3 of token r), float dx[MR],
 *                  int32 init[2][MR] (-off * xsum of each part), float ax[2][MR] (dx * xsum of
 *                  each part: the min term's product, one rounding as the spec's)
 *   B micro-panel: uint32 quads[8][NR] (Q8_0: qw; others: u = qw + off; bytes 4q..4q+3 of
 *                  column j), float sw[H][NR], float mw[H][NR] (types with a min) */
#define NX_Q8A_AG (13 * NX_Q8A_MR * 4)
#define NX_Q8A_BG(H, M) ((8 + (H) * (1 + (M))) * NX_Q8A_NR * 4)

/* ------------------------------------------------------------------ activation packer */

/* Sum of the 16 signed bytes of v (exact). */
static inline int32_t nx_hsum_i8x16(__m128i v) {
    const __m128i w = _mm_madd_epi16(_mm_cvtepi8_epi16(v), _mm_set1_epi16(1));
    const __m128i w2 = _mm_madd_epi16(_mm_cvtepi8_epi16(_mm_srli_si128(v, 8)), _mm_set1_epi16(1));
    __m128i s = _mm_add_epi32(w, w2);
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

/* Tokens [t0, t0+rows) into one A micro-panel: quantized by the AVX2 quantizer (the spec's bytes),
 * dx = nx_q8_0_act_scale (the spec itself), and per part (H of them) the init and min product. */
static inline __attribute__((always_inline)) void
nx_q8a_pack_a_t(const float *x /* IN */, size_t K, size_t t0, size_t rows, uint8_t *Ap /* OUT */,
                void *scratch, const int off, const int H) {
    const size_t nb = K / NX_QK8_0;
    const int MR = NX_Q8A_MR;
    uint8_t *q = (uint8_t *)scratch; /* one quantized row: nb * 34 bytes */
    for (int r = 0; r < MR; r++) {
        if ((size_t)r < rows) nx_q8_0_quantize_avx2(x + (t0 + r) * K, q, nb);
        for (size_t b = 0; b < nb; b++) {
            int32_t *g = (int32_t *)(Ap + b * NX_Q8A_AG);
            if ((size_t)r >= rows) {
                for (int i = 0; i < 13; i++) g[i * MR + r] = 0; /* float fields +0.0f */
                continue;
            }
            const uint8_t *blk = q + b * NX_Q8_0_BLOCK_BYTES;
            int32_t quad[8];
            memcpy(quad, blk + 2, 32);
            for (int i = 0; i < 8; i++) g[i * MR + r] = quad[i];
            const float dx = nx_q8_0_act_scale(x + (t0 + r) * K + b * NX_QK8_0);
            memcpy(&g[8 * MR + r], &dx, 4);
            const int32_t lo = nx_hsum_i8x16(_mm_loadu_si128((const __m128i *)(blk + 2)));
            const int32_t hi = nx_hsum_i8x16(_mm_loadu_si128((const __m128i *)(blk + 18)));
            const int32_t xs[2] = {H == 1 ? lo + hi : lo, H == 1 ? 0 : hi};
            for (int h = 0; h < 2; h++) {
                const float ax = dx * (float)xs[h]; /* one rounding, as the spec */
                g[(9 + h) * MR + r] = -off * xs[h];
                memcpy(&g[(11 + h) * MR + r], &ax, 4);
            }
        }
    }
}

#define NX_Q8A_PACK_A(OFF, H)                                                                      \
    static void nx_q8a_pack_a_##OFF##_##H(const float *x, size_t K, size_t t0, size_t rows,        \
                                          uint8_t *Ap, void *scratch) {                            \
        nx_q8a_pack_a_t(x, K, t0, rows, Ap, scratch, OFF, H);                                      \
    }
NX_Q8A_PACK_A(0, 1) /* Q8_0 (its sign trick needs no init), Q4_1, Q5_1, Q4_K, Q5_K */
NX_Q8A_PACK_A(128, 1) /* Q8_0 as u = qw + 128 (the VNNI kernel) */
NX_Q8A_PACK_A(8, 1)
NX_Q8A_PACK_A(16, 1)
NX_Q8A_PACK_A(32, 2)
NX_Q8A_PACK_A(4, 2)
NX_Q8A_PACK_A(0, 2)

/* ------------------------------------------------------------------ weight packer
 * Per column, per weight block: the codes (SIMD for the hot types, else the spec's decoder) and
 * the spec's scales (nx_q8w: every product exact, the same on every ISA), then one 8 x 8 dword
 * transpose per 8 columns and 32-group. */

/* In-register 8 x 8 dword transpose: r[i] = 8 dwords of column i -> r[q] lane i = in[i][q]. */
static inline void nx_tr8x8(__m256i r[8]) {
    __m256i t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {
        u[4 * i + 0] = _mm256_unpacklo_epi64(t[4 * i + 0], t[4 * i + 2]);
        u[4 * i + 1] = _mm256_unpackhi_epi64(t[4 * i + 0], t[4 * i + 2]);
        u[4 * i + 2] = _mm256_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm256_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    /* u[c] (c < 4) = [quad c of cols 0-3 | quad 4+c of cols 0-3]; u[4+c] the same for cols 4-7 */
    for (int c = 0; c < 4; c++) {
        r[c] = _mm256_permute2x128_si256(u[c], u[4 + c], 0x20);
        r[c + 4] = _mm256_permute2x128_si256(u[c], u[4 + c], 0x31);
    }
}

/* ---- unsigned codes u[e] = qw[e] + off of one block (the element order of nx_quants.h); Q8_0:
 * the signed codes themselves. */
static inline __m256i nx_ld32(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline __m256i nx_a_nib32(const uint8_t *qs) { /* 16 bytes -> 32 nibbles, low first */
    const __m128i q = _mm_loadu_si128((const __m128i *)qs), m = _mm_set1_epi8(15);
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_and_si128(q, m)),
                                   _mm_and_si128(_mm_srli_epi16(q, 4), m), 1);
}
/* bit j of the 32-bit word at qh -> 16 in byte j */
static inline __m256i nx_a_bit4(const uint8_t *qh) {
    uint32_t h;
    memcpy(&h, qh, 4);
    const __m256i sh = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2,
                                        2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)h), sh);
    const __m256i on = _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
    return _mm256_and_si256(on, _mm256_set1_epi8(16));
}
static inline __m256i nx_a_q8_0(const uint8_t *p) { return nx_ld32(p + 2); }
/* Q8_0 as unsigned codes u = qw + 128 (each byte's top bit flipped), for the VNNI kernel: its
 * vpdpbusd takes them like any other type's, with -128 * xsum as the part's start (the sign
 * trick the AVX2 kernel needs costs two more instructions per step). */
static inline __m256i nx_a_q8_0u(const uint8_t *p) {
    return _mm256_xor_si256(nx_ld32(p + 2), _mm256_set1_epi8((char)0x80));
}
static inline __m256i nx_a_q4_0(const uint8_t *p) { return nx_a_nib32(p + 2); }
static inline __m256i nx_a_q4_1(const uint8_t *p) { return nx_a_nib32(p + 4); }
static inline __m256i nx_a_q5_0(const uint8_t *p) {
    return _mm256_or_si256(nx_a_nib32(p + 6), nx_a_bit4(p + 2));
}
static inline __m256i nx_a_q5_1(const uint8_t *p) {
    return _mm256_or_si256(nx_a_nib32(p + 8), nx_a_bit4(p + 4));
}
/* 256-element types: the 8 groups' codes into u[8] */
static inline void nx_a_q4_K(const uint8_t *p, __m256i u[8]) {
    const __m256i m = _mm256_set1_epi8(15);
    for (int c = 0; c < 4; c++) {
        const __m256i v = nx_ld32(p + 16 + 32 * c);
        u[2 * c] = _mm256_and_si256(v, m);
        u[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m);
    }
}
/* 16 where bit j of byte e of h is set, for the 32 bytes of h */
static inline __m256i nx_a_bitj(__m256i h, int j, int val) {
    const __m256i b = _mm256_set1_epi8((char)(1 << j));
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(h, b), b),
                            _mm256_set1_epi8((char)val));
}
static inline void nx_a_q5_K(const uint8_t *p, __m256i u[8]) {
    const __m256i m = _mm256_set1_epi8(15), h = nx_ld32(p + 16);
    for (int c = 0; c < 4; c++) {
        const __m256i v = nx_ld32(p + 48 + 32 * c);
        u[2 * c] = _mm256_or_si256(_mm256_and_si256(v, m), nx_a_bitj(h, 2 * c, 16));
        u[2 * c + 1] =
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), m),
                            nx_a_bitj(h, 2 * c + 1, 16));
    }
}
static inline void nx_a_q6_K(const uint8_t *p, __m256i u[8]) {
    const __m256i m4 = _mm256_set1_epi8(15), m2 = _mm256_set1_epi8(3);
    for (int h = 0; h < 2; h++) {
        const __m256i qh = nx_ld32(p + 128 + 32 * h);
        for (int k = 0; k < 4; k++) {
            __m256i lo = nx_ld32(p + 64 * h + 32 * (k & 1));
            if (k >> 1) lo = _mm256_srli_epi16(lo, 4);
            lo = _mm256_and_si256(lo, m4);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * k), m2);
            u[4 * h + k] = _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
        }
    }
}
static inline void nx_a_q3_K(const uint8_t *p, __m256i u[8]) {
    const __m256i m2 = _mm256_set1_epi8(3), hm = nx_ld32(p);
    for (int h = 0; h < 2; h++) {
        const __m256i q = nx_ld32(p + 32 + 32 * h);
        for (int s = 0; s < 4; s++)
            u[4 * h + s] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 2 * s), m2),
                                           nx_a_bitj(hm, 4 * h + s, 4));
    }
}
static inline void nx_a_q2_K(const uint8_t *p, __m256i u[8]) {
    const __m256i m2 = _mm256_set1_epi8(3);
    for (int h = 0; h < 2; h++) {
        const __m256i q = nx_ld32(p + 16 + 32 * h);
        for (int s = 0; s < 4; s++)
            u[4 * h + s] = _mm256_and_si256(_mm256_srli_epi16(q, 2 * s), m2);
    }
}

/* B packer for columns [j0, j0+ncols) x k in [k0, k0+kc) (k0, kc multiples of the block). */
static inline __attribute__((always_inline)) void
nx_q8a_pack_b_t(const nx_mm_call *c, size_t j0, size_t ncols, size_t k0, size_t kc,
                uint8_t *Bp /* OUT */, const int E, const int H, const int M,
                __m256i (*dec32)(const uint8_t *), void (*dec)(const uint8_t *, __m256i *)) {
    const nx_q8w_type *qt = nx_q8w(c->type);
    const uint8_t *w = c->w;
    const size_t rowbytes = c->rowbytes, bb = c->wt->blck_bytes;
    const size_t blk0 = k0 / (size_t)E, nblk = kc / (size_t)E;
    const int GB = E / 32, NS = GB * H;
    const size_t BG = NX_Q8A_BG(H, M);
    _Alignas(32) float sw[8][16], mw[8][16]; /* [column][part of the block] */
    uint16_t dh[8], mh[8];                     /* 32-element types: the float16 d, m per column */
    for (int v = 0; v < NX_Q8A_NV; v++) {
        const size_t c0 = (size_t)v * 8;
        const int nv = c0 >= ncols ? 0 : (ncols - c0 >= 8 ? 8 : (int)(ncols - c0));
        for (size_t bi = 0; bi < nblk; bi++) {
            __m256i u[8][8]; /* [column][32-group of the block] */
            for (int j = 0; j < 8; j++) {
                if (j < nv) {
                    const uint8_t *blk = w + (j0 + c0 + j) * rowbytes + (blk0 + bi) * bb;
                    if (E == 32) { /* d (and m) are the block's first float16 fields */
                        u[j][0] = dec32(blk);
                        memcpy(&dh[j], blk, 2);
                        if (M) memcpy(&mh[j], blk + 2, 2);
                    } else {
                        dec(blk, u[j]);
                        qt->scales(blk, sw[j], mw[j]);
                    }
                } else {
                    dh[j] = mh[j] = 0;
                    for (int g = 0; g < GB; g++) u[j][g] = _mm256_setzero_si256();
                    for (int i = 0; i < NS; i++) sw[j][i] = mw[j][i] = 0.0f;
                }
            }
            for (int gl = 0; gl < GB; gl++) {
                uint8_t *g = Bp + (bi * (size_t)GB + (size_t)gl) * BG;
                __m256i r[8];
                for (int j = 0; j < 8; j++) r[j] = u[j][gl];
                nx_tr8x8(r);
                for (int q = 0; q < 8; q++)
                    _mm256_store_si256((__m256i *)(g + (q * NX_Q8A_NR + c0) * 4), r[q]);
                float *f = (float *)(g + 8 * NX_Q8A_NR * 4);
                if (E == 32) { /* f32(d), f32(m): the spec's nx_q8w_scales_d / _dm, 8 at once */
                    _mm256_store_ps(f + c0, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)dh)));
                    if (M)
                        _mm256_store_ps(f + NX_Q8A_NR + c0,
                                        _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)mh)));
                    continue;
                }
                for (int h = 0; h < H; h++)
                    for (int j = 0; j < 8; j++) {
                        f[h * NX_Q8A_NR + c0 + j] = sw[j][gl * H + h];
                        if (M) f[(H + h) * NX_Q8A_NR + c0 + j] = mw[j][gl * H + h];
                    }
            }
        }
    }
}

#define NX_Q8A_PACK_B(t, E, H, M, D32, D)                                                          \
    static void nx_q8a_pack_b_##t(const nx_mm_call *c, size_t j0, size_t ncols, size_t k0,         \
                                  size_t kc, uint8_t *Bp, void *scratch) {                         \
        (void)scratch;                                                                             \
        nx_q8a_pack_b_t(c, j0, ncols, k0, kc, Bp, E, H, M, D32, D);                                \
    }
NX_Q8A_PACK_B(q8_0, 32, 1, 0, nx_a_q8_0, NULL)
NX_Q8A_PACK_B(q8_0u, 32, 1, 0, nx_a_q8_0u, NULL) /* the VNNI kernel's Q8_0 */
NX_Q8A_PACK_B(q4_0, 32, 1, 0, nx_a_q4_0, NULL)
NX_Q8A_PACK_B(q4_1, 32, 1, 1, nx_a_q4_1, NULL)
NX_Q8A_PACK_B(q5_0, 32, 1, 0, nx_a_q5_0, NULL)
NX_Q8A_PACK_B(q5_1, 32, 1, 1, nx_a_q5_1, NULL)
NX_Q8A_PACK_B(q2_K, 256, 2, 1, NULL, nx_a_q2_K)
NX_Q8A_PACK_B(q3_K, 256, 2, 0, NULL, nx_a_q3_K)
NX_Q8A_PACK_B(q4_K, 256, 1, 1, NULL, nx_a_q4_K)
NX_Q8A_PACK_B(q5_K, 256, 1, 1, NULL, nx_a_q5_K)
NX_Q8A_PACK_B(q6_K, 256, 2, 0, NULL, nx_a_q6_K)

/* ------------------------------------------------------------------ micro-kernel
 * C[0:mr, 0:nr] := the chain over ng groups, continued from C unless first. SGN: Q8_0's sign
 * trick (one vpmaddwd per step); else F steps summed in int16 per vpmaddwd. H parts per group,
 * M: with a min. */
/* Keeps v in a register as it is: stops the compiler from reassociating the integer sums of a
 * step chain into a tree of all the step's products at once (which spills every one of them). */
#define NX_KEEP(v) __asm__("" : "+x"(v))

static inline __m256i nx_lane_mask(int left) { /* lanes < left all-ones */
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(left), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

static inline __attribute__((always_inline)) void
nx_q8a_kern_t(size_t ng, const uint8_t *A, const uint8_t *B, float *C, size_t ldc, int mr, int nr,
              int first, const int SGN, const int F, const int H, const int M) {
    enum { MR = NX_Q8A_MR, NV = NX_Q8A_NV, NR = NX_Q8A_NR };
    /* a whole-width tile (nr == NR) is read and written with plain moves, the same values (a
     * masked store is slow on AMD Zen 3: nx_matmul_avx2.c); the AVX-VNNI build keeps the masked
     * ones, as it was last tested (no AVX-VNNI CPU has run this change) */
    const int whole = !NX_Q8A_VNNI && nr == NR;
    __m256i m[NV];
    for (int v = 0; v < NV; v++) m[v] = nx_lane_mask(nr - 8 * v);
    __m256 f[MR][NV];
    for (int r = 0; r < MR; r++)
        for (int v = 0; v < NV; v++)
            f[r][v] = (!first && r < mr) ? (whole ? _mm256_loadu_ps(C + r * ldc + 8 * v)
                                                  : _mm256_maskload_ps(C + r * ldc + 8 * v, m[v]))
                                         : _mm256_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1);
    const size_t BG = NX_Q8A_BG(H, M);
    for (size_t gi = 0; gi < ng; gi++) {
        const int32_t *a = (const int32_t *)(A + gi * NX_Q8A_AG);
        const uint8_t *b = B + gi * BG;
        const float *dx = (const float *)(a + 8 * MR);
        const float *sw = (const float *)(b + 8 * NR * 4);
        __m256 y[MR][NV]; /* H = 2: the group's scaled part sums */
#pragma GCC unroll 2
        for (int h = 0; h < H; h++) {
            /* each part's int32 sum starts at -off * xsum (the A panel's init); the types with a
             * min (M) are packed with off = 0 (the entry point's table), so the AVX2 kernel starts
             * theirs at zero and saves a broadcast per token and an add per accumulator a group */
            const int Z = SGN || (!NX_Q8A_VNNI && M);
            __m256i s[MR][NV];
            for (int r = 0; r < MR; r++)
                for (int v = 0; v < NV; v++)
                    s[r][v] = Z ? _mm256_setzero_si256() : _mm256_set1_epi32(a[(9 + h) * MR + r]);
            const int q0 = h * 8 / H, q1 = (h + 1) * 8 / H;
            if (SGN) {
#pragma GCC unroll 8
                for (int q = q0; q < q1; q++) {
                    __m256i bv[NV], ub[NV];
                    for (int v = 0; v < NV; v++) {
                        bv[v] = _mm256_load_si256((const __m256i *)(b + (q * NR + 8 * v) * 4));
                        ub[v] = _mm256_abs_epi8(bv[v]);
                    }
                    for (int r = 0; r < MR; r++) {
                        const __m256i av = _mm256_set1_epi32(a[q * MR + r]);
                        for (int v = 0; v < NV; v++) {
#if NX_Q8A_VNNI /* the four products of a lane summed into it exactly: no int16 stage */
                            s[r][v] = _mm256_dpbusd_avx_epi32(s[r][v], ub[v],
                                                              _mm256_sign_epi8(av, bv[v]));
#else
                            const __m256i sx = _mm256_sign_epi8(av, bv[v]);
                            s[r][v] = _mm256_add_epi32(
                                s[r][v], _mm256_madd_epi16(_mm256_maddubs_epi16(ub[v], sx), ones));
#endif
                            NX_KEEP(s[r][v]);
                        }
                    }
                }
            } else {
                /* AVX2: F steps summed in int16, then widened by one vpmaddwd; VNNI: every step
                 * summed four products at a time straight into the part's int32 */
                const int FS = NX_Q8A_VNNI ? 8 : F;
#pragma GCC unroll 8
                for (int qc = q0; qc < q1; qc += FS) {
                    __m256i p[MR][NV];
                    for (int r = 0; r < MR; r++)
                        for (int v = 0; v < NV; v++) p[r][v] = _mm256_setzero_si256();
#pragma GCC unroll 8
                    for (int q = qc; q < qc + FS && q < q1; q++) {
                        __m256i bv[NV];
                        for (int v = 0; v < NV; v++)
                            bv[v] = _mm256_load_si256((const __m256i *)(b + (q * NR + 8 * v) * 4));
                        for (int r = 0; r < MR; r++) {
                            const __m256i av = _mm256_set1_epi32(a[q * MR + r]);
                            for (int v = 0; v < NV; v++) {
#if NX_Q8A_VNNI
                                s[r][v] = _mm256_dpbusd_avx_epi32(s[r][v], bv[v], av);
                                NX_KEEP(s[r][v]);
#else
                                p[r][v] =
                                    _mm256_add_epi16(p[r][v], _mm256_maddubs_epi16(bv[v], av));
                                NX_KEEP(p[r][v]);
#endif
                            }
                        }
                    }
                    if (!NX_Q8A_VNNI)
                        for (int r = 0; r < MR; r++)
                            for (int v = 0; v < NV; v++)
                                s[r][v] =
                                    _mm256_add_epi32(s[r][v], _mm256_madd_epi16(p[r][v], ones));
                }
            }
            for (int r = 0; r < MR; r++)
                for (int v = 0; v < NV; v++) {
                    const __m256 swv = _mm256_load_ps(sw + h * NR + 8 * v);
                    const __m256 is = _mm256_cvtepi32_ps(s[r][v]);
                    if (H == 1) /* acc = fmaf((float)isum, dx*sw, acc) */
                        f[r][v] = _mm256_fmadd_ps(is, _mm256_mul_ps(swv, _mm256_set1_ps(dx[r])),
                                                  f[r][v]);
                    else if (h == 0) /* y = (float)isum_0 * sw_0 */
                        y[r][v] = _mm256_mul_ps(is, swv);
                    else /* y = fmaf((float)isum_1, sw_1, y) */
                        y[r][v] = _mm256_fmadd_ps(is, swv, y[r][v]);
                }
        }
        for (int r = 0; r < MR; r++)
            for (int v = 0; v < NV; v++) {
                if (H == 2) /* acc = fmaf(y, dx, acc) */
                    f[r][v] = _mm256_fmadd_ps(y[r][v], _mm256_set1_ps(dx[r]), f[r][v]);
                if (M) /* acc = fmaf(dx * (float)xsum_h, mw_h, acc), h = 0 .. H-1 */
                    for (int h = 0; h < H; h++)
                        f[r][v] = _mm256_fmadd_ps(
                            _mm256_set1_ps(((const float *)(a + (11 + h) * MR))[r]),
                            _mm256_load_ps(sw + (H + h) * NR + 8 * v), f[r][v]);
            }
    }
    for (int r = 0; r < MR; r++)
        if (r < mr)
            for (int v = 0; v < NV; v++) {
                if (whole)
                    _mm256_storeu_ps(C + r * ldc + 8 * v, f[r][v]);
                else
                    _mm256_maskstore_ps(C + r * ldc + 8 * v, m[v], f[r][v]);
            }
}

#define NX_Q8A_KERN(NAME, SGN, F, H, M)                                                            \
    static void nx_q8a_kern_##NAME(size_t ng, const uint8_t *A, const uint8_t *B, float *C,        \
                                   size_t ldc, int mr, int nr, int first) {                        \
        nx_q8a_kern_t(ng, A, B, C, ldc, mr, nr, first, SGN, F, H, M);                              \
    }
NX_Q8A_KERN(sgn, 1, 1, 1, 0)   /* Q8_0 */
NX_Q8A_KERN(f8, 0, 8, 1, 0)    /* Q4_0: u <= 15 */
NX_Q8A_KERN(f8m, 0, 8, 1, 1)   /* Q4_1, Q4_K */
NX_Q8A_KERN(f4, 0, 4, 1, 0)    /* Q5_0: u <= 31 */
NX_Q8A_KERN(f4m, 0, 4, 1, 1)   /* Q5_1, Q5_K */
NX_Q8A_KERN(h2f2, 0, 2, 2, 0)  /* Q6_K: u <= 63, 16-element parts */
NX_Q8A_KERN(h2f4, 0, 4, 2, 0)  /* Q3_K: u <= 7 */
NX_Q8A_KERN(h2f4m, 0, 4, 2, 1) /* Q2_K: u <= 3 */

/* ------------------------------------------------------------------ entry point */

int NX_Q8A_ENTRY(const nx_mm_call *c) {
    typedef void (*pack_a_fn)(const float *, size_t, size_t, size_t, uint8_t *, void *);
    typedef void (*pack_b_fn)(const nx_mm_call *, size_t, size_t, size_t, size_t, uint8_t *,
                              void *);
    typedef void (*kern_fn)(size_t, const uint8_t *, const uint8_t *, float *, size_t, int, int,
                            int);
    pack_a_fn pa;
    pack_b_fn pb;
    kern_fn kn;
    size_t bg;
    switch (c->type) {
/* A kernel with a min (f8m, f4m, h2f4m) must get an A packer with off = 0 (nx_q8a_pack_a_0_*): the
 * AVX2 build starts those kernels' part sums at zero (nx_q8a_kern_t's Z) */
#define NX_Q8A_CASE(T, t, A, KN, H, M)                                                             \
    case NX_GGML_##T:                                                                              \
        pa = A, pb = nx_q8a_pack_b_##t, kn = nx_q8a_kern_##KN, bg = NX_Q8A_BG(H, M);               \
        break;
#if NX_Q8A_VNNI /* unsigned codes, like the other types (the int16 bound F does not apply) */
        NX_Q8A_CASE(Q8_0, q8_0u, nx_q8a_pack_a_128_1, f8, 1, 0)
#else
        NX_Q8A_CASE(Q8_0, q8_0, nx_q8a_pack_a_0_1, sgn, 1, 0)
#endif
        NX_Q8A_CASE(Q4_0, q4_0, nx_q8a_pack_a_8_1, f8, 1, 0)
        NX_Q8A_CASE(Q5_0, q5_0, nx_q8a_pack_a_16_1, f4, 1, 0)
        NX_Q8A_CASE(Q4_1, q4_1, nx_q8a_pack_a_0_1, f8m, 1, 1)
        NX_Q8A_CASE(Q5_1, q5_1, nx_q8a_pack_a_0_1, f4m, 1, 1)
        NX_Q8A_CASE(Q4_K, q4_K, nx_q8a_pack_a_0_1, f8m, 1, 1)
        NX_Q8A_CASE(Q5_K, q5_K, nx_q8a_pack_a_0_1, f4m, 1, 1)
        NX_Q8A_CASE(Q6_K, q6_K, nx_q8a_pack_a_32_2, h2f2, 2, 0)
        NX_Q8A_CASE(Q3_K, q3_K, nx_q8a_pack_a_4_2, h2f4, 2, 0)
        NX_Q8A_CASE(Q2_K, q2_K, nx_q8a_pack_a_0_2, h2f4m, 2, 1)
#undef NX_Q8A_CASE
    default:
        return -2;
    }
    const nx_lowp_tiling tl = {
        NX_Q8A_MR, NX_Q8A_NR, NX_Q8A_KC, NX_Q8A_NC, NX_Q8A_MC, NX_Q8A_AG, bg,
        c->K / NX_QK8_0 * NX_Q8_0_BLOCK_BYTES + 64, 0, 0, pa, pb, kn,
    };
    return nx_lowp_blocked(&tl, c);
}

#endif
