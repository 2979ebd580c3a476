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
 * thread): for each ISA, each slot is taken from the first table on the chain
 * isa -> parent -> ... -> GENERIC (nx_cpu.h, NX_ISA_LIST) that has it. The generic table fills
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

#define NX_TBL_FIELD_(name, ret, params) ret(*name) params;
#define NX_TBL_NAME_(name, ret, params) #name,
#define NX_TBL_COUNT_(name, ret, params) +1
#define NX_TBL_RESOLVE_(name, ret, params)                                                         \
    for (int d_ = 0; d_ <= NX_ISA_COUNT; d_++) {                                                   \
        const nx_tbl_t_ *t_ = tables_[a_[d_]];                                                     \
        if (t_ && t_->name) {                                                                      \
            r_->name = t_->name;                                                                   \
            from_[k_] = (unsigned char)a_[d_];                                                     \
            break;                                                                                 \
        }                                                                                          \
        if (a_[d_] == NX_ISA_GENERIC) break;                                                       \
    }                                                                                              \
    k_++;

#define NX_TABLE_TYPE(T, SLOTS)                                                                    \
    typedef struct {                                                                               \
        SLOTS(NX_TBL_FIELD_)                                                                       \
    } T;

#define NX_DEFINE_DISPATCH(PFX, FAMNAME, SLOTS, ...)                                               \
    enum {                                                                                         \
        PFX##_nslots_ = 0 SLOTS(NX_TBL_COUNT_)                                                     \
    };                                                                                             \
    static PFX##_table PFX##_resolved_[NX_ISA_COUNT];                                              \
    static unsigned char PFX##_from_[NX_ISA_COUNT][PFX##_nslots_];                                 \
    static int PFX##_done_;                                                                        \
    static void PFX##_resolve_(void) {                                                             \
        typedef PFX##_table nx_tbl_t_;                                                             \
        static const nx_tbl_t_ *const tables_[NX_ISA_COUNT] = __VA_ARGS__;                         \
        for (int i_ = 0; i_ < NX_ISA_COUNT; i_++) {                                                \
            nx_isa a_[NX_ISA_COUNT + 1]; /* the chain i_ -> parent -> ... -> GENERIC */            \
            a_[0] = (nx_isa)i_;                                                                    \
            for (int d_ = 1; d_ <= NX_ISA_COUNT; d_++) a_[d_] = nx_isa_parent(a_[d_ - 1]);         \
            a_[NX_ISA_COUNT] = NX_ISA_GENERIC;                                                     \
            nx_tbl_t_ *r_ = &PFX##_resolved_[i_];                                                  \
            unsigned char *from_ = PFX##_from_[i_];                                                \
            int k_ = 0;                                                                            \
            for (int s_ = 0; s_ < PFX##_nslots_; s_++) from_[s_] = (unsigned char)NX_ISA_COUNT;    \
            SLOTS(NX_TBL_RESOLVE_)                                                                 \
            (void)k_;                                                                              \
        }                                                                                          \
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
