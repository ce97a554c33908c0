/* Private to src/parallel: the ZeRO core that zero1 (zero.c) and zero2
 * (zero2.c) share. */
#ifndef CTRAIN_PARALLEL_ZERO_H
#define CTRAIN_PARALLEL_ZERO_H

#include "parallel/flat.h"
#include "parallel/shards.h"

typedef struct ct__zbuckets ct__zbuckets;

typedef struct {
    ct__shards sh;      /* the trainable parameters at wrap (model order), their ranges and owners,
                           the optimizer slots of this rank's (shards.h) */
    ct__ddp *ddp;       /* zero1: DDP's gradient flats, allreduced as DDP does; NULL for zero2 */
    ct_work **work;     /* [pt.n] broadcast of the range after the step, or NULL */
    int bcast_bf16;     /* broadcast_fp16: the ranges travel as bf16; owners keep their f32 */
    uint16_t **bwire;   /* [pt.n] bf16 copy of a range on the wire, until its broadcast is waited for */
    ct_hook **hooks;    /* pre-forward (and, zero2, pre-backward) hooks of the modules with parameters */
    int nhooks;
    /* zero2 */
    ct_hook **grad_hooks; /* [ntp] */
    char *trainable;    /* [ntp] requires_grad as last seen (a parameter may be frozen and unfrozen) */
    int stepped;        /* no gradients pending: the trainable set may be refreshed */
    float *gshard;      /* this rank's reduced gradients, owned ranges end to end (optimizer slots) */
    int64_t *goff;      /* [pt.n] offset of an owned range in gshard, else -1 */
    int64_t nshard;
    char *ready;        /* [ntp] reduced in this backward */
    ct_work **red;      /* [pt.n] reduce of the range to its owner */
    uint16_t **wire;    /* [ntp] 16-bit copy on the wire (reduce_dtype bf16/f16), or NULL */
    ct__inflight q;     /* parameters whose reduces are in flight, with their gradient bytes */
    ct__flat *gflat;    /* [ntp] zero2: each gradient a flat of its own (flat.c), resident from its
                           module's backward until its reduce to the owners is done */
    size_t limit;       /* bound on q.total before a module's backward (reduce_buffer_mb) */
    ct__zbuckets *zb;   /* reduce_bucket_size: small ranges packed per owner (zero2_bucket.c), or NULL */
    int nreduces;       /* reduces to the owners started in this backward (buckets and lone ranges) */
    int nready;
    double *t_start;    /* [ntp] when the parameter's reduces started */
    double *t_end;      /* [pt.n] when the range's reduce completed (comm thread) */
    double t_comm;      /* sum over parameters of (last reduce end - start) in this backward */
    double t_room;      /* time backward waited for reduces to make room (counted as comm wait) */
} ct__zero;


/* The options both take (auto_refresh_trainable and its warning). */
#define BCAST16_OPT(type)                                                                               \
    {"broadcast_fp16", CT__OPT_BOOL, offsetof(type, broadcast_fp16), "0",                              \
     "broadcast the updated ranges in bf16 (half the bytes; owners keep their f32 values)", 0, NULL}
#define SPLIT_OPT(type)                                                                                 \
    {"split_params", CT__OPT_BOOL, offsetof(type, split_params), "0",                                  \
     "partition the parameters laid end to end into equal pieces (exact balance) instead of whole tensors", 0, NULL}
#define REFRESH_OPTS(type)                                                                              \
    {"auto_refresh_trainable", CT__OPT_BOOL, offsetof(type, auto_refresh_trainable), "1",              \
     "follow parameters frozen or unfrozen between steps (else that is an error)", 0, NULL},                 \
    {"warn_on_trainable_params_changed", CT__OPT_BOOL, offsetof(type, warn_on_trainable_params_changed), \
     "1", "warn when the trainable parameters change", 0, NULL}

/* Bytes of zero2's gradient shard on rank (its owned ranges of pt end to
 * end, with slack): what zero2 allocates and what its memory plan counts. */
uint64_t ct__zero2_shard_bytes(const ct_partition *pt, int rank);

/* ---- zero2's buckets (zero2_bucket.c) ---- */

