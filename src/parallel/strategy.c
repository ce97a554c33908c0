/*
 * The strategy interface: dispatch to the strategy's own entries, with the
 * replicated defaults (whole synchronised gradients on every rank) where a
 * strategy has none; the train step with its micro-batches; timing; the
 * learning rate.  "none" is the strategy with no entries at all.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"

static const ct__strategy_ops none_ops = {.kind = "none", .runs_alone = 1};

static const ct__strategy_ops *const kinds[] = {&none_ops, &ct__ddp_ops, &ct__zero1_ops, &ct__zero2_ops,
                                                   &ct__fsdp_ops, &ct__pipe_ops, &ct__offload_ops};

const char *ct_strategy_list(void) { return "none, ddp, zero1, zero2, fsdp, pipe, offload"; }

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

/* Whole-parameter optimizer over every trainable parameter: what a rank
 * that holds the whole model owns. */
static ct_status build_whole_optim(ct_strategy *s, const ct_optim_opts *o)
{
    s->opt = ct_optim_create(o, s->params, s->nparams);
    return s->opt ? CT_OK : ct_last_status(); /* CT_ENOMEM stays CT_ENOMEM (found by the allocation walk) */
}

ct_status ct_strategy_create(const char *kind, ct_module *model, const ct_optim_opts *optim,
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
    s->ops = ops;
    s->model = model;
    s->g = g;
    ct_status st = ct__opts_parse(s, opts);
    if (st == CT_OK) st = ct_module_params(model, &s->params, &s->nparams);
    if (st == CT_OK) st = ct_module_buffers(model, &s->buffers, &s->nbuffers);
    if (st == CT_OK && ops->init) st = ops->init(s);
    if (st == CT_OK) st = ops->build_optim ? ops->build_optim(s, optim) : build_whole_optim(s, optim);
    if (st == CT_OK && !ops->manages_compute) st = ct__mixed_init(s);
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
    ct__mixed_fini(s);
    if ((s->priv || s->ext) && s->ops->fini) s->ops->fini(s);
    ct__comm_hook_free(s);
    ct_optim_destroy(s->opt);
    ct__opts_free(s);
    ct_free(s->params);
    ct_free(s->buffers);
    ct_free(s);
}

const char *ct_strategy_kind(const ct_strategy *s) { return s->ops->kind; }
const ct_partition *ct_strategy_partition(const ct_strategy *s)
{
    return s->ops->partition ? s->ops->partition(s) : NULL;
}
ct_module *ct_strategy_model(const ct_strategy *s) { return s->model; }
ct_optim *ct_strategy_optim(const ct_strategy *s) { return s->opt; }
ct_group *ct_strategy_group(const ct_strategy *s) { return s->g; }
ct_step_stats ct_strategy_stats(const ct_strategy *s) { return s->last; }
void ct_strategy_set_no_sync(ct_strategy *s, int on) { s->no_sync = on; }

ct_status ct_strategy_reduce(ct_strategy *s)
{
    return s->ops->reduce ? s->ops->reduce(s) : CT_OK;
}

/* ---- forward and backward ------------------------------------------------ */

ct_status ct_strategy_forward(ct_strategy *s, ct_tensor *in, ct_tensor **out, ct_record **rec,
                              const ct_fwd_ctx *ctx)
{
    double t0 = ct_now();
    if (s->ops->pre_forward) CT_TRY(s->ops->pre_forward(s));
    ct_status st = ct_module_forward(s->model, in, out, rec, ctx);
    double t1 = ct_now();
    s->stats.forward += t1 - t0;
    ct_trace_event("forward", "step", t0, t1, 0);
    return st;
}

/* Backward from dout times scale.  Backward is linear in dout, so scaling
 * it scales every gradient: the mean over ranks and micro-batches costs
 * one pass over the loss gradient instead of one over all gradients. */
