/*
 * `ctrain train`: the training loop, through the strategy interface only,
 * so every strategy is a flag.  Set-up failures are agreed over the world
 * (ct_group_check) so every rank exits the same way with rank 0 saying why;
 * a failure inside the loop stops the job (ct_comm_abort) rather than leave
 * the other ranks waiting in a collective.
 *
 * One step: global batch `pos` of the epoch's order is cut across the ranks
 * (contiguous slices in rank order) and each rank hands its slice to
 * ct_strategy_train_step, which cuts it into --grad-accum micro-batches and
 * scales each loss gradient so the result is the global batch's mean
 * gradient however unevenly the samples fall.  Dropout keys on a row's
 * place in the global batch, so any number of ranks draws the masks one
 * process would.  Everything a step depends on is a function of (seed,
 * step, epoch, position) and the saved optimizer state, which is what makes
 * --resume continue bit for bit.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#if defined(__SSE__)
#include <xmmintrin.h>
#endif

#include "train.h"

typedef struct {
    train_opts *o;
    ct_group *g;
    int rank, world;
    int drank, dsize;      /* this rank's slice of each batch, of dsize (ct_strategy_data_rank) */
    int64_t nparams;       /* the whole model's, before a pipeline keeps only its stage */
    ct_model_config cfg;
    uint64_t seed;
    int shuffle;
    ct_optim_kind okind;
    ct_dataset train, test;
    ct_safetensors *ck, *side; /* --init / --resume files */
    ct_module *model;
    ct_optim *opt;
    ct_strategy *s;
    ct_sampler sampler;
    ct_lr_schedule sched;
    int64_t step, epoch, pos, total, spe, start_step;
    double last_loss;      /* mean loss over the last logged window */
    ct_step_stats sum;     /* strategy timings summed over steps */
    int64_t nstats;
    double *step_s;        /* wall time of each step of this run */
    int64_t nstep_s;
    ct_mem_report *mem;    /* every rank's, gathered after the loop */
    int usage;             /* the failure is the command line's (exit 2) */
} trainer;

/* ---- set-up -------------------------------------------------------------- */

/* The model's config: the flags', or the checkpoint's when --model is not given. */
static ct_status choose_config(trainer *t)
{
    train_opts *o = t->o;
    const char *file = o->resume ? o->resume : o->init;
    if (!o->has_model) {
        ct_meta m;
        CT_TRY(cli_file_meta(t->ck, &m));
        if (ct_model_config_from_meta(&m, &t->cfg) != CT_OK) {
            char why[512];
            snprintf(why, sizeof why, "%s", ct_last_error());
            return ct_error(CT_EFORMAT, "%s: %s; pass --model (and --hidden) to say what it holds", file, why);
        }
        if (o->has_hidden) {
            char mine[256];
            ct_model_config c = t->cfg;
            CT_TRY(ct_model_config_parse_hidden(&c, o->hidden));
            if (strcmp(ct_model_config_hidden_str(&c, mine, sizeof mine), ct_meta_get(&m, "ctrain.hidden"))) {
                t->usage = 1;
                return ct_error(CT_EINVAL, "--hidden %s differs from the checkpoint's %s (%s); drop --hidden",
                                o->hidden, ct_meta_get(&m, "ctrain.hidden"), file);
            }
        }
        if (o->has_dropout && (float)o->dropout != t->cfg.dropout) {
            t->usage = 1;
            return ct_error(CT_EINVAL, "--dropout %g differs from the checkpoint's %g (%s); drop --dropout",
                            o->dropout, (double)t->cfg.dropout, file);
        }
        return CT_OK;
    }
    ct_model_kind kind;
    CT_TRY(ct_model_parse_kind(o->model, &kind));
    t->cfg = ct_model_config_default(kind);
    if (o->has_hidden) CT_TRY(ct_model_config_parse_hidden(&t->cfg, o->hidden));
    if (o->has_kernel) t->cfg.kernel = (int)o->kernel;
    if (o->has_dropout) t->cfg.dropout = (float)o->dropout;
    return ct_model_config_validate(&t->cfg);
}

/* A flag the user gave must agree with the value the run was saved with. */
static ct_status agree(trainer *t, const ct_meta *m, const char *key, const char *flag, int given,
                       int64_t *val)
{
    int64_t saved;
    CT_TRY(cli_meta_int(m, t->o->resume, key, &saved));
    if (given && *val != saved) {
        t->usage = 1;
        if (!strcmp(flag, "--no-shuffle"))
            return ct_error(CT_EINVAL, "--no-shuffle: %s was trained with shuffling on; drop --no-shuffle to "
                            "continue it exactly", t->o->resume);
        return ct_error(CT_EINVAL, "%s %lld differs from the %lld that %s was trained with; drop %s to continue "
                        "that run exactly (or use --init to start a new run from its weights)",
                        flag, (long long)*val, (long long)saved, t->o->resume, flag);
    }
    *val = saved;
    return CT_OK;
}

/* A setting the user did not give on --resume comes from the saved run. */
static ct_status saved_num(const ct_meta *m, const char *file, const char *key, int given, double *val)
{
    if (given) return CT_OK;
    const char *s = ct_meta_get(m, key);
    char *end;
    double v = s ? strtod(s, &end) : 0;
    if (!s || end == s || *end) return ct_error(CT_EFORMAT, "%s has no valid metadata '%s'", file, key);
    *val = v;
    return CT_OK;
}

