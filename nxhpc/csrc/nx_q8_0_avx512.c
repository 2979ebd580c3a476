/* nx_q8_0_avx512.c -- AVX-512 (F/BW/VL/DQ) variants of the Q8_0 family: quantize, dequantize, matmul.
 *
 * Owns the matmul's AVX-512 pieces for the shared blocked driver (nx_q8_0_matmul_blocked): the
 * weight-panel packer (dequantize, exact, and transpose into micro-kernel order) and the
 * register-blocked MR x 32 micro-kernel that runs the contract's fma chain in vector lanes (one
 * lane = one output column). Entered only after the CPU probe reports AVX-512 + OS ZMM support.
 * Must not: change the per-output FMA order (see nx_q8_0.h), allocate per tile, or use threads.
 */
#include "nx_q8_0.h"

#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------ quantize / dequantize */

static inline __m512 nx_deq16(const uint8_t *q /* IN 16 int8 */, __m512 d) {
    __m128i b = _mm_loadu_si128((const __m128i *)q);
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), d);
}

static inline float nx_load_d(const uint8_t *blk) {
    uint16_t h;
    memcpy(&h, blk, 2);
    return _cvtsh_ss(h);
}

/* round-half-away(v), then float32 -> int32 (INT32_MIN for non-finite) -> low byte. */
static inline __m128i nx_round_q16(__m512 v) {
    const __m512 sign = _mm512_set1_ps(-0.0f);
    __m512 a = _mm512_andnot_ps(sign, v);
    __m512 f = _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __mmask16 up = _mm512_cmp_ps_mask(_mm512_sub_ps(a, f), _mm512_set1_ps(0.5f), _CMP_GE_OQ);
    __m512 b = _mm512_mask_add_ps(f, up, f, _mm512_set1_ps(1.0f));
    b = _mm512_or_ps(b, _mm512_and_ps(sign, v));
    return _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(b));
}

void nx_q8_0_quantize_avx512(const float *x /* IN */, uint8_t *out /* OUT */, size_t nblocks) {
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (size_t blk = 0; blk < nblocks; blk++) {
        const float *xb = x + blk * NX_QK8_0;
        uint8_t *ob = out + blk * NX_Q8_0_BLOCK_BYTES;
        __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
        __mmask16 nan = _mm512_cmp_ps_mask(v0, v0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(v1, v1, _CMP_UNORD_Q);
        if (nan) {                                   /* NaN propagation rules: the spec handles it */
            nx_q8_0_quantize_generic(xb, ob, 1);
            continue;
        }
        __m512 m = _mm512_max_ps(_mm512_andnot_ps(sign, v0), _mm512_andnot_ps(sign, v1));
        float amax = _mm512_reduce_max_ps(m);
        float d = amax / 127.0f;
        float id = (d == 0.0f) ? 0.0f : 1.0f / d;
        uint16_t dh = (uint16_t)_cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT);
        memcpy(ob, &dh, 2);
        __m512 vid = _mm512_set1_ps(id);
        _mm_storeu_si128((__m128i *)(ob + 2), nx_round_q16(_mm512_mul_ps(v0, vid)));
        _mm_storeu_si128((__m128i *)(ob + 18), nx_round_q16(_mm512_mul_ps(v1, vid)));
    }
}

void nx_q8_0_dequantize_avx512(const uint8_t *w /* IN */, float *out /* OUT */, size_t nblocks) {
    for (size_t blk = 0; blk < nblocks; blk++) {
        const uint8_t *b = w + blk * NX_Q8_0_BLOCK_BYTES;
        __m512 d = _mm512_set1_ps(nx_load_d(b));
        _mm512_storeu_ps(out + blk * NX_QK8_0, nx_deq16(b + 2, d));
        _mm512_storeu_ps(out + blk * NX_QK8_0 + 16, nx_deq16(b + 18, d));
    }
}

/* ------------------------------------------------------------------ matmul */