ct_status ct__strategy_backward_ex(ct_strategy *s, ct_tensor *dout, ct_record *rec, float scale,
                                   ct_tensor **din)
{
    double t0 = ct_now();
    ct_status st = s->ops->pre_backward ? s->ops->pre_backward(s) : CT_OK;
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
    if (st == CT_OK && s->ops->post_backward) st = s->ops->post_backward(s);
    return st;
}

ct_status ct_strategy_backward(ct_strategy *s, ct_tensor *dout, ct_record *rec)
{
    return ct__strategy_backward_ex(s, dout, rec, s->ops->grad_scale ? s->ops->grad_scale(s) : 1.0f, NULL);
}

ct_status ct_loss_cross_entropy(ct_tensor *out, ct_tensor *target, void *ud, float *loss, ct_tensor **dout)
{
    (void)ud;
    return ct_cross_entropy(out, target, -100, loss, dout);
}

/* Rows [r0, r0 + n) of t: a view (rows are contiguous). */
static ct_tensor *rows(ct_tensor *t, int64_t r0, int64_t n)
{
    int64_t shape[CT_MAX_DIMS];
    memcpy(shape, t->shape, sizeof shape);
    shape[0] = n;
    return ct_tensor_view(t, r0 * (t->numel / t->shape[0]), t->ndim, shape);
}

static ct_status micro_step(ct_strategy *s, const ct_batch *b, int64_t r0, int64_t n, int64_t global,
                            ct_loss_fn loss, void *ud, ct_fwd_ctx ctx, ct_step_out *out)
{
    ct_tensor *x = rows(b->x, r0, n), *y = rows(b->y, r0, n), *z = NULL, *dz = NULL;
    ct_record *rec = NULL;
    float l = 0;
    ctx.sample0 = b->sample0 + r0;
    ct_status st = x && y ? CT_OK : CT_ENOMEM;
    if (st == CT_OK) st = ct_strategy_forward(s, x, &z, &rec, &ctx);
    if (st == CT_OK) st = loss(z, y, ud, &l, &dz);
    if (st == CT_OK) {
        if (!s->joined) {
            out->loss_sum += (double)l * (double)n;
            out->rows += n;
        }
        /* d(global mean)/d(micro-batch mean) = n / global; the reduction sums.  A joined rank's shadow
         * rows are not in the global batch: its backward runs (the collectives in it must) with 0. */
        st = ct__strategy_backward_ex(s, dz, rec, s->joined ? 0.0f : (float)((double)n / (double)global), NULL);
        rec = NULL;
    }
    ct_record_destroy(rec);
    ct_tensor_release(x);
    ct_tensor_release(y);
    ct_tensor_release(z);
    ct_tensor_release(dz);
    return st;
}

ct_status ct_strategy_join(ct_strategy *s, int64_t rows, int64_t *global_rows, int *active)
{
    if (rows < 0) return ct_error(CT_EINVAL, "join: rows is %lld; give 0 or more", (long long)rows);
    int64_t v[2] = {rows, rows > 0};
    if (s->g && s->ops != &none_ops) CT_TRY(ct_group_allreduce(s->g, v, 2, CT_I64, CT_OP_SUM, NULL)); /* none: alone */
    *global_rows = v[0];
    *active = (int)v[1];
    return CT_OK;
}

void ct_strategy_set_joined(ct_strategy *s, int joined) { s->joined = joined != 0; }

