/* nx_attn_bf16_amx.c -- the `bf16` attention on the AMX tile unit (tdpbf16ps for Q K^T and P V);
 * exports the amx table of the "attn_bf16" family.
 *
 * Owns: the AMX panel layouts, the 16-row micro-block and its tile configuration (loaded at
 * entry and released at exit of every call, in the calling thread). Everything but the two dot
 * products is the contract of nx_attn_bf16.h, operation for operation: bf() of q, k, v
 * (VCVTNEPS2BF16), 64-key tiles run whole, x_j = s_j * scale or -inf, the running max, E
 * (nx_exp16), p_j = bf(E(x_j - m_use)), the contract's sum tree, l = l * alpha + sum, O = O * alpha.
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
#include "nx_vmath_avx512.h" /* nx_exp16, nx_mask16 */

#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

#define NX_AX_BR 16                /* rows per micro-block: one tile's rows */
#define NX_AX_BC NX_ATTN_BF16_TILE /* keys per tile (the contract's) */
#ifndef NX_AX_QB
#define NX_AX_QB 256 /* query rows sharing one pass over the K/V tiles */
#endif
_Static_assert(NX_AX_QB % NX_AX_BR == 0, "whole micro-blocks per query block");
_Static_assert(NX_AX_BC == 64, "the S tiles cover 64 keys as 4 x 16");

/* bf() of 16 floats as 16 bf16 bits, and as float32 values. */
static inline __m256i nx_ax_bf16_bits(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }
static inline __m512 nx_ax_bf16(__m512 x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(nx_ax_bf16_bits(x)), 16));
}

/* The contract's sum tree of one row's 64 rounded p (f0..f3 = keys 0-15, 16-31, 32-47, 48-63). */
static inline float nx_ax_tree(__m512 f0, __m512 f1, __m512 f2, __m512 f3) {
    const __m512 a = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(f0, f1), f2), f3);
    const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

static inline uint64_t nx_ax_low_bits(int64_t n) { /* keys [0, n) of a tile */
    return n >= 64 ? ~(uint64_t)0 : n <= 0 ? 0 : (((uint64_t)1 << n) - 1);
}

/* Layouts (bf16 bits; hd32 = hd rounded up to 32, nc = hd32 / 32 chunks, hdp = hd rounded up to
 * 16; zeros beyond hd and beyond T):
 *   kt[tile b][chunk c][pair p < 16][key jj < 64]: dword {bf(k[j, 32c+2p]), bf(k[j, 32c+2p+1])}
 *      -- 16 columns of it (keys 16 kg ..) are the B tile of S's kg-th 16 keys, stride 256 B;
 *   vt[tile b][half h][pair p < 16][d < hdp]: dword {bf(v[64b+32h+2p, d]), bf(v[.. +1, d])}
 *      -- 16 columns (d = 16 dg ..) are the B tile of O's dg-th 16 columns, stride hdp * 4 B;
 *   qt[row][hd32] bf16 -- 16 rows x chunk c are an A tile, stride hd32 * 2 B;
 *   pt[row][64] bf16 (per micro-block) -- 16 rows x half h are an A tile, stride 128 B. */
