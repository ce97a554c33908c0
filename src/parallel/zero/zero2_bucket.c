/*
 * ZeRO-2's buckets (fairscale ShardedDataParallel's reduce_buffer_size):
 * gradient ranges smaller than a bucket are packed, per owner rank, into
 * buckets of reduce_bucket_size elements, so the many small gradients of a
 * model (biases, norms) go to their owners in one reduce per bucket instead
 * of one each.  A bucket is reduced as soon as its last member is packed
 * (its ranges are cut in backward's order, last parameters first), or at
 * the end of backward with the members that got no gradient as zeros, so
 * a parameter without a gradient costs nothing (fairscale tolerates them;
 * every rank must miss the same ones, as the reduces pair up by order).
 * The buckets live for the strategy's life (fairscale's trade: their bytes
 * are not sharded), in the wire dtype.
 */
#include <string.h>

#include "zero.h"

typedef struct {
    int owner;
    int64_t n;        /* elements */
    int nmem, pending;
    int launched;
    void *buf;        /* n elements of the wire dtype */
    ct_work *work;
} zbucket;

struct ct__zbuckets {
    zbucket *b;
    int nb;
    int *of;          /* [pt.n] bucket of range k, or -1 */
    int64_t *off;     /* [pt.n] its offset in the bucket, elements */
    char *packed;     /* [pt.n] packed in this backward */
    ct_dtype dt;
};

void ct__zbuckets_destroy(ct__zbuckets *zb)
{
    if (!zb) return;
    for (int i = 0; i < zb->nb; i++) {
        if (zb->b[i].work) ct_work_wait(zb->b[i].work);
        ct_work_destroy(zb->b[i].work);
        ct_free(zb->b[i].buf);
    }
    ct_free(zb->b);
    ct_free(zb->of);
    ct_free(zb->off);
    ct_free(zb->packed);
    ct_free(zb);
}

/* The buckets of pt's ranges (without their buffers): the one rule the
 * strategy and the memory plan both follow. */
static ct_status assign(const ct_partition *pt, int64_t size, ct_dtype dt, ct__zbuckets **out)
{
    *out = NULL;
    ct__zbuckets *zb = ct_alloc_zeroed(sizeof *zb, CT_MEM_OTHER);
    if (!zb) return CT_ENOMEM;
    size_t nr = (size_t)pt->n + 1;
    zb->dt = dt;
    zb->of = ct_alloc(sizeof *zb->of * nr, CT_MEM_OTHER);
    zb->off = ct_alloc_zeroed(sizeof *zb->off * nr, CT_MEM_OTHER);
    zb->packed = ct_alloc_zeroed(nr, CT_MEM_OTHER);
    zb->b = ct_alloc_zeroed(sizeof *zb->b * nr, CT_MEM_OTHER); /* at most a bucket per range */
    int *open = ct_alloc(sizeof *open * (size_t)(pt->nranks + 1), CT_MEM_OTHER);
    ct_status st = zb->of && zb->off && zb->packed && zb->b && open ? CT_OK : CT_ENOMEM;
    for (int r = 0; st == CT_OK && r < pt->nranks; r++) open[r] = -1;
    /* backward's order: the last ranges first, so a bucket fills while backward runs */
    for (int k = pt->n - 1; st == CT_OK && k >= 0; k--) {
        const ct_part_range *x = &pt->ranges[k];
        zb->of[k] = -1;
        if (!x->count || x->count >= size) continue;
        int b = open[x->owner];
        if (b < 0 || zb->b[b].n + x->count > size) {
            b = open[x->owner] = zb->nb++;
            zb->b[b].owner = x->owner;
        }
        zb->of[k] = b;
        zb->off[k] = zb->b[b].n;
        zb->b[b].n += x->count;
        zb->b[b].nmem++;
    }
    ct_free(open);
    if (st != CT_OK) ct__zbuckets_destroy(zb);
    else *out = zb;
    return st;
}

