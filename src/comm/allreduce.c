/*
 * Allreduce.  Three ways, chosen on the comm thread when it starts:
 *   MPI      one MPI_Iallreduce (the group has no shared allocations, or
 *            the ranks agreed that every one passes private memory, or an
 *            integer dtype), AVG scaled afterwards;
 *   direct   every rank passes the same range of one of the group's shared
 *            allocations (all on one node): after the agreement's barrier,
 *            rank r reduces slice r of the range across all ranks' buffers
 *            and writes it into all of them; a second barrier and every
 *            buffer holds the whole result (shm.c says why this is safe).
 *            Each rank reads ~N and writes ~N bytes for any group size; the
 *            sum runs in rank order, so the result is the same bits on every
 *            rank, and with 2 ranks an f32 sum is exactly MPI's a + b.
 *   two-level  the group spans nodes and every rank passes the same range of
 *            one of its shared allocations (windows per node, f32/bf16/f16):
 *            1. inside each node, rank r reduces slice r of the range across
 *               the node's buffers into the node leader's (its first rank's)
 *               buffer, in rank order, through shared memory;
 *            2. the leaders allreduce their buffers with MPI (one
 *               MPI_Iallreduce among the leaders; AVG as a sum, scaled by
 *               1/size after);
 *            3. inside each node the other ranks copy the leader's result.
 *            Only one rank per node sends over the network, and only N
 *            bytes; inside a node the work is spread like the direct path's.
 *            Chosen over "reduce-scatter in the node, allreduce of slices
 *            across nodes, all-gather in the node" because that one needs
 *            the same number of ranks on every node to pair up the slices,
 *            and fake nodes (CTRAIN_FAKE_NODES=K not dividing the ranks) or
 *            real clusters need not have it; figures in bench/comm_overlap
 *            --compare-two-level.
 * On a group with shared allocations every allreduce agrees first, so ranks
 * that pass different ranges or dtypes all fail with CT_EINVAL: through the
 * control block on one node (shm.c), through a small MPI_Iallreduce of a
 * hash of the arguments (its minimum and maximum) across nodes.
 */
#include <stdatomic.h>
#include <string.h>

#include "internal.h"

enum { PH_AGREE = 0, PH_MPI, PH_DIRECT,
       /* two-level */
       PH_HAGREE, PH_INPUTS, PH_REDUCED, PH_INTER, PH_RESULT, PH_COPIED };

#define SPIN_SECONDS 100e-6 /* the second barrier's busy wait before handing back to the engine */

typedef struct {
    ct_work w;
    void *buf;
    int count;
    ct_dtype dt;
    ct_reduce_op op;
    int agree; /* the group has shared allocations */
    int two_level; /* ... in windows per node */
    ct__shm_ref ref;
    ct__agree ag;
    int64_t h[2]; /* two-level agreement: hash of the arguments, and its negation */
    int phase;
    uint64_t target;
} allreduce_op;

static int is_float(ct_dtype dt) { return dt == CT_F32 || dt == CT_BF16 || dt == CT_F16; }

static int start_mpi(allreduce_op *o)
{
    ct_work *w = &o->w;
    o->phase = PH_MPI;
    w->gate = 0; /* the group's next collective may make its MPI calls */
    ct__traffic_coll(CT_COLL_ALLREDUCE, w->g->size, 0, (uint64_t)o->count * ct_dtype_size(o->dt));
    return ct__op_mpi(w, MPI_Iallreduce(MPI_IN_PLACE, o->buf, o->count, ct__mpi_dtype(o->dt),
                                        ct__mpi_op(o->dt, o->op), w->g->comm, &w->req),
                      "MPI_Iallreduce");
}

/* ---- two-level ---------------------------------------------------------- */

_Atomic uint64_t ct__allreduce_two_level_runs;

static int start_two_level(allreduce_op *o)
{
    int64_t h = ct__args_hash(CT__KIND_ALLREDUCE, &o->ref, o->count, o->dt, (int)o->op, 0);
    o->phase = PH_HAGREE;
    return ct__hash_agree_start(&o->w, o->h, h, "MPI_Iallreduce (agreeing on an allreduce's arguments)");
}