/* Buckets of up to size elements (0: none, *out NULL) for the ranges of z
 * smaller than that, per owner, in the wire dtype dt. */
ct_status ct__zbuckets_create(const ct__zero *z, int64_t size, ct_dtype dt, ct__zbuckets **out);
/* Bytes the buckets of partition pt would take (the memory plan). */
uint64_t ct__zbuckets_plan_bytes(const ct_partition *pt, int64_t size, ct_dtype dt);
/* Waits for anything in flight and frees; NULL is a no-op. */
void ct__zbuckets_destroy(ct__zbuckets *zb);
/* 1 if range k travels in a bucket (zb may be NULL). */
int ct__zbuckets_has(const ct__zbuckets *zb, int k);
/* Before a synchronised backward: every bucket empty. */
void ct__zbuckets_begin(ct__zbuckets *zb, const ct__zero *z);
/* Packs range k of the f32 gradient grad (the whole parameter's) into its
 * bucket; a bucket whose last member this is starts its reduce. */
ct_status ct__zbuckets_pack(ct_strategy *s, ct__zbuckets *zb, int k, const float *grad);
/* End of backward: the buckets still waiting (members without a gradient
 * as zeros) start in bucket order, all are waited for, and the owners
 * take their ranges into z->gshard.  Collective. */
ct_status ct__zbuckets_finish(ct_strategy *s, ct__zbuckets *zb);

/* The strategy's ZeRO state (s->priv). */
ct__zero *ct__zero_of(ct_strategy *s);
/* Waits for every parameter broadcast in flight (and refreshes bf16 copies). */
ct_status ct__zero_wait_all(ct_strategy *s);
/* summon_full_params: the parameters are whole on every rank once the
 * step's broadcasts have arrived (reading or writing them before would race
 * with the owners' sends). */
ct_status ct__zero_summon(ct_strategy *s, int writeback, int rank0_only);
/* The trainable list, the partition (split: flat pieces), the broadcast
 * handles (bcast_bf16: the ranges travel in bf16) and the pre-forward hooks
 * that wait for them. */
ct_status ct__zero_core_init(ct_strategy *s, int split, int bcast_bf16);
void ct__zero_core_fini(ct_strategy *s);
/* Follows parameters frozen or unfrozen since the last step; *changed says whether any were. */
ct_status ct__zero_refresh_trainable(ct_strategy *s, int auto_refresh, int warn, int *changed);
/* The step: the last broadcasts done, the optimizer over the owned ranges,
 * then each owner starts sending its updated ranges (nobody waits here). */
ct_status ct__zero_step(ct_strategy *s);
const ct_partition *ct__zero_partition(const ct_strategy *s);
/* ZeRO-1's and ZeRO-2's state entries: the parameters whole on every rank,
 * the optimizer state in the owners' ranges. */
#define CT__ZERO_STATE_OPS                                                                         \
    {                                                                                              \
        .model = ct__zero_model_state, .optim = ct__zero_optim_state, .shard = ct__zero_shard_state, \
        .local = ct__zero_local_state, .load = ct__zero_load_state, .each = ct__zero_each,         \
        .share = ct__zero_share,                                                                   \
    }
/* ct_strategy_state_foreach for ZeRO: the model as it is (whole on every
 * rank), the optimizer state through ct__shards_optim_each. */
ct_status ct__zero_each(ct_strategy *s, int optim, int shapes_only, ct_state_fn fn, void *ud);
ct_status ct__zero_model_state(ct_strategy *s, ct_state *out);
ct_status ct__zero_optim_state(ct_strategy *s, ct_state *out);
ct_status ct__zero_shard_state(ct_strategy *s, int optim, ct_state *out);
/* This rank's owned ranges as pieces (ct_strategy_local_state). */
ct_status ct__zero_local_state(ct_strategy *s, int optim, ct_state *out);
/* ct_strategy_share_foreach: the optimizer's share gathered one tensor at a time, pieces as they lie. */
ct_status ct__zero_share(ct_strategy *s, int optim, int local, int shapes_only, ct_state_fn fn, void *ud);
ct_status ct__zero_load_state(ct_strategy *s, const char *const *names, ct_tensor *const *ts, int n, int optim);

#endif
