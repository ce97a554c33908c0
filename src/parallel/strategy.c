/*
 * The strategy interface: creation (the kind's table copied with the
 * replicated defaults of replicated.c filled in), dispatch to the entries,
 * validation of a train step, timing, clipping and the learning rate.
 * "none" is the strategy with no entries of its own.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"

/* Public entry points that may communicate run inside ct_comm_enter_call,
 * so a comm timeout or a CTRAIN_DEBUG=collectives mismatch names the call a
 * rank is in ("ct_strategy_model_state"), not only the collective. */
#define IN_CALL(name, expr)                               \
    do {                                                  \
        const char *prev_call_ = ct_comm_enter_call(name); \
        ct_status st_ = (expr);                           \
        ct_comm_leave_call(prev_call_);                   \
        return st_;                                       \
    } while (0)

static const ct__strategy_ops none_ops = {.kind = "none", .runs_alone = 1};

static const ct__strategy_ops *const kinds[] = {&none_ops, &ct__ddp_ops, &ct__zero1_ops, &ct__zero2_ops,
                                                   &ct__fsdp_ops, &ct__pipe_ops, &ct__offload_ops};

const char *ct_strategy_list(void) { return "none, ddp, zero1, zero2, fsdp, pipe, offload"; }

/* Nesting of ct_strategy_create on this thread: 1 for a user's call. */
static _Thread_local int create_depth;

static const ct__strategy_ops *find_kind(const char *kind)
{
    for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++)
        if (kind && !strcmp(kinds[i]->kind, kind)) return kinds[i];
    ct_error(CT_EINVAL, "unknown strategy '%s'; choose one of: %s", kind ? kind : "(null)", ct_strategy_list());
    return NULL;
}

ct_status ct_strategy_help(const char *kind, char *buf, size_t n)
{
    const ct__strategy_ops *ops = find_kind(kind);
    if (!ops) return CT_EINVAL;
    ct__opts_help(ops, buf, n);
    return CT_OK;
}

ct_status ct_strategy_check_opts(const char *kind, const char *opts, char *buf, size_t n)
{
    const ct__strategy_ops *ops = find_kind(kind);
    if (!ops) return CT_EINVAL;
    ct_strategy *s = ct_alloc_zeroed(sizeof *s, CT_MEM_OTHER); /* only its options are used */
    if (!s) return CT_ENOMEM;
    s->ops = ops;
    ct_status st = ct__opts_parse(s, opts);
    size_t off = 0;
    if (buf && n) buf[0] = 0;
    for (int i = 0; st == CT_OK && buf && i < s->nopt_text; i++) {
        off += (size_t)snprintf(buf + off, off < n ? n - off : 0, "%s=%s\n", s->opt_keys[i], s->opt_text[i]);
        if (off >= n) st = ct_error(CT_EINVAL, "strategy options of %s need a larger buffer than %zu bytes", kind, n);
    }
    ct__opts_free(s);
    ct_free(s);
    return st;
}

/* Every name an optimizer group gives is a parameter of the model: a rank
 * that shards may hold none of a group's pieces, so its optimizer cannot
 * tell a misspelt name from a parameter it does not own; the whole model
 * can. */
static ct_status check_group_names(const ct_strategy *s, const ct_optim_opts *o)
{
    for (int i = 0; i < o->ngroups; i++)
        for (int j = 0; j < o->groups[i].nparams; j++) {
            const char *nm = o->groups[i].params[j];
            int found = 0;
            for (int k = 0; k < s->nparams && !found; k++) found = s->params[k]->name && !strcmp(s->params[k]->name, nm);
            if (!found)
                return ct_error(CT_EINVAL, "optimizer group %d names '%s', which is not a parameter of the model; "
                                "give full names as ct_module_params lists them (e.g. '%s')", i, nm,
                                s->nparams && s->params[0]->name ? s->params[0]->name : "0.weight");
        }
    return CT_OK;
}

