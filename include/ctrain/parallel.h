/*
 * ctrain parallel: training strategies.  One interface drives a training
 * step whatever the strategy: forward, backward (gradients are synchronised
 * across ranks by the time it returns, as in PyTorch where loss.backward()
 * finishes DDP's allreduce), clip, step, zero_grad, no_sync, state for
 * checkpoints, and a memory/timing report.  A strategy is a flag, not a fork
 * of the loop:
 *   "none"  one replica, no communication (a world of 1, or every rank alone)
 *   "ddp"   DistributedDataParallel: replicas, bucketed gradient allreduce
 *           started from grad-ready hooks so it overlaps backward
 *
 * Ownership: the strategy borrows the model, the optimizer and the group;
 * they must outlive it.  A strategy may re-point parameter gradients into
 * storage it owns (DDP: views into bucket buffers); destroying the strategy
 * gives every parameter a gradient tensor of its own again.
 */
#ifndef CTRAIN_PARALLEL_H
#define CTRAIN_PARALLEL_H

#include "comm.h"
#include "nn.h"
#include "optim.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- bucket assignment ------------------------------------------------- */

/* PyTorch's compute_bucket_assignment_by_size: tensors (in the given order)
 * go into per-key (dtype) buckets; a bucket closes when its bytes reach the
 * current limit of its key; each key walks through limits in turn and keeps
 * the last one; open buckets are appended at the end; the result is sorted
 * by each bucket's smallest index.  Output: bucket_of[i] for each tensor and
 * *nbuckets; bucket b's members are the i with bucket_of[i] == b, ascending. */
ct_status ct_bucket_assign(const size_t *bytes, const int *keys, int n, const size_t *limits,
                           int nlimits, int *bucket_of, int *nbuckets);

/* ---- options ----------------------------------------------------------- */

typedef struct {
    double bucket_cap_mb;       /* bucket size after the first (default 25) */
    double first_bucket_mb;     /* first bucket, so the first allreduce starts early (default 1) */
    int broadcast_buffers;      /* broadcast buffers from rank 0 before every forward (default 1) */
    int find_unused_parameters; /* parameters of modules that did not run are marked ready (default 0) */
    ct_dtype comm_dtype;        /* CT_F32, or CT_BF16 / CT_F16 to compress gradients on the wire */
    int rebuild_buckets;        /* after the first step, rebuild buckets in the order gradients became ready (default 1) */
} ct_ddp_opts;

typedef struct {
    ct_ddp_opts ddp;
} ct_strategy_opts;

/* Defaults as PyTorch's DDP. */
ct_strategy_opts ct_strategy_defaults(void);

/* ---- the strategy interface ------------------------------------------- */

typedef struct ct_strategy ct_strategy;

/* Timings of the last step, in seconds, and how much communication hid
 * behind backward. */
typedef struct {
    double forward, backward, comm_wait, optimizer;
    double comm_total;  /* sum over buckets of (allreduce end - start) */
    double overlap;     /* 1 - comm_wait / comm_total, clipped to [0,1]; 1 when no comm */
    int nbuckets;
} ct_step_stats;

/* Wraps model and opt for training over group g (NULL: the world) with the
 * strategy named kind ("none" or "ddp").  Collective over g for "ddp": all
 * ranks call it; parameters and buffers are broadcast from rank 0; a model
 * that differs across ranks is an error on every rank. */
ct_status ct_strategy_create(const char *kind, ct_module *model, ct_optim *opt, ct_group *g,
                             const ct_strategy_opts *o, ct_strategy **out);
/* Unwraps and frees; NULL is a no-op. */
void ct_strategy_destroy(ct_strategy *s);
/* "none", "ddp". */
const char *ct_strategy_kind(const ct_strategy *s);
/* Names accepted by ct_strategy_create, comma separated. */
const char *ct_strategy_list(void);

/* Forward through the wrapped model (see ct_module_forward). */
ct_status ct_strategy_forward(ct_strategy *s, ct_tensor *in, ct_tensor **out, ct_record **rec,
                              const ct_fwd_ctx *ctx);
/* Backward from dout (consumes rec).  Gradients accumulate; unless no_sync
 * is on, they are averaged over the group's ranks when this returns.  DDP
 * folds the 1/world of the average into dout, so under no_sync the local
 * gradients read as 1/world of their plain sum. */
ct_status ct_strategy_backward(ct_strategy *s, ct_tensor *dout, ct_record *rec);
/* Clips the gradients by their global norm (as clip_grad_norm_); *norm gets it. */
ct_status ct_strategy_clip_grad_norm(ct_strategy *s, float max_norm, float *norm);
/* Optimizer step on the synchronised gradients. */
ct_status ct_strategy_step(ct_strategy *s);
/* Zeroes every gradient. */
void ct_strategy_zero_grad(ct_strategy *s);
/* While on, backward only accumulates locally (gradient accumulation); the
 * first backward after turning it off synchronises the accumulated sum. */
void ct_strategy_set_no_sync(ct_strategy *s, int on);
/* The model, optimizer and group the strategy wraps. */
ct_module *ct_strategy_model(const ct_strategy *s);
ct_optim *ct_strategy_optim(const ct_strategy *s);
ct_group *ct_strategy_group(const ct_strategy *s);
/* Timings of the last completed step. */
ct_step_stats ct_strategy_stats(const ct_strategy *s);

/* ---- state for checkpoints -------------------------------------------- */

/* Named tensors (retained references); free with ct_state_fini. */
typedef struct {
    int n;
    char **names;
    ct_tensor **tensors;
} ct_state;

/* Appends a retained reference under a copy of name. */
ct_status ct_state_add(ct_state *st, const char *name, ct_tensor *t);
/* Releases the tensors and names and zeroes st. */
void ct_state_fini(ct_state *st);

/* The full model state (parameters then buffers, PyTorch names), valid on
 * every rank. */
ct_status ct_strategy_model_state(ct_strategy *s, ct_state *out);
/* The optimizer state: "<param>.exp_avg", "<param>.exp_avg_sq" (AdamW) or
 * "<param>.momentum_buffer" (SGD), full tensors, plus an I64 tensor "step". */
ct_status ct_strategy_optim_state(ct_strategy *s, ct_state *out);
/* Loads tensors by name into the model (every parameter and buffer must be
 * present with its shape; f32, or bf16/f16 converted) or, with optim != 0,
 * into the optimizer state.  Names not in the model are an error. */
ct_status ct_strategy_load_state(ct_strategy *s, const char *const *names,
                                 ct_tensor *const *tensors, int n, int optim);

#ifdef __cplusplus
}
#endif
#endif
