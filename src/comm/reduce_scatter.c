/*
 * Reduce-scatter.  MPI: one MPI_Ireduce_scatter_block; in place, MPI leaves
 * the result at the start of the input, so it is moved into this rank's
 * block afterwards, and AVG is scaled then.  Direct, when every rank's send
 * buffer is the same range of one of the group's shared allocations (f32,
 * bf16, f16; recv may be private): after the agreement's barrier rank r
 * reduces block r across all ranks' send buffers, in rank order, straight
 * into its recv; a second barrier keeps every send buffer unchanged until
 * all ranks have read it.  Each rank reads N and writes N/W bytes.
 * Agreement first (shm.c): mismatched arguments are an error on every rank.
 *
 * Ring, in place of MPI's for f32, bf16 and f16 in private memory: W-1
 * steps; at step k rank r sends its running sum of block r-k-1 to rank r+1
 * and receives rank r-1's sum of block r-k-2, to which it adds its own
 * (k = 0 sends its own block straight from send); the last step's sum is
 * block r, reduced into recv.  Each rank sends and receives (W-1)/W of the
 * bytes, like MPI's best, and holds two blocks of temporaries (one at two
 * ranks) whatever the world size.  Open MPI's nonblocking reduce-scatter
 * (libnbc) reduces to rank 0 along a binomial tree and scatters from it:
 * rank 0 and every inner rank of the tree allocate the whole input, so an
 * FSDP unit's gradient cost its size again on half the ranks, beyond any
 * budget planned per rank (8 ranks under a cgroup: ranks 0 and 4 killed).
 * Block b is summed in the fixed order b+1, b+2, ..., b, so results are the
 * same from run to run.  Messages go over the group's own duplicate
 * communicator, tagged by the collective's number, so two rings in flight
 * and a caller's point-to-point never match each other.
 *
 * Two-level, when the group spans nodes and every rank's send buffer is the
 * same range of one of its shared allocations (windows per node; f32, bf16,
 * f16; integers take the MPI path):
 *   1. barrier; the node's leader (its first rank) reduces every block
 *      across its node's send buffers, in rank order, into a private buffer
 *      laid out node by node (node 0's ranks' blocks, then node 1's, ...);
 *   2. the leaders reduce-scatter those node sums with one
 *      MPI_Ireduce_scatter, node n receiving its ranks' blocks (count x
 *      ranks on n: nodes may hold different numbers of ranks);
 *   3. the leader hands each rank of its node its block with an
 *      MPI_Iscatter over the node (which the MPI moves through shared
 *      memory); AVG is scaled by 1/size after, as on the MPI path.
 * Cost: only leaders use the network, each sending N/nodes-ish bytes per
 * node instead of every rank sending; but the leader alone reads its
 * node's L send buffers (L x N bytes) while the others wait, and the
 * scatter copies count elements per rank through MPI.  Chosen because the
 * send buffers must stay unchanged (out of place) and a rank's recv may be
 * private, so there is no shared memory to spread the node's sum or the
 * results over; an in-place variant that sums slices into the leader's
 * (clobberable) send buffer could spread step 1 (not done).
 * f32: exact inputs give the flat path's bits in any order; with rounding
 * the flat path's order is MPI's own, so bits can differ (as for the
 * two-level allreduce).  Arguments, including whether each rank is in
 * place, are agreed first by a small MPI_Iallreduce of a hash of them.
 */
#include <limits.h>
#include <stdatomic.h>
#include <string.h>

#include "internal.h"

enum { PH_AGREE = 0, PH_MPI, PH_DIRECT, PH_RING,
       /* two-level */
       PH_HAGREE, PH_INPUTS, PH_INTER, PH_SCATTER };

