/* nx_wtype.h -- weight types: the traits table per GGML type and the dequantize family.
 *
 * Owns: GGML's type numbering, the packed block layouts (pinned by _Static_assert, and on the
 * Python side by nxhpc/formats/ggml_blocks.py with a test comparing the two), one traits row per
 * weight type (name, elements and bytes per block, the scalar dequantize spec), the per-ISA
 * dequantize tables and their dispatch, and the float16 / bfloat16 conversions in software.
 * Must not: know the matmul (it reads the traits; nx_matmul.h) or allocate.
 *
 * Arithmetic contract of dequantize (every ISA variant is bit-identical to the generic spec, and
 * the spec is byte-identical to gguf.quants.dequantize):
 *   F32   value = the stored float32 (bits copied, NaN payloads kept)
 *   F16   value = the binary16 value widened exactly (numpy's astype: NaN payload and the
 *         signalling bit kept -- F16C's vcvtph2ps would quiet sNaN, the SIMD variants patch it)
 *   BF16  value = bits << 16 (exact, NaN kept)
 *   Q8_0  value = float32(d) * q (d float16, q int8: 11 x 8 significant bits, exact in float32)
 *   Q4_0 .. Q6_K  the float32 op order in nx_quants.h (exact products; one rounding, the final
 *         "+ m" / "- dmin*mn", for Q4_1, Q5_1, Q2_K, Q4_K, Q5_K)
 * For F32/F16/BF16/Q8_0/Q4_0/Q5_0/Q3_K/Q6_K every value is exact in float32; for all types the
 * dequantize is bit-identical at every ISA, so a matmul over the stored bytes and over the float32
 * dequantization give the same bits (nx_matmul.h).
 *
 * Adding a weight type (say IQ4_NL, 32 values in 18 bytes; Q4_0 .. Q6_K were added this way, their blocks and specs in nx_quants.h/.c):
 *   1. its block struct + _Static_assert here (sizes as ggml-common.h), and a dtype of the same
 *      itemsize in nxhpc/formats/ggml_blocks.py (tests/test_kernels_wtype.py compares them);
 *   2. `void nx_dequant_iq4_nl_generic(const uint8_t *blocks, float *out, size_t nblocks)` -- the
 *      spec: its float32 operation order written in a comment, byte-identical to gguf's
 *      dequantize (K-quants: d*sc*q - dmin*m in a fixed order) -- and one traits row in
 *      nx_wtype.c: {"IQ4_NL", 32, sizeof(nx_block_iq4_nl), nx_dequant_iq4_nl_generic};
 *   3. optional SIMD variants (same signature, bit-identical) `nx_dequant_iq4_nl_avx2` /
 *      `_avx512` in files with those suffixes, one line each in nx_wtype_table_avx2 /
 *      nx_wtype_table_avx512 (missing ones inherit the parent ISA's, down to the spec);
 *   4. nothing else: the matmul packs its panels with the ISA's dequantize (dequantize a few
 *      rows into a small scratch, then transpose). An optional fused packer for speed is one
 *      line in the ISA's matmul tiling (nx_matmul_<isa>.c, pack_fused[NX_GGML_IQ4_NL]).
 *   Blocks may hold up to NX_WTYPE_MAX_BLOCK elements (256, the K-quants'); the matmul's k-blocks
 *   are multiples of 256 so a block never straddles two of them.
 */
#ifndef NX_WTYPE_H
#define NX_WTYPE_H

#include <stddef.h>
#include <stdint.h>

#include "nx_cpu.h"
#include "nx_dispatch.h"

/* GGML type ids (ggml.h numbering; gguf.GGMLQuantizationType). */
enum {
    NX_GGML_F32 = 0,
    NX_GGML_F16 = 1,
    NX_GGML_Q4_0 = 2,
    NX_GGML_Q4_1 = 3,
    NX_GGML_Q5_0 = 6,
    NX_GGML_Q5_1 = 7,
    NX_GGML_Q8_0 = 8,
    NX_GGML_Q8_1 = 9,
    NX_GGML_Q2_K = 10,
    NX_GGML_Q3_K = 11,
    NX_GGML_Q4_K = 12,
    NX_GGML_Q5_K = 13,
    NX_GGML_Q6_K = 14,
    NX_GGML_Q8_K = 15,
    NX_GGML_BF16 = 30,
    NX_GGML_TYPE_COUNT = 31 /* size of the tables (ids 0..30) */
};

#define NX_WTYPE_MAX_BLOCK 256 /* largest block (elements) any type may have */

/* ---- block layouts. GGUF rows are arrays of these, only byte-aligned: read fields with memcpy. */
#define NX_QK8_0 32
typedef struct {
    uint16_t d;          /* float16 scale (IEEE binary16 bits, little-endian) */
    int8_t qs[NX_QK8_0]; /* quants */
} nx_block_q8_0;
_Static_assert(sizeof(nx_block_q8_0) == 34, "nx_block_q8_0 must be 34 bytes (ggml block_q8_0)");
typedef struct {
    float v;
} nx_block_f32; /* one element per "block" */
typedef struct {
    uint16_t bits;
} nx_block_f16; /* IEEE binary16 */
typedef struct {
    uint16_t bits;
} nx_block_bf16; /* top half of a float32 */
_Static_assert(sizeof(nx_block_f32) == 4 && sizeof(nx_block_f16) == 2 && sizeof(nx_block_bf16) == 2,
               "element types are unpadded");

