/*
 * ctrain nn: modules with explicit forward and backward, parameters with
 * PyTorch-style fully qualified names, buffers, hooks, and activation
 * records.  A forward call saves what its backward needs in a ct_record that
 * belongs to that call (not to the layer), so several micro-batches can be
 * in flight and a record can be dropped and recomputed (ct_checkpoint_create;
 * ct_module_apply_activation_checkpointing wraps a model's blocks).
 * A pipeline cuts a sequential into stages that keep their names
 * (ct_sequential_split) and sizes the activations between them without
 * running anything (ct_module_out_shape).  This room knows nothing of ranks:
 * a strategy tells dropout where a call's rows sit in the global batch
 * (ct_fwd_ctx.sample0).
 *
 * Ownership: a module owns its children, parameters and buffers;
 * ct_module_destroy frees the whole tree.  Forward returns a new reference in
 * *out that the caller releases.  Backward consumes the record and returns
 * a new reference in *din (if din is not NULL).  Parameter gradients are
 * accumulated (+=), never overwritten.
 */
#ifndef CTRAIN_NN_H
#define CTRAIN_NN_H

#include "tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ct_module ct_module;
typedef struct ct_param ct_param;
typedef struct ct_record ct_record;
typedef struct ct_hook ct_hook;

/* What a forward call needs to know besides its input.  Dropout draws the
 * mask of input row r (index r along dim 0) from (seed, step, the module's
 * stream, sample0 + r) only, so the masks of a step do not depend on how its
 * global batch is cut into ranks and micro-batches: N ranks equal one
 * process, and a pipeline's micro-batches draw what the whole batch would. */
typedef struct {
    int training;    /* dropout active, batchnorm uses batch stats */
    uint64_t seed;   /* run seed */
    uint64_t step;   /* optimizer step: part of the dropout RNG key */
    int64_t sample0; /* global index, within the step's global batch, of this call's first
                        row (the strategy sets it: rank offset + micro-batch offset) */
    int recompute;   /* this call repeats one already run with the same context (activation
                        checkpointing, ct_module_recompute): the same numbers, dropout's masks
                        included, but no state changes twice: modules with running statistics
                        (CT_MOD_RUNNING_STATS) leave them alone, and hooks can tell
                        (ct_module.recomputing) */
} ct_fwd_ctx;

/* A parameter or buffer.  A strategy may replace data/grad with views into
 * storage it owns; layers read p->data and p->grad at every call. */
/* How a parameter's initial values are made: a rule that gives any element
 * from (the parameter's seed, its full name, the element's index), so a
 * rank can make just its shard and get the numbers a whole-model
 * initialisation gives (src/nn/init.c).  Built-in layers set PyTorch's
 * rules when built; the ready models set their own; a custom layer sets its
 * parameters' rules in its constructor (any rule through fn). */
typedef enum {
    CT_INIT_NONE = 0, /* no rule: ct_module_init_params leaves the values and warns */
    CT_INIT_CONST,    /* every element a */
    CT_INIT_UNIFORM,  /* U(-a, a) */
    CT_INIT_NORMAL,   /* N(mean a, std b) */
    CT_INIT_FN,       /* fn */
} ct_init_kind;
/* Writes elements [first, first + n) of p's initial values (p's shape
 * flattened, row-major) into out, as a pure function of (p, seed, index):
 * draw from a ct_rng keyed by p->name at offset first, as the built-in rules do. */
typedef ct_status (*ct_init_fn)(const ct_param *p, uint64_t seed, int64_t first, int64_t n, float *out);
typedef struct {
    ct_init_kind kind;
    float a, b;
    ct_init_fn fn;
} ct_init;
static inline ct_init ct_init_const(float v) { return (ct_init){CT_INIT_CONST, v, 0.0f, NULL}; }
static inline ct_init ct_init_uniform(float bound) { return (ct_init){CT_INIT_UNIFORM, bound, 0.0f, NULL}; }
static inline ct_init ct_init_normal(float mean, float std) { return (ct_init){CT_INIT_NORMAL, mean, std, NULL}; }
static inline ct_init ct_init_with(ct_init_fn fn) { return (ct_init){CT_INIT_FN, 0.0f, 0.0f, fn}; }

