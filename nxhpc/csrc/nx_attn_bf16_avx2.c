/* nx_attn_bf16_avx2.c -- the `bf16` attention (nx_attn_bf16.h) on AVX2 + FMA; exports the avx2
 * table of the "attn_bf16" family (inherited by the AVX-512 ISAs that do not override it).
 *
 * Owns: the packed layouts, the tiled driver and the NX_A2_BR-row x 64-key micro-block, the
 * design of nx_attn_bf16_avx512bf16.c on 8-lane ymm. bf() is nx_a2_bf8 below (integer ops on the
 * bit pattern, nx_bf16_round's three cases). E() is nx_exp2_8 (nx_vmath_avx2.h: nx_vmath_ew.h's
 * operations, the same bits as nx_attn_exp). The dot steps are vfmadd231ps on bfloat16-valued
 * float32 operands with MXCSR DAZ|FTZ set around each chain: then every FMA is exactly the
 * contract's step(acc, a, b) = ftz(fma(daz(a), daz(b), daz(acc))) (nx_lowp.h: ftz is x86's,
 * a result tiny after rounding to 24 bits with an unbounded exponent becomes the zero of its
 * sign; tests/test_kernels_attn_bf16.py::test_ftz_rounding_boundary_is_the_contract checks the
 * interval (2^-126 - 2^-150, 2^-126 - 2^-151) where that differs from flushing a
 * gradual-underflow fmaf).
 * O * alpha is taken before the chain, with the caller's MXCSR (a subnormal alpha is a value
 * there, as in the spec), then flushed as the chain's first acc by DAZ.
 * A pair's two steps are two FMAs, odd element first: K and Q are packed with the two elements
 * of each d-pair swapped, V with the two keys of each pair swapped.
 * Layouts, per kv head, once: kt[tile][i][64 keys] = bf(k[j, i^1]) (i < hd2 = hd rounded up to
 * even), vt[tile][i][hdp] = bf(v[64 tile + (i^1), d]) (hdp = hd rounded up to 8; keys >= T and
 * d >= hd zero); per query block qt[row][i] = bf(q[row, i^1]). For each query block of <= QB
 * rows and each key tile, micro-blocks of <= NX_A2_BR rows run: S = Q K^T (per 32 keys:
 * NX_A2_BR x 4 ymm accumulators, one chain per score over i), the online softmax (the contract's
 * tree sum of the rounded p, caller's MXCSR), then O = O * alpha and P V (per 32 columns:
 * NX_A2_BR x 4 ymm, one chain per output over the tile's 64 key positions). Every operation is
 * the contract's, in its order, lane for lane, so the generic spec's bits come out.
 * Entered only after the probe reports AVX2 + FMA (nx_cpu_isa_supported(NX_ISA_AVX2)).
 * Must not: change the contract's order, allocate per tile, use threads, or return with MXCSR
 * changed (every _mm_setcsr(csr | ...) below is followed, in straight-line code without a return
 * or a call that can leave early, by _mm_setcsr(csr)).
 */
#include "nx_attn_bf16.h"
#include "nx_vmath_avx2.h" /* nx_exp2_8, nx_mask8, nx_hsum8, nx_hmax8 */

#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

/* Rows per micro-block and ymm per row of an accumulator block (QK: 8 NX_A2_NK keys, PV: 8
 * NX_A2_NV columns): 3 x 4 = 12 accumulators + 4 operand registers of the 16 ymm; FMA's 4-cycle
 * latency at two per cycle needs >= 8 independent chains. Measured (AMD EPYC Zen 3 (family 25
 * model 1), 2 cores, AVX2, shared with another job; T=1024, hd=128, H=2, 1 thread, process time,
 * best of 9, bf16 speed / f32 AVX2 attention speed in the same process, three interleaved runs):
 * BR x NK x NV = 3x4x4 (12 acc) 1.08 / 1.00 / 0.90; 4x2x2 (8 acc, the f32 kernel's shape)
 * 0.97 / 0.94 / 0.98; 2x4x4 (8 acc) 0.84 / 1.05 / 0.72; earlier single runs: 6x2x2 (12 acc)
 * 0.67, 4x2x4 and 3x4x2 below 3x4x4. 3x4x4 and 4x2x2 tie within the noise; 3x4x4 kept (fewer
 * broadcasts per FMA: 7 loads per 12 FMAs against 6 per 8). */
