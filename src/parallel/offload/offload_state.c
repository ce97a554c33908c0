/*
 * Offload's checkpoint state: the normal full state dict (PyTorch's names,
 * a tied weight once, under its first user's name), read from the store's
 * file (the tied group: from memory) and written back to it, so any other
 * strategy, ctrain eval or PyTorch loads it and an offloaded run resumes
 * from any of theirs.
 */
#include <stdio.h>
#include <string.h>

#include "offload.h"

/* Moves parameter j's data (part OFF_DATA) or its optimizer state buffer b
 * (OFF_STATE) between buf (f32) and where it lives: the store's file, or
 * memory for the tied group. */
static ct_status part_rw(ct_strategy *s, int j, int part, int b, int write, float *buf)
{
    offload_t *f = ct__offload(s);
    offload_slice *sl = f->where[j] < f->ns ? &f->sl[f->where[j]] : &f->tied;
    size_t bytes = (size_t)s->params[j]->data->numel * 4;
    int64_t e = f->eoff[j] + (part == OFF_STATE ? (int64_t)b * sl->flat.numel : 0);
    if (sl == &f->tied) {
        float *mem = (float *)ct_storage_ptr(part == OFF_STATE ? sl->state : sl->flat.st[CT__FL_DATA]) + e;
        memcpy(write ? mem : buf, write ? buf : mem, bytes);
        return CT_OK;
    }
    off_t at = (part == OFF_STATE ? ct__offload_state_off(sl) : sl->off) + (off_t)(e * 4);
    return ct__ostore_rw(f->store, write, buf, bytes, at);
}

/* Parameter j's part as a tensor of its own to fn, read one at a time, so a
 * full save holds one tensor beside the resident slices, never the model. */
static ct_status emit_read(ct_strategy *s, int j, int part, int b, const char *name, int shapes_only,
                           ct_state_fn fn, void *ud)
{
    ct_param *p = s->params[j];
    ct_tensor *t = shapes_only ? ct_tensor_wrap(CT_F32, p->data->ndim, p->data->shape, NULL)
                               : ct_tensor_empty(CT_F32, p->data->ndim, p->data->shape, CT_MEM_OTHER);
    if (!t) return CT_ENOMEM;
    ct_status st = shapes_only ? CT_OK : part_rw(s, j, part, b, 0, ct_tensor_data(t));
    if (st == CT_OK) st = fn(ud, name, t);
    ct_tensor_release(t);
    return st;
}

/* The full model (optim 0) or optimizer state (optim 1), tensor by tensor,
 * on every rank (offload replicates). */
ct_status ct__offload_each(ct_strategy *s, int optim, int shapes_only, ct_state_fn fn, void *ud)
{
    offload_t *f = ct__offload(s);
    const char *names[CT_OPTIM_MAX_STATE];
    ct_optim_state_names(s->opt, names);
    char name[512];
    ct_status st = ct__offload_flush(s);
    for (int j = 0; j < s->nparams && st == CT_OK; j++) {
        ct_param *p = s->params[j];
        if (!optim) {
            st = emit_read(s, j, OFF_DATA, 0, p->name, shapes_only, fn, ud);
            continue;
        }
        if (!p->requires_grad) continue;
        for (int b = 0; b < f->nstate && st == CT_OK; b++) {
            snprintf(name, sizeof name, "%s.%s", p->name, names[b]);
            st = emit_read(s, j, OFF_STATE, b, name, shapes_only, fn, ud);
        }
    }
    for (int i = 0; !optim && i < s->nbuffers && st == CT_OK; i++)
        st = ct__state_emit(fn, ud, s->buffers[i]->name, s->buffers[i]->data, shapes_only);
    if (optim && st == CT_OK) st = ct__state_emit_step(s, shapes_only, fn, ud);
    return st;
}

static ct_status collect(ct_strategy *s, int optim, ct_state *out)
{
    ct_status st = ct__offload_each(s, optim, 0, ct__state_collect, out);
    if (st != CT_OK) ct_state_fini(out);
    return st;
}

ct_status ct__offload_model_state(ct_strategy *s, ct_state *out) { return collect(s, 0, out); }
ct_status ct__offload_optim_state(ct_strategy *s, ct_state *out) { return collect(s, 1, out); }

/* src (f32/bf16/f16, numel elements) as f32 into parameter j's part (part_rw). */
static ct_status write_f32(ct_strategy *s, const ct_tensor *src, int64_t numel, const char *name, int j, int part,
                           int b)
{
    float *tmp = ct_alloc((size_t)numel * 4 + 4, CT_MEM_OTHER);
    if (!tmp) return CT_ENOMEM;
    ct_status st = ct__load_whole(s, tmp, numel, src, name);
    if (st == CT_OK) st = part_rw(s, j, part, b, 1, tmp);
    ct_free(tmp);
    return st;
}