/* The optimizer spec with its groups' tables and names copied into one
 * block the strategy owns: the caller's names may point into the model
 * (ctrain train's do), and pipe frees the other stages' parameters before
 * its replica strategy builds the optimizer. */
static ct_status own_spec(ct_strategy *s, const ct_optim_opts *o)
{
    size_t bytes = sizeof(ct_optim_group) * (size_t)o->ngroups;
    for (int i = 0; i < o->ngroups; i++) {
        bytes += sizeof(char *) * (size_t)o->groups[i].nparams;
        for (int j = 0; j < o->groups[i].nparams; j++) bytes += strlen(o->groups[i].params[j]) + 1;
    }
    char *mem = ct_alloc(bytes + 1, CT_MEM_OTHER);
    if (!mem) return CT_ENOMEM;
    ct_optim_group *gs = (ct_optim_group *)mem;
    char *at = mem + sizeof(ct_optim_group) * (size_t)o->ngroups;
    for (int i = 0; i < o->ngroups; i++) {
        gs[i] = o->groups[i];
        const char **names = (const char **)(void *)at;
        at += sizeof(char *) * (size_t)o->groups[i].nparams;
        for (int j = 0; j < o->groups[i].nparams; j++) {
            size_t n = strlen(o->groups[i].params[j]) + 1;
            memcpy(at, o->groups[i].params[j], n);
            names[j] = at;
            at += n;
        }
        gs[i].params = names;
    }
    s->spec = *o;
    s->spec.groups = gs;
    s->spec_mem = mem;
    return CT_OK;
}

static ct_status create_impl(const char *kind, ct_module *model, const ct_optim_opts *optim,
                             ct_group *g, const char *opts, ct_strategy **out)
{
    *out = NULL;
    const ct__strategy_ops *ops = find_kind(kind);
    if (!ops) return CT_EINVAL;
    if (!model || !optim)
        return ct_error(CT_EINVAL, "strategy '%s' needs a model and an optimizer spec", kind);
    CT_TRY(ct_optim_validate(optim));
    if (!g) g = ct_group_world();
    if (!ops->runs_alone && !g)
        return ct_error(CT_ESTATE, "strategy '%s' needs communication: call ct_comm_init first", kind);
    ct_strategy *s = ct_alloc_zeroed(sizeof *s, CT_MEM_OTHER);
    if (!s) return CT_ENOMEM;
    memset(s, 0, sizeof *s);
    s->vt = *ops;
    ct__strategy_fill(&s->vt);
    s->ops = &s->vt;
    s->model = model;
    s->g = g;
    snprintf(s->who, sizeof s->who, "strategy %s", ops->kind);
    /* The model is borrowed until destroy: a second wrap, or destroying it meanwhile, is an
     * error.  A strategy made inside another's create (pipe's replicas of a stage) belongs to
     * that one, which holds for both. */
    ct_status st = CT_OK;
    if (create_depth == 1) {
        if ((st = ct_module_hold(model, s->who)) != CT_OK) {
            ct_free(s);
            return st;
        }
        s->held_model = model;
    }
    if (create_depth == 1 && g && !ops->runs_alone) {
        ct_comm_hold(s->who);
        s->held_comm = 1;
        /* Sharding, pipelining or averaging over one rank does nothing, and usually
         * means the program was started without its launcher. */
        if (ct_group_size(g) == 1)
            ct_log(CT_LOG_WARN, "strategy %s runs on 1 rank: there are no other ranks to shard, pipeline or "
                   "average over (started without mpirun?); start it with mpirun -np N, or use strategy none",
                   ops->kind);
    }
    if (st == CT_OK) st = ct__opts_parse(s, opts);
    if (st == CT_OK) st = ct_module_params(model, &s->params, &s->nparams);
    for (int i = 0; st == CT_OK && i < s->nparams; i++)
        if (!s->params[i]->shape_only && ct_tensor_check_data(s->params[i]->data) != CT_OK)
            st = ct_error(CT_ESTATE, "strategy %s: parameter '%s' has no values (a sharded strategy's destroy "
                          "freed them); to wrap a model again, summon its full parameters before destroying the "
                          "last strategy (ct_strategy_summon_full_params), or load a checkpoint into a new model",
                          ops->kind, s->params[i]->name);
    if (st == CT_OK) st = ct_module_buffers(model, &s->buffers, &s->nbuffers);
    /* checked on the whole model: a strategy made inside another (a pipeline stage's replicas) sees part of it */
    if (st == CT_OK && create_depth == 1) st = check_group_names(s, optim);
    if (st == CT_OK && (st = own_spec(s, optim)) == CT_OK) optim = &s->spec;
    if (st == CT_OK && !ops->makes_params) st = ct_module_materialize(model);
    if (st == CT_OK) st = s->vt.place.init(s);
    if (st == CT_OK) st = s->vt.place.build_optim(s, optim);
    if (st == CT_OK && !ops->manages_compute) st = ct__mixed_init(s);
    if (st == CT_OK) st = ct__syncbn_init(s);
    if (st == CT_OK) st = ct__buffers_init(s);
    /* After init, whose flats have hinted the automatic bound; a process-wide setting. */
    if (st == CT_OK && s->common.alloc_cache_mb >= 0) ct_mem_set_cache_limit((size_t)s->common.alloc_cache_mb << 20);
    if (st != CT_OK) {
        ct_strategy_destroy(s);
        return st;
    }
    *out = s;
    return CT_OK;
}