ct_status ct_strategy_train_step(ct_strategy *s, const ct_batch *b, ct_loss_fn loss, void *ud,
                                 const ct_fwd_ctx *ctx, ct_step_out *out)
{
    ct_step_out local = {0, 0};
    if (out) *out = local;
    if (!b || !b->x || !b->y || !loss || !ctx)
        return ct_error(CT_EINVAL, "train step needs a batch (x and y), a loss and a context");
    int64_t nrows = b->x->ndim ? b->x->shape[0] : 0;
    int k = s->ops->train_step ? 1 : s->common.grad_accum;
    if (b->y->ndim == 0 || b->y->shape[0] != nrows)
        return ct_error(CT_EINVAL, "train step: x has %lld rows but y has %lld; they must match",
                        (long long)nrows, (long long)(b->y->ndim ? b->y->shape[0] : 0));
    if (nrows < k)
        return ct_error(CT_EINVAL, "train step: %lld rows on this rank cannot fill %d micro-batches "
                        "(grad_accum); give every rank at least %d rows or lower grad_accum",
                        (long long)nrows, k, k);
    int64_t global = b->global_rows ? b->global_rows : nrows * (s->g ? ct_group_size(s->g) : 1);
    if (global < nrows && !s->joined)
        return ct_error(CT_EINVAL, "train step: global_rows %lld is fewer than this rank's %lld rows",
                        (long long)global, (long long)nrows);
    if (s->ops->train_step) {
        ct_status st = s->ops->train_step(s, b, loss, ud, ctx, &local);
        if (out) *out = local;
        return st;
    }
    ct_fwd_ctx c = *ctx;
    int64_t r0 = 0;
    ct_status st = CT_OK;
    for (int m = 0; m < k && st == CT_OK; m++) {
        int64_t n = nrows / k + (m < nrows % k); /* as even as rows allow */
        ct_strategy_set_no_sync(s, m + 1 < k);
        st = micro_step(s, b, r0, n, global, loss, ud, c, &local);
        r0 += n;
    }
    ct_strategy_set_no_sync(s, 0);
    if (out) *out = local;
    return st;
}

/* ---- clip, step, zero_grad, lr ------------------------------------------- */

/* Gradients marked zero by the lazy zero_grad that no backward wrote since. */
static void sync_grads(ct_strategy *s)
{
    for (int i = 0; i < s->nparams; i++) ct_param_grad_sync(s->params[i]);
}

static ct_status replicated_norm(ct_strategy *s, double norm_type, double *norm)
{
    double acc = 0;
    for (int i = 0; i < s->nparams; i++) {
        ct_param *p = s->params[i];
        if (!p->grad || !p->requires_grad) continue;
        if (isinf(norm_type)) {
            const float *gp = ct_f32(p->grad);
            for (int64_t j = 0; j < p->grad->numel; j++) {
                double a = fabs((double)gp[j]);
                if (a > acc || isnan(a)) acc = a;
            }
        } else {
            acc += ct_grad_sq_sum(&p, 1);
        }
    }
    *norm = isinf(norm_type) ? acc : sqrt(acc);
    return CT_OK;
}

ct_status ct__strategy_norm_term(ct_strategy *s, double norm_type, double *term)
{
    sync_grads(s);
    double n = 0;
    CT_TRY(s->ops->grad_norm ? s->ops->grad_norm(s, norm_type, &n) : replicated_norm(s, norm_type, &n));
    *term = isinf(norm_type) ? n : n * n;
    return CT_OK;
}

