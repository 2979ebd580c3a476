/* nx_matmul.h -- the weight-type-agnostic matmul out = x @ W^T (+ bias) and the adaLN linear.
 *
 * Owns the matmul's arithmetic contract, its scalar spec, the cache-blocked driver the SIMD
 * variants share, and the matmul dispatch family. The driver knows a weight type only by its
 * traits (nx_wtype.h: elements / bytes per block, the dequantize of the ISA); the SIMD files
 * supply the register micro-kernel and panel packers. Must not: allocate per tile, spawn threads,
 * or read/write outside the ranges given (callers validate shapes before entering C).
 *
 * Arithmetic contract (every ISA, every weight type, bit-identical):
 *   w[n, k] = dequantize(row n of the stored bytes)[k]  (nx_wtype.h; exact in float32 for F32,
 *             F16, BF16 and Q8_0, so for those types W as stored and W dequantized to float32
 *             give the same bits)
 *   out[t, n] = two-level sum over k: K is cut into chunks c of NX_MM_CHAIN (=128) steps at
 *               absolute offsets 0, 128, 256, ...; inside a chunk one float32 fused-multiply-add
 *               chain from +0:  p_c = fmaf(x[t, k], w[n, k], p_c);  then, in chunk order,
 *               acc = p_0;  acc = acc + p_c  (one float32 add per later chunk);
 *               out[t, n] = acc, or acc + bias[n] (one float32 add) when a bias is given.
 *               The empty sum (K = 0) is +0.
 * Why two levels: a single K-long chain has a worst-case error growing with K (and measured 2.2x
 * the max error of OpenBLAS's float32 sgemm at K=768); 128-step chunks bound the chain length
 * at the cost of one C-tile load/add/store per 128 k-steps (~2% at K=3840).
 * The order depends on nothing but K: not on n0/n1, on the tile a column or token falls in, on
 * T, or on the weight type's storage, so any split of the work into column bands / token batches
 * gives bit-identical output. The generic (scalar) variant is the spec (nx_mm_dot_rows below);
 * SIMD variants run the same order in vector lanes.
 */
#ifndef NX_MATMUL_H
#define NX_MATMUL_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "nx_cpu.h"
#include "nx_dispatch.h"
#include "nx_wtype.h"

#define NX_MM_CHAIN 128     /* k-steps per fmaf chain in the two-level sum */
#define NX_MM_KC_ALIGN 256  /* every tiling's KC is a multiple: a block (<= 256) never straddles */
#define NX_MM_PACK_SPAN 256 /* k-values the generic packer dequantizes per row at a time */
_Static_assert(NX_MM_KC_ALIGN % NX_MM_CHAIN == 0 && NX_MM_KC_ALIGN % NX_WTYPE_MAX_BLOCK == 0,
               "k-blocks must hold whole chains and whole blocks");
_Static_assert(NX_MM_PACK_SPAN % NX_WTYPE_MAX_BLOCK == 0, "pack span must hold whole blocks");

/* The SwiGLU of two rows: out[i] = silu(a[i]) * b[i], i in [i0, i1) (nx_ops.h's swiglu slot). */
typedef void (*nx_glu_fn)(const float *a, const float *b, float *out, int64_t i0, int64_t i1);

/* Rows [t0, t0 + rows) of an implicit x [T, K] into dst [rows, K] (nx_mm_call's a_rows). */
typedef void (*nx_mm_rows_fn)(const void *a_ctx, size_t t0, size_t rows, float *dst /* OUT */);

