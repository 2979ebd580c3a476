/* nx_lowp.h -- low-precision matmuls: `bf16` (vdpbf16ps) and `q8` (Q8_0 activations x
 * Q8_0 / Q4_0 .. Q6_K weights, vpdpbusd).
 *
 * Owns: the arithmetic contract of both precisions (below), the "lowp" dispatch family (its slots
 * and per-ISA tables), the blocked driver both SIMD variants share, and the scalar specs. Weights
 * are decoded only through the weight-type traits (nx_wtype.h) and the ISA's dequantize. Must not: allocate per tile, spawn threads, read/write outside the given ranges
 * (callers validate shapes before entering C), or copy a whole weight matrix.
 *
 * Shape API (both precisions, like nx_matmul): x float32 [T, K] row-major; w raw GGML rows
 * [N, rowbytes] (rowbytes = K / block_elems * block_bytes of the weight type); out float32 [T, N];
 * only columns [n0, n1) of out are written; bias (float32 [N] or NULL) is added once, after the sum.
 *
 * ---- `bf16` contract (bit-identical: generic spec == AVX2 == AVX-512 BF16, every band, every T
 *      batching;
 *      AMX: the clause at the end of this section)
 *   bf(v)   = float32 -> bfloat16 as VCVTNEPS2BF16 does it: a subnormal v becomes the zero of its
 *             sign; NaN -> quiet NaN keeping sign and top payload bits ((bits >> 16) | 0x0040);
 *             otherwise round to nearest even on the bit pattern (overflow -> inf). (torch rounds
 *             subnormals instead of flushing them; the product step below treats bfloat16
 *             subnormals as zero anyway, so the two differ only for |v| in [2^-126 - 2^-134, 2^-126).)
 *   xb[t,k] = bf(x[t,k]);  wb[n,k] = bf(dequant(w)[n,k])  (dequant exact in float32, once per
 *             weight and weight panel; the matrix is never held in bfloat16 as a whole).
 *   K is zero-padded to K32 = 32*ceil(K/32) (pads are +0 in both operands).
 *   daz(v)  = v with a subnormal value replaced by the zero of its sign.
 *   ftz(fma(a, b, c)) = x86's flush-to-zero of one fused multiply-add: the zero of the result's
 *             sign where the exact a*b + c is tiny after rounding (rounded to 24 significant
 *             bits with an unbounded exponent, to nearest even, it is below 2^-126 in magnitude),
 *             else fmaf(a, b, c) (one rounding, to nearest even). A gradual-underflow fmaf whose
 *             subnormal results are flushed differs only where the exact value lies in
 *             (2^-126 - 2^-150, 2^-126 - 2^-151): fmaf rounds it up to 2^-126, x86 flushes it.
 *   step(acc, a, b) = ftz(fma(daz(a), daz(b), daz(acc)))
 *   acc = +0;  for p = 0 .. K32/2-1:  acc = step(acc, xb[2p+1], wb[2p+1]);
 *                                     acc = step(acc, xb[2p],   wb[2p]);
 *   out[t,n] = acc (+ bias[n], one float32 add). Bit-identity covers every non-NaN output; a NaN
 *   output is NaN in every variant but its payload is not promised (scalar fmaf may differ).
 *   That per-pair step is Intel's pseudo-code of VDPBF16PS (odd element first, two fused steps,
 *   DAZ on every input including the accumulator, FTZ after each step, RNE, MXCSR ignored), and
 *   x86's FTZ is the one above (tininess after rounding: Intel SDM vol. 1, "Numeric Underflow
 *   Exception"): on this project's Intel Xeon (family 6 model 167) the instruction matched the
 *   step on 4.8e7 random and underflow-range cases, 2.1e4 in the interval above
 *   (benchmarks/probes/bf16_fma_ftz.c), and a vfmadd231ps under MXCSR DAZ|FTZ is the step
 *   itself (the avx2 kernels run so). On AMD Zen 4 4e6 random and 1e7 underflow-boundary cases
 *   matched an earlier statement of this contract (fmaf, then subnormals flushed); whether they
 *   reached the interval is not recorded, and the
 *   tests check it on every machine they run on (test_bf16_simd_ftz_boundary). Products of
 *   two bfloat16 values are exact in float32 unless they under/overflow, so each step is one
 *   rounding of acc + product. The scalar spec (nx_dpbf16_step) decides the one ambiguous
 *   fmaf result, +-2^-126, by the same fma with a factor and acc scaled by 2^24.
 *   One chain per output over all of K: no two-level chunking (the chain's worst case gamma_K is
 *   <= 8% of the input-rounding term 2u = 2^-7 at K <= 10240, so chunks would not pay for their
 *   extra C traffic and registers).
 *   Error vs float64 x @ dequant(w).T, with u = 2^-8 (bfloat16: 8-bit significand, round to
 *   nearest) and gamma_n = n 2^-24 / (1 - n 2^-24):
 *     |out - ref| <= ((2u + u^2) + gamma_K (1+u)^2) * sum_k |x w|
 *                    + K32 * 2^-124 * (1 + max|x| + max|w|)
 *   (input rounding |bf(v) - v| <= u|v|; each product passes <= K roundings of the chain; the
 *   last term covers FTZ of results and flushed subnormal inputs, ~1e-34 for normal-range data).
 *   AMX clause (nx_lowp_amx.c, the `amx` ISA): xb and wb exactly as above, but the sum over k is
 *   tdpbf16ps's: per 32-k group (K zero-padded to K32), in group order, 16 pairs of products
 *   added into a float32 accumulator with DAZ/FTZ and round-to-nearest as the instruction does
 *   it, the accumulator a float32 value between groups. Intel documents neither the order of
 *   the 32 additions nor their intermediate roundings (on this project's AMX Xeon the result
 *   matched neither order of the fused pair steps, nor one rounding per pair, per group or per
 *   output), so these are not the spec's bits. Promised instead: each output's arithmetic
 *   depends only on K and the data (never on the tile, band, token batch or worker split), so
 *   outputs are bit-identical across bands, batches and workers on one machine; each output is
 *   within gamma_K * sum_k |xb wb| (+ the FTZ term) of the exact sum of the bf()-rounded
 *   products, hence within the error bound above; bias as above. Measured: tests/
 *   test_kernels_lowp.py (test_bf16_amx_*).
 *
 * ---- `q8` contract (bit-identical: generic spec == AVX2 == AVX-512 VNNI == AMX, every band,
 *      every T batching)
 *   Weights must be Q8_0 (ggml block_q8_0: fp16 d, 32 int8 q). Each row of x is quantized to
 *   Q8_0 bytes by nx_q8_0_quantize (byte-identical to gguf.quants.quantize): qx; the block scale
 *   is kept in float32, dx = nx_q8_0_act_scale (nx_q8_0.h: the quantizer's own d = amax/127
 *   before its float16 rounding, 0 for amax < 127 * 2^-126). A float16 dx would give q8 no
 *   range: inf for amax >= 127 * 65504 (~8.3e6: the whole output row NaN) and 0 below ~7.6e-6.
 *   For each block b = 0, 1, ..., K/32-1 in order, from acc = +0:
 *     isum = sum_{i<32} qx[t,b,i] * qw[n,b,i]          exact int32 (|isum| <= 32*128*128)
 *     s    = dx[t,b] * f32(dw[n,b])                     float32 product, one rounding
 *     acc  = fmaf((float)isum, s, acc)                  (float)isum exact (|isum| < 2^24)
 *   out[t,n] = acc (+ bias[n]).  ggml's Q8_0 x Q8_0 arithmetic with one fixed block order, and
 *   the activation scale not rounded to float16 (so not ggml's bits).
 *   Range: every finite x. A block of max |x| below 127 * 2^-126 (~1.5e-36) contributes 0; the
 *   result is finite whenever every s is (amax_b * |dw| / 127 <= FLT_MAX: beyond that the
 *   float32 products x*w overflow in every precision) and the sum does not overflow.
 *   Error vs float64 x @ dequant(w).T (x~ = q * dx, the activations the sum sees):
 *     |out - ref| <= sum_k |x - x~| |w| + gamma_{K/32+1} * sum_k |x~ w| + (K/32) * 2^-130
 *     (dots exact; s one rounding; each block term passes <= K/32 fma roundings; the last term
 *     covers s and acc in float32's subnormal range), where per element
 *       |x - x~| <= (0.5/127 + 2^-22) * amax_b       (amax_b >= 127 * 2^-126)
 *       |x - x~| =  |x| < 127 * 2^-126               (smaller blocks, flushed)
 *     (half a quantization step, and the float32 roundings of d, 1/d and x/d), i.e. ~0.39% of
 *     the block's max |x|, for any block scale. The error stays relative while s is a normal
 *     float32 (amax_b * |dw| >= 127 * 2^-126, e.g. amax_b >= ~1e-33 against |dw| ~ 1e-4);
 *     below that the absolute term, ~1e-39 per block, is what is promised.
 *   VNNI detail: vpdpbusd multiplies unsigned by signed bytes. The weights are repacked per panel
 *   as qw + 128 (unsigned), the activations stay signed (the broadcast operand), and the int32
 *   accumulator of each block starts at -128 * sum_i qx[t,b,i]: the result is the exact isum.
 *
 * ---- `q8` on the other quantized types (Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K;
 *   bit-identical in the same way). Activations exactly as for Q8_0 (qx, dx per 32-block b).
 *   Each weight block is read as signed integer codes qw (|qw| <= 128), one float32 scale sw per
 *   "part" and, for the types with an offset/min, one float32 min mw per part. A part is the
 *   whole 32-block (H = 1 part per 32) or, for the types with 16-element sub-blocks (Q2_K, Q3_K,
 *   Q6_K), its two halves of 16 (H = 2, elements 0..15 first). Per type (f32(): the float16
 *   field widened exactly; sc/mn the integer sub-block scale/min of nx_quants.h):
 *     type   H  qw                    sw                       mw
 *     Q8_0   1  q (int8)              f32(d)                   -
 *     Q4_0   1  code - 8              f32(d)                   -
 *     Q5_0   1  code - 16             f32(d)                   -
 *     Q4_1   1  code (0..15)          f32(d)                   f32(m)
 *     Q5_1   1  code (0..31)          f32(d)                   f32(m)
 *     Q4_K   1  code (0..15)          f32(d) * sc_j            -(f32(dmin) * mn_j)   j = 32-group
 *     Q5_K   1  code (0..31)          f32(d) * sc_j            -(f32(dmin) * mn_j)   of the 256
 *     Q6_K   2  code - 32 (-32..31)   f32(d) * sc_i (int8)     -                     i = 16-part
 *     Q3_K   2  q (-4..3)             f32(d) * (sc6_i - 32)    -                     of the 256
 *     Q2_K   2  code (0..3)           f32(d) * (sc_i & 15)     -(f32(dmin) * (sc_i >> 4))
 *   Every sw / mw product is exact in float32 (11-bit significand times <= 7-bit integer; see
 *   nx_quants.h), so sw*qw + mw is, in real arithmetic, the element's value (for the types with a
 *   min, gguf's float32 dequantize rounds that sum once; without a min it is exact).
 *   For each block b = 0 .. K/32-1 in order, from acc = +0, with per part p (exact integers)
 *     isum_p = sum_{i in part p} qx[t,b,i] * qw[n,b,i]   (int32; |isum| <= 32*127*128 < 2^24)
 *     xsum_p = sum_{i in part p} qx[t,b,i]               (|xsum| <= 32*127):
 *     H = 1:  acc = fmaf((float)isum_0, dx[t,b] * sw[n,b,0], acc)   (the product one rounding)
 *     H = 2:  y   = (float)isum_0 * sw[n,b,0]                         (one rounding)
 *             y   = fmaf((float)isum_1, sw[n,b,1], y)
 *             acc = fmaf(y, dx[t,b], acc)
 *     then, with a min, for p = 0 .. H-1:
 *             acc = fmaf(dx[t,b] * (float)xsum_p, mw[n,b,p], acc)   (the product one rounding)
 *   (H = 2 combines the halves before the activation scale: one multiply per 32 instead of two.)
 *   out[t,n] = acc (+ bias[n]). K must be a multiple of the type's block (32, or 256 for the
 *   K-quants). Range and NaN/inf: as for Q8_0 (a NaN/inf activation makes its output row NaN).
 *   Error vs float64 x @ dequant(w).T (dequant = gguf's float32 values), with n = (K/32) *
 *   (1 + H * has_min) fma steps on acc and |w|' = |sw qw| + |mw| per element (= |w| without a
 *   min):
 *     |out - ref| <= sum_k |x - x~| |w| + gamma_{n+2} * sum_k |x~| |w|'
 *                    + [has_min] 2^-24 * sum_k |x~ w| + 2n * 2^-130
 *   (activation error as for Q8_0; each part's product passes <= 2 roundings before the chain
 *   and <= n on it, measured against the split terms, which can cancel where the min is large;
 *   the third term is gguf's rounding of d*sc*q - dmin*mn; the last the subnormal range).
 *   VNNI detail: the panels hold the stored unsigned code u = qw + off (off = 8 Q4_0, 16 Q5_0,
 *   32 Q6_K, 4 Q3_K, 0 for the min types), and each part's int32 accumulator starts at
 *   -off * xsum: the result is the exact isum.
 */
