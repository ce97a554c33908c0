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
 * On a group with shared allocations every allreduce agrees first (shm.c),
 * so ranks that pass different ranges or dtypes all fail with CT_EINVAL.
 */
#include "internal.h"

enum { PH_AGREE = 0, PH_MPI, PH_DIRECT };

#define SPIN_SECONDS 100e-6 /* the second barrier's busy wait before handing back to the engine */

typedef struct {
    ct_work w;
    void *buf;
    int count;
    ct_dtype dt;
    ct_reduce_op op;
    int agree; /* the group has shared allocations */
    ct__shm_ref ref;
    ct__agree ag;
    int phase;
    uint64_t target;
} allreduce_op;

static int is_float(ct_dtype dt) { return dt == CT_F32 || dt == CT_BF16 || dt == CT_F16; }

static int start_mpi(allreduce_op *o)
{
    ct_work *w = &o->w;
    o->phase = PH_MPI;
    w->gate = 0; /* the group's next collective may make its MPI calls */
    return ct__op_mpi(w, MPI_Iallreduce(MPI_IN_PLACE, o->buf, o->count, ct__mpi_dtype(o->dt),
                                        ct__mpi_op(o->dt, o->op), w->g->comm, &w->req),
                      "MPI_Iallreduce");
}

static int allreduce_start(ct_work *w)
{
    allreduce_op *o = (allreduce_op *)w;
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
    int agree = ct__shm_active(g);
    if (agree) CT_TRY(ct__shm_locate(g, buf, (size_t)count * ct_dtype_size(dt), &ref, "allreduce"));
    allreduce_op *o = ct__work_new(g, &allreduce_vt, sizeof *o);
    if (!o) return CT_ENOMEM;
    o->buf = buf;
    o->count = (int)count;
    o->dt = dt;
    o->op = op;
    o->agree = agree;
    o->ref = ref;
    return ct__submit(&o->w, work);
}
