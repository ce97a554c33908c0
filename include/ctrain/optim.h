/*
 * ctrain optim: SGD (momentum, nesterov, weight decay) and AdamW with
 * PyTorch's update rules, gradient clipping by global norm, and learning
 * rate schedules.  An optimizer steps a list of slots; a slot is a whole
 * parameter or a flat range of one (offset, count), so sharding strategies
 * keep state only for the part they own.  State (momentum buffers, Adam
 * moments, step) is allocated under CT_MEM_OPTIM and can be read and
 * written for checkpoints.
 *
 * Numerics follow PyTorch 1.13's CPU kernels operation by operation: float
 * arithmetic per element, hyper-parameters held as double (like Python
 * floats) and rounded to float where PyTorch rounds them, fused
 * multiply-adds where PyTorch's add(alpha=)/addcmul use them.  On a CPU with
 * FMA the results are bit-identical to torch.optim.SGD / torch.optim.AdamW.
 *
 * Ownership: an optimizer never owns parameter data or gradients; it owns
 * its state and copies of slot names.  ct_optim_destroy frees both.
 */
#ifndef CTRAIN_OPTIM_H
#define CTRAIN_OPTIM_H

#include "nn.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { CT_OPT_SGD = 0, CT_OPT_ADAMW } ct_optim_kind;

/* One parameter group (an entry of PyTorch's param_groups): its own
 * hyper-parameters for the parameters it names.  Parameters are named, not
 * pointed at, because a strategy's optimizer steps pieces of them (ZeRO's
 * ranges, FSDP's shards, offload's slices) that all carry their
 * parameter's full name. */
typedef struct {
    const char *const *params; /* full names ("h.0.attn.c_attn.bias"), each in one group at most */
    int nparams;
    double lr_scale;           /* the group's lr is the optimizer's lr (a schedule's) times this, so a
                                  schedule moves every group as PyTorch's LambdaLR does; 1: the same */
    double weight_decay;
    double beta1, beta2, eps;  /* AdamW */
} ct_optim_group;

/* Hyper-parameters.  Doubles, like PyTorch's Python floats, so that derived
 * constants (1 - beta2, 1 - lr*wd, bias corrections) round as PyTorch's do. */
typedef struct {
    ct_optim_kind kind;
    double lr;
    double weight_decay; /* SGD: L2 added to the gradient; AdamW: decoupled */
    /* SGD */
    double momentum;
    double dampening;
    int nesterov;        /* needs momentum > 0 and dampening == 0 */
    /* AdamW */
    double beta1, beta2, eps;
    /* Parameter groups: parameters a group names take its hyper-parameters,
     * the rest (the default group) the ones above.  Borrowed: an optimizer
     * copies the table when it is created, and its own opts point at the
     * copy.  NULL/0: one group. */
    const ct_optim_group *groups;
    int ngroups;
} ct_optim_opts;

/* Most state buffers a slot has (AdamW's two moments). */
#define CT_OPTIM_MAX_STATE 2

/* PyTorch's defaults: SGD lr 0.01, momentum 0, dampening 0, wd 0; AdamW lr
 * 1e-3, betas (0.9, 0.999), eps 1e-8, wd 0.01.  Fields of the other kind
 * hold that kind's defaults too, so changing .kind afterwards stays valid
 * (except weight_decay, which differs). */
ct_optim_opts ct_optim_defaults(ct_optim_kind kind);
/* CT_OK, or CT_EINVAL naming the bad value (lr < 0, betas outside [0, 1),
 * eps < 0, weight_decay < 0, momentum < 0, nesterov without momentum or
 * with dampening, NaN anywhere, unknown kind; a group's bad value or
 * lr_scale, a NULL name, a parameter named by two groups or twice). */
ct_status ct_optim_validate(const ct_optim_opts *o);
/* A group of no parameters with o's hyper-parameters (lr_scale 1); set
 * params and change what differs. */
ct_optim_group ct_optim_group_init(const ct_optim_opts *o);
/* The index into o->groups of the group that names parameter name, or -1
 * (the default group). */
int ct_optim_group_of(const ct_optim_opts *o, const char *name);
/* The hyper-parameters parameter name trains with under o: its group's, the
 * learning rate o->lr times the group's lr_scale; out has no groups.  The
 * one place a group's values replace the defaults (the optimizer's step and
 * offload's update both take them from here). */