void ct_strategy_destroy(ct_strategy *s)
{
    if (!s) return;
    if (!create_depth) ct_mem_phase_begin(CT_PHASE_TEARDOWN); /* not a failed create's own clean-up */
    const char *prev = ct_comm_enter_call("ct_strategy_destroy");
    ct__syncbn_fini(s);
    ct__buffers_fini(s);
    ct__mixed_fini(s);
    if (s->priv) s->vt.place.fini(s);
    ct__comm_hook_free(s);
    ct_comm_leave_call(prev);
    ct_optim_destroy(s->opt);
    ct_free(s->spec_mem);
    ct__opts_free(s);
    ct_free(s->params);
    ct_free(s->buffers);
    ct_module_unhold(s->held_model);
    if (s->held_comm) ct_comm_unhold(s->who);
    ct_free(s);
}

const char *ct_strategy_kind(const ct_strategy *s) { return s->ops->kind; }
const ct_partition *ct_strategy_partition(const ct_strategy *s)
{
    return s->vt.place.partition(s);
}
ct_module *ct_strategy_model(const ct_strategy *s) { return s->model; }
ct_optim *ct_strategy_optim(const ct_strategy *s) { return s->opt; }
ct_group *ct_strategy_group(const ct_strategy *s) { return s->g; }
ct_step_stats ct_strategy_stats(const ct_strategy *s) { return s->last; }
void ct_strategy_set_no_sync(ct_strategy *s, int on) { s->no_sync = on; }

static ct_status reduce_impl(ct_strategy *s)
{
    return s->vt.sync.reduce(s);
}

/* ---- forward and backward ------------------------------------------------ */

static ct_status forward_impl(ct_strategy *s, ct_tensor *in, ct_tensor **out, ct_record **rec,
                              const ct_fwd_ctx *ctx)
{
    double t0 = ct_now();
    CT_TRY(s->vt.sync.pre_forward(s));
    ct_status st = ct_module_forward(s->model, in, out, rec, ctx);
    double t1 = ct_now();
    s->stats.forward += t1 - t0;
    ct_trace_event("forward", "step", t0, t1, 0);
    return st;
}

/* Backward from dout times scale.  Backward is linear in dout, so scaling
 * it scales every gradient: the mean over ranks and micro-batches costs
 * one pass over the loss gradient instead of one over all gradients. */