#ifndef NX_LOWP_H
#define NX_LOWP_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "nx_cpu.h"

#include "nx_dispatch.h"
#include "nx_matmul.h" /* nx_mm_call */
#include "nx_wtype.h"  /* GGML type ids (NX_GGML_*), traits, nx_bf16_to_f32 */

/* ---- the "lowp" dispatch family (nx_dispatch.h): one slot per kernel, one table per ISA file.
 * A call is an nx_mm_call (nx_matmul.h): the weight type's traits, the dequantize of the
 * requested ISA (the wtype family: every type of the traits table decodes on the bf16 path),
 * x, w, bias, out, T, K, N, [n0, n1), rowbytes. Slots:
 *   matmul_bf16(c)        the `bf16` matmul (any weight type with traits)
 *   matmul_q8(c)          the `q8` matmul (c->type one of nx_q8w's types; -2 otherwise)
 *   round_bf16(x, out, n) out[i] = bits of bf(x[i])
 * Tables: generic (the specs, nx_lowp.c), avx2 (bf16 on float32 FMA chains over bfloat16-valued
 * panels with MXCSR DAZ, results flushed: nx_lowp_bf16_avx2.c; table in nx_lowp_avx2.c),
 * avx512 (q8 on VNNI: VNNI is part of the avx512 ISA's
 * required bits, nx_cpu.h; nx_lowp_avx512.c), avx512bf16 (bf16 on vdpbf16ps,
 * nx_lowp_avx512bf16.c), amx (q8 of every type on the AMX tile unit's tdpbssd, the same bits;
 * bf16 on tdpbf16ps under its own clause: nx_lowp_amx.c). A missing slot inherits down the ISA
 * chain to the spec. */
