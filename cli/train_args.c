/*
 * The train command's flags: the table (with defaults and help), parsing,
 * and the checks that make a bad command line one clear line and exit
 * code 2 instead of a failure halfway through a run.
 */
#include <errno.h>
#include <fnmatch.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "train.h"

static const char usage[] =
    "usage: ctrain train --model mlp|cnn|gpt (--epochs N | --steps K) [options]\n"
    "       mpirun -np R ctrain train ...   (data parallel over R ranks)\n\n"
    "Trains a model on Fashion-MNIST (mlp, cnn) or byte-level text (gpt: --data fortunes),\n"
    "prints progress, then the test loss and accuracy (gpt: validation loss, bits per byte),\n"
    "the peak memory per category and the strategy's step times.";

static const char epilog[] =
    "--epochs and --steps count from the start of training, so a resumed run stops at the\n"
    "same point a straight one would.  --batch is the global batch: it is split across ranks\n"
    "and, with --grad-accum N, into N micro-batches whose gradients add up to the same step.\n"
    "A checkpoint CKPT.safetensors holds the model (PyTorch nn.Sequential state_dict names);\n"
    "its optimizer state and training position go to CKPT.optim.safetensors, which --resume\n"
    "needs and --init ignores.  On --resume, the model, seed, batch, optimizer and its\n"
    "settings are the checkpoint's unless given again.\n"
    "--state-dict sharded makes CKPT a directory: every rank writes its share of the model\n"
    "(CKPT/model-stepN-R-of-W.safetensors) and of the optimizer state at once, then rank 0\n"
    "writes Hugging Face indexes CKPT/model.safetensors.index.json and optim.safetensors.index.json\n"
    "and removes the files of older saves.  --init, --resume, eval and inspect take the directory,\n"
    "with any number of ranks.\n";

/* The option table over o; returns the number of entries. */
#define MAXOPT CLI_TRAIN_MAXOPT