#ifndef NX_A2_BR
#define NX_A2_BR 3
#endif
#ifndef NX_A2_NK
#define NX_A2_NK 4
#endif
#ifndef NX_A2_NV
#define NX_A2_NV 4
#endif
#define NX_A2_BC NX_ATTN_BF16_TILE /* keys per tile (the contract's) */
/* query rows sharing one pass over the K/V tiles, a multiple of NX_A2_BR */
#ifndef NX_A2_QB
#define NX_A2_QB 192
#endif
_Static_assert(NX_A2_QB % NX_A2_BR == 0, "whole micro-blocks per query block");
_Static_assert(NX_A2_BC % (8 * NX_A2_NK) == 0, "whole key chunks per tile");
_Static_assert(NX_A2_BR <= 8, "rows fit the alpha vector");

/* Causal: a row t runs the tiles b <= floor(t/64). A micro-block whose rows straddle a tile's
 * first key (some rows before it) runs that tile with those rows inactive: their state (m, l, O)
 * is neither read into the result nor written, so each row runs exactly the contract's tiles. */

/* MXCSR while a dot chain runs: DAZ (bit 6) and FTZ (bit 15) set, the rest the caller's. */
#define NX_A2_DAZ 0x0040u
#define NX_A2_FTZ 0x8000u

/* bf() of 8 floats (nx_bf16_round, nx_lowp.h), as float32 values: zero/subnormal -> the zero of
 * its sign; NaN -> quieted (bit 22 set), low 16 bits cleared; else round to nearest even on the
 * bit pattern (u + 0x7fff + bit 16, low 16 bits cleared; +-inf stays, overflow gives +-inf). */
static inline __m256 nx_a2_bf8(__m256 x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rne =
        _mm256_and_si256(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), hi);
    const __m256i qnan = _mm256_and_si256(_mm256_or_si256(u, _mm256_set1_epi32(0x00400000)), hi);
    const __m256i zero = _mm256_and_si256(u, _mm256_set1_epi32((int)0x80000000u));
    const __m256i isnan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                             _mm256_set1_epi32(0x7f800000));
    const __m256i issub = _mm256_cmpeq_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7f800000)),
                                             _mm256_setzero_si256());
    __m256i r = _mm256_blendv_epi8(rne, qnan, isnan);
    r = _mm256_blendv_epi8(r, zero, issub);
    return _mm256_castsi256_ps(r);
}

/* Lanes (2i, 2i+1) swapped: the order of a pair's two steps (odd element first). */
static inline __m256 nx_a2_swap_pairs(__m256 x) { return _mm256_permute_ps(x, 0xB1); }

/* kt[tile][i][64] (i < hd2): bf(k[j, i^1]) for keys [0, Tp) of one kv head (k rows hd apart). */
static void nx_a2_pack_k(const float *kg, int64_t T, int64_t hd, int64_t hd2, int64_t Tp,
                         float *kt) {
    for (int64_t j = 0; j < Tp; j++) {
        float *dst = kt + (j / NX_A2_BC) * hd2 * NX_A2_BC + j % NX_A2_BC;
        for (int64_t d = 0; d < hd2; d += 8) {
            float w[8];
            const __m256 x = j < T ? _mm256_maskload_ps(kg + j * hd + d, nx_mask8(hd - d))
                                   : _mm256_setzero_ps();
            _mm256_storeu_ps(w, nx_a2_swap_pairs(nx_a2_bf8(x)));
            for (int64_t i = 0; i < 8 && d + i < hd2; i++) dst[(d + i) * NX_A2_BC] = w[i];
        }
    }
}