struct ct_param {
    char *name;          /* fully qualified once the tree is named ("0.weight") */
    const char *local;   /* name within its module ("weight") */
    ct_tensor *data;
    ct_tensor *grad;     /* same shape as data; NULL for buffers */
    ct_tensor *compute;  /* compute copy of data in a lower precision (BF16, same shape)
                            that layers read for their products when not NULL; owned by
                            whoever set it (a strategy's mixed-precision policy), who keeps
                            it in step with data; data stays the f32 master, grad stays f32 */
    int requires_grad;
    int is_buffer;
    ct_module *owner;
    ct_hook *grad_hooks; /* grad-ready hooks */
    void *user;          /* free for strategies */
    int grad_stale;      /* grad is logically zero but its memory was not cleared
                            (ct_module_zero_grad_lazy); see ct_param_grad_sync */
    int nmodules;        /* modules listing it: 1, or more for a shared (tied) parameter
                            (ct_module_share_param); the last of them frees it */
    int uses_pending;    /* shared only: forward uses with a record whose backward has not
                            ended; grad-ready fires when the last one's backward ends */
    ct_init init;        /* how its initial values are made (ct_param_set_init) */
    uint64_t seed;       /* the seed of those values (ct_module_init_params) */
    int shape_only;      /* built shape-only (ct_module_shape_only) and not made yet: data and grad
                            have no memory and the values are init's; a strategy makes what its
                            rank holds, ct_module_materialize the whole */
};

/* What a kind of module does.  forward must save into rec only when rec is
 * not NULL (rec NULL = inference, nothing saved).  backward reads rec,
 * accumulates parameter gradients, and writes a new reference to the input
 * gradient into *din when din is not NULL.  out_shape (optional, see
 * ct_module_out_shape) gives the output shape for an input shape without
 * running forward, with the errors forward would give. */
/* What one training call of a module keeps and allocates, for planning
 * memory without running anything (ct_module_act_cost, ct_act_plan_run).
 * Bytes; outputs and input gradients are f32 (their size is the planner's). */
typedef struct {
    int keep_in, keep_out; /* the record holds the input / the output tensor itself */
    int alias;             /* the output is a view of the input, the input gradient one of dout */
    int walk;              /* a container whose children run one after another: plan them
                              instead (the other fields are unused) */
    uint64_t saved;        /* new memory the record keeps (masks, bf16 casts, statistics) */
    uint64_t fwd_tmp;      /* scratch alive only while forward runs, besides the output */
    uint64_t bwd_tmp;      /* scratch alive only while backward runs, besides the input gradient */
} ct_act_cost;

typedef struct {
    const char *kind;
    ct_status (*forward)(ct_module *m, ct_tensor *in, ct_tensor **out,
                         ct_record *rec, const ct_fwd_ctx *ctx);
    ct_status (*backward)(ct_module *m, ct_tensor *dout, ct_tensor **din,
                          ct_record *rec);
    void (*destroy)(ct_module *m); /* frees impl; may be NULL */
    /* 1 if backward handles gradients marked zero itself (ct_param_grad_beta);
     * otherwise the wrapper clears them before calling backward. */
    int lazy_grad;
    /* May be NULL (then the kind cannot infer shapes).  out_shape has room
     * for CT_MAX_DIMS dims; in_shape is already checked (0 <= ndim <=
     * CT_MAX_DIMS, no negative dim). */
    ct_status (*out_shape)(ct_module *m, int ndim, const int64_t *in_shape, int *out_ndim,
                           int64_t *out_shape);
    /* May be NULL (then the planner assumes the record keeps the input and
     * the output, which errs high).  What a training call on an input of
     * in_shape keeps for backward and allocates while it runs, written
     * next to the layer's forward so the two change together; mixed: the
     * run gives weights bf16 compute copies (param_dtype=bf16); need_dx:
     * backward makes an input gradient.  See ct_module_act_cost. */
    ct_status (*act_cost)(ct_module *m, int ndim, const int64_t *in_shape, int mixed, int need_dx,
                          ct_act_cost *out);
    /* What the kind is (CT_MOD_* bits), for policies outside src/nn that must
     * never ask by kind name (mixed precision, pipelines, offload). */
    unsigned flags;
} ct_module_ops;

/* ct_module_ops.flags: */
enum {
    CT_MOD_KEEP_F32 = 1u << 0,      /* its parameters stay f32 under mixed precision (norm layers) */
    CT_MOD_RUNNING_STATS = 1u << 1, /* training forward updates running statistics (batchnorm): a
                                       recompute must not update them twice */
    CT_MOD_SEQUENTIAL = 1u << 2,    /* runs its children in order, each on the last one's output:
                                       can be cut into pipeline stages or offload slices */
    CT_MOD_CHECKPOINT = 1u << 3,    /* keeps only its input and recomputes its child in backward
                                       (ct_checkpoint_create) */
    CT_MOD_BLOCK = 1u << 4,         /* a repeated block of a deep model (a transformer block): what
                                       activation checkpointing wraps by default */
};
/* 1 if m's kind has every bit of flags (0 for a NULL m). */
int ct_module_is(const ct_module *m, unsigned flags);
/* The mixed-precision policy (param_dtype=bf16), the one rule strategies
 * and the memory planner follow: 1 if p gets a bf16 compute copy, that is,
 * a trainable f32 parameter of two or more dims (linear and conv weights,
 * embeddings) whose module does not keep f32 (CT_MOD_KEEP_F32: norm layers). */
