/*
 * The shard table's state I/O (shards.h): what ZeRO-1, ZeRO-2 and FSDP save
 * and load, written once over the ranges each rank owns.
 *
 * Checkpoints: a full tensor is assembled on its root by a reduce of the
 * owners' ranges (every non-owner contributing zeros), so no rank holds more
 * than one parameter's worth on top of its own; a sharded save balances the
 * parameters over the ranks by bytes; local pieces are the owned ranges as
 * they lie.  Loading takes the owned ranges out of full tensors, so any
 * world size and any sharding loads any checkpoint.
 */
#include <stdio.h>
#include <string.h>

#include "shards.h"

void ct__shards_fini(ct__shards *sh)
{
    ct_partition_fini(&sh->pt);
    ct_free(sh->tp);
    ct_free(sh->first);
    ct_free(sh->slot);
    ct_free(sh->pg);
    ct_free(sh->quiet);
    memset(sh, 0, sizeof *sh);
}

int ct__shards_index(const ct__shards *sh, const ct_param *p)
{
    for (int i = 0; i < sh->ntp; i++)
        if (sh->tp[i] == p) return i;
    return -1;
}

static ct_group *group_of(ct_strategy *s, const ct__shards *sh, int i) { return sh->pg ? sh->pg[i] : s->g; }

static int quiet(const ct__shards *sh, int i) { return sh->quiet && sh->quiet[i]; }

/* The f32 values of owned range k's buffer b (b < 0: the parameter values). */
static ct_status range_buf(ct_strategy *s, const ct__shards *sh, int k, int b, float **out)
{
    if (b < 0) {
        *out = ct_optim_slot_at(s->opt, sh->slot[k])->data;
        return CT_OK;
    }
    float *bufs[CT_OPTIM_MAX_STATE];
    int nb = ct_optim_state(s->opt, sh->slot[k], bufs, NULL);
    if (nb < 0) return nb;
    *out = bufs[b];
    return CT_OK;
}

ct_status ct__shards_gather(ct_strategy *s, const ct__shards *sh, int i, int b, int root, ct_tensor **out)
{
    *out = NULL;
    ct_param *p = sh->tp[i];
    ct_group *g = group_of(s, sh, i);
    ct_tensor *full = ct_tensor_create(CT_F32, p->data->ndim, p->data->shape, CT_MEM_COMM);
    if (!full) return CT_ENOMEM;
    int local_only = 1;
    ct_status st = CT_OK;
    for (int k = sh->first[i]; st == CT_OK && k < sh->pt.n && sh->pt.ranges[k].param == i; k++) {
        const ct_part_range *x = &sh->pt.ranges[k];
        local_only &= x->owner == root;
        if (sh->slot[k] < 0) continue;
        float *src;
        st = range_buf(s, sh, k, b, &src);
        if (st == CT_OK) memcpy(ct_f32(full) + x->offset, src, (size_t)x->count * sizeof(float));
    }
    if (st == CT_OK && !local_only)
        st = ct_group_reduce(g, ct_tensor_data(full), full->numel, CT_F32, CT_OP_SUM, root, NULL);
    if (st == CT_OK && ct_group_rank(g) == root && !quiet(sh, i)) *out = full;
    else ct_tensor_release(full);
    return st;
}

ct_status ct__shards_roots(ct_strategy *s, const ct__shards *sh, int **roots)
{
    int size = ct_group_size(s->g);
    int *order = ct_alloc(sizeof *order * (size_t)(sh->ntp + 1), CT_MEM_OTHER);
    int64_t *load = ct_alloc_zeroed(sizeof *load * (size_t)size, CT_MEM_OTHER);
    *roots = ct_alloc(sizeof **roots * (size_t)(sh->ntp + 1), CT_MEM_OTHER);
    if (!order || !load || !*roots) {
        ct_free(order);
        ct_free(load);
        ct_free(*roots);
        *roots = NULL;
        return CT_ENOMEM;
    }
    for (int i = 0; i < sh->ntp; i++) { /* insertion by elements descending, stable */
        int j = i;
        while (j > 0 && sh->tp[order[j - 1]]->data->numel < sh->tp[i]->data->numel) {
            order[j] = order[j - 1];
            j--;
        }
        order[j] = i;
    }
    for (int k = 0; k < sh->ntp; k++) {
        int i = order[k], gs = ct_group_size(group_of(s, sh, i)), r = 0;
        for (int q = 1; q < gs && q < size; q++)
            if (load[q] < load[r]) r = q;
        load[r] += sh->tp[i]->data->numel;
        (*roots)[i] = r;
    }
    ct_free(order);
    ct_free(load);
    return CT_OK;
}

int ct__shards_reports(ct_strategy *s, const ct__shards *sh, int i, int root)
{
    return ct_group_rank(group_of(s, sh, i)) == root && !quiet(sh, i);
}

ct_status ct__shards_optim_each(ct_strategy *s, const ct__shards *sh, const int *roots, int shapes_only,
                                ct_state_fn fn, void *ud)
{
    const char *bn[CT_OPTIM_MAX_STATE];
    int nb = ct_optim_state_names(s->opt, bn);
    char name[512];
    ct_status st = CT_OK, fst = CT_OK; /* a failing fn stops the calls, never the collectives */
    for (int i = 0; i < sh->ntp && st == CT_OK; i++) {
        int root = roots ? roots[i] : 0;
        for (int b = 0; b < nb && st == CT_OK; b++) {
            snprintf(name, sizeof name, "%s.%s", sh->tp[i]->name, bn[b]);
            if (shapes_only) {
                if (fst == CT_OK && ct__shards_reports(s, sh, i, root))
                    fst = ct__state_emit(fn, ud, name, sh->tp[i]->data, 1);
                continue;
            }
            ct_tensor *t;
            st = ct__shards_gather(s, sh, i, b, root, &t);
            if (st == CT_OK && t && fst == CT_OK) fst = fn(ud, name, t);
            ct_tensor_release(t);
        }
    }
    if (st == CT_OK && fst == CT_OK && ct_group_rank(s->g) == 0) fst = ct__state_emit_step(s, shapes_only, fn, ud);
    return st != CT_OK ? st : fst;
}