/* --resume: the run's settings (flags given must agree where they decide
 * the data order; hyper-parameters not given are the saved run's) and its
 * position. */
static ct_status resume_settings(trainer *t, const char *side, const ct_meta *m)
{
    train_opts *o = t->o;
    int64_t shuffle = !o->no_shuffle, mstep;
    CT_TRY(agree(t, m, "ctrain.seed", "--seed", o->has_seed, &o->seed));
    CT_TRY(agree(t, m, "ctrain.batch", "--batch", o->has_batch, &o->batch));
    CT_TRY(agree(t, m, "ctrain.shuffle", "--no-shuffle", o->no_shuffle, &shuffle));
    o->no_shuffle = !shuffle;
    const char *oname = ct_meta_get(m, "ctrain.optim");
    if (!oname || ct_optim_parse(oname, &t->okind))
        return ct_error(CT_EFORMAT, "%s has no valid 'ctrain.optim' metadata", side);
    if (o->has_optim && strcmp(oname, o->optim)) {
        t->usage = 1;
        return ct_error(CT_EINVAL, "--optim %s differs from the %s state saved in %s; drop --optim, or use --init "
                        "to start a new optimizer from the weights", o->optim, oname, side);
    }
    o->optim = t->okind == CT_OPT_SGD ? "sgd" : "adamw";
    CT_TRY(saved_num(m, side, "ctrain.lr", o->has_lr, &o->lr));
    CT_TRY(saved_num(m, side, "ctrain.weight_decay", o->has_wd, &o->weight_decay));
    CT_TRY(saved_num(m, side, "ctrain.momentum", o->has_momentum, &o->momentum));
    CT_TRY(saved_num(m, side, "ctrain.clip", o->has_clip, &o->clip));
    const char *cn = ct_meta_get(m, "ctrain.clip_norm"); /* absent in older files: 2 */
    if (!o->has_clip_norm && cn) o->clip_norm = !strcmp(cn, "inf") ? "inf" : "2";
    o->has_lr = o->has_wd = o->has_momentum = 1;
    if (!o->has_warmup) CT_TRY(cli_meta_int(m, side, "ctrain.warmup", &o->warmup));
    if (!o->has_accum) CT_TRY(cli_meta_int(m, side, "ctrain.grad_accum", &o->grad_accum));
    if (!o->has_schedule) {
        const char *sk = ct_meta_get(m, "ctrain.schedule");
        ct_sched_kind k;
        if (!sk || ct_sched_parse(sk, &k)) return ct_error(CT_EFORMAT, "%s has no valid 'ctrain.schedule'", side);
        o->schedule = k == CT_SCHED_COSINE ? "cosine" : "constant";
    }
    CT_TRY(cli_meta_int(m, side, "ctrain.step", &t->step));
    CT_TRY(cli_meta_int(m, side, "ctrain.epoch", &t->epoch));
    CT_TRY(cli_meta_int(m, side, "ctrain.position", &t->pos));
    ct_meta mm;
    CT_TRY(cli_file_meta(t->ck, &mm));
    /* Sharded: both indexes name the save they belong to. */
    const char *gm = ct_meta_get(&mm, "ctrain.generation"), *gs = ct_meta_get(m, "ctrain.generation");
    int same_save = (!gm && !gs) || (gm && gs && !strcmp(gm, gs));
    if (cli_meta_int(&mm, o->resume, "ctrain.step", &mstep) != CT_OK || mstep != t->step || !same_save)
        return ct_error(CT_EFORMAT, "%s and %s are from different saves (a save was interrupted?); resume from a "
                        "matching pair, or use --init for the weights alone", o->resume, side);
    return CT_OK;
}

/* Reads --init / --resume files; for --resume, the run's settings and position. */
static ct_status read_checkpoints(trainer *t)
{
    train_opts *o = t->o;
    if (o->init) return cli_load_file(o->init, "the --init checkpoint", &t->ck);
    if (!o->resume) return CT_OK;
    CT_TRY(cli_load_file(o->resume, "the --resume checkpoint", &t->ck));
    char side[4096];
    cli_sidecar_path(o->resume, side, sizeof side);
    if (access(side, F_OK) != 0)
        return ct_error(CT_EIO, "cannot resume from %s: its optimizer state %s is missing (it is written beside "
                        "the checkpoint by --save); use --init %s to start from the weights alone",
                        o->resume, side, o->resume);
    CT_TRY(cli_load_file(side, "the optimizer state", &t->side));
    ct_meta m;
    CT_TRY(cli_file_meta(t->side, &m));
    return resume_settings(t, side, &m);
}

/* The optimizer spec; the strategy builds the optimizer over what this rank owns. */
static ct_status optimizer_spec(trainer *t, ct_optim_opts *oo)
{
    train_opts *o = t->o;
    if (!o->resume && ct_optim_parse(o->optim, &t->okind)) return ct_error(CT_EINVAL, "unknown --optim %s", o->optim);
    *oo = ct_optim_defaults(t->okind);
    if (o->has_lr) oo->lr = o->lr;
    if (o->has_wd) oo->weight_decay = o->weight_decay;
    if (o->has_momentum) oo->momentum = o->momentum;
    if (ct_optim_validate(oo) != CT_OK) {
        t->usage = 1;
        return CT_EINVAL;
    }
    return CT_OK;
}

