/* nx_lowp_amx.c -- the amx table of the "lowp" family: the `q8` matmul of Q8_0 weights on the AMX
 * tile unit (tdpbssd: signed int8 x signed int8 -> int32), its panels and its tile configuration.
 *
 * Owns: the AMX q8 panel layouts, the 32 x 32 tile block and the palette-1 tile configuration
 * (loaded at entry, released at exit of every call, in the calling thread). The arithmetic is the
 * q8 contract of nx_lowp.h unchanged: each 32-k block's integer dot is exact in int32 whichever
 * unit computes it, and the float epilogue (s = dx * dw, one rounding; acc = fma((float)isum, s,
 * acc), blocks in order) is the AVX-512 one, so the result is the spec's, bit for bit.
 * Entered only when the probe reports the amx ISA (AMX-TILE/INT8/BF16, the OS tile state and the
 * Linux XTILEDATA permission). Weight types other than Q8_0 run the avx512 q8 kernel.
 * Must not: change the per-output block order or arithmetic of nx_lowp.h, allocate per tile, or
 * leave a tile configuration loaded when it returns.
 */
#include "nx_lowp.h"

#include <immintrin.h>
#include <string.h>

#include "nx_lowp_bf16_pack.h"
#include "nx_q8_0.h"

/* The block: 16 tokens x 16 columns, up to 4 consecutive 32-k groups per round. Each group g of
 * a round has its own int32 result tile (tmm0..3, 16 x 16 int32, zeroed per round: a group's
 * integer dot is exact, |isum| <= 32 * 128 * 128, and never carried into the next), its A tile
 * (16 tokens x 32 int8) and B tile (8 k-quads x 16 columns x 4 int8), alternating between tmm4/5
 * and tmm6/7; one tdpbssd of 16 x 16 x 32 each. Then the 4 result tiles are stored (4 KiB, L1)
 * and the contract's epilogue runs on zmm in group order (cvt, mul, fma per row), the 16 float32
 * chains held in registers across rounds. Measured on this project's AMX Xeon (2 cores, KVM),
 * register/L1-resident panels, 1 thread: a 32 x 32 block with one group per round reached
 * ~670 GOP/s (its tile work and its epilogue ran one after the other: 1316 and ~1240 GOP/s
 * alone); this 16 x 16, 4-groups-per-round block ~1310 GOP/s (the epilogue of one round overlaps
 * the tile work of the next). */
#define NX_AMX_MR 16
#define NX_AMX_NR 16
#define NX_AMX_RG 2 /* groups per round: one result tile each */
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

/* Per 32-k group (one Q8_0 block):
 *   A micro-panel: int8 qx[MR][32] (row r = token r's codes), float dx[MR]
 *   B micro-panel: int8 quads[8][NR][4] (row q = for each column j its codes 4q..4q+3),
 *                  float dw[NR] */
#define NX_AMX_AG (NX_AMX_MR * 32 + NX_AMX_MR * 4)
#define NX_AMX_BG (8 * NX_AMX_NR * 4 + NX_AMX_NR * 4)

/* nx_q8_0_act_scale on zmm: the same d (the max of |x| is exact in any order); a block holding a
 * NaN takes the scalar spec itself. */