int ct_param_takes_bf16_copy(const ct_param *p);

struct ct_module {
    const ct_module_ops *ops;
    char *name;            /* name within parent ("0", "fc1"); "" for a root */
    char *fqn;             /* full path ("layers.0"); "" for a root */
    ct_module *parent;
    ct_module **kids;
    int nkids, kids_cap;   /* count and allocated capacity (arrays grow by doubling) */
    ct_param **params;     /* direct parameters, in registration order */
    int nparams, params_cap;
    ct_param **buffers;    /* direct buffers (running stats) */
    int nbuffers, buffers_cap;
    void *impl;            /* kind-specific state */
    uint64_t rng_stream;   /* from fqn: dropout stream */
    ct_hook *hooks;        /* pre/post forward and backward hooks */
    int transparent;       /* wrapper whose child takes its place in names */
    int emit_bf16;         /* set by the parent before each forward: the output feeds only a
                              layer that casts it to bf16, so the module may return it as BF16
                              (rounded as ct_f32_to_bf16_n: the same numbers, one pass less) */
    int emit_bf16_grad;    /* set by the parent before each backward: the input gradient feeds
                              only a bf16 linear, so the module may return it as BF16 with its
                              column sums (see nn/internal.h: the same numbers, two passes less) */
    const char *held_by;   /* root only: who wraps the tree (ct_module_hold), else NULL */
    int recomputing;       /* while a forward of m runs as a recompute (ct_fwd_ctx.recompute), hooks
                              included: 2 when m is the module ct_module_recompute runs, whose
                              backward follows at once (FSDP keeps such a unit gathered for it),
                              1 for a module inside it (its backward comes later), else 0 */
};

/* Per-call activation record: any number of saved tensors (retained; add
 * them with ct_record_save, read them with ct_record_saved), small values,
 * and the records of child calls (ct_record_add_kid).  A backward that takes
 * a child record out of kids[] sets the slot to NULL: destroying the record
 * then skips it. */
struct ct_record {
    ct_module *m;
    ct_tensor **saved;     /* [nsaved], in save order */
    int nsaved, saved_cap;
    int64_t ival[4];
    double fval[4];
    void *extra;           /* freed with ct_free when the record is freed */
    ct_record **kids;      /* [nkids], in call order */
    int nkids, kcap;
    ct_fwd_ctx ctx;        /* the context of the call, for a recompute */
    int shared_uses;       /* this call counted a use of m's shared parameters (dropping the
                              record unused takes the use back; needs m alive) */
};

/* ---- running modules --------------------------------------------------- */

/* Runs pre-forward hooks, the module's forward and post-forward hooks.
 * rec NULL: inference, nothing saved.  Otherwise *rec receives a new record
 * for ct_module_backward (or ct_record_destroy). */
ct_status ct_module_forward(ct_module *m, ct_tensor *in, ct_tensor **out,
                            ct_record **rec, const ct_fwd_ctx *ctx);
/* Runs pre-backward hooks, backward, grad-ready hooks of the module's own
 * parameters, then post-backward hooks.  Consumes rec even on failure; a
 * record already consumed (a second backward on it) is CT_ESTATE.
 * A shared parameter (ct_module_share_param) gets its grad-ready hooks once:
 * each forward with a record counts a use, and the hooks fire after the
 * backward that ends the last pending use, when p->grad holds the sum of
 * every use's gradient. */
ct_status ct_module_backward(ct_module *m, ct_tensor *dout, ct_tensor **din,
                             ct_record *rec);
/* Runs m's forward again, with a record, as a recompute of a call made with
 * ctx (the same context, recompute set: the same dropout masks, running
 * statistics untouched): the one recompute of activation checkpointing,
 * whether a checkpoint wrapper, a pipeline stage or an offload slice drops
 * the records.  *rec gets the record for ct_module_backward; out (may be
 * NULL: released) the output. */
