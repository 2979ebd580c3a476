/* nx_lowp_amx.c -- the amx table of the "lowp" family: the `q8` matmul of every weight type q8
 * takes (Q8_0, Q4_0 .. Q6_K) on the AMX tile unit (tdpbssd: signed int8 x signed int8 -> int32),
 * and the `bf16` matmul (tdpbf16ps); their panels and their tile configurations.
 *
 * Owns: the AMX q8 and bf16 panel layouts, their tile blocks (q8 16 x 16, bf16 32 x 32) and the
 * palette-1 tile configurations (loaded at entry, released at exit of every call, in the calling
 * thread). The q8 arithmetic is the contract of nx_lowp.h unchanged: each part's integer dot
 * (a 32-k block, or a 16-element half for Q6_K / Q3_K / Q2_K) is exact in int32 whichever unit
 * computes it, and the float epilogue is the contract's per type (the avx512 kernel's
 * operations, one output lane per column), so the result is the spec's, bit for bit. (The
 * weight decoders and scale fields are nx_q8x_avx512.h's, shared with the avx512 kernel.)
 * Entered only when the probe reports the amx ISA (AMX-TILE/INT8/BF16, the OS tile state and the
 * Linux XTILEDATA permission). The weight codes enter the tiles as the signed qw of nx_lowp.h
 * (every type's fit int8), so each unit's dot is the exact isum with no offset correction.
 * Must not: change the per-output block order or arithmetic of nx_lowp.h, allocate per tile, or
 * leave a tile configuration loaded when it returns.
 */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off") /* the weight decoders' mul, sub stay two roundings */
#endif
#pragma STDC FP_CONTRACT OFF

#include "nx_amx.h"
#include "nx_lowp.h"

#include <immintrin.h>
#include <string.h>

#include "nx_kscales_avx512.h"
#include "nx_lowp_bf16_pack.h"
#include "nx_q8_0.h"
#include "nx_q8x_avx512.h"
#include "nx_vmath_avx512.h" /* nx_mask16 */

/* The block: 16 tokens x 16 columns. A "unit" is one tdpbssd: for the H = 1 types (one part per
 * 32-group: Q8_0, Q4_0, Q5_0, Q4_1, Q5_1, Q4_K, Q5_K) one whole 32-k group (16 x 16 x 32), for
 * the H = 2 types (16-element parts: Q6_K, Q3_K, Q2_K) one half of a group (16 x 16 x 16). A
 * round is 2 units, each with its own int32 result tile (zeroed per round: a unit's integer dot
 * is exact, |isum| <= 32 * 128 * 128, and never carried into the next), A tile (16 tokens x 32
 * or 16 int8) and B tile (8 or 4 k-quads x 16 columns x 4 int8), alternating between tmm4/5 and
 * tmm6/7. Then the 2 result tiles are stored (2 KiB, L1) and the contract's epilogue runs on zmm
 * in group order, the 16 float32 chains held in registers across rounds. Measured on this
 * project's AMX Xeon (2 cores, KVM), register/L1-resident panels, 1 thread, Q8_0: a 32 x 32
 * block with one group per round reached ~670 GOP/s (its tile work and its epilogue ran one
 * after the other: 1316 and ~1240 GOP/s alone); this 16 x 16, 2-units-per-round block ~1310
 * GOP/s (the epilogue of one round overlaps the tile work of the next). */
#define NX_AMX_MR 16
#define NX_AMX_NR 16
#ifndef NX_AMX_JR
#define NX_AMX_JR 0
#endif
#ifndef NX_AMX_KC
#define NX_AMX_KC 2048
#endif
#ifndef NX_AMX_NC
#define NX_AMX_NC 256
#endif
#ifndef NX_AMX_MC
#define NX_AMX_MC 512
#endif
_Static_assert(NX_AMX_KC % 256 == 0, "KC must hold whole blocks of every type");
_Static_assert(NX_AMX_NC % NX_AMX_NR == 0, "NC must be a multiple of NR");
_Static_assert(NX_AMX_MC % NX_AMX_MR == 0, "MC must be a multiple of MR");

/* Per 32-k group:
 *   A micro-panel: int8 qx[MR][32] (row r = token r's codes), float dx[MR], and for the types
 *     with a min float ax[2][MR] (dx * (float)xsum of each part, the spec's one rounding; H = 1:
 *     part 0 is the whole 32): NX_AMX_AG bytes, or NX_AMX_AGM with ax.
 *   B micro-panel: int8 quads[8][NR][4] (row q = for each column j its signed codes qw
 *     4q..4q+3), float sw[H][NR], float mw[H][NR] (types with a min): NX_Q8X_BG(H, M, NR).
 *     Q8_0's sw is f32(d). */
#define NX_AMX_AG (NX_AMX_MR * 32 + NX_AMX_MR * 4)
#define NX_AMX_AGM (NX_AMX_AG + 2 * NX_AMX_MR * 4)

/* H: parts per group whose xsums go into ax (0: none, no ax fields). */
NX_INLINE void nx_amx_pack_a_t(const float *x /* IN */, size_t K, size_t t0, size_t rows,
                               uint8_t *Ap /* OUT */, void *scratch, const int H) {
    const size_t nb = K / NX_QK8_0, AG = H ? NX_AMX_AGM : NX_AMX_AG;
    uint8_t *q = (uint8_t *)scratch; /* one quantized row: nb * 34 bytes */
    for (size_t r = 0; r < NX_AMX_MR; r++) {
        if (r < rows) nx_q8_0_quantize_avx512(x + (t0 + r) * K, q, nb);
        for (size_t b = 0; b < nb; b++) {
            uint8_t *g = Ap + b * AG;
            float *dx = (float *)(g + NX_AMX_MR * 32), *ax = dx + NX_AMX_MR;
            if (r >= rows) {
                memset(g + r * 32, 0, 32);
                dx[r] = 0.0f;
                if (H) ax[r] = ax[NX_AMX_MR + r] = 0.0f;
                continue;
            }
            const uint8_t *codes = q + b * NX_Q8_0_BLOCK_BYTES + 2;
            memcpy(g + r * 32, codes, 32);
            dx[r] = nx_q8x_act_scale(x + (t0 + r) * K + b * NX_QK8_0); /* as the spec */
            if (H) {
                const __m512i s16 = _mm512_madd_epi16(
                    _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)codes)),
                    _mm512_set1_epi16(1)); /* pair sums, lanes 0-7: elements 0-15 */
                const int32_t xs0 = H == 1 ? _mm512_reduce_add_epi32(s16)
                                           : _mm512_mask_reduce_add_epi32((__mmask16)0x00ff, s16);
                const int32_t xs1 =
                    H == 1 ? 0 : _mm512_mask_reduce_add_epi32((__mmask16)0xff00, s16);
                ax[r] = dx[r] * (float)xs0; /* one rounding, as the spec */
                ax[NX_AMX_MR + r] = dx[r] * (float)xs1;
            }
        }
    }
}
static void nx_amx_pack_a(const float *x, size_t K, size_t t0, size_t rows, uint8_t *Ap,
                          void *scratch) {
    nx_amx_pack_a_t(x, K, t0, rows, Ap, scratch, 0);
}
static void nx_amx_pack_a_m1(const float *x, size_t K, size_t t0, size_t rows, uint8_t *Ap,
                             void *scratch) {
    nx_amx_pack_a_t(x, K, t0, rows, Ap, scratch, 1);
}
static void nx_amx_pack_a_m2(const float *x, size_t K, size_t t0, size_t rows, uint8_t *Ap,
                             void *scratch) {
    nx_amx_pack_a_t(x, K, t0, rows, Ap, scratch, 2);
}

