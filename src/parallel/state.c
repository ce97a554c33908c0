/*
 * Checkpoint state for strategies that hold whole parameters and whole
 * optimizer slots on every rank (none, ddp): the full state is what this
 * rank holds; a shard is a balanced share of it; loading copies by name
 * (through state_load.c's reads).  Sharded strategies bring their own
 * entries (ct__strategy_ops).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

ct_status ct_state_add(ct_state *st, const char *name, ct_tensor *t)
{
    if (st->n == st->cap) { /* both arrays grow together; cap changes once both did */
        int c1 = st->cap, c2 = st->cap;
        char **nn = ct_grow(st->names, st->n, &c1, sizeof *nn, CT_MEM_OTHER);
        if (!nn) return CT_ENOMEM;
        st->names = nn;
        ct_tensor **nt = ct_grow(st->tensors, st->n, &c2, sizeof *nt, CT_MEM_OTHER);
        if (!nt) return CT_ENOMEM;
        st->tensors = nt;
        st->cap = c2;
    }
    size_t len = strlen(name) + 1;
    char *copy = ct_alloc(len, CT_MEM_OTHER);
    if (!copy) return CT_ENOMEM;
    memcpy(copy, name, len);
    st->names[st->n] = copy;
    st->tensors[st->n] = ct_tensor_retain(t);
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

ct_status ct__replicated_model_state(ct_strategy *s, ct_state *out)
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

ct_status ct__replicated_optim_state(ct_strategy *s, ct_state *out)
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
    if (st == CT_OK) st = ct__state_add_step(s, out);
    if (st != CT_OK) ct_state_fini(out);
    return st;
}

ct_status ct__state_collect(void *ud, const char *name, ct_tensor *t) { return ct_state_add(ud, name, t); }

ct_status ct__state_emit(ct_state_fn fn, void *ud, const char *name, ct_tensor *t, int shapes_only)
{
    if (!shapes_only) return fn(ud, name, t);
    ct_tensor *shape = ct_tensor_wrap(t->dtype, t->ndim, t->shape, NULL);
    if (!shape) return CT_ENOMEM;
    ct_status st = fn(ud, name, shape);
    ct_tensor_release(shape);
    return st;
}

ct_status ct__state_emit_step(ct_strategy *s, int shapes_only, ct_state_fn fn, void *ud)
{
    ct_tensor *step = ct_tensor_create(CT_I64, 1, (int64_t[]){1}, CT_MEM_OTHER);
    if (!step) return CT_ENOMEM;
    ((int64_t *)ct_tensor_data(step))[0] = ct_optim_get_step(s->opt);
    ct_status st = ct__state_emit(fn, ud, "step", step, shapes_only);
    ct_tensor_release(step);
    return st;
}

ct_status ct__state_add_step(ct_strategy *s, ct_state *out) { return ct__state_emit_step(s, 0, ct__state_collect, out); }

ct_status ct__replicated_each(ct_strategy *s, int optim, int shapes_only, ct_state_fn fn, void *ud)
{
    ct_state full;
    memset(&full, 0, sizeof full); /* as ct_strategy_model_state hands it to the entries */
    CT_TRY(optim ? s->vt.state.optim(s, &full) : s->vt.state.model(s, &full));
    ct_status st = CT_OK;
    for (int i = 0; i < full.n && st == CT_OK; i++) st = ct__state_emit(fn, ud, full.names[i], full.tensors[i], shapes_only);
    ct_state_fini(&full);
    return st;
}

ct_status ct__collected_share(ct_strategy *s, int optim, int local, int shapes_only, ct_state_fn fn, void *ud)
{
    ct_state st;
    memset(&st, 0, sizeof st);
    CT_TRY(local ? s->vt.state.local(s, optim, &st) : s->vt.state.shard(s, optim, &st));
    ct_status r = CT_OK;
    for (int i = 0; i < st.n && r == CT_OK; i++) r = ct__state_emit(fn, ud, st.names[i], st.tensors[i], shapes_only);
    ct_state_fini(&st);
    return r;
}

const ct_tensor *ct__state_find(const char *const *names, ct_tensor *const *ts, int n, const char *name)
{
    for (int i = 0; i < n; i++)
        if (!strcmp(names[i], name)) return ts[i];
    return NULL;
}

ct_status ct__state_step(const char *const *names, ct_tensor *const *ts, int n, int64_t *step)
{
    const ct_tensor *t = ct__state_find(names, ts, n, "step");
    if (!t || t->dtype != CT_I64 || t->numel != 1)
        return ct_error(CT_EINVAL, "optimizer state has no I64 'step' tensor");
    *step = ((const int64_t *)ct_tensor_data(t))[0];
    return CT_OK;
}

