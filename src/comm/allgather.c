/*
 * All-gather.  MPI: one MPI_Iallgather.  Direct, when every rank's receive
 * buffer is the same range of one of the group's shared allocations (any
 * dtype; send may be private): after the agreement's barrier each rank
 * copies its send into its own block of its receive buffer, passes a
 * barrier, then copies every other rank's block from that rank's receive
 * buffer into its own (reading its peers', writing only its own memory); a
 * last barrier keeps the blocks unchanged until all have copied them.
 * Agreement first (shm.c): mismatched arguments are an error on every rank.
 *
 * Two-level, when the group spans nodes and every rank's receive buffer is
 * the same range of one of its shared allocations (windows per node; any
 * dtype):
 *   1. every rank copies its send into its block of its node leader's (the
 *      node's first rank's) receive buffer, through shared memory; barrier;
 *   2. the leaders exchange their nodes' blocks with one MPI_Iallgatherv
 *      (node n sends its ranks' blocks, count x ranks on n: nodes may hold
 *      different numbers of ranks), in place in the leader's receive
 *      buffer when every node's ranks are contiguous in the group (fake
 *      nodes, and by-slot placement on clusters), else packed node by node
 *      into a private buffer and unpacked;
 *   3. the other ranks copy the leader's whole buffer; a last barrier keeps
 *      it unchanged until all have.
 * Only the leaders use the network, each sending its node's blocks once
 * (MPI's flat all-gather sends every rank's block from every rank).  The
 * result is a copy, so it is the flat path's bits for every dtype.
 * Arguments are agreed first by a small MPI_Iallreduce of a hash of them
 * across the group (as the two-level allreduce does): a mismatch, or
 * private memory on some ranks only, is CT_EINVAL on every rank.
 *
 * All-gather with counts per rank (allgatherv): one MPI_Iallgatherv.
 */
#include <limits.h>
#include <stdatomic.h>
#include <string.h>

#include "internal.h"

enum { PH_AGREE = 0, PH_MPI, PH_OWN, PH_COPIED,
       /* two-level */
       PH_HAGREE, PH_GATHERED, PH_INTER, PH_RESULT, PH_LCOPIED };

typedef struct {
    ct_work w;
    void *recv;
    const void *send;
    int count;
    ct_dtype dt;
    int inplace;
    int *counts, *displs; /* allgatherv, and two-level on leaders (per node): ct_alloc'd */
    int agree;            /* allgather on a group with shared allocations */
    int two_level;        /* ... in windows per node (the group spans nodes) */
    int rank_order;       /* two-level leaders: node blocks lie in rank order */
    int64_t *pos;         /* two-level leaders, not rank order: each rank's block in pack */
    char *pack;           /* ... the node-major buffer */
    int64_t h[2];         /* two-level agreement: hash of the arguments, and its negation */
    ct__shm_ref ref;      /* of recv */
    ct__agree ag;
    int phase;
    uint64_t target;
} allgather_op;

static int start_mpi(allgather_op *o)
{
    ct_work *w = &o->w;
    MPI_Datatype t = ct__mpi_dtype(o->dt);
    o->phase = PH_MPI;
    w->gate = 0;
    ct__traffic_coll(CT_COLL_ALLGATHER, w->g->size, 0, (uint64_t)w->g->size * (uint64_t)o->count * ct_dtype_size(o->dt));
    return ct__op_mpi(w, MPI_Iallgather(o->inplace ? MPI_IN_PLACE : o->send, o->count, t, o->recv,
                                        o->count, t, w->g->comm, &w->req),
                      "MPI_Iallgather");
}

/* ---- two-level ---------------------------------------------------------- */

_Atomic uint64_t ct__allgather_two_level_runs;

/* Agrees on count, dtype and where recv lies; in place may differ by rank. */
static int start_two_level(allgather_op *o)
{
    int64_t h = ct__args_hash(CT__KIND_ALLGATHER, &o->ref, o->count, o->dt, 0, 0);
    o->phase = PH_HAGREE;
    return ct__hash_agree_start(&o->w, o->h, h, "MPI_Iallreduce (agreeing on an all-gather's arguments)");
}