/* Q8_0's B packer: the stored int8 codes are the signed qw; 16 columns' 4-byte quads gathered. */
static void nx_amx_pack_b(const nx_mm_call *c, size_t j0, size_t ncols, size_t k0, size_t kc,
                          uint8_t *Bp /* OUT */, void *scratch) {
    (void)scratch;
    const size_t rowbytes = c->rowbytes;
    const size_t b0 = k0 / NX_QK8_0, nb = kc / NX_QK8_0;
    const int nv = ncols >= 16 ? 16 : (int)ncols;
    const __mmask16 m = nv >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << nv) - 1u);
    /* byte offsets of the 16 columns' rows (those past ncols are masked off) */
    const __m512i rowoff =
        _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                           _mm512_set1_epi32((int)rowbytes));
    const uint8_t *wc = c->w + j0 * rowbytes;
    /* (No prefetch of the next micro-panel's rows as nx_bf16_pack_b does: measured 4-6% slower
     * here, T=256, K=N=3840, on the AMX Xeon; the q8 kernel is not waiting on this packer.) */
    for (size_t b = 0; b < nb; b++) {
        uint8_t *g = Bp + b * NX_Q8X_BG(1, 0, NX_AMX_NR);
        float *dw = (float *)(g + 8 * NX_AMX_NR * 4);
        const uint8_t *blk = wc + (b0 + b) * NX_Q8_0_BLOCK_BYTES;
        for (int j = 0; j < 16; j++) {
            uint16_t dh = 0;
            if (j < nv) memcpy(&dh, blk + (size_t)j * rowbytes, 2);
            dw[j] = _cvtsh_ss(dh);
        }
        for (int q = 0; q < 8; q++)
            _mm512_store_si512((__m512i *)(g + q * NX_AMX_NR * 4),
                               _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, rowoff,
                                                           blk + 2 + 4 * q, 1));
    }
}

/* The other types' B packers: nx_q8x_avx512.h's decoders, one 16-column vector, the codes shifted
 * back to the signed qw (SUB = off) so that tdpbssd's dot is isum itself. */
#define NX_AMX_PACK_B(T, t, E, H, M, OFF, D, D32, S)                                               \
    static void nx_amx_pack_b_##t(const nx_mm_call *c, size_t j0, size_t ncols, size_t k0,         \
                                  size_t kc, uint8_t *Bp, void *scratch) {                         \
        (void)scratch;                                                                             \
        nx_q8x_pack_b_t(c, j0, ncols, k0, kc, Bp, 1, E, H, M, OFF, D, D32, nx_s_##S);              \
    }
NX_Q8X_TYPES(NX_AMX_PACK_B)
#undef NX_AMX_PACK_B

/* One unit's tile work: result tile TC := A tile TA . B tile TB (tile ids are immediates; the A
 * rows are 32 bytes apart in the panel whatever the tile's width). */
#define NX_AMX_UNIT(TC, TA, TB, a, b)                                                              \
    do {                                                                                           \
        _tile_loadd(TA, (a), 32);                                                                  \
        _tile_loadd(TB, (b), NX_AMX_NR * 4);                                                       \
        _tile_dpbssd(TC, TA, TB);                                                                  \
    } while (0)

/* A round: units (a0, b0) and (a1, b1) into result tiles T0/T1 (A tiles 4/5, B tiles 6/7),
 * stored to ibr. */
#define NX_AMX_ROUND(T0, T1, a0, b0, a1, b1, ibr)                                                  \
    do {                                                                                           \
        _tile_zero(T0);                                                                            \
        _tile_zero(T1);                                                                            \
        NX_AMX_UNIT(T0, 4, 6, (a0), (b0));                                                         \
        NX_AMX_UNIT(T1, 5, 7, (a1), (b1));                                                         \
        _tile_stored(T0, (ibr)[0], NX_AMX_NR * 4);                                                 \
        _tile_stored(T1, (ibr)[1], NX_AMX_NR * 4);                                                 \
    } while (0)

typedef int32_t nx_amx_isums[NX_AMX_MR][NX_AMX_NR];

/* The contract's epilogue (nx_lowp.h) of one group g, on its units' isums i0 (and i1 for H = 2),
 * into the 16 row chains f. */
NX_INLINE void nx_amx_epilogue(__m512 f[NX_AMX_MR], const nx_amx_isums *i0,
                               const nx_amx_isums *i1, const uint8_t *a, const uint8_t *b,
                               const int H, const int M) {
    const float *dx = (const float *)(a + NX_AMX_MR * 32), *ax = dx + NX_AMX_MR;
    const float *sw = (const float *)(b + 8 * NX_AMX_NR * 4);
    const __m512 sw0 = _mm512_load_ps(sw);
    if (H == 1) {
        const __m512 mw0 = M ? _mm512_load_ps(sw + NX_AMX_NR) : _mm512_setzero_ps();
        for (int r = 0; r < NX_AMX_MR; r++) {
            /* acc = fmaf((float)isum, dx * sw, acc) */
            f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512((*i0)[r])),
                                   _mm512_mul_ps(sw0, _mm512_set1_ps(dx[r])), f[r]);
            if (M) /* acc = fmaf(dx * (float)xsum, mw, acc) */
                f[r] = _mm512_fmadd_ps(_mm512_set1_ps(ax[r]), mw0, f[r]);
        }
    } else {
        const __m512 sw1 = _mm512_load_ps(sw + NX_AMX_NR);
        const __m512 mw0 = M ? _mm512_load_ps(sw + 2 * NX_AMX_NR) : _mm512_setzero_ps();
        const __m512 mw1 = M ? _mm512_load_ps(sw + 3 * NX_AMX_NR) : _mm512_setzero_ps();
        for (int r = 0; r < NX_AMX_MR; r++) {
            /* y = (float)isum_0 * sw_0; y = fmaf((float)isum_1, sw_1, y); acc = fmaf(y, dx, acc) */
            __m512 y = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512((*i0)[r])), sw0);
            y = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512((*i1)[r])), sw1, y);
            f[r] = _mm512_fmadd_ps(y, _mm512_set1_ps(dx[r]), f[r]);
            if (M) { /* acc = fmaf(dx * (float)xsum_p, mw_p, acc), p = 0, 1 */
                f[r] = _mm512_fmadd_ps(_mm512_set1_ps(ax[r]), mw0, f[r]);
                f[r] = _mm512_fmadd_ps(_mm512_set1_ps(ax[NX_AMX_MR + r]), mw1, f[r]);
            }
        }
    }
}

/* C[0:mr, 0:nr] := the block chain over ng groups, continued from C unless first.
 * Software-pipelined in rounds of 2 units (H = 1: groups 2i, 2i+1; H = 2: the halves of group
 * i): the tile work of round i+1 (result tiles 2/3 or 0/1, alternating) is issued before the
 * epilogue of round i, so the tile unit and the vector units work at once; the epilogues still
 * run in group order. An odd last group of an H = 1 type runs alone. AG / BG: the panels' group
 * strides. */
NX_INLINE void nx_amx_kern_t(size_t ng, const uint8_t *A, const uint8_t *B, float *C, size_t ldc,
                             int mr, int nr, int first, const int H, const int M, const size_t AG,
                             const size_t BG) {
    _Alignas(64) nx_amx_isums ib[2][2];
    const __mmask16 m = nr >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << nr) - 1u);
    __m512 f[NX_AMX_MR];
    for (int r = 0; r < NX_AMX_MR; r++)
        f[r] = (!first && r < mr) ? _mm512_maskz_loadu_ps(m, C + r * ldc) : _mm512_setzero_ps();
    /* unit u of round i: its A and B tile origins */
