/* nx_lowp_bf16_avx2.c -- the `bf16` matmul (nx_lowp.h) and bf() rounding on AVX2 + FMA: a
 * float32 register-tile micro-kernel over bfloat16-valued float32 panels; exports
 * nx_matmul_bf16_avx2 and nx_bf16_round_n_avx2 (the lowp table that holds them is
 * nx_lowp_avx2.c's). Compiled with -mavx2 -mfma -mf16c; inherited by every ISA above avx2 that
 * does not override the slots, so it must give the spec's bits on any x86 with AVX2.
 *
 * Owns: the float32 panel layouts, the MR x NR ymm tile and the MXCSR discipline of its chains.
 *   Panels: per 32-k group, A micro-panel float[32][MR] with row i = bf(x[t, 32g + (i ^ 1)]) of
 *   each token t (the two elements of each k-pair swapped, so a plain k loop runs the pair's odd
 *   element first), B micro-panel float[32][NR], row i = bf(dequant(w)[n, 32g + (i ^ 1)]) of
 *   each column n; K zero-padded to 32, tokens / columns past the tile's zero. Weights decode
 *   through the call's dequantize (the ISA's wtype family: every type with traits) into a
 *   scratch of 8 rows x KC floats, exact, then bf() once per panel; Q8_0 (unless the call asks
 *   for the dequantize packer, NX_MM_DEQUANT_PACK) decodes f32(d) * q in registers, the same
 *   exact values.
 *   Step: each chain step is one vfmadd231ps on bfloat16 values, run with MXCSR = the caller's
 *   exception masks, round-to-nearest-even, DAZ and FTZ on. That is the contract's
 *   step(acc, a, b) = ftz(fma(daz(a), daz(b), daz(acc))) exactly: DAZ reads subnormal inputs as
 *   zeros (a and b never are: bf() flushes them), and x86 FTZ is the contract's ftz (a result
 *   tiny after rounding to 24 bits with an unbounded exponent becomes the zero of its sign;
 *   C between k-blocks is such a result). Checked by tests/test_kernels_lowp.py
 *   (test_bf16_simd_ftz_boundary: exact sums in (2^-126 - 2^-150, 2^-126 - 2^-151), which FTZ
 *   flushes and a gradual-underflow fmaf rounds to 2^-126).
 *   The bias add (nx_lowp_blocked) and the packing run with the caller's MXCSR.
 * Must not: change the per-output order of nx_lowp.h (one chain over k = 1, 0, 3, 2, ...),
 * allocate per tile, keep a bfloat16/float32 copy of the whole weight matrix, use threads, or
 * return with MXCSR changed.
 */
#include "nx_lowp.h"
#include "nx_simd.h" /* nxv_transpose, nxv_load_q8, nx_mask8 (8 lanes) */

#include <immintrin.h>
#include <string.h>

/* Tile, measured on AMD EPYC Zen 3 (family 25 model 1), 2 cores, AVX2, one thread, the other
 * core busy with another job (fma_ymm peak 94 GFLOP/s under that load; figures +-5%); process
 * time, best of 4; T=256, K=N=3840, Q8_0 weights, GFLOP/s:
 *   MR x NR = 6 x 16 (12 ymm accumulators + 2 weight vectors + 1 broadcast: nx_matmul_avx2.c's
 *     tile, the 16 ymm registers full); 4 x 24 not tried.
 *   KC x NC (jr_outer 0): 512 x 256: 67, 256 x 256: 70, 1024 x 256: 64, 512 x 128: 67,
 *     512 x 512: 65; jr_outer 1: 256 x 256: 66, 512 x 256: 70 -- all within the noise; 512 x 256
 *     kept (the float32 matmul's). Weight panels (decode + bf + transpose) take ~8% (perf).
 *   The two MXCSR writes per tile (~82k tiles per call): with and without them 61.5-61.9 vs
 *     61.8 (not measurable). */
