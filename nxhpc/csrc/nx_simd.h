/* nx_simd.h -- one float32 vector vocabulary (nxv_*) over AVX-512 (16 lanes) or AVX2 (8 lanes),
 * including the exact widening of stored weight values (F16, BF16, Q8_0 quants),
 * chosen by the flags of the including file, so element-wise loops are written once for both
 * widths (ggml's GGML_F32_VEC, numpy's universal intrinsics): a file nx_<family>_ew.h holds the
 * loops, and nx_<family>_avx2.c / _avx512.c each include it once. Register micro-kernels (matmul,
 * attention) stay hand-written per ISA.
 *
 * Every nxv_* maps to exactly one intrinsic (or to the shared polynomials of nx_vmath_<isa>.h),
 * so a loop written with them does the same float32 operations at both widths: lane for lane
 * the same bits. NXV_FN(nx_swiglu_f32) names the variant: nx_swiglu_f32_avx512 / _avx2.
 * Must only be included from SIMD files (the vmath headers #error otherwise). No state.
 */
#ifndef NX_SIMD_H
#define NX_SIMD_H

#include <stdint.h>

#if defined(__AVX512F__)
#include "nx_vmath_avx512.h"

#define NXV_W 16
#define NXV_FN(name) name##_avx512
typedef __m512 nxv;
typedef __m512d nxvd_half; /* float64 broadcast for nxv_sub_f64 */
typedef __mmask16 nxv_mask;
static inline nxv_mask nxv_mask_n(int64_t valid) { return nx_mask16(valid); }
static inline nxv nxv_loadu(const float *p) { return _mm512_loadu_ps(p); }
static inline nxv nxv_load_n(const float *p, nxv_mask m) { return _mm512_maskz_loadu_ps(m, p); }
static inline void nxv_storeu(float *p, nxv v) { _mm512_storeu_ps(p, v); }
static inline void nxv_store_n(float *p, nxv_mask m, nxv v) { _mm512_mask_storeu_ps(p, m, v); }
static inline nxv nxv_set1(float a) { return _mm512_set1_ps(a); }
static inline nxv nxv_add(nxv a, nxv b) { return _mm512_add_ps(a, b); }
static inline nxv nxv_mul(nxv a, nxv b) { return _mm512_mul_ps(a, b); }
static inline nxv nxv_fmadd(nxv a, nxv b, nxv c) { return _mm512_fmadd_ps(a, b, c); }
static inline nxv nxv_exp(nxv x) { return nx_exp16(x); }
static inline nxv nxv_exp_nosub(nxv x) { return nx_exp_nosub16(x); }
static inline nxv nxv_tanh(nxv x) { return nx_tanh16(x); }
static inline nxv nxv_silu(nxv x) { return nx_silu16(x); }
static inline nxvd_half nxv_set1_f64(double a) { return _mm512_set1_pd(a); }
static inline nxv nxv_sub_f64(nxv x, nxvd_half mu) { return nx_sub_f64_16(x, mu); }
static inline float nxv_rms_inv(const float *x, int64_t n, float eps) {
    return nx_rms_inv16(x, n, eps);
}
static inline void nxv_ln_stats(const float *x, int64_t n, double *mean, double *var) {
    nx_ln_stats16(x, n, mean, var);
}
/* Stored weight values -> float32 lanes, exact (nx_wtype.h): 16 binary16 (NaN payload and the
 * signalling bit kept: vcvtph2ps quiets sNaN, so NaN lanes are rebuilt from the bits), 16
 * bfloat16, 16 int8 times a scale. p may be unaligned. */