typedef struct {
    ct_work w;
    void *recv;
    const void *send;
    int count;
    ct_dtype dt;
    ct_reduce_op op;
    int inplace;
    int agree; /* the group has shared allocations */
    int two_level; /* ... in windows per node (the group spans nodes) */
    int *counts, *displs; /* two-level leaders: per node; ct_alloc'd */
    int64_t *pos;         /* ... each rank's block in sums */
    char *sums;           /* ... the node's sums, node by node */
    int64_t h[2];         /* two-level agreement: hash of the arguments, and its negation */
    char *tmp[2];          /* ring: the running sums received, ping-pong; ct_alloc'd */
    MPI_Request rq[2];     /* ring: this step's send and receive */
    int step;              /* ring: the step whose messages are in flight */
    ct__shm_ref ref; /* of send */
    ct__agree ag;
    int phase;
    uint64_t target;
} redscat_op;

static int is_float(ct_dtype dt) { return dt == CT_F32 || dt == CT_BF16 || dt == CT_F16; }

/* Whether the MPI path runs as ctrain's ring (decided at submit, where its
 * buffers are made, and again at start: the same inputs). */
static int rings(const ct_group *g, int64_t count, ct_dtype dt)
{
    return g->ring != MPI_COMM_NULL && g->size > 1 && count > 0 && is_float(dt);
}

/* Ring step o->step: send the running sum (own block at step 0), receive
 * the previous rank's into the other temporary. */
static int ring_post(redscat_op *o)
{
    ct_work *w = &o->w;
    ct_group *g = w->g;
    int W = g->size, r = g->rank, k = o->step;
    size_t block = (size_t)o->count * ct_dtype_size(o->dt);
    MPI_Datatype dt = ct__mpi_dtype(o->dt);
    int tag = (int)(w->seq % 32768u); /* MPI guarantees tags up to 32767 */
    const void *out = k == 0 ? (const char *)o->send + (size_t)((r - 1 + W) % W) * block
                             : o->tmp[(k - 1) % 2];
    ct__traffic_p2p(block, block); /* a block each way per step: exactly what moves */
    int rc = MPI_Irecv(o->tmp[k % 2], o->count, dt, (r - 1 + W) % W, tag, g->ring, &o->rq[1]);
    if (rc == MPI_SUCCESS)
        rc = MPI_Isend(out, o->count, dt, (r + 1) % W, tag, g->ring, &o->rq[0]);
    if (rc != MPI_SUCCESS) return ct__op_fail(w, ct__mpi_fail(rc, "MPI_Isend/MPI_Irecv (ring reduce-scatter)"));
    return CT__MOVED;
}

_Atomic uint64_t ct__reduce_scatter_ring_runs;

static int start_ring(redscat_op *o)
{
    atomic_fetch_add(&ct__reduce_scatter_ring_runs, 1);
    o->phase = PH_RING;
    o->w.gate = 0; /* its messages carry its own tag: later collectives may start */
    o->step = 0;
    o->rq[0] = o->rq[1] = MPI_REQUEST_NULL;
    return ring_post(o);
}

/* Polled: both of the step's messages done, adds this rank's own block to
 * the sum received and sends it on, or, at the last step, into recv. */
static int ring_progress(redscat_op *o)
{
    ct_work *w = &o->w;
    ct_group *g = w->g;
    int W = g->size, r = g->rank, k = o->step, done = 0, got = 0;
    MPI_Status st[2];
    int rc = MPI_Testall(2, o->rq, &done, st);
    if (rc != MPI_SUCCESS) return ct__op_fail(w, ct__mpi_fail(rc, "MPI_Testall (ring reduce-scatter)"));
    if (!done) return CT__WAIT;
    MPI_Get_count(&st[1], ct__mpi_dtype(o->dt), &got);
    if (got != o->count)
        return ct__op_fail(w, ct_error(CT_EINVAL, "reduce_scatter: rank %d sent %d elements of a "
                                                  "block where this rank (%d) expects %d; pass "
                                                  "the same count and dtype on every rank",
                                       (r - 1 + W) % W, got, r, o->count));
    size_t block = (size_t)o->count * ct_dtype_size(o->dt);
    int b = ((r - k - 2) % W + W) % W; /* the block just received */
    void *src[2] = {o->tmp[k % 2], (char *)o->send + (size_t)b * block};
    if (k == W - 2) {
        void *dst = o->recv;
        ct__reduce_into(src, 2, &dst, 1, o->count, o->dt, o->op,
                        o->op == CT_OP_AVG ? 1.0f / (float)W : 1.0f);
        return CT__DONE;
    }
    void *dst = o->tmp[k % 2];
    ct__reduce_into(src, 2, &dst, 1, o->count, o->dt, o->op == CT_OP_AVG ? CT_OP_SUM : o->op, 1.0f);
    o->step++;
    return ring_post(o);
}