#define NX_B2_MR 6
#define NX_B2_NV 2 /* ymm vectors per tile row */
#define NX_B2_NR (8 * NX_B2_NV)
#ifndef NX_B2_KC
#define NX_B2_KC 512
#endif
#ifndef NX_B2_NC
#define NX_B2_NC 256
#endif
#ifndef NX_B2_MC
#define NX_B2_MC 264
#endif
#ifndef NX_B2_JR_OUTER
#define NX_B2_JR_OUTER 0
#endif
_Static_assert(NX_B2_KC % 256 == 0, "KC must hold whole blocks of every type");
_Static_assert(NX_B2_NC % NX_B2_NR == 0, "NC must be a multiple of NR");
_Static_assert(NX_B2_MC % NX_B2_MR == 0, "MC must be a multiple of MR");

#define NX_B2_AG (32 * NX_B2_MR * 4) /* bytes of one A micro-panel group */
#define NX_B2_BG (32 * NX_B2_NR * 4) /* bytes of one B micro-panel group */

/* MXCSR bits: DAZ (6), rounding control (13-14), FTZ (15). */
#define NX_B2_DAZ 0x0040u
#define NX_B2_FTZ 0x8000u
#define NX_B2_RC_FTZ 0xE000u

/* ------------------------------------------------------------------ bf() on 8 lanes */

/* Bits of bf(v) << 16 (the bfloat16 value as float32 bits), nx_bf16_round lane by lane. */
static inline __m256i nx_b2_bf16_bits(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i mag = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
    const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rne = _mm256_and_si256(
        _mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), hi);
    const __m256i qnan = _mm256_and_si256(_mm256_or_si256(u, _mm256_set1_epi32(0x00400000)), hi);
    const __m256i sgn = _mm256_and_si256(u, _mm256_set1_epi32((int)0x80000000u));
    const __m256i is_nan = _mm256_cmpgt_epi32(mag, _mm256_set1_epi32(0x7f800000));
    const __m256i is_small =
        _mm256_cmpeq_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7f800000)), _mm256_setzero_si256());
    __m256i r = _mm256_blendv_epi8(rne, qnan, is_nan);
    return _mm256_blendv_epi8(r, sgn, is_small);
}

static inline __m256 nx_b2_bf16(__m256 v) { return _mm256_castsi256_ps(nx_b2_bf16_bits(v)); }

void nx_bf16_round_n_avx2(const float *x /* IN [n] */, uint16_t *out /* OUT [n] */, size_t n) {
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m256i a = _mm256_srli_epi32(nx_b2_bf16_bits(_mm256_loadu_ps(x + i)), 16);
        const __m256i b = _mm256_srli_epi32(nx_b2_bf16_bits(_mm256_loadu_ps(x + i + 8)), 16);
        /* packus works per 128-bit lane: a0 b0 a1 b1 -> a0 a1 b0 b1 */
        const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xD8);
        _mm256_storeu_si256((__m256i *)(out + i), p);
    }
    for (; i < n; i++) out[i] = nx_bf16_round(x[i]);
}

/* ------------------------------------------------------------------ packers */

/* Lanes (2i, 2i+1) swapped. */
static inline __m256 nx_b2_swap_pairs(__m256 v) { return _mm256_permute_ps(v, 0xB1); }

static void nx_b2_pack_a(const float *x /* IN */, size_t K, size_t t0, size_t rows,
                         uint8_t *Ap /* OUT */, void *scratch) {
    (void)scratch;
    const size_t G = (K + 31) / 32;
    float *a = (float *)Ap;
    for (size_t r = 0; r < NX_B2_MR; r++) {
        if (r >= rows) {
            for (size_t i = 0; i < G * 32; i++) a[i * NX_B2_MR + r] = 0.0f;
            continue;
        }
        const float *src = x + (t0 + r) * K;
        for (size_t k = 0; k < G * 32; k += 8) {
            const __m256 v = _mm256_maskload_ps(src + k, nx_mask8((int64_t)K - (int64_t)k));
            float p[8];
            _mm256_storeu_ps(p, nx_b2_swap_pairs(nx_b2_bf16(v)));
            for (int i = 0; i < 8; i++) a[(k + (size_t)i) * NX_B2_MR + r] = p[i];
        }
    }
}

