/* nx_attn_bf16_avx512bf16.c -- the `bf16` attention (nx_attn_bf16.h) on AVX-512 BF16: Q K^T and
 * P V on vdpbf16ps, the online softmax on 16 float32 lanes; exports the avx512bf16 table of the
 * "attn_bf16" family.
 *
 * Owns: the packed bfloat16 layouts, the tiled driver and the 6-row x 64-key micro-block. Per kv
 * head, K is packed once as pair-dwords kt[tile][p][64 keys] (bf(k[j,2p]) low half, bf(k[j,2p+1])
 * high) and V as vt[tile][i][hdp] (bf(v[2i,d]) low, bf(v[2i+1,d]) high; hdp = hd rounded up to
 * 16, keys >= T and d >= hd zero); per query block Q as qp[row][p]. For each query block of <= QB
 * rows and each key tile, micro-blocks of <= 6 rows run: S = Q K^T (6 x 4 zmm accumulators, one
 * vdpbf16ps chain per score over the d-pairs in order), the online softmax in registers (E =
 * nx_exp16, the contract's tree sum of the rounded p), then O = O * alpha + P V (per 64 columns:
 * 6 x 4 zmm, the chain over the tile's 32 key pairs in order). The order of every operation is
 * the contract's, lane for lane, so the generic spec's bits come out.
 * Entered only after the probe reports AVX-512 (F/BW/VL/DQ), AVX512_BF16 and OS ZMM support.
 * Must not: change the contract's order, allocate per tile, or use threads.
 */
#include "nx_attn_bf16.h"
#include "nx_vmath_avx512.h" /* nx_exp16, nx_mask16 */

#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

/* Rows per micro-block: 6 (24 zmm accumulators). 4 rows measured the same (89.6 vs 89.7 GFLOP/s,
 * process time, T=1024 hd=128 H=2, Intel Xeon family 6 model 167): here vdpbf16ps zmm retires one
 * per ~2 cycles with ~8 cycles latency, so 4 chains already keep it busy; 6 passes fewer times
 * over each K/V tile. */
#define NX_AB_BR 6
#define NX_AB_BC NX_ATTN_BF16_TILE /* keys per tile (the contract's) */
/* query rows sharing one pass over the K/V tiles, a multiple of NX_AB_BR */
#ifndef NX_AB_QB
#define NX_AB_QB 192
#endif
_Static_assert(NX_AB_QB % NX_AB_BR == 0, "whole micro-blocks per query block");

/* Causal: a row t runs the tiles b <= floor(t/64). A micro-block whose rows straddle a tile's
 * first key (some rows before it) runs that tile with those rows inactive: their state (m, l, O)
 * is neither read into the result nor written, so each row runs exactly the contract's tiles. */

/* bf() of 32 floats as 16 pair-dwords: dword i = bf(x[2i]) | bf(x[2i+1]) << 16. */
static inline __m512i nx_ab_pairs32(__m512 lo, __m512 hi) {
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

/* kt[tile][p][64] for keys [0, Tp) of one kv head (k rows hd floats apart). */
static void nx_ab_pack_k(const float *kg, int64_t T, int64_t hd, int64_t P2, int64_t Tp,
                         uint32_t *kt) {
    for (int64_t j = 0; j < Tp; j++) {
        uint32_t *dst = kt + (j / NX_AB_BC) * P2 * NX_AB_BC + j % NX_AB_BC;
        for (int64_t p0 = 0; p0 < P2; p0 += 16) {
            uint32_t w[16];
            if (j < T) {
                const int64_t d = 2 * p0;
                const float *src = kg + j * hd + d;
                __m512i v = nx_ab_pairs32(_mm512_maskz_loadu_ps(nx_mask16(hd - d), src),
                                          _mm512_maskz_loadu_ps(nx_mask16(hd - d - 16), src + 16));
                _mm512_storeu_si512((__m512i *)w, v);
            } else {
                memset(w, 0, sizeof w);
            }
            for (int64_t i = 0; i < 16 && p0 + i < P2; i++) dst[(p0 + i) * NX_AB_BC] = w[i];
        }
    }
}

/* vt[tile][i][hdp] for keys [0, Tp) of one kv head (v rows W floats apart). */
static void nx_ab_pack_v(const float *vg, int64_t W, int64_t T, int64_t hd, int64_t hdp,
                         int64_t Tp, uint32_t *vt) {
    for (int64_t j = 0; j < Tp; j += 2) {
        uint32_t *dst = vt + (j / 2) * hdp; /* tile-major = pair-major: 32 pairs per tile */
        for (int64_t c = 0; c < hdp; c += 16) {
            const __mmask16 mk = nx_mask16(hd - c);
            const __m512 lo = j < T ? _mm512_maskz_loadu_ps(mk, vg + j * W + c) : _mm512_setzero_ps();
            const __m512 hi =
                j + 1 < T ? _mm512_maskz_loadu_ps(mk, vg + (j + 1) * W + c) : _mm512_setzero_ps();
            const __m512i bl = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(lo));
            const __m512i bh = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(hi));
            _mm512_storeu_si512((__m512i *)(dst + c), _mm512_or_si512(bl, _mm512_slli_epi32(bh, 16)));
        }
    }
}

