/* nx_vmath_avx512.h -- the 16-lane (zmm) vector math shared by the AVX-512 kernel files
 * (nx_ops_avx512.c, nx_bwd_avx512.c): lane masks, exp / tanh / silu polynomials, and the
 * float32 -> float64 split + fixed float64 reduction tree of the bit-identical rmsnorm paths, and
 * the float64 row statistics of rmsnorm / layernorm.
 * Each helper exists once, here; the forward and backward kernels call the same code, so an
 * exp(x) in the attention forward and backward is bit-identical by construction.
 * (Horizontal float32 max/sum use the compiler's _mm512_reduce_max_ps / _mm512_reduce_add_ps.)
 *
 * Must only be included from files compiled with the AVX-512 ISA flags (-mavx512f -mavx512dq
 * ...: the *_avx512.c files, see setup.py), and those files are only entered after the run-time
 * CPU probe (nx_cpu_isa_supported(NX_ISA_AVX512)). Including it from a generic or AVX2 file would
 * let the compiler emit AVX-512 code into paths that run on other CPUs, hence the #error below.
 * Everything is static inline: no symbols, no state. */
#ifndef NX_VMATH_AVX512_H
#define NX_VMATH_AVX512_H

/* clang-format off */
#if defined(__GNUC__) && !(defined(__AVX512F__) && defined(__AVX512DQ__) && defined(__FMA__))
#error "nx_vmath_avx512.h: include only from files compiled with -mavx512f -mavx512dq (the *_avx512.c files)"
#endif
/* clang-format on */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

/* Lane mask: lanes [0, valid) set (valid clamped to [0, 16]). */
static inline __mmask16 nx_mask16(int64_t valid) {
    return valid >= 16  ? (__mmask16)0xFFFF
           : valid <= 0 ? (__mmask16)0
                        : (__mmask16)((1u << valid) - 1u);
}

/* 16-lane spellings of the shared polynomials (nx_vmath_ew.h) */
#define NXM_FN(name) name##16
#define NXM_PS(op) _mm512_##op##_ps
typedef __m512 nxm_v;
typedef __mmask16 nxm_cmp; /* a lane predicate */
#define NXM_ROUND(v) _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define NXM_SCALE2N(p, n) _mm512_scalef_ps(p, n) /* p * 2^n, rounded once */
#define NXM_CMP(a, b, pred) _mm512_cmp_ps_mask(a, b, pred)
/* y - floor(y), rounded toward -inf (VREDUCEPS in round-down mode, no fraction bits kept: its
 * subtraction rounds in the immediate's mode too; only y in (-1, 0) rounds at all) */
#define NXM_FRAC_DOWN(y) _mm512_reduce_ps(y, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)
#define NXM_SCALE2_FLOOR(p, y) _mm512_scalef_ps(p, y) /* p * 2^floor(y), rounded once */
#define NXM_SELECT(m, f, t) _mm512_mask_blend_ps(m, f, t) /* lane: m ? t : f */
#define NXM_ANY(m) ((m) != 0)
#define NXM_INT_BITS(t) _mm512_castsi512_ps(_mm512_cvtps_epi32(t)) /* round(t) as float bits */
#include "nx_vmath_ew.h" /* nx_exp16, nx_exp2_16, nx_tanh16 */

/* silu(x) = (x < 0 ? x*e : x) / (1 + e), e = exp(-|x|) (nx_exp_nosub16: nx_exp16's bits without
 * its underflow, so an input below -104 costs no microcode assist): never overflows; -inf is
 * clamped to -FLT_MAX first so silu(-inf) = -0; NaN kept. Used by the forward swiglu only: the
 * swiglu backward (nx_bwd_avx512.c) computes silu as x * sigmoid(x) with its own rounding, see
 * the comment there. */
static inline __m512 nx_silu16(__m512 x) {
    const __m512 sign = _mm512_set1_ps(-0.0f);
    __m512 e = nx_exp_nosub16(_mm512_or_ps(x, sign)); /* exp's bits, no underflow assist */
    __m512 xc =
        _mm512_max_ps(_mm512_set1_ps(-3.4028234663852886e38f), x); /* -inf -> -FLT_MAX, NaN kept */
    __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
    __m512 num = _mm512_mask_mul_ps(x, neg, xc, e);
    return _mm512_div_ps(num, _mm512_add_ps(e, _mm512_set1_ps(1.0f)));
}

