/*
 * Internals of the ctrain program, shared by its files: exit codes, the
 * option parser (args.c) and the gpt's shape flags (gpt_flags.c), printing
 * from rank 0 only (output.c), data loading (data.c), evaluation on a test
 * set (evaluate.c), checkpoint metadata (checkpoint.c; saving and loading
 * are the library's, checkpoint.h), progress display (progress.c), and the commands (train.c,
 * eval.c, inspect.c, estimate.c, sample.c).  Like any user of ctrain,
 * the program sees only the public headers.
 */
#ifndef CTRAIN_CLI_H
#define CTRAIN_CLI_H

/* fsdp's auto-wrap size on the command line (train and estimate): a module
 * holding this many parameters outside units below it becomes a unit. */
#define CLI_FSDP_WRAP_MIN_PARAMS 100000

/* fsdp's units on the command line, as a strategy option into buf: the
 * gpt's blocks (its natural units: each transformer block, the embeddings
 * and head in the root), or the size policy (other models, or when
 * --wrap-min-params is given). */
#define CLI_FSDP_WRAP(buf, n, is_gpt, min_params, given)                                               \
    ((is_gpt) && !(given) ? snprintf(buf, n, "wrap_kinds=block")                                       \
                          : snprintf(buf, n, "wrap_min_params=%lld", (long long)(min_params)))

#include <stdio.h>

#include <ctrain/ctrain.h>

/* Exit codes: usage errors (bad flags) are 2, failures while running are 1. */
enum { CLI_OK = 0, CLI_RUNTIME = 1, CLI_USAGE = 2 };

/* ---- options (args.c) -------------------------------------------------- */

typedef enum { OPT_FLAG, OPT_STR, OPT_INT, OPT_NUM } cli_opt_type;

/* One --option.  dest is int* (FLAG: set to 1), const char ** (STR),
 * int64_t * (INT) or double * (NUM).  given counts occurrences. */
typedef struct {
    const char *name;  /* "--epochs" */
    cli_opt_type type;
    void *dest;
    const char *metavar; /* "N" for the help text */
    const char *help;    /* NULL: hidden from --help */
    int given;
} cli_opt;

/* Parses argv[0..argc) (the words after the command) against opts: both
 * "--name value" and "--name=value".  Words not starting with "--" go to
 * pos (room for maxpos).  A "--help" or "-h" sets *help.  On a bad word
 * returns CLI_USAGE with one line in err naming the cause and the fix. */
int cli_parse(const char *cmd, int argc, char **argv, cli_opt *opts, int nopts, const char **pos,
              int maxpos, int *npos, int *help, char *err, size_t errn);
/* Collective over g: every option of opts (by its parsed value) must be the
 * same on every rank, except those named in per_rank (NULL-terminated);
 * CT_EINVAL on every rank naming the options and ranks that differ. */
ct_status cli_agree_options(ct_group *g, const char *what, const cli_opt *opts, int n, const char *const *per_rank);
/* Prints usage then every listed option with its help. */
void cli_print_help(FILE *f, const char *usage, const cli_opt *opts, int nopts, const char *epilog);
/* The option called name (for checking .given), or NULL. */
cli_opt *cli_find(cli_opt *opts, int nopts, const char *name);

/* ---- the gpt's shape flags (gpt_flags.c): train and estimate ---------- */

/* --layers, --heads, --dim, --context and --vocab, as parsed. */
typedef struct {
    int64_t layers, heads, dim, context, vocab;
} cli_gpt_shape;

#define CLI_GPT_SHAPE_NOPTS 5
/* The flags' names, for messages that name them all. */
#define CLI_GPT_SHAPE_FLAGS "--layers, --heads, --dim, --context and --vocab"

