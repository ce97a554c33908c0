/*
 * Pipeline parallelism (fairscale's Pipe / AsyncPipe, DeepSpeed's pipe x
 * ZeRO-1): set-up and the strategy entries.  A sequential model is cut into
 * stages of whole children ("balance": children per stage, as fairscale
 * counts nn.Sequential's children); with N ranks and P stages there are
 * N / P replicas of the pipeline (rank r is stage r % P of replica r / P)
 * and the ranks left over sit out with a warning.  Each rank keeps only its
 * stage: the other children are taken out of the model and freed, so a
 * rank's parameters, gradients and optimizer state are its stage's alone.
 * Names do not change (ct_module_detach keeps them), so state dicts and
 * dropout streams are the unsplit model's.  A parameter tied across stages
 * (the GPT's embedding and head) keeps a copy in each: pipe_tied.c.
 *
 * The stage runs inside a replica strategy over the stage's replicas (its
 * data-parallel group): DDP or ZeRO-1 when there are several replicas, so
 * pipe x DDP allreduces each stage's gradients with DDP's buckets and pipe x
 * ZeRO-1 shards each stage's optimizer state with the ZeRO core, nothing
 * copied; "none" for one.  The schedules are in pipe_sched.c, checkpoint
 * state in pipe_state.c.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pipe.h"

static const ct__opt_def pipe_opt_defs[] = {
    {"stages", CT__OPT_AUTO_INT, offsetof(pipe_opts, stages), "auto",
     "pipeline stages P (auto: balance's length, else the number of ranks); N ranks make N/P replicas", 0, NULL},
    {"balance", CT__OPT_TEXT, 0, "",
     "children of the sequential per stage, ':' separated (3:3:2); empty: balanced by parameter count", 0, NULL},
    {"chunks", CT__OPT_INT, offsetof(pipe_opts, chunks), "4",
     "micro-batches per step (the batch is cut as torch.chunk cuts it: the last piece may be smaller)", 0, NULL},
    {"schedule", CT__OPT_CHOICE, offsetof(pipe_opts, schedule), "1f1b",
     "gpipe (all forwards, then all backwards) or 1f1b (a stage holds at most P micro-batches)", 0,
     "gpipe|1f1b"},
    {"checkpoint", CT__OPT_CHOICE, offsetof(pipe_opts, checkpoint), "except_last",
     "recompute a micro-batch's stage forward in backward: always, except_last (micro-batch), never", 0,
     "always|except_last|never"},
    {"dp", CT__OPT_CHOICE, offsetof(pipe_opts, dp), "ddp",
     "data parallel between a stage's replicas: ddp, or zero1 (the stage's optimizer state sharded)", 0,
     "ddp|zero1"},
    {"deferred_batch_norm", CT__OPT_BOOL, offsetof(pipe_opts, deferred_batch_norm), "0",
     "batchnorm running statistics updated once per step over all its micro-batches, as if not split", 0, NULL},
};

static const pipe_opts *O(const ct_strategy *s) { return s->kopts; }

/* ---- balance: contiguous stages minimising the largest ------------------ */