#define NX_LOWP_SLOTS(X)                                                                           \
    X(matmul_bf16, int, (const nx_mm_call *c))                                                     \
    X(matmul_q8, int, (const nx_mm_call *c))                                                       \
    X(round_bf16, void, (const float *x /* IN [n] */, uint16_t *out /* OUT [n] */, size_t n))
NX_DECLARE_FAMILY(nx_lowp, NX_LOWP_SLOTS)
extern const nx_lowp_table nx_lowp_table_generic;    /* nx_lowp.c */
extern const nx_lowp_table nx_lowp_table_avx2;       /* nx_lowp_avx2.c (q8 on vpmaddubsw; bf16:
                                                        nx_lowp_bf16_avx2.c) */
extern const nx_lowp_table nx_lowp_table_avxvnni;    /* nx_lowp_avxvnni.c (q8 on vpdpbusd ymm) */
extern const nx_lowp_table nx_lowp_table_avx512;     /* nx_lowp_avx512.c */
extern const nx_lowp_table nx_lowp_table_avx512bf16; /* nx_lowp_avx512bf16.c */
extern const nx_lowp_table nx_lowp_table_amx;        /* nx_lowp_amx.c (q8 on tdpbssd, bf16 on
                                                        tdpbf16ps) */

/* ---- bfloat16 rounding (see bf above) */
static inline uint16_t nx_bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7f800000u) == 0) return (uint16_t)((u >> 16) & 0x8000u); /* zero, subnormal */
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u); /* NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
/* out[i] = bits of bf(x[i]) for i < n, at `isa`. */
void nx_bf16_round_n(nx_isa isa, const float *x /* IN [n] */, uint16_t *out /* OUT [n] */,
                     size_t n);
