/*
 * ctrain optim: SGD (momentum, nesterov, weight decay) and AdamW with
 * PyTorch's update rules, gradient clipping by global norm, and learning
 * rate schedules.  An optimizer steps a list of slots; a slot is a whole
 * parameter or a flat range of one (offset, count), so sharding strategies
 * keep state only for the part they own.  State (momentum buffers, Adam
 * moments, step) is allocated under CT_MEM_OPTIM and can be read and
 * written for checkpoints.
 */
#ifndef CTRAIN_OPTIM_H
#define CTRAIN_OPTIM_H

#include "nn.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { CT_OPT_SGD = 0, CT_OPT_ADAMW } ct_optim_kind;

typedef struct {
    ct_optim_kind kind;
    float lr;
    float weight_decay; /* SGD: L2 added to the gradient; AdamW: decoupled */
    /* SGD */
    float momentum;
    float dampening;
    int nesterov;
    /* AdamW */
    float beta1, beta2, eps;
} ct_optim_opts;

/* PyTorch's defaults: SGD lr 0.01; AdamW lr 1e-3, betas (0.9, 0.999), eps 1e-8, wd 0.01. */
ct_optim_opts ct_optim_defaults(ct_optim_kind kind);

/* What one slot updates: n floats of data and grad (f32). */
typedef struct {
    float *data;
    float *grad;
    int64_t n;
    const char *name; /* parameter name (state tensor names derive from it) */
    int64_t offset;   /* of this range within the parameter (0 for whole) */
} ct_optim_slot;

typedef struct ct_optim ct_optim;

/* Optimizer over every requires_grad parameter in params (whole slots). */
ct_optim *ct_optim_create(const ct_optim_opts *o, ct_param **params, int n);
/* Optimizer over explicit slots (ranges of parameters). */
ct_optim *ct_optim_create_slots(const ct_optim_opts *o, const ct_optim_slot *slots, int n);
/* Frees the optimizer and its state; NULL is a no-op. */
void ct_optim_destroy(ct_optim *opt);
/* One update of every slot from its current gradient. */
ct_status ct_optim_step(ct_optim *opt);
/* Re-points slot i at new data/grad memory (same n); state stays. */
void ct_optim_set_slot(ct_optim *opt, int i, float *data, float *grad);
int ct_optim_num_slots(const ct_optim *opt);
const ct_optim_slot *ct_optim_slot_at(const ct_optim *opt, int i);
void ct_optim_set_lr(ct_optim *opt, float lr);
float ct_optim_get_lr(const ct_optim *opt);
const ct_optim_opts *ct_optim_get_opts(const ct_optim *opt);
/* Steps taken so far (AdamW's bias correction uses it). */
int64_t ct_optim_get_step(const ct_optim *opt);
void ct_optim_set_step(ct_optim *opt, int64_t step);
/* "sgd" or "adamw". */
const char *ct_optim_name(const ct_optim *opt);

/* State buffers of slot i: SGD has "momentum_buffer"; AdamW "exp_avg" and
 * "exp_avg_sq".  Returns the number of buffers (0..2) and their pointers and
 * names; each has the slot's n floats.  Buffers are allocated on first use,
 * so before the first step this returns them zeroed. */
int ct_optim_state(ct_optim *opt, int i, float **bufs, const char **names);

/* Raw updates (one range), as PyTorch computes them.  step is 1-based. */
void ct_sgd_update(float *p, const float *g, float *buf, int64_t n,
                   const ct_optim_opts *o, int first_step);
void ct_adamw_update(float *p, const float *g, float *m, float *v, int64_t n,
                     const ct_optim_opts *o, int64_t step);

/* ---- gradient clipping ------------------------------------------------- */

/* Sum of squares of every gradient element under params (f64). */
double ct_grad_sq_sum(ct_param **params, int n);
/* Scales gradients by max_norm/(total_norm+1e-6) when total_norm > max_norm,
 * as torch.nn.utils.clip_grad_norm_.  Returns the total norm in *norm. */
ct_status ct_clip_grad_norm(ct_param **params, int n, float max_norm, float *norm);
/* Scaling part alone, for strategies that compute the global norm themselves. */
void ct_scale_grads(ct_param **params, int n, float scale);

/* ---- LR schedules ------------------------------------------------------ */

typedef enum { CT_SCHED_CONSTANT = 0, CT_SCHED_COSINE } ct_sched_kind;

typedef struct {
    ct_sched_kind kind;
    float base_lr;
    int64_t warmup_steps; /* linear from base_lr/warmup to base_lr */
    int64_t total_steps;  /* cosine decays to min_lr at total_steps */
    float min_lr;
} ct_lr_schedule;

/* Learning rate for 0-based step. */
float ct_lr_at(const ct_lr_schedule *s, int64_t step);
/* Parses "constant" or "cosine"; returns 0 or -1. */
int ct_sched_parse(const char *name, ct_sched_kind *kind);

#ifdef __cplusplus
}
#endif
#endif
