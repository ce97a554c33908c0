/* Private to src/parallel: FSDP's units and flat parameters, shared by
 * fsdp_units.c (which modules become units), fsdp.c (gather, reduce, the
 * hooks, the optimizer) and fsdp_state.c (state dicts, full parameters). */
#ifndef CTRAIN_PARALLEL_FSDP_H
#define CTRAIN_PARALLEL_FSDP_H

#include "parallel/flat.h"
#include "parallel/shards.h"

enum { FSDP_FULL_SHARD, FSDP_SHARD_GRAD_OP, FSDP_NO_SHARD, FSDP_HYBRID };
enum { FSDP_PREFETCH_PRE, FSDP_PREFETCH_POST, FSDP_PREFETCH_NONE };

typedef struct {
    int sharding;          /* FSDP_* */
    int backward_prefetch; /* FSDP_PREFETCH_* */
    int forward_prefetch;
    int limit_all_gathers;
    int sync_module_states;
    int64_t wrap_min_params;
    int keep_low_precision_grads; /* the bf16 flats' gradient pieces at bf16 precision (param_dtype's) */
    /* wrap_modules, wrap_kinds, ignored_modules: text ('+'-separated), read with ct_strategy_opt */
    int offload;           /* FSDP_OFF_*: which of this rank's shard parts rest in the store */
    int max_resident_mb;   /* with offload: bound on resident param + grad + optim (0: none) */
    int store;             /* FSDP_STORE_* */
    int drop_cache;        /* the store's file pages leave the page cache after each transfer */
    /* offload_dir: text */
} fsdp_opts;
enum { FSDP_OFF_NONE, FSDP_OFF_OPTIM, FSDP_OFF_PARAMS, FSDP_OFF_ALL };
enum { FSDP_STORE_FILE, FSDP_STORE_MEMORY };

/* One flat parameter: the unit's parameters of one dtype class laid end to
 * end (a flat of flat.c: its data, grad and low parts hold memory only while
 * the unit computes), padded to ns * shard elements; this rank keeps
 * elements [rank * shard, (rank + 1) * shard) of it in master. */
typedef struct {
    ct__flat flat;         /* the layout, the storages behind the views (DATA wraps master when
                              ns == 1), the staged pointing until set-up is done on every rank */
    int low;               /* gathered in bf16 into the compute copies (mixed precision) */
    ct_partition pt;       /* the flat's pieces over the shard group (split) */
    float *master;         /* [shard] f32 parameters (what the optimizer steps) */
    float *gshard;         /* [shard] reduced gradients */
    int gzero;             /* gshard is logically zero: the next reduce overwrites it */
    uint16_t *send;        /* bf16 copy of master for the gather (low) */
    void *wire;            /* gradients in reduce_dtype when it is not f32 */
    void *rsbuf;           /* reduce-scatter result when not straight into gshard */
    ct_work *ag, *rs;
} fsdp_flat;

enum { UNIT_SHARDED, UNIT_GATHERING, UNIT_FULL };

typedef struct {
    ct_module *m;
    int parent;            /* enclosing unit, -1 for a top-level one */
    int ignored;           /* an ignored module: replicated (no sharding), gradients allreduced */
    int is_root;           /* the model itself: keeps its parameters from forward to backward */
    int gi;                /* index of its shard group in fsdp_t.groups */
    ct_group *sg, *rg;     /* shard group; replicate group (NULL: none) */
    int ns, srank;         /* shard group size and this rank's place in it */
    int reshard_after_fwd;
    fsdp_flat fl[2];
    int nfl;
    int state;             /* UNIT_* */
    int grads;             /* gfull holds gradients */
    int reducing;          /* reduce in flight */
    int summoned;          /* full f32 parameters out for the user */
    int summon_writeback;  /* copy them back into the pieces on release */
    int seen_fwd, seen_bwd;
    double t_ag, t_rs;     /* when its gather and its reduce started (step statistics, trace) */
    ct_hook *h[4];
    ct_strategy *s;        /* its strategy: the hooks get the unit itself */
} fsdp_unit;

typedef struct {
    fsdp_unit *u;
    int nu;
    ct_group *groups[2];   /* distinct shard groups (gradient norms sum per group) */
    int ngroups;
    ct_group *own[3];      /* groups this strategy made (destroyed at fini) */
    int nown;
    int *fwd_order, nfwd;  /* units in the order the first step ran them */
    int *bwd_order, nbwd;
    int recorded;
    ct__inflight q;        /* units whose reduce is in flight, oldest first */
    int ready;             /* set up on every rank: fini may gather */
    ct__shards sh;         /* the flattened parameters (model order), their pieces over each unit's
                              shard group and this rank's optimizer slots: the state I/O's table */
    struct fsdp_off *off;  /* the offloaded shards (fsdp_offload.c); NULL without offload */
} fsdp_t;

