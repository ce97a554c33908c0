/* All-gather: one MPI_Iallgather; and all-gather with counts per rank
 * (allgatherv), one MPI_Iallgatherv. */
#include <limits.h>

#include "internal.h"

typedef struct {
    ct_work w;
    void *recv;
    const void *send;
    int count;
    ct_dtype dt;
    int inplace;
    int *counts, *displs; /* allgatherv: ct_alloc'd, freed with the work */
} allgather_op;

static int allgather_start(ct_work *w)
{
    allgather_op *o = (allgather_op *)w;
    MPI_Datatype t = ct__mpi_dtype(o->dt);
    return ct__op_mpi(w, MPI_Iallgather(o->inplace ? MPI_IN_PLACE : o->send, o->count, t, o->recv,
                                        o->count, t, w->g->comm, &w->req),
                      "MPI_Iallgather");
}

static int allgatherv_start(ct_work *w)
{
    allgather_op *o = (allgather_op *)w;
    MPI_Datatype t = ct__mpi_dtype(o->dt);
    return ct__op_mpi(w, MPI_Iallgatherv(o->inplace ? MPI_IN_PLACE : o->send, o->count, t,
                                         o->recv, o->counts, o->displs, t, w->g->comm, &w->req),
                      "MPI_Iallgatherv");
}

static void allgather_destroy(ct_work *w)
{
    allgather_op *o = (allgather_op *)w;
    ct_free(o->counts);
    ct_free(o->displs);
}

static const ct__op_vt allgather_vt = {.name = "allgather", .flags = CT__OP_ORDERED,
                                       .start = allgather_start};
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
    allgather_op *o = ct__work_new(g, &allgather_vt, sizeof *o);
    if (!o) return CT_ENOMEM;
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
    o->recv = recv;
    o->send = send;
    o->count = (int)send_count;
    o->dt = dt;
    o->inplace = inplace;
    o->counts = ct_alloc((size_t)g->size * sizeof(int), CT_MEM_OTHER);
    o->displs = ct_alloc((size_t)g->size * sizeof(int), CT_MEM_OTHER);
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