/* The strategy's key=value options from the flags, then --strategy-opt
 * (later keys win, so --strategy-opt can override a flag's). */
static ct_status make_strategy(trainer *t)
{
    train_opts *o = t->o;
    ct_optim_opts oo;
    CT_TRY(optimizer_spec(t, &oo));
    char opts[2048];
    int n = snprintf(opts, sizeof opts, "grad_accum=%lld,param_dtype=%s,reduce_dtype=%s", (long long)o->grad_accum,
                     strcmp(o->mixed, "none") ? o->mixed : "f32",
                     strcmp(o->grad_compress, "none") ? o->grad_compress : "f32");
    /* DDP's bucket flags: passed where they apply, and where the user gave
     * them, so a strategy without buckets names the flag it does not take */
    int buckets = !strcmp(o->strategy, "ddp") || !strcmp(o->strategy, "zero1") || !strcmp(o->strategy, "pipe");
    if (buckets || o->has_bucket_cap)
        n += snprintf(opts + n, sizeof opts - (size_t)n, ",bucket_cap_mb=%.17g", o->bucket_cap_mb);
    if (buckets || o->find_unused)
        n += snprintf(opts + n, sizeof opts - (size_t)n, ",find_unused_parameters=%d", o->find_unused);
    if (!strcmp(o->strategy, "pipe")) {
        if (o->stages) n += snprintf(opts + n, sizeof opts - (size_t)n, ",stages=%lld", (long long)o->stages);
        if (o->chunks) n += snprintf(opts + n, sizeof opts - (size_t)n, ",chunks=%lld", (long long)o->chunks);
        if (o->pipe_schedule) n += snprintf(opts + n, sizeof opts - (size_t)n, ",schedule=%s", o->pipe_schedule);
        if (o->pipe_checkpoint) n += snprintf(opts + n, sizeof opts - (size_t)n, ",checkpoint=%s", o->pipe_checkpoint);
        if (o->balance) { /* "3,3,2" -> balance=3:3:2 (commas separate options) */
            n += snprintf(opts + n, sizeof opts - (size_t)n, ",balance=");
            for (const char *c = o->balance; *c && n + 2 < (int)sizeof opts; c++) opts[n++] = *c == ',' ? ':' : *c;
            opts[n] = 0;
        }
    }
    if (!strcmp(o->strategy, "offload")) {
        if (o->slices) n += snprintf(opts + n, sizeof opts - (size_t)n, ",slices=%lld", (long long)o->slices);
        if (o->microbatches) n += snprintf(opts + n, sizeof opts - (size_t)n, ",microbatches=%lld", (long long)o->microbatches);
        if (o->max_resident_mb)
            n += snprintf(opts + n, sizeof opts - (size_t)n, ",max_resident_mb=%lld", (long long)o->max_resident_mb);
        if (o->checkpoint_activation) n += snprintf(opts + n, sizeof opts - (size_t)n, ",checkpoint_activation=1");
        if (o->offload_dir) n += snprintf(opts + n, sizeof opts - (size_t)n, ",dir=%s", o->offload_dir);
        if (o->balance) {
            n += snprintf(opts + n, sizeof opts - (size_t)n, ",balance=");
            for (const char *c = o->balance; *c && n + 2 < (int)sizeof opts; c++) opts[n++] = *c == ',' ? ':' : *c;
            opts[n] = 0;
        }
    }
    if (o->strategy_opt) snprintf(opts + n, sizeof opts - (size_t)n, ",%s", o->strategy_opt);
    t->nparams = ct_module_num_params(t->model);
    ct_status st = ct_strategy_create(o->strategy, t->model, &oo, t->g, opts, &t->s);
    if (st == CT_OK) t->opt = ct_strategy_optim(t->s);
    else if (st == CT_EINVAL) t->usage = 1;
    if (st == CT_OK) ct_strategy_data_rank(t->s, &t->drank, &t->dsize);
    /* a pipeline's ranks share a slice: each slice needs a sample */
    if (st == CT_OK && o->batch < t->dsize) {
        t->usage = 1;
        st = ct_error(CT_EINVAL, "--batch %lld is smaller than the %d pipeline replicas; use --batch %d or more",
                      (long long)o->batch, t->dsize, t->dsize);
    }
    return st;
}

static ct_status make_schedule(trainer *t)
{
    train_opts *o = t->o;
    ct_sched_kind k;
    ct_sched_parse(o->schedule, &k);
    t->sched = (ct_lr_schedule){k, ct_optim_get_lr(t->opt), o->warmup, t->total, 0.0};
    if (ct_strategy_set_schedule(t->s, &t->sched) != CT_OK) {
        char why[400];
        snprintf(why, sizeof why, "%s", ct_last_error());
        t->usage = 1;
        return ct_error(CT_EINVAL, "--schedule %s over %lld steps: %s", o->schedule, (long long)t->total, why);
    }
    return CT_OK;
}