ct_status ct_module_recompute(ct_module *m, ct_tensor *in, ct_tensor **out, ct_record **rec,
                              const ct_fwd_ctx *ctx);
/* Output shape of m for an input of shape in_shape (ndim dims), without
 * running anything: writes *out_ndim and out_shape (room for CT_MAX_DIMS).
 * Every built-in layer knows its rule and containers compose their
 * children's; an input the forward would reject gives the same CT_EINVAL.
 * A module kind without an out_shape op (a custom module) is CT_EUNSUPPORTED
 * naming the module: give its ct_module_ops an out_shape (shape-preserving
 * kinds can use ct_module_out_shape_same).  No forward is run as a fallback:
 * that would cost a batch of activations and could not know the input's
 * dtype. */
ct_status ct_module_out_shape(ct_module *m, int ndim, const int64_t *in_shape, int *out_ndim,
                              int64_t *out_shape);
/* An out_shape op for kinds whose output has their input's shape. */
ct_status ct_module_out_shape_same(ct_module *m, int ndim, const int64_t *in_shape,
                                   int *out_ndim, int64_t *out_shape);
/* What a training call of m on an input of in_shape keeps and allocates
 * (its ops' act_cost; without one, the input and output kept), for memory
 * planning; the shape is checked as ct_module_out_shape checks it. */
ct_status ct_module_act_cost(ct_module *m, int ndim, const int64_t *in_shape, int mixed, int need_dx,
                             ct_act_cost *out);

/* The activation bytes of one micro-batch through modules mods[0..n), run
 * one after another (a model's top-level children, or a pipeline stage's),
 * forward then backward, replayed on shapes only (src/nn/act_plan.c):
 * every tensor of the call is a buffer with a reference count, as ctrain
 * holds it: the chain of outputs, what each record keeps (the modules'
 * act_cost; containers that walk are replayed as their children), the loss
 * gradient or the next stage's, and the input gradients flowing back. */
#define CT_ACT_MIXED  1 /* param_dtype=bf16: weights have bf16 compute copies */
#define CT_ACT_DX0    2 /* the first module makes an input gradient (a pipeline stage after the first) */
#define CT_ACT_WHOLE  4 /* the output and the loss gradient stay to the end (a whole model);
                           otherwise the output is sent away after forward (a stage) */
#define CT_ACT_SCALED 8 /* with WHOLE: the loss gradient is scaled in a copy (micro-batches) */
#define CT_ACT_HANDED 16 /* the output gradient is handed over, not held to the end: it goes once
                            the last module's backward has used it (offload's slices) */
typedef struct {
    uint64_t kept;      /* bytes the records hold from forward to backward (the output not) */
    uint64_t peak;      /* peak live bytes over forward and backward, scratch included; the
                           input is not counted (it belongs to the caller) */
    uint64_t in_bytes;  /* the input's f32 size, and the output's */
    uint64_t out_bytes;
} ct_act_plan;
ct_status ct_act_plan_run(ct_module *const *mods, int n, int ndim, const int64_t *in_shape, int flags,
                          ct_act_plan *out);

/* Frees a record and its children (releasing saved tensors); NULL is a no-op. */
void ct_record_destroy(ct_record *rec);
/* New empty record for module m (for module kinds that call children). */
ct_record *ct_record_create(ct_module *m, const ct_fwd_ctx *ctx);
/* Appends a child record to rec, which owns it from then on (CT_ENOMEM
 * leaves kid the caller's). */
ct_status ct_record_add_kid(ct_record *rec, ct_record *kid);
/* Keeps t alive for backward: retains it (the caller keeps its own
 * reference) and returns its index, 0 for the first save, 1 for the next...;
 * a negative ct_status (CT_ENOMEM, nothing retained) on failure. */
int ct_record_save(ct_record *rec, ct_tensor *t);
/* The tensor saved at index i (borrowed: the record holds the reference).
 * i outside [0, rec->nsaved) is a programmer error (CT_ASSERT). */
ct_tensor *ct_record_saved(const ct_record *rec, int i);

/* ---- building modules -------------------------------------------------- */

/* Bare module of a kind (for custom layers); NULL on failure. */
ct_module *ct_module_create(const ct_module_ops *ops, void *impl);
/* Frees the module tree; NULL is a no-op.  CT_ESTATE, freeing nothing,
 * while a strategy wraps it (ct_module_hold): destroy the strategy first. */
ct_status ct_module_destroy(ct_module *m);
/* A strategy borrows root from wrap to destroy: ct_module_hold marks it
 * (who names the holder, "strategy ddp"; a string that outlives the hold),
 * so destroying it meanwhile, or wrapping it a second time, is CT_ESTATE
 * naming the holder instead of a crash later.  ct_module_unhold ends it. */
