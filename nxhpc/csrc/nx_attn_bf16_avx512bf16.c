/* nx_attn_bf16_avx512bf16.c -- the `bf16` attention (nx_attn_bf16.h) on AVX-512 BF16; exports
 * the avx512bf16 table of the "attn_bf16" family.
 *
 * Owns: the packed layouts, the tiled driver and the 6-row x 64-key micro-block, on either
 * dot. Rounding is VCVTNEPS2BF16 (bf() by definition). The FMA dot's steps are vfmadd231ps on
 * bfloat16-valued float32 operands with MXCSR DAZ|FTZ set around each chain: then every FMA is
 * exactly the contract's step(acc, a, b) = ftz(fma(daz(a), daz(b), daz(acc))) (nx_lowp.h: ftz
 * is x86's, tininess after rounding to 24 bits with an unbounded exponent; on this project's
 * Intel Xeon (family 6 model 167) 4.8e7 random and underflow-range steps matched the scalar
 * spec, 2.1e4 in the interval (2^-126 - 2^-150, 2^-126 - 2^-151) where flushing a
 * gradual-underflow fmaf would differ: benchmarks/probes/bf16_fma_ftz.c;
 * tests/test_kernels_attn_bf16.py checks the kernel bit for bit in the underflow range and in
 * that interval). A pair's two steps are two FMAs,
 * odd element first: K and Q are packed with the two elements of each d-pair swapped, V with
 * the two keys of each pair swapped.
 * The other dot, vdpbf16ps (NX_AB_DOT_DP, nx_attn_bf16_dot: chosen once per process by the
 * peak loops' rates), runs the same micro-block and driver on pair-dword layouts (dp = 1): one
 * instruction is a pair's two steps, so its bits are the same. On this project's Intel Xeon
 * (family 6 model 167) vdpbf16ps retires one per ~2 cycles (16 bf16 MACs/cycle) against two
 * vfmadd231ps per cycle (32 MACs/cycle): the FMA dot ran 8.97 ms against 11.47 (T=1024, hd=128,
 * 2 heads, process time); on AMD Zen 4 vdpbf16ps has twice the FMA's rate.
 * Layouts, per kv head, once: kt[tile][i][64 keys] = bf(k[j, i^1]) (i < hd2 = hd rounded up to
 * even), vt[tile][i][hdp] = bf(v[64 tile + (i^1), d]) (hdp = hd rounded up to 16; keys >= T and
 * d >= hd zero); per query block qt[row][i] = bf(q[row, i^1]). For each query block of <= QB
 * rows and each key tile, micro-blocks of <= 6 rows run: S = Q K^T (6 x 4 zmm accumulators, one
 * chain per score over i), the online softmax (E = nx_exp2_16, the contract's tree sum of the
 * rounded p, with the caller's MXCSR), then O = O * alpha + P V (per 64 columns: 6 x 4 zmm, one
 * chain per output over the tile's 64 key positions). The order of every operation is the
 * contract's, lane for lane, so the generic spec's bits come out.
 * Entered only after the probe reports AVX-512 (F/BW/VL/DQ), AVX512_BF16 and OS ZMM support.
 * Must not: change the contract's order, allocate per tile, use threads, or return with MXCSR
 * changed.
 */
#include "nx_attn_bf16.h"
#include "nx_vmath_avx512.h" /* nx_exp2_16, nx_mask16 */

#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

/* Rows per micro-block: 6 x 4 zmm = 24 accumulators, the float32 kernel's shape (nx_ops_avx512.c);
 * FMA's ~4-cycle latency at two per cycle needs >= 8 independent chains. */
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

/* MXCSR while a dot chain runs: DAZ (bit 6) and FTZ (bit 15) on top of the caller's bits. */
#define NX_AB_DAZ_FTZ 0x8040u