/* Sampler and the run's length; the resumed position must exist in it. */
static ct_status make_sampler(trainer *t)
{
    train_opts *o = t->o;
    CT_TRY(ct_sampler_init(&t->sampler, t->train.n, o->batch, t->seed, t->shuffle, 1));
    t->spe = ct_sampler_nbatches(&t->sampler);
    if (t->spe == 0) {
        t->usage = 1;
        return ct_error(CT_EINVAL, "the training set has %lld samples, fewer than one batch of %lld; lower --batch",
                        (long long)t->train.n, (long long)o->batch);
    }
    t->total = o->steps ? o->steps : o->epochs * t->spe;
    if (t->pos > t->spe || t->pos < 0 || t->epoch < 0)
        return ct_error(CT_EFORMAT, "%s is at batch %lld of epoch %lld, but an epoch here has %lld batches; resume "
                        "with the same data (and --limit-train)", o->resume, (long long)t->pos,
                        (long long)t->epoch, (long long)t->spe);
    if (t->pos == t->spe) {
        t->epoch++;
        t->pos = 0;
    }
    return ct_sampler_set_epoch(&t->sampler, t->epoch);
}

/* Subnormal floats cost some CPUs 30x per operation: AdamW moments of
 * parameters whose gradient stays 0 (dead ReLU units) decay into them and
 * stay there.  Flushing them is PyTorch's torch.set_flush_denormal(True). */
static ct_status flush_denormals(void)
{
#if defined(__SSE__)
    _mm_setcsr(_mm_getcsr() | 0x8040); /* FTZ (bit 15) and DAZ (bit 6) */
    return CT_OK;
#else
    return ct_error(CT_EUNSUPPORTED, "--flush-denormal works on x86 only; leave it out");
#endif
}

static int sharded(const trainer *t) { return !strcmp(t->o->state_dict, "sharded"); }

/* A --save path of the wrong kind fails now, not after the training it would lose. */
static ct_status check_save_target(trainer *t)
{
    struct stat sb;
    const char *p = t->o->save;
    if (!p || t->rank != 0 || stat(p, &sb) != 0) return CT_OK;
    if (sharded(t) && !S_ISDIR(sb.st_mode))
        return ct_error(CT_EINVAL, "--save %s: --state-dict sharded writes a directory, but %s is a file; give a "
                        "directory path (or drop --state-dict sharded to write one file)", p, p);
    if (!sharded(t) && S_ISDIR(sb.st_mode))
        return ct_error(CT_EINVAL, "--save %s is a directory; save a sharded checkpoint into it with --state-dict "
                        "sharded, or give a file path", p);
    return CT_OK;
}

/* Everything before the first step, agreed over the world after each part. */
static ct_status setup(trainer *t)
{
    train_opts *o = t->o;
    ct_status st;
    int threads = o->threads ? (int)o->threads : cli_default_threads(t->g);
    ct_blas_set_threads(threads);
    if (o->trace) ct_trace_enable(t->rank);
    if (o->flush_denormal) CT_TRY(ct_group_check(t->g, flush_denormals()));

    ct_status chk = check_save_target(t);
    if (chk != CT_OK) t->usage = 1;
    CT_TRY(ct_group_check(t->g, chk));
    CT_TRY(ct_group_check(t->g, read_checkpoints(t)));
    /* After --resume has settled the batch: each rank needs a sample in every micro-batch. */
    if (!strcmp(o->strategy, "offload") && o->microbatches > 1 && o->batch < t->world * o->microbatches) {
        t->usage = 1;
        return ct_error(CT_EINVAL, "--batch %lld is smaller than %d ranks x %lld micro-batches (--microbatches); "
                        "every rank needs at least one sample per micro-batch: use --batch %lld or more",
                        (long long)o->batch, t->world, (long long)o->microbatches, (long long)(t->world * o->microbatches));
    }
    if (strcmp(o->strategy, "pipe") && o->batch < t->world * o->grad_accum) {
        t->usage = 1;
        if (o->grad_accum == 1)
            return ct_error(CT_EINVAL, "--batch %lld is smaller than the %d ranks; every rank needs at least one "
                            "sample per step: use --batch %d or more", (long long)o->batch, t->world, t->world);
        return ct_error(CT_EINVAL, "--batch %lld is smaller than %d ranks x %lld micro-batches (--grad-accum); "
                        "every rank needs at least one sample per micro-batch: use --batch %lld or more",
                        (long long)o->batch, t->world, (long long)o->grad_accum,
                        (long long)(t->world * o->grad_accum));
    }
    t->seed = (uint64_t)o->seed;
    t->shuffle = !o->no_shuffle;
    CT_TRY(ct_group_check(t->g, choose_config(t)));

    st = cli_load_data(o->data, o->data_dir, 1, o->limit_train, &t->train);
    if (st == CT_OK) st = cli_load_data(o->data, o->data_dir, 0, o->limit_test, &t->test);
    if (st == CT_OK) st = cli_check_input(&t->cfg, &t->train);
    CT_TRY(ct_group_check(t->g, st));

    st = ct_model_build(&t->cfg, t->seed, &t->model);
    CT_TRY(ct_group_check(t->g, st));
    CT_TRY(ct_group_check(t->g, make_strategy(t)));

    st = CT_OK;
    if (t->ck) {
        st = cli_load_state(t->s, t->ck, 0);
        if (st != CT_OK) {
            /* Say which model the file holds, when its metadata tells. */
            char why[512], mine[300], theirs[300];
            snprintf(why, sizeof why, "%s", ct_last_error());
            cli_config_str(&t->cfg, mine, sizeof mine);
            ct_meta m;
            ct_model_config c;
            if (cli_file_meta(t->ck, &m) == CT_OK && ct_model_config_from_meta(&m, &c) == CT_OK)
                st = ct_error(st, "%s holds %s, not the %s this run builds: %s", o->resume ? o->resume : o->init,
                              cli_config_str(&c, theirs, sizeof theirs), mine, why);
            else
                st = ct_error(st, "%s does not fit this %s: %s", o->resume ? o->resume : o->init, mine, why);
        }
    }
    if (st == CT_OK && t->side) st = cli_load_state(t->s, t->side, 1);
    if (st == CT_OK) st = make_sampler(t);
    if (st == CT_OK) st = make_schedule(t);
    CT_TRY(ct_group_check(t->g, st));
    t->start_step = t->step;
    int64_t n = t->total > t->step ? t->total - t->step : 1;
    t->step_s = ct_alloc(sizeof *t->step_s * (size_t)n, CT_MEM_OTHER);
    t->mem = ct_alloc(sizeof *t->mem * (size_t)t->world, CT_MEM_OTHER);
    CT_TRY(ct_group_check(t->g, t->step_s && t->mem ? CT_OK : CT_ENOMEM));
    /* Wrapping's one-off transients (the gradients before DDP moves them
     * into buckets) are not the steady state the report is about. */
    ct_mem_reset_peak();
    return CT_OK;
}