#define NX_AMX_UA(i, u) (H == 1 ? A + (2 * (i) + (u)) * AG : A + (i) * AG + 16 * (u))
#define NX_AMX_UB(i, u) (H == 1 ? B + (2 * (i) + (u)) * BG : B + (i) * BG + 4 * NX_AMX_NR * 4 * (u))
    const size_t nrounds = H == 1 ? ng / 2 : ng;
    if (nrounds > 0)
        NX_AMX_ROUND(0, 1, NX_AMX_UA(0, 0), NX_AMX_UB(0, 0), NX_AMX_UA(0, 1), NX_AMX_UB(0, 1),
                     ib[0]);
    for (size_t i = 0; i < nrounds; i++) {
        if (i + 1 < nrounds) {
            if (i % 2 == 0)
                NX_AMX_ROUND(2, 3, NX_AMX_UA(i + 1, 0), NX_AMX_UB(i + 1, 0), NX_AMX_UA(i + 1, 1),
                             NX_AMX_UB(i + 1, 1), ib[1]);
            else
                NX_AMX_ROUND(0, 1, NX_AMX_UA(i + 1, 0), NX_AMX_UB(i + 1, 0), NX_AMX_UA(i + 1, 1),
                             NX_AMX_UB(i + 1, 1), ib[0]);
        }
        const nx_amx_isums *is = ib[i % 2];
        if (H == 1) {
            nx_amx_epilogue(f, &is[0], NULL, A + 2 * i * AG, B + 2 * i * BG, 1, M);
            nx_amx_epilogue(f, &is[1], NULL, A + (2 * i + 1) * AG, B + (2 * i + 1) * BG, 1, M);
        } else {
            nx_amx_epilogue(f, &is[0], &is[1], A + i * AG, B + i * BG, 2, M);
        }
    }
#undef NX_AMX_UA
#undef NX_AMX_UB
    if (H == 1 && ng % 2) {
        const uint8_t *a = A + (ng - 1) * AG, *b = B + (ng - 1) * BG;
        _tile_zero(0);
        NX_AMX_UNIT(0, 4, 6, a, b);
        _tile_stored(0, ib[0][0], NX_AMX_NR * 4);
        nx_amx_epilogue(f, &ib[0][0], NULL, a, b, 1, M);
    }
    for (int r = 0; r < mr; r++) _mm512_mask_storeu_ps(C + r * ldc, m, f[r]);
}

#define NX_AMX_KERN(H, M, AG)                                                                      \
    static void nx_amx_kern_##H##_##M(size_t ng, const uint8_t *A, const uint8_t *B, float *C,     \
                                      size_t ldc, int mr, int nr, int first) {                     \
        nx_amx_kern_t(ng, A, B, C, ldc, mr, nr, first, H, M, AG, NX_Q8X_BG(H, M, NX_AMX_NR));      \
    }
NX_AMX_KERN(1, 0, NX_AMX_AG)
NX_AMX_KERN(1, 1, NX_AMX_AGM)
NX_AMX_KERN(2, 0, NX_AMX_AG)
NX_AMX_KERN(2, 1, NX_AMX_AGM)

/* Palette 1. q8: tmm0-3 results (16 rows x 64 bytes); A tiles tmm4-5 16 x 32 bytes (H = 1) or
 * 16 x 16 (H = 2); B tiles tmm6-7 8 x 64 (H = 1) or 4 x 64 (H = 2). bf16 (H = 0): every tile
 * 16 rows x 64 bytes. */
static void nx_amx_configure(int H) {
    nx_tilecfg cfg = nx_tile_config();
    if (H) {
        for (int t = 4; t < 6; t++) cfg.colsb[t] = (uint16_t)(32 / H);
        for (int t = 6; t < 8; t++) cfg.rows[t] = (uint8_t)(8 / H);
    }
    nx_tile_loadconfig(&cfg);
}