static ct_status put_whole(ct_strategy *s, ct_param *p, const ct_tensor *src)
{
    return ct__load_whole(s, ct_f32(p->data), p->data->numel, src, p->name);
}

ct_status ct__load_model_with(ct_strategy *s, const char *const *names, ct_tensor *const *ts, int n,
                              ct__load_fn put)
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
            const ct_tensor *src = ct__state_find(names, ts, n, ps[j]->name);
            if (!src)
                return ct_error(CT_EINVAL, "checkpoint has no tensor '%s' that the model needs", ps[j]->name);
            if (src->ndim != ps[j]->data->ndim ||
                memcmp(src->shape, ps[j]->data->shape, sizeof(int64_t) * (size_t)src->ndim)) {
                char a[64], b[64];
                return ct_error(CT_EINVAL, "'%s' is %s in the checkpoint but %s in the model",
                                ps[j]->name, ct_shape_str(src, a, sizeof a),
                                ct_shape_str(ps[j]->data, b, sizeof b));
            }
            CT_TRY(put(s, ps[j], src)); /* same shape: same numel */
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
            const ct_tensor *src = ct__state_find(names, ts, n, name);
            if (!src)
                return ct_error(CT_EINVAL, "optimizer state has no '%s' (saved with another optimizer? "
                                "this run uses %s)", name, ct_optim_name(s->opt));
            CT_TRY(ct__load_whole(s, bufs[b], sl->n, src, name));
        }
    }
    ct_optim_set_step(s->opt, step);
    return CT_OK;
}

ct_status ct__replicated_load_state(ct_strategy *s, const char *const *names, ct_tensor *const *tensors,
                                   int n, int optim)
{
    return optim ? load_optim(s, names, tensors, n) : ct__load_model_with(s, names, tensors, n, put_whole);
}

/* Shares balanced by bytes: largest tensor first onto the least loaded
 * rank (ties: lowest rank), the same on every rank; "step" on rank 0. */
ct_status ct__replicated_shard_state(ct_strategy *s, int optim, ct_state *out)
{
    ct_state full;
    /* through the strategy: one that keeps whole state elsewhere (offload's store) shares it too */
    CT_TRY(optim ? ct_strategy_optim_state(s, &full) : ct_strategy_model_state(s, &full));
    int size = s->g ? ct_group_size(s->g) : 1, rank = s->g ? ct_group_rank(s->g) : 0; /* no group: alone */
    int *order = ct_alloc(sizeof *order * (size_t)(full.n + 1), CT_MEM_OTHER);
    size_t *load = ct_alloc(sizeof *load * (size_t)size, CT_MEM_OTHER);
    ct_status st = order && load ? CT_OK : CT_ENOMEM;
    memset(out, 0, sizeof *out);
    for (int i = 0; st == CT_OK && i < full.n; i++) {
        /* insertion by bytes descending, stable: state sizes are small lists */
        int j = i;
        size_t b = ct_tensor_bytes(full.tensors[i]);
        while (j > 0 && ct_tensor_bytes(full.tensors[order[j - 1]]) < b) {
            order[j] = order[j - 1];
            j--;
        }
        order[j] = i;
    }
    if (st == CT_OK) memset(load, 0, sizeof *load * (size_t)size);
    for (int k = 0; st == CT_OK && k < full.n; k++) {
        int i = order[k], owner = 0;
        if (strcmp(full.names[i], "step"))
            for (int r = 1; r < size; r++)
                if (load[r] < load[owner]) owner = r;
        load[owner] += ct_tensor_bytes(full.tensors[i]);
        if (owner == rank) st = ct_state_add(out, full.names[i], full.tensors[i]);
    }
    ct_free(order);
    ct_free(load);
    ct_state_fini(&full);
    if (st != CT_OK) ct_state_fini(out);
    return st;
}

ct_status ct__replicated_local_state(ct_strategy *s, int optim, ct_state *out)
{
    memset(out, 0, sizeof *out);
    if (s->g && ct_group_rank(s->g) != 0) return CT_OK;
    /* through the strategy: one that keeps whole state elsewhere (offload's store) gives it too */
    return optim ? ct_strategy_optim_state(s, out) : ct_strategy_model_state(s, out);
}

void ct__param_take(ct_param *p, ct_tensor *d, ct_tensor *g)
{
    if (d && g) {
        ct_tensor_release(p->data);
        ct_tensor_release(p->grad);
        p->data = d;
        p->grad = g;
        p->grad_stale = 0;
    } else {
        ct_tensor_release(d);
        ct_tensor_release(g);
    }
    ct_tensor_release(p->compute); /* the unwrapped model computes in f32, as after any strategy */
    p->compute = NULL;
}