/* fsdp_units.c: decides the units (root, wrap_modules, wrap_kinds,
 * wrap_min_params, ignored_modules), assigns every trainable parameter to
 * one unit's flat and lays the flats out (u, nu, offsets, numel); no memory
 * for data yet.  groups/ns are set by the caller afterwards. */
ct_status ct__fsdp_build_units(ct_strategy *s, fsdp_t *f);
void ct__fsdp_free_units(fsdp_t *f);

/* fsdp.c, for fsdp_state.c */
fsdp_t *ct__fsdp_of(ct_strategy *s);
/* All-gathers every unit's f32 parameters into their data views (keep: they
 * stay until ct__fsdp_release), or frees them again. */
ct_status ct__fsdp_summon(ct_strategy *s, int writeback, int rank0_only);
ct_status ct__fsdp_release(ct_strategy *s);
/* Waits for every reduce in flight (the pieces are final after it). */
ct_status ct__fsdp_finish_all(ct_strategy *s);

/* fsdp_unit_io.c: the units of ct_strategy_unit_* (one at a time, into a caller's buffer) */
int ct__fsdp_units(ct_strategy *s);
ct_status ct__fsdp_unit_params(ct_strategy *s, int i, ct_module **m, ct_param ***ps, int *n);
ct_status ct__fsdp_unit_io(ct_strategy *s, int i, float *buf, int write);
/* Frees every unit's gathered parameters (they are stale after a step or a load). */
ct_status ct__fsdp_reshard_all(ct_strategy *s);

/* fsdp_state.c */
ct_status ct__fsdp_model_state(ct_strategy *s, ct_state *out);
ct_status ct__fsdp_shard_state(ct_strategy *s, int optim, ct_state *out);
/* ct_strategy_state_foreach: parameters and optimizer state gathered one tensor at a time. */
ct_status ct__fsdp_each(ct_strategy *s, int optim, int shapes_only, ct_state_fn fn, void *ud);
ct_status ct__fsdp_load_state(ct_strategy *s, const char *const *names, ct_tensor *const *ts, int n, int optim);
ct_status ct__fsdp_optim_state(ct_strategy *s, ct_state *out);
ct_status ct__fsdp_local_state(ct_strategy *s, int optim, ct_state *out);
/* ct_strategy_share_foreach: the sharded save's tensors gathered one at a time on their roots, or this rank's pieces. */
ct_status ct__fsdp_share(ct_strategy *s, int optim, int local, int shapes_only, ct_state_fn fn, void *ud);
const ct_partition *ct__fsdp_partition(const ct_strategy *s);
ct_status ct__fsdp_grad_norm(ct_strategy *s, ct_norm_acc *acc);
void ct__fsdp_scale_grads(ct_strategy *s, float k);

/* fsdp_offload.c: this rank's shard parts in the store (offload=optim:
 * optimizer state; params: masters and gradient pieces; all: the three).
 * Every entry is called only when fsdp_t.off is set, except open and
 * masters_out. */
/* 1 if the masters rest in the store (with one shard, the data part becomes
 * their home and is made owned, not a window on the master). */
int ct__fsdp_off_masters_out(const ct_strategy *s);
/* Opens the store sized for every flat (the shard groups are known) and
 * checks max_resident_mb; no-op without offload. */
ct_status ct__fsdp_off_open(ct_strategy *s);
/* After setup_flat: the flat's offloaded parts move into the store. */
ct_status ct__fsdp_off_adopt(ct_strategy *s, fsdp_unit *u, int k);
/* Before a gather: the unit's masters resident (loads the next in the
 * recorded order behind them). */
ct_status ct__fsdp_off_masters(ct_strategy *s, fsdp_unit *u);
/* After a gather, and after a unit's parameters are freed: masters no
 * longer read go back (dropped: the store has them). */
void ct__fsdp_off_gathered(ct_strategy *s, fsdp_unit *u);
void ct__fsdp_off_freed(ct_strategy *s, fsdp_unit *u);
/* Before a reduce: gradient pieces resident (read to add to, or new). */
ct_status ct__fsdp_off_grads(ct_strategy *s, fsdp_unit *u);
/* After a reduce: note their norm terms and write them back. */
ct_status ct__fsdp_off_reduced(ct_strategy *s, fsdp_unit *u);
/* 1 if the gradient pieces rest in the store (norm and scale go through here). */
int ct__fsdp_off_grads_out(const ct_strategy *s);
ct_status ct__fsdp_off_grad_norm(ct_strategy *s, ct_norm_acc *acc);
void ct__fsdp_off_scale(ct_strategy *s, float k);
/* The optimizer, flat by flat, on the store's parts (loads run one flat ahead). */
ct_status ct__fsdp_off_step(ct_strategy *s);
/* Waits for the store, frees every part and closes it. */
void ct__fsdp_off_close(ct_strategy *s);

#endif