/* Blocking, measured on this project's Zen 5 host (2 x 512-bit FMA/cycle, 48 KiB L1d, 1 MiB L2;
 * thread-CPU time, best of 5, T=256, K in {3840, 10240}, N in {3840, 11520}):
 *   MR x NR = 12 x 32: 24 zmm accumulators + 2 weight vectors + 1 broadcast. MR=14 measured the
 *     same (within 1%), so the smaller tail tile wins.
 *   KC = 1024: k-depth of one pass (C tile read-modify-written K/KC times; A micro-panel
 *     MR*KC*4 = 48 KiB streams through L1). 1024: 239/241/233 GFLOP/s; 512: 232/238/231;
 *     256: 222/-/-; 128: 219/-/-.
 *   NC = 128: columns per dequantized weight panel (KC*NC*4 = 512 KiB, L2); 64..256 within 1%.
 *   MC = 264: tokens per packed activation block (MC*K*4 bytes); weights are dequantized once per
 *     block, so T <= MC dequantizes each weight exactly once. 132 and 528 were 1-3% slower. */
#ifndef NX_MR
#define NX_MR 12
#endif
#define NX_NR 32
#ifndef NX_KC
#define NX_KC 1024
#endif
#ifndef NX_NC
#define NX_NC 128
#endif
#ifndef NX_MC
#define NX_MC 264
#endif
_Static_assert(NX_MR >= 12 && NX_MR <= 14, "micro-kernel cases cover MR in 12..14");
_Static_assert(NX_KC % NX_Q8_0_CHAIN == 0, "KC must be a multiple of the chain chunk");
_Static_assert(NX_NC % NX_NR == 0, "NC must be a multiple of NR");
_Static_assert(NX_MC % NX_MR == 0, "MC must be a multiple of MR");

/* In-register 16x16 transpose: r[i][j] -> r[j][i]. */
static inline void nx_tr16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    /* r[4g + c], 128-bit lane L = rows 4g..4g+3 of column 4L + c */
    for (int c = 0; c < 4; c++) {
        __m512 a = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x88);
        __m512 b = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xDD);
        __m512 e = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x88);
        __m512 f = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xDD);
        t[c] = _mm512_shuffle_f32x4(a, e, 0x88);
        t[8 + c] = _mm512_shuffle_f32x4(a, e, 0xDD);
        t[4 + c] = _mm512_shuffle_f32x4(b, f, 0x88);
        t[12 + c] = _mm512_shuffle_f32x4(b, f, 0xDD);
    }
    for (int i = 0; i < 16; i++) r[i] = t[i];
}

/* Dequantize columns [j0, j0+nc) x blocks [b0, b0+kb) of w into Bp: for each 32-column panel p,
 * Bp[p*kc*32 + k*32 + j] = w[j0 + 32p + j, 32*b0 + k]; columns past nc are zero. */
static void nx_pack_b(const uint8_t *w /* IN */, size_t rowbytes, size_t j0, size_t nc, size_t b0,
                      size_t kb, float *Bp /* OUT */) {
    const size_t kc = kb * NX_QK8_0;
    for (size_t p = 0; p * NX_NR < nc; p++) {
        float *dst = Bp + p * kc * NX_NR;
        for (int h = 0; h < 2; h++) {
            size_t c0 = p * NX_NR + (size_t)h * 16;
            int ncol = c0 >= nc ? 0 : (nc - c0 >= 16 ? 16 : (int)(nc - c0));
            for (size_t b = 0; b < kb; b++) {
                float *db = dst + b * NX_QK8_0 * NX_NR + h * 16;
                if (ncol == 0) {
                    for (int k = 0; k < NX_QK8_0; k++) _mm512_store_ps(db + k * NX_NR, _mm512_setzero_ps());
                    continue;
                }
                const uint8_t *base = w + (j0 + c0) * rowbytes + (b0 + b) * NX_Q8_0_BLOCK_BYTES;
                for (int half = 0; half < 2; half++) {
                    __m512 r[16];
                    for (int i = 0; i < 16; i++) {
                        if (i < ncol) {
                            const uint8_t *blk = base + (size_t)i * rowbytes;
                            r[i] = nx_deq16(blk + 2 + half * 16, _mm512_set1_ps(nx_load_d(blk)));
                        } else {
                            r[i] = _mm512_setzero_ps();
                        }
                    }
                    nx_tr16(r);
                    for (int k = 0; k < 16; k++) _mm512_store_ps(db + (half * 16 + k) * NX_NR, r[k]);
                }
            }
        }
    }
}