void nx_bf16_round_n_generic(const float *x /* IN */, uint16_t *out /* OUT */, size_t n);
void nx_bf16_round_n_avx2(const float *x /* IN */, uint16_t *out /* OUT */, size_t n);
void nx_bf16_round_n_avx512bf16(const float *x /* IN */, uint16_t *out /* OUT */, size_t n);

/* ---- the matmuls at `isa` (shapes above; w rows of GGML type `type`). Return 0, -1 when scratch
 * memory could not be allocated (out then unspecified in the band), -2 for a weight type the
 * precision does not take (bf16: no traits; q8: no nx_q8w decoding, i.e. F32, F16, BF16).
 * bf16's flags are NX_MM_* (nx_matmul.h): 0, or NX_MM_DEQUANT_PACK, which makes every packer
 * decode through the type's dequantize instead of a fused decoder (a test hook: the same bits). */
int nx_matmul_bf16(nx_isa isa, uint32_t type, const float *x /* IN [T*K] */,
                   const uint8_t *w /* IN [N*rowbytes] */, const float *bias /* IN [N] or NULL */,
                   float *out /* OUT [T*N] */, size_t T, size_t K, size_t N, size_t n0, size_t n1,
                   unsigned flags);
/* The bf16 matmul of an implicit x [T, K] (nx_matmul.h's nx_mm_run_rows: the SIMD variants,
 * every one on the blocked driver, pack the rows as they come; the spec gets chunks). Returns
 * and bits: nx_matmul_bf16's on the materialized x. */
