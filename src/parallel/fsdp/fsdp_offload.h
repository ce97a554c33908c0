/* Private to src/parallel/fsdp: FSDP's offloaded shard parts (fsdp_offload.c,
 * the residency, the unit hooks and the deferred step; fsdp_offload_state.c,
 * checkpoints, summons and unit I/O straight from the store). */
#ifndef CTRAIN_PARALLEL_FSDP_OFFLOAD_H
#define CTRAIN_PARALLEL_FSDP_OFFLOAD_H

#include "fsdp.h"
#include "parallel/store.h"

enum { PM = 0, PG, PS, NPART };
enum { P_RES = 0, P_LOADING, P_OUT };

typedef struct {
    ct_storage *st[NPART]; /* NULL: not offloaded (fsdp.c's own pointers) or no state */
    int where[NPART];      /* P_* */
    long tk[NPART];        /* ticket of the job bringing it in */
    long out_tk[NPART];    /* ticket of the job that last took it out */
    int dirty[NPART];      /* resident copy differs from the store's */
    int fresh;             /* S never written: zeros, nothing to read */
    off_t off[NPART];
    float *state;          /* S when resident and not offloaded */
    double sq, mx;         /* norm terms of G after its last reduce */
    int pend;              /* the last step's update is still to be applied */
    int pend_gzero;        /* its gradient was untouched since zero_grad (zero) */
} off_flat;

typedef struct fsdp_off {
    ct__ostore *store;
    off_flat *fl;          /* [nflats]: unit by unit, flat by flat */
    int *first;            /* [nu] index of the unit's first flat */
    int nflats;
    unsigned mask;         /* bits of the parts in the store */
    int nstate;
    int ahead;             /* 2: load one unit ahead; 1: on demand */
    int *seq, nseq, cap, cur, recorded; /* units in the order their masters were needed (one pass) */
    int seq_max;           /* the recording's bound: every unit's forward, recompute and backward */
    float scales[16];      /* clip factors since the last step */
    int nscales;
    int npend;             /* flats whose update is pending */
    ct_optim_opts pend_o;  /* the pending update: the step's options (its learning rate), */
    int64_t pend_step;     /* its 1-based step count */
    float pend_scales[16]; /* and the clip factors it took */
    int pend_nscales;
    int pinned;
    fsdp_flat **slot_flat; /* [optimizer slots] the flat of each slot's range, */
    off_flat **slot_x;     /* its parts, */
    int64_t *slot_at;      /* and its offset in the piece (range_io) */
    double moved;          /* the store's bytes read plus written at the last step's end */
    ct__strategy_ops saved; /* the entries this file wraps */
} fsdp_off;

static inline const fsdp_opts *O(const ct_strategy *s) { return s->kopts; }
static inline fsdp_off *OFF(ct_strategy *s) { return ct__fsdp_of(s)->off; }
static inline off_flat *OF(ct_strategy *s, const fsdp_unit *u, int k)
{
    fsdp_off *o = OFF(s);
    return &o->fl[o->first[u - ct__fsdp_of(s)->u] + k];
}

/* The pointers fsdp.c reads follow the parts' residency. */
static inline void sync_ptrs(fsdp_flat *fl, off_flat *x)
{
    if (x->st[PM]) fl->master = x->where[PM] == P_RES ? ct_storage_ptr(x->st[PM]) : NULL;
    if (x->st[PG]) fl->gshard = x->where[PG] == P_RES ? ct_storage_ptr(x->st[PG]) : NULL;
}

/* fsdp_offload.c: part p of flat x resident (waits for its load; fresh: new
 * memory, not read); part p out (written when it changed, else dropped);
 * every pending update applied, unit by unit through the store. */
ct_status ct__fsdp_off_have(fsdp_off *o, fsdp_flat *fl, off_flat *x, int p, int fresh);
ct_status ct__fsdp_off_send_out(fsdp_off *o, fsdp_flat *fl, off_flat *x, int p);
ct_status ct__fsdp_off_flush(ct_strategy *s);
/* fsdp_offload_state.c: the strategy's placement and state entries that
 * read and write the store (the originals kept in o->saved). */
void ct__fsdp_off_wrap(ct_strategy *s);

#endif