/* The train command's options into t (room for MAXOPT). */
static int table(train_opts *o, cli_opt *t)
{
    int n = 0;
#define OPT(nm, ty, dst, mv, hl)                              \
    do {                                                      \
        CT_ASSERT(n < MAXOPT);                                \
        t[n++] = (cli_opt){nm, ty, dst, mv, hl, 0};           \
    } while (0)
    OPT("--model", OPT_STR, &o->model, "NAME", "model to train: mlp, cnn or gpt");
    OPT("--hidden", OPT_STR, &o->hidden, "LIST", "layer sizes (mlp 256,128; cnn conv channels then fc: 16,32,128)");
    OPT("--kernel", OPT_INT, &o->kernel, "K", "cnn: conv kernel size, odd (3)");
    OPT("--dropout", OPT_NUM, &o->dropout, "P", "mlp: dropout after every hidden layer (0)");
    OPT("--batchnorm", OPT_FLAG, &o->batchnorm, NULL, "cnn: BatchNorm2d after each conv (the convs lose their bias)");
    OPT("--sync-batchnorm", OPT_FLAG, &o->sync_batchnorm, NULL, "batchnorm statistics over every rank's rows "
        "(SyncBatchNorm; ddp, zero1, zero2, fsdp)");
    CT_ASSERT(n + CLI_GPT_SHAPE_NOPTS <= MAXOPT);
    n += cli_gpt_shape_opts(&o->gpt, t + n);
    OPT("--data", OPT_STR, &o->data, "NAME", "data set: fashion-mnist (mlp, cnn) or fortunes (gpt: byte-level text)");
    OPT("--data-dir", OPT_STR, &o->data_dir, "DIR", "where the data files are (" CT_FASHION_MNIST_DIR "; "
        "fortunes: " CT_FORTUNES_DIR ", or any folder of text files)");
    OPT("--epochs", OPT_INT, &o->epochs, "N", "train until N epochs are done");
    OPT("--steps", OPT_INT, &o->steps, "K", "train until K optimizer steps are done");
    OPT("--batch", OPT_INT, &o->batch, "B", "global batch size, split across ranks (64)");
    OPT("--optim", OPT_STR, &o->optim, "NAME", "sgd or adamw (adamw)");
    OPT("--lr", OPT_NUM, &o->lr, "LR", "learning rate (adamw 0.001, sgd 0.01)");
    OPT("--weight-decay", OPT_NUM, &o->weight_decay, "WD", "weight decay (adamw 0.01, sgd 0)");
    OPT("--momentum", OPT_NUM, &o->momentum, "M", "sgd momentum (0)");
    OPT("--no-decay", OPT_STR, &o->no_decay, "RULES", "parameters trained without weight decay: ndim<K, name globs "
        "(*.bias), or none; comma-separated (gpt: ndim<2, nanoGPT's groups; others: none)");
    OPT("--betas", OPT_STR, &o->betas, "B1,B2", "adamw betas (gpt: 0.9,0.95 as nanoGPT; others: 0.9,0.999)");
    OPT("--schedule", OPT_STR, &o->schedule, "NAME", "learning rate schedule: constant or cosine (constant); "
        "gpipe or 1f1b: --pipe-schedule");
    OPT("--warmup", OPT_INT, &o->warmup, "N", "linear warm-up over the first N steps (0)");
    OPT("--clip", OPT_NUM, &o->clip, "MAXNORM", "clip the gradient's global norm to MAXNORM (off)");
    OPT("--clip-filter", OPT_STR, &o->clip_filter, "GLOBS", "--clip measures and scales only the parameters whose names match one of these comma-separated globs, such as '*.weight' (all)");
    OPT("--clip-norm", OPT_STR, &o->clip_norm, "TYPE", "norm type --clip measures: any p > 0 (sum |g|^p, to the 1/p) or inf (2)");
    OPT("--on-nonfinite", OPT_STR, &o->on_nonfinite, "WHAT", "a NaN/inf loss or gradient norm: stop, or skip the step (stop)");
    OPT("--seed", OPT_INT, &o->seed, "S", "seed of weights, shuffling and dropout (0)");
    OPT("--last-batch", OPT_STR, &o->last_batch, "WHAT", "an epoch's short last batch: drop, or keep (ranks it leaves without rows join the step) (drop)");
    OPT("--no-shuffle", OPT_FLAG, &o->no_shuffle, NULL, "visit the training set in file order");
    OPT("--init", OPT_STR, &o->init, "CKPT", "start from these weights (optimizer starts fresh)");
    OPT("--resume", OPT_STR, &o->resume, "CKPT", "continue exactly: weights, optimizer, step and data position "
        "(latest: the newest complete checkpoint --save wrote; a new run if none)");
    OPT("--save", OPT_STR, &o->save, "CKPT", "write the model to CKPT (and its optimizer state beside it)");
    OPT("--state-dict", OPT_STR, &o->state_dict, "FMT", "full (CKPT is a file), sharded (a directory: a file per rank, an index) or local (each rank's own pieces, no gathering) (full)");
    OPT("--save-every", OPT_INT, &o->save_every, "N", "also save every N steps (needs --save)");
    OPT("--keep-last", OPT_INT, &o->keep_last, "K", "save each checkpoint under its step (CKPT-stepN) and keep the K newest");
    OPT("--log-every", OPT_INT, &o->log_every, "N", "progress line every N steps (50; 0: none)");
    OPT("--eval-every", OPT_INT, &o->eval_every, "N", "evaluate (test set; gpt: validation split) every N steps too, "
        "into the progress lines and --metrics as val_loss (0: after the last step only)");
    OPT("--metrics", OPT_STR, &o->metrics, "FILE", "one JSON object per logged step (appended on --resume)");
    OPT("--strategy", OPT_STR, &o->strategy, "NAME", "none, ddp, zero1, zero2, fsdp, pipe or offload (ddp when run on several ranks)");
    OPT("--stages", OPT_INT, &o->stages, "P", "pipe: pipeline stages (--balance's length, else the ranks); N ranks make N/P replicas");
    OPT("--balance", OPT_STR, &o->balance, "LIST", "pipe, offload: the model's top-level layers per stage or slice, as 3,3,2 (by parameter count)");
    OPT("--chunks", OPT_INT, &o->chunks, "M", "pipe: micro-batches per step (4)");
    OPT("--pipe-schedule", OPT_STR, &o->pipe_schedule, "NAME", "pipe: gpipe or 1f1b (1f1b)");
    OPT("--pipe-checkpoint", OPT_STR, &o->pipe_checkpoint, "MODE", "pipe: recompute activations: always, except_last or never (except_last)");
    OPT("--slices", OPT_INT, &o->slices, "N", "offload: slices of the model; only those in use are in memory (4)");
    OPT("--offload-dir", OPT_STR, &o->offload_dir, "DIR", "offload, fsdp --offload: directory of the store's file, removed on any exit ($TMPDIR or /tmp)");
    OPT("--offload", OPT_STR, &o->fsdp_offload, "PARTS", "fsdp: this rank's shard parts kept on disk: optim (optimizer state), params (masters, gradients) or all");
    OPT("--checkpoint-activation", OPT_FLAG, &o->checkpoint_activation, NULL, "every strategy: each gpt block (each layer of an mlp or cnn) keeps only its input; recomputed in backward");
    OPT("--microbatches", OPT_INT, &o->microbatches, "M", "offload: micro-batches per step, each slice runs all (needs --checkpoint-activation) (1)");
    OPT("--max-resident-mb", OPT_INT, &o->max_resident_mb, "MIB", "offload, fsdp --offload: bound on resident param + grad + optim (none)");
    OPT("--grad-accum", OPT_INT, &o->grad_accum, "N", "split each step into N micro-batches (1)");
    OPT("--bucket-cap-mb", OPT_NUM, &o->bucket_cap_mb, "MB", "ddp: gradient bucket size (auto: 25 on one node, gradients / 16 across nodes)");
    OPT("--find-unused-parameters", OPT_FLAG, &o->find_unused, NULL, "ddp: allow parameters without a gradient");
    OPT("--grad-compress", OPT_STR, &o->grad_compress, "NAME", "gradients reduced as none (f32), bf16, f16 or powersgd:R (PowerSGD at rank R; ddp and zero1)");
    OPT("--local-sgd", OPT_STR, &o->local_sgd, "SUB[:START[:PERIOD]]", "ddp: post-local SGD: after START steps (100) gradients are reduced over SUB, none or node, and parameters averaged every PERIOD steps (4)");
    OPT("--mixed", OPT_STR, &o->mixed, "DTYPE", "mixed precision: bf16 products on f32 master weights (none)");
    OPT("--sharding", OPT_STR, &o->sharding, "MODE", "fsdp: full, grad-op, none or hybrid (full)");
    OPT("--wrap-min-params", OPT_INT, &o->wrap_min_params, "N", "fsdp: a module with N parameters becomes a unit (100000; gpt: each block)");
    OPT("--prefetch", OPT_STR, &o->prefetch, "WHEN", "fsdp: gather the next unit in backward pre, post or none (pre)");
    OPT("--limit-all-gathers", OPT_FLAG, &o->limit_all_gathers, NULL, "fsdp: at most two units unsharded besides the root");
    OPT("--strategy-opt", OPT_STR, &o->strategy_opt, "K=V,...", "strategy options (--strategy-opt help lists them)");
    OPT("--threads", OPT_INT, &o->threads, "N", "BLAS threads per rank (cores / ranks on the node)");
    OPT("--flush-denormal", OPT_FLAG, &o->flush_denormal, NULL, "treat subnormal floats as 0 (faster; as torch.set_flush_denormal)");
    OPT("--trace", OPT_STR, &o->trace, "FILE", "write a Chrome trace (FILE.rank<r>.json with several ranks)");
    OPT("--debug-collectives", OPT_FLAG, &o->debug_collectives, NULL, "check every collective's fingerprint across ranks (CTRAIN_DEBUG=collectives)");
    OPT("--verbose", OPT_FLAG, &o->verbose, NULL, "also print which rank owns which parameters (zero1, zero2)");
    OPT("--limit-train", OPT_INT, &o->limit_train, "N", NULL);
    OPT("--limit-test", OPT_INT, &o->limit_test, "N", NULL);
    OPT("--eval-batch", OPT_INT, &o->eval_batch, "B", NULL);
#undef OPT
    return n;
}