int nx_matmul_q8_amx(const nx_mm_call *c) {
    typedef void (*pack_a_fn)(const float *, size_t, size_t, size_t, uint8_t *, void *);
    typedef void (*pack_b_fn)(const nx_mm_call *, size_t, size_t, size_t, size_t, uint8_t *, void *);
    typedef void (*kern_fn)(size_t, const uint8_t *, const uint8_t *, float *, size_t, int, int, int);
    pack_a_fn pa;
    pack_b_fn pb;
    kern_fn kn;
    size_t ag, bg;
    int H;
    switch (c->type) {
#define NX_AMX_SET(PA, PB, h, M)                                                                   \
    pa = PA, pb = PB, kn = nx_amx_kern_##h##_##M, H = h;                                           \
    ag = M ? NX_AMX_AGM : NX_AMX_AG, bg = NX_Q8X_BG(h, M, NX_AMX_NR);
#define NX_AMX_CASE(T, t, E, h, M, OFF, D, D32, S)                                                 \
    case NX_GGML_##T:                                                                              \
        NX_AMX_SET(!M ? nx_amx_pack_a : h == 1 ? nx_amx_pack_a_m1 : nx_amx_pack_a_m2,              \
                   nx_amx_pack_b_##t, h, M)                                                        \
        break;
    case NX_GGML_Q8_0:
        NX_AMX_SET(nx_amx_pack_a, nx_amx_pack_b, 1, 0)
        break;
        NX_Q8X_TYPES(NX_AMX_CASE)
#undef NX_AMX_SET
#undef NX_AMX_CASE
    default:
        return -2;
    }
    const nx_lowp_tiling tl = {
        NX_AMX_MR, NX_AMX_NR, NX_AMX_KC, NX_AMX_NC, NX_AMX_MC, ag, bg,
        c->K / NX_QK8_0 * NX_Q8_0_BLOCK_BYTES + 64, 0, NX_AMX_JR, pa, pb, kn,
    };
    nx_amx_configure(H);
    const int rc = nx_lowp_blocked(&tl, c);
    _tile_release();
    return rc;
}

/* ------------------------------------------------------------------ bf16 matmul
 *
 * x and the decoded weights rounded by bf() exactly as the bf16 contract says (the same packers'
 * arithmetic as the vdpbf16ps kernel), the products summed by tdpbf16ps in float32 tiles over all
 * of K: per 32-k group one tdpbf16ps of 16 x 16 x 32 per result tile, the groups in order, the
 * tile's float32 sums carried between k-blocks through a packed buffer (exact). tdpbf16ps's
 * own rounding of its 32 products into the accumulator is not the contract's pair chain (Intel
 * documents
 * DAZ/FTZ and round-to-nearest, not the order or the intermediate roundings; on this project's
 * AMX Xeon it matched neither order of fused steps, nor one rounding per pair, nor per group), so
 * this kernel is the one `bf16` variant whose bits are not the spec's (nx_lowp.h: its own
 * clause). What it keeps: every output's operations depend only on K (never on the tile, band,
 * token batch or worker split), so outputs are bit-identical across bands, batches and workers
 * on one machine; and the bf16 error bound of nx_lowp.h, whose chain term it stays inside.
 *
 * Block: 32 tokens x 32 columns = 2 x 2 result tiles (tmm0-3) of out^T, per group 2 A tiles
 * of weights (16 columns x 16 pairs, tmm4/5, rows as decoded) and 2 B tiles of x (16 pairs x 16
 * tokens, tmm6/7). The operands sit this way round so that the weights, decoded afresh for
 * every token block, need no transpose (x is transposed once per call, each output once at the
 * end). Each output's sum is the same tdpbf16ps accumulation of the same pairs in the same
 * order either way round: the outputs were bit-identical to the x-as-A kernel before it (nine
 * shapes and types, AMX Xeon), and one thread on Q4_K / Q6_K, K=3840, N=10240 with shared
 * memory outputs, T=256, went 868-884 / 715-719 -> 904-934 / 781-815 GOP/s (T >= 1024 within
 * noise: the packing is then amortized over 1024 tokens). */
#define NX_AMXBF_MR 32
#define NX_AMXBF_NV 2
#define NX_AMXBF_NR (16 * NX_AMXBF_NV)
/* The tile sums go between k-blocks through the driver's packed C buffer (kern_cp of nx_lowp.h),
 * not through `out` (as before 2026-12-05, with k-blocks of 1024 past 512 tokens to keep that
 * round trip out of L3): out's rows are N floats apart, and for N = 10240 (the FFN's w1 and w3)
 * on 2 MiB pages a block's rows crowd a few cache sets. That round trip still costs most of
 * what the kernel loses to a loop without it (a timing build that skipped it, wrong output:
 * 1420-1430 GOP/s against ~870 at T=1024-4096). So: KC 512 (half the round trips), the weight
 * tiles loaded with TILELOADDT1 (used once per call: the 32 KiB x panel then stays in L1, where
 * at KC 512 plain loads pushed it out), and the next call's 4 KiB of tile sums prefetched
 * during this call's first 8 groups.
 * AMX Xeon (family 6 model 167), 1 thread, K=3840, GOP/s:
 *   - numpy outputs (transparent huge pages), Q4_K, T=256, N=10240, C through `out` -> the
 *     packed buffer at KC 256: 676-693 -> 777-800;
 *   - shared-memory outputs (the workers'; 4 KiB pages), file weights, Q4_K N=10240 / Q6_K
 *     (K=10240, N=3840): through `out` (KC 256 / 1024 by T) -> the packed buffer at KC 256:
 *     T=256 833-857 / 688-710 -> 814-840 / 740-752, T=1024 890-909 / 828 -> 925-966 / 831-876,
 *     T=4096 889-929 / 842-872 -> 912-958 / 836-877;
 *   - the same after the operand swap below, at KC 256 -> KC 512 + TILELOADDT1 + the prefetch,
 *     alternating runs: T=256 905-950 / 786-793 -> 1011-1053 / 867-930, T=1024 890-914 /
 *     846-851 -> 1100-1204 / 985-1062, T=4096 879-904 / 850-852 -> 1098-1202 / 966-1046.
 *     Without the prefetch 3-5% less; KC 512 with plain loads, KC 768 / 1024, NC 256 / 128,
 *     MC 512, all of K in one k-block (NC 64-256), or token sub-blocks over weights packed for
 *     all of K: the same or slower (a loop of calls, one thread).
 *   - MC 1024 -> 512 (2026-12-06), in a denoiser call at 1024x1024 (`zimage-dit-2l-q4km`, a main
 *     layer at T = 4224, bf16, the projections split over token rows): 2 workers, three
 *     alternating process pairs, 893-943 -> 876-891 ms a layer (medians); 1 worker, two pairs,
 *     1749-1848 -> 1654-1668. A block of 1024 tokens keeps 2 MiB of tile sums (1024 x NC 512
 *     floats), the whole L2 of this Xeon, beside the 512 KiB weight panel: at 512 both fit,
 *     for twice the decoding. MC 256: 919-1012 (slower). At 512x512 (576 rows a worker) and in
 *     the autoencoder's decode (2.22-2.35 s against 2.30-2.36) the same within noise.
 *   - F32 / F16 / BF16 weights back at MC 1024 (NX_AMXBF_MC_FLOAT; 2026-12-06, later): there
 *     every token block streams the weights from memory again at 2-4 bytes a weight (0.56 for
 *     Q4_K), so the block count, not L2, bounds it. The same denoiser call at 1024x1024, 2
 *     workers, three alternating process pairs (a build with NX_AMXBF_MC_FLOAT=512 against
 *     the default): the noise refiner (BF16 weights, 2 layers at T = 4096) 2242-2307 ->
 *     2123-2137 ms, the main layers (Q4_K etc., MC 512 both) the same; the autoencoder's decode
 *     (F16 weights, bf16) at 1024x1024 10.62 -> 10.05 s (one pair), at 512x512 the same
 *     (2.58 / 2.63 against 2.55 / 2.63 s).
 * KC and MC do not change the bits: the tile sums are carried exactly. */
#ifndef NX_AMXBF_KC
#define NX_AMXBF_KC 512
#endif
#ifndef NX_AMXBF_NC
#define NX_AMXBF_NC 512
#endif
#ifndef NX_AMXBF_MC
#define NX_AMXBF_MC 512
#endif
/* Token blocks for F32 / F16 / BF16 weights: each block reads the weights from memory again
 * (2 or 4 bytes a weight, against 0.56-1.06 for the quantized types), so fewer, larger blocks
 * (measured above). */
#ifndef NX_AMXBF_MC_FLOAT
#define NX_AMXBF_MC_FLOAT 1024
#endif
_Static_assert(NX_AMXBF_KC % 256 == 0, "KC must hold whole blocks of every type");
_Static_assert(NX_AMXBF_NC % NX_AMXBF_NR == 0, "NC must be a multiple of NR");
_Static_assert(NX_AMXBF_MC % NX_AMXBF_MR == 0, "MC must be a multiple of MR");
_Static_assert(NX_AMXBF_MC_FLOAT % NX_AMXBF_MR == 0, "MC_FLOAT must be a multiple of MR");
/* Per 32-k group (the operands swapped: the tiles compute out^T = W x^T, so neither the weights
 * nor the tile sums are transposed per k-block, only x once per call and each output once):
 *   A micro-panel (x, MR tokens): uint32 pairs[16][MR] (row p = pair p of every token), two B
 *     tiles of 16 tokens at stride MR * 4 bytes;
 *   B micro-panel (weights, NR columns): uint32 pairs[NR][16] (row j = column j's 16 pairs, as
 *     decoded), two A tiles of 16 columns at stride 64. */
#define NX_AMXBF_AG (16 * NX_AMXBF_MR * 4)
#define NX_AMXBF_BG (NX_AMXBF_NR * 64)

static void nx_amxbf_pack_a(const float *x /* IN */, size_t K, size_t t0, size_t rows,
                            uint8_t *Ap /* OUT */, void *scratch) {
    (void)scratch;
    const size_t G = (K + 31) / 32;
    for (size_t h = 0; h < NX_AMXBF_MR / 16; h++)
        for (size_t g = 0; g < G; g++) {
            const size_t k = g * 32, left = K - k;
            const __mmask16 m0 = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u);
            const __mmask16 m1 = left >= 32  ? (__mmask16)0xffff
                                 : left > 16 ? (__mmask16)((1u << (left - 16)) - 1u)
                                             : (__mmask16)0;
            __m512i v[16];
            for (size_t r = 0; r < 16; r++) {
                const size_t t = h * 16 + r;
                const float *src = x + (t0 + t) * K + k;
                v[r] = t < rows ? nx_bf16_pairs32(_mm512_maskz_loadu_ps(m0, src),
                                                  _mm512_maskz_loadu_ps(m1, src + 16))
                                : _mm512_setzero_si512();
            }
            nx_tr16i(v); /* v[p] lane r = pair p of token h * 16 + r */
            uint8_t *dst = Ap + g * NX_AMXBF_AG + h * 64;
            for (int p = 0; p < 16; p++)
                _mm512_store_si512((__m512i *)(dst + p * NX_AMXBF_MR * 4), v[p]);
        }
}

