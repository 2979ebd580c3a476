/* nx_attn_bf16_amx.c -- the `bf16` attention on the AMX tile unit (tdpbf16ps for Q K^T and P V);
 * exports the amx table of the "attn_bf16" family.
 *
 * Owns: the AMX panel layouts, the 16-row micro-block (rows in vector lanes) and its tile
 * configuration (loaded at entry and released at exit of every call, in the calling thread).
 * Everything but the two dot products is the contract of nx_attn_bf16.h, operation for
 * operation: bf() of q, k, v (VCVTNEPS2BF16), 64-key tiles run whole, x_j = s_j * c or -inf (c
 * the base-2 factor, which nx_attention_bf16 passes as `scale`),
 * the running max, E (nx_exp2_16; for p, nx_ax_exp2z: the same values, excluded keys' lanes
 * zeroed, run under FTZ), p_j = bf(E(x_j - m_use)), the contract's sum tree,
 * l = l * alpha + sum, O = O * alpha.
 * The dots are tdpbf16ps: s_j sums the d-pairs of bf(q) . bf(k_j) per 32-d chunk in chunk order,
 * and O += sum_j p_j bf(v_j) per 32-key half of the tile in order, each with the instruction's own
 * accumulation (DAZ/FTZ, round to nearest; its internal order and intermediate roundings are
 * not documented, and do not match the contract's pair steps: benchmarks/probes/amx_tdpbf16ps.c).
 * So these are not the spec's bits (the contract's AMX clause, nx_attn_bf16.h). What holds: a
 * row's operations depend only on t, T and the data (never on the micro-block, query block or
 * head band), so outputs are bit-identical across head bands and worker splits on one machine,
 * and the error bound of nx_attn_bf16.h holds (each dot's accumulation stays within gamma of
 * its exact sum of rounded products; tests/test_kernels_attn_bf16.py).
 * Entered only when the probe reports the amx ISA. Must not: allocate per tile, use threads, or
 * leave a tile configuration loaded.
 */
#include "nx_amx.h"
#include "nx_attn_bf16.h"
#include "nx_lowp_bf16_pack.h" /* nx_tr16i */
#include "nx_vmath_avx512.h"   /* nx_exp2_16, nx_mask16 */

#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

#define NX_AX_BR 16                /* query rows per micro-block: the lanes of a vector */
#define NX_AX_BC NX_ATTN_BF16_TILE /* keys per tile (the contract's) */
#ifndef NX_AX_QB
#define NX_AX_QB 256 /* query rows sharing one pass over the K/V tiles */
#endif
_Static_assert(NX_AX_QB % NX_AX_BR == 0, "whole micro-blocks per query block");
_Static_assert(NX_AX_BC == 64, "the S tiles cover 64 keys as 4 x 16");

/* Rows in lanes: the tiles compute S^T = K Q^T (a 64-key x 16-query block as 4 result tiles)
 * and O^T = O^T + V^T P^T, so that in the online softmax lane r of every vector is query row r
 * of the micro-block: the tile's max, the sum tree of the rounded p (key i, 16 + i, 32 + i,
 * 48 + i added first, then lanes i and i + 8, ...: the contract's tree, one vertical add per
 * step) and every per-row scalar (m, l, alpha) are vertical operations on 16 rows at once, with
 * no horizontal reductions and no per-row branches. Each S^T / O^T element is the same
 * tdpbf16ps sum of the same bf16 pairs in the same order as S / O with the operands the other
 * way round: the outputs of this kernel and of the rows-in-registers one before it (2026-12-05)
 * were bit-identical on 330 cases (T 1 .. 600, hd 8 .. 128, GQA, causal, masks). AMX Xeon
 * (family 6 model 167), one thread, 4 of 30 heads, shared-memory buffers, GFLOP/s: T=4128
 * 402-404 -> 487-492, T=1024 387 -> 500. Tried, not kept: four O^T result tiles in flight in
 * P V (487), the Q^T B tile alternating between two tiles by chunk (481-485), and issuing the
 * next micro-block's S^T before this one's softmax (453-457).
 *
 * Layouts (bf16 bits; hd32 = hd rounded up to 32, nc = hd32 / 32 chunks, hdp = hd rounded up to
 * 16; zeros beyond hd and beyond T):
 *   kt[key j][hd32] bf16 -- 16 keys x chunk c are an A tile of S^T, stride hd32 * 2 B;
 *   vt[tile b][half h][d < hdp][32 keys] bf16 -- 16 rows (d = 16 dg ..) are an A tile of O^T's
 *      dg-th 16 rows, stride 64 B;
 *   qt[micro-block][chunk c][pair p < 16][row r < 16]: dword {bf(q[r, 32c+2p]), bf(q[r, 32c+2p+1])}
 *      -- the B tile of S^T for chunk c, stride 64 B;
 *   pt[half h][pair p < 16][row r < 16]: dword {bf(p_(32h+2p)), bf(p_(32h+2p+1))} of row r -- the
 *      B tile of O^T for the half, stride 64 B;
 *   OT[micro-block][d < hdp][16 rows] float32 -- O^T, 16 rows d at a time a result tile. */
