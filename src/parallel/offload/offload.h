/* Private to src/parallel: the offload strategy's state, shared by its
 * set-up and checkpoint state (offload.c) and its step (offload_step.c);
 * its store is parallel/store.c, shared with FSDP's offload. */
#ifndef CTRAIN_PARALLEL_OFFLOAD_H
#define CTRAIN_PARALLEL_OFFLOAD_H

#include "parallel/flat.h"
#include "parallel/store.h"

/* ---- the strategy -------------------------------------------------------- */

/* Longest text option (balance, dir) and path the store handles. */
#define OFF_TEXT_MAX CT__STORE_DIR_MAX

/* The kind's options (balance and dir are text: ct_strategy_opt). */
typedef struct {
    int slices;                     /* slices to cut the sequential into */
    int checkpoint_activation;      /* keep only slice inputs in forward; recompute in backward */
    int microbatches;               /* per step; > 1 needs checkpoint_activation */
    int max_resident_mb;            /* 0 (auto: no bound) or MiB of param + grad + optim */
    int prefetch;                   /* load the next slice while this one computes */
    int drop_cache;                 /* keep the store out of the page cache */
    int store;                      /* OFF_STORE_FILE or OFF_STORE_MEMORY */
} offload_opts;
enum { OFF_STORE_FILE = 0, OFF_STORE_MEMORY };

/* Parts of a slice (bit masks).  OFF_LOW: the bf16 compute copies
 * (param_dtype=bf16), never stored: brought back empty and made from the
 * data by ct__offload_cast, dropped without writing. */
enum { OFF_DATA = 1, OFF_GRAD = 2, OFF_STATE = 4, OFF_LOW = 8 };

/* A slice, or the tied group: parameters used by children in two slices
 * (a tied weight, as the gpt's embedding and head), which stay resident
 * from wrap to unwrap in flat storages of their own, get the gradient of
 * every use and are stepped at ct_strategy_step. */
typedef struct {
    int k0, k1;          /* children [k0, k1) of the sequential (the tied group: none) */
    int *pj;             /* [np] indices into s->params of its parameters, model order */
    int np;
    ct__flat flat;       /* those parameters end to end (flat.c): data, grad and low parts, resident
                            while the slice is, in the store (data, grad) or dropped (low) otherwise */
    ct_storage *state;   /* [nstate * flat.numel] CT_MEM_OPTIM (NULL when the optimizer has none) */
    off_t off;           /* file: data at off, grad after it, state after that */
    ct_work *ar;         /* the gradient allreduce in flight (DDP) */
    int pending;         /* the last optimizer step is still to be applied to this slice */
    int summoned;        /* its data was brought in by ct_strategy_summon_full_params */
} offload_slice;

typedef struct {
    offload_slice *sl;
    int ns;
    offload_slice tied;  /* parameters used by two slices: resident, never in the store */
    int *where;          /* [nparams] the slice holding each parameter (ns: the tied group) */
    int64_t *eoff;       /* [nparams] its element offset in that slice's flat storages */
    int *pjs;            /* the groups' pj runs, end to end (one allocation) */
    int nstate;          /* optimizer state buffers per element (AdamW 2, SGD momentum 1) */
    ct__ostore *store;
    int ahead;           /* slices resident at once the budget allows: 1, 2 or 3 */
    size_t fixed;        /* resident bytes outside the slices (buffers, small state) */
    int grads_zero;      /* zero_grad since the last backward: the next one overwrites */
    double *gsq;         /* [nparams] squared 2-norm of each parameter's gradient */
    double *gmax;        /* [nparams] max |g| */
    float scales[8];     /* clip factors pending for the next step, in order */
    int nscales;
    unsigned char *smask; /* [nparams] bit q: scales[q] applies to the parameter (a clip's filter took it) */
    int clip_overflow;   /* a ninth clip of another selection in one step: the step refuses */
    /* The optimizer step ct_strategy_step took, applied to each slice when
     * it is next resident (the next forward, or a flush): the update needs
     * the slice's parameters, gradients and state in memory, and the next
     * forward loads the slice anyway, so the step costs no pass of its own
     * over the store. */
    ct_optim_opts pend_o;  /* with the step's learning rate */
    int64_t pend_step;     /* 1-based step number of the update */
    float pend_scales[8];  /* its clip factors */
    int pend_nscales;
    unsigned char *pend_smask; /* [nparams] which of them apply to each parameter */
    int summoned;        /* between ct_strategy_summon_full_params and its release */
    int ready;           /* set-up done (a failed one gives the model back as it was) */
    int summon_writeback;
} offload_t;