ct_status ct_module_hold(ct_module *root, const char *who);
void ct_module_unhold(ct_module *root);
/* Adds kid under name (NULL: its index); a name may be a dotted path
 * ("transformer.h.0": a flat container carrying a nested model's state_dict
 * names) whose parts are not empty.  m owns kid from now on, and on
 * failure kid is freed (so ct_module_add(m, NULL, ct_relu_create()) never
 * leaks) unless it already belongs to another tree. */
ct_status ct_module_add(ct_module *m, const char *name, ct_module *kid);
/* Adds a zero-initialised parameter (with a gradient) of the given shape. */
ct_param *ct_module_add_param(ct_module *m, const char *local, int ndim,
                              const int64_t *shape);
/* Makes m's parameter local be p, a parameter of another module (a tied
 * weight: nanoGPT's lm_head.weight is transformer.wte.weight).  m's own
 * parameter of that name is freed and p takes its place in m->params, so
 * both modules read p->data and accumulate into p->grad.  p keeps its
 * owner's name, so a state dict holds it once, under the name
 * ct_module_params finds first (PyTorch's named_parameters rule); the
 * gradient is the sum of both uses and grad-ready fires once per backward
 * (ct_module_backward).  Shapes must match (CT_EINVAL otherwise); p is
 * freed with the last module that lists it.  Strategies that walk
 * m->params see p in both modules. */
ct_status ct_module_share_param(ct_module *m, const char *local, ct_param *p);
/* Adds a buffer (no gradient), filled with value. */
ct_param *ct_module_add_buffer(ct_module *m, const char *local, int ndim,
                               const int64_t *shape, float value);
/* Computes fully qualified names of every module and parameter under root.
 * Called by ct_module_add; call again after re-parenting a tree by hand. */
ct_status ct_module_name_tree(ct_module *root);
/* Takes child index out of parent and returns it as a root of its own that
 * keeps its names: its fqn stays what it was ("layers.3"), so its parameters
 * are still "layers.3.weight" and its dropout streams do not change.  The
 * caller owns the result (ct_module_destroy, or ct_module_add, which names it
 * anew under its new parent).  The other children keep their names too.
 * NULL with CT_EINVAL if index is not a child's. */
ct_module *ct_module_detach(ct_module *parent, int index);

/* ---- walking the tree -------------------------------------------------- */

/* Collects the tree's parameters (not buffers) in PyTorch's named_parameters
 * order into a new array (ct_free it); sets *n. */
ct_status ct_module_params(ct_module *root, ct_param ***list, int *n);
/* Same for buffers. */
ct_status ct_module_buffers(ct_module *root, ct_param ***list, int *n);
/* Collects every module (pre-order, root first) into a new array (ct_free it). */
ct_status ct_module_modules(ct_module *root, ct_module ***list, int *n);
/* Parameter or buffer with this fully qualified name, or NULL. */
ct_param *ct_module_find(ct_module *root, const char *fqn);
/* Total number of parameter elements. */
int64_t ct_module_num_params(ct_module *root);
/* Sets every parameter gradient under root to zero. */
void ct_module_zero_grad(ct_module *root);
/* Marks every gradient under root as zero without writing it, so the next
 * backward overwrites instead of accumulating and a pass over all gradient
 * memory is saved.  Until a backward has produced it, a marked gradient's
 * memory is stale: read it only after ct_param_grad_sync (strategies do). */
void ct_module_zero_grad_lazy(ct_module *root);
/* Makes p->grad hold its value: clears it if it is marked zero.  A gradient
 * whose storage is released (a sharded strategy frees the gradients it does
 * not own) stays marked zero until its storage comes back. */
void ct_param_grad_sync(ct_param *p);
/* For layers writing p's gradient: 0 if it is marked zero (the layer must
 * then overwrite all of it), else 1 (accumulate); clears the mark. */
float ct_param_grad_beta(ct_param *p);
/* Writes a one-line-per-module description ("0 linear [784->256]") to buf. */
void ct_module_describe(ct_module *root, char *buf, size_t n);

/* ---- hooks ------------------------------------------------------------- */

typedef enum {
    CT_HOOK_PRE_FORWARD = 0,
    CT_HOOK_POST_FORWARD,
    CT_HOOK_PRE_BACKWARD,
    CT_HOOK_POST_BACKWARD,
    CT_HOOK_GRAD_READY
} ct_hook_kind;