static void nx_ax_pack_k(const float *kg, int64_t T, int64_t hd, int64_t hd32, int64_t Tp,
                         uint16_t *kt) {
    for (int64_t j = 0; j < Tp; j++)
        for (int64_t d = 0; d < hd32; d += 32) {
            const __m512 lo = j < T ? _mm512_maskz_loadu_ps(nx_mask16(hd - d), kg + j * hd + d)
                                    : _mm512_setzero_ps();
            const __m512 hi =
                j < T ? _mm512_maskz_loadu_ps(nx_mask16(hd - d - 16), kg + j * hd + d + 16)
                      : _mm512_setzero_ps();
            _mm512_storeu_si512((void *)(kt + j * hd32 + d), nx_bf16_pairs32(lo, hi));
        }
}

/* V^T: per tile half, 32 keys x 16 d -> 16 rows d of 32 keys (two 16 x 16 word blocks). */
static void nx_ax_pack_v(const float *vg, int64_t W, int64_t T, int64_t hd, int64_t hdp,
                         int64_t Tp, uint16_t *vt) {
    for (int64_t j0 = 0; j0 < Tp; j0 += 32) { /* one half: keys j0 .. j0 + 31 */
        uint16_t *dst = vt + (j0 / 32) * hdp * 32;
        /* the next half's 32 rows, each in its own pages (W floats apart: out of the hardware
         * prefetchers' reach). AMX Xeon, one thread, T=256, 15 heads of hd 128 (a Z-Image
         * worker's share), a /tmp loop over K.attention, ms: inputs evicted from the caches
         * before each call 2.94 -> 2.41-2.66, in the block's sdpa stage 2.72-2.73 -> 2.63-2.65.
         * Two halves ahead: no better. */
        for (int64_t j = j0 + 32; j < j0 + 64 && j < T; j++)
            for (int64_t c = 0; c < hd; c += 16)
                _mm_prefetch((const char *)(vg + j * W + c), _MM_HINT_T0);
        for (int64_t c = 0; c < hdp; c += 16) {
            const __mmask16 m = nx_mask16(hd - c);
            __m512i r[16]; /* r[i] = dwords {bf(v[j0+2i, c+e]), bf(v[j0+2i+1, c+e])}, e < 16 */
            for (int i = 0; i < 16; i++) {
                const int64_t j = j0 + 2 * i;
                const __m512 a = j < T ? _mm512_maskz_loadu_ps(m, vg + j * W + c)
                                       : _mm512_setzero_ps();
                const __m512 b = j + 1 < T ? _mm512_maskz_loadu_ps(m, vg + (j + 1) * W + c)
                                           : _mm512_setzero_ps();
                const __m512i ab = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(a));
                const __m512i bb = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(b));
                r[i] = _mm512_or_si512(ab, _mm512_slli_epi32(bb, 16));
            }
            nx_tr16i(r); /* r[e] lane i = that dword for d = c + e: row d, keys 2i, 2i+1 */
            for (int e = 0; e < 16; e++) _mm512_storeu_si512((void *)(dst + (c + e) * 32), r[e]);
        }
    }
}

