/* nx_peak_avx2.c -- the avx2 peak loops (nx_peak.h): fma_ymm (12 independent vfmadd213ps ymm
 * chains) and i8_ymm (12 vpmaddubsw + vpaddw chains).
 *
 * Owns: those loops. Entered only after the probe reports the avx2 level (nx_peak_supported).
 * Must not: touch memory inside the loop (operands and accumulators live in registers from the
 * loads before it to the stores after it).
 */
#include "nx_peak.h"

#include <immintrin.h>

/* 12 accumulators + a + b = 14 of the 16 ymm registers AVX2 encodes. */
#define NX_R12(M) M(0) M(1) M(2) M(3) M(4) M(5) M(6) M(7) M(8) M(9) M(10) M(11)

void nx_peak_fma_ymm_avx2(size_t iters, const void *a /* IN [8] f32 */,
                          const void *b /* IN [8] f32 */, void *acc /* INOUT [12][8] f32 */) {
    const __m256 va = _mm256_loadu_ps((const float *)a), vb = _mm256_loadu_ps((const float *)b);
    float *c = (float *)acc;
#define NX_LD_(i) __m256 c##i = _mm256_loadu_ps(c + 8 * (i));
#define NX_STEP_(i) c##i = _mm256_fmadd_ps(c##i, va, vb);
#define NX_ST_(i) _mm256_storeu_ps(c + 8 * (i), c##i);
    NX_R12(NX_LD_)
    for (size_t it = 0; it < iters; it++) {
        NX_R12(NX_STEP_)
    }
    NX_R12(NX_ST_)
#undef NX_LD_
#undef NX_STEP_
#undef NX_ST_
}

/* i8_ymm: 12 chains of vpaddw(acc, vpmaddubsw(a, b)); 12 accumulators + a + b as above. The
 * product has no input from the chain, so each chain's latency is the add's (1 cycle) and the
 * loop runs at vpmaddubsw's issue rate. */
void nx_peak_i8_ymm_avx2(size_t iters, const void *a /* IN [32] u8 */,
                         const void *b /* IN [32] i8 */, void *acc /* INOUT [12][16] i16 */) {
    __m256i va = _mm256_loadu_si256((const __m256i *)a), vb = _mm256_loadu_si256((const __m256i *)b);
    __m256i *c = (__m256i *)acc;
#define NX_LD_(i) __m256i c##i = _mm256_loadu_si256(c + (i));
/* the empty asm (no instruction) makes the compiler treat a as new before every step: it may
 * neither hoist the product out of the loop nor share one product among the chains */
#define NX_STEP_(i)                                                                                \
    __asm__("" : "+x"(va));                                                                        \
    c##i = _mm256_add_epi16(c##i, _mm256_maddubs_epi16(va, vb));
#define NX_ST_(i) _mm256_storeu_si256(c + (i), c##i);
    NX_R12(NX_LD_)
    for (size_t it = 0; it < iters; it++) {
        NX_R12(NX_STEP_)
    }
    NX_R12(NX_ST_)
#undef NX_LD_
#undef NX_STEP_
#undef NX_ST_
}