/* qp[r][p] (rows P2s dwords apart) for rows [0, nq) of q (rows hd floats apart). */
static void nx_ab_pack_q(const float *q, int64_t nq, int64_t hd, int64_t P2s, uint32_t *qp) {
    for (int64_t r = 0; r < nq; r++)
        for (int64_t p0 = 0; p0 < P2s; p0 += 16) {
            const int64_t d = 2 * p0;
            const float *src = q + r * hd + d;
            __m512i v = nx_ab_pairs32(_mm512_maskz_loadu_ps(nx_mask16(hd - d), src),
                                      _mm512_maskz_loadu_ps(nx_mask16(hd - d - 16), src + 16));
            _mm512_storeu_si512((__m512i *)(qp + r * P2s + p0), v);
        }
}

/* The contract's sum tree of one row's 64 rounded p (f0..f3 = keys 0-15, 16-31, 32-47, 48-63). */
static inline float nx_ab_tree(__m512 f0, __m512 f1, __m512 f2, __m512 f3) {
    const __m512 a = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(f0, f1), f2), f3);
    const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

/* bf() of 16 floats: the pair words (16 x 16 bits) and their float32 values. */
static inline __m256i nx_ab_round16(__m512 p, __m512 *val) {
    const __m256i b = (__m256i)_mm512_cvtneps_pbh(p);
    *val = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
    return b;
}

static inline uint64_t nx_ab_low_bits(int64_t n) { /* keys [0, n) of a tile */
    return n >= 64 ? ~(uint64_t)0 : n <= 0 ? 0 : (((uint64_t)1 << n) - 1);
}

/* O[r, c : c + 16 nv] = O * alpha[r], then the chain over the tile's 32 key pairs (nv in {1, 4}). */
NX_INLINE void nx_ab_pv(const int nr, const int nv, const uint32_t *Pp, const float *alpha,
                        const uint32_t *vt, int64_t hdp, int64_t c, float *O, unsigned act) {
    __m512 acc[NX_AB_BR][4];
    for (int r = 0; r < nr; r++) {
        const __m512 a = _mm512_set1_ps(alpha[r]);
#pragma GCC unroll 4
        for (int v = 0; v < nv; v++)
            acc[r][v] = _mm512_mul_ps(_mm512_load_ps(O + r * hdp + c + 16 * v), a);
    }
    for (int i = 0; i < NX_AB_BC / 2; i++) {
        const uint32_t *vr = vt + i * hdp + c;
        __m512bh vv[4];
#pragma GCC unroll 4
        for (int v = 0; v < nv; v++) vv[v] = (__m512bh)_mm512_loadu_si512((const void *)(vr + 16 * v));
        for (int r = 0; r < nr; r++) {
            const __m512bh pb = (__m512bh)_mm512_set1_epi32((int)Pp[r * 32 + i]);
#pragma GCC unroll 4
            for (int v = 0; v < nv; v++) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], vv[v], pb);
        }
    }
    for (int r = 0; r < nr; r++)
        if (act >> r & 1u)
#pragma GCC unroll 4
            for (int v = 0; v < nv; v++) _mm512_store_ps(O + r * hdp + c + 16 * v, acc[r][v]);
}

/* One micro-block: rows r < nr (pair-dwords qp + r*P2s), tile kt (P2 x 64 dwords) / vt, keys of
 * the tile allowed for row r: rmask[r]; running m, l, O (rows hdp floats apart), updated for the
 * rows r with bit r of act set (the others do not run this tile). */