/* ---- fused weight decoders, one per quantized type: one block's exact float32 values (the
 * spec's operations of nx_quants.c, in its order), bf()-rounded, stored as the panel's pair rows:
 * group g of the block (its elements 32g .. 32g+31) at dst + g * gs. They give the bits of
 * dequantize-then-bf() (the test hook NX_MM_DEQUANT_PACK runs that path) at a fraction of its
 * operations: with dequantize, decoding took a quarter to a third of the whole call at T=256
 * (perf, AMX Xeon, Q4_K / Q5_K / Q6_K). AMX Xeon, one thread, K = 3840, N = 3840 (Q4_K, Q5_K,
 * Q6_K: 16384), random codes, ps per weight at T=8 (mostly decoding), dequantize -> fused:
 * Q4_0 135 -> 118, Q4_1 178 -> 162, Q5_0 164 -> 137, Q5_1 207 -> 191, Q2_K 155 -> 120,
 * Q3_K 184 -> 139, Q4_K 112 -> 101, Q5_K 155 -> 124, Q6_K 148 -> 125. The 32-element types,
 * Q2_K and Q3_K take their codes from the q8 kernels' decoders (nx_q8x_avx512.h). */
#ifndef NX_AMXBF_PFD
#define NX_AMXBF_PFD 16
#endif
typedef void (*nx_amxbf_dec_fn)(const uint8_t *blk /* IN */, uint8_t *dst /* OUT */, size_t gs);

/* Q8_0: f32(d) * q in registers. */
static inline void nx_amxbf_dec_q8_0(const uint8_t *p, uint8_t *dst, size_t gs) {
    (void)gs;
    const __m512 d = _mm512_set1_ps(nx_h2f(p));
    const __m128i q0 = _mm_loadu_si128((const __m128i *)(p + 2));
    const __m128i q1 = _mm_loadu_si128((const __m128i *)(p + 18));
    const __m512 lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)), d);
    const __m512 hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)), d);
    _mm512_store_si512((__m512i *)dst, nx_bf16_pairs32(lo, hi));
}

/* Q4_0, Q4_1, Q5_0, Q5_1 (blocks of 32): the block's 16 or 32 possible values (the spec's
 * operations on each code: d * (u - 8), d * u + m, d * (u - 16), d * u + m, the + m with
 * nx_quants' NaN rule), rounded by bf() as one table, looked up by the 32 codes (vpermw: the q8
 * kernels' code decoders of nx_q8x_avx512.h, widened to words). */
static inline __m512 nx_amxbf_iota(float a) {
    return _mm512_add_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                         _mm512_set1_ps(a));
}
/* a 16-value table (words 0-15) looked up by a block's 32 codes (bytes) */
static inline void nx_amxbf_lookup16(__m512 t, __m256i codes, uint8_t *dst) {
    const __m512i tab = _mm512_zextsi256_si512((__m256i)_mm512_cvtneps_pbh(t));
    _mm512_store_si512((__m512i *)dst, _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(codes), tab));
}
/* a 32-value table (t0: codes 0-15, t1: codes 16-31) looked up by a block's 32 codes */
static inline void nx_amxbf_lookup32(__m512 t0, __m512 t1, __m256i codes, uint8_t *dst) {
    const __m512i tab = (__m512i)_mm512_cvtne2ps_pbh(t1, t0);
    _mm512_store_si512((__m512i *)dst, _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(codes), tab));
}
static inline void nx_amxbf_dec_q4_0(const uint8_t *p, uint8_t *dst, size_t gs) {
    (void)gs;
    nx_amxbf_lookup16(_mm512_mul_ps(_mm512_set1_ps(nx_h2f(p)), nx_amxbf_iota(-8.0f)),
                      nx_u_q4_0(p), dst);
}
static inline void nx_amxbf_dec_q4_1(const uint8_t *p, uint8_t *dst, size_t gs) {
    (void)gs;
    const __m512 d = _mm512_set1_ps(nx_h2f(p)), m = _mm512_set1_ps(nx_h2f(p + 2));
    nx_amxbf_lookup16(nx_add_m16(_mm512_mul_ps(d, nx_amxbf_iota(0.0f)), m), nx_u_q4_1(p), dst);
}
static inline void nx_amxbf_dec_q5_0(const uint8_t *p, uint8_t *dst, size_t gs) {
    (void)gs;
    const __m512 d = _mm512_set1_ps(nx_h2f(p));
    const __m512 lo = _mm512_mul_ps(d, nx_amxbf_iota(-16.0f)); /* codes 0-15: d * (u - 16) */
    nx_amxbf_lookup32(lo, _mm512_mul_ps(d, nx_amxbf_iota(0.0f)), nx_u_q5_0(p), dst);
}
static inline void nx_amxbf_dec_q5_1(const uint8_t *p, uint8_t *dst, size_t gs) {
    (void)gs;
    const __m512 d = _mm512_set1_ps(nx_h2f(p)), m = _mm512_set1_ps(nx_h2f(p + 2));
    nx_amxbf_lookup32(nx_add_m16(_mm512_mul_ps(d, nx_amxbf_iota(0.0f)), m),
                      nx_add_m16(_mm512_mul_ps(d, nx_amxbf_iota(16.0f)), m), nx_u_q5_1(p), dst);
}

/* Q4_K and Q5_K: part j of 32 elements has value dl_j * u - ml_j for its 4- or 5-bit code u. A
 * part's 16 or 32 possible values are computed, rounded by bf() as one table of 32 bf16 words,
 * and looked up by the codes (vpermw: its index is a word's low 5 bits). Each table value is
 * one fma(dl, u, -ml): dl = d * sc has at most 11 + 6 significant bits, so dl * u (u < 32) is
 * exact in float32 and the fma's one rounding is the spec's rounding of the subtraction (the
 * same bits; NaN and inf scales give NaN and inf alike). The scales are read back from memory
 * (the barrier), so the broadcasts are loads, not shuffles on port 5. Q4_K: qs[32c .. 32c+32)
 * holds part 2c in its low nibbles, 2c+1 in its high ones; both share one table (words 0-15
 * part 2c+1, 16-31 part 2c). */
static inline void nx_amxbf_k4_scales(const uint8_t *p, float s[32]) {
    const __m512 v = nx_k4_scales16(p);
    _mm512_store_ps(s, v);                                             /* dl_j, then ml_j */
    _mm512_store_ps(s + 16, _mm512_xor_ps(v, _mm512_set1_ps(-0.0f))); /* -dl_j, -ml_j */
    __asm__ volatile("" ::: "memory");
}

static inline void nx_amxbf_dec_q4_K(const uint8_t *p, uint8_t *dst, size_t gs) {
    _Alignas(64) float s[32];
    nx_amxbf_k4_scales(p, s);
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i b16 = _mm512_set1_epi16(16);
    for (int c = 0; c < 4; c++) {
        const int j = 2 * c;
        const __m512 tl = _mm512_fmadd_ps(_mm512_set1_ps(s[j]), iota, _mm512_set1_ps(s[24 + j]));
        const __m512 th =
            _mm512_fmadd_ps(_mm512_set1_ps(s[j + 1]), iota, _mm512_set1_ps(s[25 + j]));
        const __m512i tab = (__m512i)_mm512_cvtne2ps_pbh(tl, th);
        const __m512i w =
            _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(p + 16 + 32 * c)));
        _mm512_store_si512((__m512i *)(dst + j * gs),
                           _mm512_permutexvar_epi16(_mm512_or_si512(w, b16), tab)); /* 16 + lo */
        _mm512_store_si512((__m512i *)(dst + (j + 1) * gs),
                           _mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), tab)); /* hi */
    }
}

