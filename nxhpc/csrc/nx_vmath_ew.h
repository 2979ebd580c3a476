/* nx_vmath_ew.h -- the exp, softmax-weight 2^y and tanh polynomials, written once for both vector
 * widths: included exactly once by nx_vmath_avx512.h (nx_exp16, nx_exp2_16, nx_tanh16) and by
 * nx_vmath_avx2.h (nx_exp8, nx_exp2_8, nx_tanh8), each after defining its spellings:
 * NXM_FN(name) (name16 / name8), NXM_PS(op) (the _ps intrinsic of its width, by its own name),
 * nxm_v, nxm_cmp, NXM_ROUND, NXM_SCALE2N, NXM_FRAC_DOWN, NXM_SCALE2_FLOOR, NXM_CMP, NXM_SELECT.
 * Every lane computes the same float32 values at both widths (the same bits).
 * Must not: be included from anywhere else (it has no include guard of its own: one copy per
 * width), keep state, or emit symbols (static inline only).
 */

/* exp's range reduction and polynomial (below): returns p = exp(r) and n, x = n ln2 + r. */
static inline nxm_v NXM_FN(nx_exp_poly)(nxm_v x, nxm_v *n_out) {
    x = NXM_PS(max)(NXM_PS(set1)(-110.0f), NXM_PS(min)(NXM_PS(set1)(89.0f), x));
    nxm_v n = NXM_ROUND(NXM_PS(mul)(x, NXM_PS(set1)(1.44269504088896341f)));
    nxm_v r = NXM_PS(fnmadd)(n, NXM_PS(set1)(0.693359375f), x);
    r = NXM_PS(fnmadd)(n, NXM_PS(set1)(-2.12194440e-4f), r);
    nxm_v p = NXM_PS(set1)(1.9875691500e-4f);
    p = NXM_PS(fmadd)(p, r, NXM_PS(set1)(1.3981999507e-3f));
    p = NXM_PS(fmadd)(p, r, NXM_PS(set1)(8.3334519073e-3f));
    p = NXM_PS(fmadd)(p, r, NXM_PS(set1)(4.1665795894e-2f));
    p = NXM_PS(fmadd)(p, r, NXM_PS(set1)(1.6666665459e-1f));
    p = NXM_PS(fmadd)(p, r, NXM_PS(set1)(5.0000001201e-1f));
    p = NXM_PS(fmadd)(p, NXM_PS(mul)(r, r), r);
    *n_out = n;
    return NXM_PS(add)(p, NXM_PS(set1)(1.0f));
}

/* exp(x). Range reduction x = n*ln2 + r (ln2 split in two, Cody-Waite), |r| <= ln2/2,
 * exp(r) = 1 + r + r^2 * P5(r) (Cephes expf minimax coefficients), result = p * 2^n
 * (NXM_SCALE2N: AVX-512 scalef, AVX2 two exact power-of-two factors; both round once).
 * Input clamped to [-110, 89] first (NaN kept: the clamp returns its second operand on NaN), so
 * exp(+inf) = inf, exp(-inf) = 0, subnormal results are rounded once.
 * Max error measured over the float range: <= 2 ulp (tests/test_kernels_ops.py). */
static inline nxm_v NXM_FN(nx_exp)(nxm_v x) {
    nxm_v n;
    const nxm_v p = NXM_FN(nx_exp_poly)(x, &n);
    return NXM_SCALE2N(p, n);
}

/* exp(x) with nx_exp's bits, its results below 2^-125 made without the scaling step's
 * underflow: an underflowing result costs a microcode assist per vector on Intel cores (the
 * float32 attention of a row whose scores spread over more than ~90: 12x its time on the AMX
 * Xeon). Where n <= -126, p * 2^n is a multiple of 2^-149 plus a remainder (the spacing of the
 * subnormals and of the binade above them), so its correctly rounded value has the bit pattern
 * round(p * 2^(n + 149)) (ties to even, MXCSR's rounding: the integer conversion), which is what
 * the gradual underflow of NXM_SCALE2N gives; p * 2^(n + 149) is exact (a normal float times a
 * power of two that keeps it normal). The other lanes scale as nx_exp does. *low_any is set to
 * 1 when some lane took that path (its result may be subnormal), and left as it was otherwise. */
static inline nxm_v NXM_FN(nx_exp_nosub_any)(nxm_v x, int *low_any) {
    nxm_v n;
    const nxm_v p = NXM_FN(nx_exp_poly)(x, &n);
    const nxm_cmp low = NXM_CMP(n, NXM_PS(set1)(-125.5f), _CMP_LT_OQ); /* n <= -126; not NaN */
    if (!NXM_ANY(low)) return NXM_SCALE2N(p, n);
    *low_any = 1;
    const nxm_v zero = NXM_PS(setzero)();
    const nxm_v big = NXM_SCALE2N(p, NXM_SELECT(low, n, zero)); /* low lanes: p, unused */
    const nxm_v t = NXM_SCALE2N(p, NXM_SELECT(low, zero, NXM_PS(add)(n, NXM_PS(set1)(149.0f))));
    return NXM_SELECT(low, big, NXM_INT_BITS(t));
}

