/*
 * The flat layer: the one mechanism by which a strategy owns parameter
 * bytes (see flat.c for the design).  Private to src/parallel.
 */
#ifndef CTRAIN_PARALLEL_FLAT_H
#define CTRAIN_PARALLEL_FLAT_H

#include "internal.h"

/* The parts of a flat: what its parameters' tensors view. */
typedef enum {
    CT__FL_DATA = 0, /* f32 values (p->data) */
    CT__FL_GRAD,     /* f32 gradients (p->grad) */
    CT__FL_LOW,      /* bf16 compute copies (p->compute) of the parameters that take one */
    CT__FL_NPARTS
} ct__flat_part;
#define CT__FL_BIT(part) (1u << (part))

typedef struct {
    ct_param **p;       /* [n] the parameters, end to end in this order */
    int n;
    int64_t *off;       /* [n] element offset of p[j] in the data and grad parts */
    int64_t *loff;      /* [n] element offset in the low part, or -1: no compute copy */
    int64_t numel;      /* elements of every p[j] */
    int64_t nlow;       /* elements with a compute copy */
    int64_t shard;      /* ceil(numel / nshards): this rank keeps [srank * shard, +shard) */
    int nshards, srank;
    ct_storage *st[CT__FL_NPARTS]; /* behind the parameters' views (NULL: part not in the flat),
                                      nshards * shard elements (low: nlow) */
    ct_tensor **old;    /* [3n] the parameters' own data, grad and compute until commit */
    unsigned pointed;   /* parts whose views the parameters hold */
} ct__flat;

/* Lays p[0..n) end to end (no memory for values yet) for a shard group of
 * nshards in which this rank is srank; with low, the parameters that mixed
 * precision gives a copy (ct_param_takes_bf16_copy) get room in the low part. */
ct_status ct__flat_init(ct__flat *f, ct_param *const *p, int n, int nshards, int srank, int low);
/* Sets the shard group (ct__flat_init's, until the groups are known). */
void ct__flat_shard(ct__flat *f, int nshards, int srank);
/* Frees the flat's tables and storages; the parameters must have their own
 * tensors again (ct__flat_unpoint) or be going away with the model. */
void ct__flat_fini(ct__flat *f);
/* Gives part a storage: a new one under cat (resident: with memory, zeroed
 * with zero; otherwise absent until ct__flat_fill), or, with mem, a window
 * onto memory the strategy owns (a shared-memory window, a shard buffer). */
ct_status ct__flat_storage(ct__flat *f, ct__flat_part part, ct_mem_cat cat, int resident, int zero, void *mem);
/* Re-points the parts in mask of every parameter at views of the flat's
 * storages; the parts in copy (a mask too) get each parameter's current
 * values first (their storages must have memory); a gradient not copied is
 * marked stale (the next backward overwrites it).  The parameters' own tensors are
 * kept until ct__flat_commit drops them or ct__flat_rollback puts them back,
 * so a set-up that fails on any rank leaves every model untouched. */
ct_status ct__flat_point(ct__flat *f, unsigned mask, int copy);
/* The same without staging, for set-ups that need no rollback (offload's
 * slices, ZeRO-2's gradients): each parameter's own tensors go as soon as
 * its views are in place, so the peak is the group plus one parameter, not
 * the group twice.  After a failure part of the group is moved; unpoint
 * takes any mix. */
ct_status ct__flat_move(ct__flat *f, unsigned mask, int copy);
void ct__flat_commit(ct__flat *f);
void ct__flat_rollback(ct__flat *f);
/* Unwrap: every parameter gets tensors of its own again (data, and grad
 * where it had one), with the values the flat holds where its data part
 * has memory, else those fetch writes (a store's copy); with neither (NULL
 * fetch), tensors without memory: the values are gone (a teardown that frees).
 * A compute copy that viewed the low part goes (an unwrapped model computes
 * in f32; the mixed-precision policy drops the copies it made).  Out of
 * memory leaves the parameter on its views and returns CT_ENOMEM. */
typedef ct_status (*ct__flat_fetch_fn)(void *ud, int j, float *dst);
ct_status ct__flat_unpoint(ct__flat *f, ct__flat_fetch_fn fetch, void *ud);

/* Residency of a part: memory freed (the views stay, without data) or
 * brought back (zeroed with zero). */
ct_status ct__flat_evict(ct__flat *f, ct__flat_part part);
ct_status ct__flat_fill(ct__flat *f, ct__flat_part part, int zero);
int ct__flat_resident(const ct__flat *f, ct__flat_part part);
/* The part's memory (NULL while absent) and its bytes. */
void *ct__flat_ptr(const ct__flat *f, ct__flat_part part);
size_t ct__flat_bytes(const ct__flat *f, ct__flat_part part);
/* The clip's parameter filter over this rank's shard of the gradient: g
 * holds the flat's elements [srank * shard, +shard) (FSDP's reduced piece);
 * adds the norm terms of the members s's clip selects (ct__clip_selects)
 * that fall in it to a, or scales them by k.  Padding counts in neither. */
void ct__flat_shard_norm_sel(const ct_strategy *s, const ct__flat *f, const float *g, ct_norm_acc *a);
void ct__flat_shard_scale_sel(const ct_strategy *s, const ct__flat *f, float *g, float k);
/* Casts the data part into the low part (the compute copies follow the
 * masters: after a step, a load or a gather of f32 values). */
void ct__flat_cast_low(ct__flat *f);

#endif
