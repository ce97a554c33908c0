/*
 * Bucket assignment with the semantics of PyTorch's
 * compute_bucket_assignment_by_size (torch/csrc/distributed/c10d/reducer.cpp):
 * one open bucket per key (dtype); each key has its own walk through the
 * size limits, advancing after every bucket it closes and staying on the
 * last limit; open buckets are appended at the end; buckets are ordered by
 * their smallest member.
 */
#include <stdlib.h>

#include "ctrain/parallel.h"

typedef struct {
    int key;
    size_t bytes;
    int limit_i;
    int first; /* smallest member of the open bucket, -1 if empty */
} open_bucket;

typedef struct {
    int first;
    int id; /* provisional id before sorting */
} closed;

static int by_first(const void *a, const void *b)
{
    const closed *x = a, *y = b;
    return (x->first > y->first) - (x->first < y->first);
}

ct_status ct_bucket_assign(const size_t *bytes, const int *keys, int n, const size_t *limits,
                           int nlimits, int *bucket_of, int *nbuckets)
{
    if (n < 0 || nlimits < 1)
        return ct_error(CT_EINVAL, "bucket assignment needs n >= 0 and at least one size limit");
    open_bucket *ob = ct_alloc_zeroed(sizeof *ob * (size_t)(n ? n : 1), CT_MEM_OTHER);
    closed *cl = ct_alloc_zeroed(sizeof *cl * (size_t)(n ? n : 1), CT_MEM_OTHER);
    int *remap = ct_alloc_zeroed(sizeof *remap * (size_t)(n ? n : 1), CT_MEM_OTHER);
    if (!ob || !cl || !remap) {
        ct_free(ob);
        ct_free(cl);
        ct_free(remap);
        return CT_ENOMEM;
    }
    int nopen = 0, nclosed = 0;
    /* Members of the open bucket of a key carry -(slot+1) until it closes. */
    for (int i = 0; i < n; i++) {
        int s = 0;
        while (s < nopen && ob[s].key != keys[i]) s++;
        if (s == nopen) ob[nopen++] = (open_bucket){keys[i], 0, 0, -1};
        open_bucket *b = &ob[s];
        if (b->first < 0) b->first = i;
        b->bytes += bytes[i];
        bucket_of[i] = -(s + 1);
        if (b->bytes >= limits[b->limit_i]) {
            for (int j = b->first; j <= i; j++)
                if (bucket_of[j] == -(s + 1)) bucket_of[j] = nclosed;
            cl[nclosed] = (closed){b->first, nclosed};
            nclosed++;
            b->bytes = 0;
            b->first = -1;
            if (b->limit_i + 1 < nlimits) b->limit_i++;
        }
    }
    for (int s = 0; s < nopen; s++) { /* leftovers */
        if (ob[s].first < 0) continue;
        for (int j = ob[s].first; j < n; j++)
            if (bucket_of[j] == -(s + 1)) bucket_of[j] = nclosed;
        cl[nclosed] = (closed){ob[s].first, nclosed};
        nclosed++;
    }
    qsort(cl, (size_t)nclosed, sizeof *cl, by_first);
    for (int b = 0; b < nclosed; b++) remap[cl[b].id] = b;
    for (int i = 0; i < n; i++) bucket_of[i] = remap[bucket_of[i]];
    *nbuckets = nclosed;
    ct_free(ob);
    ct_free(cl);
    ct_free(remap);
    return CT_OK;
}