static int two_level_progress(allreduce_op *o)
{
    ct_work *w = &o->w;
    ct_group *g = w->g, *t = g->node;
    int leader = t->rank == 0;
    size_t esz = ct_dtype_size(o->dt);
    switch (o->phase) {
    case PH_HAGREE:
        if (!ct__hash_agreed(o->h))
            return ct__op_fail(w, ct_error(CT_EINVAL, "allreduce: the ranks passed different "
                                                      "arguments (this rank: %d x %s %s %s); pass "
                                                      "the same count, dtype and op on every "
                                                      "rank, and the same range of one "
                                                      "ct_group_alloc_shared allocation on every "
                                                      "rank (or private memory on every rank)",
                                           o->count, ct_dtype_name(o->dt), ct__op_name(o->op),
                                           o->ref.a ? "in shared memory" : "in private memory"));
        if (o->count == 0) return CT__DONE;
        if (!o->ref.a || !(o->dt == CT_F32 || o->dt == CT_BF16 || o->dt == CT_F16))
            return start_mpi(o);
        atomic_fetch_add(&ct__allreduce_two_level_runs, 1);
        o->target = ct__shm_arrive(t, &o->ref);
        o->phase = PH_INPUTS;
        return CT__MOVED;
    case PH_INPUTS: { /* 1: slices of the node's sum into the leader's buffer */
        if (!ct__shm_passed(t, o->target, &o->ref)) return CT__WAIT;
        int64_t lo, hi;
        ct__shm_slice(o->count, o->ref.off, esz, t->size, t->rank, &lo, &hi);
        if (hi > lo) {
            void *src[t->size], *dst;
            for (int r = 0; r < t->size; r++)
                src[r] = (char *)ct__shm_peer(&o->ref, r) + (size_t)lo * esz;
            dst = src[0];
            ct__reduce_into(src, t->size, &dst, 1, hi - lo, o->dt,
                            o->op == CT_OP_AVG ? CT_OP_SUM : o->op, 1.0f);
        }
        o->target = ct__shm_arrive(t, &o->ref);
        if (!leader) {
            o->target = ct__shm_arrive(t, &o->ref); /* nothing to publish for step 3 */
            o->phase = PH_RESULT;
            return CT__MOVED;
        }
        o->phase = PH_REDUCED;
        return CT__MOVED;
    }
    case PH_REDUCED: /* 2: the leaders, across nodes */
        if (!ct__shm_passed(t, o->target, &o->ref)) return CT__WAIT;
        o->phase = PH_INTER;
        ct__traffic_coll(CT_COLL_ALLREDUCE, g->leaders->size, 0, (uint64_t)o->count * esz);
        return ct__op_mpi(w, MPI_Iallreduce(MPI_IN_PLACE, o->buf, o->count, ct__mpi_dtype(o->dt),
                                            ct__mpi_op(o->dt, o->op), g->leaders->comm, &w->req),
                          "MPI_Iallreduce (between nodes)");
    case PH_INTER:
        if (o->op == CT_OP_AVG) ct__scale(o->buf, o->count, o->dt, g->size);
        o->target = ct__shm_arrive(t, &o->ref);
        o->phase = PH_RESULT;
        return CT__MOVED;
    case PH_RESULT: /* 3: the others copy the leader's result */
        if (!ct__shm_passed(t, o->target, &o->ref)) return CT__WAIT;
        if (!leader) memcpy(o->buf, ct__shm_peer(&o->ref, 0), (size_t)o->count * esz);
        o->target = ct__shm_arrive(t, &o->ref);
        o->phase = PH_COPIED;
        return CT__MOVED;
    case PH_COPIED: /* the leader's buffer stays unchanged until all copied it */
        return ct__shm_passed(t, o->target, &o->ref) ? CT__DONE : CT__WAIT;
    }
    CT_ASSERT(!"allreduce: unknown two-level phase");
    return CT__DONE;
}

static int allreduce_start(ct_work *w)
{
    allreduce_op *o = (allreduce_op *)w;
    if (o->two_level) return start_two_level(o);
    if (!o->agree) return start_mpi(o);
    ct__agree_start(w->g, &o->ag, &o->ref, o->count, o->dt, o->op, CT__KIND_ALLREDUCE, -1);
    o->phase = PH_AGREE;
    return CT__MOVED;
}

