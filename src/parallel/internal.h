/* Private to src/parallel: the strategy object, the table each strategy
 * fills (split by concern: placement, synchronisation, state I/O; NULL
 * entries are the replicated defaults of replicated.c), the option tables,
 * and what the strategies share: the gradient norm, the wire dtype path
 * (wire.c), the in-flight queue (inflight.c), mixed precision (mixed.c).
 * Parameter bytes a strategy owns always go through the flat layer
 * (flat.h); which ranges of them a rank owns, and the state I/O over
 * those, through the shard table (shards.h: ZeRO and FSDP).  Room layout:
 * the interface and shared layer at the top, ddp.c, and a folder per
 * strategy with several files (zero/, fsdp/, pipe/, offload/), plan/ for
 * the memory plans. */
#ifndef CTRAIN_PARALLEL_INTERNAL_H
#define CTRAIN_PARALLEL_INTERNAL_H

#include <stddef.h>

#include "ctrain/comm_hook.h"
#include "ctrain/parallel.h"

/* One "key=value" option: where its parsed value goes (an offset into the
 * strategy's own options struct, or into ct__common), its default and a
 * line of help. */
/* INT: a whole number from 1; COUNT: from 0; NUM: a positive number; BOOL;
 * DTYPE (from dtypes); CHOICE: one of the '|'-separated words in choices,
 * stored as its index; TEXT: any text, read back with ct_strategy_opt;
 * AUTO_INT: "auto" (stored as 0) or a whole number from 1 (an int);
 * AUTO_COUNT: "auto" (stored as -1) or a whole number from 0 (an int64_t);
 * AUTO_NUM: "auto" (stored as 0) or a positive number (a double). */
typedef enum { CT__OPT_INT, CT__OPT_NUM, CT__OPT_BOOL, CT__OPT_DTYPE, CT__OPT_COUNT, CT__OPT_CHOICE,
               CT__OPT_TEXT, CT__OPT_AUTO_INT, CT__OPT_AUTO_COUNT, CT__OPT_AUTO_NUM } ct__opt_type;
typedef struct {
    const char *key;
    ct__opt_type type;
    size_t off;
    const char *def;
    const char *help;
    unsigned dtypes; /* CT__OPT_DTYPE: bit per ct_dtype allowed */
    const char *choices; /* CT__OPT_CHOICE: "a|b|c" */
} ct__opt_def;

/* SyncBatchNorm (sync_batchnorm=1): every batchnorm of the model sums its
 * statistics over s's group from now on; CT_EINVAL for a kind whose ranks
 * do not share a batch (pipe, offload).  A no-op otherwise. */
ct_status ct__syncbn_init(ct_strategy *s);
/* Every batchnorm back to its replica's own statistics. */
void ct__syncbn_fini(ct_strategy *s);
/* buffer_dtype=bf16: hooks that keep every buffer at bf16 precision (buffers.c). */
ct_status ct__buffers_init(ct_strategy *s);
void ct__buffers_fini(ct_strategy *s);

/* Options every strategy takes. */
typedef struct {
    int grad_accum;
    int param_dtype;  /* ct_dtype: CT_F32 or CT_BF16 */
    int reduce_dtype; /* ct_dtype: CT_F32, CT_BF16, CT_F16 */
    int sync_batchnorm; /* batchnorm statistics over the group (syncbn.c) */
    int buffer_dtype;   /* ct_dtype: CT_F32, or CT_BF16 (buffers held at bf16 precision, buffers.c) */
    int64_t alloc_cache_mb; /* the allocator cache's bound in MiB; -1: auto (ct_mem_set_cache_limit) */
} ct__common;

/* A strategy's entries, split by concern.  Every entry may be left NULL in
 * a kind's table: ct_strategy_create fills it with the replicated default
 * (whole, synchronised gradients and parameters on every rank) in the
 * strategy's own copy (s->vt), so no caller ever tests for NULL.  A
 * strategy's kind is asked by name (ct_strategy_kind), never by comparing
 * tables. */