static inline nxv nxv_load_f16(const uint8_t *p) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    const __m512i u = _mm512_cvtepu16_epi32(h);
    const __m512i mag = _mm512_and_si512(u, _mm512_set1_epi32(0x7fff));
    const __mmask16 nan = _mm512_cmpgt_epi32_mask(mag, _mm512_set1_epi32(0x7c00));
    const __m512i bits = _mm512_or_si512(
        _mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(u, _mm512_set1_epi32(0x8000)), 16),
                        _mm512_set1_epi32(0x7f800000)),
        _mm512_slli_epi32(_mm512_and_si512(u, _mm512_set1_epi32(0x3ff)), 13));
    return _mm512_mask_mov_ps(_mm512_cvtph_ps(h), nan, _mm512_castsi512_ps(bits));
}
static inline nxv nxv_load_bf16(const uint8_t *p) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline nxv nxv_load_q8(const uint8_t *q, nxv d) {
    const __m128i b = _mm_loadu_si128((const __m128i *)q);
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), d);
}
static inline nxv nxv_zero(void) { return _mm512_setzero_ps(); }
static inline void nxv_store(float *p, nxv v) { _mm512_store_ps(p, v); } /* p 64-byte aligned */
/* int32 lanes, and the float ops by the intrinsic's own name (NXV_PS(mul)(a, b) is
 * _mm512_mul_ps(a, b), no wrapper): the block decoders (nx_quants_ew.h) are spelled with these so
 * that their 16-lane code is exactly the intrinsics code they were first written as. */
typedef __m512i nxvi;
#define NXV_PS(op) _mm512_##op##_ps
#define nxvi_set1 _mm512_set1_epi32
#define nxvi_and _mm512_and_si512
#define nxvi_or _mm512_or_si512
#define nxvi_sub _mm512_sub_epi32
#define nxvi_srli _mm512_srli_epi32
#define nxvi_slli _mm512_slli_epi32
/* Masked / predicated steps by the intrinsic's own name, for the same reason (nx_bwd_ew.h):
 * NXV_MASKN(n) lanes [0, n) (nxv_mask), NXV_LOADN / NXV_STOREN masked, NXV_CMP(a, b, _CMP_*) a
 * lane predicate (nxv_pred), NXV_SELECT(m, f, t) lane m ? t : f, NXV_EXP the exp polynomial. */
typedef __mmask16 nxv_pred;
#define NXV_MASKN(n) nx_mask16(n)
#define NXV_LOADN(p, m) _mm512_maskz_loadu_ps(m, p)
#define NXV_STOREN(p, m, v) _mm512_mask_storeu_ps(p, m, v)
#define NXV_CMP(a, b, pred) _mm512_cmp_ps_mask(a, b, pred)
#define NXV_SELECT(m, f, t) _mm512_mask_blend_ps(m, f, t)
#define NXV_EXP(x) nx_exp16(x)
#define NXV_HMAX(v) _mm512_reduce_max_ps(v) /* horizontal max / sum of the lanes */
#define NXV_HSUM(v) _mm512_reduce_add_ps(v)
static inline nxvi nxvi_srl(nxvi a, int n) { return _mm512_srl_epi32(a, _mm_cvtsi32_si128(n)); }
static inline nxv nxvi_cvt(nxvi a) { return _mm512_cvtepi32_ps(a); }
/* 16 bytes at p (any alignment) -> 16 lanes, zero- / sign-extended */
static inline nxvi nxvi_load_u8(const uint8_t *p) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
}
static inline nxvi nxvi_load_i8(const uint8_t *p) {
    return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
}
/* De-interleave 16 groups of 4 floats (p[4i + c], i < 16, any alignment): c[k][i] = p[4i + k].
 * In-lane 4x4 transposes leave group 4k + L's values at lane 4L + k; one permute each restores
 * the order. */
