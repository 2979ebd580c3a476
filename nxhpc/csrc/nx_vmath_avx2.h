/* nx_vmath_avx2.h -- the 8-lane (ymm) vector math shared by the AVX2+FMA kernel files
 * (nx_ops_avx2.c, nx_bwd_avx2.c): lane masks, exp / tanh / silu polynomials, horizontal max/sum,
 * the float64 row statistics of rmsnorm / layernorm, and the 4x16 tile of X Y^T the attention
 * forward and backward both compute.
 * Each helper exists once, here; the forward and backward kernels call the same code, so an
 * exp(x) in the attention forward and backward is bit-identical by construction.
 *
 * Must only be included from files compiled with the AVX2 ISA flags (-mavx2 -mfma -mf16c: the
 * *_avx2.c files, see setup.py), and those files are only entered after the run-time CPU probe
 * (nx_cpu_isa_supported(NX_ISA_AVX2)). Including it from a generic file would let the compiler
 * emit AVX2 code into paths that run on any CPU, hence the #error below.
 * Everything is static inline: no symbols, no state. */
#ifndef NX_VMATH_AVX2_H
#define NX_VMATH_AVX2_H

/* clang-format off */
#if defined(__GNUC__) && !(defined(__AVX2__) && defined(__FMA__))
#error "nx_vmath_avx2.h: include only from files compiled with -mavx2 -mfma (the *_avx2.c files)"
#endif
/* clang-format on */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

/* Lane mask for maskload/maskstore: lanes [0, valid) set (valid clamped to [0, 8]). */
static inline __m256i nx_mask8(int64_t valid) {
    int v = valid >= 8 ? 8 : valid <= 0 ? 0 : (int)valid;
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(v), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* p * 2^n for the 8-lane exp and 2^y (n in [-160, 129], integral): as two exact power-of-two
 * factors 2^(n>>1) * 2^(n-(n>>1)), so overflow gives inf and subnormal results are rounded
 * once; p * 2^(n>>1) stays normal, hence exact, so only the last product rounds, as AVX-512's
 * scalef does: the two give the same results lane for lane. */
static inline __m256 nx_scale2n8(__m256 p, __m256 n) {
    __m256i ni = _mm256_cvtps_epi32(n); /* NaN -> INT_MIN; p is NaN then anyway */
    __m256i n1 = _mm256_srai_epi32(ni, 1);
    __m256i n2 = _mm256_sub_epi32(ni, n1);
    __m256 s1 =
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, _mm256_set1_epi32(127)), 23));
    __m256 s2 =
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, _mm256_set1_epi32(127)), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
}

/* y - floor(y) rounded toward -inf, as AVX-512's VREDUCEPS (round-down mode) gives it: the
 * subtraction rounded to nearest, then one ulp down where that rounded up. -floor(y) >= |y| for
 * y <= 0, so (Fast2Sum) z = f + floor(y) and y - z are exact, and y - z is the rounding error.
 * Only y in (-1, 0) can round (f = 1 + y); f > 0 there, so one ulp down is the bit pattern
 * minus 1. NaN stays NaN. */
static inline __m256 nx_floor8(__m256 y) {
    return _mm256_round_ps(y, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
}

static inline __m256 nx_frac_down8(__m256 y) {
    const __m256 n = nx_floor8(y);
    const __m256 f = _mm256_sub_ps(y, n);
    const __m256 t = _mm256_sub_ps(y, _mm256_add_ps(f, n));
    const __m256i up = _mm256_castps_si256(_mm256_cmp_ps(t, _mm256_setzero_ps(), _CMP_LT_OQ));
    return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(f), up)); /* up: -1 */
}

