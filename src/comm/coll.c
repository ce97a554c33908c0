/*
 * Collectives and point-to-point transfers: argument checks (in the
 * caller's thread, before anything is queued, so a bad call returns at
 * once), the MPI_I* call each one makes on the comm thread, and the
 * post-processing MPI does not do (AVG scaling, moving an in-place
 * reduce-scatter result into this rank's block, received-count checks).
 * An allreduce on a group with shared allocations is handed to shm.c.
 */
#include <limits.h>
#include <string.h>

#include "internal.h"

/* ---- argument checks --------------------------------------------------- */

static ct_status check_args(const ct_group *g, const void *buf, int64_t count, ct_dtype dt,
                            const char *what)
{
    if (!g)
        return ct_error(CT_EINVAL, "%s: group is NULL; pass ct_group_world() (after "
                                   "ct_comm_init) or a group from ct_group_split", what);
    if ((int)dt < 0 || dt >= CT_NDTYPE)
        return ct_error(CT_EINVAL, "%s: unknown dtype %d", what, (int)dt);
    if (count < 0)
        return ct_error(CT_EINVAL, "%s: count is %lld; it must be >= 0", what, (long long)count);
    if (count > INT_MAX)
        return ct_error(CT_EINVAL, "%s: count %lld exceeds MPI's limit of %d elements; split the "
                                   "buffer into smaller chunks", what, (long long)count, INT_MAX);
    if (count > 0 && !buf)
        return ct_error(CT_EINVAL, "%s: buffer is NULL for %lld elements", what, (long long)count);
    return CT_OK;
}

static ct_status check_rank(const ct_group *g, int r, const char *role, const char *what)
{
    if (r < 0 || r >= g->size)
        return ct_error(CT_EINVAL, "%s: %s %d is out of range for a group of %d ranks (0..%d)",
                        what, role, r, g->size, g->size - 1);
    return CT_OK;
}

static int overlaps(const void *a, size_t na, const void *b, size_t nb)
{
    const char *x = a, *y = b;
    return na && nb && x < y + nb && y < x + na;
}

static ct_work *new_work(ct_group *g, const char *name, ct__start_fn start, ct__finish_fn finish,
                         int ordered, void *buf, const void *sbuf, int64_t count, ct_dtype dt)
{
    ct_work *w = ct__work_new(g, name, start, finish, ordered);
    if (!w) return NULL;
    w->buf = buf;
    w->sbuf = sbuf;
    w->count = (int)count;
    w->dt = dt;
    return w;
}

static ct_status mpi_rc(int rc, const char *what)
{
    return rc == MPI_SUCCESS ? CT_OK : ct__mpi_fail(rc, what);
}

/* ---- allreduce, reduce ------------------------------------------------- */

static ct_status allreduce_start(ct_work *w, MPI_Request *req)
{
    return mpi_rc(MPI_Iallreduce(MPI_IN_PLACE, w->buf, w->count, ct__mpi_dtype(w->dt),
                                 ct__mpi_op(w->dt, w->op), w->g->comm, req),
                  "MPI_Iallreduce");
}

static ct_status scale_finish(ct_work *w)
{
    if (w->op == CT_OP_AVG && (w->root < 0 || w->root == w->g->rank))
        ct__scale(w->buf, w->count, w->dt, w->g->size);
    return CT_OK;
}

ct_status ct_group_allreduce(ct_group *g, void *buf, int64_t count, ct_dtype dt,
                             ct_reduce_op op, ct_work **work)
{
    CT_TRY(check_args(g, buf, count, dt, "allreduce"));
    CT_TRY(ct__check_op(dt, op, "allreduce"));
    ct_work *w = new_work(g, "MPI_Iallreduce", allreduce_start, scale_finish, 1, buf, NULL,
                          count, dt);
    if (!w) return CT_ENOMEM;
    w->op = op;
    w->root = -1; /* every rank scales for AVG */
    ct_status s = ct__shm_allreduce_setup(w, buf, (size_t)count * ct_dtype_size(dt));
    if (s != CT_OK) {
        ct__work_destroy(w);
        return s;
    }
    return ct__submit(w, work);
}

static ct_status reduce_start(ct_work *w, MPI_Request *req)
{
    int at_root = w->g->rank == w->root;
    return mpi_rc(MPI_Ireduce(at_root ? MPI_IN_PLACE : w->buf, at_root ? w->buf : NULL, w->count,
                              ct__mpi_dtype(w->dt), ct__mpi_op(w->dt, w->op), w->root,
                              w->g->comm, req),
                  "MPI_Ireduce");
}

ct_status ct_group_reduce(ct_group *g, void *buf, int64_t count, ct_dtype dt, ct_reduce_op op,
                          int root, ct_work **work)
{
    CT_TRY(check_args(g, buf, count, dt, "reduce"));
    CT_TRY(ct__check_op(dt, op, "reduce"));
    CT_TRY(check_rank(g, root, "root", "reduce"));
    ct_work *w = new_work(g, "MPI_Ireduce", reduce_start, scale_finish, 1, buf, NULL, count, dt);
    if (!w) return CT_ENOMEM;
    w->op = op;
    w->root = root;
    return ct__submit(w, work);
}