/* Module hook; a failing status aborts the forward or backward with it. */
typedef ct_status (*ct_module_hook_fn)(ct_module *m, ct_hook_kind kind, void *ud);
/* Grad-ready hook: p->grad holds this backward's full gradient for p. */
typedef ct_status (*ct_param_hook_fn)(ct_param *p, void *ud);

/* Registers a module hook; hooks of one kind fire in registration order.
 * Returns a handle for ct_hook_remove, NULL on failure. */
ct_hook *ct_module_add_hook(ct_module *m, ct_hook_kind kind,
                            ct_module_hook_fn fn, void *ud);
/* Registers a grad-ready hook on a parameter. */
ct_hook *ct_param_add_hook(ct_param *p, ct_param_hook_fn fn, void *ud);
/* Unregisters and frees a hook; NULL is a no-op. */
void ct_hook_remove(ct_hook *h);

/* ---- layers ------------------------------------------------------------ */
/* Weights are initialised like PyTorch's defaults from (seed, fqn-free
 * stream) via ct_module_init_params; shapes follow PyTorch.
 * Linear, conv2d and embedding compute in bf16 when their weight has a bf16
 * compute copy (ct_param.compute), and linear and conv2d also when their
 * input is BF16: products run on oneDNN with f32 accumulation, the record
 * keeps the input as bf16, and outputs, input gradients and parameter
 * gradients stay F32 (the bias too).  Other layers take F32 only. */

/* y[N,out] = x[N,in] W^T + b; x F32 or BF16; weight [out,in], bias [out] (bias 0: none). */
ct_module *ct_linear_create(int64_t in, int64_t out, int bias);
ct_module *ct_relu_create(void);
/* tanh approximation off: exact erf GELU, as PyTorch's default. */
ct_module *ct_gelu_create(void);
ct_module *ct_tanh_create(void);
/* Normalises the last dim of size dim; weight and bias [dim]. */
ct_module *ct_layernorm_create(int64_t dim, float eps);
/* Input i32 or i64 indices [...]; output [..., dim]; weight [num, dim]. */
ct_module *ct_embedding_create(int64_t num, int64_t dim);
/* Zeroes with probability p and scales by 1/(1-p) in training; identity otherwise
 * (p = 0 or not training), which returns its input, and backward its output
 * gradient, as new references: no copy. */
ct_module *ct_dropout_create(float p);
/* x[N,Cin,H,W] (F32 or BF16) -> [N,Cout,Ho,Wo]; weight [Cout,Cin,k,k], bias [Cout]. */
ct_module *ct_conv2d_create(int64_t cin, int64_t cout, int k, int stride, int pad, int bias);
/* Max over k x k windows with stride (0 = k). */
ct_module *ct_maxpool2d_create(int k, int stride);
/* Over channel dim 1 of [N,C] or [N,C,H,W]; weight, bias, running_mean,
 * running_var buffers and num_batches_tracked (as PyTorch). */
ct_module *ct_batchnorm_create(int64_t c, float eps, float momentum);
/* How a training forward treats bn's running statistics (fairscale's
 * DeferredBatchNorm, for micro-batches): CT_BN_NOW updates them (default),
 * CT_BN_DEFER accumulates the batch's statistics for ct_batchnorm_commit,
 * CT_BN_HOLD leaves both alone (a checkpoint's recompute).  Normalisation
 * always uses the batch's own statistics.  CT_EINVAL if bn is not a
 * batchnorm or mode is unknown. */
enum { CT_BN_NOW = 0, CT_BN_DEFER, CT_BN_HOLD };
ct_status ct_batchnorm_set_mode(ct_module *bn, int mode);
/* Updates the running statistics once from every batch accumulated since the
 * last commit, as if they had been one batch (mean and unbiased variance
 * over all their values), counts one batch in num_batches_tracked, and
 * clears the accumulator; nothing accumulated: no-op. */
ct_status ct_batchnorm_commit(ct_module *bn);
/* Sums v[0..n) over the replicas of a data-parallel group, in place, on
 * every replica (SyncBatchNorm's statistics); ud is the installer's. */
typedef ct_status (*ct_stats_sync_fn)(float *v, int64_t n, void *ud);
/* PyTorch's SyncBatchNorm: with fn, a training forward of bn normalises
 * with the mean and variance of the batch over every replica (fn sums each
 * replica's count, per-channel sums, then squared deviations from the
 * common mean) and updates the running statistics from them; backward sums
 * the per-channel terms of the input gradient the same way (the weight and
 * bias gradients stay this replica's, for the strategy to reduce).  Every
 * replica must run the same forwards and backwards (fn is collective).  fn
 * NULL: this replica's batch alone (the default).  CT_EINVAL if bn is not
 * a batchnorm. */