NX_INLINE void nx_ab_micro(const int nr, const uint32_t *qp, int64_t P2s, int64_t P2,
                           const uint32_t *kt, const uint32_t *vt, const uint64_t *rmask,
                           unsigned act, float scale, float *m, float *l, float *O, int64_t hdp) {
    __m512 acc[NX_AB_BR][4];
    for (int r = 0; r < nr; r++)
        for (int v = 0; v < 4; v++) acc[r][v] = _mm512_setzero_ps();
    for (int64_t p = 0; p < P2; p++) {
        const uint32_t *kp = kt + p * NX_AB_BC;
        const __m512bh k0 = (__m512bh)_mm512_load_si512((const void *)kp);
        const __m512bh k1 = (__m512bh)_mm512_load_si512((const void *)(kp + 16));
        const __m512bh k2 = (__m512bh)_mm512_load_si512((const void *)(kp + 32));
        const __m512bh k3 = (__m512bh)_mm512_load_si512((const void *)(kp + 48));
        for (int r = 0; r < nr; r++) {
            const __m512bh b = (__m512bh)_mm512_set1_epi32((int)qp[r * P2s + p]);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], k0, b);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], k1, b);
            acc[r][2] = _mm512_dpbf16_ps(acc[r][2], k2, b);
            acc[r][3] = _mm512_dpbf16_ps(acc[r][3], k3, b);
        }
    }
    const __m512 sc = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
    uint32_t Pp[NX_AB_BR * 32] __attribute__((aligned(64)));
    float sums[NX_AB_BR], dm[16] = {0};
    for (int r = 0; r < nr; r++) {
        __m512 x[4];
        for (int v = 0; v < 4; v++)
            x[v] = _mm512_mask_mov_ps(ninf, (__mmask16)(rmask[r] >> (16 * v)),
                                      _mm512_mul_ps(acc[r][v], sc));
        const float mx =
            _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(x[0], x[1]), _mm512_max_ps(x[2], x[3])));
        const float m_new = mx > m[r] ? mx : m[r];
        const float m_use = m_new == -INFINITY ? 0.0f : m_new; /* all excluded so far: p = 0 */
        dm[r] = m[r] - m_use;
        if (act >> r & 1u) m[r] = m_new;
        const __m512 mu = _mm512_set1_ps(m_use);
        __m512 f[4];
        __m256i b[4];
        for (int v = 0; v < 4; v++) b[v] = nx_ab_round16(nx_exp16(_mm512_sub_ps(x[v], mu)), &f[v]);
        _mm512_store_si512((__m512i *)(Pp + r * 32),
                           _mm512_inserti64x4(_mm512_castsi256_si512(b[0]), b[1], 1));
        _mm512_store_si512((__m512i *)(Pp + r * 32 + 16),
                           _mm512_inserti64x4(_mm512_castsi256_si512(b[2]), b[3], 1));
        sums[r] = nx_ab_tree(f[0], f[1], f[2], f[3]);
    }
    float alpha[16] __attribute__((aligned(64)));
    _mm512_store_ps(alpha, nx_exp16(_mm512_loadu_ps(dm)));
    for (int r = 0; r < nr; r++)
        if (act >> r & 1u) l[r] = l[r] * alpha[r] + sums[r];
    int64_t c = 0;
    for (; c + 64 <= hdp; c += 64) nx_ab_pv(nr, 4, Pp, alpha, vt, hdp, c, O, act);
    for (; c < hdp; c += 16) nx_ab_pv(nr, 1, Pp, alpha, vt, hdp, c, O, act);
}

static void nx_ab_micro_any(int nr, const uint32_t *qp, int64_t P2s, int64_t P2,
                            const uint32_t *kt, const uint32_t *vt, const uint64_t *rmask,
                            unsigned act, float scale, float *m, float *l, float *O, int64_t hdp) {
#define NX_AB_CASE(n)                                                                              \
    case n: nx_ab_micro(n, qp, P2s, P2, kt, vt, rmask, act, scale, m, l, O, hdp); break;
    switch (nr) { /* constant row counts: the accumulators stay in registers */
        NX_AB_CASE(6)
        NX_AB_CASE(5)
        NX_AB_CASE(4)
        NX_AB_CASE(3)
        NX_AB_CASE(2)
    default: nx_ab_micro(1, qp, P2s, P2, kt, vt, rmask, act, scale, m, l, O, hdp); break;
    }
#undef NX_AB_CASE
}