int nx_matmul_bf16_rows(nx_isa isa, uint32_t type, nx_mm_rows_fn a_rows, const void *a_ctx,
                        const uint8_t *w /* IN [N*rowbytes] */,
                        const float *bias /* IN [N] or NULL */, float *out /* OUT [T*N] */,
                        size_t T, size_t K, size_t N, size_t n0, size_t n1, unsigned flags);
int nx_matmul_q8(nx_isa isa, uint32_t type, const float *x /* IN [T*K] */,
                 const uint8_t *w /* IN [N*rowbytes] */, const float *bias /* IN [N] or NULL */,
                 float *out /* OUT [T*N] */, size_t T, size_t K, size_t N, size_t n0, size_t n1);

/* ---- the weight side of the q8 contract, per type (the table above): the spec's decoders.
 * codes(blk, qw): the signed codes qw[e] of one block, e < elems (nx_quants.h element order);
 * scales(blk, sw, mw): sw[i] (and mw[i] where has_min) for i < elems/32 * halves, i = 32-group *
 * halves + part. off: the SIMD panels' unsigned code u = qw + off. */
typedef struct {
    uint32_t elems; /* elements per block: 32 or 256 */
    int halves;     /* H: 1 or 2 parts per 32-group */
    int has_min;
    int off;
    void (*codes)(const uint8_t *blk /* IN */, int8_t *qw /* OUT [elems] */);
    void (*scales)(const uint8_t *blk /* IN */, float *sw /* OUT */, float *mw /* OUT */);
} nx_q8w_type;
/* The q8 decoding of `type`, or NULL where q8 does not take it (F32, F16, BF16, unknown). */
const nx_q8w_type *nx_q8w(uint32_t type);
/* The gated matmuls (nx_mm_call's w_up; nx_matmul_glu of nx_matmul.h for `bf16` / `q8`):
 * out[t, n] := silu(x . w_n) * (x . w_up_n), n in [n0, n1), the bits of the plain call for w and
 * for w_up, then nx_swiglu_f32 at `isa` on the two. The SIMD variants run it in the blocked
 * driver (one packed x for both weights; per block the up outputs in an L2-sized buffer, glu
 * while the block's gate outputs are still in cache), the specs as two plain calls per chunk. */
int nx_matmul_bf16_glu(nx_isa isa, uint32_t type, const float *x, const uint8_t *w,
                       const uint8_t *w_up, float *out, size_t T, size_t K, size_t N, size_t n0,
                       size_t n1, unsigned flags);
int nx_matmul_q8_glu(nx_isa isa, uint32_t type, const float *x, const uint8_t *w,
                     const uint8_t *w_up, float *out, size_t T, size_t K, size_t N, size_t n0,
                     size_t n1);