ct_status ct_pipe_balance_weights(const double *w, int n, int nstages, int *balance)
{
    if (nstages < 1 || n < nstages)
        return ct_error(CT_EINVAL, "cannot cut %d layers into %d stages: every stage needs a layer", n, nstages);
    /* best[k][i]: the smallest possible largest stage when the first i layers
     * form k stages; cut[k][i]: where the last of them starts.  O(P n^2). */
    size_t cells = (size_t)(nstages + 1) * (size_t)(n + 1);
    double *best = ct_alloc(sizeof *best * cells, CT_MEM_OTHER), *pre = ct_alloc(sizeof *pre * (size_t)(n + 1), CT_MEM_OTHER);
    int *cut = ct_alloc(sizeof *cut * cells, CT_MEM_OTHER);
    if (!best || !pre || !cut) {
        ct_free(best);
        ct_free(pre);
        ct_free(cut);
        return CT_ENOMEM;
    }
#define AT(a, k, i) a[(size_t)(k) * (size_t)(n + 1) + (size_t)(i)]
    pre[0] = 0;
    for (int i = 0; i < n; i++) pre[i + 1] = pre[i] + (w[i] > 0 ? w[i] : 0);
    for (int k = 0; k <= nstages; k++)
        for (int i = 0; i <= n; i++) AT(best, k, i) = INFINITY;
    AT(best, 0, 0) = 0;
    for (int k = 1; k <= nstages; k++)
        for (int i = k; i <= n; i++)
            for (int j = k - 1; j < i; j++) { /* last stage is layers [j, i) */
                double v = fmax(AT(best, k - 1, j), pre[i] - pre[j]);
                if (v < AT(best, k, i)) {
                    AT(best, k, i) = v;
                    AT(cut, k, i) = j;
                }
            }
    for (int k = nstages, i = n; k >= 1; k--) {
        int j = AT(cut, k, i);
        balance[k - 1] = i - j;
        i = j;
    }
#undef AT
    ct_free(best);
    ct_free(pre);
    ct_free(cut);
    return CT_OK;
}

static ct_status need_sequential(const ct_module *seq, int nstages)
{
    if (!ct_module_is(seq, CT_MOD_SEQUENTIAL))
        return ct_error(CT_EINVAL, "pipe needs a sequential model (its children are what stages hold); got %s",
                        seq ? seq->ops->kind : "NULL");
    if (seq->nkids < nstages)
        return ct_error(CT_EINVAL, "the model has %d layers, fewer than %d stages; use fewer stages",
                        seq->nkids, nstages);
    return CT_OK;
}

ct_status ct_pipe_balance_by_params(ct_module *seq, int nstages, int *balance)
{
    CT_TRY(need_sequential(seq, nstages));
    double *w = ct_alloc(sizeof *w * (size_t)seq->nkids, CT_MEM_OTHER);
    if (!w) return CT_ENOMEM;
    ct_status st = CT_OK;
    for (int i = 0; i < seq->nkids && st == CT_OK; i++) /* -1: its list could not be allocated, not a weight */
        if ((w[i] = (double)ct_module_num_params(seq->kids[i])) < 0) st = CT_ENOMEM;
    if (st == CT_OK) st = ct_pipe_balance_weights(w, seq->nkids, nstages, balance);
    ct_free(w);
    return st;
}

ct_status ct_pipe_balance_by_time(ct_module *seq, ct_tensor *sample, int nstages, int *balance)
{
    CT_TRY(need_sequential(seq, nstages));
    if (!sample) return ct_error(CT_EINVAL, "balance by time needs a sample batch of the model's input");
    int n = seq->nkids;
    double *w = ct_alloc_zeroed(sizeof *w * (size_t)n, CT_MEM_OTHER);
    ct_tensor **x = ct_alloc_zeroed(sizeof *x * (size_t)(n + 1), CT_MEM_OTHER);
    ct_record **rec = ct_alloc_zeroed(sizeof *rec * (size_t)n, CT_MEM_OTHER);
    ct_status st = w && x && rec ? CT_OK : CT_ENOMEM;
    ct_fwd_ctx ctx = {.training = 1, .seed = 0, .step = 0, .sample0 = 0};
    /* Two rounds; the second is measured (the first warms caches and BLAS). */
    for (int round = 0; round < 2 && st == CT_OK; round++) {
        x[0] = ct_tensor_retain(sample);
        for (int i = 0; i < n && st == CT_OK; i++) {
            double t0 = ct_now();
            st = ct_module_forward(seq->kids[i], x[i], &x[i + 1], &rec[i], &ctx);
            w[i] = ct_now() - t0;
        }
        ct_tensor *g = NULL;
        if (st == CT_OK && x[n]->dtype != CT_F32)
            st = ct_error(CT_EINVAL, "balance by time: the model's output is %s, not F32", ct_dtype_name(x[n]->dtype));
        if (st == CT_OK && !(g = ct_tensor_create(CT_F32, x[n]->ndim, x[n]->shape, CT_MEM_ACT))) st = CT_ENOMEM;
        if (g) ct_tensor_fill(g, 1.0f);
        for (int i = n - 1; i >= 0 && st == CT_OK; i--) {
            ct_tensor *din = NULL;
            double t0 = ct_now();
            st = ct_module_backward(seq->kids[i], g, i ? &din : NULL, rec[i]);
            rec[i] = NULL;
            w[i] += ct_now() - t0;
            ct_tensor_release(g);
            g = din;
        }
        ct_tensor_release(g);
        for (int i = 0; i <= n; i++) {
            if (i < n) ct_record_destroy(rec[i]);
            if (i < n) rec[i] = NULL;
            ct_tensor_release(x[i]);
            x[i] = NULL;
        }
    }
    ct_module_zero_grad(seq); /* the measurement's gradients are not the caller's */
    if (st == CT_OK) st = ct_pipe_balance_weights(w, n, nstages, balance);
    ct_free(w);
    ct_free(x);
    ct_free(rec);
    return st;
}

