/*
 * Private to the memory planners (src/parallel/plan*.c): what every
 * strategy's plan reads (the model's parameters and the order backward
 * reaches its modules, the run, the strategy's resolved options) and the
 * figures they share.  ct_strategy_plan (plan.c) fills a ct__plan and calls
 * the kind's planner; a new strategy adds its planner to plan.c's table.
 */
#ifndef CTRAIN_PARALLEL_PLAN_H
#define CTRAIN_PARALLEL_PLAN_H

#include "parallel/internal.h"

typedef struct {
    ct_module *model;
    const ct_plan_spec *spec;
    const char *opts;       /* as the caller gave them (NULL: defaults) */
    char *vals;             /* the options resolved by ct_strategy_check_opts: "key=value\n" lines (the
                               defaults' room and the given text's: a wrap_modules list is kilobytes) */
    int nparams;
    ct_param **params;      /* every parameter, model order */
    int ntp;
    ct_param **tp;          /* the trainable ones, model order (the strategies' indices) */
    struct ct__plan_ix {
        const ct_param *p;
        int i;
    } *by_addr;             /* tp's entries sorted by address, with their index (ct__plan_tindex) */
    uint64_t buffer_bytes;  /* buffers (batchnorm statistics) count as param */
    int nmods;
    ct_module **bwd;        /* modules with trainable parameters, in the order backward reaches them */
    int64_t rows;           /* the largest rank's rows of the global batch (the first ranks take the extra) */
} ct__plan;

/* The value of key in the resolved options (NULL if the kind has no such
 * key), as a number (def if absent), and whether a dtype key is 16-bit. */
const char *ct__plan_opt(const ct__plan *pl, const char *key, char *buf, size_t n);
double ct__plan_num(const ct__plan *pl, const char *key, double def);
int ct__plan_is16(const ct__plan *pl, const char *key);
/* The balance option (children per stage or slice, "3:3:2"; the format
 * checked by ct_strategy_check_opts) into sizes (room for the model's
 * children), *n its count (0: not given); CT_EINVAL, as the strategy at
 * wrap, when the counts do not add up to the model's children. */
ct_status ct__plan_balance(const ct__plan *pl, const char *what, int *sizes, int *n);
/* Index of trainable parameter p in pl->tp, or -1. */
int ct__plan_tindex(const ct__plan *pl, const ct_param *p);

/* Folds one rank's figures into out, peaks at different times (resident
 * the peak of param + grad + optim together), or at the same time. */
void ct__plan_peaks(ct_mem_plan *out, uint64_t param, uint64_t grad, uint64_t optim, uint64_t act, uint64_t comm,
                    uint64_t resident);
void ct__plan_rank(ct_mem_plan *out, uint64_t param, uint64_t grad, uint64_t optim, uint64_t act, uint64_t comm);

/* Bytes of p's data, and of its compute copy under mixed (mixed.c's policy). */
uint64_t ct__plan_bytes(const ct_param *p);
uint64_t ct__plan_copy_bytes(const ct_param *p, int mixed);
/* Gradients of frozen parameters: no strategy takes them, they keep their own. */
uint64_t ct__plan_frozen_grads(const ct__plan *pl);
/* The optimizer's state over slots of counts[0..n) elements. */
uint64_t ct__plan_optim(const ct__plan *pl, const int64_t *counts, int n);
/* The optimizer bytes of rank r: its ranges of pt (counts: room for pt->n). */
uint64_t ct__plan_optim_share(const ct__plan *pl, const ct_partition *pt, int r, int64_t *counts);
/* The activations of a step of rows rows in k micro-batches (the first, the
 * largest, sets the peak), this rank's batch included; mixed: bf16 copies. */
ct_status ct__plan_act(const ct__plan *pl, int64_t rows, int k, int mixed, uint64_t *act);
/* One micro-batch of mrows rows through top-level children [lo, hi) of the
 * model (a pipeline stage or an offload slice); flags: more CT_ACT_* bits. */
ct_status ct__plan_stage_act(const ct__plan *pl, int lo, int hi, int64_t mrows, int mixed, int flags, ct_act_plan *out);
/* This rank's batch of rows, as the loaders hold it. */
uint64_t ct__plan_batch_bytes(const ct__plan *pl, int64_t rows);

ct_status ct__plan_pipe(const ct__plan *pl, ct_mem_plan *out);
ct_status ct__plan_fsdp(const ct__plan *pl, ct_mem_plan *out);
ct_status ct__plan_offload(const ct__plan *pl, ct_mem_plan *out);

#endif