static ct_status load_model(ct_strategy *s, const char *const *names, ct_tensor *const *ts, int n)
{
    for (int i = 0; i < n; i++)
        if (!ct_module_find(s->model, names[i]))
            return ct_error(CT_EINVAL, "checkpoint tensor '%s' is not in the model (wrong --model, or an "
                            "optimizer file where the model file belongs?)", names[i]);
    /* Check everything before writing anything: a bad file leaves the run as it was. */
    for (int pass = 0; pass < 2; pass++)
        for (int j = 0; j < (pass ? s->nbuffers : s->nparams); j++) {
            ct_param *p = pass ? s->buffers[j] : s->params[j];
            const ct_tensor *src = ct__state_find(names, ts, n, p->name);
            if (!src) return ct_error(CT_EINVAL, "checkpoint has no tensor '%s' that the model needs", p->name);
            if (src->ndim != p->data->ndim || memcmp(src->shape, p->data->shape, sizeof(int64_t) * (size_t)src->ndim)) {
                char a[64], b[64];
                return ct_error(CT_EINVAL, "'%s' is %s in the checkpoint but %s in the model", p->name,
                                ct_shape_str(src, a, sizeof a), ct_shape_str(p->data, b, sizeof b));
            }
            if (pass && src->dtype != CT_F32)
                return ct_error(CT_EINVAL, "buffer '%s' is %s in the checkpoint; buffers load from F32", p->name,
                                ct_dtype_name(src->dtype));
        }
    for (int j = 0; j < s->nparams; j++) {
        ct_param *p = s->params[j];
        CT_TRY(write_f32(s, ct__state_find(names, ts, n, p->name), p->data->numel, p->name, j, OFF_DATA, 0));
    }
    ct__offload_cast(s, &ct__offload(s)->tied); /* new master weights: the resident copies follow */
    for (int j = 0; j < s->nbuffers; j++) {
        ct_param *p = s->buffers[j];
        CT_TRY(ct__load_whole(s, ct_f32(p->data), p->data->numel, ct__state_find(names, ts, n, p->name), p->name));
    }
    return CT_OK;
}

static ct_status load_optim(ct_strategy *s, const char *const *names, ct_tensor *const *ts, int n)
{
    offload_t *f = ct__offload(s);
    int64_t step;
    CT_TRY(ct__state_step(names, ts, n, &step));
    const char *bn[CT_OPTIM_MAX_STATE];
    ct_optim_state_names(s->opt, bn);
    char name[512];
    for (int pass = 0; pass < 2; pass++)
        for (int j = 0; j < s->nparams; j++) {
            ct_param *p = s->params[j];
            if (!p->requires_grad) continue;
            for (int b = 0; b < f->nstate; b++) {
                snprintf(name, sizeof name, "%s.%s", p->name, bn[b]);
                const ct_tensor *src = ct__state_find(names, ts, n, name);
                if (!src)
                    return ct_error(CT_EINVAL, "optimizer state has no '%s' (saved with another optimizer? "
                                    "this run uses %s)", name, ct_optim_name(s->opt));
                if (pass)
                    CT_TRY(write_f32(s, src, p->data->numel, name, j, OFF_STATE, b));
                else if (src->numel != p->data->numel)
                    return ct_error(CT_EINVAL, "'%s' has %lld elements in the checkpoint but %lld in the model",
                                    name, (long long)src->numel, (long long)p->data->numel);
            }
        }
    ct_optim_set_step(s->opt, step);
    return CT_OK;
}

ct_status ct__offload_load_state(ct_strategy *s, const char *const *names, ct_tensor *const *ts, int n,
                                 int optim)
{
    CT_TRY(ct__offload_flush(s)); /* the step taken happened before the load */
    return optim ? load_optim(s, names, ts, n) : load_model(s, names, ts, n);
}

ct_status ct__offload_summon(ct_strategy *s, int writeback, int rank0_only)
{
    offload_t *f = ct__offload(s);
    if (writeback && rank0_only)
        return ct_error(CT_EINVAL, "summon_full_params: writeback with rank0_only is not supported (the other "
                        "ranks would have nothing to write back); drop one of them");
    if (f->summoned) return ct_error(CT_ESTATE, "summon_full_params: already summoned; release it first");
    CT_TRY(ct__offload_flush(s)); /* the pending step applied: the store holds the current values */
    CT_TRY(ct__ostore_drain(f->store));
    int keep = !rank0_only || ct__offload_ranks(s) == 1 || ct_group_rank(s->g) == 0;
    f->summoned = 1;
    f->summon_writeback = writeback;
    for (int i = 0; keep && i < f->ns; i++) {
        offload_slice *sl = &f->sl[i];
        if (ct__flat_resident(&sl->flat, CT__FL_DATA)) continue; /* in memory already, and current */
        CT_TRY(ct__flat_fill(&sl->flat, CT__FL_DATA, 0));
        sl->summoned = 1;
        CT_TRY(ct__ostore_rw(f->store, 0, ct__flat_ptr(&sl->flat, CT__FL_DATA), (size_t)sl->flat.numel * 4, sl->off));
    }
    return CT_OK;
}

ct_status ct__offload_release(ct_strategy *s)
{
    offload_t *f = ct__offload(s);
    ct_status st = CT_OK;
    for (int i = 0; i < f->ns; i++) {
        offload_slice *sl = &f->sl[i];
        if (f->summon_writeback && ct__flat_resident(&sl->flat, CT__FL_DATA) && st == CT_OK)
            st = ct__ostore_rw(f->store, 1, ct__flat_ptr(&sl->flat, CT__FL_DATA), (size_t)sl->flat.numel * 4, sl->off);
        if (sl->summoned) ct__flat_evict(&sl->flat, CT__FL_DATA);
        sl->summoned = 0;
    }
    if (f->summon_writeback) ct__offload_cast(s, &f->tied); /* compute copies follow the masters */
    f->summoned = f->summon_writeback = 0;
    return st;
}