void ct_optim_param_opts(const ct_optim_opts *o, const char *name, ct_optim_opts *out);
/* The trainable parameters of params[0..n) that rules select, by name, for
 * a group (a no-decay group): *names gets a new array (ct_free it) of the
 * parameters' own names (borrowed: valid while they are), *count their
 * number.  rules are comma-separated, a parameter matching any is selected:
 * "ndim<K" (fewer than K dimensions: nanoGPT's configure_optimizers decays
 * only parameters of 2 or more, so "ndim<2" are its no-decay group), a glob
 * on the full name ("*.bias", "ln_f.*"), or "none" (nothing).  CT_EINVAL
 * naming an empty or malformed rule. */
ct_status ct_optim_select(ct_param **params, int n, const char *rules, const char ***names, int *count);
/* Parses "sgd" or "adamw"; returns 0 and sets *kind, or -1. */
int ct_optim_parse(const char *name, ct_optim_kind *kind);

/* What one slot updates: n floats of data and grad (f32). */
typedef struct {
    float *data;
    float *grad;      /* NULL: the slot is skipped by a step (PyTorch's grad None) */
    int64_t n;
    const char *name; /* parameter name (state tensor names derive from it) */
    int64_t offset;   /* of this range within the parameter (0 for whole) */
} ct_optim_slot;

typedef struct ct_optim ct_optim;

/* Optimizer over every requires_grad parameter in params (whole slots), in
 * order; a parameter listed twice is an error.  These slots follow their parameter: each step re-reads p->data and
 * p->grad (a strategy may re-point them at views of its own storage, same
 * numel) and p->name.  Data must be f32 (CT_EUNSUPPORTED otherwise).
 * Returns NULL with the error set (CT_EINVAL for bad options) on failure. */
ct_optim *ct_optim_create(const ct_optim_opts *o, ct_param **params, int n);
/* A range of a parameter: elements [offset, offset + count) of its data. */
typedef struct {
    ct_param *param;
    int64_t offset, count;
} ct_optim_range;

/* Optimizer over ranges of parameters (what a rank owns under ZeRO), in
 * order.  Like whole-parameter slots they follow their parameter: each step
 * re-reads p->data and p->grad at the range's offset, so a strategy may
 * re-point them; a NULL grad skips the range.  Slot i's offset is the
 * range's.  NULL with the error set on failure (a range outside its
 * parameter, a non-f32 parameter). */
ct_optim *ct_optim_create_ranges(const ct_optim_opts *o, const ct_optim_range *r, int n);
/* Optimizer over explicit slots (ranges of parameters); copies the slot
 * table and names (a NULL name becomes "slot<i>").  n may be 0 (a rank that
 * owns no shard).  Returns NULL with the error set on failure. */
ct_optim *ct_optim_create_slots(const ct_optim_opts *o, const ct_optim_slot *slots, int n);
/* Frees the optimizer and its state; NULL is a no-op. */
void ct_optim_destroy(ct_optim *opt);
/* One update of every slot from its current gradient; slots whose grad is
 * NULL are skipped and their step does not advance.  Fails (nothing
 * updated) with CT_EINVAL if the learning rate set since is invalid,
 * CT_ESTATE if a parameter changed size or dtype under the optimizer, or
 * CT_ENOMEM if the state cannot be allocated. */
ct_status ct_optim_step(ct_optim *opt);
/* Re-points slot i at new data/grad memory (same n); state stays.  A slot
 * made from a ct_param stops following the parameter from then on. */
void ct_optim_set_slot(ct_optim *opt, int i, float *data, float *grad);
int ct_optim_num_slots(const ct_optim *opt);
/* Slot i as the next step will see it (refreshed from its parameter). */
const ct_optim_slot *ct_optim_slot_at(const ct_optim *opt, int i);
/* PyTorch's add_param_group, for parameters the optimizer already steps in
 * the default group (every trainable parameter is in the optimizer from its
 * creation): from the next step on, the parameters g names (copied) train
 * with g's hyper-parameters.  A sharded optimizer takes the same group on
 * every rank and moves the pieces it holds.  CT_EINVAL if g's values are
 * bad or it names a parameter another group already has (nothing changes). */