static inline void nxv_deinterleave4(const float *p, nxv c[4]) {
    const __m512 a = _mm512_loadu_ps(p), b = _mm512_loadu_ps(p + 16);
    const __m512 e = _mm512_loadu_ps(p + 32), f = _mm512_loadu_ps(p + 48);
    const __m512 t0 = _mm512_unpacklo_ps(a, b), t1 = _mm512_unpackhi_ps(a, b);
    const __m512 t2 = _mm512_unpacklo_ps(e, f), t3 = _mm512_unpackhi_ps(e, f);
    const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    c[0] = _mm512_permutexvar_ps(idx, _mm512_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0)));
    c[1] = _mm512_permutexvar_ps(idx, _mm512_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2)));
    c[2] = _mm512_permutexvar_ps(idx, _mm512_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0)));
    c[3] = _mm512_permutexvar_ps(idx, _mm512_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2)));
}
/* In-register 16x16 transpose: r[i][j] -> r[j][i]. */
static inline void nxv_transpose(nxv r[16]) {
    __m512 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    /* r[4g + c], 128-bit lane L = rows 4g..4g+3 of column 4L + c */
    for (int c = 0; c < 4; c++) {
        __m512 a = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x88);
        __m512 b = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xDD);
        __m512 e = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x88);
        __m512 f = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xDD);
        t[c] = _mm512_shuffle_f32x4(a, e, 0x88);
        t[8 + c] = _mm512_shuffle_f32x4(a, e, 0xDD);
        t[4 + c] = _mm512_shuffle_f32x4(b, f, 0x88);
        t[12 + c] = _mm512_shuffle_f32x4(b, f, 0xDD);
    }
    for (int i = 0; i < 16; i++) r[i] = t[i];
}

#elif defined(__AVX2__)
#include "nx_vmath_avx2.h"

#define NXV_W 8
#define NXV_FN(name) name##_avx2
typedef __m256 nxv;
typedef __m256d nxvd_half;
typedef __m256i nxv_mask;
static inline nxv_mask nxv_mask_n(int64_t valid) { return nx_mask8(valid); }
static inline nxv nxv_loadu(const float *p) { return _mm256_loadu_ps(p); }
static inline nxv nxv_load_n(const float *p, nxv_mask m) { return _mm256_maskload_ps(p, m); }
static inline void nxv_storeu(float *p, nxv v) { _mm256_storeu_ps(p, v); }
static inline void nxv_store_n(float *p, nxv_mask m, nxv v) { _mm256_maskstore_ps(p, m, v); }
static inline nxv nxv_set1(float a) { return _mm256_set1_ps(a); }
static inline nxv nxv_add(nxv a, nxv b) { return _mm256_add_ps(a, b); }
static inline nxv nxv_mul(nxv a, nxv b) { return _mm256_mul_ps(a, b); }
static inline nxv nxv_fmadd(nxv a, nxv b, nxv c) { return _mm256_fmadd_ps(a, b, c); }
static inline nxv nxv_exp(nxv x) { return nx_exp8(x); }
static inline nxv nxv_exp_nosub(nxv x) { return nx_exp_nosub8(x); }
static inline nxv nxv_tanh(nxv x) { return nx_tanh8(x); }
static inline nxv nxv_silu(nxv x) { return nx_silu8(x); }
static inline nxvd_half nxv_set1_f64(double a) { return _mm256_set1_pd(a); }
static inline nxv nxv_sub_f64(nxv x, nxvd_half mu) { return nx_sub_f64_8(x, mu); }
static inline float nxv_rms_inv(const float *x, int64_t n, float eps) {
    return nx_rms_inv8(x, n, eps);
}
static inline void nxv_ln_stats(const float *x, int64_t n, double *mean, double *var) {
    nx_ln_stats8(x, n, mean, var);
}
/* As the 16-lane versions above, 8 lanes. */
static inline nxv nxv_load_f16(const uint8_t *p) {
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    const __m256i u = _mm256_cvtepu16_epi32(h);
    const __m256i mag = _mm256_and_si256(u, _mm256_set1_epi32(0x7fff));
    const __m256i nan = _mm256_cmpgt_epi32(mag, _mm256_set1_epi32(0x7c00));
    const __m256i bits = _mm256_or_si256(
        _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x8000)), 16),
                        _mm256_set1_epi32(0x7f800000)),
        _mm256_slli_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x3ff)), 13));
    return _mm256_blendv_ps(_mm256_cvtph_ps(h), _mm256_castsi256_ps(bits),
                            _mm256_castsi256_ps(nan));
}
static inline nxv nxv_load_bf16(const uint8_t *p) {
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline nxv nxv_load_q8(const uint8_t *q, nxv d) {
    const __m128i b = _mm_loadl_epi64((const __m128i *)q);
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), d);
}
static inline nxv nxv_zero(void) { return _mm256_setzero_ps(); }
static inline void nxv_store(float *p, nxv v) { _mm256_store_ps(p, v); } /* p 32-byte aligned */
typedef __m256i nxvi;
#define NXV_PS(op) _mm256_##op##_ps
#define nxvi_set1 _mm256_set1_epi32
#define nxvi_and _mm256_and_si256
#define nxvi_or _mm256_or_si256
#define nxvi_sub _mm256_sub_epi32
#define nxvi_srli _mm256_srli_epi32
#define nxvi_slli _mm256_slli_epi32
typedef __m256 nxv_pred;
#define NXV_MASKN(n) nx_mask8(n)
#define NXV_LOADN(p, m) _mm256_maskload_ps(p, m)
#define NXV_STOREN(p, m, v) _mm256_maskstore_ps(p, m, v)
#define NXV_CMP(a, b, pred) _mm256_cmp_ps(a, b, pred)
#define NXV_SELECT(m, f, t) _mm256_blendv_ps(f, t, m)
#define NXV_EXP(x) nx_exp8(x)
#define NXV_HMAX(v) nx_hmax8(v)
#define NXV_HSUM(v) nx_hsum8(v)
static inline nxvi nxvi_srl(nxvi a, int n) { return _mm256_srl_epi32(a, _mm_cvtsi32_si128(n)); }
static inline nxv nxvi_cvt(nxvi a) { return _mm256_cvtepi32_ps(a); }
/* 8 bytes at p (any alignment) -> 8 lanes, zero- / sign-extended */
static inline nxvi nxvi_load_u8(const uint8_t *p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
}
static inline nxvi nxvi_load_i8(const uint8_t *p) {
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
}
/* As the 16-lane version: 8 groups of 4 floats, c[k][i] = p[4i + k]; after the in-lane
 * transposes group 2k + L sits at lane 4L + k. */
