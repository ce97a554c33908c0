/*
 * The flat layer: the one mechanism by which a strategy owns parameter
 * bytes.  A flat is a group of parameters laid end to end, with storages
 * for its parts (f32 data, f32 gradients, bf16 compute copies), cut into
 * nshards equal pieces (the last padded) for a shard group.  Each
 * parameter keeps its name and shape; its data, grad and compute tensors
 * become views of the flat's storages, so a strategy moves, frees, gathers
 * or reduces a whole group's bytes in one place and every layer follows,
 * reading p->data and p->grad at every call as it always does.
 *
 * Residency is per part: absent (memory freed, views without data),
 * resident (the whole flat), or somewhere the strategy keeps it between
 * uses (this rank's shard in a buffer of its own, a store on disk), from
 * which it brings the part back.  The policies are the strategies':
 *
 *   DDP     a flat per bucket, grad part only, over shared memory: the
 *           allreduce sums the gradients where they are
 *   FSDP    a flat per unit and dtype class: data, grad and low parts
 *           absent except while the unit computes (gathered from the shard,
 *           reduce-scattered back into it)
 *   offload a flat per slice: every part resident while the slice is, its
 *           bytes in the store otherwise
 *
 * Pointing is staged: the parameters' own tensors stay until commit (or
 * come back with rollback), so a set-up that fails on one rank (a shape
 * check, memory) leaves the model as it was everywhere.  Unpoint is the one
 * unwrap: each parameter gets tensors of its own with its current values.
 */
#include <string.h>

#include "flat.h"

static const ct_dtype part_dtype[CT__FL_NPARTS] = {CT_F32, CT_F32, CT_BF16};

ct_status ct__flat_init(ct__flat *f, ct_param *const *p, int n, int nshards, int srank, int low)
{
    memset(f, 0, sizeof *f);
    CT_ASSERT(n >= 0 && nshards >= 1 && srank >= 0 && srank < nshards);
    size_t nn = (size_t)(n ? n : 1);
    f->p = ct_alloc(sizeof *f->p * nn, CT_MEM_OTHER);
    f->off = ct_alloc(sizeof *f->off * nn, CT_MEM_OTHER);
    f->loff = ct_alloc(sizeof *f->loff * nn, CT_MEM_OTHER);
    if (!f->p || !f->off || !f->loff) {
        ct__flat_fini(f);
        return CT_ENOMEM;
    }
    f->n = n;
    f->nshards = nshards;
    f->srank = srank;
    for (int j = 0; j < n; j++) {
        f->p[j] = p[j];
        f->off[j] = f->numel;
        f->numel += p[j]->data->numel;
        f->loff[j] = low && ct_param_takes_bf16_copy(p[j]) ? f->nlow : -1;
        if (f->loff[j] >= 0) f->nlow += p[j]->data->numel;
    }
    f->shard = (f->numel + nshards - 1) / nshards;
    /* A flat's parts are allocated and freed whole, over and over (buckets,
     * gathered units, slices): the allocator's cache bound follows them. */
    ct_mem_cache_hint((size_t)f->numel * sizeof(float));
    return CT_OK;
}

void ct__flat_shard(ct__flat *f, int nshards, int srank)
{
    CT_ASSERT(nshards >= 1 && srank >= 0 && srank < nshards && !f->st[CT__FL_DATA]);
    f->nshards = nshards;
    f->srank = srank;
    f->shard = (f->numel + nshards - 1) / nshards;
}

void ct__flat_fini(ct__flat *f)
{
    if (f->old) ct__flat_commit(f);
    for (int k = 0; k < CT__FL_NPARTS; k++) ct_storage_release(f->st[k]);
    ct_free(f->p);
    ct_free(f->off);
    ct_free(f->loff);
    memset(f, 0, sizeof *f);
}

/* Elements of a part: the data and grad parts are padded to the shards;
 * so is the low part when every parameter has a copy (then it is laid out
 * as the data and gathered alike), otherwise it holds the copies alone. */
static int64_t part_numel(const ct__flat *f, ct__flat_part part)
{
    if (part == CT__FL_LOW && f->nlow != f->numel) return f->nlow;
    return f->shard * f->nshards;
}

size_t ct__flat_bytes(const ct__flat *f, ct__flat_part part)
{
    return (size_t)part_numel(f, part) * ct_dtype_size(part_dtype[part]);
}

ct_status ct__flat_storage(ct__flat *f, ct__flat_part part, ct_mem_cat cat, int resident, int zero, void *mem)
{
    CT_ASSERT(!f->st[part]);
    size_t bytes = ct__flat_bytes(f, part);
    f->st[part] = mem ? ct_storage_wrap(mem, bytes) : resident ? ct_storage_create(bytes, cat, zero)
                                                                : ct_storage_absent(bytes, cat);
    return f->st[part] ? CT_OK : CT_ENOMEM;
}