ct_status ct_optim_add_param_group(ct_optim *opt, const ct_optim_group *g);
/* Number of groups besides the default one (ct_optim_get_opts(opt)->ngroups). */
int ct_optim_num_groups(const ct_optim *opt);
/* Learning rate for the next steps (schedules call this every step); a
 * group's is this times its lr_scale. */
void ct_optim_set_lr(ct_optim *opt, double lr);
double ct_optim_get_lr(const ct_optim *opt);
const ct_optim_opts *ct_optim_get_opts(const ct_optim *opt);
/* Number of ct_optim_step calls so far (or the last ct_optim_set_step). */
int64_t ct_optim_get_step(const ct_optim *opt);
/* Sets the step count of the optimizer and of every slot (PyTorch keeps a
 * step per parameter: AdamW's bias correction uses it, and SGD treats a
 * slot at step 0 as having no momentum buffer yet).  With the state buffers
 * written back, this resumes training exactly. */
void ct_optim_set_step(ct_optim *opt, int64_t step);
/* "sgd" or "adamw". */
const char *ct_optim_name(const ct_optim *opt);

/* State buffers of slot i: SGD with momentum has "momentum_buffer"; AdamW
 * "exp_avg" and "exp_avg_sq"; SGD without momentum has none.  Fills bufs
 * and names (either may be NULL; room for CT_OPTIM_MAX_STATE) and returns
 * the number of buffers, each of the slot's n floats, owned by the
 * optimizer.  Buffers are allocated on first use, so before the first step
 * this returns them zeroed.  Returns CT_ENOMEM (negative) if they cannot
 * be allocated. */
int ct_optim_state(ct_optim *opt, int i, float **bufs, const char **names);
/* Frees the state buffers (the next ct_optim_state or step allocates them
 * zeroed): for a strategy that keeps the state elsewhere (FSDP's offloaded
 * shards) and fills the optimizer's buffers only for a checkpoint. */
void ct_optim_release_state(ct_optim *opt);
/* The state buffer names every slot has (as ct_optim_state gives them), into
 * names (room for CT_OPTIM_MAX_STATE; may be NULL); returns how many.  Valid
 * with no slots, so a rank that owns nothing names what others hold. */
int ct_optim_state_names(const ct_optim *opt, const char **names);
/* Bytes of the state slab an optimizer of options o over slots of
 * counts[0..n) elements allocates (CT_MEM_OPTIM), the slot table left out:
 * the layout ct_optim_create* uses, for memory planning. */
uint64_t ct_optim_state_bytes(const ct_optim_opts *o, const int64_t *counts, int n);

/* Multiplies the gradients of every slot by scale. */
void ct_optim_scale_grads(ct_optim *opt, float scale);

/* One update of a caller-owned range (a strategy that keeps parameters,
 * gradients and state itself: offload's slices) by o's rule, bitwise what
 * ct_optim_step does to a slot: state holds ct_optim_state_names' buffers
 * of n floats each (zeroed before the first update), step is the range's
 * 1-based step count after this update.  The one place an update rule is
 * chosen by kind: a new optimizer is added here and in its state names. */
void ct_optim_update_range(const ct_optim_opts *o, float *data, const float *grad, float *const *state,
                           int64_t n, int64_t step);

/* Raw updates (one range), as PyTorch computes them.  buf may be NULL when
 * momentum is 0; first_step: buf is set to the gradient instead of being
 * decayed (PyTorch's "buffer is None").  step is 1-based. */
void ct_sgd_update(float *p, const float *g, float *buf, int64_t n,
                   const ct_optim_opts *o, int first_step);
void ct_adamw_update(float *p, const float *g, float *m, float *v, int64_t n,
                     const ct_optim_opts *o, int64_t step);

/* ---- gradient clipping ------------------------------------------------- */

/* A gradient norm being accumulated: the sum of |g|^p (finite p; squares
 * for 2) or the largest magnitude (infinity) of every element added, in
 * double, NaN propagating.  Every strategy's norm is one of these over the
 * pieces it holds, combined across ranks (whole tensors add their own sum
 * first, so a norm over whole gradients matches ct_grad_sq_sum bit for
 * bit).  The norm is the sum^(1/p), as torch.nn.utils.clip_grad_norm_'s. */