/* The default gpt's shape (ct_model_config_default). */
cli_gpt_shape cli_gpt_shape_default(void);
/* The flags' table entries over s into t (room for CLI_GPT_SHAPE_NOPTS); returns their number. */
int cli_gpt_shape_opts(cli_gpt_shape *s, cli_opt *t);
/* 1 if any of the flags was given in t (parsed by cli_parse). */
int cli_gpt_shape_given(cli_opt *t, int n);
/* Sets cfg's gpt shape from s (ct_model_config_gpt; checks nothing). */
void cli_gpt_shape_apply(const cli_gpt_shape *s, ct_model_config *cfg);
/* CT_OK when s makes a valid gpt, else CT_EINVAL with the cause in ct_last_error. */
ct_status cli_gpt_shape_check(const cli_gpt_shape *s);

/* ---- output (output.c) ------------------------------------------------- */

/* This process's rank and the world size (0 and 1 before start-up). */
extern int cli_rank, cli_world;
/* Rank the launcher gave this process before MPI starts (0 without one). */
int cli_launcher_rank(void);
/* printf to stdout / one error line "ctrain CMD: msg" to stderr, from rank 0 only. */
void cli_out(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void cli_err(const char *cmd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Human-readable bytes ("12.3 MiB") into buf. */
const char *cli_bytes(double bytes, char *buf, size_t n);
/* s with control characters and DEL written as \xHH (and backslashes
 * doubled) into buf, so text from a file cannot drive the terminal. */
const char *cli_printable(const char *s, char *buf, size_t n);
/* R of --grad-compress powersgd:R (train and estimate); 0 for the other
 * values; -1 for a malformed rank. */
int cli_powersgd_rank(const char *grad_compress);
/* "1:02:03" or "2:03" into buf. */
const char *cli_hms(double seconds, char *buf, size_t n);
/* "mlp [256,128]" into buf. */
const char *cli_config_str(const ct_model_config *cfg, char *buf, size_t n);
/* BLAS threads per rank when --threads is not given: the node's cores over
 * the ranks on the node, at least 1. */
int cli_default_threads(ct_group *g);
/* Sums n doubles over the ranks of g exactly (gathered and added in rank
 * order, so every rank gets the same bits whatever the world size). */
ct_status cli_sum_f64(ct_group *g, double *v, int n);

/* ---- data (data.c) ----------------------------------------------------- */

/* Loads the named data set's train (train != 0) or test split; limit > 0
 * keeps only the first limit samples.  The message names the fix. */
ct_status cli_load_data(const char *name, const char *dir, int train, int64_t limit, ct_dataset *out);
/* Checks that one sample of ds is what the model takes. */
ct_status cli_check_input(const ct_model_config *cfg, const ct_dataset *ds);
/* Gathers samples idx[0..n) as a batch shaped for the model: *x [n, in...],
 * *y i32 [n]; the caller releases both. */
ct_status cli_batch(const ct_dataset *ds, const ct_model_config *cfg, const int64_t *idx, int64_t n,
                    ct_tensor **x, ct_tensor **y);

/* The data set a model trains on when --data is not given: fortunes for
 * the gpt, fashion-mnist otherwise. */
const char *cli_data_default(const ct_model_config *cfg);
/* CT_EINVAL naming the fix when data (a --data name) does not suit cfg:
 * the gpt reads text (fortunes), the mlp and cnn images (fashion-mnist). */
ct_status cli_check_data_kind(const ct_model_config *cfg, const char *data);
/* Loads the text corpus --data fortunes (dir NULL: CT_FORTUNES_DIR, or any
 * folder of text files) and checks that it fits the gpt's context and
 * vocabulary. */
ct_status cli_load_text(const ct_model_config *cfg, const char *dir, ct_text *out);

/* ---- evaluation (evaluate.c) ------------------------------------------- */

typedef struct {
    double loss;      /* mean cross-entropy over the set */
    int64_t correct;
    int64_t n;
    int64_t *confusion; /* [classes*classes] row = true class, or NULL if not asked for */
} cli_eval;

/* Evaluates model (inference, no records) on ds, each rank of g taking a
 * contiguous share, in batches of batch, summed over ranks.  With
 * confusion != NULL it receives the classes x classes counts. */
ct_status cli_evaluate(ct_strategy *s, ct_module *model, const ct_model_config *cfg, const ct_dataset *ds,
                       int64_t batch, ct_group *g, cli_eval *out, int64_t *confusion);
/* The gpt on the validation split of tx: its consecutive windows of
 * context + 1 bytes (ct_text_val_batch), each rank a contiguous share (s
 * != NULL: its data slice, predicting through it), in batches of batch
 * windows.  out->loss is the mean cross-entropy per token (nats),
 * out->correct the tokens whose argmax is the next byte, out->n the
 * tokens.  limit > 0 takes only the first limit windows (quick runs). */
ct_status cli_evaluate_text(ct_strategy *s, ct_module *model, const ct_model_config *cfg, const ct_text *tx,
                            int64_t batch, int64_t limit, ct_group *g, cli_eval *out);
/* "loss 1.2345 nats/byte (1.7810 bits per byte), next-byte accuracy 62.1%; unigram baseline 3.3200
 * (-62.8%)" into buf. */
const char *cli_eval_text_str(const cli_eval *e, double unigram, char *buf, size_t n);
/* "loss 0.3312  accuracy 88.41% (8841/10000)" into buf. */
const char *cli_eval_str(const cli_eval *e, char *buf, size_t n);

/* ---- checkpoints: the library's (checkpoint.h); metadata (checkpoint.c), outputs (paths.c) */

/* Reads key of m as an integer into *v; CT_EFORMAT naming file and key. */
ct_status cli_meta_int(const ct_meta *m, const char *file, const char *key, int64_t *v);
/* CT_OK when the file path (is_dir: the directory path, made later if
 * missing) can be written: its directory exists and takes a new file.
 * The message names flag and the fix. */
ct_status cli_check_output(const char *flag, const char *path, int is_dir);

/* ---- progress (progress.c) --------------------------------------------- */

typedef struct {
    int tty;          /* stderr is a terminal: live bar with \r */
    int bar_shown;
    double t_start, t_last_draw;
    int64_t total_steps, steps_per_epoch, epochs;
    FILE *metrics;    /* one JSON object per logged step, or NULL */
} cli_progress;

/* Starts the display (rank 0 only draws); metrics_path NULL for none,
 * append != 0 to continue an existing file. */
ct_status cli_progress_init(cli_progress *p, int64_t total_steps, int64_t steps_per_epoch,
                            const char *metrics_path, int append);
/* Rank 0, on --resume: drops the records of path with a step beyond step,
 * so the appended run does not repeat them (no file: nothing to do). */
ct_status cli_metrics_rewind(const char *path, int64_t step);
/* Redraws the live bar (terminal only, at most 10 times a second). */
void cli_progress_tick(cli_progress *p, int64_t step, int64_t epoch, double last_loss);
/* One permanent line (and a metrics record) for step. */
void cli_progress_log(cli_progress *p, int64_t step, int64_t epoch, double loss, double lr,
                      double samples_per_s);
/* An evaluation at step: a progress line (with --log-every) and a metrics
 * record {"event":"eval","step":..,"epoch":..,"val_loss":..} (scripts/plot draws it). */
void cli_progress_eval(cli_progress *p, int64_t step, double val_loss);
/* Clears the bar (before a report is printed). */
void cli_progress_clear(cli_progress *p);
/* Clears the bar and closes the metrics file. */
void cli_progress_finish(cli_progress *p);
/* Rank 0: the last line of --metrics, {"event":"summary","step_ms":...,
 * "memory":[one ct_mem_report_json object per rank]}. */
/* traffic: every rank's bytes sent and received and its communication
 * thread's CPU ms per step (3 per rank), or NULL. */
ct_status cli_progress_summary(cli_progress *p, double step_ms, const ct_mem_report *mem, const double *traffic,
                               int nranks);

/* ---- commands ---------------------------------------------------------- */

int cli_train(int argc, char **argv);
int cli_eval_cmd(int argc, char **argv);
int cli_inspect(int argc, char **argv);
int cli_estimate(int argc, char **argv);
int cli_sample(int argc, char **argv);

#endif
