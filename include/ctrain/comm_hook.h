/*
 * ctrain/comm_hook.h: how a gradient bucket is reduced, replaceable (as
 * PyTorch's DistributedDataParallel.register_comm_hook).
 *
 * DDP (and ZeRO-1, which keeps DDP's buckets) reduces each bucket of
 * gradients as soon as backward has filled it.  A communication hook is
 * that reduce: `start` is called on the training thread the moment the
 * bucket is full (buckets in order, every rank the same order) and starts
 * its communication; `finish` is called when backward is over, after the
 * work `start` returned has completed, buckets in order, and must leave the
 * bucket holding the reduced gradients.  Both may call collectives on g, in
 * the same order on every rank.
 *
 * FSDP (sharding full, grad_op or hybrid) hands a hook each unit's flat
 * gradient when the unit's backward is done, as PyTorch's FSDP
 * register_comm_hook does: b->shard is set, and finish must leave this
 * rank's piece of the sum over g (the unit's shard group) there, elements
 * [rank(g) * shard_numel, +shard_numel) of the sum of grad: a reduce-scatter
 * (grad is padded to size(g) * shard_numel).  Several units' reduces may be
 * in flight at once, finished oldest first; FSDP adds the piece to what
 * earlier backwards left (no_sync) and allreduces it across replicas
 * (hybrid) itself, in f32.  A hook registered on FSDP replaces its built-in
 * reduce-scatter (reduce_dtype); the allreduce hooks do the reduce-scatter
 * in their dtype; PowerSGD, which needs whole matrices, refuses (as
 * PyTorch's does for sharded strategies).
 *
 * Built in (src/parallel/comm_hook.c, src/parallel/powersgd.c):
 *  - allreduce: the sum over the group in f32, or with a 16-bit wire dtype
 *    (bf16, f16) rounded to it, summed, and widened back (what the strategy
 *    option reduce_dtype / `--grad-compress bf16|f16` selects);
 *  - PowerSGD (Vogels et al. 2019, as PyTorch's powerSGD_hook): each
 *    gradient of two or more dimensions, viewed as a matrix [shape[0], rest],
 *    is sent as two rank-r factors P [n, r] and Q [m, r] (what
 *    `--grad-compress powersgd:R` selects; settings below);
 *  - post-local SGD (ddp's local_sgd options, src/parallel/local_sgd.c, as
 *    PyTorch's post_localSGD_hook): the allreduce for local_sgd_start
 *    steps, then over the node's ranks or no one; a hook registered over it
 *    is refused (it is half of local SGD, the averaging after each step the
 *    other).
 */
#ifndef CTRAIN_COMM_HOOK_H
#define CTRAIN_COMM_HOOK_H

#include "comm.h"
#include "nn.h"
#include "parallel.h"

/* One bucket as a hook sees it.  grad holds this rank's gradients of the
 * bucket's parameters laid end to end, already multiplied by 1/world (the
 * average is folded into the loss gradient), so the reduce is a sum. */
typedef struct {
    int index;                /* 0 is reduced first; the same bucket keeps its index from step to step */
    int nbuckets;             /* buckets in this backward (index nbuckets-1 is the last) */
    float *grad;              /* [numel] f32: in, this rank's gradients; after finish, their sum over g */
    int64_t numel;
    int nparams;
    ct_param *const *params;  /* [nparams] the bucket's parameters, in the order they lie in grad */
    const int64_t *offsets;   /* [nparams] each one's first element in grad */
    uint16_t *wire;           /* [numel] 16-bit scratch a 16-bit hook may use (shared memory on one node), or NULL */
    float *shard;             /* FSDP: [shard_numel] where finish leaves this rank's piece of the sum; NULL: grad */
    int64_t shard_numel;
} ct_comm_bucket;

typedef struct {
    const char *name;
    /* Starts reducing b over g.  *work: the last asynchronous operation it
     * started (waited for before finish), or NULL. */
    ct_status (*start)(void *state, ct_group *g, const ct_comm_bucket *b, ct_work **work);
    /* Completes the reduce: b->grad holds the sum over g when it returns. */
    ct_status (*finish)(void *state, ct_group *g, const ct_comm_bucket *b);
    /* Frees state (NULL: nothing to free). */
    void (*destroy)(void *state);
} ct_comm_hook_ops;

/* Replaces how s reduces its gradient buckets (strategies ddp, zero1 and
 * fsdp; CT_EINVAL naming the strategy for others, fsdp's sharding=none,
 * and a ddp with local_sgd).  Call it on every rank, after
 * ct_strategy_create and between steps.  s owns state from then on: ops->
 * destroy(state) runs when the hook is replaced or s is destroyed (also when
 * this call fails).  ops must outlive s. */
ct_status ct_strategy_register_comm_hook(ct_strategy *s, const ct_comm_hook_ops *ops, void *state);
/* The name of the hook s reduces its buckets with ("allreduce", "bf16", "f16",
 * "powersgd", "post_local_sgd" or a registered hook's), and (state != NULL) its state; NULL for
 * strategies without buckets, and fsdp without a registered hook. */
const char *ct_strategy_comm_hook(const ct_strategy *s, void **state);

/* The built-in allreduce, with wire CT_F32, CT_BF16 or CT_F16. */
ct_status ct_comm_hook_allreduce(ct_dtype wire, const ct_comm_hook_ops **ops, void **state);

/* PowerSGD's settings (PyTorch's PowerSGDState), the strategy options
 * powersgd_* of ddp and zero1. */
typedef struct {
    int rank;                    /* matrix_approximation_rank: r (powersgd_rank; --grad-compress powersgd:R) */
    int start_iter;              /* start_powerSGD_iter: steps reduced uncompressed first (1000, PyTorch's default) */
    double min_compression_rate; /* a matrix is compressed only when n*m > (n+m)*r times this (2) */
    int error_feedback;          /* use_error_feedback: what compression lost is added to the next step's gradient (1) */
    int warm_start;              /* warm_start: Q starts from the last step's (1); else fresh random each step */
    uint64_t seed;               /* random_seed: the random Q's (the same on every rank) (0) */
    float epsilon;               /* orthogonalization_epsilon: added to each column's norm (0) */
} ct_powersgd_opts;

/* PyTorch's defaults at the given rank. */
ct_powersgd_opts ct_powersgd_defaults(int rank);
/* A PowerSGD hook; CT_EINVAL naming a bad setting (rank < 1; error feedback
 * or warm start with start_iter < 2: DDP's buckets are rebuilt after the
 * first step, and PowerSGD's state follows a bucket's index). */
ct_status ct_comm_hook_powersgd(const ct_powersgd_opts *o, const ct_comm_hook_ops **ops, void **state);

/* The steps PowerSGD has counted so far, and the elements a rank sent per
 * step without it and with it (over the last step reduced): the
 * compression PyTorch's stats report.  state is a PowerSGD hook's. */
void ct_powersgd_stats(const void *state, int64_t *iter, int64_t *numel_before, int64_t *numel_after);

#endif