static int two_level_progress(allgather_op *o)
{
    ct_work *w = &o->w;
    ct_group *g = w->g, *t = g->node;
    int leader = t->rank == 0;
    size_t esz = ct_dtype_size(o->dt), block = (size_t)o->count * esz;
    MPI_Datatype dt = ct__mpi_dtype(o->dt);
    switch (o->phase) {
    case PH_HAGREE:
        if (!ct__hash_agreed(o->h))
            return ct__op_fail(w, ct_error(CT_EINVAL, "allgather: the ranks passed different "
                                                      "arguments (this rank: %d x %s %s); pass "
                                                      "the same count and dtype on every rank, "
                                                      "and the same range of one "
                                                      "ct_group_alloc_shared allocation as the "
                                                      "receive buffer on every rank (or private "
                                                      "memory on every rank)",
                                           o->count, ct_dtype_name(o->dt),
                                           o->ref.a ? "in shared memory" : "in private memory"));
        if (o->count == 0) return CT__DONE;
        if (!o->ref.a || (int64_t)g->size * o->count > INT_MAX) return start_mpi(o);
        atomic_fetch_add(&ct__allgather_two_level_runs, 1);
        /* 1: this rank's block into the leader's buffer */
        if (!(leader && o->inplace))
            memcpy((char *)ct__shm_peer(&o->ref, 0) + (size_t)g->rank * block, o->send, block);
        o->target = ct__shm_arrive(t, &o->ref);
        o->phase = PH_GATHERED;
        return CT__MOVED;
    case PH_GATHERED: /* 2: the leaders, across nodes */
        if (!ct__shm_passed(t, o->target, &o->ref)) return CT__WAIT;
        if (!leader) {
            o->target = ct__shm_arrive(t, &o->ref); /* nothing to publish for step 3 */
            o->phase = PH_RESULT;
            return CT__MOVED;
        }
        o->phase = PH_INTER;
        ct__traffic_coll(CT_COLL_ALLGATHER, g->leaders->size, 0, (uint64_t)g->size * block);
        if (o->rank_order)
            return ct__op_mpi(w, MPI_Iallgatherv(MPI_IN_PLACE, 0, dt, o->recv, o->counts,
                                                 o->displs, dt, g->leaders->comm, &w->req),
                              "MPI_Iallgatherv (between nodes)");
        for (int r = 0; r < g->size; r++)
            if (g->node_of[r] == g->leaders->rank)
                memcpy(o->pack + (size_t)o->pos[r] * esz, (char *)o->recv + (size_t)r * block,
                       block);
        return ct__op_mpi(w, MPI_Iallgatherv(MPI_IN_PLACE, 0, dt, o->pack, o->counts, o->displs,
                                             dt, g->leaders->comm, &w->req),
                          "MPI_Iallgatherv (between nodes)");
    case PH_INTER:
        if (!o->rank_order)
            for (int r = 0; r < g->size; r++)
                if (g->node_of[r] != g->leaders->rank)
                    memcpy((char *)o->recv + (size_t)r * block,
                           o->pack + (size_t)o->pos[r] * esz, block);
        o->target = ct__shm_arrive(t, &o->ref);
        o->phase = PH_RESULT;
        return CT__MOVED;
    case PH_RESULT: /* 3: the others copy the leader's buffer */
        if (!ct__shm_passed(t, o->target, &o->ref)) return CT__WAIT;
        if (!leader)
            memcpy(o->recv, ct__shm_peer(&o->ref, 0), (size_t)g->size * block);
        o->target = ct__shm_arrive(t, &o->ref);
        o->phase = PH_LCOPIED;
        return CT__MOVED;
    case PH_LCOPIED: /* the leader's buffer stays unchanged until all copied it */
        return ct__shm_passed(t, o->target, &o->ref) ? CT__DONE : CT__WAIT;
    }
    CT_ASSERT(!"allgather: unknown two-level phase");
    return CT__DONE;
}

static int allgather_start(ct_work *w)
{
    allgather_op *o = (allgather_op *)w;
    if (o->two_level) return start_two_level(o);
    if (!o->agree) return start_mpi(o);
    ct__agree_start(w->g, &o->ag, &o->ref, o->count, o->dt, CT_OP_SUM, CT__KIND_ALLGATHER, -1);
    o->phase = PH_AGREE;
    return CT__MOVED;
}