/* vt[tile][i][hdp] (i < 64): bf(v[64 tile + (i^1), d]) for one kv head (v rows W apart). */
static void nx_a2_pack_v(const float *vg, int64_t W, int64_t T, int64_t hd, int64_t hdp,
                         int64_t Tp, float *vt) {
    for (int64_t i = 0; i < Tp; i++) {
        const int64_t j = i ^ 1; /* the key at position i */
        float *dst = vt + i * hdp;
        for (int64_t c = 0; c < hdp; c += 8) {
            const __m256 x = j < T ? _mm256_maskload_ps(vg + j * W + c, nx_mask8(hd - c))
                                   : _mm256_setzero_ps();
            _mm256_store_ps(dst + c, nx_a2_bf8(x));
        }
    }
}

/* qt[r][i] (rows hd2s floats apart): bf(q[r, i^1]) for rows [0, nq) (q rows hd floats apart). */
static void nx_a2_pack_q(const float *q, int64_t nq, int64_t hd, int64_t hd2s, float *qt) {
    for (int64_t r = 0; r < nq; r++)
        for (int64_t d = 0; d < hd2s; d += 8) {
            const __m256 x = _mm256_maskload_ps(q + r * hd + d, nx_mask8(hd - d));
            _mm256_store_ps(qt + r * hd2s + d, nx_a2_swap_pairs(nx_a2_bf8(x)));
        }
}

/* The contract's sum tree of one row's 64 rounded p (f[v] = keys 8v .. 8v+7): lanes L < 16 are
 * f[0..1]; a_L = ((p_L + p_{L+16}) + p_{L+32}) + p_{L+48}, then a_L + a_{L+8} (one ymm), then
 * nx_hsum8's (l + l+4), (l + l+2), (l0 + l1). */
static inline float nx_a2_tree(const __m256 f[8]) {
    const __m256 lo = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(f[0], f[2]), f[4]), f[6]);
    const __m256 hi = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(f[1], f[3]), f[5]), f[7]);
    return nx_hsum8(_mm256_add_ps(lo, hi));
}

/* Lanes of keys 8v .. 8v+7 allowed (bit 8v+L of bits): all-ones lanes. */
static inline __m256 nx_a2_lanes(uint64_t bits, int v) {
    const __m256i b = _mm256_set1_epi32((int)((bits >> (8 * v)) & 0xffu));
    const __m256i one = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    return _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(b, one), one));
}

/* The chains over the tile's 64 key positions (key i^1 at position i: odd key of each pair
 * first) for O[r, c : c + 8 nv], whose rows already hold O * alpha. nv <= NX_A2_NV. Run under
 * DAZ|FTZ. */
NX_INLINE void nx_a2_pv(const int nr, const int nv, const float *Pt, const float *vt, int64_t hdp,
                        int64_t c, float *O, unsigned act) {
    __m256 acc[NX_A2_BR][NX_A2_NV];
    for (int r = 0; r < nr; r++)
#pragma GCC unroll 4
        for (int v = 0; v < nv; v++) acc[r][v] = _mm256_load_ps(O + r * hdp + c + 8 * v);
    for (int i = 0; i < NX_A2_BC; i++) {
        const float *vr = vt + i * hdp + c;
        __m256 vv[NX_A2_NV];
#pragma GCC unroll 4
        for (int v = 0; v < nv; v++) vv[v] = _mm256_load_ps(vr + 8 * v);
        for (int r = 0; r < nr; r++) {
            const __m256 pb = _mm256_broadcast_ss(Pt + r * NX_A2_BC + i);
#pragma GCC unroll 4
            for (int v = 0; v < nv; v++) acc[r][v] = _mm256_fmadd_ps(pb, vv[v], acc[r][v]);
        }
    }
    for (int r = 0; r < nr; r++)
        if (act >> r & 1u)
#pragma GCC unroll 4
            for (int v = 0; v < nv; v++)
                _mm256_store_ps(O + r * hdp + c + 8 * v, acc[r][v]);
}

