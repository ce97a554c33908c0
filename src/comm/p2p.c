/*
 * Point-to-point transfers: a send or a recv is one MPI_Isend / MPI_Irecv.
 * They are not collectives: never held back behind a group's collectives,
 * completed as soon as MPI says so.  A recv checks that the message held
 * exactly the count it expected (MPI accepts shorter ones).
 */
#include "internal.h"

typedef struct {
    ct_work w;
    void *buf;
    const void *sbuf;
    int count;
    ct_dtype dt;
    int peer, tag;
} p2p_op;

static int send_start(ct_work *w)
{
    p2p_op *o = (p2p_op *)w;
    ct__traffic_p2p((uint64_t)o->count * ct_dtype_size(o->dt), 0);
    return ct__op_mpi(w, MPI_Isend(o->sbuf, o->count, ct__mpi_dtype(o->dt), o->peer, o->tag,
                                   w->g->comm, &w->req),
                      "MPI_Isend");
}

static int recv_start(ct_work *w)
{
    p2p_op *o = (p2p_op *)w;
    ct__traffic_p2p(0, (uint64_t)o->count * ct_dtype_size(o->dt));
    return ct__op_mpi(w, MPI_Irecv(o->buf, o->count, ct__mpi_dtype(o->dt), o->peer, o->tag,
                                   w->g->comm, &w->req),
                      "MPI_Irecv");
}

static ct_status recv_finish(ct_work *w)
{
    p2p_op *o = (p2p_op *)w;
    int n = 0;
    MPI_Get_count(&w->mpi_status, ct__mpi_dtype(o->dt), &n);
    if (n != o->count)
        return ct_error(CT_ECOMM, "recv on rank %d: rank %d sent %d elements with tag %d but %d "
                                  "were expected; match the counts of send and recv",
                        w->g->rank, o->peer, n, o->tag, o->count);
    return CT_OK;
}

static const ct__op_vt send_vt = {.name = "MPI_Isend", .start = send_start};
static const ct__op_vt recv_vt = {.name = "MPI_Irecv", .start = recv_start,
                                  .finish = recv_finish};

static ct_status check_p2p(const ct_group *g, const void *buf, int64_t count, ct_dtype dt,
                           int peer, int tag, const char *what)
{
    CT_TRY(ct__check_args(g, buf, count, dt, what));
    CT_TRY(ct__check_rank(g, peer, "peer", what));
    if (tag < 0 || tag > ct__tag_ub())
        return ct_error(CT_EINVAL, "%s: tag %d is out of range 0..%d", what, tag, ct__tag_ub());
    return CT_OK;
}

static ct_status submit(ct_group *g, const ct__op_vt *vt, void *buf, const void *sbuf,
                        int64_t count, ct_dtype dt, int peer, int tag, ct_work **work)
{
    p2p_op *o = ct__work_new(g, vt, sizeof *o);
    if (!o) return CT_ENOMEM;
    o->buf = buf;
    o->sbuf = sbuf;
    o->count = (int)count;
    o->dt = dt;
    o->peer = peer;
    o->tag = tag;
    return ct__submit(&o->w, work);
}

ct_status ct_group_send(ct_group *g, const void *buf, int64_t count, ct_dtype dt, int peer,
                        int tag, ct_work **work)
{
    CT_TRY(check_p2p(g, buf, count, dt, peer, tag, "send"));
    return submit(g, &send_vt, NULL, buf, count, dt, peer, tag, work);
}

ct_status ct_group_recv(ct_group *g, void *buf, int64_t count, ct_dtype dt, int peer, int tag,
                        ct_work **work)
{
    CT_TRY(check_p2p(g, buf, count, dt, peer, tag, "recv"));
    return submit(g, &recv_vt, buf, NULL, count, dt, peer, tag, work);
}