ct_status ct_batchnorm_set_sync(ct_module *bn, ct_stats_sync_fn fn, void *ud);
/* ct_batchnorm_set_sync on every module under root (root included) that
 * keeps batch statistics; *n (may be NULL) gets how many. */
ct_status ct_module_set_stats_sync(ct_module *root, ct_stats_sync_fn fn, void *ud, int *n);
/* [N, ...] -> [N, prod(...)]. */
ct_module *ct_flatten_create(void);
/* Children run in order; add them with ct_module_add(m, NULL, kid). */
ct_module *ct_sequential_create(void);
/* Skip connections (torchgpipe's stash/pop): a stash passes its input on
 * and keeps it under name; a later pop of that name (anywhere in the same
 * model, after the stash in forward order) outputs its input plus the kept
 * tensor (same shape, f32), and its backward hands the gradient back to the
 * stash.  One stash per name; any number of pops.  A pipeline may cut
 * between them: it sends the kept tensor with the activations (README). */
ct_module *ct_skip_stash_create(const char *name);
ct_module *ct_skip_pop_create(const char *name);
/* 1 if m is a stash, 2 a pop (*name, may be NULL, gets its name), else 0. */
int ct_skip_info(const ct_module *m, const char **name);
/* Cuts sequential seq into pipeline stages: moves its children, in order,
 * into nparts new sequentials, parts[0] taking the first sizes[0] children,
 * parts[1] the next sizes[1], and so on.  Names do not change: each part is
 * a root with seq's path and every child keeps its name, so a part holding
 * children 3..5 names its parameters "3.weight" ... "5.bias" ("layers.3.weight"
 * when seq is "layers") exactly as the unsplit model's state_dict, and
 * dropout draws the same masks.  Running the parts in turn computes what seq
 * did.  On success seq is left without children (still the caller's to
 * destroy; hooks on seq stay on it) and parts[i] are new roots the caller
 * destroys; on failure (sizes that do not add up to seq's children, a part
 * of size < 1, seq not a sequential, out of memory) nothing has changed. */
ct_status ct_sequential_split(ct_module *seq, const int *sizes, int nparts, ct_module **parts);
/* y = x + body(x); body becomes the child named "body" (shape-preserving). */
ct_module *ct_residual_create(ct_module *body);
/* Wraps inner: forward keeps only its input, backward recomputes inner's
 * forward with the same context (so dropout draws the same mask) and then
 * runs its backward.  Transparent in names: inner's parameters keep their
 * names. */
ct_module *ct_checkpoint_create(ct_module *inner);

/* Which modules ct_module_apply_activation_checkpointing wraps (PyTorch's
 * check_fn): 1 to wrap m (then its subtree is not looked into). */
typedef int (*ct_ckpt_check_fn)(const ct_module *m, void *ud);
/* PyTorch's apply_activation_checkpointing: wraps, in place, every module
 * under root that check picks in a checkpoint wrapper (ct_checkpoint_create),
 * so its forward keeps only its input and its backward recomputes it (same
 * context: dropout repeats exactly; batchnorm statistics are not counted
 * twice).  check NULL: the default policy, every block (CT_MOD_BLOCK: the
 * gpt's transformer blocks), or, in a tree without blocks, each child of a
 * sequential root (mlp, cnn).  Names, dropout streams and the state dict do
 * not change.  Call it before a strategy wraps the model; *nwrapped (may be
 * NULL) gets the count.  CT_ESTATE (nothing changed) while a strategy holds
 * root, or if root already has checkpoint wrappers (wrapping twice would
 * recompute twice); CT_EINVAL if the policy picks nothing or picks root
 * itself (a root wrapper would keep nothing but the batch). */
ct_status ct_module_apply_activation_checkpointing(ct_module *root, ct_ckpt_check_fn check, void *ud,
                                                   int *nwrapped);

/* ---- transformer pieces (nanoGPT's names) ------------------------------- */

/* Causal self-attention, x [B,T,dim] F32 -> [B,T,dim]: children c_attn
 * (Linear(dim, 3*dim): q, k, v), c_proj (Linear(dim, dim)) and resid_dropout
 * (Dropout(resid_p)); softmax(q k^T / sqrt(dim/heads)) over positions <= t
 * (the causal mask) with dropout attn_p on the probabilities.  The products
 * run in bf16 when c_attn's weight has a bf16 compute copy.  heads must
 * divide dim. */