/* S[r][0:64] := the score chains of rows r < nr (qt + r*hd2s) against tile kt (hd2 x 64). Run
 * under DAZ|FTZ. */
NX_INLINE void nx_a2_qk(const int nr, const float *qt, int64_t hd2s, int64_t hd2, const float *kt,
                        float *S) {
    for (int k0 = 0; k0 < NX_A2_BC; k0 += 8 * NX_A2_NK) {
        __m256 acc[NX_A2_BR][NX_A2_NK];
        for (int r = 0; r < nr; r++)
            for (int v = 0; v < NX_A2_NK; v++) acc[r][v] = _mm256_setzero_ps();
        for (int64_t i = 0; i < hd2; i++) {
            const float *kp = kt + i * NX_A2_BC + k0;
            __m256 kk[NX_A2_NK];
            for (int v = 0; v < NX_A2_NK; v++) kk[v] = _mm256_load_ps(kp + 8 * v);
            for (int r = 0; r < nr; r++) {
                const __m256 b = _mm256_broadcast_ss(qt + r * hd2s + i);
                for (int v = 0; v < NX_A2_NK; v++) acc[r][v] = _mm256_fmadd_ps(b, kk[v], acc[r][v]);
            }
        }
        for (int r = 0; r < nr; r++)
            for (int v = 0; v < NX_A2_NK; v++)
                _mm256_store_ps(S + r * NX_A2_BC + k0 + 8 * v, acc[r][v]);
    }
}

/* One micro-block: rows r < nr (qt + r*hd2s), tile kt (hd2 x 64) / vt (64 x hdp), keys of the
 * tile allowed for row r: rmask[r]; running m, l, O (rows hdp floats apart), updated for the
 * rows r with bit r of act set (the others do not run this tile). csr: the caller's MXCSR. The
 * dot chains run with DAZ and FTZ set (the file comment); the softmax and O * alpha run
 * with the caller's MXCSR, as the spec's float32 operations do, but for a row's exponentials
 * (p = bf(E(x - m_use)) and its sum), which add FTZ: bf() flushes E's subnormal results
 * anyway, so the bits are the same, and no vector pays an underflow assist (Intel cores;
 * nx_attn_bf16.h). The compiler barriers keep every load, FMA and store of a chain between
 * its two MXCSR writes. */