/* Q^T of rows [0, nr) of a micro-block (rows past nr zero), every chunk. */
static void nx_ax_pack_q(const float *q, int nr, int64_t hd, int64_t nc, uint32_t *qt) {
    for (int64_t c = 0; c < nc; c++) {
        const int64_t d = 32 * c;
        __m512i r[16];
        for (int i = 0; i < 16; i++)
            r[i] = i < nr ? nx_bf16_pairs32(
                                _mm512_maskz_loadu_ps(nx_mask16(hd - d), q + i * hd + d),
                                _mm512_maskz_loadu_ps(nx_mask16(hd - d - 16), q + i * hd + d + 16))
                          : _mm512_setzero_si512();
        nx_tr16i(r); /* r[p] lane i = pair p of row i */
        for (int p = 0; p < 16; p++) _mm512_store_si512((void *)(qt + (c * 16 + p) * 16), r[p]);
    }
}

/* E(y) of the contract (nx_exp2_16) in the lanes of k and +0 in the others, without E's clamp
 * at -160: the lanes outside k are the keys a row does not see (x = -inf, so E = +0 there), and
 * for a finite y below -160, 2^floor(y) * p(f) < 2^-150 is +0 just as E(-160) = 2^-160 is
 * (rounded to nearest, or flushed under the FTZ the exponentials run with). So every lane has
 * E's bits, one vector operation fewer per 16 weights, and an excluded key costs no underflow. */
static inline __m512 nx_ax_exp2z(__mmask16 k, __m512 y) {
    return _mm512_maskz_scalef_ps(k, nx_exp2_frac16(y), y);
}

/* One micro-block of 16 rows against tile kt / vt. lanes(j): the rows key j of the tile enters
 * (bit r: row r runs the tile and may see key j); act: the rows that run the tile (the others --
 * padding, or causal rows before the tile -- keep m, l and their O^T lanes). Running m, l (16
 * floats each) and OT (hdp rows of 16) are updated in place. */