/* ---- the loop ------------------------------------------------------------ */

/* Fails the job from inside the loop: with other ranks waiting in
 * collectives the whole job must stop. */
static ct_status loop_fail(trainer *t, ct_status st, const char *what)
{
    if (t->world > 1) ct_comm_abort("ctrain train: %s at step %lld failed: %s", what, (long long)t->step + 1,
                                    ct_last_error());
    char why[512];
    snprintf(why, sizeof why, "%s", ct_last_error());
    return ct_error(st, "%s at step %lld failed: %s", what, (long long)t->step + 1, why);
}

/* This rank's slice of the step's global batch, through the strategy:
 * forward, loss and backward per micro-batch, then the synchronisation.
 * Adds the local loss sum and row count to sums. */
static ct_status train_step(trainer *t, int64_t *idx, double *sums)
{
    int64_t count, global = ct_sampler_batch_size(&t->sampler, t->pos);
    CT_TRY(ct_sampler_batch(&t->sampler, t->pos, t->drank, t->dsize, idx, &count));
    ct_batch b = {.global_rows = global, .sample0 = ct_sampler_first(&t->sampler, t->pos, t->drank, t->dsize)};
    ct_fwd_ctx ctx = {.training = 1, .seed = t->seed, .step = (uint64_t)t->step};
    ct_step_out out = {0, 0};
    ct_status st = cli_batch(&t->train, &t->cfg, idx, count, &b.x, &b.y);
    if (st == CT_OK) st = ct_strategy_train_step(t->s, &b, ct_loss_cross_entropy, NULL, &ctx, &out);
    sums[0] += out.loss_sum;
    sums[1] += (double)out.rows;
    ct_tensor_release(b.x);
    ct_tensor_release(b.y);
    return st;
}

static void add_stats(trainer *t)
{
    ct_step_stats s = ct_strategy_stats(t->s);
    t->sum.forward += s.forward;
    t->sum.backward += s.backward;
    t->sum.comm_wait += s.comm_wait;
    t->sum.optimizer += s.optimizer;
    t->sum.comm_total += s.comm_total;
    t->sum.io_total += s.io_total;
    t->sum.io_wait += s.io_wait;
    t->sum.nbuckets = s.nbuckets;
    t->nstats++;
}

static ct_status fill_meta(trainer *t, ct_meta *model, ct_meta *side)
{
    train_opts *o = t->o;
    memset(model, 0, sizeof *model);
    CT_TRY(ct_model_config_to_meta(&t->cfg, model));
    CT_TRY(ct_meta_set(model, "ctrain.step", "%lld", (long long)t->step));
    CT_TRY(ct_meta_set(model, "ctrain.epoch", "%lld", (long long)(t->pos == t->spe ? t->epoch + 1 : t->epoch)));
    CT_TRY(ct_meta_set(model, "ctrain.seed", "%llu", (unsigned long long)t->seed));
    CT_TRY(ct_meta_set(model, "ctrain.optim", "%s", ct_optim_name(t->opt)));
    CT_TRY(ct_meta_set(model, "ctrain.data", "%s", o->data));
    *side = *model;
    CT_TRY(ct_meta_set(side, "ctrain.position", "%lld", (long long)t->pos));
    CT_TRY(ct_meta_set(side, "ctrain.batch", "%lld", (long long)o->batch));
    CT_TRY(ct_meta_set(side, "ctrain.shuffle", "%d", t->shuffle));
    CT_TRY(ct_meta_set(side, "ctrain.train_samples", "%lld", (long long)t->train.n));
    const ct_optim_opts *oo = ct_optim_get_opts(t->opt);
    CT_TRY(ct_meta_set(side, "ctrain.lr", "%.17g", t->sched.base_lr));
    CT_TRY(ct_meta_set(side, "ctrain.weight_decay", "%.17g", oo->weight_decay));
    CT_TRY(ct_meta_set(side, "ctrain.momentum", "%.17g", oo->momentum));
    CT_TRY(ct_meta_set(side, "ctrain.clip", "%.17g", o->clip));
    CT_TRY(ct_meta_set(side, "ctrain.clip_norm", "%s", o->clip_norm));
    CT_TRY(ct_meta_set(side, "ctrain.schedule", "%s", ct_sched_name(t->sched.kind)));
    CT_TRY(ct_meta_set(side, "ctrain.warmup", "%lld", (long long)t->sched.warmup_steps));
    CT_TRY(ct_meta_set(side, "ctrain.total_steps", "%lld", (long long)t->sched.total_steps));
    CT_TRY(ct_meta_set(side, "ctrain.grad_accum", "%lld", (long long)o->grad_accum));
    return CT_OK;
}