static void drop_views(ct_tensor **v, int n)
{
    for (int i = 0; i < n; i++) ct_tensor_release(v[i]);
}

/* staged: the parameters' own tensors wait in f->old for commit or
 * rollback; otherwise each goes as soon as its views are in place. */
static ct_status point(ct__flat *f, unsigned mask, int copy, int staged)
{
    CT_ASSERT(!f->old && !(mask & f->pointed));
    ct_tensor *one[3];
    if (staged && !(f->old = ct_alloc_zeroed(sizeof *f->old * (size_t)(3 * f->n + 1), CT_MEM_OTHER)))
        return CT_ENOMEM;
    if (!staged) f->pointed |= mask; /* what is moved so far is moved: unpoint takes any mix */
    for (int j = 0; j < f->n; j++) {
        ct_param *p = f->p[j];
        const ct_tensor *d = p->data;
        ct_tensor *v[CT__FL_NPARTS] = {NULL, NULL, NULL};
        int64_t at[CT__FL_NPARTS] = {f->off[j], f->off[j], f->loff[j]};
        int want[CT__FL_NPARTS] = {(mask & CT__FL_BIT(CT__FL_DATA)) != 0,
                                   (mask & CT__FL_BIT(CT__FL_GRAD)) && p->grad,
                                   (mask & CT__FL_BIT(CT__FL_LOW)) && f->loff[j] >= 0};
        int ok = 1;
        for (int k = 0; k < CT__FL_NPARTS; k++)
            if (want[k] && !(v[k] = ct_tensor_on(f->st[k], (size_t)at[k] * ct_dtype_size(part_dtype[k]),
                                                 part_dtype[k], d->ndim, d->shape)))
                ok = 0;
        if (!ok) {
            drop_views(v, CT__FL_NPARTS);
            if (staged) ct__flat_rollback(f);
            return CT_ENOMEM;
        }
        /* the values wherever they are: memory, or a shape-only parameter's rule */
        if (v[CT__FL_DATA] && (copy & CT__FL_BIT(CT__FL_DATA)) &&
            ct_param_values(p, 0, d->numel, ct_tensor_data(v[CT__FL_DATA])) != CT_OK) {
            drop_views(v, CT__FL_NPARTS);
            if (staged) ct__flat_rollback(f);
            return ct_last_status();
        }
        int gcopy = v[CT__FL_GRAD] && (copy & CT__FL_BIT(CT__FL_GRAD)) && ct_tensor_data(p->grad);
        if (gcopy) {
            ct_param_grad_sync(p);
            memcpy(ct_tensor_data(v[CT__FL_GRAD]), ct_tensor_data(p->grad), ct_tensor_bytes(d));
        }
        ct_tensor **old = staged ? f->old + 3 * j : one;
        old[0] = old[1] = old[2] = NULL;
        if (v[CT__FL_DATA]) old[0] = p->data, p->data = v[CT__FL_DATA];
        if (v[CT__FL_GRAD]) old[1] = p->grad, p->grad = v[CT__FL_GRAD];
        if (v[CT__FL_LOW]) old[2] = p->compute, p->compute = v[CT__FL_LOW];
        if (v[CT__FL_GRAD] && !gcopy)
            p->grad_stale = 1; /* new memory: the next backward overwrites it */
        if (!staged) {
            drop_views(one, 3);
            if (v[CT__FL_DATA]) p->shape_only = 0; /* its values are the flat's now */
        }
    }
    f->pointed |= mask;
    return CT_OK;
}

ct_status ct__flat_point(ct__flat *f, unsigned mask, int copy) { return point(f, mask, copy, 1); }
ct_status ct__flat_move(ct__flat *f, unsigned mask, int copy) { return point(f, mask, copy, 0); }

void ct__flat_commit(ct__flat *f)
{
    for (int j = 0; f->old && j < f->n; j++)
        if (f->old[3 * j]) f->p[j]->shape_only = 0; /* its values are the flat's now */
    for (int i = 0; f->old && i < 3 * f->n; i++) ct_tensor_release(f->old[i]);
    ct_free(f->old);
    f->old = NULL;
}

void ct__flat_rollback(ct__flat *f)
{
    for (int j = 0; f->old && j < f->n; j++) {
        ct_param *p = f->p[j];
        ct_tensor **old = f->old + 3 * j;
        if (old[0]) ct_tensor_release(p->data), p->data = old[0];
        if (old[1]) ct_tensor_release(p->grad), p->grad = old[1], p->grad_stale = 0;
        if (old[2] || (f->pointed & CT__FL_BIT(CT__FL_LOW))) ct_tensor_release(p->compute), p->compute = old[2];
    }
    ct_free(f->old);
    f->old = NULL;
    f->pointed = 0;
}

