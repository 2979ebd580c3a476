/* nx_lowp_bf16_pack.h -- the bfloat16 packing shared by the bf16 matmuls that take bf16 pairs
 * (the vdpbf16ps kernel of nx_lowp_avx512bf16.c and the tdpbf16ps kernel of nx_lowp_amx.c):
 * bf() of 32 floats as 16 pair-dwords and a 16 x 16 dword transpose (both kernels), and the
 * vdpbf16ps kernel's weight micro-panel packer. Included only by files compiled with AVX-512
 * BF16.
 *
 * Owns: the vdpbf16ps B micro-panel layout: per 32-k group uint32 pairs[16][NR] (row p = pair p
 * of every column: bf(w[2p]) in the low half, bf(w[2p+1]) in the high half). (The AMX kernel
 * keeps the weights' pairs as decoded, one row per column: its own packer.) Must not:
 * allocate, or decode weights other than to their exact float32 values (the call's dequantize;
 * Q8_0 in registers: f32(d) * q, exact), rounded by bf() once.
 */
#ifndef NX_LOWP_BF16_PACK_H
#define NX_LOWP_BF16_PACK_H

#include <immintrin.h>
#include <string.h>

#include "nx_lowp.h"

#ifndef NX_PANEL_PF
#define NX_PANEL_PF 1 /* prefetch the next 16 columns' weight rows while packing (0: off) */
#endif

/* bf() of 32 floats (lo = elements 0..15, hi = 16..31) as 16 pair-dwords: dword i holds element
 * 2i in its low half and 2i+1 in its high half (the vdpbf16ps operand order). VCVTNE2PS2BF16 is
 * bf() of nx_lowp.h by definition (checked against the scalar spec in the tests). */
static inline __m512i nx_bf16_pairs32(__m512 lo, __m512 hi) {
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

/* In-register 16x16 dword transpose: r[i][j] -> r[j][i]. */
static inline void nx_tr16i(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    /* r[4g + c], 128-bit lane L = rows 4g..4g+3 of column 4L + c */
    for (int c = 0; c < 4; c++) {
        __m512i a = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x88);
        __m512i b = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xDD);
        __m512i e = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x88);
        __m512i f = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xDD);
        t[c] = _mm512_shuffle_i32x4(a, e, 0x88);
        t[8 + c] = _mm512_shuffle_i32x4(a, e, 0xDD);
        t[4 + c] = _mm512_shuffle_i32x4(b, f, 0x88);
        t[12 + c] = _mm512_shuffle_i32x4(b, f, 0xDD);
    }
    for (int i = 0; i < 16; i++) r[i] = t[i];
}

/* The weight micro-panel of columns [j0, j0+ncols) (ncols <= 16 * NV) x k in [k0, k0+kc):
 * ceil(kc/32) groups of pairs[16][16 * NV], columns past ncols zero. scratch: 16 * KCP floats
 * (KCP >= kc rounded up to 32). */
NX_INLINE void nx_bf16_pack_b(const nx_mm_call *c, size_t j0, size_t ncols, size_t k0, size_t kc,
                              uint8_t *Bp /* OUT */, void *scratch, const int NV, const size_t KCP) {
    const size_t NR = 16 * (size_t)NV, BG = 16 * NR * 4;
    const nx_dequant_fn deq = c->dequant; /* the ISA's dequantize of the type (wtype family) */
    const uint8_t *w = c->w;
    const size_t rowbytes = c->rowbytes;
    const size_t ng = (kc + 31) / 32, be = c->wt->blck_elems, bb = c->wt->blck_bytes;
    float *s = (float *)scratch; /* [16][KCP] decoded rows */
    const int fused_q8 = c->type == NX_GGML_Q8_0 && !(c->flags & NX_MM_DEQUANT_PACK);
    const size_t pfb = kc / be * bb; /* bytes of one row's k-range */
    for (int h = 0; h < NV; h++) {
        const size_t c0 = (size_t)h * 16;
        const int nv = c0 >= ncols ? 0 : (ncols - c0 >= 16 ? 16 : (int)(ncols - c0));
        /* Prefetch the k-range of the next 16 columns' rows (the next vector, or the next
         * micro-panel's first): each row contributes only kc/be blocks per call, too short a
         * stream for the hardware prefetchers, so the loads here waited on memory (perf: 2/3
         * of this packer's samples on the weight loads, the packer ~40% of the AMX bf16 matmul
         * on Q8_0). AMX Xeon (family 6 model 167), T=256, K=N=3840, 1 thread, tdpbf16ps,
         * GOP/s without -> with, 3 A/B runs: Q8_0 540-616 -> 663-738, Q6_K 484-535 -> 697-706,
         * Q4_K 697 -> 769, Q5_K 627 -> 699, Q4_0 777 -> 822. */
        for (size_t j = j0 + c0 + 16; NX_PANEL_PF && j < j0 + c0 + 32 && j < c->n1; j++)
            for (size_t o = 0; o < pfb; o += 64)
                _mm_prefetch((const char *)(w + j * rowbytes + k0 / be * bb + o), _MM_HINT_T0);
        if (fused_q8) { /* Q8_0: one block per group, decoded in registers (d * q is exact) */
            for (size_t g = 0; g < ng; g++) {
                __m512i r[16];
                for (int j = 0; j < 16; j++) {
                    if (j < nv) {
                        const uint8_t *blk = w + (j0 + c0 + j) * rowbytes + (k0 / 32 + g) * bb;
                        uint16_t dh;
                        memcpy(&dh, blk, 2);
                        const __m512 d = _mm512_set1_ps(_cvtsh_ss(dh));
                        const __m128i q0 = _mm_loadu_si128((const __m128i *)(blk + 2));
                        const __m128i q1 = _mm_loadu_si128((const __m128i *)(blk + 18));
                        r[j] = nx_bf16_pairs32(
                            _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)), d),
                            _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)), d));
                    } else {
                        r[j] = _mm512_setzero_si512();
                    }
                }
                nx_tr16i(r);
                uint8_t *dst = Bp + g * BG + c0 * 4;
                for (int p = 0; p < 16; p++)
                    _mm512_store_si512((__m512i *)(dst + p * NR * 4), r[p]);
            }
            continue;
        }
        for (int j = 0; j < nv; j++) {
            float *row = s + (size_t)j * KCP;
            deq(w + (j0 + c0 + j) * rowbytes + k0 / be * bb, row, kc / be); /* exact */
            for (size_t k = kc; k < ng * 32; k++) row[k] = 0.0f;
        }
        for (size_t g = 0; g < ng; g++) {
            __m512i r[16];
            for (int j = 0; j < 16; j++) {
                if (j < nv) {
                    const float *row = s + (size_t)j * KCP + g * 32;
                    r[j] = nx_bf16_pairs32(_mm512_loadu_ps(row), _mm512_loadu_ps(row + 16));
                } else {
                    r[j] = _mm512_setzero_si512();
                }
            }
            nx_tr16i(r); /* r[p] lane j = pair p of column c0 + j */
            uint8_t *dst = Bp + g * BG + c0 * 4;
            for (int p = 0; p < 16; p++)
                _mm512_store_si512((__m512i *)(dst + p * NR * 4), r[p]);
        }
    }
}

#endif