/* Full: rank 0 writes; every rank learns whether it worked.  Sharded:
 * every rank writes its share, rank 0 the indexes. */
static ct_status save(trainer *t)
{
    ct_meta mm, sm;
    CT_TRY(ct_group_check(t->g, fill_meta(t, &mm, &sm)));
    if (sharded(t)) return cli_save_sharded(t->s, t->o->save, &mm, &sm, t->step);
    return cli_save(t->s, t->o->save, &mm, &sm);
}

static ct_status train_loop(trainer *t, cli_progress *prog)
{
    train_opts *o = t->o;
    int64_t *idx = ct_alloc_zeroed(sizeof *idx * (size_t)o->batch, CT_MEM_OTHER);
    if (!idx) return CT_ENOMEM;
    double win[2] = {0, 0}, t_win = ct_now();
    int64_t win_steps = 0;
    ct_status st = CT_OK;
    while (t->step < t->total) {
        if (t->pos == t->spe) {
            t->epoch++;
            t->pos = 0;
            if ((st = ct_sampler_set_epoch(&t->sampler, t->epoch))) break;
        }
        double lr = ct_strategy_lr(t->s), t_step = ct_now();
        if ((st = train_step(t, idx, win)) != CT_OK) {
            st = loop_fail(t, st, "forward/backward");
            break;
        }
        if (o->clip > 0 && (st = ct_strategy_clip_grad_norm(t->s, (float)o->clip, !strcmp(o->clip_norm, "inf") ? INFINITY : 2.0, NULL))) {
            st = loop_fail(t, st, "gradient clipping");
            break;
        }
        if ((st = ct_strategy_step(t->s))) {
            st = loop_fail(t, st, "optimizer step");
            break;
        }
        ct_strategy_zero_grad(t->s);
        t->step_s[t->nstep_s++] = ct_now() - t_step;
        add_stats(t);
        t->step++;
        t->pos++;
        win_steps++;
        int last = t->step == t->total;
        if ((o->log_every && t->step % o->log_every == 0) || last) {
            if ((st = cli_sum_f64(t->g, win, 2))) {
                st = loop_fail(t, st, "loss allreduce");
                break;
            }
            double now = ct_now();
            t->last_loss = win[1] > 0 ? win[0] / win[1] : 0;
            if (o->log_every)
                cli_progress_log(prog, t->step, t->epoch, t->last_loss, lr,
                                 (double)win_steps * (double)o->batch / (now - t_win));
            win[0] = win[1] = 0;
            win_steps = 0;
            t_win = now;
        }
        cli_progress_tick(prog, t->step, t->epoch, t->last_loss);
        if (o->save_every && t->step % o->save_every == 0 && !last && (st = save(t))) break;
    }
    ct_free(idx);
    return st;
}

/* ---- the report ---------------------------------------------------------- */

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Median wall time of this run's steps in ms (0 if none ran). */
static double median_step_ms(trainer *t)
{
    if (!t->nstep_s) return 0;
    qsort(t->step_s, (size_t)t->nstep_s, sizeof *t->step_s, cmp_double);
    int64_t n = t->nstep_s;
    return 1000.0 * (n % 2 ? t->step_s[n / 2] : 0.5 * (t->step_s[n / 2 - 1] + t->step_s[n / 2]));
}

/* Peak bytes per category over the training steps, a column per rank (up
 * to 8; beyond that the largest rank's figure). */
static void print_memory(trainer *t)
{
    static const char *rows[] = {"param", "grad", "optim", "act", "comm", "data", "other",
                                 "total", "resident", "cached", "rss"};
    int cols = t->world <= 8 ? t->world : 1;
    char b[32];
    cli_out("peak memory over the training steps%s:\n  %-9s", t->world > 8 ? " (max over ranks)" : "", "");
    for (int r = 0; r < cols; r++) {
        char h[16];
        snprintf(h, sizeof h, cols == 1 && t->world == 1 ? "bytes" : t->world > 8 ? "max" : "rank %d", r);
        cli_out("%12s", h);
    }
    cli_out("\n");
    for (size_t k = 0; k < sizeof rows / sizeof rows[0]; k++) {
        cli_out("  %-9s", rows[k]);
        for (int r = 0; r < cols; r++) {
            size_t v = 0;
            for (int q = t->world > 8 ? 0 : r; q < (t->world > 8 ? t->world : r + 1); q++) {
                const ct_mem_report *m = &t->mem[q];
                size_t x = k < CT_MEM_NCAT ? m->peak[k] : k == 7 ? m->peak_total : k == 8 ? m->peak_resident
                         : k == 9 ? m->cached : m->peak_rss;
                if (x > v) v = x;
            }
            cli_out("%12s", cli_bytes((double)v, b, sizeof b));
        }
        cli_out("\n");
    }
    cli_out("  (resident = param + grad + optim at its peak; rss = the process's peak resident set)\n");
}