static inline void nxv_deinterleave4(const float *p, nxv c[4]) {
    const __m256 a = _mm256_loadu_ps(p), b = _mm256_loadu_ps(p + 8);
    const __m256 e = _mm256_loadu_ps(p + 16), f = _mm256_loadu_ps(p + 24);
    const __m256 t0 = _mm256_unpacklo_ps(a, b), t1 = _mm256_unpackhi_ps(a, b);
    const __m256 t2 = _mm256_unpacklo_ps(e, f), t3 = _mm256_unpackhi_ps(e, f);
    const __m256i idx = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    c[0] = _mm256_permutevar8x32_ps(_mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0)), idx);
    c[1] = _mm256_permutevar8x32_ps(_mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2)), idx);
    c[2] = _mm256_permutevar8x32_ps(_mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0)), idx);
    c[3] = _mm256_permutevar8x32_ps(_mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2)), idx);
}
/* In-register 8x8 transpose: r[i][j] -> r[j][i]. */
static inline void nxv_transpose(nxv r[8]) {
    __m256 t[8], s[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {
        s[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        s[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        s[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        s[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    /* s[4g + c], 128-bit lane L = rows 4g..4g+3 of column 4L + c */
    for (int c = 0; c < 4; c++) {
        r[c] = _mm256_permute2f128_ps(s[c], s[4 + c], 0x20);
        r[4 + c] = _mm256_permute2f128_ps(s[c], s[4 + c], 0x31);
    }
}

#else
#error "nx_simd.h: include only from files compiled with AVX2 or AVX-512 flags"
#endif

#endif
