/*
 * `ctrain estimate`: predicted per-rank memory of every strategy from a
 * model's shapes alone.  estimate.c owns the command and the table of
 * strategies (a row is one function of est_in); estimate_act.c estimates the
 * activations of one training step by replaying, on shapes only, what each
 * layer keeps in its record and allocates while it runs.
 */
#ifndef CTRAIN_CLI_ESTIMATE_H
#define CTRAIN_CLI_ESTIMATE_H

#include "cli.h"

/* What every row reads: the model, the run's settings, the parameters. */
typedef struct {
    ct_module *model;
    ct_model_config cfg;
    int world;
    int64_t batch;          /* global batch, as `ctrain train --batch` */
    ct_optim_kind optim;
    double momentum;
    int nparams;
    ct_param **params;      /* every parameter, model order */
    int ntp;
    ct_param **tp;          /* trainable ones, model order (the strategies' indices) */
    uint64_t buffer_bytes;  /* buffers (batchnorm statistics) count as param */
    int nmods;
    ct_module **bwd;        /* modules with trainable parameters, in the order backward reaches them */
} est_in;

/* Bytes per rank; each column is its own maximum over ranks, and resident
 * (param + grad + optim) and total (all five) the largest rank's sums. */
typedef struct {
    uint64_t param, grad, optim, act, comm, resident, total;
} est_row;

/* Every strategy's row (estimate_rows.c), in the order of ct_strategy_list();
 * max_ranks 0: any. */
typedef struct {
    const char *kind;
    int max_ranks;
    ct_status (*row)(const est_in *in, const char *vals, est_row *row);
} est_kind;
extern const est_kind est_kinds[];
extern const int est_nkinds;

/* Peak bytes of the activation category over one training step of a rank
 * holding rows samples, cut into k micro-batches (the first, largest, one
 * sets the peak), with the loss gradient scaled (a copy: scaled != 0 when
 * the micro-batch is not the whole global batch) and with bf16 compute
 * copies of the weights (mixed != 0).  Counts this rank's batch (inputs and
 * targets), the records forward leaves for backward, and what is alive at
 * once while a layer runs (its output, input gradient and scratch).  Layer
 * kinds it does not know are assumed to keep their input and output. */
ct_status est_activations(const est_in *in, int64_t rows, int k, int scaled, int mixed, uint64_t *bytes);
/* One micro-batch of mrows rows through the model's top-level children
 * [lo, hi) (a pipeline stage), replayed as est_activations replays a step:
 * *kept gets the bytes its record holds from its forward to its backward,
 * *peak the peak of its forward and backward on their own (the next
 * stage's gradient or the loss's included, the stage's input not),
 * *in_bytes and *out_bytes the sizes of the stage's input and output. */
ct_status est_stage_activations(const est_in *in, int lo, int hi, int64_t mrows, int mixed, uint64_t *kept,
                                uint64_t *peak, uint64_t *in_bytes, uint64_t *out_bytes);
/* This rank's batch of rows (inputs and targets), as the loaders hold it. */
uint64_t est_batch_bytes(const est_in *in, int64_t rows);

#endif