void train_help(FILE *f)
{
    train_opts o;
    cli_opt t[MAXOPT];
    int n = table(&o, t);
    cli_print_help(f, usage, t, n, epilog);
}

static int in_list(const char *v, const char *const *list)
{
    for (; *list; list++)
        if (!strcmp(v, *list)) return 1;
    return 0;
}

#define BAD(...) (snprintf(err, errn, "ctrain train: " __VA_ARGS__), CLI_USAGE)

int train_norm_type(const char *s, double *p)
{
    if (!strcmp(s, "inf")) {
        *p = INFINITY;
        return 0;
    }
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !isfinite(v) || !ct_norm_type_ok(v)) return -1;
    *p = v;
    return 0;
}

int train_parse(int argc, char **argv, train_opts *o, int *help, char *err, size_t errn)
{
    memset(o, 0, sizeof *o);
    o->data = NULL; /* fashion-mnist, or fortunes for the gpt (train_data_default) */
    o->gpt = cli_gpt_shape_default();
    o->batch = 64;
    o->optim = "adamw";
    o->schedule = "constant";
    o->log_every = 50;
    o->grad_accum = 1;
    o->bucket_cap_mb = 25;
    o->grad_compress = "none";
    o->mixed = "none";
    o->clip_norm = "2";
    o->on_nonfinite = "stop";
    o->last_batch = "drop";
    o->eval_batch = 500;
    o->state_dict = "full";
    o->sharding = "full";
    o->prefetch = "pre";
    o->wrap_min_params = CLI_FSDP_WRAP_MIN_PARAMS;
    cli_opt t[MAXOPT];
    int n = table(o, t), npos;
    const char *pos[1];
    int r = cli_parse("train", argc, argv, t, n, pos, 0, &npos, help, err, errn);
    if (r || *help) return r;
    for (int i = 0; i < n; i++)
        if (t[i].given > 1) return BAD("%s is given %d times; give it once", t[i].name, t[i].given);
    for (int i = 0; i < n && i < (int)sizeof o->given; i++) o->given[i] = (unsigned char)t[i].given;
#define GIVEN(nm) (cli_find(t, n, nm)->given != 0)
    o->has_model = GIVEN("--model");
    o->has_last_batch = GIVEN("--last-batch");
    o->has_hidden = GIVEN("--hidden");
    o->has_seed = GIVEN("--seed");
    o->has_batch = GIVEN("--batch");
    o->has_optim = GIVEN("--optim");
    o->has_lr = GIVEN("--lr");
    o->has_wd = GIVEN("--weight-decay");
    o->has_momentum = GIVEN("--momentum");
    o->has_no_decay = GIVEN("--no-decay");
    o->has_betas = GIVEN("--betas");
    o->has_strategy = GIVEN("--strategy");
    o->has_schedule = GIVEN("--schedule");
    o->has_warmup = GIVEN("--warmup");
    o->has_clip = GIVEN("--clip");
    o->has_accum = GIVEN("--grad-accum");
    o->has_kernel = GIVEN("--kernel");
    o->has_dropout = GIVEN("--dropout");
    o->has_clip_norm = GIVEN("--clip-norm");
    o->has_clip_filter = GIVEN("--clip-filter");
    o->has_bucket_cap = GIVEN("--bucket-cap-mb");
    int has_epochs = GIVEN("--epochs"), has_steps = GIVEN("--steps");
    o->has_wrap_min = GIVEN("--wrap-min-params");
    const char *fsdp_flag = GIVEN("--sharding") ? "--sharding" : GIVEN("--wrap-min-params") ? "--wrap-min-params"
                          : GIVEN("--prefetch") ? "--prefetch" : GIVEN("--limit-all-gathers") ? "--limit-all-gathers"
                          : NULL;
    o->has_gpt_shape = cli_gpt_shape_given(t, n);
#undef GIVEN

    /* --strategy-opt help only lists keys: nothing else is needed (cli_train answers it). */
    if (o->strategy_opt && !strcmp(o->strategy_opt, "help")) return 0;
    if (has_epochs && has_steps) return BAD("--epochs and --steps are both given; give one of them");
    if (!has_epochs && !has_steps) return BAD("say how long to train: give --epochs N or --steps K");
    if (has_epochs && o->epochs < 1) return BAD("--epochs %lld must be at least 1", (long long)o->epochs);
    if (has_steps && o->steps < 1) return BAD("--steps %lld must be at least 1", (long long)o->steps);
    if (o->init && o->resume)
        return BAD("--init and --resume are both given; --resume continues a run, --init only takes its weights");
    if (!o->has_model && !o->init && !o->resume) return BAD("--model is required; choose one of: %s", ct_model_list());
    ct_model_kind kind = CT_MODEL_MLP;
    if (o->has_model && ct_model_parse_kind(o->model, &kind) != CT_OK)
        return BAD("--model: %s", ct_last_error());
    if (o->has_kernel && (!o->has_model || kind != CT_MODEL_CNN))
        return BAD("--kernel applies to --model cnn only");
    if (o->batchnorm && o->has_model && kind != CT_MODEL_CNN)
        return BAD("--batchnorm applies to --model cnn only (the mlp has none; the gpt has LayerNorm)");
    if (o->has_hidden || o->has_kernel) {
        ct_model_config c = ct_model_config_default(kind);
        if (o->has_hidden && ct_model_config_parse_hidden(&c, o->hidden) != CT_OK)
            return BAD("--hidden: %s", ct_last_error());
        if (o->has_kernel) c.kernel = o->kernel < 0 || o->kernel > 99 ? 0 : (int)o->kernel;
        if (o->has_model && ct_model_config_validate(&c) != CT_OK)
            return BAD("%s: %s", o->has_kernel ? "--kernel" : "--hidden", ct_last_error());
    }
    if (o->has_dropout && !(o->dropout >= 0 && o->dropout < 1))
        return BAD("--dropout %g must be in [0, 1)", o->dropout);
    if (o->has_dropout && o->has_model && kind == CT_MODEL_CNN) return BAD("--dropout applies to --model mlp and gpt only");
    if (o->has_gpt_shape && (!o->has_model || kind != CT_MODEL_GPT))
        return BAD(CLI_GPT_SHAPE_FLAGS " apply to --model gpt only%s",
                   o->has_model ? "" : " (on --init/--resume the checkpoint's shape is used: drop them)");
    if (o->has_model && kind == CT_MODEL_GPT && cli_gpt_shape_check(&o->gpt) != CT_OK)
        return BAD("%s", ct_last_error());
    if (o->data && strcmp(o->data, "fashion-mnist") && strcmp(o->data, "fortunes"))
        return BAD("unknown data set '%s' for --data; this ctrain knows: fashion-mnist, fortunes", o->data);
    if (o->data && o->has_model && (kind == CT_MODEL_GPT) != !strcmp(o->data, "fortunes"))
        return BAD("--data %s does not suit --model %s: the gpt trains on text (fortunes), the mlp and cnn on "
                   "images (fashion-mnist)", o->data, o->model);
    if (o->batch < 1) return BAD("--batch %lld must be at least 1", (long long)o->batch);
    ct_optim_kind ok;
    if (ct_optim_parse(o->optim, &ok)) return BAD("unknown optimizer '%s' for --optim; choose sgd or adamw", o->optim);
    if (o->has_lr && o->lr < 0) return BAD("--lr %g must not be negative", o->lr);
    if (o->has_wd && o->weight_decay < 0) return BAD("--weight-decay %g must not be negative", o->weight_decay);
    if (o->has_momentum && o->momentum < 0) return BAD("--momentum %g must not be negative", o->momentum);
    if (o->has_momentum && ok != CT_OPT_SGD) return BAD("--momentum applies to --optim sgd only (adamw has betas)");
    if (o->has_betas) {
        char *end, *end2;
        o->beta1 = strtod(o->betas, &end);
        o->beta2 = *end == ',' ? strtod(end + 1, &end2) : -1;
        if (end == o->betas || *end != ',' || end2 == end + 1 || *end2 || !(o->beta1 >= 0 && o->beta1 < 1) ||
            !(o->beta2 >= 0 && o->beta2 < 1))
            return BAD("--betas %s is not two numbers in [0, 1) as B1,B2 (nanoGPT: 0.9,0.95)", o->betas);
        if (ok != CT_OPT_ADAMW) return BAD("--betas applies to --optim adamw only");
    }
    if (o->has_no_decay) {
        if (strlen(o->no_decay) >= NO_DECAY_MAX)
            return BAD("--no-decay is %zu bytes; at most %d: use globs", strlen(o->no_decay), NO_DECAY_MAX - 1);
        const char **nm;
        int nn;
        if (ct_optim_select(NULL, 0, o->no_decay, &nm, &nn) != CT_OK) return BAD("--no-decay: %s", ct_last_error());
        ct_free(nm);
    }
    ct_sched_kind sk;
    /* --schedule gpipe|1f1b is the pipeline's (the names differ from the learning rate's) */
    if (!strcmp(o->schedule, "gpipe") || !strcmp(o->schedule, "1f1b")) {
        if (o->pipe_schedule) return BAD("--schedule %s and --pipe-schedule %s both give the pipeline schedule; give one",
                                         o->schedule, o->pipe_schedule);
        o->pipe_schedule = o->schedule;
        o->schedule = "constant";
        o->has_schedule = 0;
    }
    if (ct_sched_parse(o->schedule, &sk)) return BAD("unknown schedule '%s' for --schedule; choose constant or cosine", o->schedule);
    if (o->warmup < 0) return BAD("--warmup %lld must not be negative", (long long)o->warmup);
    if (train_norm_type(o->clip_norm, &o->clip_p))
        return BAD("--clip-norm '%s' is not a norm type; give a number > 0 (2, 1, 3.5...) or inf", o->clip_norm);
    static const char *const last_batch[] = {"drop", "keep", NULL};
    if (!in_list(o->last_batch, last_batch)) return BAD("unknown --last-batch '%s'; choose drop or keep", o->last_batch);
    static const char *const nonfinite[] = {"stop", "skip", NULL};
    if (!in_list(o->on_nonfinite, nonfinite))
        return BAD("unknown --on-nonfinite '%s'; choose stop or skip", o->on_nonfinite);
    if (o->has_clip_filter && !o->has_clip && !o->resume)
        return BAD("--clip-filter '%s' chooses what --clip clips, but --clip is not given; add --clip MAXNORM",
                   o->clip_filter);
    if (o->has_clip_filter && !o->clip_filter[0])
        return BAD("--clip-filter is empty; give globs of parameter names, such as '*.weight' (ctrain inspect lists them)");
    if (o->clip < 0) return BAD("--clip %g must not be negative (leave it out for no clipping)", o->clip);
    if (o->seed < 0) return BAD("--seed %lld must not be negative", (long long)o->seed);
    if (o->save_every < 0) return BAD("--save-every %lld must not be negative", (long long)o->save_every);
    if (o->save_every && !o->save) return BAD("--save-every needs --save CKPT to say where");
    if (o->keep_last < 0) return BAD("--keep-last %lld must not be negative", (long long)o->keep_last);
    if (o->keep_last && !o->save) return BAD("--keep-last needs --save CKPT to say where");
    if (o->resume && !strcmp(o->resume, "latest") && !o->save)
        return BAD("--resume latest continues the checkpoints --save CKPT writes; give --save too");
    static const char *const formats[] = {"full", "sharded", "local", NULL};
    if (!in_list(o->state_dict, formats))
        return BAD("unknown --state-dict '%s'; choose full (one file), sharded or local (a directory)", o->state_dict);
    if (cli_find(t, n, "--state-dict")->given && !o->save) return BAD("--state-dict needs --save CKPT to say where");
    if (o->log_every < 0) return BAD("--log-every %lld must not be negative (0 turns progress off)", (long long)o->log_every);
    if (o->has_strategy) {
        /* ct_strategy_list() is "none, ddp": a name is in it when bounded by ", " or the ends. */
        const char *l = ct_strategy_list(), *p = l;
        size_t len = strlen(o->strategy);
        int found = 0;
        while (len && (p = strstr(p, o->strategy))) {
            if ((p == l || p[-1] == ' ') && (p[len] == 0 || p[len] == ',')) found = 1;
            p += len;
        }
        if (!found) return BAD("unknown strategy '%s' for --strategy; choose one of: %s", o->strategy, l);
    }
    if (fsdp_flag && (!o->has_strategy || strcmp(o->strategy, "fsdp")))
        return BAD("%s applies to --strategy fsdp only", fsdp_flag);
    static const char *const shardings[] = {"full", "grad-op", "none", "hybrid", NULL};
    if (!in_list(o->sharding, shardings))
        return BAD("unknown --sharding '%s'; choose full, grad-op, none or hybrid", o->sharding);
    static const char *const prefetches[] = {"pre", "post", "none", NULL};
    if (!in_list(o->prefetch, prefetches)) return BAD("unknown --prefetch '%s'; choose pre, post or none", o->prefetch);
    if (o->wrap_min_params < 0) return BAD("--wrap-min-params %lld must not be negative (0: the model is one unit)",
                                           (long long)o->wrap_min_params);
    int pipe = o->has_strategy && !strcmp(o->strategy, "pipe");
    const char *pflag = cli_find(t, n, "--stages")->given ? "--stages" : cli_find(t, n, "--chunks")->given ? "--chunks"
                      : o->balance ? "--balance" : o->pipe_schedule ? (cli_find(t, n, "--pipe-schedule")->given ? "--pipe-schedule" : "--schedule")
                      : o->pipe_checkpoint ? "--pipe-checkpoint" : NULL;
    int offload = o->has_strategy && !strcmp(o->strategy, "offload");
    if (pflag && !pipe && !(offload && !strcmp(pflag, "--balance"))) return BAD("%s applies to --strategy pipe only", pflag);
    const char *oflag = cli_find(t, n, "--slices")->given ? "--slices" : o->offload_dir ? "--offload-dir"
                      : cli_find(t, n, "--microbatches")->given ? "--microbatches"
                      : cli_find(t, n, "--max-resident-mb")->given ? "--max-resident-mb" : NULL;
    int fsdp_off = o->has_strategy && !strcmp(o->strategy, "fsdp") && o->fsdp_offload;
    static const char *const offparts[] = {"optim", "params", "all", NULL};
    if (o->fsdp_offload && !(o->has_strategy && !strcmp(o->strategy, "fsdp")))
        return BAD("--offload applies to --strategy fsdp only (--strategy offload streams slices of the model instead)");
    if (o->fsdp_offload && !in_list(o->fsdp_offload, offparts))
        return BAD("unknown --offload '%s'; choose optim, params or all", o->fsdp_offload);
    if (fsdp_off && cli_find(t, n, "--max-resident-mb")->given && o->max_resident_mb < 1)
        return BAD("--max-resident-mb %lld must be at least 1 (leave it out for no bound)", (long long)o->max_resident_mb);
    int ofsdp = !strcmp(oflag ? oflag : "", "--offload-dir") || !strcmp(oflag ? oflag : "", "--max-resident-mb");
    if (oflag && !offload && !(fsdp_off && ofsdp))
        return BAD("%s applies to --strategy offload only%s", oflag, ofsdp ? " (and to fsdp with --offload)" : "");
    if (offload && cli_find(t, n, "--slices")->given && o->slices < 1) return BAD("--slices %lld must be at least 1", (long long)o->slices);
    if (offload && cli_find(t, n, "--microbatches")->given && o->microbatches < 1)
        return BAD("--microbatches %lld must be at least 1", (long long)o->microbatches);
    if (offload && cli_find(t, n, "--max-resident-mb")->given && o->max_resident_mb < 1)
        return BAD("--max-resident-mb %lld must be at least 1 (leave it out for no bound)", (long long)o->max_resident_mb);
    if (offload && o->microbatches > 1 && !o->checkpoint_activation)
        return BAD("--microbatches %lld needs --checkpoint-activation (each micro-batch's activations would stay for "
                   "every slice otherwise, as fairscale refuses too)", (long long)o->microbatches);
    if (o->offload_dir && (strchr(o->offload_dir, ',') || strlen(o->offload_dir) > 200))
        return BAD("--offload-dir '%s': use a path without commas, of at most 200 characters", o->offload_dir);
    if (offload && o->has_accum && o->grad_accum != 1)
        return BAD("--grad-accum does not apply to --strategy offload: its micro-batches are --microbatches");
    if (pipe && cli_find(t, n, "--stages")->given && o->stages < 1) return BAD("--stages %lld must be at least 1", (long long)o->stages);
    if (pipe && cli_find(t, n, "--chunks")->given && (o->chunks < 1 || o->chunks > 16000))
        return BAD("--chunks %lld must be from 1 to 16000 (number of chunks must be a positive integer)", (long long)o->chunks);
    static const char *const psched[] = {"gpipe", "1f1b", NULL}, *const pck[] = {"always", "except_last", "never", NULL};
    if (o->pipe_schedule && !in_list(o->pipe_schedule, psched))
        return BAD("unknown --pipe-schedule '%s'; choose gpipe or 1f1b", o->pipe_schedule);
    if (o->pipe_checkpoint && !in_list(o->pipe_checkpoint, pck))
        return BAD("unknown --pipe-checkpoint '%s'; choose always, except_last or never", o->pipe_checkpoint);
    if (o->balance) {
        const char *b = o->balance;
        if (!*b || strlen(b) > 200 || strspn(b, "0123456789,") != strlen(b) || strstr(b, ",,") || *b == ',' || b[strlen(b) - 1] == ',')
            return BAD("--balance '%s': give the number of layers of each stage as positive integers, like 3,3,2", b);
    }
    if (pipe && o->has_accum && o->grad_accum != 1)
        return BAD("--grad-accum does not apply to --strategy pipe: its micro-batches are --chunks");
    if (o->grad_accum < 1) return BAD("--grad-accum %lld must be at least 1", (long long)o->grad_accum);
    /* Upper bounds, so no count overflows what it is multiplied into or cast to. */
    if (o->grad_accum > (1 << 30)) return BAD("--grad-accum %lld is too large (at most %d)", (long long)o->grad_accum, 1 << 30);
    if (o->threads > 4096) return BAD("--threads %lld is too large (at most 4096)", (long long)o->threads);
    if (o->bucket_cap_mb > (1 << 20)) return BAD("--bucket-cap-mb %g is too large (at most %d)", o->bucket_cap_mb, 1 << 20);
    if (o->eval_batch > (1 << 30)) return BAD("the evaluation batch %lld is too large", (long long)o->eval_batch);
    if (!(o->bucket_cap_mb > 0)) return BAD("--bucket-cap-mb %g must be positive", o->bucket_cap_mb);
    static const char *const comp[] = {"none", "bf16", "f16", NULL};
    if (!in_list(o->grad_compress, comp) && train_powersgd_rank(o) <= 0)
        return BAD("unknown --grad-compress '%s'; choose none, bf16, f16 or powersgd:R (R a rank from 1, such as powersgd:4)",
                   o->grad_compress);
    char lsgd[128];
    if (train_local_sgd_opts(o, lsgd, sizeof lsgd) < 0)
        return BAD("--local-sgd '%s' is malformed; give none or node (the ranks gradients are reduced over after the "
                   "start), then optionally :START (steps of plain DDP first, 100) and :PERIOD (steps between "
                   "averagings, from 1; 4), such as none:100:4", o->local_sgd);
    static const char *const mixed[] = {"none", "bf16", NULL};
    if (!strcmp(o->mixed, "f16") || !strcmp(o->mixed, "fp16"))
        return BAD("--mixed %s: products in f16 need oneDNN's f16 matmul, which oneDNN 2.6 only has on CPUs with "
                   "AVX512-FP16; use --mixed bf16 (the same bytes; gradients can still travel in f16 with "
                   "--grad-compress f16)", o->mixed);
    if (!in_list(o->mixed, mixed)) return BAD("unknown --mixed '%s'; choose none or bf16", o->mixed);
    if (o->threads < 0) return BAD("--threads %lld must not be negative (0: automatic)", (long long)o->threads);
    if (o->limit_train < 0 || o->limit_test < 0) return BAD("--limit-train and --limit-test must not be negative");
    if (o->eval_every < 0) return BAD("--eval-every %lld must not be negative", (long long)o->eval_every);
    if (o->eval_batch < 1) return BAD("--eval-batch %lld must be at least 1", (long long)o->eval_batch);
    return 0;
}