int nx_attention_bf16_avx512bf16(const float *q, const float *k, const float *qkv,
                                 const uint8_t *mask, float *out, int64_t T, int64_t H,
                                 int64_t KVH, int64_t hd, float scale, int64_t h0, int64_t h1,
                                 int causal) {
    const int64_t BC = NX_AB_BC, QB = NX_AB_QB;
    const int64_t W = (H + 2 * KVH) * hd, group = H / KVH, OW = H * hd;
    const int64_t ntiles = (T + BC - 1) / BC, Tp = ntiles * BC;
    const int64_t P2 = (hd + 1) / 2, P2s = (P2 + 15) / 16 * 16, hdp = (hd + 15) / 16 * 16;
    /* sizes in whole 64-byte lines (aligned_alloc wants a multiple of the alignment) */
    uint32_t *kt = aligned_alloc(64, (size_t)((Tp * P2 * 4 + 63) / 64 * 64));
    uint32_t *vt = aligned_alloc(64, (size_t)((Tp / 2 * hdp * 4 + 63) / 64 * 64));
    uint32_t *qp = aligned_alloc(64, (size_t)(QB * P2s * 4));
    float *O = aligned_alloc(64, (size_t)(QB * hdp * 4));
    uint64_t *tmask = malloc((size_t)ntiles * sizeof(uint64_t)); /* allowed keys per tile */
    float m[NX_AB_QB], l[NX_AB_QB];
    if (!kt || !vt || !qp || !O || !tmask) {
        free(kt);
        free(vt);
        free(qp);
        free(O);
        free(tmask);
        return -1;
    }
    for (int64_t b = 0; b < ntiles; b++) {
        uint64_t bits = 0;
        for (int64_t jj = 0; jj < BC; jj++) {
            const int64_t j = b * BC + jj;
            if (j < T && (!mask || mask[j])) bits |= (uint64_t)1 << jj;
        }
        tmask[b] = bits;
    }
    int64_t packed = -1;
    for (int64_t h = h0; h < h1; h++) {
        const int64_t g = h / group;
        if (g != packed) {
            nx_ab_pack_k(k + g * T * hd, T, hd, P2, Tp, kt);
            nx_ab_pack_v(qkv + (H + KVH) * hd + g * hd, W, T, hd, hdp, Tp, vt);
            packed = g;
        }
        for (int64_t t0 = 0; t0 < T; t0 += QB) {
            const int64_t nq = T - t0 < QB ? T - t0 : QB;
            nx_ab_pack_q(q + (h * T + t0) * hd, nq, hd, P2s, qp);
            for (int64_t r = 0; r < nq; r++) {
                m[r] = -INFINITY;
                l[r] = 0.0f;
            }
            memset(O, 0, (size_t)(nq * hdp) * sizeof(float));
            for (int64_t b = 0; b < ntiles; b++) {
                const int64_t j0 = b * BC;
                if (causal && j0 > t0 + nq - 1) break; /* no row of the block runs this tile */
                for (int64_t r0 = 0; r0 < nq; r0 += NX_AB_BR) {
                    const int nr = (int)(nq - r0 < NX_AB_BR ? nq - r0 : NX_AB_BR);
                    const int64_t f = t0 + r0; /* first row */
                    uint64_t rmask[NX_AB_BR];
                    unsigned act = (1u << nr) - 1u;
                    if (causal && j0 > f + nr - 1) continue; /* the tile starts after every row */
                    for (int r = 0; r < nr; r++) {
                        const int run = !causal || j0 <= f + r; /* row f+r runs tile b */
                        if (!run) act &= ~(1u << r);
                        rmask[r] = !run ? 0 : causal ? tmask[b] & nx_ab_low_bits(f + r - j0 + 1)
                                                     : tmask[b];
                    }
                    nx_ab_micro_any(nr, qp + r0 * P2s, P2s, P2, kt + b * P2 * BC,
                                    vt + b * (BC / 2) * hdp, rmask, act, scale, m + r0, l + r0,
                                    O + r0 * hdp, hdp);
                }
            }
            for (int64_t r = 0; r < nq; r++) {
                float *o = out + (t0 + r) * OW + h * hd;
                const float *src = O + r * hdp;
                if (l[r] == 0.0f) {
                    for (int64_t d = 0; d < hd; d++) o[d] = 0.0f;
                } else {
                    const float inv = 1.0f / l[r];
                    for (int64_t d = 0; d < hd; d++) o[d] = src[d] * inv;
                }
            }
        }
    }
    free(kt);
    free(vt);
    free(qp);
    free(O);
    free(tmask);
    return 0;
}

const nx_attn_bf16_table nx_attn_bf16_table_avx512bf16 = {.attention_bf16 =
                                                              nx_attention_bf16_avx512bf16};