/* bf() of 16 floats, as float32 values. */
static inline __m512 nx_ab_bf16(__m512 x) {
    const __m256i b = (__m256i)_mm512_cvtneps_pbh(x);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

/* Lanes (2i, 2i+1) swapped: the order of a pair's two steps (odd element first). */
static inline __m512 nx_ab_swap_pairs(__m512 x) { return _mm512_permute_ps(x, 0xB1); }

/* vt[tile][i][hdp] (i < 64): bf(v[64 tile + (i^1), d]) for one kv head (v rows W apart). */
static void nx_ab_pack_v(const float *vg, int64_t W, int64_t T, int64_t hd, int64_t hdp,
                         int64_t Tp, float *vt) {
    for (int64_t i = 0; i < Tp; i++) {
        const int64_t j = i ^ 1; /* the key at position i */
        float *dst = vt + i * hdp;
        for (int64_t c = 0; c < hdp; c += 16) {
            const __m512 x = j < T ? _mm512_maskz_loadu_ps(nx_mask16(hd - c), vg + j * W + c)
                                   : _mm512_setzero_ps();
            _mm512_store_ps(dst + c, nx_ab_bf16(x));
        }
    }
}

/* qt[r][i] (rows hd2s floats apart): bf(q[r, i^1]) for rows [0, nq) (q rows hd floats apart). */
static void nx_ab_pack_q(const float *q, int64_t nq, int64_t hd, int64_t hd2s, float *qt) {
    for (int64_t r = 0; r < nq; r++)
        for (int64_t d = 0; d < hd2s; d += 16) {
            const __m512 x = _mm512_maskz_loadu_ps(nx_mask16(hd - d), q + r * hd + d);
            _mm512_store_ps(qt + r * hd2s + d, nx_ab_swap_pairs(nx_ab_bf16(x)));
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

/* ---- the vdpbf16ps dot (NX_AB_DOT_DP): one instruction per pair is the contract's two steps
 * (DAZ, FTZ, odd element first, MXCSR not consulted), so the layouts are pair-dwords (dword =
 * bf(element 2i) | bf(element 2i+1) << 16, no swap) and no MXCSR switch is needed. Half the
 * instructions of the FMA dot at twice the multiply-adds per instruction. */

/* bf() of 32 floats as 16 pair-dwords: dword i = bf(x[2i]) | bf(x[2i+1]) << 16. */
static inline __m512i nx_abd_pairs32(__m512 lo, __m512 hi) {
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

/* K for keys [0, Tp) of one kv head (k rows hd floats apart), as 32-bit words kt[tile][i][64]:
 * dp = 0, i < hd2: bf(k[j, i^1]) (floats, pairs swapped); dp = 1, i < hd2 / 2: the pair-dword
 * bf(k[j, 2i]) | bf(k[j, 2i+1]) << 16. Keys >= T and d >= hd zero. */
static void nx_ab_pack_k(const int dp, const float *kg, int64_t T, int64_t hd, int64_t hd2,
                         int64_t Tp, uint32_t *kt) {
    const int64_t n = dp ? hd2 / 2 : hd2; /* words per key */
    for (int64_t j = 0; j < Tp; j++) {
        uint32_t *dst = kt + (j / NX_AB_BC) * n * NX_AB_BC + j % NX_AB_BC;
        for (int64_t i0 = 0; i0 < n; i0 += 16) {
            uint32_t w[16];
            const int64_t d = dp ? 2 * i0 : i0;
            const float *src = kg + j * hd + d;
            __m512i v = _mm512_setzero_si512();
            if (j < T && dp)
                v = nx_abd_pairs32(_mm512_maskz_loadu_ps(nx_mask16(hd - d), src),
                                   _mm512_maskz_loadu_ps(nx_mask16(hd - d - 16), src + 16));
            else if (j < T)
                v = _mm512_castps_si512(nx_ab_swap_pairs(
                    nx_ab_bf16(_mm512_maskz_loadu_ps(nx_mask16(hd - d), src))));
            _mm512_storeu_si512((__m512i *)w, v);
            for (int64_t i = 0; i < 16 && i0 + i < n; i++) dst[(i0 + i) * NX_AB_BC] = w[i];
        }
    }
}

/* vt[i][hdp] (i < Tp / 2, 32 pairs a tile): bf(v[2i, d]) | bf(v[2i+1, d]) << 16 for one kv head
 * (v rows W floats apart; keys >= T and d >= hd zero). */
static void nx_abd_pack_v(const float *vg, int64_t W, int64_t T, int64_t hd, int64_t hdp,
                          int64_t Tp, uint32_t *vt) {
    for (int64_t j = 0; j < Tp; j += 2) {
        uint32_t *dst = vt + (j / 2) * hdp;
        for (int64_t c = 0; c < hdp; c += 16) {
            const __mmask16 mk = nx_mask16(hd - c);
            const __m512 lo = j < T ? _mm512_maskz_loadu_ps(mk, vg + j * W + c)
                                    : _mm512_setzero_ps();
            const __m512 hi = j + 1 < T ? _mm512_maskz_loadu_ps(mk, vg + (j + 1) * W + c)
                                        : _mm512_setzero_ps();
            const __m512i bl = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(lo));
            const __m512i bh = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(hi));
            _mm512_store_si512((__m512i *)(dst + c),
                               _mm512_or_si512(bl, _mm512_slli_epi32(bh, 16)));
        }
    }
}

/* qp[r][p] (rows P2s dwords apart; dwords p < P2 written) for rows [0, nq) of q (rows hd floats
 * apart). */
static void nx_abd_pack_q(const float *q, int64_t nq, int64_t hd, int64_t P2, int64_t P2s,
                          uint32_t *qp) {
    for (int64_t r = 0; r < nq; r++)
        for (int64_t p0 = 0; p0 < P2; p0 += 16) {
            const int64_t d = 2 * p0;
            const float *src = q + r * hd + d;
            const __m512i v =
                nx_abd_pairs32(_mm512_maskz_loadu_ps(nx_mask16(hd - d), src),
                               _mm512_maskz_loadu_ps(nx_mask16(hd - d - 16), src + 16));
            _mm512_mask_storeu_epi32(qp + r * P2s + p0, nx_mask16(P2 - p0), v);
        }
}

/* S[r][0:64] := the score chains of rows r < nr against tile kt. dp = 0: rows qt + r*hd2s
 * floats, kt hd2 x 64 floats, one vfmadd231ps a step (run under DAZ|FTZ); dp = 1: rows qt +
 * r*(hd2s/2) pair-dwords, kt hd2/2 x 64 pair-dwords, one vdpbf16ps a pair. */
NX_INLINE void nx_ab_qk(const int dp, const int nr, const void *qt, int64_t hd2s, int64_t hd2,
                        const void *kt, float *S) {
    __m512 acc[NX_AB_BR][4];
    for (int r = 0; r < nr; r++)
        for (int v = 0; v < 4; v++) acc[r][v] = _mm512_setzero_ps();
    if (dp) {
        const uint32_t *qp = (const uint32_t *)qt, *kp0 = (const uint32_t *)kt;
        for (int64_t p = 0; p < hd2 / 2; p++) {
            const uint32_t *kp = kp0 + p * NX_AB_BC;
            __m512bh k[4];
            for (int v = 0; v < 4; v++)
                k[v] = (__m512bh)_mm512_load_si512((const void *)(kp + 16 * v));
            for (int r = 0; r < nr; r++) {
                const __m512bh b = (__m512bh)_mm512_set1_epi32((int)qp[r * (hd2s / 2) + p]);
                for (int v = 0; v < 4; v++) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], k[v], b);
            }
        }
    } else {
        const float *qf = (const float *)qt, *kf = (const float *)kt;
        for (int64_t i = 0; i < hd2; i++) {
            const float *kp = kf + i * NX_AB_BC;
            __m512 k[4];
            for (int v = 0; v < 4; v++) k[v] = _mm512_load_ps(kp + 16 * v);
            for (int r = 0; r < nr; r++) {
                const __m512 b = _mm512_set1_ps(qf[r * hd2s + i]);
                for (int v = 0; v < 4; v++) acc[r][v] = _mm512_fmadd_ps(b, k[v], acc[r][v]);
            }
        }
    }
    for (int r = 0; r < nr; r++)
        for (int v = 0; v < 4; v++) _mm512_store_ps(S + r * NX_AB_BC + 16 * v, acc[r][v]);
}