static int start_mpi(redscat_op *o)
{
    ct_work *w = &o->w;
    if (o->tmp[0]) return start_ring(o);
    o->phase = PH_MPI;
    w->gate = 0;
    ct__traffic_coll(CT_COLL_REDUCE_SCATTER, w->g->size, 0, (uint64_t)w->g->size * (uint64_t)o->count * ct_dtype_size(o->dt));
    return ct__op_mpi(w, MPI_Ireduce_scatter_block(o->inplace ? MPI_IN_PLACE : o->send,
                                                   o->inplace ? (void *)o->send : o->recv,
                                                   o->count, ct__mpi_dtype(o->dt),
                                                   ct__mpi_op(o->dt, o->op), w->g->comm, &w->req),
                      "MPI_Ireduce_scatter_block");
}

/* ---- two-level ---------------------------------------------------------- */

_Atomic uint64_t ct__reduce_scatter_two_level_runs;

/* Agrees on count, dtype, op, where send lies and in place (on all ranks or none). */
static int start_two_level(redscat_op *o)
{
    int64_t h = ct__args_hash(CT__KIND_REDUCE_SCATTER, &o->ref, o->count, o->dt, (int)o->op, o->inplace);
    o->phase = PH_HAGREE;
    return ct__hash_agree_start(&o->w, o->h, h, "MPI_Iallreduce (agreeing on a reduce-scatter's arguments)");
}

static int two_level_progress(redscat_op *o)
{
    ct_work *w = &o->w;
    ct_group *g = w->g, *t = g->node;
    int leader = t->rank == 0;
    size_t esz = ct_dtype_size(o->dt), block = (size_t)o->count * esz;
    MPI_Datatype dt = ct__mpi_dtype(o->dt);
    switch (o->phase) {
    case PH_HAGREE:
        if (!ct__hash_agreed(o->h))
            return ct__op_fail(w, ct_error(CT_EINVAL, "reduce_scatter: the ranks passed "
                                                      "different arguments (this rank: %d x %s "
                                                      "%s %s%s); pass the same count, dtype and "
                                                      "op on every rank, in place on all or "
                                                      "none, and the same range of one "
                                                      "ct_group_alloc_shared allocation as send "
                                                      "on every rank (or private memory on "
                                                      "every rank)",
                                           o->count, ct_dtype_name(o->dt), ct__op_name(o->op),
                                           o->ref.a ? "in shared memory" : "in private memory",
                                           o->inplace ? ", in place" : ""));
        if (o->count == 0) return CT__DONE;
        if (!o->ref.a || !is_float(o->dt) || (int64_t)g->size * o->count > INT_MAX)
            return start_mpi(o);
        atomic_fetch_add(&ct__reduce_scatter_two_level_runs, 1);
        o->target = ct__shm_arrive(t, &o->ref);
        if (!leader) { /* 3, on the receiving side: the leader sends after step 1 */
            o->phase = PH_SCATTER;
            ct__traffic_coll(CT__COLL_SCATTER, t->size, t->rank, (uint64_t)t->size * block);
            return ct__op_mpi(w, MPI_Iscatter(NULL, o->count, dt, o->recv, o->count, dt, 0,
                                              t->comm, &w->req),
                              "MPI_Iscatter (inside a node)");
        }
        o->phase = PH_INPUTS;
        return CT__MOVED;
    case PH_INPUTS: { /* 1: the node's sums, by the leader */
        if (!ct__shm_passed(t, o->target, &o->ref)) return CT__WAIT;
        int L = t->size;
        void *src[L];
        for (int r = 0; r < g->size; r++) {
            void *dst = o->sums + (size_t)o->pos[r] * esz;
            for (int j = 0; j < L; j++)
                src[j] = (char *)ct__shm_peer(&o->ref, j) + (size_t)r * block;
            ct__reduce_into(src, L, &dst, 1, o->count, o->dt,
                            o->op == CT_OP_AVG ? CT_OP_SUM : o->op, 1.0f);
        }
        /* 2: across nodes; node n's blocks land at the start of sums */
        o->phase = PH_INTER;
        ct__traffic_coll(CT_COLL_REDUCE_SCATTER, g->leaders->size, 0, (uint64_t)g->size * block);
        return ct__op_mpi(w, MPI_Ireduce_scatter(MPI_IN_PLACE, o->sums, o->counts, dt,
                                                 ct__mpi_op(o->dt, o->op), g->leaders->comm,
                                                 &w->req),
                          "MPI_Ireduce_scatter (between nodes)");
    }
    case PH_INTER: /* 3: each rank of the node its block */
        o->phase = PH_SCATTER;
        ct__traffic_coll(CT__COLL_SCATTER, t->size, 0, (uint64_t)t->size * block);
        return ct__op_mpi(w, MPI_Iscatter(o->sums, o->count, dt, o->recv, o->count, dt, 0,
                                          t->comm, &w->req),
                          "MPI_Iscatter (inside a node)");
    case PH_SCATTER:
        if (o->op == CT_OP_AVG) ct__scale(o->recv, o->count, o->dt, g->size);
        return CT__DONE;
    }
    CT_ASSERT(!"reduce_scatter: unknown two-level phase");
    return CT__DONE;
}

