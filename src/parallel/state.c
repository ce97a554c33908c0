/*
 * Checkpoint state for strategies that hold whole parameters and whole
 * optimizer slots on every rank (none, ddp): the full state is what this
 * rank holds; a shard is a balanced share of it; loading copies by name.
 * Sharded strategies bring their own entries (ct__strategy_ops).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

ct_status ct_state_add(ct_state *st, const char *name, ct_tensor *t)
{
    if (st->n == st->cap) { /* geometric growth: appends stay O(1) */
        int cap = st->cap ? 2 * st->cap : 16;
        char **nn = ct_alloc(sizeof *nn * (size_t)cap, CT_MEM_OTHER);
        ct_tensor **nt = ct_alloc(sizeof *nt * (size_t)cap, CT_MEM_OTHER);
        if (!nn || !nt) {
            ct_free(nn);
            ct_free(nt);
            return CT_ENOMEM;
        }
        if (st->n) {
            memcpy(nn, st->names, sizeof *nn * (size_t)st->n);
            memcpy(nt, st->tensors, sizeof *nt * (size_t)st->n);
        }
        ct_free(st->names);
        ct_free(st->tensors);
        st->names = nn;
        st->tensors = nt;
        st->cap = cap;
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

ct_status ct__replicated_load_state(ct_strategy *s, const char *const *names, ct_tensor *const *tensors,
                                   int n, int optim)
{
    return optim ? load_optim(s, names, tensors, n) : load_model(s, names, tensors, n);
}

/* Shares balanced by bytes: largest tensor first onto the least loaded
 * rank (ties: lowest rank), the same on every rank; "step" on rank 0. */
ct_status ct__replicated_shard_state(ct_strategy *s, int optim, ct_state *out)
{
    ct_state full;
    /* through the strategy: one that keeps whole state elsewhere (offload's store) shares it too */
    CT_TRY(optim ? ct_strategy_optim_state(s, &full) : ct_strategy_model_state(s, &full));
    int size = ct_group_size(s->g), rank = ct_group_rank(s->g);
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
