/*
 * The strategy interface: the parts every strategy shares (timing, clipping,
 * the optimizer step, checkpoint state) and dispatch to the strategy's own
 * hooks.  "none" is the strategy with no hooks at all.
 */
#include <stdio.h>
#include <string.h>

#include "internal.h"

static const ct__strategy_ops none_ops = {"none", NULL, NULL, NULL, NULL, NULL, NULL};

static const ct__strategy_ops *const kinds[] = {&none_ops, &ct__ddp_ops};

const char *ct_strategy_list(void) { return "none, ddp"; }

ct_strategy_opts ct_strategy_defaults(void)
{
    ct_strategy_opts o;
    memset(&o, 0, sizeof o);
    o.ddp.bucket_cap_mb = 25;
    o.ddp.first_bucket_mb = 1;
    o.ddp.broadcast_buffers = 1;
    o.ddp.find_unused_parameters = 0;
    o.ddp.comm_dtype = CT_F32;
    o.ddp.rebuild_buckets = 1;
    return o;
}

ct_status ct_strategy_create(const char *kind, ct_module *model, ct_optim *opt, ct_group *g,
                             const ct_strategy_opts *o, ct_strategy **out)
{
    *out = NULL;
    const ct__strategy_ops *ops = NULL;
    for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++)
        if (kind && !strcmp(kinds[i]->kind, kind)) ops = kinds[i];
    if (!ops)
        return ct_error(CT_EINVAL, "unknown strategy '%s'; choose one of: %s", kind ? kind : "(null)",
                        ct_strategy_list());
    if (!model || !opt) return ct_error(CT_EINVAL, "strategy '%s' needs a model and an optimizer", kind);
    if (!g) g = ct_group_world();
    if (ops != &none_ops && !g)
        return ct_error(CT_ESTATE, "strategy '%s' needs communication: call ct_comm_init first", kind);
    ct_strategy *s = ct_alloc_zeroed(sizeof *s, CT_MEM_OTHER);
    if (!s) return CT_ENOMEM;
    s->ops = ops;
    s->model = model;
    s->opt = opt;
    s->g = g;
    s->o = o ? *o : ct_strategy_defaults();
    ct_status st = ct_module_params(model, &s->params, &s->nparams);
    if (st == CT_OK) st = ct_module_buffers(model, &s->buffers, &s->nbuffers);
    if (st == CT_OK && ops->init) st = ops->init(s);
    if (st != CT_OK) {
        ct_free(s->params);
        ct_free(s->buffers);
        ct_free(s);
        return st;
    }
    *out = s;
    return CT_OK;
}

void ct_strategy_destroy(ct_strategy *s)
{
    if (!s) return;
    if (s->ops->fini) s->ops->fini(s);
    ct_free(s->params);
    ct_free(s->buffers);
    ct_free(s);
}

const char *ct_strategy_kind(const ct_strategy *s) { return s->ops->kind; }
ct_module *ct_strategy_model(const ct_strategy *s) { return s->model; }
ct_optim *ct_strategy_optim(const ct_strategy *s) { return s->opt; }
ct_group *ct_strategy_group(const ct_strategy *s) { return s->g; }
ct_step_stats ct_strategy_stats(const ct_strategy *s) { return s->last; }
void ct_strategy_set_no_sync(ct_strategy *s, int on) { s->no_sync = on; }

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

ct_status ct_strategy_backward(ct_strategy *s, ct_tensor *dout, ct_record *rec)
{
    double t0 = ct_now();
    ct_status st = s->ops->pre_backward ? s->ops->pre_backward(s) : CT_OK;
    if (st != CT_OK) {
        ct_record_destroy(rec);
        return st;
    }
    /* Backward is linear in dout, so scaling it scales every gradient: DDP
     * passes 1/world here and then only has to sum, saving a pass over all
     * gradients after the allreduce. */
    float scale = s->ops->grad_scale ? s->ops->grad_scale(s) : 1.0f;
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
    st = ct_module_backward(s->model, g, NULL, rec);
    if (g != dout) ct_tensor_release(g);
    double t1 = ct_now();
    s->stats.backward += t1 - t0;
    ct_trace_event("backward", "step", t0, t1, 0);
    if (st == CT_OK && s->ops->post_backward) st = s->ops->post_backward(s);
    return st;
}

/* Gradients marked zero by the lazy zero_grad that no backward wrote since. */
static void sync_grads(ct_strategy *s)
{
    for (int i = 0; i < s->nparams; i++) ct_param_grad_sync(s->params[i]);
}