/* Placement: where the parameters live, and the optimizer over them. */
typedef struct {
    ct_status (*init)(ct_strategy *s); /* sets up s->priv; collective for distributed strategies */
    void (*fini)(ct_strategy *s);
    ct_status (*build_optim)(ct_strategy *s, const ct_optim_opts *o); /* default: every trainable param */
    const ct_partition *(*partition)(const ct_strategy *s);          /* sharded strategies; default NULL */
    ct_status (*summon)(ct_strategy *s, int writeback, int rank0_only); /* full parameters out */
    ct_status (*release)(ct_strategy *s);
    void (*data_rank)(const ct_strategy *s, int *rank, int *size); /* default: group rank and size */
    /* Units for ct_strategy_unit_* (units.c; default: one, the model's trainable parameters):
     * their number; unit i's module and own trainable parameters in buffer order (*ps: ct_free);
     * its full values into buf, or (write) buf's values into what the strategy keeps.  Collective. */
    int (*units)(ct_strategy *s);
    ct_status (*unit_params)(ct_strategy *s, int i, ct_module **m, ct_param ***ps, int *n);
    ct_status (*unit_io)(ct_strategy *s, int i, float *buf, int write);
} ct__place_ops;

/* Synchronisation: the work around forward, backward and the step. */
typedef struct {
    ct_status (*pre_forward)(ct_strategy *s);
    ct_status (*pre_backward)(ct_strategy *s);
    ct_status (*post_backward)(ct_strategy *s);
    float (*grad_scale)(ct_strategy *s); /* factor on the loss gradient; default 1 */
    ct_status (*reduce)(ct_strategy *s); /* synchronise accumulated gradients now */
    /* Adds the norm terms of every gradient s trains, combined across the
     * ranks that shard them (ct__norm_combine), to acc. */
    ct_status (*grad_norm)(ct_strategy *s, ct_norm_acc *acc);
    void (*scale_grads)(ct_strategy *s, float k);
    /* The optimizer step and the strategy's work around it (default: the
     * optimizer, then the mixed-precision copies refreshed). */
    ct_status (*step)(ct_strategy *s);
    void (*zero_grad)(ct_strategy *s);
    /* The whole train step, after ct_strategy_train_step's validation, with
     * *out zeroed (default: grad_accum micro-batches; pipe: chunks through
     * stages; offload: slices through the store). */
    ct_status (*train_step)(ct_strategy *s, const ct_batch *b, ct_loss_fn loss, void *ud,
                            const ct_fwd_ctx *ctx, ct_step_out *out);
    /* Inference over the whole model (default: pre_forward, the model's forward). */
    ct_status (*predict)(ct_strategy *s, ct_tensor *x, const ct_fwd_ctx *ctx, ct_tensor **out);
} ct__sync_ops;

/* State I/O: checkpoints out (full, balanced shards, local pieces) and in. */
typedef struct {
    ct_status (*model)(ct_strategy *s, ct_state *out);
    ct_status (*optim)(ct_strategy *s, ct_state *out);
    ct_status (*shard)(ct_strategy *s, int optim, ct_state *out);
    ct_status (*local)(ct_strategy *s, int optim, ct_state *out);
    ct_status (*load)(ct_strategy *s, const char *const *names, ct_tensor *const *ts, int n, int optim);
    /* the full state one tensor at a time (ct_strategy_state_foreach); default: model/optim's tensors */
    ct_status (*each)(ct_strategy *s, int optim, int shapes_only, ct_state_fn fn, void *ud);
    /* this rank's share (local 0) or pieces (local 1) one tensor at a time (ct_strategy_share_foreach);
     * default: shard/local's tensors */
    ct_status (*share)(ct_strategy *s, int optim, int local, int shapes_only, ct_state_fn fn, void *ud);
} ct__state_ops;

typedef struct {
    const char *kind;
    const ct__opt_def *opts; /* the kind's own keys */
    int nopts;
    const ct__opt_def *base_opts; /* keys of the strategy it builds on (DDP's), whose options
                                     struct lies at base_off in the kind's */
    int nbase_opts;
    size_t base_off;
    size_t opts_size;        /* bytes of the kind's options struct (s->kopts) */
    int manages_compute;     /* makes and keeps the mixed-precision copies itself (FSDP gathers
                                them, offload makes them with a slice) */
    int runs_alone;          /* works without ct_comm_init (no group: one process of its own) */
    int makes_params;        /* makes the shape-only parameters it holds itself (fsdp its shards,
                                pipe its stage, offload its slices); for the others the whole model
                                is made (ct_module_materialize) before init */
    int takes_comm_hook;     /* reduces gradient buckets through s->hook (comm_hook.c) */
    int replicas_share_batch; /* every rank runs the whole model on its rows of each batch, so
                                 batchnorm statistics can be summed over the group (syncbn.c) */
    ct__place_ops place;
    ct__sync_ops sync;
    ct__state_ops state;
} ct__strategy_ops;