int nx_matmul_bf16_generic(const nx_mm_call *c);
int nx_matmul_bf16_avx2(const nx_mm_call *c);
int nx_matmul_bf16_avx512bf16(const nx_mm_call *c);
int nx_matmul_q8_generic(const nx_mm_call *c);
int nx_matmul_q8_avx2(const nx_mm_call *c);
int nx_matmul_q8_avxvnni(const nx_mm_call *c);
int nx_matmul_q8_avx512(const nx_mm_call *c);
int nx_matmul_q8_amx(const nx_mm_call *c);
int nx_matmul_bf16_amx(const nx_mm_call *c);

/* ---- the per-step arithmetic of the specs, scalar (exported for the generic matmuls) */
float nx_dpbf16_step(float acc, float a, float b); /* ftz(fma(daz(a), daz(b), daz(acc))), x86 ftz */

/* ---- the blocked driver shared by the SIMD variants (BLIS loop order, like nx_matmul_blocked):
 *   for each block of mc tokens (as few blocks of <= 9/8 MC as T needs, equal, whole MR):
 *     pack_a packs MR-token micro-panels (all of K)
 *     for each block of nc <= NC columns in [n0, n1):
 *       for each k-block of kc <= KC steps: pack_b packs NR-column micro-panels of that k-block
 *         for each MR x NR tile (A- or B-micro-panel-major, jr_outer): kern (continues each output's single chain; C holds it between
 *         k-blocks). Then bias is added to the finished mc x nc block.
 * Micro-panels are stored per 32-k group: an A micro-panel takes a_group bytes per group, a B
 * micro-panel b_group bytes, so the group g of a panel starts at g * x_group (K beyond the last
 * full group is zero-padded by the packers). The per-output order depends only on K, never on
 * the tile, so every band / batch split is bit-identical.
 *   pack_a(x, K, t0, rows, Ap, scratch): tokens [t0, t0+rows) (rows <= MR) into one micro-panel of
 *     ceil(K/32) groups; tokens past rows are zero. scratch: a_scratch bytes.
 *   pack_b(c, j0, ncols, k0, kc, Bp, scratch): columns [j0, j0+ncols) (ncols <= NR)
 *     x k in [k0, k0+kc) into one micro-panel of ceil(kc/32) groups; columns past ncols zero.
 *     scratch: b_scratch bytes. k0 % KC == 0, KC % 256 == 0 (a whole number of any block size).
 *   kern(ngroups, A, B, C, ldc, mr, nr, first): C[0:mr, 0:nr] (ldc floats per row) :=
 *     the chain over ngroups groups, started from +0 (first) or continued from C.
 *   kern_cp (optional; replaces kern): the same chain, carried between k-blocks in a packed
 *     buffer Cp of mr x nr floats per tile (laid out as the kernel likes) instead
 *     of in C: started from +0 (first) or continued from Cp, and written to C (ldc floats per
 *     row) after the last k-block, to Cp before it. out's rows are N floats apart, and N a
 *     multiple of 1024 floats puts a tile's rows in a handful of L1 sets; Cp does not. next:
 *     in the last k-block, the first output of the tile the driver runs after this one when
 *     that tile is a whole MR x NR one in the same block (NULL otherwise): a hint, for the
 *     kernel to prefetch those output lines while it computes. bias: in the last k-block, NULL
 *     or the call's bias from the tile's first column: C := sums + bias, one float32 add per
 *     output (the bits of the driver's add after the sum, which kern_cp tilings skip). */
typedef struct {
    size_t mr, nr, kc, nc, mc;
    size_t a_group, b_group, a_scratch, b_scratch;
    int jr_outer; /* 0: for A micro-panel { for B micro-panel } (A stays in L1);
                                  * 1: for B micro-panel { for A micro-panel } (B stays in L1) */
    void (*pack_a)(const float *x, size_t K, size_t t0, size_t rows, uint8_t *Ap, void *scratch);
    void (*pack_b)(const nx_mm_call *c, size_t j0, size_t ncols, size_t k0, size_t kc, uint8_t *Bp,
                   void *scratch);
    void (*kern)(size_t ngroups, const uint8_t *A, const uint8_t *B, float *C, size_t ldc, int mr,
                 int nr, int first);
    void (*kern_cp)(size_t ngroups, const uint8_t *A, const uint8_t *B, float *Cp, float *C,
                    size_t ldc, int mr, int nr, int first, int last, const float *next,
                    const float *bias);
} nx_lowp_tiling;

int nx_lowp_blocked(const nx_lowp_tiling *tl, const nx_mm_call *c);

#endif