/* 8-lane spellings of the shared polynomials (nx_vmath_ew.h) */
#define NXM_FN(name) name##8
#define NXM_PS(op) _mm256_##op##_ps
typedef __m256 nxm_v;
typedef __m256 nxm_cmp; /* a lane predicate (all-ones lanes) */
#define NXM_ROUND(v) _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define NXM_SCALE2N(p, n) nx_scale2n8(p, n)
#define NXM_CMP(a, b, pred) _mm256_cmp_ps(a, b, pred)
#define NXM_FRAC_DOWN(y) nx_frac_down8(y)
#define NXM_SCALE2_FLOOR(p, y) nx_scale2n8(p, nx_floor8(y)) /* p * 2^floor(y), rounded once */
#define NXM_SELECT(m, f, t) _mm256_blendv_ps(f, t, m) /* lane: m ? t : f */
#define NXM_ANY(m) (_mm256_movemask_ps(m) != 0)
#define NXM_INT_BITS(t) _mm256_castsi256_ps(_mm256_cvtps_epi32(t)) /* round(t) as float bits */
#include "nx_vmath_ew.h" /* nx_exp8, nx_exp2_8, nx_tanh8 */

/* silu(x) = (x < 0 ? x*e : x) / (1 + e), e = exp(-|x|) (nx_exp_nosub8), 8 lanes, same formula as
 * nx_silu16: never overflows; -inf is clamped to -FLT_MAX first so silu(-inf) = -0; NaN kept.
 * Used by the forward swiglu only: the swiglu backward (nx_bwd_avx2.c) computes silu as
 * x * sigmoid(x) with its own rounding, see the comment there. */
static inline __m256 nx_silu8(__m256 x) {
    __m256 e = nx_exp_nosub8(_mm256_or_ps(x, _mm256_set1_ps(-0.0f))); /* no underflow assist */
    __m256 xc = _mm256_max_ps(_mm256_set1_ps(-3.4028234663852886e38f), x);
    __m256 neg = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ);
    __m256 num = _mm256_blendv_ps(x, _mm256_mul_ps(xc, e), neg);
    return _mm256_div_ps(num, _mm256_add_ps(e, _mm256_set1_ps(1.0f)));
}

/* Horizontal max of 8 lanes (exact), tree (l, l+4), (l, l+2), (l0, l1) with maxps semantics:
 * a NaN lane may or may not propagate, depending on its position. */
static inline float nx_hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

/* Horizontal sum of 8 lanes in float32, fixed tree (l + l+4), (l + l+2), (l0 + l1): the same
 * order on every call, so results are reproducible (not the sequential left-to-right sum). */