ct_module *ct_attention_create(int64_t dim, int heads, float attn_p, float resid_p);
/* Bytes an attention forward with a record keeps for an input [batch, T,
 * dim] besides its children's records: qkv (bf16 when bf16, i.e. c_attn's
 * weight has a bf16 compute copy), the probabilities and, if dropout (attn_p
 * > 0 in training), their keep-mask.  For memory estimates. */
int64_t ct_attention_saved_bytes(int64_t batch, int64_t T, int64_t dim, int heads, int bf16, int dropout);
/* The core a bf16 attention of this head width runs here: "ctrain kernels on AMX tiles",
 * "ctrain avx512bf16 kernels" or "portable, oneDNN products" (f32 attention always
 * runs the portable core). */
const char *ct_attention_bf16_path(int64_t head_dim);
/* Pre-LN transformer block, [B,T,dim] -> [B,T,dim]: h = x + attn(ln_1(x)),
 * out = h + mlp(ln_2(h)); children ln_1, attn (ct_attention_create with
 * dropout for both), ln_2 (LayerNorm eps 1e-5) and mlp, a sequential of
 * c_fc (Linear(dim, 4*dim)), gelu (erf), c_proj (Linear(4*dim, dim)) and
 * dropout. */
ct_module *ct_transformer_block_create(int64_t dim, int heads, float dropout);
/* Token plus position embeddings, indices [B,T] (I32/I64, T <= context) ->
 * [B,T,dim] = wte(idx) + wpe(0..T-1), then dropout; children wte
 * (Embedding(vocab, dim)), wpe (Embedding(context, dim)) and drop.  No input
 * gradient (indices). */
ct_module *ct_tokpos_embedding_create(int64_t vocab, int64_t context, int64_t dim, float dropout);

/* Initialises every parameter under root from its rule (ct_param.init: the
 * built-in layers' are PyTorch's defaults, kaiming-uniform weights,
 * uniform(+-1/sqrt(fan_in)) biases, ones/zeros for norms, normal(0,1)
 * embeddings) and seed: a shape-only parameter keeps the seed and gets its
 * values when made.  A parameter with no rule is left as it is and its
 * module named in a warning. */
void ct_module_init_params(ct_module *root, uint64_t seed);
/* Sets p's rule; a CONST rule also writes the values now when p has memory
 * (a norm layer is usable before ct_module_init_params). */
void ct_param_set_init(ct_param *p, ct_init rule);
/* Elements [first, first + n) of p's initial values (its rule at its seed)
 * into out; CT_EUNSUPPORTED naming the module when p has no rule. */
ct_status ct_param_init_values(const ct_param *p, int64_t first, int64_t n, float *out);
/* Elements [first, first + n) of p's current values into out: from its
 * memory, or from its rule while it is shape-only; CT_ESTATE when it has
 * neither (a sharded strategy holds it in pieces, or freed it). */
ct_status ct_param_values(const ct_param *p, int64_t first, int64_t n, float *out);

/* Shape-only construction (PyTorch's meta device, DeepSpeed's zero.Init):
 * while on, on this thread, ct_module_add_param makes parameters whose data
 * and grad have no memory (shape_only; a few hundred bytes each whatever
 * their size).  A strategy then makes only what its rank holds (fsdp its
 * shards, pipe its stage, offload one slice at a time; ddp and zero the
 * whole, which they replicate), with the values a whole-model
 * initialisation gives.  Buffers always have memory.  Returns the previous
 * setting, to restore. */
int ct_module_shape_only(int on);
/* Gives every shape-only parameter under root memory and its initial values
 * (a zero gradient): the whole model, for use without a sharding strategy. */
ct_status ct_module_materialize(ct_module *root);

/* ---- loss -------------------------------------------------------------- */

/* Softmax cross-entropy of logits [N,C] against i32/i64 targets [N], mean
 * over targets != ignore_index.  *loss receives the mean; if dlogits is not
 * NULL it receives a new [N,C] tensor with d(loss)/d(logits).
 * Targets outside [0,C) other than ignore_index are an error. */
ct_status ct_cross_entropy(const ct_tensor *logits, const ct_tensor *targets,
                           int64_t ignore_index, float *loss,
                           ct_tensor **dlogits);
/* Number of rows whose argmax equals the target (ignored rows skipped). */
int64_t ct_count_correct(const ct_tensor *logits, const ct_tensor *targets,
                         int64_t ignore_index);

#ifdef __cplusplus
}
#endif
#endif