static ct_status backward_ex_impl(ct_strategy *s, ct_tensor *dout, ct_record *rec, float scale, ct_tensor **din)
{
    double t0 = ct_now();
    s->backwards++;
    ct_status st = s->vt.sync.pre_backward(s);
    if (st != CT_OK) {
        ct_record_destroy(rec);
        return st;
    }
    ct_tensor *g = dout;
    if (scale != 1.0f) {
        if (dout->dtype != CT_F32) {
            ct_record_destroy(rec);
            return ct_error(CT_EINVAL, "backward: the loss gradient is %s; it must be F32",
                            ct_dtype_name(dout->dtype));
        }
        if (!(g = ct_tensor_clone(dout, CT_MEM_ACT))) {
            ct_record_destroy(rec);
            return CT_ENOMEM;
        }
        float *gp = ct_f32(g);
        for (int64_t i = 0; i < g->numel; i++) gp[i] *= scale;
    }
    st = ct_module_backward(s->model, g, din, rec);
    if (g != dout) ct_tensor_release(g);
    double t1 = ct_now();
    s->stats.backward += t1 - t0;
    ct_trace_event("backward", "step", t0, t1, 0);
    if (st == CT_OK) st = s->vt.sync.post_backward(s);
    return st;
}

static ct_status backward_impl(ct_strategy *s, ct_tensor *dout, ct_record *rec)
{
    return backward_ex_impl(s, dout, rec, s->vt.sync.grad_scale(s), NULL);
}

ct_status ct_loss_cross_entropy(ct_tensor *out, ct_tensor *target, void *ud, float *loss, ct_tensor **dout)
{
    (void)ud;
    return ct_cross_entropy(out, target, -100, loss, dout);
}

static ct_status join_impl(ct_strategy *s, int64_t rows, int64_t *global_rows, int *active)
{
    if (rows < 0) return ct_error(CT_EINVAL, "join: rows is %lld; give 0 or more", (long long)rows);
    int64_t v[2] = {rows, rows > 0};
    if (s->g && strcmp(s->vt.kind, "none")) CT_TRY(ct_group_allreduce(s->g, v, 2, CT_I64, CT_OP_SUM, NULL)); /* none: alone */
    *global_rows = v[0];
    *active = (int)v[1];
    return CT_OK;
}

void ct_strategy_set_joined(ct_strategy *s, int joined) { s->joined = joined != 0; }

static ct_status train_step_impl(ct_strategy *s, const ct_batch *b, ct_loss_fn loss, void *ud,
                                 const ct_fwd_ctx *ctx, ct_step_out *out)
{
    ct_step_out local = {0, 0};
    if (out) *out = local;
    if (!b || !b->x || !b->y || !loss || !ctx)
        return ct_error(CT_EINVAL, "train step needs a batch (x and y), a loss and a context");
    int64_t nrows = b->x->ndim ? b->x->shape[0] : 0;
    int k = ct__strategy_owns_micro_batches(s) ? 1 : s->common.grad_accum;
    if (b->y->ndim == 0 || b->y->shape[0] != nrows)
        return ct_error(CT_EINVAL, "train step: x has %lld rows but y has %lld; they must match",
                        (long long)nrows, (long long)(b->y->ndim ? b->y->shape[0] : 0));
    if (nrows < k)
        return ct_error(CT_EINVAL, "train step: %lld rows on this rank cannot fill %d micro-batches "
                        "(grad_accum); give every rank at least %d rows or lower grad_accum",
                        (long long)nrows, k, k);
    int64_t global = ct__global_rows(s, b);
    if (global < nrows && !s->joined)
        return ct_error(CT_EINVAL, "train step: global_rows %lld is fewer than this rank's %lld rows",
                        (long long)global, (long long)nrows);
    CT_TRY(ct__check_rows(s, b, nrows, !strcmp(s->vt.kind, "none")));
    if (ct__strategy_owns_micro_batches(s)) s->backwards++; /* the strategy's own step runs the backward passes */
    ct_status st = s->vt.sync.train_step(s, b, loss, ud, ctx, &local);
    if (out) *out = local;
    return st;
}

