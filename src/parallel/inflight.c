/*
 * The one queue of reduces in flight, oldest first, with the bytes each
 * holds: ZeRO-2's gradients on their way to the owners (bounded by
 * reduce_buffer_mb) and FSDP's units being reduce-scattered (bounded to two
 * units).  The strategy decides what "finish" means; the queue only keeps
 * the order and the byte count.  Entries are ids (a parameter's, a unit's
 * index), each at most once, so cap ids never overflow it.
 */
#include <string.h>

#include "internal.h"

ct_status ct__inflight_init(ct__inflight *q, int cap)
{
    memset(q, 0, sizeof *q);
    q->id = ct_alloc(sizeof *q->id * (size_t)(cap + 1), CT_MEM_OTHER);
    q->bytes = ct_alloc(sizeof *q->bytes * (size_t)(cap + 1), CT_MEM_OTHER);
    q->cap = cap;
    if (q->id && q->bytes) return CT_OK;
    ct__inflight_fini(q);
    return CT_ENOMEM;
}

void ct__inflight_fini(ct__inflight *q)
{
    ct_free(q->id);
    ct_free(q->bytes);
    memset(q, 0, sizeof *q);
}

void ct__inflight_push(ct__inflight *q, int id, size_t bytes)
{
    CT_ASSERT(q->n < q->cap);
    if (q->head + q->n == q->cap) { /* the tail reached the end: move the live part to the front */
        memmove(q->id, q->id + q->head, sizeof *q->id * (size_t)q->n);
        memmove(q->bytes, q->bytes + q->head, sizeof *q->bytes * (size_t)q->n);
        q->head = 0;
    }
    q->id[q->head + q->n] = id;
    q->bytes[q->head + q->n] = bytes;
    q->n++;
    q->total += bytes;
}

int ct__inflight_take(ct__inflight *q, int pos)
{
    CT_ASSERT(pos >= 0 && pos < q->n);
    int at = q->head + pos, id = q->id[at];
    q->total -= q->bytes[at];
    if (pos == 0) {
        q->head++;
    } else {
        memmove(q->id + at, q->id + at + 1, sizeof *q->id * (size_t)(q->n - pos - 1));
        memmove(q->bytes + at, q->bytes + at + 1, sizeof *q->bytes * (size_t)(q->n - pos - 1));
    }
    if (--q->n == 0) q->head = 0;
    return id;
}

int ct__inflight_find(const ct__inflight *q, int id)
{
    for (int k = 0; k < q->n; k++)
        if (q->id[q->head + k] == id) return k;
    return -1;
}
