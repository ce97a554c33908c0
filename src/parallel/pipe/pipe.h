/* Private to src/parallel: the pipeline strategy's state, shared by its
 * set-up and entries (pipe.c), its schedules (pipe_sched.c) and its
 * checkpoint state (pipe_state.c). */
#ifndef CTRAIN_PARALLEL_PIPE_H
#define CTRAIN_PARALLEL_PIPE_H

#include "parallel/internal.h"

enum { PIPE_GPIPE = 0, PIPE_1F1B };
enum { PIPE_CKPT_ALWAYS = 0, PIPE_CKPT_EXCEPT_LAST, PIPE_CKPT_NEVER };
enum { PIPE_DP_DDP = 0, PIPE_DP_ZERO1 };

/* The kind's options; DDP's are its base keys (at base_off, passed on as
 * text to the replicas' DDP or ZeRO-1). */
typedef struct {
    ct__ddp_opts ddp;
    int stages;     /* 0 (auto: balance's length, else the group size) or P; balance is text */
    int chunks;
    int schedule;   /* PIPE_GPIPE, PIPE_1F1B */
    int checkpoint; /* PIPE_CKPT_* */
    int dp;         /* PIPE_DP_*: what the replicas of a stage run */
    int deferred_batch_norm; /* running statistics once per step over all micro-batches */
} pipe_opts;

/* A row's shape at a stage boundary: dims after the batch dim. */
typedef struct {
    int ndim;              /* of the whole tensor, batch dim included */
    int64_t shape[CT_MAX_DIMS]; /* shape[0] unused (rows) */
    int64_t row_numel;
} pipe_shape;

/* Parameters that several stages hold (one ct_param in several children of
 * the unsplit model: the GPT's token embedding and its tied LM head), for
 * one set of stages holding them.  Each copy gets the sum of every copy's
 * gradient before clipping and the step (Megatron's embedding allreduce),
 * so the copies, equal at start and updated alike, stay equal. */
typedef struct {
    ct_group *g;    /* this replica's ranks of those stages, in stage order; NULL: not one of them */
    ct_param **ps;  /* the parameters, as this stage holds them, in model order */
    int nps;
    int first;      /* this stage is the first holder: it counts them in the norm and saves them */
} pipe_tie;

/* A skip (ct_skip_stash_create / ct_skip_pop_create) whose pops lie in
 * later stages than its stash: stages a..b-1 send its value with their
 * activations (and b..a+1 its gradient back with theirs). */
enum { CT_PIPE_MAX_SKIPS = 16 }; /* skips live at one boundary */

typedef struct {
    char name[64];
    int a, b;          /* the stash's stage, the last pop's */
    ct_module *stash;  /* this stage's: the model's own (stage a), a proxy the pops of this stage are
                          bound to (a < stage <= b), else NULL */
    int own;           /* stash is the proxy, this strategy's to free */
    pipe_shape sh;     /* its row shape, agreed with the boundaries */
} pipe_skip;

typedef struct {
    int nstages, stage;    /* stage -1: this rank sits out (more ranks than stages x replicas) */
    int replicas, replica;
    int *balance;          /* [nstages] children per stage */
    int lo, hi;            /* this stage holds children [lo, hi) of the model as given */
    ct_group *pg;          /* this replica's pipeline: rank k is stage k */
    ct_group *rg;          /* this stage's replicas (data parallel) */
    ct_strategy *inner;    /* the stage over rg: "ddp", "zero1", or "none" for one replica */
    ct_module **bns;       /* this stage's batchnorm modules (deferred_batch_norm commits them) */
    int nbns;
    char **names;          /* every parameter and buffer name of the whole model */
    int nnames;
    pipe_tie *ties;        /* one per set of stages holding tied parameters */
    int nties;
    int ties_summed;       /* the tied gradients hold sums since the last zero_grad */
    /* boundary shapes, agreed for the input row shape in key (see pipe_sched.c) */
    int have_shapes;
    pipe_shape key, in, out;
    pipe_skip *skips;      /* every skip crossing a boundary (every rank lists them all) */
    int nskips;
    int64_t in_wide, out_wide; /* a message's values per row: the activation's, then each live skip's */
} pipe_t;