struct ct_strategy {
    const ct__strategy_ops *ops; /* &vt */
    ct__strategy_ops vt;         /* the kind's table with the defaults filled in */
    ct_module *model;
    ct_optim *opt;
    ct_group *g;
    ct__common common;
    void *kopts;           /* the kind's options struct */
    char *opt_text[64];    /* parsed option values as text, by key (ct_strategy_opt) */
    const char *opt_keys[64];
    int nopt_text;
    int no_sync;
    int joined; /* ct_strategy_set_joined: train steps run on a shadow batch that counts as zeros */
    ct_param **params;     /* every parameter, model order */
    int nparams;
    ct_param **buffers;
    int nbuffers;
    ct_lr_schedule sched;
    int has_sched;
    ct_step_stats stats;   /* being measured */
    ct_step_stats last;    /* last completed step */
    int owns_compute;      /* made the mixed-precision compute copies (mixed.c) and frees them */
    ct_hook **buf_hooks;   /* buffer_dtype's rounding hooks (buffers.c) */
    int nbuf_hooks;
    void *priv;            /* the kind's own state (one slot: a strategy that composes another's
                              parts holds their handles in its own state) */
    int64_t backwards;     /* backward passes (or train steps) since the last optimizer step */
    char who[32];          /* "strategy ddp": the model's and communication's holder (ct_module_hold) */
    ct_module *held_model; /* the model as given to create, held (ct_module_hold) until destroy
                              (a strategy may point s->model elsewhere: pipe's stage) */
    int held_comm;         /* 1: communication held too (ct_comm_hold) */
    struct ct__hook *hook; /* how buckets are reduced (comm_hook.c); lives as long as s */
    const struct ct__load_ctx *load; /* the load in progress (state_load.c), or NULL */
    ct_param_filter_fn clip_filter; /* the parameter filter of the clip in progress (NULL: every parameter);
                                       grad_norm and scale_grads take only what ct__clip_selects */
    void *clip_ud;
    ct_optim_opts spec;    /* the optimizer spec as given, its groups' names copied (own_spec) */
    char *spec_mem;        /* the block they are copied into */
};

extern const ct__strategy_ops ct__ddp_ops;
extern const ct__strategy_ops ct__zero1_ops;
extern const ct__strategy_ops ct__zero2_ops;
extern const ct__strategy_ops ct__fsdp_ops;
extern const ct__strategy_ops ct__pipe_ops;
extern const ct__strategy_ops ct__offload_ops;

/* Fills every NULL entry of vt with the replicated default (replicated.c). */
void ct__strategy_fill(ct__strategy_ops *vt);
/* The rows of the step's global batch: b->global_rows, or this rank's rows
 * times the group's size when the caller left it 0. */
int64_t ct__global_rows(const ct_strategy *s, const ct_batch *b);
/* 1 if s's train step is its own (pipe, offload), not the default grad_accum loop. */
int ct__strategy_owns_micro_batches(const ct_strategy *s);
/* 1 if the clip in progress takes p (ct_strategy_clip_grad_norm_filter's filter; none: every parameter). */
int ct__clip_selects(const ct_strategy *s, const ct_param *p);
/* Every rank of g's accumulated value, folded in rank order into a (the
 * same double on every rank, never rounded to float on the way). */
ct_status ct__norm_combine(ct_group *g, ct_norm_acc *a);
/* rows.c: ranks with different row counts and global_rows 0, or ranks that
 * share a data slice (a pipeline's stages) given different rows: CT_EINVAL on
 * every rank of s's group, before the step.  Collective when either can
 * happen (one small all-gather), else free; alone: the strategy never
 * communicates ("none": every rank trains by itself), nothing to check. */
ct_status ct__check_rows(ct_strategy *s, const ct_batch *b, int64_t nrows, int alone);

/* DDP's options and entries, for the strategies built on its buckets
 * (ZeRO-1 keeps DDP's gradient path and shards only the optimizer). */
