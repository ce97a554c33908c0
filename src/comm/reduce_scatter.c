/*
 * Reduce-scatter: one MPI_Ireduce_scatter_block; in place, MPI leaves the
 * result at the start of the input, so it is moved into this rank's block
 * afterwards, and AVG is scaled then.
 */
#include <string.h>

#include "internal.h"

typedef struct {
    ct_work w;
    void *recv;
    const void *send;
    int count;
    ct_dtype dt;
    ct_reduce_op op;
    int inplace;
} redscat_op;

static int redscat_start(ct_work *w)
{
    redscat_op *o = (redscat_op *)w;
    return ct__op_mpi(w, MPI_Ireduce_scatter_block(o->inplace ? MPI_IN_PLACE : o->send,
                                                   o->inplace ? (void *)o->send : o->recv,
                                                   o->count, ct__mpi_dtype(o->dt),
                                                   ct__mpi_op(o->dt, o->op), w->g->comm, &w->req),
                      "MPI_Ireduce_scatter_block");
}

static ct_status redscat_finish(ct_work *w)
{
    redscat_op *o = (redscat_op *)w;
    if (o->inplace && o->recv != o->send)
        memmove(o->recv, o->send, (size_t)o->count * ct_dtype_size(o->dt));
    if (o->op == CT_OP_AVG) ct__scale(o->recv, o->count, o->dt, w->g->size);
    return CT_OK;
}

static const ct__op_vt redscat_vt = {.name = "reduce_scatter", .flags = CT__OP_ORDERED,
                                     .start = redscat_start, .finish = redscat_finish};

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
    redscat_op *o = ct__work_new(g, &redscat_vt, sizeof *o);
    if (!o) return CT_ENOMEM;
    o->recv = recv;
    o->send = send;
    o->count = (int)count;
    o->dt = dt;
    o->op = op;
    o->inplace = inplace;
    return ct__submit(&o->w, work);
}
