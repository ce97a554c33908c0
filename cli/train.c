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
#include <time.h>
#include <unistd.h>
#if defined(__SSE__)
#include <xmmintrin.h>
#endif

#include "train_loop.h"

#define STEP_TIMES_MAX (1 << 20)


/* ---- set-up -------------------------------------------------------------- */

/* The model's config: the flags', or the checkpoint's when --model is not given. */
static ct_status choose_config(trainer *t)
{
    train_opts *o = t->o;
    const char *file = o->resume ? o->resume : o->init;
    if (!o->has_model) {
        const ct_meta *m = &t->ck.meta;
        if (ct_model_config_from_meta(m, &t->cfg) != CT_OK) {
            char why[512];
            snprintf(why, sizeof why, "%s", ct_last_error());
            return ct_error(CT_EFORMAT, "%s: %s; pass --model (and --hidden) to say what it holds", file, why);
        }
        if (o->has_hidden) {
            char mine[256];
            ct_model_config c = t->cfg;
            CT_TRY(ct_model_config_parse_hidden(&c, o->hidden));
            if (strcmp(ct_model_config_hidden_str(&c, mine, sizeof mine), ct_meta_get(m, "ctrain.hidden"))) {
                t->usage = 1;
                return ct_error(CT_EINVAL, "--hidden %s differs from the checkpoint's %s (%s); drop --hidden",
                                o->hidden, ct_meta_get(m, "ctrain.hidden"), file);
            }
        }
        if (o->batchnorm && !t->cfg.batchnorm) {
            t->usage = 1;
            return ct_error(CT_EINVAL, "--batchnorm: the checkpoint %s holds a model without batchnorm; drop "
                            "--batchnorm", file);
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
    t->cfg.batchnorm = o->batchnorm;
    if (o->has_dropout) t->cfg.dropout = (float)o->dropout;
    if (kind == CT_MODEL_GPT) cli_gpt_shape_apply(&o->gpt, &t->cfg);
    return ct_model_config_validate(&t->cfg);
}

/* A flag the user gave must agree with the value the run was saved with. */
static ct_status agree(trainer *t, const ct_meta *m, const char *file, const char *key, const char *flag, int given,
                       int64_t *val)
{
    int64_t saved;
    CT_TRY(cli_meta_int(m, file, key, &saved));
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
    int64_t shuffle = !o->no_shuffle;
    CT_TRY(agree(t, m, side, "ctrain.seed", "--seed", o->has_seed, &o->seed));
    CT_TRY(agree(t, m, side, "ctrain.batch", "--batch", o->has_batch, &o->batch));
    CT_TRY(agree(t, m, side, "ctrain.shuffle", "--no-shuffle", o->no_shuffle, &shuffle));
    o->no_shuffle = !shuffle;
    const char *lb = ct_meta_get(m, "ctrain.last_batch"); /* absent in older files: drop */
    const char *saved_lb = lb && !strcmp(lb, "keep") ? "keep" : "drop";
    if (o->has_last_batch && strcmp(o->last_batch, saved_lb)) {
        t->usage = 1;
        return ct_error(CT_EINVAL, "--last-batch %s differs from the %s that %s was trained with (it decides the "
                        "steps of an epoch); drop --last-batch to continue that run exactly", o->last_batch,
                        saved_lb, o->resume);
    }
    o->last_batch = saved_lb;
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
    /* Absent in files from before parameter groups: those runs decayed every
     * parameter with PyTorch's betas, and go on doing so. */
    const char *nd = ct_meta_get(m, "ctrain.no_decay");
    if (nd && strlen(nd) >= sizeof t->saved_no_decay)
        return ct_error(CT_EFORMAT, "%s: 'ctrain.no_decay' is %zu bytes, over %d", side, strlen(nd), NO_DECAY_MAX - 1);
    snprintf(t->saved_no_decay, sizeof t->saved_no_decay, "%s", nd ? nd : "none"); /* m is the caller's */
    if (!o->has_no_decay) o->no_decay = t->saved_no_decay;
    o->has_no_decay = 1;
    if (!o->has_betas && ct_meta_get(m, "ctrain.beta1")) {
        CT_TRY(saved_num(m, side, "ctrain.beta1", 0, &o->beta1));
        CT_TRY(saved_num(m, side, "ctrain.beta2", 0, &o->beta2));
        o->has_betas = 1;
    } else if (!o->has_betas) {
        ct_optim_opts d = ct_optim_defaults(CT_OPT_ADAMW);
        o->beta1 = d.beta1;
        o->beta2 = d.beta2;
        o->has_betas = 1;
    }
    CT_TRY(saved_num(m, side, "ctrain.clip", o->has_clip, &o->clip));
    const char *cf = ct_meta_get(m, "ctrain.clip_filter"); /* absent: every parameter */
    if (cf && strlen(cf) >= sizeof t->saved_clip_filter)
        return ct_error(CT_EFORMAT, "%s: 'ctrain.clip_filter' is %zu bytes, over %zu", side, strlen(cf),
                        sizeof t->saved_clip_filter - 1);
    if (!o->has_clip_filter && cf && cf[0]) {
        snprintf(t->saved_clip_filter, sizeof t->saved_clip_filter, "%s", cf);
        o->clip_filter = t->saved_clip_filter;
    }
    const char *cn = ct_meta_get(m, "ctrain.clip_norm"); /* absent in older files: 2 */
    if (!o->has_clip_norm && cn && train_norm_type(cn, &o->clip_p))
        return ct_error(CT_EFORMAT, "%s has 'ctrain.clip_norm' '%s', not a norm type; give --clip-norm", side, cn);
    o->has_lr = o->has_wd = o->has_momentum = 1;
    if (!o->has_warmup) CT_TRY(cli_meta_int(m, side, "ctrain.warmup", &o->warmup));
    if (!o->has_accum) CT_TRY(cli_meta_int(m, side, "ctrain.grad_accum", &o->grad_accum));
    if (!o->has_schedule) {
        const char *sk = ct_meta_get(m, "ctrain.schedule");
        ct_sched_kind k;
        if (!sk || ct_sched_parse(sk, &k)) return ct_error(CT_EFORMAT, "%s has no valid 'ctrain.schedule'", side);
        o->schedule = k == CT_SCHED_COSINE ? "cosine" : "constant";
    }
    /* ct_checkpoint_info checked that both files are from one save */
    CT_TRY(cli_meta_int(m, side, "ctrain.step", &t->step));
    CT_TRY(cli_meta_int(m, side, "ctrain.epoch", &t->epoch));
    CT_TRY(cli_meta_int(m, side, "ctrain.position", &t->pos));
    return train_check_saved(o, t->step, t->epoch, t->pos, side);
}

/* Collective: the metadata of the --init / --resume checkpoint (its
 * tensors are read once the strategy is there); for --resume, the run's
 * settings and position. */
static ct_status read_checkpoints(trainer *t)
{
    train_opts *o = t->o;
    const char *ckp = o->init ? o->init : o->resume;
    if (ckp) ct_mem_phase_begin(CT_PHASE_LOAD);
    if (o->init) {
        t->ck_path = o->init;
        return ct_checkpoint_info(t->g, o->init, 0, &t->ck);
    }
    if (!o->resume) return CT_OK;
    char side[4096];
    CT_TRY(ct_group_check(t->g, train_check_resume_name(o->resume)));
    t->ck_path = o->resume;
    CT_TRY(ct_checkpoint_info(t->g, o->resume, 1, &t->ck));
    ct_checkpoint_optim_path(o->resume, side, sizeof side);
    return resume_settings(t, side, &t->ck.optim_meta);
}

/* The optimizer spec; the strategy builds the optimizer over what this rank
 * owns.  The gpt's defaults are nanoGPT's configure_optimizers: parameters
 * of fewer than 2 dimensions (biases, LayerNorms) in a group without weight
 * decay, betas (0.9, 0.95).  t->nodecay's names are t->nd, borrowed from the
 * model's parameters until the strategy has copied them. */
static ct_status optimizer_spec(trainer *t, ct_optim_opts *oo)
{
    train_opts *o = t->o;
    if (!o->resume && ct_optim_parse(o->optim, &t->okind)) return ct_error(CT_EINVAL, "unknown --optim %s", o->optim);
    *oo = ct_optim_defaults(t->okind);
    int gpt = t->cfg.kind == CT_MODEL_GPT;
    if (o->has_lr) oo->lr = o->lr;
    if (o->has_wd) oo->weight_decay = o->weight_decay;
    if (o->has_momentum) oo->momentum = o->momentum;
    if (o->has_betas) oo->beta1 = o->beta1, oo->beta2 = o->beta2;
    else if (gpt) oo->beta2 = 0.95;
    if (!o->has_no_decay) o->no_decay = gpt ? "ndim<2" : "none";
    ct_param **ps;
    int np;
    CT_TRY(ct_module_params(t->model, &ps, &np));
    ct_status st = ct_optim_select(ps, np, o->no_decay, &t->nd, &t->nnd);
    ct_free(ps);
    if (st != CT_OK) {
        t->usage = 1;
        return ct_error(st, "--no-decay: %s", ct_last_error());
    }
    t->nodecay = ct_optim_group_init(oo);
    t->nodecay.params = t->nd;
    t->nodecay.nparams = t->nnd;
    t->nodecay.weight_decay = 0;
    if (t->nnd) {
        oo->groups = &t->nodecay;
        oo->ngroups = 1;
    }
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
    int psgd = train_powersgd_rank(o);
    int n = snprintf(opts, sizeof opts, "grad_accum=%lld,param_dtype=%s,reduce_dtype=%s", (long long)o->grad_accum,
                     strcmp(o->mixed, "none") ? o->mixed : "f32",
                     strcmp(o->grad_compress, "none") && !psgd ? o->grad_compress : "f32");
    if (psgd > 0) n += snprintf(opts + n, sizeof opts - (size_t)n, ",powersgd_rank=%d", psgd);
    char lsgd[128];
    if (train_local_sgd_opts(o, lsgd, sizeof lsgd) == 0) n += snprintf(opts + n, sizeof opts - (size_t)n, "%s", lsgd);
    if (o->sync_batchnorm) n += snprintf(opts + n, sizeof opts - (size_t)n, ",sync_batchnorm=1");
    /* DDP's bucket flags: passed where they apply, and where the user gave
     * them, so a strategy without buckets names the flag it does not take;
     * the bucket size only where given (the library's default is auto) */
    int buckets = !strcmp(o->strategy, "ddp") || !strcmp(o->strategy, "zero1") || !strcmp(o->strategy, "pipe");
    if (o->has_bucket_cap)
        n += snprintf(opts + n, sizeof opts - (size_t)n, ",bucket_cap_mb=%.17g", o->bucket_cap_mb);
    if (buckets || o->find_unused)
        n += snprintf(opts + n, sizeof opts - (size_t)n, ",find_unused_parameters=%d", o->find_unused);
    if (!strcmp(o->strategy, "fsdp")) {
        char wrap[64];
        CLI_FSDP_WRAP(wrap, sizeof wrap, t->cfg.kind == CT_MODEL_GPT, o->wrap_min_params, o->has_wrap_min);
        n += snprintf(opts + n, sizeof opts - (size_t)n, ",sharding=%s,%s,backward_prefetch=%s,limit_all_gathers=%d",
                      strcmp(o->sharding, "grad-op") ? o->sharding : "grad_op", wrap, o->prefetch,
                      o->limit_all_gathers);
        if (o->fsdp_offload) { /* the shards in a store (fsdp_offload.c) */
            n += snprintf(opts + n, sizeof opts - (size_t)n, ",offload=%s", o->fsdp_offload);
            if (o->max_resident_mb)
                n += snprintf(opts + n, sizeof opts - (size_t)n, ",max_resident_mb=%lld", (long long)o->max_resident_mb);
            if (o->offload_dir) n += snprintf(opts + n, sizeof opts - (size_t)n, ",offload_dir=%s", o->offload_dir);
        }
    }
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
    ct_free(t->nd); /* the optimizer has its copy of the group */
    t->nd = NULL;
    t->nodecay.params = NULL;
    if (st == CT_OK) t->opt = ct_strategy_optim(t->s);
    else if (st == CT_EINVAL) t->usage = 1;
    if (st == CT_OK) ct_strategy_data_rank(t->s, &t->drank, &t->dsize);
    if (st == CT_OK && o->clip_filter) { /* globs that match nothing would clip nothing, silently */
        ct_param **ps;
        int np, hits = 0;
        if ((st = ct_module_params(t->model, &ps, &np)) == CT_OK) {
            for (int i = 0; i < np; i++) hits += ps[i]->requires_grad && train_clip_selects(ps[i], (void *)o->clip_filter);
            ct_free(ps);
        }
        if (st == CT_OK && !hits) {
            t->usage = 1;
            st = ct_error(CT_EINVAL, "--clip-filter '%s' matches no trainable parameter; parameters are named like "
                          "0.weight or h.0.attn.c_attn.weight (ctrain inspect lists a checkpoint's)", o->clip_filter);
        }
    }
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
    CT_TRY(ct_sampler_init(&t->sampler, t->train.n, o->batch, t->seed, t->shuffle, strcmp(o->last_batch, "keep") != 0));
    t->spe = ct_sampler_nbatches(&t->sampler);
    if (t->spe == 0) {
        t->usage = 1;
        return ct_error(CT_EINVAL, "the training set has %lld samples, fewer than one batch of %lld; lower --batch",
                        (long long)t->train.n, (long long)o->batch);
    }
    if (!o->steps && o->epochs > INT64_MAX / t->spe) {
        t->usage = 1;
        return ct_error(CT_EINVAL, "--epochs %lld of %lld steps each is more steps than can be counted; give at "
                        "most %lld epochs, or --steps", (long long)o->epochs, (long long)t->spe,
                        (long long)(INT64_MAX / t->spe));
    }
    t->total = o->steps ? o->steps : o->epochs * t->spe;
    if (t->pos > t->spe || t->pos < 0 || t->epoch < 0)
        return ct_error(CT_EFORMAT, "%s is at batch %lld of epoch %lld, but an epoch here has %lld batches; resume "
                        "with the same training set", o->resume, (long long)t->pos,
                        (long long)t->epoch, (long long)t->spe);
    /* A save at the end of an epoch records the next epoch (fill_meta), and
     * older ctrains also its position as spe: that epoch is already counted. */
    if (t->pos == t->spe) t->pos = 0;
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

/* --state-dict sharded and local write a directory. */
static int sharded(const trainer *t) { return strcmp(t->o->state_dict, "full") != 0; }

/* A --save path of the wrong kind fails now, not after the training it would lose. */
static ct_status check_save_target(trainer *t)
{
    struct stat sb;
    const char *p = t->o->save;
    if (!p || t->rank != 0 || stat(p, &sb) != 0) return CT_OK;
    if (sharded(t) && !S_ISDIR(sb.st_mode))
        return ct_error(CT_EINVAL, "--save %s: --state-dict %s writes a directory, but %s is a file; give a "
                        "directory path (or drop --state-dict to write one file)", p, t->o->state_dict, p);
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

    if (o->resume && !strcmp(o->resume, "latest")) CT_TRY(train_resolve_latest(t->g, o, t->latest, sizeof t->latest, &t->usage));
    ct_status chk = check_save_target(t);
    if (chk == CT_OK) chk = train_check_outputs(o, t->rank, t->world, sharded(t));
    if (chk != CT_OK) t->usage = 1;
    CT_TRY(ct_group_check(t->g, chk));
    st = read_checkpoints(t);
    if (st == CT_EINVAL && o->resume && !t->ck_path) t->usage = 1; /* --resume names the optimizer state */
    CT_TRY(ct_group_check(t->g, st));
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

    if (!o->data) o->data = cli_data_default(&t->cfg);
    st = cli_check_data_kind(&t->cfg, o->data);
    if (st != CT_OK) t->usage = 1;
    CT_TRY(ct_group_check(t->g, st));
    t->is_text = t->cfg.kind == CT_MODEL_GPT;
    if (t->is_text) {
        /* An epoch is as many windows as the training split has bytes. */
        st = cli_load_text(&t->cfg, o->data_dir, &t->text);
        t->train.n = t->text.ntrain / (t->cfg.context + 1);
        t->test.n = ct_text_val_windows(&t->text, t->cfg.context);
    } else {
        st = cli_load_data(o->data, o->data_dir, 1, o->limit_train, &t->train);
        if (st == CT_OK) st = cli_load_data(o->data, o->data_dir, 0, o->limit_test, &t->test);
        if (st == CT_OK) st = cli_check_input(&t->cfg, &t->train);
    }
    CT_TRY(ct_group_check(t->g, st));

    /* Shape-only: no rank ever holds the whole model unless its strategy
     * replicates it; each makes what it keeps, with a whole init's values. */
    int was = ct_module_shape_only(1);
    st = ct_model_build(&t->cfg, t->seed, &t->model);
    ct_module_shape_only(was);
    /* before the strategy lays the model out: the wrappers are modules of it */
    if (st == CT_OK && o->checkpoint_activation)
        st = ct_module_apply_activation_checkpointing(t->model, NULL, NULL, &t->nckpt);
    CT_TRY(ct_group_check(t->g, st));
    CT_TRY(ct_group_check(t->g, make_strategy(t)));

    st = CT_OK;
    if (t->ck_path) {
        /* the model, and on --resume the optimizer state, read through the strategy */
        st = ct_checkpoint_load(t->s, t->ck_path, o->resume != NULL);
        if (st != CT_OK) {
            /* Say which model the file holds, when its metadata tells. */
            char why[512], mine[300], theirs[300];
            snprintf(why, sizeof why, "%s", ct_last_error());
            cli_config_str(&t->cfg, mine, sizeof mine);
            ct_model_config c;
            int told = ct_model_config_from_meta(&t->ck.meta, &c) == CT_OK;
            if (told && strcmp(cli_config_str(&c, theirs, sizeof theirs), mine))
                st = ct_error(st, "%s holds %s, not the %s this run builds: %s", o->resume ? o->resume : o->init,
                              theirs, mine, why);
            else if (told) /* the model it describes is this one: the file itself is at fault */
                st = ct_error(st, "%s does not load: %s", o->resume ? o->resume : o->init, why);
            else
                st = ct_error(st, "%s does not fit this %s: %s", o->resume ? o->resume : o->init, mine, why);
        }
    }
    if (st == CT_OK) st = make_sampler(t);
    if (st == CT_OK) st = make_schedule(t);
    CT_TRY(ct_group_check(t->g, st));
    CT_TRY(train_agree_loaded(t->g, o, &t->cfg, t->train.n, t->test.n, (int64_t[]){t->step, t->epoch, t->pos, t->total},
                              t->seed, t->sched.base_lr, ct_optim_name(t->opt)));
    t->start_step = t->step;
    int64_t n = t->total > t->step ? t->total - t->step : 1;
    t->cap_step_s = n < STEP_TIMES_MAX ? n : STEP_TIMES_MAX; /* the median of a long run: its first steps' */
    t->step_s = ct_alloc(sizeof *t->step_s * (size_t)t->cap_step_s, CT_MEM_OTHER);
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
static ct_status train_step(trainer *t, int64_t *idx, double *sums, int *empty)
{
    int64_t count, global = ct_sampler_batch_size(&t->sampler, t->pos);
    CT_TRY(ct_sampler_batch(&t->sampler, t->pos, t->drank, t->dsize, idx, &count));
    *empty = 0;
    int joined = 0;
    if (!t->sampler.drop_last) {
        /* --last-batch keep: the short last batch may leave a rank fewer rows
         * than micro-batches (none, when the world size does not divide it).
         * Such a rank joins (ct_strategy_join): it runs the step on a shadow
         * batch, the first samples of the set, that counts as zeros, and the
         * others divide by the rows that are trained on. */
        int active, usable = count >= t->o->grad_accum;
        CT_TRY(ct_strategy_join(t->s, usable ? count : 0, &global, &active));
        if (!active) return *empty = 1, CT_OK; /* no rank can fill its micro-batches: nothing to train */
        if (!usable) {
            count = t->o->grad_accum;
            for (int64_t i = 0; i < count; i++) idx[i] = i;
            joined = 1;
        }
    }
    ct_batch b = {.global_rows = global, .sample0 = ct_sampler_first(&t->sampler, t->pos, t->drank, t->dsize)};
    ct_fwd_ctx ctx = {.training = 1, .seed = t->seed, .step = (uint64_t)t->step};
    ct_step_out out = {0, 0};
    ct_strategy_set_joined(t->s, joined);
    /* Text: random windows keyed by (seed, step, place in the global batch). */
    ct_status st = t->is_text ? ct_text_train_batch(&t->text, t->cfg.context, t->seed, (uint64_t)t->step, b.sample0,
                                                    count, &b.x, &b.y)
                              : cli_batch(&t->train, &t->cfg, idx, count, &b.x, &b.y);
    if (st == CT_OK) st = ct_strategy_train_step(t->s, &b, ct_loss_cross_entropy, NULL, &ctx, &out);
    ct_strategy_set_joined(t->s, 0);
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
    t->sum.io_bytes += s.io_bytes;
    if (t->nstats < 2) t->first_io_bytes += s.io_bytes;
    t->sum.nbuckets = s.nbuckets;
    t->nstats++;
}

/* The run's metadata: model (both files: the model's config, the seed,
 * the optimizer, the data) and side (the optimizer file only: what a resume
 * continues with).  ct_checkpoint_save adds the position and the save's id. */
static ct_status fill_meta(trainer *t, ct_meta *model, ct_meta *side)
{
    train_opts *o = t->o;
    CT_TRY(ct_model_config_to_meta(&t->cfg, model));
    CT_TRY(ct_meta_set(model, "ctrain.seed", "%llu", (unsigned long long)t->seed));
    CT_TRY(ct_meta_set(model, "ctrain.optim", "%s", ct_optim_name(t->opt)));
    CT_TRY(ct_meta_set(model, "ctrain.data", "%s", o->data));
    CT_TRY(ct_meta_set(side, "ctrain.batch", "%lld", (long long)o->batch));
    CT_TRY(ct_meta_set(side, "ctrain.shuffle", "%d", t->shuffle));
    CT_TRY(ct_meta_set(side, "ctrain.last_batch", "%s", o->last_batch));
    CT_TRY(ct_meta_set(side, "ctrain.train_samples", "%lld", (long long)t->train.n));
    const ct_optim_opts *oo = ct_optim_get_opts(t->opt);
    CT_TRY(ct_meta_set(side, "ctrain.lr", "%.17g", t->sched.base_lr));
    CT_TRY(ct_meta_set(side, "ctrain.weight_decay", "%.17g", oo->weight_decay));
    CT_TRY(ct_meta_set(side, "ctrain.momentum", "%.17g", oo->momentum));
    CT_TRY(ct_meta_set(side, "ctrain.beta1", "%.17g", oo->beta1));
    CT_TRY(ct_meta_set(side, "ctrain.beta2", "%.17g", oo->beta2));
    CT_TRY(ct_meta_set(side, "ctrain.no_decay", "%s", o->no_decay));
    CT_TRY(ct_meta_set(side, "ctrain.clip", "%.17g", o->clip));
    CT_TRY(ct_meta_set(side, "ctrain.clip_filter", "%s", o->clip_filter ? o->clip_filter : ""));
    if (isinf(o->clip_p)) CT_TRY(ct_meta_set(side, "ctrain.clip_norm", "inf"));
    else CT_TRY(ct_meta_set(side, "ctrain.clip_norm", "%.17g", o->clip_p));
    CT_TRY(ct_meta_set(side, "ctrain.schedule", "%s", ct_sched_name(t->sched.kind)));
    CT_TRY(ct_meta_set(side, "ctrain.warmup", "%lld", (long long)t->sched.warmup_steps));
    CT_TRY(ct_meta_set(side, "ctrain.total_steps", "%lld", (long long)t->sched.total_steps));
    CT_TRY(ct_meta_set(side, "ctrain.grad_accum", "%lld", (long long)o->grad_accum));
    return CT_OK;
}

/* Collective: the library's checkpoint (full: rank 0 writes; sharded and
 * local: every rank its share, rank 0 the indexes), as one unit. */
static ct_status save(trainer *t)
{
    ct_meta mm = {0}, sm = {0};
    train_opts *o = t->o;
    ct_mem_phase_begin(CT_PHASE_SAVE);
    /* A save at the end of an epoch records the next epoch at its start. */
    ct_ckpt_position pos = {t->step, t->pos == t->spe ? t->epoch + 1 : t->epoch, t->pos == t->spe ? 0 : t->pos};
    ct_ckpt_opts co = {!strcmp(o->state_dict, "full") ? CT_CKPT_FULL
                       : !strcmp(o->state_dict, "local") ? CT_CKPT_LOCAL : CT_CKPT_SHARDED,
                       &sm, o->keep_last};
    ct_status st = ct_group_check(t->g, fill_meta(t, &mm, &sm));
    snprintf(t->saved, sizeof t->saved, "%s", o->save);
    if (o->keep_last) ct_checkpoint_series_path(o->save, t->step, t->saved, sizeof t->saved);
    if (st == CT_OK) st = ct_checkpoint_save(t->s, o->save, &mm, &pos, &co);
    ct_meta_fini(&mm);
    ct_meta_fini(&sm);
    return st;
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
        if (!o->log_every) { /* no progress lines: the final loss is the last step's */
            win[0] = win[1] = 0;
            win_steps = 0;
            t_win = ct_now();
        }
        double lr = ct_strategy_lr(t->s), t_step = ct_now(), before[2] = {win[0], win[1]}, led0[CT_LEDGER_N];
        ct_ledger_read(led0);
        ct_comm_traffic tr0 = ct_comm_traffic_get();
        double cpu0 = ct_comm_thread_cpu_get();
        float norm = 0;
        int empty = 0;
        if ((st = train_step(t, idx, win, &empty)) != CT_OK) {
            st = loop_fail(t, st, "forward/backward");
            break;
        }
        if (empty) { /* every rank agreed: a last batch too small to train on */
            t->step++;
            t->pos++;
            continue;
        }
        if (o->clip > 0 && (st = ct_strategy_clip_grad_norm_filter(t->s, (float)o->clip, o->clip_p,
                                                                  o->clip_filter ? train_clip_selects : NULL,
                                                                  (void *)o->clip_filter, &norm))) {
            st = loop_fail(t, st, "gradient clipping");
            break;
        }
        int bad = 0;
        st = train_nonfinite(t->g, o->on_nonfinite, t->step, win[0] - before[0], norm, &bad, &t->skipped);
        if (st == CT_ECOMM) st = loop_fail(t, st, "the non-finite check");
        if (st != CT_OK) break;
        if (bad) { /* skipped: the step's batch is used up, the model and optimizer are as before */
            win[0] = before[0];
            win[1] = before[1];
            ct_strategy_zero_grad(t->s);
            t->step++;
            t->pos++;
            continue;
        }
        if ((st = ct_strategy_step(t->s))) {
            st = loop_fail(t, st, "optimizer step");
            break;
        }
        ct_strategy_zero_grad(t->s);
        double t_end = ct_now(), led1[CT_LEDGER_N];
        if (t->nstep_s < t->cap_step_s) t->step_s[t->nstep_s++] = t_end - t_step;
        ct_ledger_read(led1);
        for (int k = 0; k < CT_LEDGER_N; k++) t->ledger[k] += led1[k] - led0[k];
        t->step_total += t_end - t_step;
        ct_comm_traffic tr1 = ct_comm_traffic_get();
        t->traffic.sent += tr1.sent - tr0.sent;
        t->traffic.received += tr1.received - tr0.received;
        t->comm_cpu += ct_comm_thread_cpu_get() - cpu0;
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
        if (o->eval_every && t->step % o->eval_every == 0 && !last && (st = train_eval(t, prog))) {
            st = loop_fail(t, st, "evaluation");
            break;
        }
        if (o->save_every && t->step % o->save_every == 0 && !last && (st = save(t))) break;
    }
    ct_free(idx);
    return st;
}

static ct_status write_trace(trainer *t)
{
    char buf[4096];
    train_trace_path(t->o->trace, t->rank, t->world, buf, sizeof buf);
    return ct_trace_write(buf);
}

/* Everything but the memory reports (train_life reads them after). */
static void teardown(trainer *t)
{
    ct_mem_phase_begin(CT_PHASE_TEARDOWN);
    ct_strategy_destroy(t->s); /* and the optimizer it built */
    ct_module_destroy(t->model);
    ct_sampler_fini(&t->sampler);
    ct_dataset_fini(&t->train);
    ct_dataset_fini(&t->test);
    ct_text_fini(&t->text);
    ct_ckpt_info_fini(&t->ck);
    ct_free(t->nd);
    ct_free(t->step_s);
}

int train_run(train_opts *o)
{
    trainer t;
    memset(&t, 0, sizeof t);
    t.o = o;
    t.last_loss = NAN; /* none logged yet */
    t.last_eval_step = -1;
    t.g = ct_group_world();
    t.rank = ct_group_rank(t.g);
    t.world = ct_group_size(t.g);
    ct_status st = setup(&t);
    cli_progress prog;
    memset(&prog, 0, sizeof prog);
    double t0 = ct_now();
    if (st == CT_OK) {
        train_describe(&t);
        if (t.step >= t.total)
            cli_out("nothing to train: %s is at step %lld and this run stops at step %lld; raise --steps or "
                    "--epochs to continue it\n", o->resume ? o->resume : "the checkpoint", (long long)t.step,
                    (long long)t.total);
        st = o->resume && o->metrics && t.rank == 0 ? cli_metrics_rewind(o->metrics, t.step) : CT_OK;
        if (st == CT_OK) st = cli_progress_init(&prog, t.total, t.spe, o->metrics, o->resume != NULL);
        st = ct_group_check(t.g, st);
    }
    if (st == CT_OK) st = train_loop(&t, &prog);
    if (st == CT_OK) st = ct_strategy_memory(t.s, t.mem);
    /* The last step's evaluation, after the memory report (its peaks cover the training steps)
     * and before the summary (the metrics file's last line). */
    if (st == CT_OK && t.step > t.start_step && t.last_eval_step != t.step) st = train_eval(&t, &prog);
    double step_ms = train_median_step_ms(&t), seconds = ct_now() - t0 - t.eval_seconds;
    cli_progress_clear(&prog);
    if (st == CT_OK) st = train_report(&t, seconds);
    if (st == CT_OK && o->save) {
        st = save(&t);
        if (st == CT_OK && sharded(&t))
            cli_out("saved %s (sharded over %d rank%s; indexes %s/model.safetensors.index.json and "
                    "optim.safetensors.index.json)\n", t.saved, t.world, t.world == 1 ? "" : "s", t.saved);
        else if (st == CT_OK) {
            char side[4096];
            ct_checkpoint_optim_path(t.saved, side, sizeof side);
            cli_out("saved %s (optimizer state: %s)\n", t.saved, side);
        }
    }
    if (st == CT_OK && o->trace) st = ct_group_check(t.g, write_trace(&t));
    if (st != CT_OK) cli_err("train", "%s", ct_last_error());
    teardown(&t);
    /* The whole life's peaks, the metrics summary (its last line) and the run's last line of output. */
    if (st == CT_OK && (st = train_life(&t, &prog, step_ms)) != CT_OK) cli_err("train", "%s", ct_last_error());
    cli_progress_finish(&prog);
    ct_free(t.mem);
    ct_free(t.traffic_all);
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
    if (o.debug_collectives) setenv("CTRAIN_DEBUG", "collectives", 1); /* read (and agreed) by ct_comm_init */
    if (ct_comm_init(NULL, NULL) != CT_OK) {
        cli_err("train", "cannot start communication: %s", ct_last_error());
        return CLI_RUNTIME;
    }
    cli_rank = ct_group_rank(ct_group_world());
    cli_world = ct_group_size(ct_group_world());
    /* First of all, before any collective that depends on a setting. */
    if (train_agree(&o, ct_group_world()) != CT_OK) {
        cli_err("train", "%s", ct_last_error());
        rc = CLI_USAGE;
    } else if ((rc = train_check_world(&o, cli_world, err, sizeof err))) {
        if (cli_rank == 0) fprintf(stderr, "%s\n", err);
    } else {
        rc = train_run(&o);
    }
    ct_comm_finalize();
    return rc;
}