typedef struct {
    double bucket_cap_mb;       /* bucket size after the first; 0: auto (ct__ddp_auto_cap) */
    double first_bucket_mb;     /* first bucket, so the first allreduce starts early */
    int broadcast_buffers;      /* broadcast buffers from rank 0 before every forward */
    int find_unused_parameters; /* parameters of modules that did not run are marked ready */
    int rebuild_buckets;        /* after the first step, rebuild buckets in gradient-ready order */
    int static_graph;           /* the first step's unused parameters and bucket order hold for good */
    int64_t powersgd_rank;      /* > 0: buckets reduced by PowerSGD at this rank (comm_hook.h) */
    int64_t powersgd_start_iter;
    double powersgd_min_compression_rate;
    int powersgd_error_feedback;
    int powersgd_warm_start;
    int64_t powersgd_seed;
    /* Post-local SGD (local_sgd.c): DDP's own keys, not its composers' (zero1, pipe's replicas) */
    int local_sgd;              /* CT__LOCAL_SGD_*: the subgroup gradients are reduced over after the start */
    int64_t local_sgd_start;    /* steps of plain DDP first */
    int average_period;         /* parameters averaged every this many steps */
    int64_t average_warmup;     /* the first step that may average; -1: local_sgd_start */
} ct__ddp_opts;
#define CT__DDP_NOPTS 12
extern const ct__opt_def ct__ddp_opt_defs[CT__DDP_NOPTS];
enum { CT__LOCAL_SGD_OFF = 0, CT__LOCAL_SGD_NONE, CT__LOCAL_SGD_NODE };
#define CT__LOCAL_SGD_NOPTS 4
extern const ct__opt_def ct__local_sgd_opt_defs[CT__LOCAL_SGD_NOPTS];
/* 1 if key is one of post-local SGD's (a strategy other than ddp names them in its refusal). */
int ct__local_sgd_key(const char *key);
/* The post-local SGD hook for o (local_sgd none or node): plain allreduce
 * before local_sgd_start steps, then over the subgroup or nothing.
 * CT_EINVAL for powersgd_rank or a 16-bit reduce_dtype with it.  Collective
 * (local_sgd=node splits the group by node). */
ct_status ct__local_sgd_hook(ct_strategy *s, const ct__ddp_opts *o, const ct_comm_hook_ops **ops, void **state);
/* 1 if the averager averages after 0-based optimizer step t. */
int ct__local_sgd_averages(const ct__ddp_opts *o, int64_t t);
/* After an optimizer step: the parameters' mean over the group when the
 * step just taken is one the averager averages after.  Collective. */
ct_status ct__local_sgd_average(ct_strategy *s, const ct__ddp_opts *o);
/* DDP's gradient flats (ddp.c): buckets over the trainable parameters,
 * allreduced as their gradients become ready.  DDP is these and nothing
 * else; ZeRO-1 composes them under its sharded optimizer.  The options are
 * the composing strategy's, passed in (they must outlive the handle). */
typedef struct ct__ddp ct__ddp;
/* bucket_cap_mb=auto: the bucket size in bytes for grad_bytes of gradients
 * reduced over a group on `nodes` nodes. */
size_t ct__ddp_auto_cap(uint64_t grad_bytes, int nodes);
/* Checks the model is the same on every rank, broadcasts rank 0's
 * parameters and buffers, sets up s's comm hook and buckets the trainable
 * parameters.  Collective. */
ct_status ct__ddp_create(ct_strategy *s, const ct__ddp_opts *o, ct__ddp **out);
/* Every parameter keeps its gradient (its own memory again); NULL is a no-op. */
void ct__ddp_destroy(ct__ddp *d);
/* The trainable set changed since create (parameters frozen or unfrozen):
 * buckets and hooks over the parameters that take gradients now, their
 * values kept.  Collective. */
ct_status ct__ddp_follow_trainable(ct__ddp *d);
ct_status ct__ddp_pre_forward(ct__ddp *d);
ct_status ct__ddp_pre_backward(ct__ddp *d);
/* Waits for every bucket's allreduce (the synchronised gradients in place). */
ct_status ct__ddp_post_backward(ct__ddp *d);
void ct__ddp_zero_grad(ct__ddp *d);
/* Synchronises the gradients accumulated under no_sync now. */
ct_status ct__ddp_reduce(ct__ddp *d);
/* The factor on the loss gradient: 1/world (the collective is a plain sum). */
float ct__ddp_grad_scale(ct_strategy *s);
/* Collective: every rank holds the same trainable parameters (names, shapes). */
ct_status ct__check_same_model(ct_strategy *s);
/* Broadcasts parameters and buffers (or buffers only) from rank 0. */
ct_status ct__broadcast_state(ct_strategy *s, int buffers_only);

