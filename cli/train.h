/* The train command's options, shared by its parser (train_args.c) and its loop (train.c). */
#ifndef CTRAIN_CLI_TRAIN_H
#define CTRAIN_CLI_TRAIN_H

#include "cli.h"

/* Room for the train command's options (train_args.c's table asserts it). */
#define CLI_TRAIN_MAXOPT 80

/* Longest --no-decay rule list (rules are short globs; a checkpoint keeps it as metadata). */
#define NO_DECAY_MAX 4096

typedef struct {
    const char *model, *hidden, *data, *data_dir;
    int64_t epochs, steps, batch, kernel;
    const char *optim, *schedule;
    double lr, weight_decay, momentum, clip, dropout;
    double clip_p; /* --clip-norm parsed: a p > 0 or INFINITY */
    /* parameter groups: rules of the no-decay group (ct_optim_select's), adamw's betas
     * (NULL: the model's default, the gpt's nanoGPT's) */
    const char *no_decay, *betas;
    double beta1, beta2;
    int64_t warmup, seed;
    int no_shuffle;
    int batchnorm, sync_batchnorm; /* cnn: BatchNorm2d after each conv; its statistics over every rank */
    const char *init, *resume, *save, *state_dict, *metrics, *trace;
    int64_t save_every, log_every, keep_last, eval_every;
    const char *strategy, *grad_compress, *strategy_opt, *mixed, *clip_norm, *on_nonfinite, *last_batch;
    const char *local_sgd; /* ddp: --local-sgd none|node[:START[:PERIOD]] */
    const char *clip_filter; /* --clip-filter: comma-separated globs of the parameters --clip takes (NULL: all) */
    int has_clip_filter;
    int64_t grad_accum, threads;
    double bucket_cap_mb;
    int find_unused, flush_denormal, verbose, debug_collectives;
    const char *sharding, *prefetch; /* fsdp */
    int64_t wrap_min_params;
    int limit_all_gathers, has_wrap_min;
    int64_t limit_train, limit_test, eval_batch; /* unlisted: small runs for tests */
    /* pipe: stages, children per stage, micro-batches, schedule, checkpoint mode */
    int64_t stages, chunks;
    const char *balance, *pipe_schedule, *pipe_checkpoint;
    cli_gpt_shape gpt;
    int has_gpt_shape; /* any of gpt's flags given */
    /* offload: slices, micro-batches, the store's directory, the resident budget */
    int64_t slices, microbatches, max_resident_mb;
    const char *offload_dir;
    const char *fsdp_offload;  /* --offload: fsdp's offloaded shard parts (optim, params, all) */
    int checkpoint_activation;
    /* which flags the user gave (resume takes the others from the checkpoint) */
    int has_model, has_hidden, has_seed, has_batch, has_optim, has_lr, has_wd, has_momentum, has_strategy;
    unsigned char given[CLI_TRAIN_MAXOPT]; /* how often each option of the table was given (compared across ranks) */
    int has_last_batch;
    int has_no_decay, has_betas;
    int has_schedule, has_warmup, has_clip, has_accum, has_kernel, has_dropout, has_clip_norm, has_bucket_cap;
} train_opts;

/* Parses and checks the train command's flags (what needs no MPI).  Returns
 * 0, or CLI_USAGE with one line in err; *help set for --help (help text
 * printed to stdout by the caller through train_help). */
int train_parse(int argc, char **argv, train_opts *o, int *help, char *err, size_t errn);
/* --clip-norm's value ("inf" or a number > 0) into *p; -1 when it is neither. */
int train_norm_type(const char *s, double *p);
void train_help(FILE *f);
/* Checks that need the world size (the strategy; the batch is checked once
 * --resume has settled it); CLI_USAGE with err on failure. */
int train_check_world(train_opts *o, int world, char *err, size_t errn);
/* R of --grad-compress powersgd:R; 0 for none, bf16 and f16; -1 for a malformed rank. */
int train_powersgd_rank(const train_opts *o);
/* 1 if parameter p's name matches one of the comma-separated globs ud
 * (--clip-filter; a ct_param_filter_fn). */
int train_clip_selects(const ct_param *p, void *ud);
/* --local-sgd's strategy options (",local_sgd=none,local_sgd_start=S,average_period=P") into buf (n
 * bytes): "" without the flag; -1 (buf "") when the value is malformed. */
int train_local_sgd_opts(const train_opts *o, char *buf, size_t n);

/* Collective: every setting of o that changes the numbers or the
 * collectives is the same on every rank of g (train_args.c lists those
 * that may differ); CT_EINVAL naming the flags and ranks otherwise. */
ct_status train_agree(train_opts *o, ct_group *g);

/* ---- guards (train_guard.c) --------------------------------------------- */

/* CT_EFORMAT naming side when a setting the optimizer file supplied is out
 * of its flag's range (grad_accum 0, a negative step, ...). */
ct_status train_check_saved(const train_opts *o, int64_t step, int64_t epoch, int64_t pos, const char *side);
/* CT_EINVAL naming the model checkpoint when --resume names an optimizer file. */
ct_status train_check_resume_name(const char *resume);
/* Collective: --resume latest becomes the newest complete checkpoint of
 * --save's series (its path in buf), or NULL for a new run (which needs
 * --model: else *usage set and CT_EINVAL). */
ct_status train_resolve_latest(ct_group *g, train_opts *o, char *buf, size_t n, int *usage);
/* This rank's --trace file: FILE, or FILE.rank<r>.<ext> with several ranks. */
void train_trace_path(const char *trace, int rank, int world, char *buf, size_t n);
/* Every output this rank writes (--save, --metrics, --trace) can be written. */
ct_status train_check_outputs(const train_opts *o, int rank, int world, int sharded);
/* Collective: the run as loaded (model, data sizes, pos = {start step,
 * epoch, position, last step}, seed, batch, lr, optimizer, grad_accum) is
 * the same on every rank. */
ct_status train_agree_loaded(ct_group *g, const train_opts *o, const ct_model_config *cfg, int64_t train_n,
                             int64_t test_n, const int64_t pos[4], uint64_t seed, double lr, const char *optim);
/* Collective: a non-finite loss_sum (any rank) or norm at step: CT_EINVAL
 * naming it, or with mode "skip" *skip set and *skipped counted.  CT_ECOMM
 * if the agreement itself failed. */
ct_status train_nonfinite(ct_group *g, const char *mode, int64_t step, double loss_sum, float norm, int *skip,
                          int64_t *skipped);

/* Runs training after start-up; returns an exit code. */
int train_run(train_opts *o);

#endif
