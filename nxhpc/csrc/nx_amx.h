/* nx_amx.h -- the AMX tile configuration of every file that runs tiles (nx_lowp_amx.c,
 * nx_attn_bf16_amx.c, nx_peak_amx.c): LDTILECFG's 64-byte palette-1 record and the one way
 * this project loads it. Included only by files compiled with -mamx-tile.
 *
 * Owns: nx_tilecfg and nx_tile_config (zeroed, palette 1, every tile 16 rows x 64 bytes: callers
 * narrow the tiles they use) and nx_tile_loadconfig. Must not: load a configuration through
 * _tile_loadconfig. gcc 12's intrinsic gives its asm only 8 bytes of the record as input (a
 * `const void *` operand), so the compiler may drop the stores to rows[] / colsb[] as dead; the
 * tile loads then run on an unconfigured tile and fault (SIGILL). ggml's AMX kernels built with
 * gcc 12 crash that way on this project's AMX Xeon (2026-12-04; llama.cpp PR #26954 reports it).
 * Here the asm reads the whole record.
 */
#ifndef NX_AMX_H
#define NX_AMX_H

#include <stdint.h>
#include <string.h>

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} nx_tilecfg;
_Static_assert(sizeof(nx_tilecfg) == 64, "LDTILECFG takes 64 bytes");

/* Palette 1 with tiles 0-7 of 16 rows x 64 bytes, the rest unused. */
static inline nx_tilecfg nx_tile_config(void) {
    nx_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) cfg.colsb[t] = 64, cfg.rows[t] = 16;
    return cfg;
}

/* LDTILECFG of *cfg, the asm's input operand being all 64 bytes of it. */
static inline void nx_tile_loadconfig(const nx_tilecfg *cfg) {
    __asm__ volatile("ldtilecfg %0" : : "m"(*cfg));
}

#endif
