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

/* Elements [at, at + n) of owned range k's buffer b (b < 0: values) into dst, wherever they rest. */
static ct_status range_read(ct_strategy *s, const ct__shards *sh, int k, int b, int64_t at, int64_t n, float *dst)
{
    if (sh->io) return sh->io(s, k, b, at, n, dst, 0);
    float *src;
    CT_TRY(range_buf(s, sh, k, b, &src));
    memcpy(dst, src + at, (size_t)n * sizeof(float));
    return CT_OK;
}

/* Elements [off, off + count) of checkpoint tensor src into owned range k's
 * buffer b (b < 0: values): straight into the slot's memory, or through io
 * a chunk at a time. */
static ct_status range_load(ct_strategy *s, const ct__shards *sh, int k, int b, const ct_tensor *src,
                            const char *name)
{
    const ct_part_range *x = &sh->pt.ranges[k];
    if (!sh->io) {
        float *buf;
        CT_TRY(range_buf(s, sh, k, b, &buf));
        return ct__load_range(s, buf, src, x->offset, x->count, name); /* only the range this rank owns */
    }
    int64_t chunk = x->count < CT__SHARDS_CHUNK ? x->count : CT__SHARDS_CHUNK;
    float *stage = ct_alloc((size_t)chunk * sizeof(float) + 4, CT_MEM_COMM);
    if (!stage) return CT_ENOMEM;
    ct_status st = CT_OK;
    for (int64_t at = 0; st == CT_OK && at < x->count; at += chunk) {
        int64_t n = x->count - at < chunk ? x->count - at : chunk;
        st = ct__load_range(s, stage, src, x->offset + at, n, name);
        if (st == CT_OK) st = sh->io(s, k, b, at, n, stage, 1);
    }
    ct_free(stage);
    return st;
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
        st = range_read(s, sh, k, b, 0, x->count, ct_f32(full) + x->offset);
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

/* "<name>[.<buf>]@<offset>" of a piece of p (or of its optimizer buffer
 * buf), or the bare name when the piece is all of it. */
static void piece_name(char *full, size_t size, const ct_param *p, const char *buf, int64_t offset, int64_t count)
{
    snprintf(full, size, "%s%s%s", p->name, buf ? "." : "", buf ? buf : "");
    if (offset != 0 || count != p->data->numel)
        snprintf(full + strlen(full), size - strlen(full), "@%lld", (long long)offset);
}

/* Owned range k's buffer b (b < 0: values) as its piece to fn: p's shape
 * when whole, else 1-D; a view of the slot's memory, or (io) a copy read
 * for the call. */
static ct_status emit_piece(ct_strategy *s, const ct__shards *sh, int k, int b, const char *bname, int shapes_only,
                            ct_state_fn fn, void *ud)
{
    const ct_part_range *x = &sh->pt.ranges[k];
    const ct_param *p = sh->tp[x->param];
    char name[600];
    piece_name(name, sizeof name, p, bname, x->offset, x->count);
    int whole = x->offset == 0 && x->count == p->data->numel;
    int ndim = whole ? p->data->ndim : 1;
    const int64_t *shape = whole ? p->data->shape : &x->count;
    float *mem = NULL;
    ct_tensor *t;
    if (shapes_only) {
        t = ct_tensor_wrap(CT_F32, ndim, shape, NULL);
    } else if (sh->io) {
        t = ct_tensor_empty(CT_F32, ndim, shape, CT_MEM_COMM);
    } else {
        CT_TRY(range_buf(s, sh, k, b, &mem));
        t = ct_tensor_wrap(CT_F32, ndim, shape, mem);
    }
    if (!t) return CT_ENOMEM;
    ct_status st = !shapes_only && sh->io ? sh->io(s, k, b, 0, x->count, ct_f32(t), 0) : CT_OK;
    if (st == CT_OK) st = fn(ud, name, t);
    ct_tensor_release(t);
    return st;
}

ct_status ct__shards_local_each(ct_strategy *s, const ct__shards *sh, int optim, int shapes_only, ct_state_fn fn,
                                void *ud)
{
    const char *bn[CT_OPTIM_MAX_STATE];
    int nb = optim ? ct_optim_state_names(s->opt, bn) : 1, rank = ct_group_rank(s->g);
    ct_status st = CT_OK;
    for (int k = 0; k < sh->pt.n && st == CT_OK; k++) {
        const ct_part_range *x = &sh->pt.ranges[k];
        if (sh->slot[k] < 0 || quiet(sh, x->param)) continue;
        for (int b = 0; b < nb && st == CT_OK; b++)
            st = emit_piece(s, sh, k, optim ? b : -1, optim ? bn[b] : NULL, shapes_only, fn, ud);
    }
    for (int i = 0; st == CT_OK && rank == 0 && !optim && i < s->nparams; i++) /* outside the partition */
        if (ct__shards_index(sh, s->params[i]) < 0)
            st = ct__state_emit(fn, ud, s->params[i]->name, s->params[i]->data, shapes_only);
    for (int i = 0; st == CT_OK && rank == 0 && !optim && i < s->nbuffers; i++)
        st = ct__state_emit(fn, ud, s->buffers[i]->name, s->buffers[i]->data, shapes_only);
    if (st == CT_OK && optim && rank == 0) st = ct__state_emit_step(s, shapes_only, fn, ud);
    return st;
}

ct_status ct__shards_local_state(ct_strategy *s, const ct__shards *sh, int optim, ct_state *out)
{
    ct_status st = ct__shards_local_each(s, sh, optim, 0, ct__state_collect, out);
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
            snprintf(name, sizeof name, "%s.%s", p->name, bn[b]);
            const ct_tensor *src = ct__state_find(names, ts, n, name);
            if (!src)
                return ct_error(CT_EINVAL, "optimizer state has no '%s' (saved with another optimizer? this run "
                                "uses %s)", name, ct_optim_name(s->opt));
            if (src->dtype != CT_F32 || src->numel != p->data->numel)
                return ct_error(CT_EINVAL, "'%s' is %s[%lld] in the checkpoint but F32[%lld] here", name,
                                ct_dtype_name(src->dtype), (long long)src->numel, (long long)p->data->numel);
            CT_TRY(range_load(s, sh, k, b, src, name)); /* only the range this rank owns */
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
        if (sh->slot[k] >= 0) CT_TRY(range_load(s, sh, k, -1, src, p->name));
    return CT_OK;
}