/* O[r, c : c + 16 nv] = O * alpha[r], then the chain over the tile's keys; nv in {1, 4}.
 * dp = 0: Pt[r][i] = p of the key at position i (key i^1: odd key of each pair first), vt 64 x
 * hdp floats, one vfmadd231ps a step (run under DAZ|FTZ); dp = 1: Pt[r][i] = p_2i | p_2i+1 << 16
 * (rows 32 dwords apart), vt 32 x hdp pair-dwords, one vdpbf16ps a pair, under the caller's
 * MXCSR (a subnormal O * alpha is then not flushed, but vdpbf16ps reads it as the zero the FMA
 * dot's FTZ gives). */
NX_INLINE void nx_ab_pv(const int dp, const int nr, const int nv, const void *Pt,
                        const float *alpha, const void *vt, int64_t hdp, int64_t c, float *O,
                        unsigned act) {
    __m512 acc[NX_AB_BR][4];
    for (int r = 0; r < nr; r++) {
        const __m512 a = _mm512_set1_ps(alpha[r]);
#pragma GCC unroll 4
        for (int v = 0; v < nv; v++)
            acc[r][v] = _mm512_mul_ps(_mm512_load_ps(O + r * hdp + c + 16 * v), a);
    }
    if (dp) {
        const uint32_t *Pp = (const uint32_t *)Pt, *vp = (const uint32_t *)vt;
        for (int i = 0; i < NX_AB_BC / 2; i++) {
            __m512bh vv[4];
#pragma GCC unroll 4
            for (int v = 0; v < nv; v++)
                vv[v] = (__m512bh)_mm512_load_si512((const void *)(vp + i * hdp + c + 16 * v));
            for (int r = 0; r < nr; r++) {
                const __m512bh pb = (__m512bh)_mm512_set1_epi32((int)Pp[r * (NX_AB_BC / 2) + i]);
#pragma GCC unroll 4
                for (int v = 0; v < nv; v++) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], vv[v], pb);
            }
        }
    } else {
        const float *Pf = (const float *)Pt, *vf = (const float *)vt;
        for (int i = 0; i < NX_AB_BC; i++) {
            __m512 vv[4];
#pragma GCC unroll 4
            for (int v = 0; v < nv; v++) vv[v] = _mm512_load_ps(vf + i * hdp + c + 16 * v);
            for (int r = 0; r < nr; r++) {
                const __m512 pb = _mm512_set1_ps(Pf[r * NX_AB_BC + i]);
#pragma GCC unroll 4
                for (int v = 0; v < nv; v++) acc[r][v] = _mm512_fmadd_ps(pb, vv[v], acc[r][v]);
            }
        }
    }
    for (int r = 0; r < nr; r++)
        if (act >> r & 1u)