static void nx_ax_micro(const uint32_t *qt, int64_t nc, const uint16_t *kt, int64_t hd32,
                        const uint16_t *vt, int64_t hdp, const __mmask16 *lanes, __mmask16 act,
                        float scale, float *m, float *l, float *OT, unsigned csr) {
    _Alignas(64) float S[NX_AX_BC][16];  /* S^T, then the scores x */
    _Alignas(64) uint32_t pt[2][16][16]; /* P^T, the B tiles of the two halves */
    /* S^T = K Q^T: 4 result tiles of 16 keys, per chunk one B tile (Q^T) and 4 A tiles (K) */
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t c = 0; c < nc; c++) {
        const uint16_t *kc = kt + 32 * c;
        _tile_loadd(4, qt + c * 256, 64);
        _tile_loadd(6, kc, hd32 * 2);
        _tile_dpbf16ps(0, 6, 4);
        _tile_loadd(7, kc + 16 * hd32, hd32 * 2);
        _tile_dpbf16ps(1, 7, 4);
        _tile_loadd(6, kc + 32 * hd32, hd32 * 2);
        _tile_dpbf16ps(2, 6, 4);
        _tile_loadd(7, kc + 48 * hd32, hd32 * 2);
        _tile_dpbf16ps(3, 7, 4);
    }
    _tile_stored(0, S[0], 64);
    _tile_stored(1, S[16], 64);
    _tile_stored(2, S[32], 64);
    _tile_stored(3, S[48], 64);
    /* x_j = s_j * scale, or -inf for the rows key j does not enter; the tile's max */
    const __m512 sc = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
    __m512 mx[4] = {ninf, ninf, ninf, ninf};
    for (int j = 0; j < NX_AX_BC; j++) {
        const __m512 x = _mm512_mask_mul_ps(ninf, lanes[j], _mm512_load_ps(S[j]), sc);
        _mm512_store_ps(S[j], x);
        mx[j & 3] = _mm512_max_ps(mx[j & 3], x);
    }
    const __m512 mt = _mm512_max_ps(_mm512_max_ps(mx[0], mx[1]), _mm512_max_ps(mx[2], mx[3]));
    const __m512 m_old = _mm512_load_ps(m);
    /* m_new = mx > m ? mx : m; m_use = m_new, or 0 while every key so far is excluded */
    const __m512 m_new = _mm512_mask_mov_ps(m_old, _mm512_cmp_ps_mask(mt, m_old, _CMP_GT_OQ), mt);
    const __m512 m_use = _mm512_mask_mov_ps(
        m_new, _mm512_cmp_ps_mask(m_new, ninf, _CMP_EQ_OQ), _mm512_setzero_ps());
    _mm512_store_ps(m, _mm512_mask_mov_ps(m_old, act, m_new));
    /* alpha = E(m_old - m_use) (1 for the rows that keep their state); O = O * alpha, every row
     * d, when some row's alpha is not 1 (x * 1 = x exactly under this code's MXCSR: round to
     * nearest, no DAZ/FTZ; the rows that keep their state have alpha 1). Done before the
     * exponentials: the tile loads of O^T below then find these vector stores long retired (a
     * tile load of lines still in the store buffer waits ~80 cycles for them, AMX Xeon). */
    const __m512 alpha = nx_exp2_16(_mm512_maskz_sub_ps(act, m_old, m_use));
    if (_mm512_cmp_ps_mask(alpha, _mm512_set1_ps(1.0f), _CMP_NEQ_UQ))
        for (int64_t d = 0; d < hdp; d++)
            _mm512_store_ps(OT + d * 16, _mm512_mul_ps(_mm512_load_ps(OT + d * 16), alpha));
    /* p_j = bf(E(x_j - m_use)), two keys a step: their bf16 pair is P^T's dword. The keys run
     * as pairs (2p, 2p + 1) of the four 16-key groups in turn, so that the contract's sum tree
     * a_i = ((f_i + f_16+i) + f_32+i) + f_48+i (f the rounded p) is summed in registers, in
     * that order, as its four terms come. */
    const __m512i il = _mm512_setr_epi32(0x00100000, 0x00110001, 0x00120002, 0x00130003,
                                         0x00140004, 0x00150005, 0x00160006, 0x00170007,
                                         0x00180008, 0x00190009, 0x001a000a, 0x001b000b,
                                         0x001c000c, 0x001d000d, 0x001e000e, 0x001f000f);
    const __m512i hi16 = _mm512_set1_epi32((int)0xffff0000u);
    __m512 a[16];
    /* The exponentials run with FTZ: a weight below 2^-126 is flushed to +0 where it would be
     * subnormal, and bf() flushes a subnormal to +0 anyway, so p and the sums keep their bits;
     * without FTZ every vector with such a weight takes a microcode assist (a row whose scores
     * spread over more than ~126: 6x the kernel's time, AMX Xeon). Only this loop: x, alpha,
     * O * alpha and l keep the caller's MXCSR (the contract's float32 operations). */
    __asm__ volatile("" ::: "memory");
    _mm_setcsr(csr | _MM_FLUSH_ZERO_ON);
    __asm__ volatile("" ::: "memory");
    for (int p = 0; p < 8; p++)
        for (int g = 0; g < 4; g++) {
            const int i = 8 * g + p; /* keys 2i = 16g + 2p and 2i + 1 */
            const __m512 e0 =
                nx_ax_exp2z(lanes[2 * i], _mm512_sub_ps(_mm512_load_ps(S[2 * i]), m_use));
            const __m512 e1 =
                nx_ax_exp2z(lanes[2 * i + 1], _mm512_sub_ps(_mm512_load_ps(S[2 * i + 1]), m_use));
            /* words: bf(e0) of rows 0-15, then bf(e1); interleaved: dword r = {bf(e0_r),
             * bf(e1_r)} */
            const __m512i pr = _mm512_permutexvar_epi16(il, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
            _mm512_store_si512((void *)pt[i / 16][i % 16], pr);
            const __m512 f0 = _mm512_castsi512_ps(_mm512_slli_epi32(pr, 16));
            const __m512 f1 = _mm512_castsi512_ps(_mm512_and_si512(pr, hi16));
            if (g == 0) {
                a[2 * p] = f0;
                a[2 * p + 1] = f1;
            } else {
                a[2 * p] = _mm512_add_ps(a[2 * p], f0);
                a[2 * p + 1] = _mm512_add_ps(a[2 * p + 1], f1);
            }
        }
    /* the tree's lanes i + 8, + 4, + 2, + 1 of the 16 (here: vectors) */
    for (int w = 8; w >= 1; w /= 2)
        for (int i = 0; i < w; i++) a[i] = _mm512_add_ps(a[i], a[i + w]);
    __asm__ volatile("" ::: "memory");
    _mm_setcsr(csr);
    __asm__ volatile("" ::: "memory");
    /* l = l * alpha + sum */
    const __m512 lv = _mm512_load_ps(l);
    _mm512_store_ps(l, _mm512_mask_mov_ps(lv, act, _mm512_add_ps(_mm512_mul_ps(lv, alpha), a[0])));
    /* O^T += V^T P^T: per 16 rows d one result tile, the two key halves in order. The rows that
     * do not run the tile keep their O exactly (tdpbf16ps would add 0 * v to it under DAZ/FTZ):
     * their lanes are put back after. */
    const __mmask16 idle = (__mmask16)~act;
    _tile_loadd(4, pt[0], 64);
    _tile_loadd(5, pt[1], 64);
    for (int64_t dg = 0; dg < hdp; dg += 16) {
        float *o = OT + dg * 16;
        __m512 keep[16];
        if (idle)
            for (int e = 0; e < 16; e++) keep[e] = _mm512_load_ps(o + e * 16);
        _tile_loadd(0, o, 64);
        _tile_loadd(6, vt + dg * 32, 64);
        _tile_dpbf16ps(0, 6, 4);
        _tile_loadd(7, vt + (hdp + dg) * 32, 64);
        _tile_dpbf16ps(0, 7, 5);
        _tile_stored(0, o, 64);
        if (idle)
            for (int e = 0; e < 16; e++)
                _mm512_store_ps(o + e * 16,
                                _mm512_mask_mov_ps(_mm512_load_ps(o + e * 16), idle, keep[e]));
    }
}

