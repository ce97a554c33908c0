/* The train command's options, shared by its parser (train_args.c) and its loop (train.c). */
#ifndef CTRAIN_CLI_TRAIN_H
#define CTRAIN_CLI_TRAIN_H

#include "cli.h"

typedef struct {
    const char *model, *hidden, *data, *data_dir;
    int64_t epochs, steps, batch, kernel;
    const char *optim, *schedule;
    double lr, weight_decay, momentum, clip, dropout;
    int64_t warmup, seed;
    int no_shuffle;
    const char *init, *resume, *save, *state_dict, *metrics, *trace;
    int64_t save_every, log_every;
    const char *strategy, *grad_compress, *strategy_opt, *mixed, *clip_norm;
    int64_t grad_accum, threads;
    double bucket_cap_mb;
    int find_unused, flush_denormal, verbose;
    int64_t limit_train, limit_test, eval_batch; /* unlisted: small runs for tests */
    /* pipe: stages, children per stage, micro-batches, schedule, checkpoint mode */
    int64_t stages, chunks;
    const char *balance, *pipe_schedule, *pipe_checkpoint;
    /* offload: slices, micro-batches, the store's directory, the resident budget */
    int64_t slices, microbatches, max_resident_mb;
    const char *offload_dir;
    int checkpoint_activation;
    /* which flags the user gave (resume takes the others from the checkpoint) */
    int has_model, has_hidden, has_seed, has_batch, has_optim, has_lr, has_wd, has_momentum, has_strategy;
    int has_schedule, has_warmup, has_clip, has_accum, has_kernel, has_dropout, has_clip_norm, has_bucket_cap;
} train_opts;

/* Parses and checks the train command's flags (what needs no MPI).  Returns
 * 0, or CLI_USAGE with one line in err; *help set for --help (help text
 * printed to stdout by the caller through train_help). */
int train_parse(int argc, char **argv, train_opts *o, int *help, char *err, size_t errn);
void train_help(FILE *f);
/* Checks that need the world size (the strategy; the batch is checked once
 * --resume has settled it); CLI_USAGE with err on failure. */
int train_check_world(train_opts *o, int world, char *err, size_t errn);

/* Runs training after start-up; returns an exit code. */
int train_run(train_opts *o);

#endif
