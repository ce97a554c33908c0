/* Broadcast: one MPI_Ibcast (any dtype). */
#include "internal.h"

typedef struct {
    ct_work w;
    void *buf;
    int count;
    ct_dtype dt;
    int root;
} bcast_op;

static int bcast_start(ct_work *w)
{
    bcast_op *o = (bcast_op *)w;
    ct__traffic_coll(CT_COLL_BROADCAST, w->g->size, (w->g->rank - o->root + w->g->size) % w->g->size,
                     (uint64_t)o->count * ct_dtype_size(o->dt));
    return ct__op_mpi(w, MPI_Ibcast(o->buf, o->count, ct__mpi_dtype(o->dt), o->root, w->g->comm,
                                    &w->req),
                      "MPI_Ibcast");
}

static const ct__op_vt bcast_vt = {.name = "broadcast", .flags = CT__OP_ORDERED,
                                   .start = bcast_start};

ct_status ct_group_broadcast(ct_group *g, void *buf, int64_t count, ct_dtype dt, int root,
                             ct_work **work)
{
    CT_TRY(ct__check_args(g, buf, count, dt, "broadcast"));
    CT_TRY(ct__check_rank(g, root, "root", "broadcast"));
    bcast_op *o = ct__work_new(g, &bcast_vt, sizeof *o);
    if (!o) return CT_ENOMEM;
    ct__work_describe(&o->w, dt, count, root, -1);
    o->buf = buf;
    o->count = (int)count;
    o->dt = dt;
    o->root = root;
    return ct__submit(&o->w, work);
}