ct_status ct__shards_optim_state(ct_strategy *s, const ct__shards *sh, int sharded, ct_state *out)
{
    int *roots = NULL;
    ct_status st = sharded ? ct__shards_roots(s, sh, &roots) : CT_OK;
    if (st == CT_OK) st = ct__shards_optim_each(s, sh, roots, 0, ct__state_collect, out);
    ct_free(roots);
    if (st != CT_OK) ct_state_fini(out);
    return st;
}

/* A piece of p (or of its optimizer buffer buf) of count floats at data,
 * named "<name>[.<buf>]@<offset>", or whole (p's shape) when it is all of it. */
static ct_status add_piece(ct_state *out, const ct_param *p, const char *buf, int64_t offset, int64_t count,
                           float *data)
{
    char full[600];
    int whole = offset == 0 && count == p->data->numel;
    snprintf(full, sizeof full, "%s%s%s", p->name, buf ? "." : "", buf ? buf : "");
    if (!whole) snprintf(full + strlen(full), sizeof full - strlen(full), "@%lld", (long long)offset);
    ct_tensor *t = whole ? ct_tensor_wrap(CT_F32, p->data->ndim, p->data->shape, data)
                         : ct_tensor_wrap(CT_F32, 1, &count, data);
    if (!t) return CT_ENOMEM;
    ct_status st = ct_state_add(out, full, t);
    ct_tensor_release(t);
    return st;
}

ct_status ct__shards_local_state(ct_strategy *s, const ct__shards *sh, int optim, ct_state *out)
{
    const char *bn[CT_OPTIM_MAX_STATE];
    int nb = optim ? ct_optim_state_names(s->opt, bn) : 1, rank = ct_group_rank(s->g);
    ct_status st = CT_OK;
    for (int k = 0; k < sh->pt.n && st == CT_OK; k++) {
        const ct_part_range *x = &sh->pt.ranges[k];
        if (sh->slot[k] < 0 || quiet(sh, x->param)) continue;
        for (int b = 0; b < nb && st == CT_OK; b++) {
            float *buf;
            st = range_buf(s, sh, k, optim ? b : -1, &buf);
            if (st == CT_OK) st = add_piece(out, sh->tp[x->param], optim ? bn[b] : NULL, x->offset, x->count, buf);
        }
    }
    for (int i = 0; st == CT_OK && rank == 0 && !optim && i < s->nparams; i++) /* outside the partition */
        if (ct__shards_index(sh, s->params[i]) < 0) st = ct_state_add(out, s->params[i]->name, s->params[i]->data);
    for (int i = 0; st == CT_OK && rank == 0 && !optim && i < s->nbuffers; i++)
        st = ct_state_add(out, s->buffers[i]->name, s->buffers[i]->data);
    if (st == CT_OK && optim && rank == 0) st = ct__state_add_step(s, out);
    if (st != CT_OK) ct_state_fini(out);
    return st;
}

ct_status ct__shards_load_optim(ct_strategy *s, const ct__shards *sh, const char *const *names,
                                ct_tensor *const *ts, int n)
{
    int64_t step;
    CT_TRY(ct__state_step(names, ts, n, &step));
    const char *bn[CT_OPTIM_MAX_STATE];
    int nb = ct_optim_state_names(s->opt, bn);
    char name[512];
    for (int k = 0; k < sh->pt.n; k++) {
        if (sh->slot[k] < 0) continue;
        const ct_part_range *x = &sh->pt.ranges[k];
        ct_param *p = sh->tp[x->param];
        for (int b = 0; b < nb; b++) {
            float *buf;
            CT_TRY(range_buf(s, sh, k, b, &buf));
            snprintf(name, sizeof name, "%s.%s", p->name, bn[b]);
            const ct_tensor *src = ct__state_find(names, ts, n, name);
            if (!src)
                return ct_error(CT_EINVAL, "optimizer state has no '%s' (saved with another optimizer? this run "
                                "uses %s)", name, ct_optim_name(s->opt));
            if (src->dtype != CT_F32 || src->numel != p->data->numel)
                return ct_error(CT_EINVAL, "'%s' is %s[%lld] in the checkpoint but F32[%lld] here", name,
                                ct_dtype_name(src->dtype), (long long)src->numel, (long long)p->data->numel);
            CT_TRY(ct__load_range(s, buf, src, x->offset, x->count, name)); /* only the range this rank owns */
        }
    }
    ct_optim_set_step(s->opt, step);
    return CT_OK;
}

ct_status ct__shards_load_param(ct_strategy *s, const ct__shards *sh, ct_param *p, const ct_tensor *src)
{
    int i = ct__shards_index(sh, p);
    if (i < 0) return ct__load_range(s, ct_f32(p->data), src, 0, p->data->numel, p->name);
    for (int k = sh->first[i]; k < sh->pt.n && sh->pt.ranges[k].param == i; k++)
        if (sh->slot[k] >= 0)
            CT_TRY(ct__load_range(s, ct_optim_slot_at(s->opt, sh->slot[k])->data, src, sh->pt.ranges[k].offset,
                                  sh->pt.ranges[k].count, p->name));
    return CT_OK;
}