/* ---- clip, step, zero_grad, lr ------------------------------------------- */

/* Gradients marked zero by the lazy zero_grad that no backward wrote since. */
static void sync_grads(ct_strategy *s)
{
    for (int i = 0; i < s->nparams; i++) ct_param_grad_sync(s->params[i]);
}

ct_status ct__norm_combine(ct_group *g, ct_norm_acc *a)
{
    int size = g ? ct_group_size(g) : 1;
    if (size == 1) return CT_OK;
    double *all = ct_alloc(sizeof *all * (size_t)size, CT_MEM_COMM);
    if (!all) return CT_ENOMEM;
    ct_status st = ct_group_allgather(g, &a->v, all, (int64_t)sizeof a->v, CT_U8, NULL);
    if (st == CT_OK) {
        a->v = 0;
        for (int r = 0; r < size; r++) ct_norm_acc_add(a, all[r]);
    }
    ct_free(all);
    return st;
}

static ct_status grad_norm_acc_impl(ct_strategy *s, ct_norm_acc *acc)
{
    sync_grads(s);
    return s->vt.sync.grad_norm(s, acc);
}

void ct_strategy_scale_grads(ct_strategy *s, float k) { s->vt.sync.scale_grads(s, k); }

int ct__clip_selects(const ct_strategy *s, const ct_param *p) { return !s->clip_filter || s->clip_filter(p, s->clip_ud); }

static ct_status clip_grad_norm_impl(ct_strategy *s, float max_norm, double norm_type, float *norm)
{
    if (!(max_norm >= 0))
        return ct_error(CT_EINVAL, "clip: max_norm must be >= 0 (got %g)", (double)max_norm);
    if (!ct_norm_type_ok(norm_type))
        return ct_error(CT_EINVAL, "clip: norm_type %g is invalid; use a number > 0 or infinity (2 is the usual)",
                        norm_type);
    ct_norm_acc acc = ct_norm_acc_init(norm_type);
    CT_TRY(grad_norm_acc_impl(s, &acc));
    double total = ct_norm_acc_norm(&acc);
    if (norm) *norm = (float)total;
    float coef = ct_clip_coef(total, max_norm);
    if (coef < 1.0f) s->vt.sync.scale_grads(s, coef);
    return CT_OK;
}

void ct_strategy_set_lr(ct_strategy *s, double lr)
{
    s->has_sched = 0;
    ct_optim_set_lr(s->opt, lr);
}

ct_status ct_strategy_set_schedule(ct_strategy *s, const ct_lr_schedule *sched)
{
    CT_TRY(ct_sched_validate(sched));
    s->sched = *sched;
    s->has_sched = 1;
    ct_optim_set_lr(s->opt, ct_lr_at(sched, ct_optim_get_step(s->opt)));
    return CT_OK;
}

double ct_strategy_lr(const ct_strategy *s)
{
    return s->has_sched ? ct_lr_at(&s->sched, ct_optim_get_step(s->opt)) : ct_optim_get_lr(s->opt);
}

static ct_status step_impl(ct_strategy *s)
{
    /* No backward since the last step: every gradient is what PyTorch leaves as None,
     * and its optimizers skip such parameters (no update, no weight decay, no step
     * count).  A backward is collective, so every rank of the group skips alike. */
    if (s->backwards == 0) return CT_OK;
    s->backwards = 0;
    double t0 = ct_now();
    sync_grads(s);
    if (s->has_sched) ct_optim_set_lr(s->opt, ct_lr_at(&s->sched, ct_optim_get_step(s->opt)));
    ct_status st = s->vt.sync.step(s);
    double t1 = ct_now();
    ct_trace_event("optimizer", "step", t0, t1, 0);
    s->stats.optimizer += t1 - t0;
    if (s->stats.comm_total > 0) {
        double ov = 1.0 - s->stats.comm_wait / s->stats.comm_total;
        s->stats.overlap = ov < 0 ? 0 : ov > 1 ? 1 : ov;
    } else {
        s->stats.overlap = 1;
    }
    s->last = s->stats;
    memset(&s->stats, 0, sizeof s->stats);
    s->stats.nbuckets = s->last.nbuckets;
    return st;
}

