/*
 * The partition of the trainable parameters over ranks, shared by every
 * sharded strategy (ZeRO-1, ZeRO-2; FSDP shards its flat parameters its own
 * way).  Greedy by size: the largest piece goes to the least loaded rank
 * (ties: the lower rank; equal pieces: model order), the same on every rank
 * because it is a pure function of the sizes.  With split on, the
 * parameters laid end to end are cut into ranks equal contiguous pieces
 * (DeepSpeed's flat partition): rank r owns elements [r*S, (r+1)*S) of the
 * concatenation, S = ceil(total / ranks), so a few huge tensors balance
 * exactly, at the cost of parameters shared between neighbouring ranks.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* Pieces by count descending, then model order (param, offset). */
static int cmp_piece(const void *a, const void *b)
{
    const ct_part_range *x = a, *y = b;
    if (x->count != y->count) return x->count < y->count ? 1 : -1;
    if (x->param != y->param) return x->param < y->param ? -1 : 1;
    return (x->offset > y->offset) - (x->offset < y->offset);
}

/* Back to model order for the owners' slot lists. */
static int cmp_order(const void *a, const void *b)
{
    const ct_part_range *x = a, *y = b;
    if (x->param != y->param) return x->param < y->param ? -1 : 1;
    return (x->offset > y->offset) - (x->offset < y->offset);
}

ct_status ct_partition_init(ct_partition *pt, const int64_t *numels, int nparams, int nranks, int split)
{
    memset(pt, 0, sizeof *pt);
    if (nranks < 1 || nparams < 0 || (nparams && !numels))
        return ct_error(CT_EINVAL, "partition of %d parameters over %d ranks: need ranks >= 1", nparams, nranks);
    int64_t total = 0;
    for (int i = 0; i < nparams; i++) {
        if (numels[i] < 0) return ct_error(CT_EINVAL, "partition: parameter %d has %lld elements", i,
                                           (long long)numels[i]);
        total += numels[i];
    }
    int64_t share = (total + nranks - 1) / nranks;
    int n = nparams + (split ? nranks : 0); /* each rank boundary cuts at most one parameter */
    pt->ranges = ct_alloc_zeroed(sizeof *pt->ranges * (size_t)(n + 1), CT_MEM_OTHER);
    pt->load = ct_alloc_zeroed(sizeof *pt->load * (size_t)nranks, CT_MEM_OTHER);
    if (!pt->ranges || !pt->load) {
        ct_partition_fini(pt);
        return CT_ENOMEM;
    }
    pt->nranks = nranks;
    if (split) {
        int64_t pos = 0; /* position in the concatenation */
        for (int i = 0; i < nparams; i++) {
            int64_t off = 0;
            do {
                int owner = share ? (int)(pos / share) : 0;
                int64_t room = share ? (owner + 1) * share - pos : numels[i];
                int64_t c = numels[i] - off < room ? numels[i] - off : room;
                pt->ranges[pt->n++] = (ct_part_range){i, off, c, owner};
                pt->load[owner] += c;
                off += c;
                pos += c;
            } while (off < numels[i]);
        }
        return CT_OK;
    }
    for (int i = 0; i < nparams; i++) pt->ranges[pt->n++] = (ct_part_range){i, 0, numels[i], 0};
    qsort(pt->ranges, (size_t)pt->n, sizeof *pt->ranges, cmp_piece);
    for (int k = 0; k < pt->n; k++) {
        int owner = 0;
        for (int r = 1; r < nranks; r++)
            if (pt->load[r] < pt->load[owner]) owner = r;
        pt->ranges[k].owner = owner;
        pt->load[owner] += pt->ranges[k].count;
    }
    qsort(pt->ranges, (size_t)pt->n, sizeof *pt->ranges, cmp_order);
    return CT_OK;
}

void ct_partition_fini(ct_partition *pt)
{
    ct_free(pt->ranges);
    ct_free(pt->load);
    memset(pt, 0, sizeof *pt);
}

ct_status ct_partition_describe(const ct_partition *pt, const char *const *names, char *buf, size_t n)
{
    size_t off = 0;
    buf[0] = 0;
    for (int r = 0; r < pt->nranks; r++) {
        off += (size_t)snprintf(buf + off, off < n ? n - off : 0, "rank %d owns %lld elements:", r,
                                (long long)pt->load[r]);
        for (int k = 0; k < pt->n; k++) {
            const ct_part_range *x = &pt->ranges[k];
            if (x->owner != r) continue;
            const char *nm = names ? names[x->param] : NULL;
            char id[32];
            if (!nm) {
                snprintf(id, sizeof id, "#%d", x->param);
                nm = id;
            }
            off += (size_t)snprintf(buf + off, off < n ? n - off : 0, " %s", nm);
            if (x->offset || (k + 1 < pt->n && pt->ranges[k + 1].param == x->param) ||
                (k > 0 && pt->ranges[k - 1].param == x->param))
                off += (size_t)snprintf(buf + off, off < n ? n - off : 0, "[%lld:%lld]", (long long)x->offset,
                                        (long long)(x->offset + x->count));
        }
        off += (size_t)snprintf(buf + off, off < n ? n - off : 0, "\n");
    }
    if (off >= n)
        return ct_error(CT_EINVAL, "partition description needs %zu bytes; give a larger buffer", off + 1);
    return CT_OK;
}