/* The skips live at stage k's input / output boundary. */
static inline int ct__pipe_skip_in(const pipe_skip *sk, int k) { return sk->a < k && k <= sk->b; }
static inline int ct__pipe_skip_out(const pipe_skip *sk, int k) { return sk->a <= k && k < sk->b; }

static inline pipe_t *ct__pipe(const ct_strategy *s) { return s->priv; }

ct_status ct__pipe_train_step(ct_strategy *s, const ct_batch *b, ct_loss_fn loss, void *ud,
                              const ct_fwd_ctx *ctx, ct_step_out *out);
ct_status ct__pipe_predict(ct_strategy *s, ct_tensor *x, const ct_fwd_ctx *ctx, ct_tensor **out);

ct_status ct__pipe_model_state(ct_strategy *s, ct_state *out);
/* ct_strategy_state_foreach: stage by stage, on rank 0 one tensor at a time. */
ct_status ct__pipe_each(ct_strategy *s, int optim, int shapes_only, ct_state_fn fn, void *ud);
ct_status ct__pipe_optim_state(ct_strategy *s, ct_state *out);
ct_status ct__pipe_shard_state(ct_strategy *s, int optim, ct_state *out);
ct_status ct__pipe_local_state(ct_strategy *s, int optim, ct_state *out);
ct_status ct__pipe_load_state(ct_strategy *s, const char *const *names, ct_tensor *const *ts, int n,
                              int optim);

/* pipe_skip.c.  The skips of sequential m that cross a boundary when its
 * children are cut by balance[0..nstages) (name, a, b; stash NULL) into
 * *out (the caller's, ct_free) and *n; CT_EINVAL for a pop before its
 * stash or two stashes of one name, CT_EUNSUPPORTED for more than
 * CT_PIPE_MAX_SKIPS at one boundary.  The strategy and its plan both list
 * them here. */
ct_status ct__pipe_skips_list(ct_module *m, const int *balance, int nstages, pipe_skip **out, int *n);
/* Lists the skips crossing a boundary (while every stage's
 * children are here; the same errors on every rank) and gives this stage
 * its proxies; fini frees them. */
ct_status ct__pipe_skips_init(ct_strategy *s, pipe_t *p);
void ct__pipe_skips_fini(pipe_t *p);

/* pipe_tied.c.  Finds the tied parameters in the unsplit model (before
 * the other stages' children are freed) and splits their groups:
 * collective over s->g. */
ct_status ct__pipe_ties_init(ct_strategy *s, pipe_t *p);
/* After the other children are freed: a tied parameter whose owner went
 * with them is owned by the module of this stage that lists it. */
void ct__pipe_ties_adopt(ct_strategy *s, pipe_t *p);
void ct__pipe_ties_fini(pipe_t *p);
/* Before a step's backwards: copies that already hold a sum (a second
 * train step without zero_grad) keep it on the first holder only, so the
 * next sum counts it once. */
void ct__pipe_ties_begin(pipe_t *p);
/* After a step's backwards: each tied gradient summed over its holders. */
ct_status ct__pipe_ties_sum(pipe_t *p);
/* The norm term (a sum of |g|^p of norm_type p, finite) of the tied
 * gradients this rank holds but does not count (of the parameters s's clip selects). */
double ct__pipe_ties_uncounted(const ct_strategy *s, const pipe_t *p, double norm_type);
/* 1 if name is a tied parameter (optim: "<param>.<slot>" of one; either
 * maybe a piece, "...@<offset>") that this stage holds but another stage
 * saves. */
int ct__pipe_tie_is_copy(const pipe_t *p, const char *name, int optim);

#endif