void ct_strategy_zero_grad(ct_strategy *s) { s->vt.sync.zero_grad(s); }

static ct_status predict_impl(ct_strategy *s, ct_tensor *x, const ct_fwd_ctx *ctx, ct_tensor **out)
{
    *out = NULL;
    if (!x || !ctx) return ct_error(CT_EINVAL, "predict needs an input and a context");
    return s->vt.sync.predict(s, x, ctx, out);
}

void ct_strategy_data_rank(const ct_strategy *s, int *rank, int *size)
{
    s->vt.place.data_rank(s, rank, size);
}

static ct_status memory_impl(ct_strategy *s, ct_mem_report *all) { return ct_group_mem_reports(s->g, all); }

static ct_status summon_full_params_impl(ct_strategy *s, int writeback, int rank0_only)
{
    return s->vt.place.summon(s, writeback, rank0_only);
}

static ct_status release_full_params_impl(ct_strategy *s)
{
    return s->vt.place.release(s);
}

/* ---- state ----------------------------------------------------------------- */

static ct_status model_state_impl(ct_strategy *s, ct_state *out)
{
    memset(out, 0, sizeof *out);
    return s->vt.state.model(s, out);
}

static ct_status optim_state_impl(ct_strategy *s, ct_state *out)
{
    memset(out, 0, sizeof *out);
    return s->vt.state.optim(s, out);
}

static ct_status shard_state_impl(ct_strategy *s, int optim, ct_state *out)
{
    memset(out, 0, sizeof *out);
    return s->vt.state.shard(s, optim, out);
}

static ct_status state_foreach_impl(ct_strategy *s, int optim, int shapes_only, ct_state_fn fn, void *ud)
{
    if (!fn) return ct_error(CT_EINVAL, "ct_strategy_state_foreach: fn is NULL");
    return s->vt.state.each(s, optim, shapes_only, fn, ud);
}

static ct_status share_foreach_impl(ct_strategy *s, int optim, int local, int shapes_only, ct_state_fn fn, void *ud)
{
    if (!fn) return ct_error(CT_EINVAL, "ct_strategy_share_foreach: fn is NULL");
    return s->vt.state.share(s, optim, local, shapes_only, fn, ud);
}

static ct_status local_state_impl(ct_strategy *s, int optim, ct_state *out)
{
    memset(out, 0, sizeof *out);
    return s->vt.state.local(s, optim, out);
}

static ct_status load_state_impl(ct_strategy *s, const char *const *names, ct_tensor *const *tensors,
                                 int n, int optim, const ct_state_source *src)
{
    CT_TRY(ct__strategy_load(s, names, tensors, n, optim, src, NULL));
    /* New master weights: the compute copies follow. */
    return optim || s->ops->manages_compute ? CT_OK : ct__mixed_refresh(s);
}

/* ---- the public entry points, each inside its call name (IN_CALL) ---------- */

ct_status ct_strategy_create(const char *kind, ct_module *model, const ct_optim_opts *optim,
                             ct_group *g, const char *opts, ct_strategy **out)
{
    if (!create_depth) ct_mem_phase_begin(CT_PHASE_WRAP);
    create_depth++;
    const char *prev = ct_comm_enter_call("ct_strategy_create");
    ct_status st = create_impl(kind, model, optim, g, opts, out);
    ct_comm_leave_call(prev);
    create_depth--;
    return st;
}

ct_status ct_strategy_train_step(ct_strategy *s, const ct_batch *b, ct_loss_fn loss, void *ud,
                                 const ct_fwd_ctx *ctx, ct_step_out *out)
{
    ct_mem_phase_begin(CT_PHASE_TRAIN);
    IN_CALL("ct_strategy_train_step", train_step_impl(s, b, loss, ud, ctx, out));
}