NX_INLINE void nx_a2_micro(const int nr, const float *qt, int64_t hd2s, int64_t hd2,
                           const float *kt, const float *vt, const uint64_t *rmask, unsigned act,
                           float scale, float *m, float *l, float *O, int64_t hdp, unsigned csr) {
    float S[NX_A2_BR * NX_A2_BC] __attribute__((aligned(32)));
    float Pt[NX_A2_BR * NX_A2_BC] __attribute__((aligned(32)));
    const unsigned chain = csr | NX_A2_FTZ | NX_A2_DAZ;
    _mm_setcsr(chain);
    __asm__ volatile("" ::: "memory");
    nx_a2_qk(nr, qt, hd2s, hd2, kt, S);
    __asm__ volatile("" ::: "memory");
    _mm_setcsr(csr);
    __asm__ volatile("" ::: "memory");
    const __m256 sc = _mm256_set1_ps(scale), ninf = _mm256_set1_ps(-INFINITY);
    float sums[NX_A2_BR], mus[NX_A2_BR], dm[8] = {0};
    for (int r = 0; r < nr; r++) { /* x into S, the running max */
        __m256 x[8];
        for (int v = 0; v < 8; v++) {
            x[v] = _mm256_blendv_ps(ninf,
                                    _mm256_mul_ps(_mm256_load_ps(S + r * NX_A2_BC + 8 * v), sc),
                                    nx_a2_lanes(rmask[r], v));
            _mm256_store_ps(S + r * NX_A2_BC + 8 * v, x[v]);
        }
        const __m256 mx8 = _mm256_max_ps(
            _mm256_max_ps(_mm256_max_ps(x[0], x[1]), _mm256_max_ps(x[2], x[3])),
            _mm256_max_ps(_mm256_max_ps(x[4], x[5]), _mm256_max_ps(x[6], x[7])));
        const float mx = nx_hmax8(mx8);
        const float m_new = mx > m[r] ? mx : m[r];
        const float m_use = m_new == -INFINITY ? 0.0f : m_new; /* all excluded so far: p = 0 */
        dm[r] = m[r] - m_use;
        mus[r] = m_use;
        if (act >> r & 1u) m[r] = m_new;
    }
    __asm__ volatile("" ::: "memory");
    _mm_setcsr(csr | NX_A2_FTZ); /* the exponentials: E's underflows (above) */
    __asm__ volatile("" ::: "memory");
    for (int r = 0; r < nr; r++) {
        const __m256 mu = _mm256_set1_ps(mus[r]);
        __m256 f[8];
        for (int v = 0; v < 8; v++) {
            const __m256 x = _mm256_load_ps(S + r * NX_A2_BC + 8 * v);
            f[v] = nx_a2_bf8(nx_exp2_8(_mm256_sub_ps(x, mu)));
            _mm256_store_ps(Pt + r * NX_A2_BC + 8 * v, nx_a2_swap_pairs(f[v]));
        }
        sums[r] = nx_a2_tree(f);
    }
    __asm__ volatile("" ::: "memory");
    _mm_setcsr(csr);
    __asm__ volatile("" ::: "memory");
    float alpha[8] __attribute__((aligned(32)));
    _mm256_store_ps(alpha, nx_exp2_8(_mm256_loadu_ps(dm)));
    for (int r = 0; r < nr; r++)
        if (act >> r & 1u) {
            l[r] = l[r] * alpha[r] + sums[r];
            const __m256 a = _mm256_set1_ps(alpha[r]);
            float *o = O + r * hdp;
            for (int64_t c = 0; c < hdp; c += 8)
                _mm256_store_ps(o + c, _mm256_mul_ps(_mm256_load_ps(o + c), a));
        }
    __asm__ volatile("" ::: "memory");
    _mm_setcsr(chain);
    __asm__ volatile("" ::: "memory");
    int64_t c = 0;
    for (; c + 8 * NX_A2_NV <= hdp; c += 8 * NX_A2_NV)
        nx_a2_pv(nr, NX_A2_NV, Pt, vt, hdp, c, O, act);
    for (; c < hdp; c += 8) nx_a2_pv(nr, 1, Pt, vt, hdp, c, O, act);
    __asm__ volatile("" ::: "memory");
    _mm_setcsr(csr);
    __asm__ volatile("" ::: "memory");
}

static void nx_a2_micro_any(int nr, const float *qt, int64_t hd2s, int64_t hd2, const float *kt,
                            const float *vt, const uint64_t *rmask, unsigned act, float scale,
                            float *m, float *l, float *O, int64_t hdp, unsigned csr) {
#define NX_A2_CASE(n)                                                                              \
    case n: nx_a2_micro(n, qt, hd2s, hd2, kt, vt, rmask, act, scale, m, l, O, hdp, csr); break;
    switch (nr) { /* constant row counts: the accumulators stay in registers */
#if NX_A2_BR >= 6
        NX_A2_CASE(6)
        NX_A2_CASE(5)
#endif
#if NX_A2_BR >= 4
        NX_A2_CASE(4)
#endif
        NX_A2_CASE(3)
        NX_A2_CASE(2)
    default: nx_a2_micro(1, qt, hd2s, hd2, kt, vt, rmask, act, scale, m, l, O, hdp, csr); break;
    }
#undef NX_A2_CASE
}