/* ---- set-up --------------------------------------------------------------- */

/* "3:3:2" (also accepts ',') into a new array; CT_EINVAL naming a bad entry. */
/* fairscale refuses a module that appears twice (its stages would share
 * it): the same module object twice in the tree, or two parameters sharing
 * memory.  One parameter listed by several modules (ct_module_share_param)
 * is a tied weight, which pipe_tied.c trains across stages;
 * ct_module_params lists it once. */
static ct_status check_no_duplicates(ct_module *m)
{
    ct_module **mods = NULL;
    ct_param **ps = NULL;
    int nm = 0, np = 0;
    ct_status st = ct_module_modules(m, &mods, &nm);
    if (st == CT_OK) st = ct_module_params(m, &ps, &np);
    for (int i = 0; st == CT_OK && i < nm; i++)
        for (int j = 0; j < i; j++)
            if (mods[i] == mods[j]) {
                st = ct_error(CT_EINVAL, "pipe: module '%s' (%s) appears twice in the model; a layer can be in "
                              "only one stage: give each place its own layer", mods[i]->fqn, mods[i]->ops->kind);
                break;
            }
    for (int i = 0; st == CT_OK && i < np; i++)
        for (int j = 0; j < i; j++)
            if (ps[i] == ps[j] || ps[i]->data->storage == ps[j]->data->storage) {
                st = ct_error(CT_EINVAL, "pipe: parameters '%s' and '%s' share memory (a layer used twice, or tied "
                              "weights); stages cannot share a parameter", ps[j]->name, ps[i]->name);
                break;
            }
    ct_free(mods);
    ct_free(ps);
    return st;
}

static ct_status keep_names(pipe_t *p, ct_strategy *s)
{
    p->names = ct_alloc(sizeof *p->names * (size_t)(s->nparams + s->nbuffers + 1), CT_MEM_OTHER);
    if (!p->names) return CT_ENOMEM;
    for (int i = 0; i < s->nparams + s->nbuffers; i++) {
        const char *name = i < s->nparams ? s->params[i]->name : s->buffers[i - s->nparams]->name;
        size_t len = strlen(name) + 1;
        if (!(p->names[i] = ct_alloc(len, CT_MEM_OTHER))) return CT_ENOMEM;
        memcpy(p->names[i], name, len);
        p->nnames++;
    }
    return CT_OK;
}

static void pipe_fini(ct_strategy *s)
{
    pipe_t *p = ct__pipe(s);
    if (!p) return;
    ct_strategy_destroy(p->inner);
    s->opt = NULL; /* the replica strategy's, freed with it */
    ct_group_destroy(p->pg);
    ct_group_destroy(p->rg);
    ct__pipe_ties_fini(p);
    ct__pipe_skips_fini(p);
    for (int i = 0; i < p->nnames; i++) ct_free(p->names[i]);
    ct_free(p->names);
    ct_free(p->balance);
    ct_free(p->bns);
    ct_free(p);
    s->priv = NULL;
}