ct_status ct_strategy_clip_grad_norm(ct_strategy *s, float max_norm, double norm_type, float *norm)
{
    if (!(max_norm >= 0))
        return ct_error(CT_EINVAL, "clip: max_norm must be >= 0 (got %g)", (double)max_norm);
    if (norm_type != 2.0 && !isinf(norm_type))
        return ct_error(CT_EINVAL, "clip: norm_type %g is not supported; use 2 or infinity", norm_type);
    sync_grads(s);
    double total = 0;
    CT_TRY(s->ops->grad_norm ? s->ops->grad_norm(s, norm_type, &total) : replicated_norm(s, norm_type, &total));
    if (norm) *norm = (float)total;
    float coef = ct_clip_coef(total, max_norm);
    if (coef < 1.0f) {
        if (s->ops->scale_grads) s->ops->scale_grads(s, coef);
        else ct_scale_grads(s->params, s->nparams, coef);
    }
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

ct_status ct_strategy_step(ct_strategy *s)
{
    double t0 = ct_now();
    sync_grads(s);
    if (s->has_sched) ct_optim_set_lr(s->opt, ct_lr_at(&s->sched, ct_optim_get_step(s->opt)));
    ct_status st = s->ops->pre_step ? s->ops->pre_step(s) : CT_OK;
    if (st == CT_OK) st = ct_optim_step(s->opt);
    if (st == CT_OK && s->ops->post_step) st = s->ops->post_step(s);
    if (st == CT_OK && !s->ops->refreshes_compute && !s->ops->manages_compute) st = ct__mixed_refresh(s);
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

/* Lazy: the next backward overwrites the gradients instead of adding to
 * zeros, which saves a write and a read of all gradient memory per step. */
void ct_strategy_zero_grad(ct_strategy *s)
{
    if (s->ops->zero_grad) s->ops->zero_grad(s);
    else ct_module_zero_grad_lazy(s->model);
}

ct_status ct_strategy_predict(ct_strategy *s, ct_tensor *x, const ct_fwd_ctx *ctx, ct_tensor **out)
{
    *out = NULL;
    if (!x || !ctx) return ct_error(CT_EINVAL, "predict needs an input and a context");
    if (s->ops->predict) return s->ops->predict(s, x, ctx, out);
    if (s->ops->pre_forward) CT_TRY(s->ops->pre_forward(s));
    return ct_module_forward(s->model, x, out, NULL, ctx);
}

void ct_strategy_data_rank(const ct_strategy *s, int *rank, int *size)
{
    if (s->ops->data_rank) {
        s->ops->data_rank(s, rank, size);
        return;
    }
    *rank = s->g ? ct_group_rank(s->g) : 0; /* no group: a process of its own */
    *size = s->g ? ct_group_size(s->g) : 1;
}

ct_status ct_strategy_memory(ct_strategy *s, ct_mem_report *all)
{
    ct_mem_report mine;
    ct_mem_report_get(&mine);
    if (!s->g || ct_group_size(s->g) == 1) {
        all[0] = mine;
        return CT_OK;
    }
    return ct_group_allgather(s->g, &mine, all, (int64_t)sizeof mine, CT_U8, NULL);
}

ct_status ct_strategy_summon_full_params(ct_strategy *s, int writeback, int rank0_only)
{
    return s->ops->summon ? s->ops->summon(s, writeback, rank0_only) : CT_OK;
}

ct_status ct_strategy_release_full_params(ct_strategy *s)
{
    return s->ops->release ? s->ops->release(s) : CT_OK;
}

/* ---- state ----------------------------------------------------------------- */

ct_status ct_strategy_model_state(ct_strategy *s, ct_state *out)
{
    memset(out, 0, sizeof *out);
    return s->ops->model_state ? s->ops->model_state(s, out) : ct__replicated_model_state(s, out);
}

ct_status ct_strategy_optim_state(ct_strategy *s, ct_state *out)
{
    memset(out, 0, sizeof *out);
    return s->ops->optim_state ? s->ops->optim_state(s, out) : ct__replicated_optim_state(s, out);
}

ct_status ct_strategy_shard_state(ct_strategy *s, int optim, ct_state *out)
{
    memset(out, 0, sizeof *out);
    return s->ops->shard_state ? s->ops->shard_state(s, optim, out) : ct__replicated_shard_state(s, optim, out);
}

ct_status ct_strategy_local_state(ct_strategy *s, int optim, ct_state *out)
{
    memset(out, 0, sizeof *out);
    return s->ops->local_state ? s->ops->local_state(s, optim, out) : ct__replicated_local_state(s, optim, out);
}

ct_status ct_strategy_load_state(ct_strategy *s, const char *const *names, ct_tensor *const *tensors,
                                 int n, int optim)
{
    ct_state whole;
    int pieces;
    CT_TRY(ct__assemble_pieces(s, names, tensors, n, &whole, &pieces));
    if (pieces) {
        names = (const char *const *)whole.names;
        tensors = whole.tensors;
        n = whole.n;
    }
    ct_status st = s->ops->load_state ? s->ops->load_state(s, names, tensors, n, optim)
                                      : ct__replicated_load_state(s, names, tensors, n, optim);
    ct_state_fini(&whole);
    CT_TRY(st);
    /* New master weights: the compute copies follow. */
    return optim || s->ops->manages_compute ? CT_OK : ct__mixed_refresh(s);
}