static inline float nx_amx_act_scale(const float *xb /* IN [32] */) {
    const __m512 a0 = _mm512_abs_ps(_mm512_loadu_ps(xb)), a1 = _mm512_abs_ps(_mm512_loadu_ps(xb + 16));
    if (_mm512_cmp_ps_mask(a0, a0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(a1, a1, _CMP_UNORD_Q))
        return nx_q8_0_act_scale(xb);
    const float d = _mm512_reduce_max_ps(_mm512_max_ps(a0, a1)) / 127.0f;
    return d < 0x1p-126f ? 0.0f : d;
}

static void nx_amx_pack_a(const float *x /* IN */, size_t K, size_t t0, size_t rows,
                          uint8_t *Ap /* OUT */, void *scratch) {
    const size_t nb = K / NX_QK8_0;
    uint8_t *q = (uint8_t *)scratch; /* one quantized row: nb * 34 bytes */
    for (size_t r = 0; r < NX_AMX_MR; r++) {
        if (r < rows) nx_q8_0_quantize_avx512(x + (t0 + r) * K, q, nb);
        for (size_t b = 0; b < nb; b++) {
            uint8_t *g = Ap + b * NX_AMX_AG;
            float *dx = (float *)(g + NX_AMX_MR * 32);
            if (r >= rows) {
                memset(g + r * 32, 0, 32);
                dx[r] = 0.0f;
                continue;
            }
            memcpy(g + r * 32, q + b * NX_Q8_0_BLOCK_BYTES + 2, 32);
            dx[r] = nx_amx_act_scale(x + (t0 + r) * K + b * NX_QK8_0); /* as the spec */
        }
    }
}

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
    for (size_t b = 0; b < nb; b++) {
        uint8_t *g = Bp + b * NX_AMX_BG;
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

/* One group's tile work: result tile TC := A tile TA . B tile TB (tile ids are immediates). */
#define NX_AMX_GROUP(TC, TA, TB, a, b)                                                             \
    do {                                                                                           \
        _tile_loadd(TA, (a), 32);                                                                  \
        _tile_loadd(TB, (b), NX_AMX_NR * 4);                                                       \
        _tile_dpbssd(TC, TA, TB);                                                                  \
    } while (0)

/* The epilogue of the groups k < rg of a round, in group order (the contract's chain). */
NX_INLINE void nx_amx_epilogue(__m512 f[NX_AMX_MR], const int32_t ib[NX_AMX_RG][NX_AMX_MR][NX_AMX_NR],
                               const uint8_t *a, const uint8_t *b, size_t rg) {
    for (size_t k = 0; k < rg; k++) {
        const float *dx = (const float *)(a + k * NX_AMX_AG + NX_AMX_MR * 32);
        const __m512 dw = _mm512_load_ps((const float *)(b + k * NX_AMX_BG + 8 * NX_AMX_NR * 4));
        for (int r = 0; r < NX_AMX_MR; r++)
            f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(ib[k][r])),
                                   _mm512_mul_ps(dw, _mm512_set1_ps(dx[r])), f[r]);
    }
}

/* Round r (2 groups) into result tiles T0/T1 (A tiles 4/5, B tiles 6/7), stored to ibr. */
#define NX_AMX_ROUND2(T0, T1, a, b, ibr)                                                           \
    do {                                                                                           \
        _tile_zero(T0);                                                                            \
        _tile_zero(T1);                                                                            \
        NX_AMX_GROUP(T0, 4, 6, (a), (b));                                                          \
        NX_AMX_GROUP(T1, 5, 7, (a) + NX_AMX_AG, (b) + NX_AMX_BG);                                  \
        _tile_stored(T0, (ibr)[0], NX_AMX_NR * 4);                                                 \
        _tile_stored(T1, (ibr)[1], NX_AMX_NR * 4);                                                 \
    } while (0)

/* C[0:mr, 0:nr] := the block chain over ng groups, continued from C unless first.
 * Software-pipelined in rounds of 2 groups: the tile work of round i+1 (result tiles 2/3 or 0/1,
 * alternating) is issued before the epilogue of round i, so the tile unit and the vector units
 * work at once; the epilogues still run in group order. An odd last group runs alone. */
static void nx_amx_kern(size_t ng, const uint8_t *A, const uint8_t *B, float *C, size_t ldc,
                        int mr, int nr, int first) {
    _Alignas(64) int32_t ib[2][NX_AMX_RG][NX_AMX_MR][NX_AMX_NR];
    const __mmask16 m = nr >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << nr) - 1u);
    __m512 f[NX_AMX_MR];
    for (int r = 0; r < NX_AMX_MR; r++)
        f[r] = (!first && r < mr) ? _mm512_maskz_loadu_ps(m, C + r * ldc) : _mm512_setzero_ps();
    const size_t nr2 = ng / 2; /* whole rounds */
    if (nr2 > 0) NX_AMX_ROUND2(0, 1, A, B, ib[0]);
    for (size_t i = 0; i < nr2; i++) {
        const uint8_t *a = A + 2 * i * NX_AMX_AG, *b = B + 2 * i * NX_AMX_BG;
        if (i + 1 < nr2) {
            if (i % 2 == 0)
                NX_AMX_ROUND2(2, 3, a + 2 * NX_AMX_AG, b + 2 * NX_AMX_BG, ib[1]);
            else
                NX_AMX_ROUND2(0, 1, a + 2 * NX_AMX_AG, b + 2 * NX_AMX_BG, ib[0]);
        }
        nx_amx_epilogue(f, (const int32_t(*)[NX_AMX_MR][NX_AMX_NR])ib[i % 2], a, b, 2);
    }
    if (ng % 2) {
        const uint8_t *a = A + (ng - 1) * NX_AMX_AG, *b = B + (ng - 1) * NX_AMX_BG;
        _tile_zero(0);
        NX_AMX_GROUP(0, 4, 6, a, b);
        _tile_stored(0, ib[0][0], NX_AMX_NR * 4);
        nx_amx_epilogue(f, (const int32_t(*)[NX_AMX_MR][NX_AMX_NR])ib[0], a, b, 1);
    }
    for (int r = 0; r < mr; r++) _mm512_mask_storeu_ps(C + r * ldc, m, f[r]);
}