/* ---- broadcast --------------------------------------------------------- */

static ct_status bcast_start(ct_work *w, MPI_Request *req)
{
    return mpi_rc(MPI_Ibcast(w->buf, w->count, ct__mpi_dtype(w->dt), w->root, w->g->comm, req),
                  "MPI_Ibcast");
}

ct_status ct_group_broadcast(ct_group *g, void *buf, int64_t count, ct_dtype dt, int root,
                             ct_work **work)
{
    CT_TRY(check_args(g, buf, count, dt, "broadcast"));
    CT_TRY(check_rank(g, root, "root", "broadcast"));
    ct_work *w = new_work(g, "MPI_Ibcast", bcast_start, NULL, 1, buf, NULL, count, dt);
    if (!w) return CT_ENOMEM;
    w->root = root;
    return ct__submit(w, work);
}

/* ---- all-gather -------------------------------------------------------- */

static ct_status allgather_start(ct_work *w, MPI_Request *req)
{
    MPI_Datatype t = ct__mpi_dtype(w->dt);
    return mpi_rc(MPI_Iallgather(w->inplace ? MPI_IN_PLACE : w->sbuf, w->count, t, w->buf,
                                 w->count, t, w->g->comm, req),
                  "MPI_Iallgather");
}

ct_status ct_group_allgather(ct_group *g, const void *send, void *recv, int64_t count,
                             ct_dtype dt, ct_work **work)
{
    CT_TRY(check_args(g, send, count, dt, "allgather"));
    if (count > 0 && !recv) return ct_error(CT_EINVAL, "allgather: receive buffer is NULL");
    size_t esz = ct_dtype_size(dt), block = (size_t)count * esz;
    int inplace = send == (const char *)recv + (size_t)g->rank * block;
    if (!inplace && overlaps(send, block, recv, block * (size_t)g->size))
        return ct_error(CT_EINVAL, "allgather: send overlaps the receive buffer; for in place "
                                   "pass send = recv + rank*count");
    ct_work *w = new_work(g, "MPI_Iallgather", allgather_start, NULL, 1, recv, send, count, dt);
    if (!w) return CT_ENOMEM;
    w->inplace = inplace;
    return ct__submit(w, work);
}

static ct_status allgatherv_start(ct_work *w, MPI_Request *req)
{
    MPI_Datatype t = ct__mpi_dtype(w->dt);
    return mpi_rc(MPI_Iallgatherv(w->inplace ? MPI_IN_PLACE : w->sbuf, w->count, t, w->buf,
                                  w->counts, w->displs, t, w->g->comm, req),
                  "MPI_Iallgatherv");
}

ct_status ct_group_allgatherv(ct_group *g, const void *send, int64_t send_count, void *recv,
                              const int64_t *counts, const int64_t *displs, ct_dtype dt,
                              ct_work **work)
{
    CT_TRY(check_args(g, send, send_count, dt, "allgatherv"));
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
    CT_TRY(check_args(g, recv, end, dt, "allgatherv (receive buffer)"));
    size_t esz = ct_dtype_size(dt);
    int64_t mine = displs ? displs[g->rank] : 0;
    if (!displs)
        for (int r = 0; r < g->rank; r++) mine += counts[r];
    int inplace = send == (const char *)recv + (size_t)mine * esz;
    if (!inplace && overlaps(send, (size_t)send_count * esz, recv, (size_t)end * esz))
        return ct_error(CT_EINVAL, "allgatherv: send overlaps the receive buffer; for in place "
                                   "pass send = recv + displs[rank]");
    ct_work *w = new_work(g, "MPI_Iallgatherv", allgatherv_start, NULL, 1, recv, send, send_count,
                          dt);
    if (!w) return CT_ENOMEM;
    w->inplace = inplace;
    w->counts = ct_alloc_zeroed((size_t)g->size * sizeof(int), CT_MEM_OTHER);
    w->displs = ct_alloc_zeroed((size_t)g->size * sizeof(int), CT_MEM_OTHER);
    if (!w->counts || !w->displs) {
        ct__work_destroy(w);
        return CT_ENOMEM;
    }
    for (int r = 0, a = 0; r < g->size; r++) {
        w->counts[r] = (int)counts[r];
        w->displs[r] = displs ? (int)displs[r] : a;
        a += w->counts[r];
    }
    return ct__submit(w, work);
}

/* ---- reduce-scatter ---------------------------------------------------- */

static ct_status redscat_start(ct_work *w, MPI_Request *req)
{
    /* In place, MPI leaves the result at the start of the input buffer. */
    return mpi_rc(MPI_Ireduce_scatter_block(w->inplace ? MPI_IN_PLACE : w->sbuf,
                                            w->inplace ? (void *)w->sbuf : w->buf, w->count,
                                            ct__mpi_dtype(w->dt), ct__mpi_op(w->dt, w->op),
                                            w->g->comm, req),
                  "MPI_Ireduce_scatter_block");
}