static inline float nx_hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 16 float64 lane accumulators as four ymm (a0 = lanes 0-3, a1 = 4-7, a2 = 8-11, a3 = 12-15)
 * summed in the generic tree (l + l+8), (l + l+4), (l + l+2), (l0 + l1) (nx_tree16_pd's). */
static inline double nx_tree16_pd4(__m256d a0, __m256d a1, __m256d a2, __m256d a3) {
    __m256d s4 = _mm256_add_pd(_mm256_add_pd(a0, a2), _mm256_add_pd(a1, a3));
    __m128d s2 = _mm_add_pd(_mm256_castpd256_pd128(s4), _mm256_extractf128_pd(s4, 1));
    return _mm_cvtsd_f64(s2) + _mm_cvtsd_f64(_mm_unpackhi_pd(s2, s2));
}

/* Elements [i, i+16) of x (lanes past n zero) as four float64 ymm, exact. */
static inline void nx_cvt16_pd4(const float *x, int64_t i, int64_t n, __m256d d[4]) {
    __m256 u = _mm256_maskload_ps(x + i, nx_mask8(n - i));
    __m256 v = _mm256_maskload_ps(x + i + 8, nx_mask8(n - i - 8));
    d[0] = _mm256_cvtps_pd(_mm256_castps256_ps128(u));
    d[1] = _mm256_cvtps_pd(_mm256_extractf128_ps(u, 1));
    d[2] = _mm256_cvtps_pd(_mm256_castps256_ps128(v));
    d[3] = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
}

/* 1 / sqrt(sum(x^2)/n + eps), the order of nx_rms_inv_generic (nx_ops.c), bit for bit. */
static inline float nx_rms_inv8(const float *x, int64_t n, float eps) {
    __m256d a[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(),
                    _mm256_setzero_pd()};
    for (int64_t i = 0; i < n; i += 16) {
        __m256d d[4];
        nx_cvt16_pd4(x, i, n, d);
        for (int j = 0; j < 4; j++) a[j] = _mm256_fmadd_pd(d[j], d[j], a[j]); /* exact products */
    }
    return (float)(1.0 / sqrt(nx_tree16_pd4(a[0], a[1], a[2], a[3]) / (double)n + (double)eps));
}

/* LayerNorm statistics in the order of nx_ln_stats_generic (nx_ops.c), bit for bit (see
 * nx_ln_stats16). Lanes past n contribute exact zeros. */
static inline void nx_ln_stats8(const float *x, int64_t n, double *mean, double *var) {
    __m256d s[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(),
                    _mm256_setzero_pd()};
    for (int64_t i = 0; i < n; i += 16) {
        __m256d d[4];
        nx_cvt16_pd4(x, i, n, d);
        for (int j = 0; j < 4; j++) s[j] = _mm256_add_pd(s[j], d[j]);
    }
    const double mu = nx_tree16_pd4(s[0], s[1], s[2], s[3]) / (double)n;
    const __m256d vmu = _mm256_set1_pd(mu);
    const __m256i lane = _mm256_setr_epi64x(0, 1, 2, 3);
    __m256d q[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(),
                    _mm256_setzero_pd()};
    for (int64_t i = 0; i < n; i += 16) {
        __m256d d[4];
        nx_cvt16_pd4(x, i, n, d);
        for (int j = 0; j < 4; j++) {
            const int64_t valid = n - i - 4 * j; /* lanes of this quarter that exist */
            __m256d keep = _mm256_castsi256_pd(_mm256_cmpgt_epi64(_mm256_set1_epi64x(valid), lane));
            __m256d dv = _mm256_and_pd(_mm256_sub_pd(d[j], vmu), keep); /* past n: +0 */
            q[j] = _mm256_add_pd(q[j], _mm256_mul_pd(dv, dv));
        }
    }
    *mean = mu;
    *var = nx_tree16_pd4(q[0], q[1], q[2], q[3]) / (double)n;
}

/* (float)((double)x - mu) per lane: the difference rounded once. */
static inline __m256 nx_sub_f64_8(__m256 x, __m256d mu) {
    __m128 a = _mm256_cvtpd_ps(_mm256_sub_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(x)), mu));
    __m128 b = _mm256_cvtpd_ps(_mm256_sub_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(x, 1)), mu));
    return _mm256_insertf128_ps(_mm256_castps128_ps256(a), b, 1);
}

/* S[r * ld + 0..15] := sum_d X[r * hd + d] * YT[d * 16 + 0..15] for the rows r < nr <= 4: one
 * 4 x 16 tile of X Y^T (YT 32-byte aligned, 16 floats a row), each element one FMA chain over d
 * in order. 8 accumulators + 2 loads + 1 broadcast: the 16 ymm registers. */
static inline __attribute__((always_inline)) void nx_dot_4x16(const int nr, const float *X,
                                                              int64_t hd, const float *YT,
                                                              float *S, int64_t ld) {
    __m256 acc[4][2];
    for (int r = 0; r < nr; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t d = 0; d < hd; d++) {
        __m256 y0 = _mm256_load_ps(YT + d * 16), y1 = _mm256_load_ps(YT + d * 16 + 8);
        for (int r = 0; r < nr; r++) {
            __m256 b = _mm256_broadcast_ss(X + r * hd + d);
            acc[r][0] = _mm256_fmadd_ps(b, y0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(b, y1, acc[r][1]);
        }
    }
    for (int r = 0; r < nr; r++) {
        _mm256_store_ps(S + r * ld, acc[r][0]);
        _mm256_store_ps(S + r * ld + 8, acc[r][1]);
    }
}

#endif