/* Q5_K: as Q4_K, the fifth bit of element i of part j being bit j of qh[i]; a table per part. */
static inline void nx_amxbf_dec_q5_K(const uint8_t *p, uint8_t *dst, size_t gs) {
    _Alignas(64) float s[32];
    nx_amxbf_k4_scales(p, s);
    const __m512 i0 = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 i1 = _mm512_add_ps(i0, _mm512_set1_ps(16.0f));
    const __m512i m15 = _mm512_set1_epi16(15), b16 = _mm512_set1_epi16(16);
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(p + 16));
    for (int c = 0; c < 4; c++) {
        const __m512i w =
            _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(p + 48 + 32 * c)));
        for (int h = 0; h < 2; h++) {
            const int j = 2 * c + h;
            const __m512 dl = _mm512_set1_ps(s[j]), nml = _mm512_set1_ps(s[24 + j]);
            const __m512i tab = (__m512i)_mm512_cvtne2ps_pbh(_mm512_fmadd_ps(dl, i1, nml),
                                                             _mm512_fmadd_ps(dl, i0, nml));
            const __m512i lo = h ? _mm512_srli_epi16(w, 4) : _mm512_and_si512(w, m15);
            const __mmask32 hb = _mm256_test_epi8_mask(qh, _mm256_set1_epi8((char)(1 << j)));
            const __m512i u = _mm512_mask_add_epi16(lo, hb, lo, b16); /* the 5-bit code */
            _mm512_store_si512((__m512i *)(dst + j * gs), _mm512_permutexvar_epi16(u, tab));
        }
    }
}

/* Q6_K: element 128h + r has the code (ql[64h + r % 64] >> 4 (r >= 64)) & 15 | ((qh[32h + r % 32]
 * >> 2 (r / 32)) & 3) << 4 and the value dl_(8h + r/16) * (code - 32), dl_i = d * sc_i. The codes
 * of 64 elements at a time as bytes (the high bits moved to bits 4-5 by one word shift per
 * 32-element half), stored, then widened 16 at a time. Its own code decoder, not the q8
 * kernels' nx_u_q6_K (32 bytes at a time), because Q6_K is every Q4_K_M file's w2: with
 * nx_u_q6_K, T=8 ran 134-143 ps per weight against 119-122 (AMX Xeon, one thread, K=N=3840,
 * three alternating runs); Q2_K and Q3_K, rare, take theirs (Q3_K 132 -> 139-143). */
static inline void nx_amxbf_dec_q6_K(const uint8_t *p, uint8_t *dst, size_t gs) {
    _Alignas(64) float dl[16];
    _Alignas(64) int8_t q[128]; /* code - 32 of one half */
    _mm512_store_ps(dl, _mm512_mul_ps(_mm512_set1_ps(nx_h2f(p + 208)),
                                      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                          _mm_loadu_si128((const __m128i *)(p + 192))))));
    __asm__ volatile("" ::: "memory"); /* broadcast from memory: loads, not shuffles */
    const __m512i m4 = _mm512_set1_epi8(15), m30 = _mm512_set1_epi8(0x30);
    const __m512i k32 = _mm512_set1_epi8(32);
    /* per word: the first 32 bytes (16 words) / the last 32 */
    const __m512i sh01 = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
    const __m512i sh23 = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    for (int h = 0; h < 2; h++) {
        const __m512i ql = _mm512_loadu_si512((const void *)(p + 64 * h));
        const __m512i qh =
            _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(p + 128 + 32 * h)));
        /* (a & c) | b: imm 0xEC */
        const __m512i c01 = _mm512_ternarylogic_epi32(
            ql, _mm512_and_si512(_mm512_sllv_epi16(qh, sh01), m30), m4, 0xEC);
        const __m512i c23 = _mm512_ternarylogic_epi32(
            _mm512_srli_epi16(ql, 4), _mm512_and_si512(_mm512_srlv_epi16(qh, sh23), m30), m4, 0xEC);
        _mm512_store_si512((__m512i *)q, _mm512_sub_epi8(c01, k32));
        _mm512_store_si512((__m512i *)(q + 64), _mm512_sub_epi8(c23, k32));
        __asm__ volatile("" ::: "memory"); /* widened from memory: loads, not extracts */
        for (int g = 0; g < 4; g++) {
            const __m128i *qg = (const __m128i *)(q + 32 * g);
            const __m512 lo = _mm512_mul_ps(_mm512_set1_ps(dl[8 * h + 2 * g]),
                                            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(qg[0])));
            const __m512 hi = _mm512_mul_ps(_mm512_set1_ps(dl[8 * h + 2 * g + 1]),
                                            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(qg[1])));
            _mm512_store_si512((__m512i *)(dst + (4 * h + g) * gs), nx_bf16_pairs32(lo, hi));
        }
    }
}

/* Q2_K and Q3_K: the codes of the block (nx_q8x_avx512.h's decoders: element e of part e/16),
 * widened 16 at a time; the value of part i is dl_i * q - ml_i (Q2_K: dl = d * (sc & 15),
 * ml = dmin * (sc >> 4); dl * q is exact, so one fma is the spec's rounding of the subtraction)
 * or dl_i * (u - 4) (Q3_K: dl = d * (6-bit code - 32)). */
static inline void nx_amxbf_dec_q2_K(const uint8_t *p, uint8_t *dst, size_t gs) {
    _Alignas(64) float dl[16], nml[16];
    _Alignas(64) uint8_t u[256];
    const __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    const __m512 d = _mm512_set1_ps(nx_h2f(p + 80)), dm = _mm512_set1_ps(nx_h2f(p + 82));
    const __m512i s15 = _mm512_and_si512(sc, _mm512_set1_epi32(15)), s4 = _mm512_srli_epi32(sc, 4);
    _mm512_store_ps(dl, _mm512_mul_ps(d, _mm512_cvtepi32_ps(s15)));
    _mm512_store_ps(nml, _mm512_xor_ps(_mm512_mul_ps(dm, _mm512_cvtepi32_ps(s4)),
                                       _mm512_set1_ps(-0.0f))); /* -ml, exact */
    nx_u_q2_K(p, u);
    __asm__ volatile("" ::: "memory"); /* widened from memory; scales broadcast from it */
    for (int g = 0; g < 8; g++) {
        const __m128i *ug = (const __m128i *)(u + 32 * g);
        const __m512 lo = _mm512_fmadd_ps(_mm512_set1_ps(dl[2 * g]),
                                          _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(ug[0])),
                                          _mm512_set1_ps(nml[2 * g]));
        const __m512 hi = _mm512_fmadd_ps(_mm512_set1_ps(dl[2 * g + 1]),
                                          _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(ug[1])),
                                          _mm512_set1_ps(nml[2 * g + 1]));
        _mm512_store_si512((__m512i *)(dst + g * gs), nx_bf16_pairs32(lo, hi));
    }
}

static inline void nx_amxbf_dec_q3_K(const uint8_t *p, uint8_t *dst, size_t gs) {
    _Alignas(64) float dl[16];
    _Alignas(64) uint8_t u[256];
    _mm512_store_ps(dl, nx_q3k_scales16(p + 96, nx_h2f(p + 108)));
    nx_u_q3_K(p, u);
    __asm__ volatile("" ::: "memory");
    const __m512i k4 = _mm512_set1_epi32(4);
    for (int g = 0; g < 8; g++) { /* q = u - 4 */
        const __m128i *ug = (const __m128i *)(u + 32 * g);
        const __m512i q0 = _mm512_sub_epi32(_mm512_cvtepu8_epi32(ug[0]), k4);
        const __m512i q1 = _mm512_sub_epi32(_mm512_cvtepu8_epi32(ug[1]), k4);
        const __m512 lo = _mm512_mul_ps(_mm512_set1_ps(dl[2 * g]), _mm512_cvtepi32_ps(q0));
        const __m512 hi = _mm512_mul_ps(_mm512_set1_ps(dl[2 * g + 1]), _mm512_cvtepi32_ps(q1));
        _mm512_store_si512((__m512i *)(dst + g * gs), nx_bf16_pairs32(lo, hi));
    }
}