/* 16 floats -> two float64 vectors (elements 0..7, 8..15); exact. */
static inline void nx_cvt_lohi(__m512 v, __m512d *lo, __m512d *hi) {
    *lo = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
    *hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

/* Sum of 16 float64 accumulators, lanes l of lo = elements l (mod 16), of hi = elements l+8,
 * in the generic tree (l + l+8), (l + l+4), (l + l+2), (l0 + l1): the order nx_rms_inv_generic
 * (nx_ops.c) and the generic rmsnorm backward (nx_bwd.c) use, so the SIMD sums are bit-identical
 * to theirs. */
static inline double nx_tree16_pd(__m512d lo, __m512d hi) {
    __m512d s8 = _mm512_add_pd(lo, hi);
    __m256d s4 = _mm256_add_pd(_mm512_castpd512_pd256(s8), _mm512_extractf64x4_pd(s8, 1));
    __m128d s2 = _mm_add_pd(_mm256_castpd256_pd128(s4), _mm256_extractf128_pd(s4, 1));
    return _mm_cvtsd_f64(s2) + _mm_cvtsd_f64(_mm_unpackhi_pd(s2, s2));
}

/* 1 / sqrt(sum(x^2)/n + eps): the sum of squares in float64, 16 lanes (lane = i % 16), the fixed
 * tree of nx_tree16_pd -- the order of nx_rms_inv_generic (nx_ops.c), bit for bit. */
static inline float nx_rms_inv16(const float *x, int64_t n, float eps) {
    __m512d a0 = _mm512_setzero_pd(), a1 = _mm512_setzero_pd();
    for (int64_t i = 0; i < n; i += 16) {
        __m512d lo, hi;
        nx_cvt_lohi(_mm512_maskz_loadu_ps(nx_mask16(n - i), x + i), &lo, &hi);
        a0 = _mm512_fmadd_pd(lo, lo, a0); /* lo*lo is exact in float64: fma == mul + add */
        a1 = _mm512_fmadd_pd(hi, hi, a1);
    }
    return (float)(1.0 / sqrt(nx_tree16_pd(a0, a1) / (double)n + (double)eps));
}

/* LayerNorm statistics of x[0:n] in the order of nx_ln_stats_generic (nx_ops.c), bit for bit:
 * mean = (sum x) / n, var = (sum (x - mean)^2) / n, both sums in float64 over 16 lanes with the
 * tree of nx_tree16_pd; (x - mean) and its square are separate float64 operations. */
static inline void nx_ln_stats16(const float *x, int64_t n, double *mean, double *var) {
    __m512d s0 = _mm512_setzero_pd(), s1 = _mm512_setzero_pd();
    for (int64_t i = 0; i < n; i += 16) {
        __m512d lo, hi;
        nx_cvt_lohi(_mm512_maskz_loadu_ps(nx_mask16(n - i), x + i), &lo, &hi);
        s0 = _mm512_add_pd(s0, lo);
        s1 = _mm512_add_pd(s1, hi);
    }
    const double mu = nx_tree16_pd(s0, s1) / (double)n;
    const __m512d vmu = _mm512_set1_pd(mu);
    __m512d q0 = _mm512_setzero_pd(), q1 = _mm512_setzero_pd();
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = nx_mask16(n - i);
        __m512d lo, hi;
        nx_cvt_lohi(_mm512_maskz_loadu_ps(m, x + i), &lo, &hi);
        lo = _mm512_maskz_sub_pd((__mmask8)(m & 0xFF), lo, vmu); /* lanes past n: +0 */
        hi = _mm512_maskz_sub_pd((__mmask8)(m >> 8), hi, vmu);
        q0 = _mm512_add_pd(q0, _mm512_mul_pd(lo, lo));
        q1 = _mm512_add_pd(q1, _mm512_mul_pd(hi, hi));
    }
    *mean = mu;
    *var = nx_tree16_pd(q0, q1) / (double)n;
}

/* (float)((double)x - mu) per lane: the difference rounded once. */
static inline __m512 nx_sub_f64_16(__m512 x, __m512d mu) {
    __m512d lo, hi;
    nx_cvt_lohi(x, &lo, &hi);
    __m256 a = _mm512_cvtpd_ps(_mm512_sub_pd(lo, mu)), b = _mm512_cvtpd_ps(_mm512_sub_pd(hi, mu));
    return _mm512_insertf32x8(_mm512_castps256_ps512(a), b, 1);
}

#endif