ct_status ct_strategy_backward(ct_strategy *s, ct_tensor *dout, ct_record *rec)
{
    IN_CALL("ct_strategy_backward", backward_impl(s, dout, rec));
}

ct_status ct_strategy_reduce(ct_strategy *s)
{
    IN_CALL("ct_strategy_reduce", reduce_impl(s));
}

ct_status ct_strategy_join(ct_strategy *s, int64_t rows, int64_t *global_rows, int *active)
{
    IN_CALL("ct_strategy_join", join_impl(s, rows, global_rows, active));
}

ct_status ct_strategy_clip_grad_norm(ct_strategy *s, float max_norm, double norm_type, float *norm)
{
    IN_CALL("ct_strategy_clip_grad_norm", clip_grad_norm_impl(s, max_norm, norm_type, norm));
}

/* The filter rides on s for the one clip (every strategy's grad_norm and
 * scale_grads ask ct__clip_selects), so the mechanism stays the one norm. */
static ct_status clip_filter_impl(ct_strategy *s, float max_norm, double norm_type, ct_param_filter_fn filter,
                                  void *ud, float *norm)
{
    const char *off = ct_strategy_opt(s, "offload");
    if (filter && !strcmp(s->ops->kind, "fsdp") && off && strcmp(off, "none"))
        return ct_error(CT_EUNSUPPORTED, "clip: a parameter filter under fsdp offload=%s: its norm terms and clip "
                        "factors are kept per flat, not per parameter; clip every parameter, or keep the shards in "
                        "memory (offload=none)", off);
    s->clip_filter = filter;
    s->clip_ud = ud;
    ct_status st = clip_grad_norm_impl(s, max_norm, norm_type, norm);
    s->clip_filter = NULL;
    s->clip_ud = NULL;
    return st;
}

ct_status ct_strategy_clip_grad_norm_filter(ct_strategy *s, float max_norm, double norm_type,
                                            ct_param_filter_fn filter, void *ud, float *norm)
{
    IN_CALL("ct_strategy_clip_grad_norm_filter", clip_filter_impl(s, max_norm, norm_type, filter, ud, norm));
}

ct_status ct_strategy_step(ct_strategy *s)
{
    ct_mem_phase_begin(CT_PHASE_TRAIN);
    IN_CALL("ct_strategy_step", step_impl(s));
}

ct_status ct_strategy_predict(ct_strategy *s, ct_tensor *x, const ct_fwd_ctx *ctx, ct_tensor **out)
{
    IN_CALL("ct_strategy_predict", predict_impl(s, x, ctx, out));
}

ct_status ct_strategy_memory(ct_strategy *s, ct_mem_report *all)
{
    IN_CALL("ct_strategy_memory", memory_impl(s, all));
}

ct_status ct_strategy_summon_full_params(ct_strategy *s, int writeback, int rank0_only)
{
    IN_CALL("ct_strategy_summon_full_params", summon_full_params_impl(s, writeback, rank0_only));
}

ct_status ct_strategy_release_full_params(ct_strategy *s)
{
    IN_CALL("ct_strategy_release_full_params", release_full_params_impl(s));
}

/* nn.Module.apply's order: the children (each with its own), then m. */
static ct_status apply_tree(ct_module *m, ct_module_fn fn, void *ud)
{
    for (int i = 0; i < m->nkids; i++) CT_TRY(apply_tree(m->kids[i], fn, ud));
    return fn(m, ud);
}