int nx_attention_bf16_amx(const float *q, const float *k, const float *qkv, const uint8_t *mask,
                          float *out, int64_t T, int64_t H, int64_t KVH, int64_t hd, float scale,
                          int64_t h0, int64_t h1, int64_t q0, int64_t q1, int causal) {
    const int64_t BC = NX_AX_BC, QB = NX_AX_QB, BR = NX_AX_BR, NB = QB / BR;
    const int64_t W = (H + 2 * KVH) * hd, group = H / KVH, OW = H * hd;
    const int64_t ntiles = (T + BC - 1) / BC, Tp = ntiles * BC;
    const int64_t hd32 = (hd + 31) / 32 * 32, nc = hd32 / 32, hdp = (hd + 15) / 16 * 16;
    uint16_t *kt = aligned_alloc(64, (size_t)(Tp * hd32 * 2));
    uint16_t *vt = aligned_alloc(64, (size_t)(Tp * hdp * 2));
    uint32_t *qt = aligned_alloc(64, (size_t)(NB * nc * 256 * 4));
    float *OT = aligned_alloc(64, (size_t)(QB * hdp * 4));
    float *ml = aligned_alloc(64, (size_t)(2 * QB * 4)); /* m, then l, 16 rows per micro-block */
    uint64_t *tmask = malloc((size_t)ntiles * sizeof(uint64_t)); /* allowed keys per tile */
    if (!kt || !vt || !qt || !OT || !ml || !tmask) {
        free(kt);
        free(vt);
        free(qt);
        free(OT);
        free(ml);
        free(tmask);
        return -1;
    }
    nx_attn_tile_masks(mask, T, BC, ntiles, tmask);
    const unsigned csr = _mm_getcsr();
    const nx_tilecfg cfg = nx_tile_config();
    nx_tile_loadconfig(&cfg);
    int64_t packed = -1;
    for (int64_t h = h0; h < h1; h++) {
        const int64_t g = h / group;
        if (g != packed) {
            nx_ax_pack_k(k + g * T * hd, T, hd, hd32, Tp, kt);
            nx_ax_pack_v(qkv + (H + KVH) * hd + g * hd, W, T, hd, hdp, Tp, vt);
            packed = g;
        }
        for (int64_t t0 = q0; t0 < q1; t0 += QB) { /* the query rows [q0, q1) */
            const int64_t nq = q1 - t0 < QB ? q1 - t0 : QB;
            for (int64_t r0 = 0; r0 < nq; r0 += BR)
                nx_ax_pack_q(q + (h * T + t0 + r0) * hd, (int)(nq - r0 < BR ? nq - r0 : BR), hd,
                             nc, qt + r0 / BR * nc * 256);
            for (int64_t r = 0; r < QB; r++) {
                ml[r] = -INFINITY;
                ml[QB + r] = 0.0f;
            }
            memset(OT, 0, (size_t)(QB * hdp) * sizeof(float));
            for (int64_t b = 0; b < ntiles; b++) {
                const int64_t j0 = b * BC;
                if (causal && j0 > t0 + nq - 1) break; /* no row of the block runs this tile */
                for (int64_t r0 = 0; r0 < nq; r0 += BR) {
                    const int nr = (int)(nq - r0 < BR ? nq - r0 : BR);
                    const int64_t f = t0 + r0; /* first row */
                    if (causal && j0 > f + nr - 1) continue; /* the tile starts after every row */
                    /* rows that run the tile: r < nr, and (causal) j0 <= f + r */
                    __mmask16 act = (__mmask16)((1u << nr) - 1u);
                    if (causal && j0 > f) act &= (__mmask16)(0xffffu << (j0 - f));
                    __mmask16 lanes[NX_AX_BC];
                    for (int jj = 0; jj < NX_AX_BC; jj++) {
                        __mmask16 ln = (tmask[b] >> jj & 1) ? act : 0;
                        if (causal) { /* key j0 + jj: rows r with f + r >= j0 + jj */
                            const int64_t thr = j0 + jj - f;
                            if (thr >= 16) ln = 0;
                            else if (thr > 0) ln &= (__mmask16)(0xffffu << thr);
                        }
                        lanes[jj] = ln;
                    }
                    nx_ax_micro(qt + r0 / BR * nc * 256, nc, kt + j0 * hd32, hd32,
                                vt + j0 * hdp, hdp, lanes, act, scale, ml + r0, ml + QB + r0,
                                OT + r0 * hdp, csr);
                }
            }
            /* out = O * (1 / l), zeros for a row with no allowed key: O^T transposed back */
            for (int64_t r0 = 0; r0 < nq; r0 += BR) {
                const int nr = (int)(nq - r0 < BR ? nq - r0 : BR);
                const float *lr = ml + QB + r0;
                const float *ot = OT + r0 * hdp;
                for (int64_t dg = 0; dg < hdp; dg += 16) {
                    __m512i v[16];
                    for (int e = 0; e < 16; e++)
                        v[e] = _mm512_load_si512((const void *)(ot + (dg + e) * 16));
                    nx_tr16i(v); /* v[r] lane e = O of row r, column dg + e */
                    const __mmask16 cm = nx_mask16(hd - dg);
                    for (int r = 0; r < nr; r++) {
                        float *o = out + (t0 + r0 + r) * OW + h * hd + dg;
                        const __m512 inv = _mm512_set1_ps(1.0f / lr[r]);
                        const __m512 val = lr[r] == 0.0f
                                               ? _mm512_setzero_ps()
                                               : _mm512_mul_ps(_mm512_castsi512_ps(v[r]), inv);
                        _mm512_mask_storeu_ps(o, cm, val);
                    }
                }
            }
        }
    }
    _tile_release();
    free(kt);
    free(vt);
    free(qt);
    free(OT);
    free(ml);
    free(tmask);
    return 0;
}

const nx_attn_bf16_table nx_attn_bf16_table_amx = {.attention_bf16 = nx_attention_bf16_amx};