/* One matmul call, as handed to a variant (the dispatch fills every field). */
typedef struct {
    const nx_wtype_traits *wt; /* the weight type */
    nx_dequant_fn dequant;     /* its dequantize at the requested ISA */
    uint32_t type;             /* GGML type id of wt */
    const float *x;            /* IN  [T, K] */
    const uint8_t *w;          /* IN  [N rows of rowbytes = K / blck_elems * blck_bytes] */
    const float *bias;         /* IN  [N] or NULL */
    float *out;                /* OUT [T, N], columns [n0, n1) */
    size_t T, K, N, n0, n1, rowbytes;
    unsigned flags; /* NX_MM_* */
    /* The gated form (a SwiGLU feed-forward's first projection; NULL / NULL for a plain call):
     * out[t, n] := glu(x . gate_n, x . up_n) with gate = w and up = w_up, rows of the same type
     * and shape; bias NULL. Each product is the plain call's own output, bit for bit, and glu
     * runs on it as on the plain outputs, so the result is the bits of two plain calls and
     * glu's pass over them. */
    const uint8_t *w_up; /* IN [N rows of rowbytes] */
    nx_glu_fn glu;
    /* An implicit x (the blocked drivers, float32 and lowp; NULL: x is read): a_rows(a_ctx, t0,
     * rows, dst) writes rows [t0, t0 + rows) of x, rows <= the tiling's MR, to dst [rows, K]
     * (row stride K), and the driver packs them from there as it packs x's own rows. The bits
     * are the call's on the materialized x (each packer reads only rows < rows). The 3x3
     * convolution's im2col rows come so (nx_conv.h's nx_conv3x3), never as a whole matrix. */
    nx_mm_rows_fn a_rows;
    const void *a_ctx;
} nx_mm_call;

/* The gated call c (c->w_up, c->glu set) on a driver `mm` that runs plain calls only (the
 * generic specs; the blocked drivers nx_matmul_blocked / nx_lowp_blocked run it themselves): per
 * chunk of at most NX_MM_GLU_CHUNK columns of [n0, n1), the gate into out and the up into a
 * T x chunk scratch (its rows of w_up as a call of their own: the bits of any band), then glu
 * row by row. Returns mm's code, or -1 when the scratch could not be allocated. */
#define NX_MM_GLU_CHUNK 512
int nx_mm_glu_split(const nx_mm_call *c, int (*mm)(const nx_mm_call *));

/* What every matmul driver (nx_matmul_blocked, nx_lowp_blocked) does before blocking: nothing for
 * T = 0 or an empty band; for K = 0 the empty sum is +0, so out[t, n] = 0 (+ bias[n]) on the band.
 * Returns 1 if the call is thereby done. */
static inline int nx_mm_trivial(const nx_mm_call *c) {
    if (c->T == 0 || c->n0 >= c->n1) return 1;
    if (c->K == 0) {
        for (size_t t = 0; t < c->T; t++)
            for (size_t n = c->n0; n < c->n1; n++)
                c->out[t * c->N + n] = c->bias ? 0.0f + c->bias[n] : 0.0f;
        return 1;
    }
    return 0;
}

/* Test hook: pack panels with the ISA's generic dequantize-and-transpose packer even where a
 * fused packer exists (so the generic packer is tested on every type). */
#define NX_MM_DEQUANT_PACK 1u

/* ---- matmul: out[t, n] for t in [0, T), n in [n0, n1) (contract above).
 * x: [T, K] row-major float32; w: N rows of K / blck_elems blocks of `type`, row stride rowbytes;
 * bias: [N] or NULL; out: [T, N]. K % blck_elems == 0, 0 <= n0 <= n1 <= N. Columns outside
 * [n0, n1) are not touched. Returns 0, -1 when scratch memory could not be allocated (out is then
 * unspecified in the band), -2 for an unsupported type. */
int nx_matmul(nx_isa isa, uint32_t type, const float *x /* IN [T*K] */,
              const uint8_t *w /* IN [N*rowbytes] */, const float *bias /* IN [N] or NULL */,
              float *out /* OUT [T*N] */, size_t T, size_t K, size_t N, size_t n0, size_t n1);
int nx_matmul_ex(nx_isa isa, uint32_t type, const float *x, const uint8_t *w, const float *bias,
                 float *out, size_t T, size_t K, size_t N, size_t n0, size_t n1, unsigned flags);