/* Columns [j0, j0+ncols) x k in [k0, k0+kc): each column's exact float32 values rounded by bf()
 * once, its pairs stored as decoded: by the type's fused decoder (dec) where it has one; F32,
 * F16 and BF16 straight from the row, 32 values a group (BF16 words with bf()'s fixes applied:
 * no float32 round trip); under the NX_MM_DEQUANT_PACK hook, by the call's dequantize into
 * scratch (one decoded row of NX_AMXBF_KC floats). Columns past ncols and k past kc zero. The
 * direct float path, AMX Xeon, BF16 K=3840 N=5120, one thread, shared-memory output: T=8
 * 3.68-3.99 -> 3.27-3.57 ms (the weights' memory stream bounds it), T=1024 43.1-46.8 ->
 * 42.5-43.5 ms. Each column prefetches every cache line of the k-range of the column
 * NX_AMXBF_PFD further on (as nx_bf16_pack_b, one column at a time instead of 16 at once: the
 * same speed, Q6_K a little faster). Until 2026-12-05 it prefetched from the range's first byte
 * in 64-byte steps, which misses the last line of a range that does not start on a line: with
 * the fused decoders, AMX Xeon, Q6_K T=256 968-973 -> 991-992 GOP/s. Distances 8 / 32 / 64 / 128:
 * within noise / 1-3% / 3-7% / 6-9% slower. */
/* bf() of 32 bfloat16 values as words (what widening them to float32 and VCVTNE2PS2BF16 give):
 * a subnormal becomes the zero of its sign, a NaN is quieted (bit 6: float32's bit 22), every
 * other value is itself. (Neither shows in a product: tdpbf16ps treats subnormal inputs as
 * zero, and a NaN's payload is not part of the contract.) */
static inline __m512i nx_amxbf_bf16_words(__m512i v) {
    const __m512i e = _mm512_and_si512(v, _mm512_set1_epi16(0x7f80));
    const __mmask32 sub = _mm512_cmpeq_epi16_mask(e, _mm512_setzero_si512());
    const __mmask32 nan = _mm512_cmpeq_epi16_mask(e, _mm512_set1_epi16(0x7f80)) &
                          _mm512_test_epi16_mask(v, _mm512_set1_epi16(0x007f));
    v = _mm512_mask_mov_epi16(v, sub, _mm512_and_si512(v, _mm512_set1_epi16((short)0x8000)));
    return _mm512_mask_mov_epi16(v, nan, _mm512_or_si512(v, _mm512_set1_epi16(0x0040)));
}

NX_INLINE void nx_amxbf_pack_b_t(const nx_mm_call *c, size_t j0, size_t ncols, size_t k0,
                                 size_t kc, uint8_t *Bp /* OUT */, void *scratch,
                                 nx_amxbf_dec_fn dec) {
    const uint8_t *w = c->w;
    const size_t rowbytes = c->rowbytes, be = c->wt->blck_elems, bb = c->wt->blck_bytes;
    const size_t ng = (kc + 31) / 32, pfb = kc / be * bb;
    float *row = (float *)scratch;
    for (size_t j = 0; j < NX_AMXBF_NR; j++) {
        if (NX_PANEL_PF && j0 + j + NX_AMXBF_PFD < c->n1) { /* column j + PFD's k-range */
            const uintptr_t a = (uintptr_t)(w + (j0 + j + NX_AMXBF_PFD) * rowbytes + k0 / be * bb);
            for (uintptr_t l = a & ~(uintptr_t)63; l < a + pfb; l += 64) /* every line it touches */
                _mm_prefetch((const char *)l, _MM_HINT_T0);
        }
        uint8_t *dst = Bp + j * 64;
        if (j >= ncols) {
            for (size_t g = 0; g < ng; g++)
                _mm512_store_si512((__m512i *)(dst + g * NX_AMXBF_BG), _mm512_setzero_si512());
            continue;
        }
        const uint8_t *src = w + (j0 + j) * rowbytes + k0 / be * bb;
        if (dec) { /* a quantized type: kc is a multiple of its block */
            for (size_t b = 0; b < kc / be; b++)
                dec(src + b * bb, dst + b * (be / 32) * NX_AMXBF_BG, NX_AMXBF_BG);
            continue;
        }
        if (!(c->flags & NX_MM_DEQUANT_PACK) &&
            (c->type == NX_GGML_F32 || c->type == NX_GGML_F16 || c->type == NX_GGML_BF16)) {
            /* F32 / F16 / BF16 straight from the row, a group of 32 values at a time (k past
             * kc zero): the values dequantize gives, then bf() */
            for (size_t g = 0; g < ng; g++) {
                const size_t left = kc - g * 32;
                const __mmask16 m0 = nx_mask16((int64_t)left),
                                m1 = nx_mask16((int64_t)left - 16);
                __m512i v;
                if (c->type == NX_GGML_BF16) {
                    const __mmask32 m =
                        left >= 32 ? (__mmask32)~0u : (__mmask32)((1u << left) - 1u);
                    v = nx_amxbf_bf16_words(_mm512_maskz_loadu_epi16(m, src + g * 64));
                } else if (c->type == NX_GGML_F16) {
                    const uint16_t *h = (const uint16_t *)src + g * 32;
                    v = nx_bf16_pairs32(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m0, h)),
                                        _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m1, h + 16)));
                } else { /* F32 */
                    const float *f = (const float *)src + g * 32;
                    v = nx_bf16_pairs32(_mm512_maskz_loadu_ps(m0, f),
                                        _mm512_maskz_loadu_ps(m1, f + 16));
                }
                _mm512_store_si512((__m512i *)(dst + g * NX_AMXBF_BG), v);
            }
            continue;
        }
        c->dequant(src, row, kc / be); /* exact */
        for (size_t k = kc; k < ng * 32; k++) row[k] = 0.0f;
        for (size_t g = 0; g < ng; g++)
            _mm512_store_si512((__m512i *)(dst + g * NX_AMXBF_BG),
                               nx_bf16_pairs32(_mm512_loadu_ps(row + g * 32),
                                               _mm512_loadu_ps(row + g * 32 + 16)));
    }
}

/* The fused decoders, one row per type: X(GGML type, decoder suffix). */
#define NX_AMXBF_DECODERS(X)                                                                       \
    X(Q8_0, q8_0) X(Q4_0, q4_0) X(Q4_1, q4_1) X(Q5_0, q5_0) X(Q5_1, q5_1)                          \
    X(Q2_K, q2_K) X(Q3_K, q3_K) X(Q4_K, q4_K) X(Q5_K, q5_K) X(Q6_K, q6_K)