#pragma GCC unroll 4
            for (int v = 0; v < nv; v++) _mm512_store_ps(O + r * hdp + c + 16 * v, acc[r][v]);
}

/* One micro-block: rows r < nr, tile b's keys and values, keys of the tile allowed for row r:
 * rmask[r]; running m, l, O (rows hdp floats apart), updated for the rows r with bit r of act
 * set (the others do not run this tile). csr: the caller's MXCSR. dp = 0: qt + r*hd2s floats,
 * kt (hd2 x 64 floats), vt (64 x hdp floats), the dot chains under DAZ|FTZ so that each
 * vfmadd231ps is the contract's step, the softmax in between with the caller's MXCSR, as the
 * spec's float32 operations are (the compiler barriers keep every load, FMA and store of a chain
 * between its two MXCSR writes). dp = 1: the pair-dword layouts (qt + r*hd2s/2 dwords, kt
 * (hd2/2 x 64), vt (32 x hdp)), every operation under the caller's MXCSR. Either way a row's
 * exponentials (p = bf(E(x - m_use)) and its sum) run with FTZ added: bf() flushes E's
 * subnormal results anyway, so the bits are the same, and no vector pays an underflow assist
 * (Intel cores; nx_attn_bf16.h). */
NX_INLINE void nx_ab_micro(const int dp, const int nr, const void *qt, int64_t hd2s, int64_t hd2,
                           const void *kt, const void *vt, const uint64_t *rmask, unsigned act,
                           float scale, float *m, float *l, float *O, int64_t hdp, unsigned csr) {
    float S[NX_AB_BR * NX_AB_BC] __attribute__((aligned(64)));
    float Pt[NX_AB_BR * NX_AB_BC] __attribute__((aligned(64)));     /* P, pairs swapped */
    uint32_t Pp[NX_AB_BR * NX_AB_BC / 2] __attribute__((aligned(64))); /* dp: P's pair-dwords */
    if (dp) {
        nx_ab_qk(1, nr, qt, hd2s, hd2, kt, S);
    } else {
        _mm_setcsr(csr | NX_AB_DAZ_FTZ);
        __asm__ volatile("" ::: "memory");
        nx_ab_qk(0, nr, qt, hd2s, hd2, kt, S);
        __asm__ volatile("" ::: "memory");
        _mm_setcsr(csr);
        __asm__ volatile("" ::: "memory");
    }
    const __m512 sc = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
    float sums[NX_AB_BR], mus[NX_AB_BR], dm[16] = {0};
    for (int r = 0; r < nr; r++) { /* x into S, the running max */
        __m512 x[4];
        for (int v = 0; v < 4; v++) {
            x[v] = _mm512_mask_mov_ps(ninf, (__mmask16)(rmask[r] >> (16 * v)),
                                      _mm512_mul_ps(_mm512_load_ps(S + r * NX_AB_BC + 16 * v), sc));
            _mm512_store_ps(S + r * NX_AB_BC + 16 * v, x[v]);
        }
        const __m512 mx4 = _mm512_max_ps(_mm512_max_ps(x[0], x[1]), _mm512_max_ps(x[2], x[3]));
        const float mx = _mm512_reduce_max_ps(mx4);
        const float m_new = mx > m[r] ? mx : m[r];
        const float m_use = m_new == -INFINITY ? 0.0f : m_new; /* all excluded so far: p = 0 */
        dm[r] = m[r] - m_use;
        mus[r] = m_use;
        if (act >> r & 1u) m[r] = m_new;
    }
    __asm__ volatile("" ::: "memory");
    _mm_setcsr(csr | _MM_FLUSH_ZERO_ON); /* the exponentials: E's underflows (above) */
    __asm__ volatile("" ::: "memory");
    for (int r = 0; r < nr; r++) {
        const __m512 mu = _mm512_set1_ps(mus[r]);
        __m512 f[4];
        if (dp) { /* keys 0-63 as 64 words: Pp[r][i] = p_2i | p_2i+1 << 16 */
            __m256i w[4];
            for (int v = 0; v < 4; v++) {
                const __m512 x = _mm512_load_ps(S + r * NX_AB_BC + 16 * v);
                w[v] = (__m256i)_mm512_cvtneps_pbh(nx_exp2_16(_mm512_sub_ps(x, mu)));
                f[v] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(w[v]), 16));
            }
            _mm512_store_si512((__m512i *)(Pp + r * (NX_AB_BC / 2)),
                               _mm512_inserti64x4(_mm512_castsi256_si512(w[0]), w[1], 1));
            _mm512_store_si512((__m512i *)(Pp + r * (NX_AB_BC / 2) + 16),
                               _mm512_inserti64x4(_mm512_castsi256_si512(w[2]), w[3], 1));
        } else {
            for (int v = 0; v < 4; v++) {
                const __m512 x = _mm512_load_ps(S + r * NX_AB_BC + 16 * v);
                f[v] = nx_ab_bf16(nx_exp2_16(_mm512_sub_ps(x, mu)));
                _mm512_store_ps(Pt + r * NX_AB_BC + 16 * v, nx_ab_swap_pairs(f[v]));
            }
        }
        sums[r] = nx_ab_tree(f[0], f[1], f[2], f[3]);
    }
    __asm__ volatile("" ::: "memory");
    _mm_setcsr(csr);
    __asm__ volatile("" ::: "memory");
    float alpha[16] __attribute__((aligned(64)));
    _mm512_store_ps(alpha, nx_exp2_16(_mm512_loadu_ps(dm)));
    for (int r = 0; r < nr; r++)
        if (act >> r & 1u) l[r] = l[r] * alpha[r] + sums[r];
    int64_t c = 0;
    if (dp) {
        for (; c + 64 <= hdp; c += 64) nx_ab_pv(1, nr, 4, Pp, alpha, vt, hdp, c, O, act);
        for (; c < hdp; c += 16) nx_ab_pv(1, nr, 1, Pp, alpha, vt, hdp, c, O, act);
        return;
    }
    __asm__ volatile("" ::: "memory");
    _mm_setcsr(csr | NX_AB_DAZ_FTZ);
    __asm__ volatile("" ::: "memory");
    for (; c + 64 <= hdp; c += 64) nx_ab_pv(0, nr, 4, Pt, alpha, vt, hdp, c, O, act);
    for (; c < hdp; c += 16) nx_ab_pv(0, nr, 1, Pt, alpha, vt, hdp, c, O, act);
    __asm__ volatile("" ::: "memory");
    _mm_setcsr(csr);
    __asm__ volatile("" ::: "memory");
}