/* nx_exp_nosub_any without the report. */
static inline nxm_v NXM_FN(nx_exp_nosub)(nxm_v x) {
    int unused = 0;
    return NXM_FN(nx_exp_nosub_any)(x, &unused);
}

/* 2^f for f = y - floor(y) (nx_exp2_ below, without its clamp and scaling): the fraction
 * rounded toward -inf and the degree-4 polynomial. The AMX attention scales it itself
 * (nx_attn_bf16_amx.c, nx_ax_exp2z). */
static inline nxm_v NXM_FN(nx_exp2_frac)(nxm_v y) {
    const nxm_v f = NXM_FRAC_DOWN(y);
    nxm_v p = NXM_PS(set1)(0x1.bc31dap-7f);
    p = NXM_PS(fmadd)(p, f, NXM_PS(set1)(0x1.aa3fcap-5f));
    p = NXM_PS(fmadd)(p, f, NXM_PS(set1)(0x1.ee5884p-3f));
    p = NXM_PS(fmadd)(p, f, NXM_PS(set1)(0x1.62d51cp-1f));
    return NXM_PS(fmadd)(p, f, NXM_PS(set1)(1.0f));
}

/* 2^y, the softmax weight of the `bf16` attention (E of nx_attn_bf16.h: its scores are in base
 * 2), for y <= 0, -inf and NaN (the only arguments there: a score minus the running max): y
 * clamped below at -160 (NaN kept: max returns its second operand on NaN); f = y - floor(y) in
 * [0, 1) rounded toward -inf (exact but for y in (-1, 0): VREDUCEPS's rounding); 2^f ~ 1 + f (c1
 * + f (c2 + f (c3 + f c4))) by four fmas (a fit for the least maximum relative error on [0, 1]
 * with p(1) = 2, so 2^y <= 1 holds); result p * 2^floor(y) rounded once. NXM_FRAC_DOWN: AVX-512
 * VREDUCEPS, AVX2 the floor, a subtraction and its rounding fixed; NXM_SCALE2_FLOOR: AVX-512
 * VSCALEFPS, which takes floor(y) itself, AVX2 nx_scale2n8 of the floor: the same values.
 * 2^0 = 1, 2^-inf = 0. The weights are rounded to bfloat16 (relative 2^-9) right after, so it
 * needs far less than nx_exp's accuracy: measured max relative error 3.42e-6 on 1e8 points of
 * [-126, 0], bound 2^-18 (3.8e-6); below -126 (subnormal results) an absolute 2^-150 more
 * (tests/test_kernels_attn_bf16.py). 7 operations against nx_exp's 15 (no multiply by log2 e,
 * no Cody-Waite reduction: the caller's scale already holds log2 e). */
static inline nxm_v NXM_FN(nx_exp2_)(nxm_v y) {
    y = NXM_PS(max)(NXM_PS(set1)(-160.0f), y);
    return NXM_SCALE2_FLOOR(NXM_FN(nx_exp2_frac)(y), y);
}

/* tanh(x). |x| < 0.625: odd minimax polynomial x + x^3 P4(x^2) (Cephes tanhf); otherwise
 * sign(x) * (1 - 2 / (exp(2|x|) + 1)) with the exp above, which saturates to +-1 and keeps NaN.
 * tanh(-0) = -0. Measured <= 1.2 ulp (test bound 3 ulp, tests/test_kernels_ops.py). */
static inline nxm_v NXM_FN(nx_tanh)(nxm_v x) {
    const nxm_v sign = NXM_PS(set1)(-0.0f);
    nxm_v ax = NXM_PS(andnot)(sign, x);
    nxm_v z = NXM_PS(mul)(x, x);
    nxm_v p = NXM_PS(set1)(-5.70498872745e-3f);
    p = NXM_PS(fmadd)(p, z, NXM_PS(set1)(2.06390887954e-2f));
    p = NXM_PS(fmadd)(p, z, NXM_PS(set1)(-5.37397155531e-2f));
    p = NXM_PS(fmadd)(p, z, NXM_PS(set1)(1.33314422036e-1f));
    p = NXM_PS(fmadd)(p, z, NXM_PS(set1)(-3.33332819422e-1f));
    nxm_v small = NXM_PS(fmadd)(NXM_PS(mul)(p, z), x, x);
    nxm_v e = NXM_FN(nx_exp)(NXM_PS(add)(ax, ax));
    nxm_v big = NXM_PS(sub)(NXM_PS(set1)(1.0f),
                            NXM_PS(div)(NXM_PS(set1)(2.0f), NXM_PS(add)(e, NXM_PS(set1)(1.0f))));
    nxm_cmp is_small = NXM_CMP(ax, NXM_PS(set1)(0.625f), _CMP_LT_OQ);
    /* both branches carry sign(x) (the polynomial is odd with 1 + z*P > 0); OR-ing it in keeps
     * tanh(-0) = -0 */
    return NXM_PS(or)(NXM_SELECT(is_small, big, small), NXM_PS(and)(sign, x));
}

#undef NXM_FN
#undef NXM_PS
#undef NXM_ROUND
#undef NXM_SCALE2N
#undef NXM_CMP
#undef NXM_SELECT