int nx_attention_bf16_avx2(const float *q, const float *k, const float *qkv, const uint8_t *mask,
                           float *out, int64_t T, int64_t H, int64_t KVH, int64_t hd, float scale,
                           int64_t h0, int64_t h1, int64_t q0, int64_t q1, int causal) {
    const int64_t BC = NX_A2_BC, QB = NX_A2_QB;
    const int64_t W = (H + 2 * KVH) * hd, group = H / KVH, OW = H * hd;
    const int64_t ntiles = (T + BC - 1) / BC, Tp = ntiles * BC;
    const int64_t hd2 = (hd + 1) / 2 * 2, hd2s = (hd2 + 7) / 8 * 8, hdp = (hd + 7) / 8 * 8;
    const unsigned csr = _mm_getcsr();
    /* sizes in whole 64-byte lines (aligned_alloc wants a multiple of the alignment) */
    float *kt = aligned_alloc(64, (size_t)((Tp * hd2 * 4 + 63) / 64 * 64));
    float *vt = aligned_alloc(64, (size_t)((Tp * hdp * 4 + 63) / 64 * 64));
    float *qp = aligned_alloc(64, (size_t)((QB * hd2s * 4 + 63) / 64 * 64));
    float *O = aligned_alloc(64, (size_t)((QB * hdp * 4 + 63) / 64 * 64));
    uint64_t *tmask = malloc((size_t)ntiles * sizeof(uint64_t)); /* allowed keys per tile */
    float m[NX_A2_QB], l[NX_A2_QB];
    if (!kt || !vt || !qp || !O || !tmask) {
        free(kt);
        free(vt);
        free(qp);
        free(O);
        free(tmask);
        return -1;
    }
    nx_attn_tile_masks(mask, T, BC, ntiles, tmask);
    int64_t packed = -1;
    for (int64_t h = h0; h < h1; h++) {
        const int64_t g = h / group;
        if (g != packed) {
            nx_a2_pack_k(k + g * T * hd, T, hd, hd2, Tp, kt);
            nx_a2_pack_v(qkv + (H + KVH) * hd + g * hd, W, T, hd, hdp, Tp, vt);
            packed = g;
        }
        for (int64_t t0 = q0; t0 < q1; t0 += QB) { /* the query rows [q0, q1) */
            const int64_t nq = q1 - t0 < QB ? q1 - t0 : QB;
            nx_a2_pack_q(q + (h * T + t0) * hd, nq, hd, hd2s, qp);
            for (int64_t r = 0; r < nq; r++) {
                m[r] = -INFINITY;
                l[r] = 0.0f;
            }
            memset(O, 0, (size_t)(nq * hdp) * sizeof(float));
            for (int64_t b = 0; b < ntiles; b++) {
                const int64_t j0 = b * BC;
                if (causal && j0 > t0 + nq - 1) break; /* no row of the block runs this tile */
                for (int64_t r0 = 0; r0 < nq; r0 += NX_A2_BR) {
                    const int nr = (int)(nq - r0 < NX_A2_BR ? nq - r0 : NX_A2_BR);
                    const int64_t f = t0 + r0; /* first row */
                    if (causal && j0 > f + nr - 1) continue; /* the tile starts after every row */
                    uint64_t rmask[NX_A2_BR];
                    const unsigned act = nx_attn_row_masks(causal, j0, f, nr, tmask[b], rmask);
                    nx_a2_micro_any(nr, qp + r0 * hd2s, hd2s, hd2, kt + b * hd2 * BC,
                                    vt + b * BC * hdp, rmask, act, scale, m + r0, l + r0,
                                    O + r0 * hdp, hdp, csr);
                }
            }
            for (int64_t r = 0; r < nq; r++)
                nx_attn_out_row(out + (t0 + r) * OW + h * hd, O + r * hdp, l[r], hd);
        }
    }
    free(kt);
    free(vt);
    free(qp);
    free(O);
    free(tmask);
    return 0;
}

const nx_attn_bf16_table nx_attn_bf16_table_avx2 = {.attention_bf16 = nx_attention_bf16_avx2};