/* s->hook from DDP's options o when it has none yet (the built-in allreduce
 * in reduce_dtype, or PowerSGD when powersgd_rank > 0); CT_EINVAL naming a
 * bad combination.  DDP's create calls it. */
ct_status ct__comm_hook_setup(ct_strategy *s, const ct__ddp_opts *o);
/* A bucket is full: start its reduce through s->hook (*work: what to wait
 * for before finishing it). */
ct_status ct__comm_hook_start(ct_strategy *s, const ct_comm_bucket *b, ct_work **work);
/* After the bucket's work completed: the hook leaves the sum in b->grad. */
ct_status ct__comm_hook_finish(ct_strategy *s, const ct_comm_bucket *b);
/* The registered hook's start and finish on group g (FSDP: a unit's shard group). */
ct_status ct__comm_hook_start_on(ct_strategy *s, ct_group *g, const ct_comm_bucket *b, ct_work **work);
ct_status ct__comm_hook_finish_on(ct_strategy *s, ct_group *g, const ct_comm_bucket *b);
void ct__comm_hook_free(ct_strategy *s);
/* powersgd.c: Gram-Schmidt over the columns of a [rows, cols] (row-major),
 * as PyTorch 1.13's _orthogonalize: each column divided by its norm + eps,
 * then taken out of the columns after it. */
void ct__powersgd_orthogonalize(float *a, int rows, int cols, float eps);
/* A PowerSGD hook's memory of bucket index (for tests): Q as the next step
 * starts from it (*nq elements, PyTorch's layout) and the error (NULL
 * without error feedback); 0 when the bucket was never compressed. */
int ct__powersgd_peek(const void *state, int index, const float **q, int64_t *nq, const float **error);

/* Parses "k=v,k=v" against the common keys and ops' keys into s->common and
 * s->kopts (defaults first).  CT_EINVAL naming a bad or unknown key. */
ct_status ct__opts_parse(ct_strategy *s, const char *text);
void ct__opts_free(ct_strategy *s);
/* Replaces the text ct_strategy_opt answers for key with what the strategy
 * settled on (pipe: the balance it computed). */
ct_status ct__opts_set_text(ct_strategy *s, const char *key, const char *value);
/* A balance option ("3:3:2" or "3,3,2": children per stage or slice) into
 * a new array (ct_free) of *n positive counts; with nkids > 0 they must add
 * up to nkids.  CT_EINVAL naming what ("pipe", "offload") and the fix. */
ct_status ct__parse_balance(const char *what, const char *text, int nkids, int **out, int *n);
/* Help lines for ops' keys (and the common ones) into buf. */
void ct__opts_help(const ct__strategy_ops *ops, char *buf, size_t n);

/* Replicated defaults (state.c): full state, load, shards by greedy balance. */
ct_status ct__replicated_model_state(ct_strategy *s, ct_state *out);
ct_status ct__replicated_optim_state(ct_strategy *s, ct_state *out);
ct_status ct__replicated_load_state(ct_strategy *s, const char *const *names, ct_tensor *const *ts,
                                    int n, int optim);
ct_status ct__replicated_shard_state(ct_strategy *s, int optim, ct_state *out);
/* The state model/optim give, one tensor at a time (a replicated strategy
 * holds it all anyway). */
ct_status ct__replicated_each(ct_strategy *s, int optim, int shapes_only, ct_state_fn fn, void *ud);
/* The state shard/local give (local 0/1), one tensor at a time: a strategy
 * whose share is not streamed collects it for each call. */
ct_status ct__collected_share(ct_strategy *s, int optim, int local, int shapes_only, ct_state_fn fn, void *ud);
/* fn for a state of one's own: ct_state_add(ud, name, t). */
ct_status ct__state_collect(void *ud, const char *name, ct_tensor *t);
/* Calls fn with t, or with a shape-only tensor like t when shapes_only. */
ct_status ct__state_emit(ct_state_fn fn, void *ud, const char *name, ct_tensor *t, int shapes_only);
/* Emits "step" (I64 [1], the optimizer's step count). */
ct_status ct__state_emit_step(ct_strategy *s, int shapes_only, ct_state_fn fn, void *ud);
/* Rank 0 of s->g: the whole state (ct_strategy_local_state of a replicated strategy). */
ct_status ct__replicated_local_state(ct_strategy *s, int optim, ct_state *out);
/* A load in progress (state_load.c): where tensors without data are read,
 * and the whole tensors stitched from local pieces. */