static void nx_ab_micro_any(int dp, int nr, const void *qt, int64_t hd2s, int64_t hd2,
                            const void *kt, const void *vt, const uint64_t *rmask, unsigned act,
                            float scale, float *m, float *l, float *O, int64_t hdp, unsigned csr) {
#define NX_AB_CASE(n)                                                                              \
    case n:                                                                                        \
        if (dp)                                                                                    \
            nx_ab_micro(1, n, qt, hd2s, hd2, kt, vt, rmask, act, scale, m, l, O, hdp, csr);        \
        else                                                                                       \
            nx_ab_micro(0, n, qt, hd2s, hd2, kt, vt, rmask, act, scale, m, l, O, hdp, csr);        \
        break;
    switch (nr) { /* constant row counts and dot: the accumulators stay in registers */
        NX_AB_CASE(6)
        NX_AB_CASE(5)
        NX_AB_CASE(4)
        NX_AB_CASE(3)
        NX_AB_CASE(2)
        NX_AB_CASE(1)
    default: break;
    }
#undef NX_AB_CASE
}

int nx_attention_bf16_avx512bf16(const float *q, const float *k, const float *qkv,
                                 const uint8_t *mask, float *out, int64_t T, int64_t H,
                                 int64_t KVH, int64_t hd, float scale, int64_t h0, int64_t h1,
                                 int64_t q0, int64_t q1, int causal) {
    const int64_t BC = NX_AB_BC, QB = NX_AB_QB;
    const int64_t W = (H + 2 * KVH) * hd, group = H / KVH, OW = H * hd;
    const int64_t ntiles = (T + BC - 1) / BC, Tp = ntiles * BC;
    const int64_t hd2 = (hd + 1) / 2 * 2, hd2s = (hd2 + 15) / 16 * 16, hdp = (hd + 15) / 16 * 16;
    const unsigned csr = _mm_getcsr();
    const int dp = nx_attn_bf16_dot() == NX_AB_DOT_DP; /* the same bits either way */
    /* sizes in whole 64-byte lines (aligned_alloc wants a multiple of the alignment); the FMA
     * dot's layouts, twice the pair-dwords' */
    float *kt = aligned_alloc(64, (size_t)((Tp * hd2 * 4 + 63) / 64 * 64));
    float *vt = aligned_alloc(64, (size_t)(Tp * hdp * 4));
    float *qp = aligned_alloc(64, (size_t)(QB * hd2s * 4));
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
    nx_attn_tile_masks(mask, T, BC, ntiles, tmask);
    int64_t packed = -1;
    for (int64_t h = h0; h < h1; h++) {
        const int64_t g = h / group;
        if (g != packed) {
            const float *vg = qkv + (H + KVH) * hd + g * hd;
            if (dp) {
                nx_ab_pack_k(1, k + g * T * hd, T, hd, hd2, Tp, (uint32_t *)kt);
                nx_abd_pack_v(vg, W, T, hd, hdp, Tp, (uint32_t *)vt);
            } else {
                nx_ab_pack_k(0, k + g * T * hd, T, hd, hd2, Tp, (uint32_t *)kt);
                nx_ab_pack_v(vg, W, T, hd, hdp, Tp, vt);
            }
            packed = g;
        }
        for (int64_t t0 = q0; t0 < q1; t0 += QB) { /* the query rows [q0, q1) */
            const int64_t nq = q1 - t0 < QB ? q1 - t0 : QB;
            if (dp)
                nx_abd_pack_q(q + (h * T + t0) * hd, nq, hd, hd2 / 2, hd2s / 2, (uint32_t *)qp);
            else
                nx_ab_pack_q(q + (h * T + t0) * hd, nq, hd, hd2s, qp);
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
                    if (causal && j0 > f + nr - 1) continue; /* the tile starts after every row */
                    uint64_t rmask[NX_AB_BR];
                    const unsigned act = nx_attn_row_masks(causal, j0, f, nr, tmask[b], rmask);
                    /* row r0, tile b: offsets in floats, or (dp) in dwords */
                    const int64_t sh = dp ? 1 : 0;
                    nx_ab_micro_any(dp, nr, qp + (r0 * hd2s >> sh), hd2s, hd2,
                                    kt + (b * hd2 * BC >> sh), vt + (b * BC * hdp >> sh), rmask,
                                    act, scale, m + r0, l + r0, O + r0 * hdp, hdp, csr);
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

const nx_attn_bf16_table nx_attn_bf16_table_avx512bf16 = {.attention_bf16 =
                                                              nx_attention_bf16_avx512bf16};