ct_status ct_strategy_clip_grad_norm(ct_strategy *s, float max_norm, float *norm)
{
    sync_grads(s);
    /* Every strategy here holds full, synchronised gradients, so the local norm is the global one. */
    return ct_clip_grad_norm(s->params, s->nparams, max_norm, norm);
}

ct_status ct_strategy_step(ct_strategy *s)
{
    double t0 = ct_now();
    sync_grads(s);
    ct_status st = ct_optim_step(s->opt);
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
void ct_strategy_zero_grad(ct_strategy *s) { ct_module_zero_grad_lazy(s->model); }

/* ---- state ------------------------------------------------------------- */

ct_status ct_state_add(ct_state *st, const char *name, ct_tensor *t)
{
    size_t len = strlen(name) + 1;
    char **nn = ct_alloc_zeroed(sizeof *nn * (size_t)(st->n + 1), CT_MEM_OTHER);
    ct_tensor **nt = ct_alloc_zeroed(sizeof *nt * (size_t)(st->n + 1), CT_MEM_OTHER);
    char *copy = ct_alloc_zeroed(len, CT_MEM_OTHER);
    if (!nn || !nt || !copy) {
        ct_free(nn);
        ct_free(nt);
        ct_free(copy);
        return CT_ENOMEM;
    }
    memcpy(copy, name, len);
    if (st->n) {
        memcpy(nn, st->names, sizeof *nn * (size_t)st->n);
        memcpy(nt, st->tensors, sizeof *nt * (size_t)st->n);
    }
    nn[st->n] = copy;
    nt[st->n] = ct_tensor_retain(t);
    ct_free(st->names);
    ct_free(st->tensors);
    st->names = nn;
    st->tensors = nt;
    st->n++;
    return CT_OK;
}

void ct_state_fini(ct_state *st)
{
    for (int i = 0; i < st->n; i++) {
        ct_free(st->names[i]);
        ct_tensor_release(st->tensors[i]);
    }
    ct_free(st->names);
    ct_free(st->tensors);
    memset(st, 0, sizeof *st);
}

ct_status ct_strategy_model_state(ct_strategy *s, ct_state *out)
{
    memset(out, 0, sizeof *out);
    for (int i = 0; i < s->nparams; i++) {
        ct_status st = ct_state_add(out, s->params[i]->name, s->params[i]->data);
        if (st) goto fail;
    }
    for (int i = 0; i < s->nbuffers; i++) {
        ct_status st = ct_state_add(out, s->buffers[i]->name, s->buffers[i]->data);
        if (st) goto fail;
    }
    return CT_OK;
fail:
    ct_state_fini(out);
    return CT_ENOMEM;
}

/* Parameter a whole-parameter optimizer slot belongs to. */
static ct_param *slot_param(ct_strategy *s, const ct_optim_slot *sl)
{
    for (int i = 0; i < s->nparams; i++)
        if (sl->name && !strcmp(s->params[i]->name, sl->name)) return s->params[i];
    return NULL;
}

ct_status ct_strategy_optim_state(ct_strategy *s, ct_state *out)
{
    memset(out, 0, sizeof *out);
    char name[512];
    ct_status st = CT_OK;
    for (int i = 0; i < ct_optim_num_slots(s->opt) && st == CT_OK; i++) {
        const ct_optim_slot *sl = ct_optim_slot_at(s->opt, i);
        ct_param *p = slot_param(s, sl);
        float *bufs[2];
        const char *names[2];
        int nb = ct_optim_state(s->opt, i, bufs, names);
        if (nb < 0) {
            st = nb;
            break;
        }
        if (!p || sl->offset != 0 || sl->n != p->data->numel)
            st = ct_error(CT_EUNSUPPORTED, "optimizer slot %d ('%s') is not a whole parameter of the model",
                          i, sl->name ? sl->name : "?");
        for (int k = 0; k < nb && st == CT_OK; k++) {
            ct_tensor *t = ct_tensor_wrap(CT_F32, p->data->ndim, p->data->shape, bufs[k]);
            if (!t) { st = CT_ENOMEM; break; }
            snprintf(name, sizeof name, "%s.%s", sl->name, names[k]);
            st = ct_state_add(out, name, t);
            ct_tensor_release(t);
        }
    }
    if (st == CT_OK) {
        ct_tensor *step = ct_tensor_create(CT_I64, 1, (int64_t[]){1}, CT_MEM_OTHER);
        if (!step) st = CT_ENOMEM;
        else {
            ((int64_t *)ct_tensor_data(step))[0] = ct_optim_get_step(s->opt);
            st = ct_state_add(out, "step", step);
            ct_tensor_release(step);
        }
    }
    if (st != CT_OK) ct_state_fini(out);
    return st;
}

/* Copies src (f32, bf16 or f16) into the f32 destination of n elements. */
static ct_status load_into(float *dst, int64_t n, const ct_tensor *src, const char *name)
{
    if (src->numel != n)
        return ct_error(CT_EINVAL, "'%s' has %lld elements in the checkpoint but %lld in the model; "
                        "the checkpoint is for a different model configuration",
                        name, (long long)src->numel, (long long)n);
    switch (src->dtype) {
    case CT_F32: memcpy(dst, ct_tensor_data(src), (size_t)n * 4); break;
    case CT_BF16: ct_bf16_to_f32_n(ct_tensor_data(src), dst, (size_t)n); break;
    case CT_F16: ct_f16_to_f32_n(ct_tensor_data(src), dst, (size_t)n); break;
    default:
        return ct_error(CT_EINVAL, "'%s' is %s in the checkpoint; parameters must be F32, BF16 or F16",
                        name, ct_dtype_name(src->dtype));
    }
    return CT_OK;
}

static ct_status load_model(ct_strategy *s, const char *const *names, ct_tensor *const *ts, int n)
{
    for (int i = 0; i < n; i++) {
        if (ct_module_find(s->model, names[i])) continue;
        const char *dot = strrchr(names[i], '.');
        if (!strcmp(names[i], "step") || (dot && (!strcmp(dot, ".exp_avg") || !strcmp(dot, ".exp_avg_sq") ||
                                                  !strcmp(dot, ".momentum_buffer"))))
            return ct_error(CT_EINVAL, "checkpoint tensor '%s' is optimizer state: this is an optimizer "
                            "file (X.optim.safetensors); pass the model file X.safetensors", names[i]);
        return ct_error(CT_EINVAL, "checkpoint tensor '%s' is not in the model (wrong --model or --hidden?)",
                        names[i]);
    }
    for (int pass = 0; pass < 2; pass++) {
        ct_param **ps = pass ? s->buffers : s->params;
        int np = pass ? s->nbuffers : s->nparams;
        for (int j = 0; j < np; j++) {
            const ct_tensor *src = NULL;
            for (int i = 0; i < n && !src; i++)
                if (!strcmp(names[i], ps[j]->name)) src = ts[i];
            if (!src)
                return ct_error(CT_EINVAL, "checkpoint has no tensor '%s' that the model needs", ps[j]->name);
            if (src->ndim != ps[j]->data->ndim ||
                memcmp(src->shape, ps[j]->data->shape, sizeof(int64_t) * (size_t)src->ndim)) {
                char a[64], b[64];
                return ct_error(CT_EINVAL, "'%s' is %s in the checkpoint but %s in the model",
                                ps[j]->name, ct_shape_str(src, a, sizeof a),
                                ct_shape_str(ps[j]->data, b, sizeof b));
            }
            CT_TRY(load_into(ct_f32(ps[j]->data), ps[j]->data->numel, src, ps[j]->name));
        }
    }
    return CT_OK;
}

static ct_status load_optim(ct_strategy *s, const char *const *names, ct_tensor *const *ts, int n)
{
    char name[512];
    int64_t step = -1;
    for (int i = 0; i < n; i++)
        if (!strcmp(names[i], "step") && ts[i]->dtype == CT_I64 && ts[i]->numel == 1)
            step = ((const int64_t *)ct_tensor_data(ts[i]))[0];
    if (step < 0) return ct_error(CT_EINVAL, "optimizer state has no I64 'step' tensor");
    for (int k = 0; k < ct_optim_num_slots(s->opt); k++) {
        const ct_optim_slot *sl = ct_optim_slot_at(s->opt, k);
        float *bufs[2];
        const char *bn[2];
        int nb = ct_optim_state(s->opt, k, bufs, bn);
        if (nb < 0) return nb;
        for (int b = 0; b < nb; b++) {
            snprintf(name, sizeof name, "%s.%s", sl->name, bn[b]);
            const ct_tensor *src = NULL;
            for (int i = 0; i < n && !src; i++)
                if (!strcmp(names[i], name)) src = ts[i];
            if (!src)
                return ct_error(CT_EINVAL, "optimizer state has no '%s' (saved with another optimizer? "
                                "this run uses %s)", name, ct_optim_name(s->opt));
            CT_TRY(load_into(bufs[b], sl->n, src, name));
        }
    }
    ct_optim_set_step(s->opt, step);
    return CT_OK;
}

ct_status ct_strategy_load_state(ct_strategy *s, const char *const *names, ct_tensor *const *tensors,
                                 int n, int optim)
{
    return optim ? load_optim(s, names, tensors, n) : load_model(s, names, tensors, n);
}
