/* nx_lowp_avx512bf16.c -- the `bf16` matmul on AVX-512 BF16: vdpbf16ps micro-kernel and its
 * packers (activations rounded to bfloat16 pairs; weights decoded by the ISA's dequantize of the
 * weight type -- the traits table, so every type it has -- rounded to bfloat16 once, panel by
 * panel); exports the avx512bf16 table of the "lowp" family.
 *
 * Owns: the bf16 panel layouts and the MR x NR register tile. Entered only after the probe
 * reports the avx512 level, AVX512_BF16 and OS ZMM support.
 * Must not: change the per-output pair order of nx_lowp.h (one vdpbf16ps chain per output over
 * k-pairs 0, 1, 2, ... in order), allocate per tile, keep a bfloat16 copy of the whole matrix,
 * or use threads.
 */
#include "nx_lowp.h"

#include <immintrin.h>
#include <string.h>

#include "nx_lowp_bf16_pack.h"

/* Tile, measured on this project's AMD Zen 4 host (2 cores shared with other jobs, so figures
 * are +-3%; process time, best of 4 interleaved runs; weights Q8_0; T=256 and
 * (K, N) = (3840, 3840) / (10240, 3840) / (3840, 10240), GFLOP/s):
 *   MR x NR = 8 x 48 (24 zmm accumulators, 3 weight vectors, the activation pair broadcast):
 *     194/188/194; 6 x 64: 193/187/191; 4 x 96: 193/186/193; 12 x 32: 178/183/180 (T=256 is
 *     21.3 tiles of 12: the padded rows cost, and 2 weight loads per 12 broadcasts gain nothing).
 *     vdpbf16ps zmm issues 1/cycle there (233 GFLOP/s measured peak); the kernel alone runs at
 *     ~214, the rest is the weight panels' decode + rounding + transpose (~10% at T=256).
 *   KC = 1024 (A micro-panel MR*KC*2 = 16 KiB in L1): 512 and 2048 within 2%.
 *   NC = 240 (NC*KC*2 = 480 KiB in L2): 144 the same, 480 3% slower.
 *   MC = 264: tokens per packed activation block; T <= MC decodes each weight once.
 *   jr_outer (B micro-panel kept in L1, KC=256) measured 2-5% slower. */
#ifndef NX_BF_MR
#define NX_BF_MR 8
#endif
#ifndef NX_BF_NV
#define NX_BF_NV 3 /* zmm vectors per tile row */
#endif
#define NX_BF_NR (16 * NX_BF_NV)
#ifndef NX_BF_KC
#define NX_BF_KC 1024
#endif
#ifndef NX_BF_NC
#define NX_BF_NC 240
#endif
#ifndef NX_BF_JR_OUTER
#define NX_BF_JR_OUTER 0
#endif
#ifndef NX_BF_MC
#define NX_BF_MC 264
#endif
_Static_assert(NX_BF_KC % 256 == 0, "KC must hold whole blocks of every type");
_Static_assert(NX_BF_NC % NX_BF_NR == 0, "NC must be a multiple of NR");
_Static_assert(NX_BF_MC % NX_BF_MR == 0, "MC must be a multiple of MR");

/* Per 32-k group: A micro-panel uint32 pairs[16][MR] (pair p of token r: bf(x[2p]) low half,
 * bf(x[2p+1]) high half); B micro-panel uint32 pairs[16][NR] (same, column j). */
#define NX_BF_AG (16 * NX_BF_MR * 4)
#define NX_BF_BG (16 * NX_BF_NR * 4)
#define NX_BF_KCP NX_BF_KC /* scratch row stride (floats) */

void nx_bf16_round_n_avx512bf16(const float *x /* IN */, uint16_t *out /* OUT */, size_t n) {
    size_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(out + i),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
    if (i < n) {
        const __mmask16 m = (__mmask16)((1u << (n - i)) - 1u);
        __m256i r = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, x + i));
        _mm256_mask_storeu_epi16(out + i, m, r);
    }
}