static ct_status plan(ct_strategy *s, pipe_t *p)
{
    const pipe_opts *o = O(s);
    ct_module *m = s->model;
    if (!ct_module_is(m, CT_MOD_SEQUENTIAL))
        return ct_error(CT_EINVAL, "pipe needs a sequential model (its children are what stages hold); got %s",
                        m->ops->kind);
    if (s->common.grad_accum != 1)
        return ct_error(CT_EINVAL, "pipe cuts each batch into micro-batches itself: use chunks=%d instead of "
                        "grad_accum=%d", s->common.grad_accum, s->common.grad_accum);
    if (o->chunks > 16000)
        return ct_error(CT_EINVAL, "pipe: chunks=%d is more than 16000 micro-batches (message tags run out); "
                        "use fewer", o->chunks);
    int nbal = 0, stages = o->stages;
    CT_TRY(ct__parse_balance("pipe", ct_strategy_opt(s, "balance"), 0, &p->balance, &nbal));
    if (nbal && stages && nbal != stages)
        return ct_error(CT_EINVAL, "pipe: stages=%d but balance lists %d stages; give one or make them agree",
                        stages, nbal);
    if (!stages) stages = nbal ? nbal : ct_group_size(s->g);
    int size = ct_group_size(s->g);
    if (size < stages)
        return ct_error(CT_EINVAL, "too few ranks to hold given partitions (ranks: %d, partitions: %d); run "
                        "with at least %d ranks or use fewer stages", size, stages, stages);
    if (nbal) {
        int sum = 0;
        for (int i = 0; i < nbal; i++) sum += p->balance[i];
        if (sum != m->nkids)
            return ct_error(CT_EINVAL, "module and sum of balance have different length (module: %d, sum of "
                            "balance: %d); balance counts the sequential's children, activations included",
                            m->nkids, sum);
    } else {
        ct_free(p->balance);
        if (!(p->balance = ct_alloc(sizeof *p->balance * (size_t)stages, CT_MEM_OTHER))) return CT_ENOMEM;
        CT_TRY(ct_pipe_balance_by_params(m, stages, p->balance));
    }
    CT_TRY(check_no_duplicates(m));
    p->nstages = stages;
    p->replicas = size / stages;
    /* ct_strategy_opt tells what was settled: "4:4", not "" */
    char text[512];
    int off = 0;
    for (int k = 0; k < stages && off < (int)sizeof text - 12; k++)
        off += snprintf(text + off, sizeof text - (size_t)off, "%s%d", k ? ":" : "", p->balance[k]);
    CT_TRY(ct__opts_set_text(s, "balance", text));
    snprintf(text, sizeof text, "%d", stages);
    CT_TRY(ct__opts_set_text(s, "stages", text));
    int rank = ct_group_rank(s->g);
    p->stage = rank < p->replicas * stages ? rank % stages : -1;
    p->replica = p->stage >= 0 ? rank / stages : 0;
    p->lo = p->hi = 0;
    for (int k = 0; k < p->stage; k++) p->lo += p->balance[k];
    if (p->stage >= 0) p->hi = p->lo + p->balance[p->stage];
    if (p->stage < 0)
        ct_log(CT_LOG_WARN, "pipe: %d ranks make %d replica%s of %d stages; rank %d is left over and sits out "
               "(run with a multiple of %d ranks to use it)", size, p->replicas, p->replicas == 1 ? "" : "s",
               stages, rank, stages);
    return CT_OK;
}