typedef struct {
    double v;
    int inf;  /* 1: infinity norm (max), 0: a sum of |g|^p */
    double p; /* the norm type: > 0, or INFINITY */
} ct_norm_acc;
/* 1 when norm_type is a norm clipping can take: > 0 or +infinity. */
int ct_norm_type_ok(double norm_type);
/* An empty accumulator for norm_type; one that is not ct_norm_type_ok (0,
 * as in a zeroed accumulator) gives the 2-norm, as before p existed
 * (clipping checks norm_type itself and refuses such values). */
ct_norm_acc ct_norm_acc_init(double norm_type);
/* Adds n f32 gradient elements. */
void ct_norm_acc_f32(ct_norm_acc *a, const float *g, int64_t n);
/* Adds a whole gradient tensor (f32, bf16 or f16). */
void ct_norm_acc_tensor(ct_norm_acc *a, const ct_tensor *g);
/* Adds another accumulator's value (a rank's, a shard group's, a slice's). */
void ct_norm_acc_add(ct_norm_acc *a, double v);
/* The norm: the sum^(1/p) (sqrt for 2), or the maximum. */
double ct_norm_acc_norm(const ct_norm_acc *a);
/* A term v of a's kind (a sum of |g|^p, or a max) after the gradients it
 * measured were scaled by k: v*|k|^p, or the f32 max times |k|. */
double ct_norm_acc_scaled(const ct_norm_acc *a, double v, float k);
/* Adds the gradients of every slot of opt (NULL grads skipped): a sharded
 * strategy's local part of the global norm. */
void ct_optim_grad_norm_acc(ct_optim *opt, ct_norm_acc *a);

/* Sum of squares (in double) of every gradient element under params;
 * params with a NULL grad are skipped.  Grads may be f32, bf16 or f16. */
double ct_grad_sq_sum(ct_param **params, int n);
/* Scale factor torch.nn.utils.clip_grad_norm_ applies for a total norm:
 * max_norm/(total_norm+1e-6) when that is below 1, otherwise 1. */
float ct_clip_coef(double total_norm, double max_norm);
/* Scales gradients by max_norm/(total_norm+1e-6) when that is below 1, as
 * torch.nn.utils.clip_grad_norm_ (norm 2).  Sets *norm (may be NULL) to the
 * total norm before clipping.  CT_EINVAL if max_norm is negative or NaN. */
ct_status ct_clip_grad_norm(ct_param **params, int n, float max_norm, float *norm);
/* The same for any norm_type > 0 or INFINITY (torch's norm_type argument):
 * CT_EINVAL names a norm_type of 0, below 0 or NaN. */
ct_status ct_clip_grad_norm_p(ct_param **params, int n, float max_norm, double norm_type, float *norm);
/* Scaling part alone, for strategies that compute the global norm
 * themselves (with ct_clip_coef). */
void ct_scale_grads(ct_param **params, int n, float scale);

/* ---- LR schedules ------------------------------------------------------ */

typedef enum { CT_SCHED_CONSTANT = 0, CT_SCHED_COSINE } ct_sched_kind;

typedef struct {
    ct_sched_kind kind;
    double base_lr;
    int64_t warmup_steps; /* both kinds: linear from base_lr/warmup to base_lr */
    int64_t total_steps;  /* cosine decays to min_lr at total_steps */
    double min_lr;
} ct_lr_schedule;

/* Learning rate for 0-based step: during warmup base*(step+1)/warmup; then
 * base (constant) or min + (base-min)*(1+cos(pi*progress))/2 with
 * progress = (step-warmup)/max(1, total-warmup) clipped to [0, 1]. */
double ct_lr_at(const ct_lr_schedule *s, int64_t step);
/* CT_OK, or CT_EINVAL naming the bad field (negative or NaN rates, negative
 * warmup; for cosine: min_lr outside [0, base_lr], total_steps <= 0 or
 * warmup_steps > total_steps). */
ct_status ct_sched_validate(const ct_lr_schedule *s);
/* Parses "constant" or "cosine"; returns 0 or -1. */
int ct_sched_parse(const char *name, ct_sched_kind *kind);
/* "constant" or "cosine". */
const char *ct_sched_name(ct_sched_kind kind);

#ifdef __cplusplus
}
#endif
#endif