/* Columns [j0, j0+ncols) x k in [k0, k0+kc) into one B micro-panel; scratch: 8 x KC floats. */
static void nx_b2_pack_b(const nx_mm_call *c, size_t j0, size_t ncols, size_t k0, size_t kc,
                         uint8_t *Bp /* OUT */, void *scratch) {
    const nx_dequant_fn deq = c->dequant; /* the ISA's dequantize of the type (wtype family) */
    const uint8_t *w = c->w;
    const size_t rowbytes = c->rowbytes;
    const size_t ng = (kc + 31) / 32, be = c->wt->blck_elems, bb = c->wt->blck_bytes;
    float *s = (float *)scratch; /* [8][KC] decoded rows */
    const int fused_q8 = c->type == NX_GGML_Q8_0 && !(c->flags & NX_MM_DEQUANT_PACK);
    for (int h = 0; h < NX_B2_NV; h++) {
        const size_t c0 = (size_t)h * 8;
        const int nv = c0 >= ncols ? 0 : (ncols - c0 >= 8 ? 8 : (int)(ncols - c0));
        float *dst = (float *)Bp + c0;
        if (nv == 0) {
            for (size_t i = 0; i < ng * 32; i++) _mm256_store_ps(dst + i * NX_B2_NR, _mm256_setzero_ps());
            continue;
        }
        if (!fused_q8)
            for (int j = 0; j < nv; j++) {
                float *row = s + (size_t)j * NX_B2_KC;
                deq(w + (j0 + c0 + j) * rowbytes + k0 / be * bb, row, kc / be); /* exact */
                for (size_t k = kc; k < ng * 32; k++) row[k] = 0.0f;
            }
        for (size_t g = 0; g < ng; g++) {
            for (int q = 0; q < 32; q += 8) {
                __m256 r[8];
                for (int j = 0; j < 8; j++) {
                    if (j >= nv) {
                        r[j] = _mm256_setzero_ps();
                    } else if (fused_q8) { /* one block per group: f32(d) * q, exact */
                        const uint8_t *blk = w + (j0 + c0 + j) * rowbytes + (k0 / 32 + g) * bb;
                        uint16_t dh;
                        memcpy(&dh, blk, 2);
                        r[j] = nx_b2_bf16(nxv_load_q8(blk + 2 + q, _mm256_set1_ps(_cvtsh_ss(dh))));
                    } else {
                        r[j] = nx_b2_bf16(_mm256_loadu_ps(s + (size_t)j * NX_B2_KC + g * 32 + q));
                    }
                }
                nxv_transpose(r); /* r[i] lane j = k-offset q + i of column c0 + j */
                float *dg = dst + (g * 32 + (size_t)q) * NX_B2_NR;
                for (int i = 0; i < 8; i++) _mm256_store_ps(dg + (size_t)(i ^ 1) * NX_B2_NR, r[i]);
            }
        }
    }
}

/* ------------------------------------------------------------------ micro-kernel */

/* An empty volatile asm that reads and writes a register: the FMAs that produce and consume it
 * cannot move across it, and volatile asm is not moved across the MXCSR writes (ldmxcsr is an
 * unspec_volatile). (A "memory" clobber instead, as in nx_attn_bf16_avx512bf16.c, made GCC keep
 * the accumulators on the stack: 12 stores per k-step, ~20 GFLOP/s.) */
#define NX_B2_FENCE(v) __asm__ volatile("" : "+x"(v))

/* C[0:mr, 0:nr] := the chain over ng groups (32 k-steps each, pair-swapped order), continued
 * from C unless first. All 6 rows run (rows past mr are the panel's zeros, never stored): named
 * accumulators and a fixed row count keep the 12 in registers (nx_matmul_avx2.c's tile). The
 * fences keep every FMA of the tile between the two MXCSR writes. */
static void nx_b2_kern(size_t ng, const uint8_t *A, const uint8_t *B, float *C, size_t ldc, int mr,
                       int nr, int first) {
    const __m256i m0 = nx_mask8(nr), m1 = nx_mask8(nr - 8);
    __m256 c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51;
    c00 = c01 = c10 = c11 = c20 = c21 = c30 = c31 = c40 = c41 = c50 = c51 = _mm256_setzero_ps();
    /* clang-format off */
    /* a whole-width tile (nr == 16) is read and written with plain moves (nx_matmul_avx2.c) */
    const int whole = nr == NX_B2_NR;
#define NX_B2_LD(r, a0, a1) if (mr > r) { \
        a0 = whole ? _mm256_loadu_ps(C + r * ldc) : _mm256_maskload_ps(C + r * ldc, m0); \
        a1 = whole ? _mm256_loadu_ps(C + r * ldc + 8) : _mm256_maskload_ps(C + r * ldc + 8, m1); }
    if (!first) { NX_B2_LD(0, c00, c01) NX_B2_LD(1, c10, c11) NX_B2_LD(2, c20, c21)
                  NX_B2_LD(3, c30, c31) NX_B2_LD(4, c40, c41) NX_B2_LD(5, c50, c51) }