/* The gated matmul (nx_mm_call's w_up): out[t, n] := silu(x . w_n) * (x . w_up_n), n in [n0, n1),
 * glu being nx_ops' swiglu at `isa`: the bits of nx_matmul for w and for w_up, then nx_swiglu_f32
 * on the two, at `isa`. Same shapes and return codes as nx_matmul_ex (no bias). */
int nx_matmul_glu(nx_isa isa, uint32_t type, const float *x, const uint8_t *w, const uint8_t *w_up,
                  float *out, size_t T, size_t K, size_t N, size_t n0, size_t n1, unsigned flags);

/* The family's slots: matmul = the whole matmul of a call (generic: the scalar spec; SIMD: the
 * blocked driver with that ISA's tiling); matmul_packer(type) = which packer that matmul uses for
 * a type: 0 none (the spec), 1 a fused packer, 2 the generic dequantize-and-transpose packer. */
#define NX_MM_SLOTS(X)                                                                             \
    X(matmul, int, (const nx_mm_call *c))                                                          \
    X(matmul_packer, int, (uint32_t type))
NX_DECLARE_FAMILY(nx_mm, NX_MM_SLOTS)
extern const nx_mm_table nx_mm_table_generic; /* nx_matmul.c */
extern const nx_mm_table nx_mm_table_avx2;    /* nx_matmul_avx2.c */
extern const nx_mm_table nx_mm_table_avx512;  /* nx_matmul_avx512.c */

int nx_matmul_generic(const nx_mm_call *c);
int nx_matmul_avx2(const nx_mm_call *c);
int nx_matmul_avx512(const nx_mm_call *c);

/* nx_mm_get(isa)->matmul_packer(type), or -1 for an unsupported type. */
int nx_matmul_packer(nx_isa isa, uint32_t type);

/* ---- the cache-blocked driver shared by the SIMD variants (BLIS loop order):
 *   for each block of mc <= MC tokens: pack x rows into MR-row micro-panels (Ap, all of K)
 *     for each block of nc <= NC columns in [n0, n1):
 *       for each k-block of kc <= KC steps (KC % 256 == 0): pack_b writes NR-column panels (Bp)
 *         for each MR x NR tile and each NX_MM_CHAIN-step chunk of the k-block: kern
 *       then, with a bias, out[t, n] = out[t, n] + bias[n] over the block (one float32 add).
 * A variant supplies its tile sizes and
 *   pack_b(c, j0, nc, b0, kb, Bp): columns [j0, j0+nc) x blocks [b0, b0+kb) of the weight into
 *     Bp, panel p (NR columns) at Bp + p*kc*NR, element [k*NR + j] = w[j0 + NR*p + j,
 *     blck_elems*b0 + k] (kc = blck_elems*kb); columns past nc are zero. pack_rows is the
 *     generic one (c->dequant a few rows into a stack scratch, then transpose); pack_fused[t]
 *     an optional faster one for type t (decodes and transposes in registers, same values).
 *   kern(mr, nr, kc, A, B, C, ldc, first): one chunk (kc <= NX_MM_CHAIN) of the contract's
 *     two-level sum for C[0:mr, 0:nr] (ldc floats per row): p = fma chain from +0 over
 *     A[k*MR + r] * B[k*NR + j]; C = first ? p : C + p.  Rows >= mr of A are zero padding.
 * The chunk order per output depends only on K, never on the tile an output falls in, so the
 * blocking keeps the contract (and every band / batch split) bit for bit. */
typedef void (*nx_mm_pack_fn)(const nx_mm_call *c, size_t j0, size_t nc, size_t b0, size_t kb,
                              float *Bp /* OUT */);
typedef struct {
    size_t mr, nr, kc, nc, mc; /* MR x NR register tile; KC % NX_MM_KC_ALIGN == 0, NC % NR == 0,
                                * MC % MR == 0 */
    nx_mm_pack_fn pack_rows;
    nx_mm_pack_fn pack_fused[NX_GGML_TYPE_COUNT];
    void (*kern)(int mr, int nr, size_t kc, const float *A, const float *B, float *C, size_t ldc,
                 int first);
} nx_mm_tiling;