/* ---- dequantize: nblocks blocks -> nblocks * blck_elems float32 values. */
typedef void (*nx_dequant_fn)(const uint8_t *blocks /* IN [nblocks * blck_bytes] */,
                              float *out /* OUT [nblocks * blck_elems] */, size_t nblocks);

/* One row per weight type. blck_bytes is sizeof the block struct. */
typedef struct {
    const char *name;      /* GGML's name: "F32", "Q8_0", ... */
    uint32_t blck_elems;   /* values per block (1 for F32 / F16 / BF16) */
    uint32_t blck_bytes;   /* bytes per block */
    nx_dequant_fn dequant; /* the generic (scalar) spec; NULL: no such weight type here */
} nx_wtype_traits;

/* Indexed by GGML type id; rows of unsupported ids are all zero. */
extern const nx_wtype_traits nx_wtype_traits_table[NX_GGML_TYPE_COUNT];

/* The traits of a supported type, or NULL (unknown id, or a type without kernels in this build). */
const nx_wtype_traits *nx_wtype(uint32_t ggml_type);

/* Per-ISA dequantize table (the "wtype" dispatch family): dequant[t] = a variant of type t's
 * spec, NULL = none at this ISA. Each ISA file exports one (nx_wtype_avx2.c, nx_wtype_avx512.c). */
typedef union {
    nx_dequant_fn dequant[NX_GGML_TYPE_COUNT];
    nx_slot_fn slot_[NX_GGML_TYPE_COUNT]; /* the resolver's view (nx_dispatch.h) */
} nx_wtype_table;
extern const nx_wtype_table nx_wtype_table_avx2;
extern const nx_wtype_table nx_wtype_table_avx512;

/* The dequantize of `type` that runs at `isa` (inherited down the ISA chain to the spec); NULL for
 * an unsupported type. nx_wtype_variant: the ISA whose code it is (NX_ISA_COUNT if none). */
nx_dequant_fn nx_wtype_dequant(nx_isa isa, uint32_t type);
nx_isa nx_wtype_variant(uint32_t type, nx_isa isa);
/* kernel_variants(): slot t = GGML type t, "dequantize[<name>]" (unsupported ids: no name). */
extern const nx_family_info nx_wtype_family;

/* out := dequantize(w), nblocks blocks of `type` at `isa`. Returns 0, or -2 for an unsupported type. */
int nx_dequantize(nx_isa isa, uint32_t type, const uint8_t *w /* IN */, float *out /* OUT */,
                  size_t nblocks);

/* ---- embed_rows: out[i, 0:K] := dequantize(row ids[i] of w) for i in [r0, r1) (an embedding
 * lookup on a typed matrix). w: N rows of rowbytes = K / blck_elems * blck_bytes bytes of `type`;
 * ids: int32 (id_bytes == 4) or int64 (id_bytes == 8), every id in [0, N) -- the caller checks
 * ids, N, K and the band; nothing is re-checked here. Each row is decoded straight into its out
 * row by the dequantize of `type` at `isa` (so bit-identical to the spec, and to
 * gguf.quants.dequantize, at every ISA and for any band split): no scratch, memory O(1) beyond
 * the rows asked. Rows of out outside [r0, r1) are untouched. Returns 0, or -2 for an
 * unsupported type. */
int nx_embed_rows(nx_isa isa, uint32_t type, const uint8_t *w /* IN [N, rowbytes] */,
                  size_t rowbytes, const void *ids /* IN [n] int32 or int64 */, int id_bytes,
                  float *out /* OUT [n, K], rows [r0, r1) */, size_t K, size_t r0, size_t r1);

/* The specs (generic) and SIMD variants of the types implemented here. */
void nx_dequant_f32_generic(const uint8_t *blocks /* IN */, float *out /* OUT */, size_t n);
void nx_dequant_f16_generic(const uint8_t *blocks /* IN */, float *out /* OUT */, size_t n);
void nx_dequant_bf16_generic(const uint8_t *blocks /* IN */, float *out /* OUT */, size_t n);
void nx_dequant_q8_0_generic(const uint8_t *blocks /* IN */, float *out /* OUT */, size_t n);
void nx_dequant_f16_avx2(const uint8_t *blocks /* IN */, float *out /* OUT */, size_t n);
void nx_dequant_bf16_avx2(const uint8_t *blocks /* IN */, float *out /* OUT */, size_t n);
void nx_dequant_q8_0_avx2(const uint8_t *blocks /* IN */, float *out /* OUT */, size_t n);
void nx_dequant_f16_avx512(const uint8_t *blocks /* IN */, float *out /* OUT */, size_t n);
void nx_dequant_bf16_avx512(const uint8_t *blocks /* IN */, float *out /* OUT */, size_t n);
void nx_dequant_q8_0_avx512(const uint8_t *blocks /* IN */, float *out /* OUT */, size_t n);

/* Scalar float16 <-> float32 (round-to-nearest-even, subnormals, inf). nx_f16_to_f32 widens
 * exactly and keeps NaN payloads and the signalling bit (numpy's cast); nx_f32_to_f16 quiets
 * NaN and keeps the top payload bits (as F16C's vcvtps2ph with RNE). */
uint16_t nx_f32_to_f16(float f);
float nx_f16_to_f32(uint16_t h);

/* bfloat16 bits -> float32: exact. */
static inline float nx_bf16_to_f32(uint16_t h) {
    union {
        uint32_t u;
        float f;
    } v;
    v.u = (uint32_t)h << 16;
    return v.f;
}

#endif