static void nx_ax_pack_k(const float *kg, int64_t T, int64_t hd, int64_t nc, int64_t Tp,
                         uint32_t *kt) {
    for (int64_t j = 0; j < Tp; j++) {
        uint32_t *dst = kt + (j / NX_AX_BC) * nc * 16 * NX_AX_BC + j % NX_AX_BC;
        for (int64_t c = 0; c < nc; c++) {
            const int64_t d = 32 * c;
            const __m512 lo = j < T ? _mm512_maskz_loadu_ps(nx_mask16(hd - d), kg + j * hd + d)
                                    : _mm512_setzero_ps();
            const __m512 hi =
                j < T ? _mm512_maskz_loadu_ps(nx_mask16(hd - d - 16), kg + j * hd + d + 16)
                      : _mm512_setzero_ps();
            uint32_t w[16];
            _mm512_storeu_si512((__m512i *)w, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
            for (int p = 0; p < 16; p++) dst[(c * 16 + p) * NX_AX_BC] = w[p];
        }
    }
}

static void nx_ax_pack_v(const float *vg, int64_t W, int64_t T, int64_t hd, int64_t hdp,
                         int64_t Tp, uint32_t *vt) {
    for (int64_t j = 0; j < Tp; j += 2) { /* key pair (j, j+1) */
        uint32_t *dst = vt + (j / 32) * 16 * hdp + (j % 32 / 2) * hdp;
        for (int64_t c = 0; c < hdp; c += 16) {
            const __mmask16 m = nx_mask16(hd - c);
            const __m512 a = j < T ? _mm512_maskz_loadu_ps(m, vg + j * W + c) : _mm512_setzero_ps();
            const __m512 b =
                j + 1 < T ? _mm512_maskz_loadu_ps(m, vg + (j + 1) * W + c) : _mm512_setzero_ps();
            const __m512i ab = _mm512_cvtepu16_epi32(nx_ax_bf16_bits(a));
            const __m512i bb = _mm512_slli_epi32(_mm512_cvtepu16_epi32(nx_ax_bf16_bits(b)), 16);
            _mm512_storeu_si512((__m512i *)(dst + c), _mm512_or_si512(ab, bb));
        }
    }
}

static void nx_ax_pack_q(const float *q, int64_t nq, int64_t hd, int64_t hd32, uint16_t *qt) {
    for (int64_t r = 0; r < NX_AX_QB && r < ((nq + NX_AX_BR - 1) / NX_AX_BR) * NX_AX_BR; r++)
        for (int64_t d = 0; d < hd32; d += 16) {
            const __m512 x = r < nq ? _mm512_maskz_loadu_ps(nx_mask16(hd - d), q + r * hd + d)
                                    : _mm512_setzero_ps();
            _mm256_storeu_si256((__m256i *)(qt + r * hd32 + d), nx_ax_bf16_bits(x));
        }
}

/* One micro-block of 16 rows (qt rows hd32 apart; rows r >= nr are padding), against tile kt /
 * vt, keys allowed for row r: rmask[r]; running m, l, O (rows hdp floats apart), updated for the
 * rows with bit r of act set (the others -- padding, or causal rows before the tile -- keep
 * theirs). */
static void nx_ax_micro(int nr, const uint16_t *qt, int64_t hd32, int64_t nc, const uint32_t *kt,
                        const uint32_t *vt, const uint64_t *rmask, unsigned act, float scale,
                        float *m, float *l, float *O, int64_t hdp) {
    float S[NX_AX_BR * NX_AX_BC] __attribute__((aligned(64)));
    uint16_t pt[NX_AX_BR * NX_AX_BC] __attribute__((aligned(64)));
    float keep[NX_AX_BR][16] __attribute__((aligned(64))); /* saved O rows chunk (inactive) */
    /* S = Q K^T: 4 result tiles (16 keys each), per chunk one A tile and 4 B tiles */
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t c = 0; c < nc; c++) {
        const uint32_t *kc = kt + c * 16 * NX_AX_BC;
        _tile_loadd(4, qt + 32 * c, hd32 * 2);
        _tile_loadd(6, kc, NX_AX_BC * 4);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, kc + 16, NX_AX_BC * 4);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(6, kc + 32, NX_AX_BC * 4);
        _tile_dpbf16ps(2, 4, 6);
        _tile_loadd(7, kc + 48, NX_AX_BC * 4);
        _tile_dpbf16ps(3, 4, 7);
    }
    _tile_stored(0, S, NX_AX_BC * 4);
    _tile_stored(1, S + 16, NX_AX_BC * 4);
    _tile_stored(2, S + 32, NX_AX_BC * 4);
    _tile_stored(3, S + 48, NX_AX_BC * 4);
    /* the online softmax, the contract's float32 operations */
    const __m512 sc = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
    float sums[NX_AX_BR], dm[NX_AX_BR];
    for (int r = 0; r < NX_AX_BR; r++) {
        if (!(act >> r & 1u)) { /* not run: p = 0, O kept below */
            dm[r] = 0.0f;
            sums[r] = 0.0f;
            memset(pt + r * NX_AX_BC, 0, NX_AX_BC * sizeof(uint16_t));
            continue;
        }
        __m512 x[4];
        for (int v = 0; v < 4; v++)
            x[v] = _mm512_mask_mov_ps(ninf, (__mmask16)(rmask[r] >> (16 * v)),
                                      _mm512_mul_ps(_mm512_load_ps(S + r * NX_AX_BC + 16 * v), sc));
        const __m512 mx4 = _mm512_max_ps(_mm512_max_ps(x[0], x[1]), _mm512_max_ps(x[2], x[3]));
        const float mx = _mm512_reduce_max_ps(mx4);
        const float m_new = mx > m[r] ? mx : m[r];
        const float m_use = m_new == -INFINITY ? 0.0f : m_new; /* all excluded so far: p = 0 */
        dm[r] = m[r] - m_use;
        m[r] = m_new;
        const __m512 mu = _mm512_set1_ps(m_use);
        __m512 f[4];
        for (int v = 0; v < 4; v++) {
            const __m512 e = nx_exp16(_mm512_sub_ps(x[v], mu));
            _mm256_store_si256((__m256i *)(pt + r * NX_AX_BC + 16 * v), nx_ax_bf16_bits(e));
            f[v] = nx_ax_bf16(e);
        }
        sums[r] = nx_ax_tree(f[0], f[1], f[2], f[3]);
    }
    float alpha[NX_AX_BR] __attribute__((aligned(64)));
    _mm512_store_ps(alpha, nx_exp16(_mm512_loadu_ps(dm)));
    for (int r = 0; r < nr; r++)
        if (act >> r & 1u) l[r] = l[r] * alpha[r] + sums[r];
    /* O = O * alpha + P V: per 16 output columns one result tile, 2 A tiles (the key halves).
     * O * alpha first, all columns, and only for the rows whose alpha is not 1 (x * 1 = x
     * exactly under this code's MXCSR, round-to-nearest without DAZ/FTZ; alpha = 1 whenever
     * the row's max did not move, most tiles past the first few). Rows that do not run the
     * tile keep their O (tdpbf16ps would add 0 * v products to it under DAZ/FTZ): saved before
     * and put back after, only for them. AMX Xeon (family 6 model 167), T=4128, hd=128, 2
     * heads, 1 thread: 387-390 -> 399-403 GFLOP/s (best of 4 s, 2 alternating runs each). */
    const unsigned all = (1u << NX_AX_BR) - 1u;
    unsigned scaled = 0;
    for (int r = 0; r < NX_AX_BR; r++)
        if ((act >> r & 1u) && alpha[r] != 1.0f) scaled |= 1u << r;
    for (int r = 0; scaled && r < NX_AX_BR; r++) {
        if (!(scaled >> r & 1u)) continue;
        const __m512 a = _mm512_set1_ps(alpha[r]);
        for (int64_t c = 0; c < hdp; c += 16)
            _mm512_store_ps(O + r * hdp + c, _mm512_mul_ps(_mm512_load_ps(O + r * hdp + c), a));
    }
    _tile_loadd(4, pt, NX_AX_BC * 2);
    _tile_loadd(5, pt + 32, NX_AX_BC * 2);
    const unsigned idle = ~act & all; /* rows that keep their O */
    for (int64_t c = 0; c < hdp; c += 16) {
        for (int r = 0; idle && r < NX_AX_BR; r++)
            if (idle >> r & 1u) _mm512_store_ps(keep[r], _mm512_load_ps(O + r * hdp + c));
        _tile_loadd(0, O + c, hdp * 4);
        _tile_loadd(6, vt + c, hdp * 4);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, vt + 16 * hdp + c, hdp * 4);
        _tile_dpbf16ps(0, 5, 7);
        _tile_stored(0, O + c, hdp * 4);
        for (int r = 0; idle && r < NX_AX_BR; r++)
            if (idle >> r & 1u) _mm512_store_ps(O + r * hdp + c, _mm512_load_ps(keep[r]));
    }
}