int train_powersgd_rank(const train_opts *o) { return cli_powersgd_rank(o->grad_compress); }

int train_clip_selects(const ct_param *p, void *ud)
{
    const char *globs = ud;
    char one[256];
    for (const char *c = globs; *c;) {
        const char *comma = strchr(c, ',');
        size_t w = comma ? (size_t)(comma - c) : strlen(c);
        snprintf(one, sizeof one, "%.*s", (int)(w < sizeof one ? w : sizeof one - 1), c);
        if (w && fnmatch(one, p->name, 0) == 0) return 1;
        c += w + (comma != NULL);
    }
    return 0;
}

int train_local_sgd_opts(const train_opts *o, char *buf, size_t n)
{
    buf[0] = 0;
    if (!o->local_sgd) return 0;
    const char *v = o->local_sgd, *colon = strchr(v, ':');
    size_t w = colon ? (size_t)(colon - v) : strlen(v);
    if (!((w == 4 && !strncmp(v, "none", 4)) || (w == 4 && !strncmp(v, "node", 4)))) return -1;
    long long start = 100, period = 4;
    if (colon) {
        char *end;
        errno = 0;
        start = strtoll(colon + 1, &end, 10);
        if (end == colon + 1 || start < 0 || start > (1LL << 40) || errno || (*end && *end != ':')) return -1;
        if (*end) {
            const char *p = end + 1;
            period = strtoll(p, &end, 10);
            if (end == p || *end || period < 1 || period > (1 << 30) || errno) return -1;
        }
    }
    snprintf(buf, n, ",local_sgd=%.4s,local_sgd_start=%lld,average_period=%lld", v, start, period);
    return 0;
}