static int redscat_start(ct_work *w)
{
    redscat_op *o = (redscat_op *)w;
    if (o->two_level) return start_two_level(o);
    if (!o->agree) return start_mpi(o);
    ct__agree_start(w->g, &o->ag, &o->ref, o->count, o->dt, o->op, CT__KIND_REDUCE_SCATTER, -1);
    o->phase = PH_AGREE;
    return CT__MOVED;
}

static int redscat_progress(ct_work *w)
{
    redscat_op *o = (redscat_op *)w;
    ct_group *g = w->g;
    if (o->phase >= PH_HAGREE) return two_level_progress(o);
    switch (o->phase) {
    case PH_RING:
        return ring_progress(o);
    case PH_MPI:
        if (o->inplace && o->recv != o->send)
            memmove(o->recv, o->send, (size_t)o->count * ct_dtype_size(o->dt));
        if (o->op == CT_OP_AVG) ct__scale(o->recv, o->count, o->dt, g->size);
        return CT__DONE;
    case PH_AGREE: {
        if (ct__agree_poll(w, &o->ag, "reduce_scatter") == CT__WAIT) return CT__WAIT;
        if (w->status != CT_OK || o->count == 0) return CT__DONE;
        if (!o->ref.a || !is_float(o->dt)) return start_mpi(o);
        int W = g->size;
        size_t block = (size_t)o->count * ct_dtype_size(o->dt);
        void *src[W], *dst = o->recv;
        for (int r = 0; r < W; r++)
            src[r] = (char *)ct__shm_peer(&o->ref, r) + (size_t)g->rank * block;
        ct__reduce_into(src, W, &dst, 1, o->count, o->dt, o->op,
                        o->op == CT_OP_AVG ? 1.0f / (float)W : 1.0f);
        o->target = ct__shm_arrive(g, &o->ref);
        o->phase = PH_DIRECT;
        return CT__MOVED;
    }
    case PH_DIRECT:
        return ct__shm_passed(g, o->target, &o->ref) ? CT__DONE : CT__WAIT;
    }
    CT_ASSERT(!"reduce_scatter: unknown phase");
    return CT__DONE;
}