uint64_t ct__zbuckets_plan_bytes(const ct_partition *pt, int64_t size, ct_dtype dt)
{
    ct__zbuckets *zb;
    if (size <= 0 || assign(pt, size, dt, &zb) != CT_OK) return 0;
    uint64_t t = 0;
    for (int b = 0; b < zb->nb; b++) t += (uint64_t)zb->b[b].n * ct_dtype_size(dt) + 64; /* as ct__wire_alloc */
    ct__zbuckets_destroy(zb);
    return t;
}

ct_status ct__zbuckets_create(const ct__zero *z, int64_t size, ct_dtype dt, ct__zbuckets **out)
{
    *out = NULL;
    if (size <= 0) return CT_OK;
    ct__zbuckets *zb;
    CT_TRY(assign(&z->sh.pt, size, dt, &zb));
    ct_status st = CT_OK;
    for (int b = 0; st == CT_OK && b < zb->nb; b++)
        if (!(zb->b[b].buf = ct__wire_alloc(dt, zb->b[b].n))) st = CT_ENOMEM;
    if (st != CT_OK) {
        ct__zbuckets_destroy(zb);
        return st;
    }
    *out = zb;
    return CT_OK;
}

int ct__zbuckets_has(const ct__zbuckets *zb, int k) { return zb && zb->of[k] >= 0; }

void ct__zbuckets_begin(ct__zbuckets *zb, const ct__zero *z)
{
    if (!zb) return;
    memset(zb->packed, 0, (size_t)z->sh.pt.n);
    for (int b = 0; b < zb->nb; b++) {
        zb->b[b].pending = zb->b[b].nmem;
        zb->b[b].launched = 0;
    }
}

static ct_status launch(ct_strategy *s, ct__zbuckets *zb, zbucket *b)
{
    b->launched = 1;
    ct__zero_of(s)->nreduces++;
    ct_work_destroy(b->work);
    b->work = NULL;
    /* A sum: the loss gradient was scaled by 1/world (ct__ddp_grad_scale). */
    return ct_group_reduce(s->g, b->buf, b->n, zb->dt, CT_OP_SUM, b->owner, &b->work);
}

ct_status ct__zbuckets_pack(ct_strategy *s, ct__zbuckets *zb, int k, const float *grad)
{
    zbucket *b = &zb->b[zb->of[k]];
    const ct_part_range *x = &ct__zero_of(s)->sh.pt.ranges[k];
    ct__wire_pack(zb->dt, grad + x->offset, (char *)b->buf + (size_t)zb->off[k] * ct_dtype_size(zb->dt), x->count);
    zb->packed[k] = 1;
    return --b->pending ? CT_OK : launch(s, zb, b);
}

ct_status ct__zbuckets_finish(ct_strategy *s, ct__zbuckets *zb)
{
    if (!zb) return CT_OK;
    ct__zero *z = ct__zero_of(s);
    ct_status st = CT_OK;
    /* members without a gradient count as zeros; every rank launches the rest in bucket order */
    for (int k = 0; k < z->sh.pt.n; k++)
        if (zb->of[k] >= 0 && !zb->packed[k] && !zb->b[zb->of[k]].launched)
            memset((char *)zb->b[zb->of[k]].buf + (size_t)zb->off[k] * ct_dtype_size(zb->dt), 0,
                   (size_t)z->sh.pt.ranges[k].count * ct_dtype_size(zb->dt));
    for (int b = 0; st == CT_OK && b < zb->nb; b++)
        if (!zb->b[b].launched) st = launch(s, zb, &zb->b[b]);
    for (int b = 0; b < zb->nb; b++) {
        if (!zb->b[b].work) continue;
        ct_status w = ct_work_wait(zb->b[b].work);
        if (st == CT_OK) st = w;
        ct_work_destroy(zb->b[b].work);
        zb->b[b].work = NULL;
    }
    if (st != CT_OK) return st;
    /* the owners take their ranges of the sums into the gradient shard */
    for (int k = 0; k < z->sh.pt.n; k++)
        if (zb->of[k] >= 0 && z->goff[k] >= 0)
            ct__wire_unpack(zb->dt, (const char *)zb->b[zb->of[k]].buf + (size_t)zb->off[k] * ct_dtype_size(zb->dt),
                            z->gshard + z->goff[k], z->sh.pt.ranges[k].count, 0);
    return CT_OK;
}