static ct_status report(trainer *t, double seconds)
{
    train_opts *o = t->o;
    cli_eval ev;
    char buf[256];
    CT_TRY(cli_evaluate(t->s, t->model, &t->cfg, &t->test, o->eval_batch, t->g, &ev, NULL));
    int64_t steps = t->step - t->start_step;
    if (steps > 0)
        cli_out("trained %lld steps (to step %lld, epoch %.2f) in %.1f s, %.0f samples/s; final train loss %.6f\n",
                (long long)steps, (long long)t->step, (double)t->step / (double)t->spe, seconds,
                (double)steps * (double)o->batch / seconds, t->last_loss);
    cli_out("test: %s\n", cli_eval_str(&ev, buf, sizeof buf));
    print_memory(t);
    if (t->nstats) {
        double n = (double)t->nstats, ms = 1000.0 / n;
        ct_step_stats s = t->sum;
        double ov = s.comm_total > 0 ? 1.0 - s.comm_wait / s.comm_total : 1.0;
        if (ov < 0) ov = 0;
        cli_out("step time (%s, mean over %lld steps): forward %.2f ms, backward %.2f ms, optimizer %.2f ms",
                ct_strategy_kind(t->s), (long long)t->nstats, s.forward * ms, s.backward * ms, s.optimizer * ms);
        if (s.io_total > 0)
            cli_out("; offload I/O %.2f ms, waited %.2f ms (%.0f%% hidden behind compute)", s.io_total * ms,
                    s.io_wait * ms, 100.0 * (s.io_total > s.io_wait ? 1.0 - s.io_wait / s.io_total : 0.0));
        if (!strcmp(ct_strategy_kind(t->s), "pipe"))
            cli_out("; waited %.2f ms for other stages (the pipeline's bubble) and the replicas' allreduce "
                    "(%.2f ms in %d bucket%s)", s.comm_wait * ms, s.comm_total * ms, s.nbuckets, s.nbuckets == 1 ? "" : "s");
        else if (t->world > 1)
            cli_out("; allreduce %.2f ms in %d bucket%s, waited %.2f ms (%.0f%% overlapped with backward)",
                    s.comm_total * ms, s.nbuckets, s.nbuckets == 1 ? "" : "s", s.comm_wait * ms, ov * 100);
        cli_out("\n");
        (void)n;
    }
    return CT_OK;
}

static ct_status write_trace(trainer *t)
{
    const char *path = t->o->trace;
    if (t->world == 1) return ct_trace_write(path);
    char buf[4096];
    const char *slash = strrchr(path, '/'), *dot = strrchr(path, '.');
    if (dot && (!slash || dot > slash + 1))
        snprintf(buf, sizeof buf, "%.*s.rank%d%s", (int)(dot - path), path, t->rank, dot);
    else
        snprintf(buf, sizeof buf, "%s.rank%d", path, t->rank);
    return ct_trace_write(buf);
}

static void teardown(trainer *t)
{
    ct_strategy_destroy(t->s); /* and the optimizer it built */
    ct_module_destroy(t->model);
    ct_sampler_fini(&t->sampler);
    ct_dataset_fini(&t->train);
    ct_dataset_fini(&t->test);
    ct_safetensors_destroy(t->ck);
    ct_safetensors_destroy(t->side);
    ct_free(t->step_s);
    ct_free(t->mem);
}

static void describe(trainer *t)
{
    train_opts *o = t->o;
    char desc[300];
    cli_out("ctrain train: %s (%lld parameters) on %s (%lld training samples), %s lr %g, batch %lld%s "
            "over %d rank%s (%s), %d BLAS thread%s per rank (OpenBLAS %s), steps %lld..%lld (%lld per epoch)\n",
            cli_config_str(&t->cfg, desc, sizeof desc), (long long)t->nparams, o->data, (long long)t->train.n, ct_optim_name(t->opt),
            t->sched.base_lr, (long long)o->batch, o->grad_accum > 1 ? " (accumulated)" : "", t->world,
            t->world == 1 ? "" : "s", ct_strategy_kind(t->s), ct_blas_get_threads(),
            ct_blas_get_threads() == 1 ? "" : "s", ct_blas_corename(), (long long)t->step, (long long)t->total, (long long)t->spe);
    int stage, nstages;
    ct_strategy_pipe_stage(t->s, &stage, &nstages);
    if (!strcmp(ct_strategy_kind(t->s), "pipe"))
        cli_out("pipeline: %d stage%s (children per stage %s) x %d replica%s; %s micro-batches, schedule %s, "
                "checkpoint %s; rank r is stage r %% %d of replica r / %d\n", nstages, nstages == 1 ? "" : "s", ct_strategy_opt(t->s, "balance"),
                t->dsize, t->dsize == 1 ? "" : "s", ct_strategy_opt(t->s, "chunks"), ct_strategy_opt(t->s, "schedule"),
                ct_strategy_opt(t->s, "checkpoint"), nstages, nstages);
    int nsl, ahead;
    ct_strategy_offload_info(t->s, &nsl, &ahead);
    if (nsl)
        cli_out("offload: %d slices (children per slice %s), up to %d resident (%s), micro-batches %s, "
                "activation checkpointing %s, budget %s MiB; store in %s\n", nsl, ct_strategy_opt(t->s, "balance"), ahead,
                ahead == 1 ? "no prefetch" : ahead == 2 ? "the next slice loads meanwhile" : "prefetch and overlapped allreduce",
                ct_strategy_opt(t->s, "microbatches"), strcmp(ct_strategy_opt(t->s, "checkpoint_activation"), "0") ? "on" : "off",
                ct_strategy_opt(t->s, "max_resident_mb"), o->offload_dir ? o->offload_dir : "$TMPDIR or /tmp");
    const ct_partition *pt = ct_strategy_partition(t->s);
    if (!o->verbose || !pt) return;
    /* Who owns what: the partition's parameter indices count trainable parameters. */
    ct_param **ps;
    int np, nt = 0;
    if (ct_module_params(t->model, &ps, &np) != CT_OK) return;
    const char **names = ct_alloc_zeroed(sizeof *names * (size_t)(np + 1), CT_MEM_OTHER);
    size_t n = 256 + 64 * (size_t)pt->n;
    char *buf = ct_alloc_zeroed(n, CT_MEM_OTHER);
    for (int i = 0; names && i < np; i++)
        if (ps[i]->requires_grad) names[nt++] = ps[i]->name;
    if (names && buf && ct_partition_describe(pt, names, buf, n) == CT_OK) cli_out("partition (%s):\n%s", ct_strategy_kind(t->s), buf);
    ct_free(buf);
    ct_free(names);
    ct_free(ps);
}

