/* Private to the train command: the state of one run, shared by the loop
 * (train.c) and what it prints (train_report.c). */
#ifndef CTRAIN_CLI_TRAIN_LOOP_H
#define CTRAIN_CLI_TRAIN_LOOP_H

#include "train.h"

typedef struct {
    train_opts *o;
    ct_group *g;
    int rank, world;
    int drank, dsize;      /* this rank's slice of each batch, of dsize (ct_strategy_data_rank) */
    int64_t nparams;       /* the whole model's, before a pipeline keeps only its stage */
    int nckpt;             /* modules --checkpoint-activation wrapped (0: off) */
    ct_model_config cfg;
    uint64_t seed;
    int shuffle;
    ct_optim_kind okind;
    ct_dataset train, test; /* images; for text only .n is set (windows per split) */
    ct_text text;            /* the gpt's corpus */
    int is_text;
    ct_ckpt_info ck;         /* --init / --resume: the checkpoint's metadata */
    const char *ck_path;     /* that checkpoint, or NULL */
    ct_module *model;
    ct_optim *opt;
    const char **nd;       /* the no-decay group's names (ct_optim_select's), until the strategy copied them */
    int nnd;
    ct_optim_group nodecay;
    char saved_no_decay[NO_DECAY_MAX]; /* --resume: the checkpoint's --no-decay rules */
    char saved_clip_filter[NO_DECAY_MAX]; /* --resume: the checkpoint's --clip-filter globs */
    ct_strategy *s;
    ct_sampler sampler;
    ct_lr_schedule sched;
    int64_t step, epoch, pos, total, spe, start_step;
    double last_loss;      /* mean loss over the last logged window */
    ct_step_stats sum;     /* strategy timings summed over steps */
    double first_io_bytes; /* the store's bytes in the first two steps (they move less: no update to load, then
                            * no optimizer state yet) */
    int64_t nstats;
    ct_comm_traffic traffic; /* messages this rank sent and received in those steps */
    double comm_cpu;         /* seconds of CPU its communication thread used in them */
    double *traffic_all;   /* every rank's, per step: sent, received, comm thread CPU ms (train_report gathers them) */
    double ledger[CT_LEDGER_N]; /* products, attention, optimizer seconds summed over the steps */
    double step_total;     /* wall seconds of those steps */
    double *step_s;        /* wall time of each step of this run (the first STEP_TIMES_MAX) */
    int64_t nstep_s, cap_step_s;
    ct_mem_report *mem;    /* every rank's, gathered after the loop */
    int usage;             /* the failure is the command line's (exit 2) */
    char latest[4096];     /* --resume latest: the checkpoint it found */
    char saved[4096];      /* where the last save went */
    int64_t skipped;       /* steps dropped by --on-nonfinite skip */
    cli_eval last_eval;    /* the evaluation made at step last_eval_step (train_eval) */
    int64_t last_eval_step; /* -1: none yet */
    double eval_seconds;   /* spent in train_eval (not training: left out of the run's speed) */
} trainer;

/* Collective: evaluates the model now (test set; gpt: validation split)
 * into t->last_eval, at t->step, and logs it (a progress line, --metrics
 * "val_loss"), so a run's curve holds the validation loss next to the
 * training loss and the final report reuses the last step's. */
ct_status train_eval(trainer *t, cli_progress *prog);

/* Evaluates, then prints the run's summary: steps, loss, test or
 * validation figures, every rank's peak memory and the strategy's times. */
ct_status train_report(trainer *t, double seconds);
/* After teardown, collective: every rank's whole-life peak RSS and phase
 * peaks into t->mem, the --metrics summary (rank 0; step_ms the median
 * step), and a line naming each rank's whole-life peak and its phase. */
ct_status train_life(trainer *t, cli_progress *prog, double step_ms);
/* Median wall time of this run's steps in ms (0 if none ran). */
double train_median_step_ms(trainer *t);
/* The run's first lines: model, data, strategy (a pipeline's stages), and
 * with --verbose who owns which parameter ranges. */
void train_describe(trainer *t);

#endif