static void nx_amxbf_pack_b(const nx_mm_call *c, size_t j0, size_t ncols, size_t k0, size_t kc,
                            uint8_t *Bp /* OUT */, void *scratch) {
    if (!(c->flags & NX_MM_DEQUANT_PACK)) switch (c->type) {
#define NX_AMXBF_CASE(T, t)                                                                        \
    case NX_GGML_##T:                                                                              \
        nx_amxbf_pack_b_t(c, j0, ncols, k0, kc, Bp, scratch, nx_amxbf_dec_##t);                    \
        return;
            NX_AMXBF_DECODERS(NX_AMXBF_CASE)
#undef NX_AMXBF_CASE
        default:
            break;
        }
    nx_amxbf_pack_b_t(c, j0, ncols, k0, kc, Bp, scratch, NULL); /* F32, F16, BF16; the hook */
}

/* out^T block: tile 0 = columns 0-15 x tokens 0-15, 1 = columns 0-15 x tokens 16-31, 2 and 3
 * the same for columns 16-31. The sums over ng groups start from zero (first) or continue from
 * Cp: the four float32 tiles of 1 KiB each (rows 64 bytes apart: 16 consecutive cache lines).
 * Stored back to Cp, or after the last k-block transposed into C[0:mr, 0:nr] (ldc floats per
 * row).
 * In the last k-block the 64 output lines of nout (the driver's next whole tile) are prefetched
 * into L2, spread over the groups (4 a group at 16 groups, 8 at the 8 of K = 3840's last
 * k-block). The output rows are written once per call and miss every cache; stores commit in
 * order, so each tile's 64 missing stores held up the next tiles' stores to Cp until their
 * lines came. AMX Xeon, one thread, Q4_K, K = 3840, N = 5120, a /tmp C loop over
 * nx_matmul_bf16, alternating runs, ms:
 *   - with PREFETCHW: T=256 10.13-10.81 -> 9.80-10.09, T=1024 40.5-44.4 -> 39.7-40.8, T=2048
 *     83.8-86.2 -> 78.7-79.6; a quieter pair with the lines spread: T=256 9.01-9.13 ->
 *     8.98-9.07 (noise), T=1024 38.3-39.1 -> 36.7-37.8;
 *   - PREFETCHW / PREFETCHT1 / none: T=1024 35.5-37.2 / 36.0-36.6 / 37.2-38.5, T=2048 71.0 /
 *     69.8-71.3 / 72.9-75.7. PREFETCHT0 or two tiles ahead: the same. So PREFETCHT1, which
 *     needs no CPUID bit beyond the ISA's (PREFETCHW has its own);
 *   - a timing build that skipped the output stores (wrong output): 36.9-38.7 at T=1024 in the
 *     first pair's conditions. */
static void nx_amxbf_kern(size_t ng, const uint8_t *A, const uint8_t *B, float *Cp, float *C,
                          size_t ldc, int mr, int nr, int first, int last, const float *nout,
                          const float *bias) {
    if (first) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    } else {
        _tile_loadd(0, Cp, 64);
        _tile_loadd(1, Cp + 256, 64);
        _tile_loadd(2, Cp + 512, 64);
        _tile_loadd(3, Cp + 768, 64);
    }
    /* the next call's tiles in the driver's order: 8 of their 64 lines a group (an address, not
     * a pointer into Cp: past its end the hint is dropped) */
    const uintptr_t next = (uintptr_t)Cp + 4096;
    const size_t lpg = ng ? (64 + ng - 1) / ng : 0; /* output lines to prefetch a group */
    if (mr <= 16) /* a micro-panel of at most 16 tokens (a tail): tiles 1 and 3 would hold only
                   * padding rows, never stored, so their loads and dots are skipped */
        for (size_t g = 0; g < ng; g++) {
            const uint8_t *a = A + g * NX_AMXBF_AG, *b = B + g * NX_AMXBF_BG;
            if (Cp && !last && g < 8)
                for (int i = 0; i < 8; i++)
                    _mm_prefetch((const char *)(next + (g * 8 + i) * 64), _MM_HINT_T0);
            _tile_stream_loadd(4, b, 64);
            _tile_stream_loadd(5, b + 16 * 64, 64);
            _tile_loadd(6, a, NX_AMXBF_MR * 4);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(2, 5, 6);
        }
    else
        for (size_t g = 0; g < ng; g++) {
            const uint8_t *a = A + g * NX_AMXBF_AG, *b = B + g * NX_AMXBF_BG;
            if (Cp && !last && g < 8)
                for (int i = 0; i < 8; i++)
                    _mm_prefetch((const char *)(next + (g * 8 + i) * 64), _MM_HINT_T0);
            if (nout) /* the next tile's 64 output lines (32 rows x 2), spread over the groups */
                for (size_t line = g * lpg; line < (g + 1) * lpg && line < 64; line++)
                    _mm_prefetch((const char *)(nout + (line >> 1) * ldc + (line & 1) * 16),
                                 _MM_HINT_T1);
            _tile_stream_loadd(4, b, 64); /* used once per call: keep the x panel in L1 */
            _tile_stream_loadd(5, b + 16 * 64, 64);
            _tile_loadd(6, a, NX_AMXBF_MR * 4);
            _tile_loadd(7, a + 64, NX_AMXBF_MR * 4);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    if (!last) {
        _tile_stored(0, Cp, 64);
        _tile_stored(1, Cp + 256, 64);
        _tile_stored(2, Cp + 512, 64);
        _tile_stored(3, Cp + 768, 64);
        return;
    }
    _Alignas(64) float cb[4][16][16];
    _tile_stored(0, cb[0], 64);
    _tile_stored(1, cb[1], 64);
    _tile_stored(2, cb[2], 64);
    _tile_stored(3, cb[3], 64);
    for (int t = 0; t < 4; t++) {
        const int c0 = (t >> 1) * 16, r0 = (t & 1) * 16; /* first column, first token */
        if (c0 >= nr || r0 >= mr) continue;
        __m512i v[16];
        for (int i = 0; i < 16; i++) v[i] = _mm512_load_si512((const __m512i *)cb[t][i]);
        nx_tr16i(v); /* v[r] lane j = token r0 + r, column c0 + j */
        const __mmask16 m =
            nr - c0 >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (nr - c0)) - 1u);
        if (bias) { /* the driver's add after the sum, while the outputs are in registers */
            const __m512 b = _mm512_maskz_loadu_ps(m, bias + c0);
            for (int r = 0; r < 16 && r0 + r < mr; r++)
                _mm512_mask_storeu_ps(C + (size_t)(r0 + r) * ldc + c0, m,
                                      _mm512_add_ps(_mm512_castsi512_ps(v[r]), b));
            continue;
        }
        for (int r = 0; r < 16 && r0 + r < mr; r++)
            _mm512_mask_storeu_ps(C + (size_t)(r0 + r) * ldc + c0, m, _mm512_castsi512_ps(v[r]));
    }
}

int nx_matmul_bf16_amx(const nx_mm_call *c) {
    if (!c->wt || !c->dequant) return -2;
    const int float_w = c->type == NX_GGML_F32 || c->type == NX_GGML_F16 || c->type == NX_GGML_BF16;
    const nx_lowp_tiling tl = {
        NX_AMXBF_MR,     NX_AMXBF_NR,     NX_AMXBF_KC, NX_AMXBF_NC,
        float_w ? NX_AMXBF_MC_FLOAT : NX_AMXBF_MC,
        NX_AMXBF_AG,     NX_AMXBF_BG,     0,           NX_AMXBF_KC * sizeof(float),
        0,               nx_amxbf_pack_a, nx_amxbf_pack_b,
        NULL,            nx_amxbf_kern,
    };
    nx_amx_configure(0);
    const int rc = nx_lowp_blocked(&tl, c);
    _tile_release();
    return rc;
}

const nx_lowp_table nx_lowp_table_amx = {.matmul_bf16 = nx_matmul_bf16_amx,
                                         .matmul_q8 = nx_matmul_q8_amx};