static ct_status redscat_finish(ct_work *w)
{
    if (w->inplace && w->buf != w->sbuf)
        memmove(w->buf, w->sbuf, (size_t)w->count * ct_dtype_size(w->dt));
    if (w->op == CT_OP_AVG) ct__scale(w->buf, w->count, w->dt, w->g->size);
    return CT_OK;
}

ct_status ct_group_reduce_scatter(ct_group *g, const void *send, void *recv, int64_t count,
                                  ct_dtype dt, ct_reduce_op op, ct_work **work)
{
    CT_TRY(check_args(g, recv, count, dt, "reduce_scatter"));
    if (count > 0 && !send) return ct_error(CT_EINVAL, "reduce_scatter: send buffer is NULL");
    CT_TRY(ct__check_op(dt, op, "reduce_scatter"));
    size_t esz = ct_dtype_size(dt), block = (size_t)count * esz;
    int inplace = recv == (const char *)send + (size_t)g->rank * block;
    if (!inplace && overlaps(send, block * (size_t)g->size, recv, block))
        return ct_error(CT_EINVAL, "reduce_scatter: recv overlaps send; for in place pass "
                                   "recv = send + rank*count");
    ct_work *w = new_work(g, "MPI_Ireduce_scatter_block", redscat_start, redscat_finish, 1, recv,
                          send, count, dt);
    if (!w) return CT_ENOMEM;
    w->op = op;
    w->inplace = inplace;
    return ct__submit(w, work);
}

/* ---- point to point ---------------------------------------------------- */

static ct_status check_p2p(const ct_group *g, const void *buf, int64_t count, ct_dtype dt,
                           int peer, int tag, const char *what)
{
    CT_TRY(check_args(g, buf, count, dt, what));
    CT_TRY(check_rank(g, peer, "peer", what));
    if (tag < 0 || tag > ct__tag_ub())
        return ct_error(CT_EINVAL, "%s: tag %d is out of range 0..%d", what, tag, ct__tag_ub());
    return CT_OK;
}

static ct_status send_start(ct_work *w, MPI_Request *req)
{
    return mpi_rc(MPI_Isend(w->sbuf, w->count, ct__mpi_dtype(w->dt), w->peer, w->tag, w->g->comm,
                            req),
                  "MPI_Isend");
}

static ct_status recv_start(ct_work *w, MPI_Request *req)
{
    return mpi_rc(MPI_Irecv(w->buf, w->count, ct__mpi_dtype(w->dt), w->peer, w->tag, w->g->comm,
                            req),
                  "MPI_Irecv");
}

static ct_status recv_finish(ct_work *w)
{
    int n = 0;
    MPI_Get_count(&w->mpi_status, ct__mpi_dtype(w->dt), &n);
    if (n != w->count)
        return ct_error(CT_ECOMM, "recv on rank %d: rank %d sent %d elements with tag %d but %d "
                                  "were expected; match the counts of send and recv",
                        w->g->rank, w->peer, n, w->tag, w->count);
    return CT_OK;
}

ct_status ct_group_send(ct_group *g, const void *buf, int64_t count, ct_dtype dt, int peer,
                        int tag, ct_work **work)
{
    CT_TRY(check_p2p(g, buf, count, dt, peer, tag, "send"));
    ct_work *w = new_work(g, "MPI_Isend", send_start, NULL, 0, NULL, buf, count, dt);
    if (!w) return CT_ENOMEM;
    w->peer = peer;
    w->tag = tag;
    return ct__submit(w, work);
}

ct_status ct_group_recv(ct_group *g, void *buf, int64_t count, ct_dtype dt, int peer, int tag,
                        ct_work **work)
{
    CT_TRY(check_p2p(g, buf, count, dt, peer, tag, "recv"));
    ct_work *w = new_work(g, "MPI_Irecv", recv_start, recv_finish, 0, buf, NULL, count, dt);
    if (!w) return CT_ENOMEM;
    w->peer = peer;
    w->tag = tag;
    return ct__submit(w, work);
}

/* ---- tensor forms ------------------------------------------------------ */

ct_status ct_group_allreduce_tensor(ct_group *g, ct_tensor *t, ct_reduce_op op, ct_work **work)
{
    if (!t) return ct_error(CT_EINVAL, "allreduce: tensor is NULL");
    return ct_group_allreduce(g, ct_tensor_data(t), t->numel, t->dtype, op, work);
}

ct_status ct_group_broadcast_tensor(ct_group *g, ct_tensor *t, int root, ct_work **work)
{
    if (!t) return ct_error(CT_EINVAL, "broadcast: tensor is NULL");
    return ct_group_broadcast(g, ct_tensor_data(t), t->numel, t->dtype, root, work);
}
