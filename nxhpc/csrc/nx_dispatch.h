/* nx_dispatch.h -- per-ISA dispatch tables: the one dispatch mechanism of every kernel family.
 *
 * A family lists its kernels ("slots") once, as X(name, return type, (parameters)):
 *     #define NX_OPS_SLOTS(X) X(rmsnorm, void, (const float *x, ...)) X(swiglu, ...)
 *     NX_TABLE_TYPE(nx_ops_table, NX_OPS_SLOTS)      -- struct of typed function pointers
 * Each ISA file exports one const table of its family; a slot left NULL has no variant there:
 *     const nx_ops_table nx_ops_table_avx2 = {.rmsnorm = nx_rmsnorm_f32_avx2, ...};
 * The family's generic file lists its tables by ISA and instantiates the resolver:
 *     NX_DEFINE_DISPATCH(nx_ops, "ops", NX_OPS_SLOTS,
 *                        {[NX_ISA_GENERIC] = &nx_ops_table_generic,
 *                         NX_X86_ONLY([NX_ISA_AVX2] = &nx_ops_table_avx2, ...)})
 * which defines
 *     const nx_ops_table *nx_ops_get(nx_isa isa);   every slot filled (inherited where missing)
 *     nx_isa nx_ops_variant(int slot, nx_isa isa);   the ISA whose code fills `slot` (slots are
 *                                                    numbered in list order); NX_ISA_COUNT if none
 *     const nx_family_info nx_ops_family;            names + variants, for kernel_variants()
 * Resolution runs once, on first use (the extension triggers it at import, before any fork or
 * thread), by the one resolver nx_dispatch_resolve (also the weight-type family's): for each ISA,
 * each slot is taken from the first table on the chain isa -> parent -> ... -> GENERIC
 * (nx_cpu.h, NX_ISA_LIST) that has it. The generic table fills
 * every slot; tests/test_kernels_dispatch.py checks that every slot of every family resolves.
 * Must not: know any family (families register themselves in nx_dispatch.c).
 */
#ifndef NX_DISPATCH_H
#define NX_DISPATCH_H

#include "nx_cpu.h"

/* What kernel_variants() reads: a family's slot names and which ISA runs each slot (slot_name
 * may return NULL for an unused slot number, which is then skipped). */
typedef struct {
    const char *name;
    int nslots;
    const char *(*slot_name)(int slot);
    nx_isa (*variant)(int slot, nx_isa isa);
} nx_family_info;

/* Every family, in a fixed order (nx_dispatch.c). */
extern const nx_family_info *const nx_families[];
extern const int nx_nfamilies;

/* Resolves every family's tables now (idempotent). */
void nx_dispatch_init(void);

/* Any slot's function pointer as the resolver sees it: every family's table type is a union of
 * its typed slots and this array view, slot_[k] = the k-th slot (same size, no padding). */
typedef void (*nx_slot_fn)(void);

/* The one ISA resolver, for every family (the X-macro families below and the weight-type family,
 * nx_wtype.c): for each ISA i and slot s < nslots, resolved[i * nslots + s] := tables[a][s] and
 * from[i * nslots + s] := a for the first a on the chain i -> parent -> ... -> GENERIC whose table
 * is non-NULL and has slot s; NULL and NX_ISA_COUNT if none. (nx_dispatch.c) */
void nx_dispatch_resolve(int nslots, const nx_slot_fn *const tables[NX_ISA_COUNT],
                         nx_slot_fn *resolved /* OUT [NX_ISA_COUNT * nslots] */,
                         unsigned char *from /* OUT [NX_ISA_COUNT * nslots] */);

#define NX_TBL_FIELD_(name, ret, params) ret(*name) params;
#define NX_TBL_NAME_(name, ret, params) #name,
#define NX_TBL_COUNT_(name, ret, params) +1

#define NX_TABLE_TYPE(T, SLOTS)                                                                    \
    typedef union {                                                                                \
        struct {                                                                                   \
            SLOTS(NX_TBL_FIELD_)                                                                   \
        };                                                                                         \
        nx_slot_fn slot_[0 SLOTS(NX_TBL_COUNT_)];                                                  \
    } T;

/* A family's header declares its table type and what NX_DEFINE_DISPATCH defines for it:
 *     PFX##_table; const PFX##_table *PFX##_get(nx_isa); nx_isa PFX##_variant(int slot, nx_isa);
 *     extern const nx_family_info PFX##_family;
 * (the resolved table for `isa`, missing variants inherited, and which ISA runs slot `slot`). */
#define NX_DECLARE_FAMILY(PFX, SLOTS)                                                              \
    NX_TABLE_TYPE(PFX##_table, SLOTS)                                                              \
    const PFX##_table *PFX##_get(nx_isa isa);                                                      \
    nx_isa PFX##_variant(int slot, nx_isa isa);                                                    \
    extern const nx_family_info PFX##_family;

#define NX_DEFINE_DISPATCH(PFX, FAMNAME, SLOTS, ...)                                               \
    enum {                                                                                         \
        PFX##_nslots_ = 0 SLOTS(NX_TBL_COUNT_)                                                     \
    };                                                                                             \
    static PFX##_table PFX##_resolved_[NX_ISA_COUNT];                                              \
    static unsigned char PFX##_from_[NX_ISA_COUNT][PFX##_nslots_];                                 \
    static int PFX##_done_;                                                                        \
    static void PFX##_resolve_(void) {                                                             \
        static const PFX##_table *const tables_[NX_ISA_COUNT] = __VA_ARGS__;                       \
        const nx_slot_fn *slots_[NX_ISA_COUNT];                                                    \
        nx_slot_fn flat_[NX_ISA_COUNT][PFX##_nslots_];                                             \
        for (int i_ = 0; i_ < NX_ISA_COUNT; i_++) slots_[i_] = tables_[i_] ? tables_[i_]->slot_ : 0; \
        nx_dispatch_resolve(PFX##_nslots_, slots_, &flat_[0][0], &PFX##_from_[0][0]);             \
        for (int i_ = 0; i_ < NX_ISA_COUNT; i_++)                                                  \
            for (int s_ = 0; s_ < PFX##_nslots_; s_++) PFX##_resolved_[i_].slot_[s_] = flat_[i_][s_]; \
        PFX##_done_ = 1;                                                                           \
    }                                                                                              \
    const PFX##_table *PFX##_get(nx_isa isa) {                                                     \
        if (!PFX##_done_) PFX##_resolve_();                                                        \
        return &PFX##_resolved_[(int)isa >= 0 && (int)isa < NX_ISA_COUNT ? isa : NX_ISA_GENERIC];  \
    }                                                                                              \
    nx_isa PFX##_variant(int slot, nx_isa isa) {                                                   \
        if (!PFX##_done_) PFX##_resolve_();                                                        \
        if (slot < 0 || slot >= PFX##_nslots_ || (int)isa < 0 || (int)isa >= NX_ISA_COUNT)         \
            return NX_ISA_COUNT;                                                                   \
        return (nx_isa)PFX##_from_[isa][slot];                                                     \
    }                                                                                              \
    static const char *PFX##_slot_name_(int slot) {                                                \
        static const char *const names_[] = {SLOTS(NX_TBL_NAME_)};                                 \
        return slot >= 0 && slot < PFX##_nslots_ ? names_[slot] : "unknown";                       \
    }                                                                                              \
    const nx_family_info PFX##_family = {FAMNAME, PFX##_nslots_, PFX##_slot_name_, PFX##_variant};

#endif