/* This rank's slice of the range, reduced across every rank's buffer and
 * written into all of them. */
static void reduce_slice(allreduce_op *o)
{
    ct_group *g = o->w.g;
    int W = g->size;
    size_t esz = ct_dtype_size(o->dt);
    int64_t lo, hi;
    ct__shm_slice(o->count, o->ref.off, esz, W, g->rank, &lo, &hi);
    if (hi <= lo) return;
    void *src[W];
    for (int r = 0; r < W; r++) src[r] = (char *)ct__shm_peer(&o->ref, r) + (size_t)lo * esz;
    float inv = o->op == CT_OP_AVG ? 1.0f / (float)W : 1.0f;
    ct__reduce_into(src, W, src, W, hi - lo, o->dt, o->op, inv);
}

static int allreduce_progress(ct_work *w)
{
    allreduce_op *o = (allreduce_op *)w;
    ct_group *g = w->g;
    if (o->phase >= PH_HAGREE) return two_level_progress(o);
    switch (o->phase) {
    case PH_MPI:
        if (o->op == CT_OP_AVG) ct__scale(o->buf, o->count, o->dt, g->size);
        return CT__DONE;
    case PH_AGREE:
        if (ct__agree_poll(w, &o->ag, "allreduce") == CT__WAIT) return CT__WAIT;
        if (w->status != CT_OK || o->count == 0) return CT__DONE;
        if (!o->ref.a || !is_float(o->dt)) return start_mpi(o);
        double t0 = ct_now();
        reduce_slice(o);
        double t1 = ct_now();
        ct_trace_event("shm allreduce", "comm", t0, t1, 1);
        o->target = ct__shm_arrive(g, &o->ref);
        o->phase = PH_DIRECT;
        /* The peers are most likely summing their slices right now. */
        if (!ct__shm_spin(g, o->target, SPIN_SECONDS)) return CT__MOVED;
        ct__shm_passed(g, o->target, &o->ref);
        return CT__DONE;
    case PH_DIRECT:
        return ct__shm_passed(g, o->target, &o->ref) ? CT__DONE : CT__WAIT;
    }
    CT_ASSERT(!"allreduce: unknown phase");
    return CT__DONE;
}

static void allreduce_blame(const ct_work *w, char *out, size_t n)
{
    const allreduce_op *o = (const allreduce_op *)w;
    if (o->phase == PH_AGREE) ct__shm_absent(w->g, o->ag.target, out, n);
    else if (o->phase == PH_DIRECT) ct__shm_absent(w->g, o->target, out, n);
    else if (o->phase == PH_INPUTS || o->phase == PH_REDUCED || o->phase == PH_RESULT ||
             o->phase == PH_COPIED)
        ct__shm_absent(w->g->node, o->target, out, n);
}

static const ct__op_vt allreduce_vt = {.name = "allreduce",
                                       .flags = CT__OP_ORDERED | CT__OP_GATE,
                                       .start = allreduce_start,
                                       .progress = allreduce_progress,
                                       .blame = allreduce_blame};

ct_status ct_group_allreduce(ct_group *g, void *buf, int64_t count, ct_dtype dt,
                             ct_reduce_op op, ct_work **work)
{
    CT_TRY(ct__check_args(g, buf, count, dt, "allreduce"));
    CT_TRY(ct__check_op(dt, op, "allreduce"));
    ct__shm_ref ref = {0};
    int agree = ct__shm_active(g), two_level = ct__shm_node_active(g);
    if (agree || two_level)
        CT_TRY(ct__shm_locate(g, buf, (size_t)count * ct_dtype_size(dt), &ref, "allreduce"));
    allreduce_op *o = ct__work_new(g, &allreduce_vt, sizeof *o);
    if (!o) return CT_ENOMEM;
    ct__work_describe(&o->w, dt, count, -1, op);
    o->buf = buf;
    o->count = (int)count;
    o->dt = dt;
    o->op = op;
    o->agree = agree;
    o->two_level = two_level;
    o->ref = ref;
    return ct__submit(&o->w, work);
}