#undef NX_B2_LD
#define NX_B2_FENCE_ALL NX_B2_FENCE(c00); NX_B2_FENCE(c01); NX_B2_FENCE(c10); NX_B2_FENCE(c11); \
    NX_B2_FENCE(c20); NX_B2_FENCE(c21); NX_B2_FENCE(c30); NX_B2_FENCE(c31); \
    NX_B2_FENCE(c40); NX_B2_FENCE(c41); NX_B2_FENCE(c50); NX_B2_FENCE(c51);
    const unsigned csr = _mm_getcsr();
    _mm_setcsr((csr & ~NX_B2_RC_FTZ) | NX_B2_DAZ | NX_B2_FTZ);
    NX_B2_FENCE_ALL /* the chains start after the MXCSR write */
    const float *A_ = (const float *)A, *B_ = (const float *)B;
    const size_t nk = ng * 32;
    for (size_t k = 0; k < nk; k++) {
        const float *a = A_ + k * NX_B2_MR;
        const __m256 b0 = _mm256_load_ps(B_ + k * NX_B2_NR), b1 = _mm256_load_ps(B_ + k * NX_B2_NR + 8);
        __m256 t;
        t = _mm256_broadcast_ss(a + 0); c00 = _mm256_fmadd_ps(t, b0, c00); c01 = _mm256_fmadd_ps(t, b1, c01);
        t = _mm256_broadcast_ss(a + 1); c10 = _mm256_fmadd_ps(t, b0, c10); c11 = _mm256_fmadd_ps(t, b1, c11);
        t = _mm256_broadcast_ss(a + 2); c20 = _mm256_fmadd_ps(t, b0, c20); c21 = _mm256_fmadd_ps(t, b1, c21);
        t = _mm256_broadcast_ss(a + 3); c30 = _mm256_fmadd_ps(t, b0, c30); c31 = _mm256_fmadd_ps(t, b1, c31);
        t = _mm256_broadcast_ss(a + 4); c40 = _mm256_fmadd_ps(t, b0, c40); c41 = _mm256_fmadd_ps(t, b1, c41);
        t = _mm256_broadcast_ss(a + 5); c50 = _mm256_fmadd_ps(t, b0, c50); c51 = _mm256_fmadd_ps(t, b1, c51);
    }
    NX_B2_FENCE_ALL /* ... and end before the restore */
#undef NX_B2_FENCE_ALL
    _mm_setcsr(csr);
#define NX_B2_SV(p, m, v) (whole ? _mm256_storeu_ps(p, v) : _mm256_maskstore_ps(p, m, v))
#define NX_B2_ST(r, a0, a1) if (mr > r) { NX_B2_SV(C + r * ldc, m0, a0); \
                                          NX_B2_SV(C + r * ldc + 8, m1, a1); }
    NX_B2_ST(0, c00, c01) NX_B2_ST(1, c10, c11) NX_B2_ST(2, c20, c21)
    NX_B2_ST(3, c30, c31) NX_B2_ST(4, c40, c41) NX_B2_ST(5, c50, c51)
#undef NX_B2_ST
#undef NX_B2_SV
    /* clang-format on */
}

int nx_matmul_bf16_avx2(const nx_mm_call *c) {
    if (!c->wt || !c->dequant) return -2;
    const nx_lowp_tiling tl = {
        NX_B2_MR,
        NX_B2_NR,
        NX_B2_KC,
        NX_B2_NC,
        NX_B2_MC,
        NX_B2_AG,
        NX_B2_BG,
        0,
        8 * NX_B2_KC * sizeof(float),
        NX_B2_JR_OUTER,
        nx_b2_pack_a,
        nx_b2_pack_b,
        nx_b2_kern,
    };
    return nx_lowp_blocked(&tl, c);
}