static void redscat_blame(const ct_work *w, char *out, size_t n)
{
    const redscat_op *o = (const redscat_op *)w;
    if (o->phase == PH_AGREE) ct__shm_absent(w->g, o->ag.target, out, n);
    else if (o->phase == PH_DIRECT) ct__shm_absent(w->g, o->target, out, n);
    else if (o->phase == PH_INPUTS) ct__shm_absent(w->g->node, o->target, out, n);
}

static void redscat_destroy(ct_work *w)
{
    redscat_op *o = (redscat_op *)w;
    ct_free(o->counts);
    ct_free(o->displs);
    ct_free(o->pos);
    ct_free(o->sums);
    if (o->tmp[1] != o->tmp[0]) ct_free(o->tmp[1]);
    ct_free(o->tmp[0]);
}

static const ct__op_vt redscat_vt = {.name = "reduce_scatter",
                                     .flags = CT__OP_ORDERED | CT__OP_GATE,
                                     .start = redscat_start, .progress = redscat_progress,
                                     .destroy = redscat_destroy, .blame = redscat_blame};

ct_status ct_group_reduce_scatter(ct_group *g, const void *send, void *recv, int64_t count,
                                  ct_dtype dt, ct_reduce_op op, ct_work **work)
{
    CT_TRY(ct__check_args(g, recv, count, dt, "reduce_scatter"));
    if (count > 0 && !send) return ct_error(CT_EINVAL, "reduce_scatter: send buffer is NULL");
    CT_TRY(ct__check_op(dt, op, "reduce_scatter"));
    size_t esz = ct_dtype_size(dt), block = (size_t)count * esz;
    int inplace = recv == (const char *)send + (size_t)g->rank * block;
    if (!inplace && ct__overlaps(send, block * (size_t)g->size, recv, block))
        return ct_error(CT_EINVAL, "reduce_scatter: recv overlaps send; for in place pass "
                                   "recv = send + rank*count");
    ct__shm_ref ref = {0};
    int agree = ct__shm_active(g), two_level = ct__shm_node_active(g);
    if (agree || two_level)
        CT_TRY(ct__shm_locate(g, send, block * (size_t)g->size, &ref, "reduce_scatter"));
    redscat_op *o = ct__work_new(g, &redscat_vt, sizeof *o);
    if (!o) return CT_ENOMEM;
    ct__work_describe(&o->w, dt, count, -1, op);
    if (two_level && ref.a && g->leaders && count > 0 && is_float(dt) &&
        (int64_t)g->size * count <= INT_MAX) {
        /* the leader's buffers, made here so that running out of memory
         * fails before anything is sent */
        int layout = ct__node_layout(g, count, &o->counts, &o->displs, &o->pos);
        o->sums = layout < 0 ? NULL : ct_alloc(block * (size_t)g->size, CT_MEM_COMM);
        if (!o->sums) {
            ct__work_destroy(&o->w);
            return ct_error(CT_ENOMEM, "reduce_scatter: out of memory for the two-level sums");
        }
    }
    if (rings(g, count, dt) && !(ref.a && (agree || two_level))) {
        /* the ring's temporaries, made here for the same reason; a send in
         * shared memory takes the direct or two-level path instead */
        o->tmp[0] = ct_alloc(block, CT_MEM_COMM);
        o->tmp[1] = g->size > 2 ? ct_alloc(block, CT_MEM_COMM) : o->tmp[0];
        if (!o->tmp[0] || !o->tmp[1]) {
            if (o->tmp[1] == o->tmp[0]) o->tmp[1] = NULL;
            ct__work_destroy(&o->w);
            return ct_error(CT_ENOMEM, "reduce_scatter: out of memory for the ring's two blocks");
        }
    }
    o->agree = agree;
    o->two_level = two_level;
    o->ref = ref;
    o->recv = recv;
    o->send = send;
    o->count = (int)count;
    o->dt = dt;
    o->op = op;
    o->inplace = inplace;
    return ct__submit(&o->w, work);
}