/* 1 if tl has a fused packer for `type`, else 2 (what a SIMD file's matmul_packer returns). */
static inline int nx_mm_tiling_packer(const nx_mm_tiling *tl, uint32_t type) {
    return type < NX_GGML_TYPE_COUNT && tl->pack_fused[type] ? 1 : 2;
}

/* Runs the driver above for call c. Scratch: one packed activation block (MC*K floats) and one
 * weight panel (NC*KC floats), 64-byte aligned, allocated once per call. Returns 0 or -1. */
int nx_matmul_blocked(const nx_mm_tiling *tl, const nx_mm_call *c);

/* A call c whose x is implicit (rows made by a_rows(a_ctx, t0, rows, dst) into dst [rows, K]),
 * run on `mm`: a blocked driver (blocked != 0) gets a_rows and asks for one micro-panel's rows
 * at a time; a spec, which reads x whole, gets chunks of NX_MM_ROWS_CHUNK rows materialized in
 * turn. Returns mm's code (-1: no memory for a chunk). The bits of mm on the materialized x.
 * nx_matmul_rows (float32) and nx_matmul_bf16_rows (nx_lowp.h) run their calls through it. */
#define NX_MM_ROWS_CHUNK 64
int nx_mm_run_rows(nx_mm_call *c, int (*mm)(const nx_mm_call *), int blocked,
                   nx_mm_rows_fn a_rows, const void *a_ctx);
/* The float32 matmul of an implicit x [T, K] (above). */
int nx_matmul_rows(nx_isa isa, uint32_t type, nx_mm_rows_fn a_rows, const void *a_ctx,
                   const uint8_t *w /* IN [N*rowbytes] */, const float *bias /* IN [N] or NULL */,
                   float *out /* OUT [T*N] */, size_t T, size_t K, size_t N, size_t n0, size_t n1);

/* ---- adaLN linear: out[n] = sum_k w[n,k] * u[k] (+ bias[n]), u = silu(t_emb) or t_emb
 * (silu in float32: t / (1 + expf(-t))): the matmul above with T = 1 at `isa` (so a weight in
 * any type and its exact float32 dequantization give the same bits at every ISA).
 * w: N rows of `type`. bias may be NULL. Returns 0, -1 on allocation failure, -2 bad type. */
int nx_adaln_linear(nx_isa isa, uint32_t type, const float *t_emb /* IN [K] */,
                    const uint8_t *w /* IN [N*rowbytes] */, const float *bias /* IN [N] or NULL */,
                    float *out /* OUT [N] */, size_t K, size_t N, int silu_input);

/* The matmul's per-output arithmetic (see the contract above), scalar -- the spec every variant
 * reproduces bit for bit: for each of nrows (<= NX_MM_DOT_ROWS) rows a_r = a + r*lda,
 * out[r*ldo] = chunks of NX_MM_CHAIN fmaf steps from +0 over a_r[k]*b[k], chunk sums added in
 * order. Rows are independent chains; running several at once only lets their fmaf calls overlap. */
#define NX_MM_DOT_ROWS 4
static inline void nx_mm_dot_rows(const float *a /* IN [nrows][lda] */, size_t lda, size_t nrows,
                                  const float *b /* IN [K] */, size_t K,
                                  float *out /* OUT [nrows][ldo] */, size_t ldo) {
    float acc[NX_MM_DOT_ROWS] = {0.0f};
    for (size_t c0 = 0; c0 < K; c0 += NX_MM_CHAIN) {
        const size_t c1 = K - c0 < NX_MM_CHAIN ? K : c0 + NX_MM_CHAIN;
        float p[NX_MM_DOT_ROWS] = {0.0f};
        for (size_t k = c0; k < c1; k++)
            for (size_t r = 0; r < nrows; r++) p[r] = fmaf(a[r * lda + k], b[k], p[r]);
        for (size_t r = 0; r < nrows; r++) acc[r] = c0 == 0 ? p[r] : acc[r] + p[r];
    }
    for (size_t r = 0; r < nrows; r++) out[r * ldo] = acc[r];
}

#endif