/* One chunk of the contract's two-level sum (kc <= NX_Q8_0_CHAIN) for C[0:mr, 0:32], masked to
 * the valid columns:  p = +0;  p = fma(A[k][r], B[k][j], p) for k < kc;  C = first ? p : C + p. */
static inline __attribute__((always_inline)) void
nx_kern(const int mr, size_t kc, const float *A /* IN [kc][MR] */, const float *B /* IN [kc][32] */,
        float *C /* IN/OUT */, size_t ldc, __mmask16 m0, __mmask16 m1, int first) {
    __m512 c0[NX_MR], c1[NX_MR];
    for (int r = 0; r < NX_MR; r++) {
        if (r < mr) {
            c0[r] = _mm512_setzero_ps();
            c1[r] = _mm512_setzero_ps();
        }
    }
    for (size_t k = 0; k < kc; k++) {
        __m512 b0 = _mm512_load_ps(B + k * NX_NR), b1 = _mm512_load_ps(B + k * NX_NR + 16);
        for (int r = 0; r < NX_MR; r++) {
            if (r < mr) {
                __m512 a = _mm512_set1_ps(A[k * NX_MR + r]);
                c0[r] = _mm512_fmadd_ps(a, b0, c0[r]);
                c1[r] = _mm512_fmadd_ps(a, b1, c1[r]);
            }
        }
    }
    for (int r = 0; r < NX_MR; r++) {
        if (r < mr) {
            if (!first) {
                c0[r] = _mm512_add_ps(_mm512_maskz_loadu_ps(m0, C + r * ldc), c0[r]);
                c1[r] = _mm512_add_ps(_mm512_maskz_loadu_ps(m1, C + r * ldc + 16), c1[r]);
            }
            _mm512_mask_storeu_ps(C + r * ldc, m0, c0[r]);
            _mm512_mask_storeu_ps(C + r * ldc + 16, m1, c1[r]);
        }
    }
}

#define NX_KERN_CASE(M) case M: nx_kern(M, kc, A, B, C, ldc, m0, m1, first); break;

/* The driver's kern (see nx_q8_0_tiling): masks for the nr valid columns, then the micro-kernel
 * compiled for this row count. */
static void nx_kern_any(int mr, int nr, size_t kc, const float *A, const float *B, float *C,
                        size_t ldc, int first) {
    const __mmask16 m0 = nr >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << nr) - 1u);
    const __mmask16 m1 = nr >= 32 ? (__mmask16)0xffff
                       : nr > 16 ? (__mmask16)((1u << (nr - 16)) - 1u) : (__mmask16)0;
    switch (mr) {
#if NX_MR >= 14
    NX_KERN_CASE(14)
#endif
#if NX_MR >= 13
    NX_KERN_CASE(13)
#endif
    NX_KERN_CASE(12) NX_KERN_CASE(11) NX_KERN_CASE(10) NX_KERN_CASE(9) NX_KERN_CASE(8)
    NX_KERN_CASE(7) NX_KERN_CASE(6) NX_KERN_CASE(5) NX_KERN_CASE(4) NX_KERN_CASE(3)
    NX_KERN_CASE(2) NX_KERN_CASE(1)
    default: __builtin_unreachable();   /* 1 <= mr <= NX_MR by construction */
    }
}
#undef NX_KERN_CASE

static const nx_q8_0_tiling nx_tiling_avx512 = {NX_MR, NX_NR, NX_KC, NX_NC, NX_MC, nx_pack_b,
                                                nx_kern_any};

int nx_q8_0_matmul_avx512(const float *x /* IN [T*K] */, const uint8_t *w /* IN [N rows] */,
                          float *out /* OUT [T*N] */, size_t T, size_t K, size_t N,
                          size_t n0, size_t n1) {
    return nx_q8_0_matmul_blocked(&nx_tiling_avx512, x, w, out, T, K, N, n0, n1);
}