static void nx_bf_pack_a(const float *x /* IN */, size_t K, size_t t0, size_t rows,
                         uint8_t *Ap /* OUT */, void *scratch) {
    (void)scratch;
    const size_t G = (K + 31) / 32;
    uint32_t *a = (uint32_t *)Ap;
    for (size_t r = 0; r < NX_BF_MR; r++) {
        const float *src = r < rows ? x + (t0 + r) * K : x;
        for (size_t g = 0; g < G; g++) {
            uint32_t p[16];
            if (r < rows) {
                const size_t k = g * 32, left = K - k;
                const __mmask16 m0 =
                    left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u);
                const __mmask16 m1 = left >= 32  ? (__mmask16)0xffff
                                     : left > 16 ? (__mmask16)((1u << (left - 16)) - 1u)
                                                 : (__mmask16)0;
                __m512i v = nx_bf16_pairs32(_mm512_maskz_loadu_ps(m0, src + k),
                                            _mm512_maskz_loadu_ps(m1, src + k + 16));
                _mm512_storeu_si512((__m512i *)p, v);
            } else {
                memset(p, 0, sizeof p);
            }
            for (int i = 0; i < 16; i++) a[(g * 16 + i) * NX_BF_MR + r] = p[i];
        }
    }
}

static void nx_bf_pack_b(const nx_mm_call *c, size_t j0, size_t ncols, size_t k0, size_t kc,
                         uint8_t *Bp /* OUT */, void *scratch) {
    nx_bf16_pack_b(c, j0, ncols, k0, kc, Bp, scratch, NX_BF_NV, NX_BF_KCP);
}

/* C[0:mr, 0:nr] := the pair chain over ng groups (16 pairs each), continued from C unless first. */
static void nx_bf_kern(size_t ng, const uint8_t *A, const uint8_t *B, float *C, size_t ldc, int mr,
                       int nr, int first) {
    __mmask16 m[NX_BF_NV];
    for (int v = 0; v < NX_BF_NV; v++) {
        const int left = nr - 16 * v;
        m[v] = left >= 16 ? (__mmask16)0xffff : left > 0 ? (__mmask16)((1u << left) - 1u) : 0;
    }
    __m512 c[NX_BF_MR][NX_BF_NV];
    for (int r = 0; r < NX_BF_MR; r++)
        for (int v = 0; v < NX_BF_NV; v++)
            c[r][v] = (!first && r < mr) ? _mm512_maskz_loadu_ps(m[v], C + r * ldc + 16 * v)
                                         : _mm512_setzero_ps();
    const uint32_t *a = (const uint32_t *)A;
    const size_t np = ng * 16;
    for (size_t p = 0; p < np; p++) {
        __m512bh bv[NX_BF_NV];
        for (int v = 0; v < NX_BF_NV; v++)
            bv[v] = (__m512bh)_mm512_load_si512((const __m512i *)(B + (p * NX_BF_NR + 16 * v) * 4));
        for (int r = 0; r < NX_BF_MR; r++) {
            const __m512bh av = (__m512bh)_mm512_set1_epi32((int)a[p * NX_BF_MR + r]);
            for (int v = 0; v < NX_BF_NV; v++) c[r][v] = _mm512_dpbf16_ps(c[r][v], bv[v], av);
        }
    }
    for (int r = 0; r < NX_BF_MR; r++)
        if (r < mr)
            for (int v = 0; v < NX_BF_NV; v++)
                _mm512_mask_storeu_ps(C + r * ldc + 16 * v, m[v], c[r][v]);
}

int nx_matmul_bf16_avx512bf16(const nx_mm_call *c) {
    if (!c->wt || !c->dequant) return -2;
    const nx_lowp_tiling tl = {
        NX_BF_MR,
        NX_BF_NR,
        NX_BF_KC,
        NX_BF_NC,
        NX_BF_MC,
        NX_BF_AG,
        NX_BF_BG,
        0,
        16 * NX_BF_KCP * sizeof(float),
        NX_BF_JR_OUTER,
        nx_bf_pack_a,
        nx_bf_pack_b,
        nx_bf_kern,
    };
    return nx_lowp_blocked(&tl, c);
}

const nx_lowp_table nx_lowp_table_avx512bf16 = {.matmul_bf16 = nx_matmul_bf16_avx512bf16,
                                                .round_bf16 = nx_bf16_round_n_avx512bf16};
