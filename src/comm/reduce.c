/* Reduce to one rank: one MPI_Ireduce, AVG scaled on the root afterwards. */
#include "internal.h"

typedef struct {
    ct_work w;
    void *buf;
    int count;
    ct_dtype dt;
    ct_reduce_op op;
    int root;
} reduce_op;

static int reduce_start(ct_work *w)
{
    reduce_op *o = (reduce_op *)w;
    int at_root = w->g->rank == o->root;
    return ct__op_mpi(w, MPI_Ireduce(at_root ? MPI_IN_PLACE : o->buf, at_root ? o->buf : NULL,
                                     o->count, ct__mpi_dtype(o->dt), ct__mpi_op(o->dt, o->op),
                                     o->root, w->g->comm, &w->req),
                      "MPI_Ireduce");
}

static ct_status reduce_finish(ct_work *w)
{
    reduce_op *o = (reduce_op *)w;
    if (o->op == CT_OP_AVG && w->g->rank == o->root) ct__scale(o->buf, o->count, o->dt, w->g->size);
    return CT_OK;
}

static const ct__op_vt reduce_vt = {.name = "reduce", .flags = CT__OP_ORDERED,
                                    .start = reduce_start, .finish = reduce_finish};

ct_status ct_group_reduce(ct_group *g, void *buf, int64_t count, ct_dtype dt, ct_reduce_op op,
                          int root, ct_work **work)
{
    CT_TRY(ct__check_args(g, buf, count, dt, "reduce"));
    CT_TRY(ct__check_op(dt, op, "reduce"));
    CT_TRY(ct__check_rank(g, root, "root", "reduce"));
    reduce_op *o = ct__work_new(g, &reduce_vt, sizeof *o);
    if (!o) return CT_ENOMEM;
    o->buf = buf;
    o->count = (int)count;
    o->dt = dt;
    o->op = op;
    o->root = root;
    return ct__submit(&o->w, work);
}
