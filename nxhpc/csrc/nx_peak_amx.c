/* nx_peak_amx.c -- the amx_int8 and amx_bf16 peak loops (nx_peak.h): tdpbssd / tdpbf16ps on
 * 4 independent C tiles (2 x 2 blocking: C[2i+j] += A[i] . B[j]).
 *
 * Owns: those loops and their tile configuration. Entered only after the probe reports the amx
 * level, whose bits include the OS tile state and Linux's XTILEDATA permission for this process
 * (nx_cpu.c asks for it; nx_peak_supported). Each call loads its own tile configuration (it is
 * per thread) and releases the tiles before returning. Must not: touch memory inside the loops,
 * or return with tiles configured.
 */
#include "nx_amx.h"
#include "nx_peak.h"

#include <immintrin.h>
#include <string.h>

static void nx_peak_tiles_config(void) {
    const nx_tilecfg cfg = nx_tile_config();
    nx_tile_loadconfig(&cfg);
}

/* Tiles: 0-3 the accumulators C0..C3, 4-5 A0/A1, 6-7 B0/B1; every tile is 16 rows of 64 bytes
 * (row stride 64 in the buffers). */
#define NX_PEAK_AMX_LOOP(DP, a, b, acc, iters)                                                     \
    do {                                                                                           \
        const uint8_t *a_ = (const uint8_t *)(a), *b_ = (const uint8_t *)(b);                     \
        uint8_t *c_ = (uint8_t *)(acc);                                                            \
        nx_peak_tiles_config();                                                                    \
        _tile_loadd(0, c_, 64);                                                                    \
        _tile_loadd(1, c_ + 1024, 64);                                                             \
        _tile_loadd(2, c_ + 2048, 64);                                                             \
        _tile_loadd(3, c_ + 3072, 64);                                                             \
        _tile_loadd(4, a_, 64);                                                                    \
        _tile_loadd(5, a_ + 1024, 64);                                                             \
        _tile_loadd(6, b_, 64);                                                                    \
        _tile_loadd(7, b_ + 1024, 64);                                                             \
        for (size_t it_ = 0; it_ < (iters); it_++) {                                               \
            DP(0, 4, 6);                                                                           \
            DP(1, 4, 7);                                                                           \
            DP(2, 5, 6);                                                                           \
            DP(3, 5, 7);                                                                           \
        }                                                                                          \
        _tile_stored(0, c_, 64);                                                                   \
        _tile_stored(1, c_ + 1024, 64);                                                            \
        _tile_stored(2, c_ + 2048, 64);                                                            \
        _tile_stored(3, c_ + 3072, 64);                                                            \
        _tile_release();                                                                           \
    } while (0)

void nx_peak_amx_int8_amx(size_t iters, const void *a /* IN [2][16][64] s8 */,
                          const void *b /* IN [2][16][64] s8 */,
                          void *acc /* INOUT [4][16][16] i32 */) {
    NX_PEAK_AMX_LOOP(_tile_dpbssd, a, b, acc, iters);
}

void nx_peak_amx_bf16_amx(size_t iters, const void *a /* IN [2][16][32] bf16 */,
                          const void *b /* IN [2][16][32] bf16 */,
                          void *acc /* INOUT [4][16][16] f32 */) {
    NX_PEAK_AMX_LOOP(_tile_dpbf16ps, a, b, acc, iters);
}