static ct_status apply_impl(ct_strategy *s, ct_module_fn fn, void *ud)
{
    if (!fn) return ct_error(CT_EINVAL, "ct_strategy_apply: fn is NULL");
    CT_TRY(summon_full_params_impl(s, 1, 0));
    ct_status st = apply_tree(s->model, fn, ud);
    char why[512] = "";
    if (st != CT_OK) snprintf(why, sizeof why, "%s", ct_last_error());
    ct_status r = release_full_params_impl(s); /* every rank releases, whatever fn did */
    if (r == CT_OK && !s->ops->manages_compute) r = ct__mixed_refresh(s);
    if (st != CT_OK) return ct_error(st, "ct_strategy_apply: %s", why);
    return r;
}

ct_status ct_strategy_apply(ct_strategy *s, ct_module_fn fn, void *ud)
{
    IN_CALL("ct_strategy_apply", apply_impl(s, fn, ud));
}

ct_status ct_strategy_model_state(ct_strategy *s, ct_state *out)
{
    ct_mem_phase_begin(CT_PHASE_SAVE);
    IN_CALL("ct_strategy_model_state", model_state_impl(s, out));
}

ct_status ct_strategy_optim_state(ct_strategy *s, ct_state *out)
{
    ct_mem_phase_begin(CT_PHASE_SAVE);
    IN_CALL("ct_strategy_optim_state", optim_state_impl(s, out));
}

ct_status ct_strategy_shard_state(ct_strategy *s, int optim, ct_state *out)
{
    ct_mem_phase_begin(CT_PHASE_SAVE);
    IN_CALL("ct_strategy_shard_state", shard_state_impl(s, optim, out));
}

ct_status ct_strategy_state_foreach(ct_strategy *s, int optim, int shapes_only, ct_state_fn fn, void *ud)
{
    IN_CALL("ct_strategy_state_foreach", state_foreach_impl(s, optim, shapes_only, fn, ud));
}

ct_status ct_strategy_share_foreach(ct_strategy *s, int optim, int local, int shapes_only, ct_state_fn fn, void *ud)
{
    ct_mem_phase_begin(CT_PHASE_SAVE);
    IN_CALL("ct_strategy_share_foreach", share_foreach_impl(s, optim, local, shapes_only, fn, ud));
}

ct_status ct_strategy_local_state(ct_strategy *s, int optim, ct_state *out)
{
    ct_mem_phase_begin(CT_PHASE_SAVE);
    IN_CALL("ct_strategy_local_state", local_state_impl(s, optim, out));
}

ct_status ct_strategy_load_state(ct_strategy *s, const char *const *names, ct_tensor *const *tensors,
                                 int n, int optim)
{
    ct_mem_phase_begin(CT_PHASE_LOAD);
    IN_CALL("ct_strategy_load_state", load_state_impl(s, names, tensors, n, optim, NULL));
}

ct_status ct_strategy_load_source(ct_strategy *s, const char *const *names, ct_tensor *const *tensors, int n,
                                  int optim, const ct_state_source *src)
{
    if (src && !src->read) return ct_error(CT_EINVAL, "ct_strategy_load_source: the source has no read function");
    ct_mem_phase_begin(CT_PHASE_LOAD);
    IN_CALL("ct_strategy_load_source", load_state_impl(s, names, tensors, n, optim, src));
}

ct_status ct_strategy_forward(ct_strategy *s, ct_tensor *in, ct_tensor **out, ct_record **rec,
                              const ct_fwd_ctx *ctx)
{
    IN_CALL("ct_strategy_forward", forward_impl(s, in, out, rec, ctx));
}

ct_status ct_strategy_pre_forward(ct_strategy *s)
{
    IN_CALL("ct_strategy_pre_forward", s->vt.sync.pre_forward(s));
}

ct_status ct_strategy_backward_ex(ct_strategy *s, ct_tensor *dout, ct_record *rec, float scale, ct_tensor **din)
{
    IN_CALL("ct_strategy_backward_ex", backward_ex_impl(s, dout, rec, scale, din));
}

ct_status ct_strategy_grad_norm_acc(ct_strategy *s, ct_norm_acc *acc)
{
    IN_CALL("ct_strategy_grad_norm_acc", grad_norm_acc_impl(s, acc));
}