ct_status ct__flat_unpoint(ct__flat *f, ct__flat_fetch_fn fetch, void *ud)
{
    ct_status st = CT_OK;
    int left = 0; /* parameters left on their views (out of memory) */
    if (!f->pointed) return CT_OK; /* never pointed, or set-up rolled back */
    for (int j = 0; j < f->n; j++) {
        ct_param *p = f->p[j];
        const ct_tensor *d = p->data;
        int data = (f->pointed & CT__FL_BIT(CT__FL_DATA)) != 0, grad = (f->pointed & CT__FL_BIT(CT__FL_GRAD)) && p->grad;
        /* Values neither here nor fetchable (a sharded strategy's teardown): the
         * parameter leaves without memory, so a teardown never holds the whole. */
        int drop = data && !ct_tensor_data(d) && !fetch;
        ct_tensor *nd = !data ? NULL
                        : drop ? ct_tensor_absent(CT_F32, d->ndim, d->shape, CT_MEM_PARAM)
                               : ct_tensor_empty(CT_F32, d->ndim, d->shape, CT_MEM_PARAM);
        /* a gradient with no values is a zeroed block: fresh pages stay untouched, so RSS does not grow */
        int gvals = grad && ct_tensor_data(p->grad) && !p->grad_stale;
        ct_tensor *ng = !grad ? NULL
                        : drop ? ct_tensor_absent(CT_F32, d->ndim, d->shape, CT_MEM_GRAD)
                        : gvals ? ct_tensor_empty(CT_F32, d->ndim, d->shape, CT_MEM_GRAD)
                                : ct_tensor_create(CT_F32, d->ndim, d->shape, CT_MEM_GRAD);
        if ((data && !nd) || (grad && !ng)) {
            ct_tensor_release(nd);
            ct_tensor_release(ng);
            st = CT_ENOMEM;
            left++;
            continue;
        }
        if (nd) {
            if (ct_tensor_data(d)) memcpy(ct_tensor_data(nd), ct_tensor_data(d), ct_tensor_bytes(d));
            else if (drop) ;
            else if (fetch(ud, j, ct_f32(nd)) != CT_OK) {
                memset(ct_tensor_data(nd), 0, ct_tensor_bytes(nd));
                st = ct_last_status();
            }
            ct_tensor_release(p->data);
            p->data = nd;
        }
        if (ng) {
            if (gvals && !drop) memcpy(ct_tensor_data(ng), ct_tensor_data(p->grad), ct_tensor_bytes(ng));
            ct_tensor_release(p->grad);
            p->grad = ng;
            p->grad_stale = 0;
        }
        if (f->pointed & CT__FL_BIT(CT__FL_LOW)) { /* a view of the low part: the unwrapped model computes in f32 */
            ct_tensor_release(p->compute);
            p->compute = NULL;
        }
    }
    if (!left) f->pointed = 0;
    return st;
}

ct_status ct__flat_evict(ct__flat *f, ct__flat_part part) { return ct_storage_free_data(f->st[part]); }
ct_status ct__flat_fill(ct__flat *f, ct__flat_part part, int zero) { return ct_storage_alloc_data(f->st[part], zero); }
int ct__flat_resident(const ct__flat *f, ct__flat_part part) { return f->st[part] && ct_storage_has_data(f->st[part]); }
void *ct__flat_ptr(const ct__flat *f, ct__flat_part part) { return f->st[part] ? ct_storage_ptr(f->st[part]) : NULL; }

void ct__flat_cast_low(ct__flat *f)
{
    const float *d = ct__flat_ptr(f, CT__FL_DATA);
    uint16_t *l = ct__flat_ptr(f, CT__FL_LOW);
    if (!d || !l) return;
    for (int j = 0; j < f->n; j++)
        if (f->loff[j] >= 0) ct_f32_to_bf16_n(d + f->off[j], l + f->loff[j], (size_t)f->p[j]->data->numel);
}

/* Member j's elements inside this rank's shard, as [*lo, *hi) of the shard. */
static int shard_piece(const ct__flat *f, int j, int64_t *lo, int64_t *hi)
{
    int64_t base = (int64_t)f->srank * f->shard, a = f->off[j] - base, b = a + f->p[j]->data->numel;
    *lo = a < 0 ? 0 : a;
    *hi = b > f->shard ? f->shard : b;
    return *lo < *hi;
}

void ct__flat_shard_norm_sel(const ct_strategy *s, const ct__flat *f, const float *g, ct_norm_acc *a)
{
    int64_t lo, hi;
    for (int j = 0; j < f->n; j++)
        if (ct__clip_selects(s, f->p[j]) && shard_piece(f, j, &lo, &hi)) ct_norm_acc_f32(a, g + lo, hi - lo);
}

void ct__flat_shard_scale_sel(const ct_strategy *s, const ct__flat *f, float *g, float k)
{
    int64_t lo, hi;
    for (int j = 0; j < f->n; j++)
        if (ct__clip_selects(s, f->p[j]) && shard_piece(f, j, &lo, &hi))
            for (int64_t i = lo; i < hi; i++) g[i] *= k;
}