int train_run(train_opts *o)
{
    trainer t;
    memset(&t, 0, sizeof t);
    t.o = o;
    t.last_loss = NAN; /* none logged yet */
    t.g = ct_group_world();
    t.rank = ct_group_rank(t.g);
    t.world = ct_group_size(t.g);
    ct_status st = setup(&t);
    cli_progress prog;
    memset(&prog, 0, sizeof prog);
    double t0 = ct_now();
    if (st == CT_OK) {
        describe(&t);
        if (t.step >= t.total)
            cli_out("nothing to train: %s is at step %lld and this run stops at step %lld; raise --steps or "
                    "--epochs to continue it\n", o->resume ? o->resume : "the checkpoint", (long long)t.step,
                    (long long)t.total);
        st = ct_group_check(t.g, cli_progress_init(&prog, t.total, t.spe, o->metrics, o->resume != NULL));
    }
    if (st == CT_OK) st = train_loop(&t, &prog);
    if (st == CT_OK) st = ct_strategy_memory(t.s, t.mem);
    if (st == CT_OK && t.rank == 0) st = cli_progress_summary(&prog, median_step_ms(&t), t.mem, t.world);
    cli_progress_finish(&prog);
    double seconds = ct_now() - t0;
    if (st == CT_OK) st = report(&t, seconds);
    if (st == CT_OK && o->save) {
        st = save(&t);
        if (st == CT_OK && sharded(&t))
            cli_out("saved %s (sharded over %d rank%s; indexes %s/model.safetensors.index.json and "
                    "optim.safetensors.index.json)\n", o->save, t.world, t.world == 1 ? "" : "s", o->save);
        else if (st == CT_OK) {
            char side[4096];
            cli_sidecar_path(o->save, side, sizeof side);
            cli_out("saved %s (optimizer state: %s)\n", o->save, side);
        }
    }
    if (st == CT_OK && o->trace) st = ct_group_check(t.g, write_trace(&t));
    if (st != CT_OK) cli_err("train", "%s", ct_last_error());
    teardown(&t);
    return st == CT_OK ? CLI_OK : t.usage ? CLI_USAGE : CLI_RUNTIME;
}

/* Flag errors are found before MPI starts: every rank has the same
 * arguments, so all exit alike, and the launcher's rank says who speaks. */
int cli_train(int argc, char **argv)
{
    train_opts o;
    char err[1024];
    int help;
    int rc = train_parse(argc, argv, &o, &help, err, sizeof err);
    cli_rank = cli_launcher_rank();
    if (help) {
        if (cli_rank == 0) train_help(stdout);
        return CLI_OK;
    }
    if (rc) {
        if (cli_rank == 0) fprintf(stderr, "%s\n", err);
        return rc;
    }
    if (o.strategy_opt && !strcmp(o.strategy_opt, "help")) {
        char buf[4096], kind[32];
        /* every kind the library lists ("none, ddp, ...") */
        for (const char *p = ct_strategy_list(); *p && cli_rank == 0;) {
            size_t len = strcspn(p, ",");
            snprintf(kind, sizeof kind, "%.*s", (int)len, p);
            p += len;
            p += strspn(p, ", ");
            if (o.has_strategy && strcmp(o.strategy, kind)) continue;
            ct_strategy_help(kind, buf, sizeof buf);
            printf("--strategy %s takes --strategy-opt KEY=VALUE,... with these keys (defaults shown):\n%s",
                   kind, buf);
        }
        return CLI_OK;
    }
    if (ct_comm_init(NULL, NULL) != CT_OK) {
        cli_err("train", "cannot start communication: %s", ct_last_error());
        return CLI_RUNTIME;
    }
    cli_rank = ct_group_rank(ct_group_world());
    cli_world = ct_group_size(ct_group_world());
    rc = train_check_world(&o, cli_world, err, sizeof err);
    if (rc) {
        if (cli_rank == 0) fprintf(stderr, "%s\n", err);
    } else {
        rc = train_run(&o);
    }
    ct_comm_finalize();
    return rc;
}

