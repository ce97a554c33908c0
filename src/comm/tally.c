/*
 * Counting collectives: every collective describes itself once when it is
 * made (ct__work_describe), which adds its call and payload to its kind's
 * tally here.  Atomic, as any thread may start a collective.
 */
#include <stdatomic.h>
#include <string.h>

#include "internal.h"

static _Atomic uint64_t calls[CT_COLL_NKINDS], bytes[CT_COLL_NKINDS];

/* The kind of an operation by its table's name; -1: not a counted collective. */
static int kind_of(const char *name)
{
    static const struct { const char *name; ct_coll_kind kind; } names[] = {
        {"allreduce", CT_COLL_ALLREDUCE},   {"reduce", CT_COLL_REDUCE},
        {"broadcast", CT_COLL_BROADCAST},   {"allgather", CT_COLL_ALLGATHER},
        {"allgatherv", CT_COLL_ALLGATHER},  {"reduce_scatter", CT_COLL_REDUCE_SCATTER},
    };
    for (size_t i = 0; name && i < sizeof names / sizeof names[0]; i++)
        if (!strcmp(name, names[i].name)) return (int)names[i].kind;
    return -1;
}

void ct__tally_add(const ct_work *w, int dtype, int64_t count)
{
    int k = kind_of(w->vt->name);
    if (k < 0 || dtype < 0 || dtype >= CT_NDTYPE || count < 0) return;
    atomic_fetch_add(&calls[k], 1);
    atomic_fetch_add(&bytes[k], (uint64_t)count * ct_dtype_size((ct_dtype)dtype));
}

void ct_comm_tally_get(ct_comm_tally out[CT_COLL_NKINDS])
{
    for (int k = 0; k < CT_COLL_NKINDS; k++) out[k] = (ct_comm_tally){atomic_load(&calls[k]), atomic_load(&bytes[k])};
}

void ct_comm_tally_reset(void)
{
    for (int k = 0; k < CT_COLL_NKINDS; k++) {
        atomic_store(&calls[k], 0);
        atomic_store(&bytes[k], 0);
    }
}