typedef struct ct__load_ctx ct__load_ctx;
/* Loads names/tensors into s through its table's load entry, after
 * stitching local pieces ("<name>@<offset>") into whole tensors; tensors
 * without data are read through src (or parent's: a pipe stage loads for
 * its pipe).  Every value goes through ct__load_range. */
ct_status ct__strategy_load(ct_strategy *s, const char *const *names, ct_tensor *const *tensors, int n, int optim,
                            const ct_state_source *src, const ct__load_ctx *parent);
/* Gives p the tensors d and g as its own data and gradient and drops its
 * compute copy: what a strategy's unwrap does to a parameter it re-pointed.
 * With either NULL (out of memory) p keeps what it had and both are released. */
void ct__param_take(ct_param *p, ct_tensor *d, ct_tensor *g);
/* Elements [off, off + count) of src (f32, bf16 or f16) into f32 dst:
 * from memory, from the pieces it is stitched from, or read through the
 * load's source (state_load.c).  Only inside a strategy's load entry. */
ct_status ct__load_range(ct_strategy *s, float *dst, const ct_tensor *src, int64_t off, int64_t count,
                         const char *name);
/* All of src (f32, bf16 or f16) into f32 dst of n elements; CT_EINVAL naming
 * name when src does not have n elements. */
ct_status ct__load_whole(ct_strategy *s, float *dst, int64_t n, const ct_tensor *src, const char *name);
/* Appends "step" (I64 [1], the optimizer's step count) to out. */
ct_status ct__state_add_step(ct_strategy *s, ct_state *out);
/* The first tensor of ts called name, or NULL. */
const ct_tensor *ct__state_find(const char *const *names, ct_tensor *const *ts, int n, const char *name);
/* The value of the state's "step" tensor into *step; CT_EINVAL when there is
 * no I64 [1] tensor of that name. */
ct_status ct__state_step(const char *const *names, ct_tensor *const *ts, int n, int64_t *step);
/* Loads a model state: every name must be a parameter or buffer of the
 * model, every parameter and buffer present with its shape; put copies
 * src (same numel) into wherever p's values live. */
typedef ct_status (*ct__load_fn)(ct_strategy *s, ct_param *p, const ct_tensor *src);
ct_status ct__load_model_with(ct_strategy *s, const char *const *names, ct_tensor *const *ts, int n,
                              ct__load_fn put);

/* Reduces in flight (inflight.c), oldest first, with their bytes: ids are
 * indices (a parameter's, a unit's), each at most once, at most cap. */
typedef struct {
    int *id;
    size_t *bytes;
    int head, n, cap;
    size_t total;  /* bytes of every entry */
} ct__inflight;
ct_status ct__inflight_init(ct__inflight *q, int cap);
void ct__inflight_fini(ct__inflight *q);
void ct__inflight_push(ct__inflight *q, int id, size_t bytes);
/* Removes the entry at place pos (0: the oldest) and returns its id. */
int ct__inflight_take(ct__inflight *q, int pos);
/* The place of id in the queue, or -1. */
int ct__inflight_find(const ct__inflight *q, int id);

/* Gradients on the wire (wire.c): n f32 values as dt for a collective
 * (ct__wire_alloc: room for n of dt, CT_MEM_COMM, freed with ct_free), and
 * the reduced values back into f32 dst, overwriting or (add) adding.  dt is
 * the strategy's reduce_dtype: f32, bf16 or f16. */
void *ct__wire_alloc(ct_dtype dt, int64_t n);
void ct__wire_pack(ct_dtype dt, const float *src, void *dst, int64_t n);
void ct__wire_unpack(ct_dtype dt, const void *src, float *dst, int64_t n, int add);

/* Mixed precision (mixed.c): compute copies of the parameters in
 * common.param_dtype, made at wrap and refreshed after every step and load;
 * no-ops for f32. */
ct_status ct__mixed_init(ct_strategy *s);
ct_status ct__mixed_refresh(ct_strategy *s);
/* units.c: the default unit entries (the whole model, through summon and release). */
int ct__whole_units(ct_strategy *s);
ct_status ct__whole_unit_params(ct_strategy *s, int i, ct_module **m, ct_param ***ps, int *n);
ct_status ct__whole_unit_io(ct_strategy *s, int i, float *buf, int write);
void ct__mixed_refresh_param(ct_strategy *s, ct_param *p);
void ct__mixed_fini(ct_strategy *s);

#endif