/* Palette 1, q8: tmm0-3 results (16 rows x 64 bytes), tmm4-5 A (16 x 32), tmm6-7 B (8 x 64);
 * bf16: every tile 16 rows x 64 bytes. */
typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} nx_amx_tilecfg;

static void nx_amx_configure(int bf16) {
    nx_amx_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) cfg.colsb[t] = 64, cfg.rows[t] = 16;
    if (!bf16) {
        for (int t = 4; t < 6; t++) cfg.colsb[t] = 32;
        for (int t = 6; t < 8; t++) cfg.rows[t] = 8;
    }
    _tile_loadconfig(&cfg);
}

int nx_matmul_q8_amx(const nx_mm_call *c) {
    if (c->type != NX_GGML_Q8_0) return nx_matmul_q8_avx512(c);
    const nx_lowp_tiling tl = {
        NX_AMX_MR,  NX_AMX_NR, NX_AMX_KC,     NX_AMX_NC,
        NX_AMX_MC,  NX_AMX_AG, NX_AMX_BG,     c->K / NX_QK8_0 * NX_Q8_0_BLOCK_BYTES + 64,
        0,          NX_AMX_JR, nx_amx_pack_a, nx_amx_pack_b,
        nx_amx_kern,
    };
    nx_amx_configure(0);
    const int rc = nx_lowp_blocked(&tl, c);
    _tile_release();
    return rc;
}

/* ------------------------------------------------------------------ bf16 matmul
 *
 * x and the decoded weights rounded by bf() exactly as the bf16 contract says (the same packers'
 * arithmetic as the vdpbf16ps kernel), the products summed by tdpbf16ps in float32 tiles over all
 * of K: per 32-k group one tdpbf16ps of 16 x 16 x 32 per result tile, the groups in order, the
 * tile's float32 sums carried between k-blocks through `out` (exact). tdpbf16ps's own rounding
 * of its 32 products into the accumulator is not the contract's pair chain (Intel documents
 * DAZ/FTZ and round-to-nearest, not the order or the intermediate roundings; on this project's
 * AMX Xeon it matched neither order of fused steps, nor one rounding per pair, nor per group), so
 * this kernel is the one `bf16` variant whose bits are not the spec's (nx_lowp.h: its own
 * clause). What it keeps: every output's operations depend only on K (never on the tile, band,
 * token batch or worker split), so outputs are bit-identical across bands, batches and workers
 * on one machine; and the bf16 error bound of nx_lowp.h, whose chain term it stays inside.
 *
 * Block: 32 tokens x 32 columns = 2 x 2 result tiles (tmm0-3), 2 A tiles (16 tokens x 16
 * pairs, tmm4/5) and 2 B tiles (16 pairs x 16 columns, tmm6/7) per group. */
#define NX_AMXBF_MR 32
#define NX_AMXBF_NV 2
#define NX_AMXBF_NR (16 * NX_AMXBF_NV)
#ifndef NX_AMXBF_KC
#define NX_AMXBF_KC 256
#endif
#ifndef NX_AMXBF_NC
#define NX_AMXBF_NC 512
#endif
#ifndef NX_AMXBF_MC
#define NX_AMXBF_MC 1024
#endif
_Static_assert(NX_AMXBF_KC % 256 == 0, "KC must hold whole blocks of every type");
_Static_assert(NX_AMXBF_NC % NX_AMXBF_NR == 0, "NC must be a multiple of NR");
_Static_assert(NX_AMXBF_MC % NX_AMXBF_MR == 0, "MC must be a multiple of MR");
/* Per 32-k group: A micro-panel uint32 pairs[MR][16] (row r = token r's 16 pairs: an A tile of
 * 16 rows at stride 64); B micro-panel uint32 pairs[16][NR] (nx_lowp_bf16_pack.h). */
#define NX_AMXBF_AG (NX_AMXBF_MR * 64)
#define NX_AMXBF_BG (16 * NX_AMXBF_NR * 4)

