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
 */
#include <string.h>

#include "internal.h"

enum { PH_AGREE = 0, PH_MPI, PH_DIRECT };

typedef struct {
    ct_work w;
    void *recv;
    const void *send;
    int count;
    ct_dtype dt;
    ct_reduce_op op;
    int inplace;
    int agree; /* the group has shared allocations */
    ct__shm_ref ref; /* of send */
    ct__agree ag;
    int phase;
    uint64_t target;
} redscat_op;

static int start_mpi(redscat_op *o)
{
    ct_work *w = &o->w;
    o->phase = PH_MPI;
    w->gate = 0;
    return ct__op_mpi(w, MPI_Ireduce_scatter_block(o->inplace ? MPI_IN_PLACE : o->send,
                                                   o->inplace ? (void *)o->send : o->recv,
                                                   o->count, ct__mpi_dtype(o->dt),
                                                   ct__mpi_op(o->dt, o->op), w->g->comm, &w->req),
                      "MPI_Ireduce_scatter_block");
}

static int redscat_start(ct_work *w)
{
    redscat_op *o = (redscat_op *)w;
    if (!o->agree) return start_mpi(o);
    ct__agree_start(w->g, &o->ag, &o->ref, o->count, o->dt, o->op, CT__KIND_REDUCE_SCATTER, -1);
    o->phase = PH_AGREE;
    return CT__MOVED;
}

static int redscat_progress(ct_work *w)
{
    redscat_op *o = (redscat_op *)w;
    ct_group *g = w->g;
    switch (o->phase) {
    case PH_MPI:
        if (o->inplace && o->recv != o->send)
            memmove(o->recv, o->send, (size_t)o->count * ct_dtype_size(o->dt));
        if (o->op == CT_OP_AVG) ct__scale(o->recv, o->count, o->dt, g->size);
        return CT__DONE;
    case PH_AGREE: {
        if (ct__agree_poll(w, &o->ag, "reduce_scatter") == CT__WAIT) return CT__WAIT;
        if (w->status != CT_OK || o->count == 0) return CT__DONE;
        int fl = o->dt == CT_F32 || o->dt == CT_BF16 || o->dt == CT_F16;
        if (!o->ref.a || !fl) return start_mpi(o);
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
}

static const ct__op_vt redscat_vt = {.name = "reduce_scatter",
                                     .flags = CT__OP_ORDERED | CT__OP_GATE,
                                     .start = redscat_start, .progress = redscat_progress,
                                     .blame = redscat_blame};

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
    int agree = ct__shm_active(g);
    if (agree) CT_TRY(ct__shm_locate(g, send, block * (size_t)g->size, &ref, "reduce_scatter"));
    redscat_op *o = ct__work_new(g, &redscat_vt, sizeof *o);
    if (!o) return CT_ENOMEM;
    o->agree = agree;
    o->ref = ref;
    o->recv = recv;
    o->send = send;
    o->count = (int)count;
    o->dt = dt;
    o->op = op;
    o->inplace = inplace;
    return ct__submit(&o->w, work);
}