int train_check_world(train_opts *o, int world, char *err, size_t errn)
{
    if (!o->has_strategy) o->strategy = world > 1 ? "ddp" : "none";
    if (train_powersgd_rank(o) > 0 && strcmp(o->strategy, "ddp") && strcmp(o->strategy, "zero1"))
        return BAD("--grad-compress %s applies to --strategy ddp and zero1 (PowerSGD compresses their gradient "
                   "buckets), not %s; use bf16 or f16 with %s", o->grad_compress, o->strategy, o->strategy);
    if (o->clip_filter && o->fsdp_offload)
        return BAD("--clip-filter with fsdp --offload %s: the offloaded shards keep their norm terms and clip factors "
                   "per flat, not per parameter; leave --clip-filter out (clip every parameter) or --offload (keep the "
                   "shards in memory)", o->fsdp_offload);
    if (o->local_sgd && strcmp(o->strategy, "ddp"))
        return BAD("--local-sgd applies to --strategy ddp (post-local SGD lets its replicas train apart between "
                   "averagings), not %s; use --strategy ddp or leave --local-sgd out", o->strategy);
    if (o->local_sgd && strcmp(o->grad_compress, "none"))
        return BAD("--local-sgd with --grad-compress %s: post-local SGD is its own gradient reduce, in f32; give "
                   "one of them", o->grad_compress);
    if (!strcmp(o->strategy, "none") && world > 1)
        return BAD("--strategy none runs every rank alone, but this job has %d ranks; use --strategy ddp, or "
                   "run without mpirun", world);
    /* Join sums rows over the strategy's group; a pipeline's stages share one slice. */
    if (!strcmp(o->last_batch, "keep") && !strcmp(o->strategy, "pipe"))
        return BAD("--last-batch keep is not available with --strategy pipe yet; leave it out (drop)");
    return 0;
}

/* Options that may differ per rank: they change neither the numbers nor
 * the collectives (threads, per-rank output, where a node keeps its data:
 * the data itself is compared once loaded).  Every other option of the
 * table is compared across ranks before training. */
static const char *const per_rank[] = {"--threads", "--trace", "--metrics", "--verbose", "--data-dir", NULL};

ct_status train_agree(train_opts *o, ct_group *g)
{
    cli_opt t[MAXOPT];
    int n = table(o, t);
    for (int i = 0; i < n && i < (int)sizeof o->given; i++) t[i].given = o->given[i];
    return cli_agree_options(g, "the command line", t, n, per_rank);
}