static void nx_amxbf_pack_a(const float *x /* IN */, size_t K, size_t t0, size_t rows,
                            uint8_t *Ap /* OUT */, void *scratch) {
    (void)scratch;
    const size_t G = (K + 31) / 32;
    for (size_t r = 0; r < NX_AMXBF_MR; r++) {
        const float *src = x + (t0 + r) * K;
        for (size_t g = 0; g < G; g++) {
            __m512i v = _mm512_setzero_si512();
            if (r < rows) {
                const size_t k = g * 32, left = K - k;
                const __mmask16 m0 =
                    left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u);
                const __mmask16 m1 = left >= 32  ? (__mmask16)0xffff
                                     : left > 16 ? (__mmask16)((1u << (left - 16)) - 1u)
                                                 : (__mmask16)0;
                v = nx_bf16_pairs32(_mm512_maskz_loadu_ps(m0, src + k),
                                    _mm512_maskz_loadu_ps(m1, src + k + 16));
            }
            _mm512_store_si512((__m512i *)(Ap + g * NX_AMXBF_AG + r * 64), v);
        }
    }
}

static void nx_amxbf_pack_b(const nx_mm_call *c, size_t j0, size_t ncols, size_t k0, size_t kc,
                            uint8_t *Bp /* OUT */, void *scratch) {
    nx_bf16_pack_b(c, j0, ncols, k0, kc, Bp, scratch, NX_AMXBF_NV, NX_AMXBF_KC);
}

/* C[0:mr, 0:nr] := the tile sums over ng groups, continued from C unless first. A full 32 x 32
 * block loads and stores its tiles at C itself; an edge block goes through a 4 KiB buffer. */
static void nx_amxbf_kern(size_t ng, const uint8_t *A, const uint8_t *B, float *C, size_t ldc,
                          int mr, int nr, int first) {
    _Alignas(64) float cb[NX_AMXBF_MR][NX_AMXBF_NR];
    const int full = mr == NX_AMXBF_MR && nr == NX_AMXBF_NR;
    float *cp = full ? C : &cb[0][0];
    const size_t stride = (full ? ldc : NX_AMXBF_NR) * sizeof(float);
    if (first) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    } else {
        if (!full) {
            memset(cb, 0, sizeof cb);
            for (int r = 0; r < mr; r++) memcpy(cb[r], C + r * ldc, (size_t)nr * sizeof(float));
        }
        const size_t rs = stride / sizeof(float);
        _tile_loadd(0, cp, stride);
        _tile_loadd(1, cp + 16, stride);
        _tile_loadd(2, cp + 16 * rs, stride);
        _tile_loadd(3, cp + 16 * rs + 16, stride);
    }
    for (size_t g = 0; g < ng; g++) {
        const uint8_t *a = A + g * NX_AMXBF_AG, *b = B + g * NX_AMXBF_BG;
        _tile_loadd(4, a, 64);
        _tile_loadd(5, a + 16 * 64, 64);
        _tile_loadd(6, b, NX_AMXBF_NR * 4);
        _tile_loadd(7, b + 64, NX_AMXBF_NR * 4);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    const size_t rs = stride / sizeof(float);
    _tile_stored(0, cp, stride);
    _tile_stored(1, cp + 16, stride);
    _tile_stored(2, cp + 16 * rs, stride);
    _tile_stored(3, cp + 16 * rs + 16, stride);
    if (!full)
        for (int r = 0; r < mr; r++) memcpy(C + r * ldc, cb[r], (size_t)nr * sizeof(float));
}

int nx_matmul_bf16_amx(const nx_mm_call *c) {
    if (!c->wt || !c->dequant) return -2;
    const nx_lowp_tiling tl = {
        NX_AMXBF_MR,     NX_AMXBF_NR,     NX_AMXBF_KC, NX_AMXBF_NC, NX_AMXBF_MC,
        NX_AMXBF_AG,     NX_AMXBF_BG,     0,           16 * NX_AMXBF_KC * sizeof(float),
        0,               nx_amxbf_pack_a, nx_amxbf_pack_b, nx_amxbf_kern,
    };
    nx_amx_configure(1);
    const int rc = nx_lowp_blocked(&tl, c);
    _tile_release();
    return rc;
}

const nx_lowp_table nx_lowp_table_amx = {.matmul_bf16 = nx_matmul_bf16_amx,
                                         .matmul_q8 = nx_matmul_q8_amx};