static ct_status pipe_init(ct_strategy *s)
{
    pipe_t *p = ct_alloc_zeroed(sizeof *p, CT_MEM_OTHER);
    if (!p) return CT_ENOMEM;
    s->priv = p;
    CT_TRY(plan(s, p));
    CT_TRY(keep_names(p, s));
    CT_TRY(ct__pipe_ties_init(s, p)); /* while every stage's children are here */
    CT_TRY(ct__pipe_skips_init(s, p));
    CT_TRY(ct_group_split(s->g, p->stage >= 0 ? p->replica : CT_GROUP_NONE, p->stage, &p->pg));
    CT_TRY(ct_group_split(s->g, p->stage >= 0 ? p->stage : CT_GROUP_NONE, p->replica, &p->rg));
    /* Keep this stage's children; the others' memory goes (from the end, so indices hold). */
    for (int i = s->model->nkids - 1; i >= 0; i--)
        if (i < p->lo || i >= p->hi) ct_module_destroy(ct_module_detach(s->model, i));
    ct_free(s->params);
    ct_free(s->buffers);
    s->params = s->buffers = NULL;
    s->nparams = s->nbuffers = 0;
    CT_TRY(ct_module_params(s->model, &s->params, &s->nparams));
    CT_TRY(ct_module_buffers(s->model, &s->buffers, &s->nbuffers));
    ct__pipe_ties_adopt(s, p);
    /* Batchnorms: deferred to one update per step if asked (a recompute
     * leaves them alone by itself: ct_module_recompute). */
    ct_module **mods;
    int nm;
    CT_TRY(ct_module_modules(s->model, &mods, &nm));
    if (!(p->bns = ct_alloc(sizeof *p->bns * (size_t)(nm + 1), CT_MEM_OTHER))) {
        ct_free(mods);
        return CT_ENOMEM;
    }
    ct_status st = CT_OK;
    for (int i = 0; i < nm && st == CT_OK; i++)
        if (ct_module_is(mods[i], CT_MOD_RUNNING_STATS)) {
            p->bns[p->nbns++] = mods[i];
            if (O(s)->deferred_batch_norm) st = ct_batchnorm_set_mode(mods[i], CT_BN_DEFER);
        }
    ct_free(mods);
    return st;
}

/* The replica strategy over this stage, with the optimizer over what this
 * rank owns of it; its mixed precision is the pipeline's. */
static ct_status pipe_build_optim(ct_strategy *s, const ct_optim_opts *oo)
{
    pipe_t *p = ct__pipe(s);
    static const char *const dp_kinds[] = {"ddp", "zero1"};
    const char *kind = p->stage >= 0 && (p->replicas > 1 || O(s)->dp == PIPE_DP_ZERO1) ? dp_kinds[O(s)->dp] : "none";
    char opts[1024];
    int n = snprintf(opts, sizeof opts, "param_dtype=%s,reduce_dtype=%s", ct_strategy_opt(s, "param_dtype"),
                     ct_strategy_opt(s, "reduce_dtype"));
    if (strcmp(kind, "none"))
        for (int i = 0; i < CT__DDP_NOPTS; i++)
            n += snprintf(opts + n, sizeof opts - (size_t)n, ",%s=%s", ct__ddp_opt_defs[i].key,
                          ct_strategy_opt(s, ct__ddp_opt_defs[i].key));
    CT_TRY(ct_strategy_create(kind, s->model, oo, p->stage >= 0 ? p->rg : NULL, opts, &p->inner));
    s->opt = ct_strategy_optim(p->inner);
    s->common.param_dtype = CT_F32; /* the replica strategy keeps the compute copies */
    return CT_OK;
}

/* ---- entries ---------------------------------------------------------------- */

static ct_status spans_ranks(ct_strategy *s)
{
    (void)s;
    return ct_error(CT_EUNSUPPORTED, "pipe: a pipeline's forward and backward span ranks; train with "
                    "ct_strategy_train_step and infer with ct_strategy_predict");
}

/* The norm over every stage: each stage's term from its replica strategy
 * (whatever it shards) less the tied copies another stage counts, one
 * replica's terms combined over the group in rank order, so every rank,
 * sitting out or not, gets the same number. */
