/*
 * Counting collectives: every collective describes itself once when it is
 * made (ct__work_describe), which adds its call and payload to its kind's
 * tally here.  And counting traffic: every MPI call that moves a payload
 * (a collective's, a two-level path's step between nodes or inside one, a
 * send or a recv) adds what this rank sends and receives in messages.
 * Atomic, as any thread may start a collective.
 */
#include <stdatomic.h>
#include <string.h>

#include "internal.h"

static _Atomic uint64_t calls[CT_COLL_NKINDS], bytes[CT_COLL_NKINDS];
static _Atomic uint64_t sent, received;

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
    atomic_store(&sent, 0);
    atomic_store(&received, 0);
}

/* MPI chooses its algorithm per call, out of sight; the figures are those of
 * the bandwidth-optimal ones it uses for large payloads (a ring, or
 * Rabenseifner's reduce-scatter then all-gather, which move the same), the
 * least any algorithm moves: over n ranks of which this one is at position
 * pos (from the root), for a payload of b bytes (an allreduce's buffer, a
 * reduce-scatter's whole input, an all-gather's whole output, a broadcast's
 * or reduce's buffer):
 *   allreduce       sends and receives 2 (n-1)/n b
 *   reduce-scatter  sends and receives (n-1)/n b
 *   all-gather      sends and receives (n-1)/n b
 *   broadcast       a pipelined chain from the root: each rank but the root
 *                   receives b, each but the last sends it on
 *   reduce          the same chain towards the root
 *   scatter         the root sends (n-1)/n b, the others receive b/n. */
void ct__traffic_coll(ct_coll_kind kind, int n, int pos, uint64_t b)
{
    if (n < 2 || !b) return;
    uint64_t s = 0, r = 0, part = b / (uint64_t)n * (uint64_t)(n - 1) + b % (uint64_t)n * (uint64_t)(n - 1) / (uint64_t)n;
    switch (kind) {
    case CT_COLL_ALLREDUCE: s = r = 2 * part; break;
    case CT_COLL_REDUCE_SCATTER:
    case CT_COLL_ALLGATHER: s = r = part; break;
    case CT_COLL_BROADCAST:
        r = pos ? b : 0;
        s = pos < n - 1 ? b : 0;
        break;
    case CT_COLL_REDUCE:
        s = pos ? b : 0;
        r = pos < n - 1 ? b : 0;
        break;
    default: /* CT__COLL_SCATTER */
        s = pos ? 0 : part;
        r = pos ? b / (uint64_t)n : 0;
        break;
    }
    atomic_fetch_add(&sent, s);
    atomic_fetch_add(&received, r);
}

void ct__traffic_p2p(uint64_t s, uint64_t r)
{
    atomic_fetch_add(&sent, s);
    atomic_fetch_add(&received, r);
}

ct_comm_traffic ct_comm_traffic_get(void)
{
    return (ct_comm_traffic){atomic_load(&sent), atomic_load(&received)};
}