static int allgather_progress(ct_work *w)
{
    allgather_op *o = (allgather_op *)w;
    ct_group *g = w->g;
    size_t block = (size_t)o->count * ct_dtype_size(o->dt);
    if (o->phase >= PH_HAGREE) return two_level_progress(o);
    switch (o->phase) {
    case PH_MPI:
        return CT__DONE;
    case PH_AGREE:
        if (ct__agree_poll(w, &o->ag, "allgather") == CT__WAIT) return CT__WAIT;
        if (w->status != CT_OK || o->count == 0) return CT__DONE;
        if (!o->ref.a) return start_mpi(o);
        if (!o->inplace) memcpy((char *)o->recv + (size_t)g->rank * block, o->send, block);
        o->target = ct__shm_arrive(g, &o->ref);
        o->phase = PH_OWN;
        return CT__MOVED;
    case PH_OWN:
        if (!ct__shm_passed(g, o->target, &o->ref)) return CT__WAIT;
        for (int r = 0; r < g->size; r++)
            if (r != g->rank)
                memcpy((char *)o->recv + (size_t)r * block,
                       (char *)ct__shm_peer(&o->ref, r) + (size_t)r * block, block);
        o->target = ct__shm_arrive(g, &o->ref);
        o->phase = PH_COPIED;
        return CT__MOVED;
    case PH_COPIED:
        return ct__shm_passed(g, o->target, &o->ref) ? CT__DONE : CT__WAIT;
    }
    CT_ASSERT(!"allgather: unknown phase");
    return CT__DONE;
}

static void allgather_blame(const ct_work *w, char *out, size_t n)
{
    const allgather_op *o = (const allgather_op *)w;
    if (o->phase == PH_AGREE) ct__shm_absent(w->g, o->ag.target, out, n);
    else if (o->phase == PH_OWN || o->phase == PH_COPIED) ct__shm_absent(w->g, o->target, out, n);
    else if (o->phase == PH_GATHERED || o->phase == PH_RESULT || o->phase == PH_LCOPIED)
        ct__shm_absent(w->g->node, o->target, out, n);
}

static int allgatherv_start(ct_work *w)
{
    allgather_op *o = (allgather_op *)w;
    MPI_Datatype t = ct__mpi_dtype(o->dt);
    uint64_t total = 0; /* counted as equal parts (tally.c) */
    for (int r = 0; r < w->g->size; r++) total += (uint64_t)o->counts[r];
    ct__traffic_coll(CT_COLL_ALLGATHER, w->g->size, 0, total * ct_dtype_size(o->dt));
    return ct__op_mpi(w, MPI_Iallgatherv(o->inplace ? MPI_IN_PLACE : o->send, o->count, t,
                                         o->recv, o->counts, o->displs, t, w->g->comm, &w->req),
                      "MPI_Iallgatherv");
}

static void allgather_destroy(ct_work *w)
{
    allgather_op *o = (allgather_op *)w;
    ct_free(o->counts);
    ct_free(o->displs);
    ct_free(o->pos);
    ct_free(o->pack);
}

static const ct__op_vt allgather_vt = {.name = "allgather",
                                       .flags = CT__OP_ORDERED | CT__OP_GATE,
                                       .start = allgather_start, .progress = allgather_progress,
                                       .destroy = allgather_destroy, .blame = allgather_blame};
static const ct__op_vt allgatherv_vt = {.name = "allgatherv", .flags = CT__OP_ORDERED,
                                        .start = allgatherv_start, .destroy = allgather_destroy};