static ct_status pipe_grad_norm(ct_strategy *s, ct_norm_acc *acc)
{
    pipe_t *p = ct__pipe(s);
    ct_norm_acc term = ct_norm_acc_init(acc->p);
    if (p->stage >= 0) { /* the stage's strategy takes the clip's filter for the call */
        p->inner->clip_filter = s->clip_filter;
        p->inner->clip_ud = s->clip_ud;
        ct_status st = ct_strategy_grad_norm_acc(p->inner, &term);
        p->inner->clip_filter = NULL;
        p->inner->clip_ud = NULL;
        CT_TRY(st);
    }
    if (p->stage >= 0 && !term.inf) term.v = fmax(0.0, term.v - ct__pipe_ties_uncounted(s, p, term.p));
    if (p->stage < 0 || p->replica != 0) term.v = 0;
    CT_TRY(ct__norm_combine(s->g, &term));
    ct_norm_acc_add(acc, term.v);
    return CT_OK;
}

static void pipe_scale_grads(ct_strategy *s, float k)
{
    ct_strategy *in = ct__pipe(s)->inner;
    in->clip_filter = s->clip_filter;
    in->clip_ud = s->clip_ud;
    ct_strategy_scale_grads(in, k);
    in->clip_filter = NULL;
    in->clip_ud = NULL;
}

static void pipe_zero_grad(ct_strategy *s)
{
    ct_strategy_zero_grad(ct__pipe(s)->inner);
    ct__pipe(s)->ties_summed = 0;
}
static ct_status pipe_reduce(ct_strategy *s) { return ct_strategy_reduce(ct__pipe(s)->inner); }

/* The replica strategy steps the optimizer both share (the pipeline set its
 * learning rate), whether or not this rank's stage ran a backward (a rank
 * left over sits out but steps alike). */
static ct_status pipe_step(ct_strategy *s)
{
    ct_strategy *in = ct__pipe(s)->inner;
    in->backwards++;
    return ct_strategy_step(in);
}

static const ct_partition *pipe_partition(const ct_strategy *s)
{
    return ct_strategy_partition(ct__pipe(s)->inner);
}

static void pipe_data_rank(const ct_strategy *s, int *rank, int *size)
{
    const pipe_t *p = ct__pipe(s);
    *rank = p->replica;
    *size = p->replicas;
}

void ct_strategy_pipe_stage(const ct_strategy *s, int *stage, int *nstages)
{
    const pipe_t *p = !strcmp(ct_strategy_kind(s), "pipe") ? ct__pipe(s) : NULL;
    *stage = p ? p->stage : 0;
    *nstages = p ? p->nstages : 1;
}

const ct__strategy_ops ct__pipe_ops = {
    .kind = "pipe",
    .opts = pipe_opt_defs,
    .nopts = (int)(sizeof pipe_opt_defs / sizeof pipe_opt_defs[0]),
    .base_opts = ct__ddp_opt_defs,
    .nbase_opts = CT__DDP_NOPTS,
    .base_off = offsetof(pipe_opts, ddp),
    .opts_size = sizeof(pipe_opts),
    .makes_params = 1, /* its stage only: the replica strategy over the stage makes it */
    .place = {
        .init = pipe_init,
        .fini = pipe_fini,
        .build_optim = pipe_build_optim,
        .partition = pipe_partition,
        .data_rank = pipe_data_rank,
    },
    .sync = {
        .pre_forward = spans_ranks,
        .pre_backward = spans_ranks,
        .grad_norm = pipe_grad_norm,
        .scale_grads = pipe_scale_grads,
        .reduce = pipe_reduce,
        .step = pipe_step,
        .zero_grad = pipe_zero_grad,
        .train_step = ct__pipe_train_step,
        .predict = ct__pipe_predict,
    },
    .state = {
        .model = ct__pipe_model_state,
        .optim = ct__pipe_optim_state,
        .each = ct__pipe_each,
        .shard = ct__pipe_shard_state,
        .local = ct__pipe_local_state,
        .load = ct__pipe_load_state,
    },
};