int nx_attention_bf16_amx(const float *q, const float *k, const float *qkv, const uint8_t *mask,
                          float *out, int64_t T, int64_t H, int64_t KVH, int64_t hd, float scale,
                          int64_t h0, int64_t h1, int causal) {
    const int64_t BC = NX_AX_BC, QB = NX_AX_QB;
    const int64_t W = (H + 2 * KVH) * hd, group = H / KVH, OW = H * hd;
    const int64_t ntiles = (T + BC - 1) / BC, Tp = ntiles * BC;
    const int64_t hd32 = (hd + 31) / 32 * 32, nc = hd32 / 32, hdp = (hd + 15) / 16 * 16;
    uint32_t *kt = aligned_alloc(64, (size_t)(Tp * nc * 16 * 4));
    uint32_t *vt = aligned_alloc(64, (size_t)(Tp / 2 * hdp * 4));
    uint16_t *qp = aligned_alloc(64, (size_t)(QB * hd32 * 2));
    float *O = aligned_alloc(64, (size_t)(QB * hdp * 4));
    uint64_t *tmask = malloc((size_t)ntiles * sizeof(uint64_t)); /* allowed keys per tile */
    float m[NX_AX_QB], l[NX_AX_QB];
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
    const nx_tilecfg cfg = nx_tile_config();
    nx_tile_loadconfig(&cfg);
    int64_t packed = -1;
    for (int64_t h = h0; h < h1; h++) {
        const int64_t g = h / group;
        if (g != packed) {
            nx_ax_pack_k(k + g * T * hd, T, hd, nc, Tp, kt);
            nx_ax_pack_v(qkv + (H + KVH) * hd + g * hd, W, T, hd, hdp, Tp, vt);
            packed = g;
        }
        for (int64_t t0 = 0; t0 < T; t0 += QB) {
            const int64_t nq = T - t0 < QB ? T - t0 : QB;
            nx_ax_pack_q(q + (h * T + t0) * hd, nq, hd, hd32, qp);
            for (int64_t r = 0; r < QB; r++) {
                m[r] = -INFINITY;
                l[r] = 0.0f;
            }
            memset(O, 0, (size_t)(QB * hdp) * sizeof(float));
            for (int64_t b = 0; b < ntiles; b++) {
                const int64_t j0 = b * BC;
                if (causal && j0 > t0 + nq - 1) break; /* no row of the block runs this tile */
                for (int64_t r0 = 0; r0 < nq; r0 += NX_AX_BR) {
                    const int nr = (int)(nq - r0 < NX_AX_BR ? nq - r0 : NX_AX_BR);
                    const int64_t f = t0 + r0; /* first row */
                    uint64_t rmask[NX_AX_BR];
                    unsigned act = (1u << nr) - 1u;
                    if (causal && j0 > f + nr - 1) continue; /* the tile starts after every row */
                    for (int r = 0; r < NX_AX_BR; r++) {
                        const int run = r < nr && (!causal || j0 <= f + r); /* row f+r runs b */
                        if (!run) act &= ~(1u << r);
                        rmask[r] = !run ? 0 : causal ? tmask[b] & nx_ax_low_bits(f + r - j0 + 1)
                                                     : tmask[b];
                    }
                    nx_ax_micro(nr, qp + r0 * hd32, hd32, nc, kt + b * nc * 16 * BC,
                                vt + b * 32 * hdp, rmask, act, scale, m + r0, l + r0,
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
    _tile_release();
    free(kt);
    free(vt);
    free(qp);
    free(O);
    free(tmask);
    return 0;
}

const nx_attn_bf16_table nx_attn_bf16_table_amx = {.attention_bf16 = nx_attention_bf16_amx};