ct_status ct_group_allgather(ct_group *g, const void *send, void *recv, int64_t count,
                             ct_dtype dt, ct_work **work)
{
    CT_TRY(ct__check_args(g, send, count, dt, "allgather"));
    if (count > 0 && !recv) return ct_error(CT_EINVAL, "allgather: receive buffer is NULL");
    size_t esz = ct_dtype_size(dt), block = (size_t)count * esz;
    int inplace = send == (const char *)recv + (size_t)g->rank * block;
    if (!inplace && ct__overlaps(send, block, recv, block * (size_t)g->size))
        return ct_error(CT_EINVAL, "allgather: send overlaps the receive buffer; for in place "
                                   "pass send = recv + rank*count");
    ct__shm_ref ref = {0};
    int agree = ct__shm_active(g), two_level = ct__shm_node_active(g);
    if (agree || two_level)
        CT_TRY(ct__shm_locate(g, recv, block * (size_t)g->size, &ref, "allgather"));
    allgather_op *o = ct__work_new(g, &allgather_vt, sizeof *o);
    if (!o) return CT_ENOMEM;
    ct__work_describe(&o->w, dt, count, -1, -1);
    if (two_level && ref.a && g->leaders && count > 0 && (int64_t)g->size * count <= INT_MAX) {
        /* the leader's layout of node blocks, made here so that running out
         * of memory fails before anything is sent */
        int layout = ct__node_layout(g, count, &o->counts, &o->displs, &o->pos);
        o->rank_order = layout == 1;
        if (layout == 0) o->pack = ct_alloc(block * (size_t)g->size, CT_MEM_COMM);
        if (layout < 0 || (layout == 0 && !o->pack)) {
            ct__work_destroy(&o->w);
            return ct_error(CT_ENOMEM, "allgather: out of memory for the two-level layout");
        }
    }
    o->agree = agree;
    o->two_level = two_level;
    o->ref = ref;
    o->recv = recv;
    o->send = send;
    o->count = (int)count;
    o->dt = dt;
    o->inplace = inplace;
    return ct__submit(&o->w, work);
}

ct_status ct_group_allgatherv(ct_group *g, const void *send, int64_t send_count, void *recv,
                              const int64_t *counts, const int64_t *displs, ct_dtype dt,
                              ct_work **work)
{
    CT_TRY(ct__check_args(g, send, send_count, dt, "allgatherv"));
    if (!counts) return ct_error(CT_EINVAL, "allgatherv: counts is NULL");
    int64_t end = 0, at = 0;
    for (int r = 0; r < g->size; r++) {
        int64_t d = displs ? displs[r] : at;
        if (counts[r] < 0 || d < 0 || d > INT_MAX || counts[r] > INT_MAX - d)
            return ct_error(CT_EINVAL, "allgatherv: rank %d has count %lld at offset %lld; counts "
                                       "and offsets must be >= 0 and end below %d",
                            r, (long long)counts[r], (long long)d, INT_MAX);
        at = d + counts[r];
        if (at > end) end = at;
    }
    if (send_count != counts[g->rank])
        return ct_error(CT_EINVAL, "allgatherv: send_count %lld differs from counts[%d] = %lld",
                        (long long)send_count, g->rank, (long long)counts[g->rank]);
    CT_TRY(ct__check_args(g, recv, end, dt, "allgatherv (receive buffer)"));
    size_t esz = ct_dtype_size(dt);
    int64_t mine = displs ? displs[g->rank] : 0;
    if (!displs)
        for (int r = 0; r < g->rank; r++) mine += counts[r];
    int inplace = send == (const char *)recv + (size_t)mine * esz;
    if (!inplace && ct__overlaps(send, (size_t)send_count * esz, recv, (size_t)end * esz))
        return ct_error(CT_EINVAL, "allgatherv: send overlaps the receive buffer; for in place "
                                   "pass send = recv + displs[rank]");
    allgather_op *o = ct__work_new(g, &allgatherv_vt, sizeof *o);
    if (!o) return CT_ENOMEM;
    ct__work_describe(&o->w, dt, end, -1, -1); /* the receive size: the same on every rank */
    o->recv = recv;
    o->send = send;
    o->count = (int)send_count;
    o->dt = dt;
    o->inplace = inplace;
    o->counts = ct_alloc_zeroed((size_t)g->size * sizeof(int), CT_MEM_OTHER);
    o->displs = ct_alloc_zeroed((size_t)g->size * sizeof(int), CT_MEM_OTHER);
    if (!o->counts || !o->displs) {
        ct__work_destroy(&o->w);
        return CT_ENOMEM;
    }
    for (int r = 0, a = 0; r < g->size; r++) {
        o->counts[r] = (int)counts[r];
        o->displs[r] = displs ? (int)displs[r] : a;
        a += o->counts[r];
    }
    return ct__submit(&o->w, work);
}

ct_status ct_group_mem_reports(ct_group *g, ct_mem_report *all)
{
    ct_mem_report mine;
    ct_mem_report_get(&mine);
    if (!g || ct_group_size(g) == 1) {
        all[0] = mine;
        return CT_OK;
    }
    return ct_group_allgather(g, &mine, all, (int64_t)sizeof mine, CT_U8, NULL);
}