static inline offload_t *ct__offload(const ct_strategy *s) { return s->priv; }
/* The residency rule, for the strategy and its memory plan: where[j] is the
 * slice of params[j] under slices of sz[0..ns) children of seq (the
 * children that use it), ns when children of two slices use it (the tied
 * group, resident throughout), -1 when no child does. */
ct_status ct__offload_where(ct_module *seq, const int *sz, int ns, ct_param *const *params, int np, int *where);

/* Bytes a slice holds while resident (what the budget counts): numel f32
 * elements of parameters, gradients and nstate optimizer state buffers, and
 * nlow bf16 compute copies.  The strategy and its memory plan both use it. */
static inline size_t ct__offload_slice_bytes(int64_t numel, int64_t nlow, int nstate)
{
    return (size_t)numel * sizeof(float) * (size_t)(2 + nstate) + (size_t)nlow * 2;
}

/* The budget rule: *ahead = the slices that may be resident at once, 3 with
 * prefetch and 1 without, fewer when budget_mb (0: no budget) holds fewer of
 * the largest slice's bytes on top of fixed (bytes resident outside the
 * slices, tied of them for parameters two slices use); CT_EINVAL naming the
 * fix when it holds none. */
ct_status ct__offload_budget(int prefetch, double budget_mb, size_t fixed, size_t largest, size_t tied, int *ahead);
/* Ranks of the data-parallel group (1 without communication). */
static inline int ct__offload_ranks(const ct_strategy *s) { return s->g ? ct_group_size(s->g) : 1; }
static inline const offload_opts *ct__offload_opts(const ct_strategy *s) { return s->kopts; }

/* Where slice sl's gradients and optimizer state start in the file (its data at sl->off). */
static inline off_t ct__offload_grad_off(const offload_slice *sl) { return sl->off + (off_t)(sl->flat.numel * 4); }
static inline off_t ct__offload_state_off(const offload_slice *sl) { return sl->off + (off_t)(2 * sl->flat.numel * 4); }

/* Queues the pieces of slice i in mask for op (CT__IO_*); *ticket as submit. */
ct_status ct__offload_io(ct_strategy *s, int i, int mask, int op, long *ticket);

/* Notes the norm terms of resident slice sl's gradients (clears stale ones). */
void ct__offload_norms(ct_strategy *s, const offload_slice *sl);
/* Makes the bf16 compute copies of resident slice sl's parameters from their data. */
void ct__offload_cast(ct_strategy *s, const offload_slice *sl);
/* The pending optimizer step (pend_*) on resident slice sl. */
void ct__offload_update(ct_strategy *s, offload_slice *sl);

ct_status ct__offload_train_step(ct_strategy *s, const ct_batch *b, ct_loss_fn loss, void *ud,
                                 const ct_fwd_ctx *ctx, ct_step_out *out);
ct_status ct__offload_predict(ct_strategy *s, ct_tensor *x, const ct_fwd_ctx *ctx, ct_tensor **out);
ct_status ct__offload_pre_step(ct_strategy *s);
/* The strategy's state entries (offload_state.c): the full state dict out of
 * the store, and a full state dict into it (everything checked first). */
ct_status ct__offload_model_state(ct_strategy *s, ct_state *out);
/* ct_strategy_state_foreach: each tensor read from the store on its own. */
ct_status ct__offload_each(ct_strategy *s, int optim, int shapes_only, ct_state_fn fn, void *ud);
ct_status ct__offload_optim_state(ct_strategy *s, ct_state *out);
ct_status ct__offload_load_state(ct_strategy *s, const char *const *names, ct_tensor *const *ts, int n,
                                 int optim);
/* ct_strategy_summon_full_params: every slice's data in memory, readable in
 * p->data (the whole model: the caller asked for it); release writes it
 * back to the store if asked and frees what summon brought in. */
ct_status ct__offload_summon(ct_strategy *s, int writeback, int rank0_only);
ct_status ct__offload_release(ct_strategy *s);
/* The tied group's gradients are complete (after a backward, or under
 * reduce): sums them over ranks when allreduce is 1 and notes their norms. */
ct_status ct__offload_reduce_tied(ct_strategy *s, int allreduce);
/* Applies the pending optimizer step to every slice that still waits for it
 * (before state is read or written, inference, or unwrapping). */
ct_status ct__offload_flush(ct_strategy *s);

#endif
