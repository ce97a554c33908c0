/*
 * Reduce to one rank.  MPI: one MPI_Ireduce, AVG scaled on the root
 * afterwards.  Direct, when every rank passes the same range of one of the
 * group's shared allocations (f32, bf16, f16): after the agreement's
 * barrier, rank r reduces slice r of the range across all ranks' buffers
 * (in rank order, as allreduce.c) and writes it into the root's buffer
 * only; after a second barrier the root has the whole result and no other
 * buffer changed.  The work is spread over all ranks, and each reads ~N and
 * writes ~N/W bytes.  Agreement first (shm.c): mismatched arguments, or a
 * different root, are an error on every rank.
 */
#include "internal.h"

enum { PH_AGREE = 0, PH_MPI, PH_DIRECT };

typedef struct {
    ct_work w;
    void *buf;
    int count;
    ct_dtype dt;
    ct_reduce_op op;
    int root;
    int agree; /* the group has shared allocations */
    ct__shm_ref ref;
    ct__agree ag;
    int phase;
    uint64_t target;
} reduce_op;

static int start_mpi(reduce_op *o)
{
    ct_work *w = &o->w;
    int at_root = w->g->rank == o->root;
    o->phase = PH_MPI;
    w->gate = 0;
    ct__traffic_coll(CT_COLL_REDUCE, w->g->size, (w->g->rank - o->root + w->g->size) % w->g->size,
                     (uint64_t)o->count * ct_dtype_size(o->dt));
    return ct__op_mpi(w, MPI_Ireduce(at_root ? MPI_IN_PLACE : o->buf, at_root ? o->buf : NULL,
                                     o->count, ct__mpi_dtype(o->dt), ct__mpi_op(o->dt, o->op),
                                     o->root, w->g->comm, &w->req),
                      "MPI_Ireduce");
}

static int reduce_start(ct_work *w)
{
    reduce_op *o = (reduce_op *)w;
    if (!o->agree) return start_mpi(o);
    ct__agree_start(w->g, &o->ag, &o->ref, o->count, o->dt, o->op, CT__KIND_REDUCE, o->root);
    o->phase = PH_AGREE;
    return CT__MOVED;
}

static int reduce_progress(ct_work *w)
{
    reduce_op *o = (reduce_op *)w;
    ct_group *g = w->g;
    switch (o->phase) {
    case PH_MPI:
        if (o->op == CT_OP_AVG && g->rank == o->root) ct__scale(o->buf, o->count, o->dt, g->size);
        return CT__DONE;
    case PH_AGREE: {
        if (ct__agree_poll(w, &o->ag, "reduce") == CT__WAIT) return CT__WAIT;
        if (w->status != CT_OK || o->count == 0) return CT__DONE;
        int fl = o->dt == CT_F32 || o->dt == CT_BF16 || o->dt == CT_F16;
        if (!o->ref.a || !fl) return start_mpi(o);
        int W = g->size;
        size_t esz = ct_dtype_size(o->dt);
        int64_t lo, hi;
        ct__shm_slice(o->count, o->ref.off, esz, W, g->rank, &lo, &hi);
        if (hi > lo) {
            void *src[W], *dst;
            for (int r = 0; r < W; r++)
                src[r] = (char *)ct__shm_peer(&o->ref, r) + (size_t)lo * esz;
            dst = src[o->root];
            ct__reduce_into(src, W, &dst, 1, hi - lo, o->dt, o->op,
                            o->op == CT_OP_AVG ? 1.0f / (float)W : 1.0f);
        }
        o->target = ct__shm_arrive(g, &o->ref);
        o->phase = PH_DIRECT;
        return CT__MOVED;
    }
    case PH_DIRECT:
        return ct__shm_passed(g, o->target, &o->ref) ? CT__DONE : CT__WAIT;
    }
    CT_ASSERT(!"reduce: unknown phase");
    return CT__DONE;
}

static void reduce_blame(const ct_work *w, char *out, size_t n)
{
    const reduce_op *o = (const reduce_op *)w;
    if (o->phase == PH_AGREE) ct__shm_absent(w->g, o->ag.target, out, n);
    else if (o->phase == PH_DIRECT) ct__shm_absent(w->g, o->target, out, n);
}

static const ct__op_vt reduce_vt = {.name = "reduce", .flags = CT__OP_ORDERED | CT__OP_GATE,
                                    .start = reduce_start, .progress = reduce_progress,
                                    .blame = reduce_blame};

ct_status ct_group_reduce(ct_group *g, void *buf, int64_t count, ct_dtype dt, ct_reduce_op op,
                          int root, ct_work **work)
{
    CT_TRY(ct__check_args(g, buf, count, dt, "reduce"));
    CT_TRY(ct__check_op(dt, op, "reduce"));
    CT_TRY(ct__check_rank(g, root, "root", "reduce"));
    ct__shm_ref ref = {0};
    int agree = ct__shm_active(g);
    if (agree) CT_TRY(ct__shm_locate(g, buf, (size_t)count * ct_dtype_size(dt), &ref, "reduce"));
    reduce_op *o = ct__work_new(g, &reduce_vt, sizeof *o);
    if (!o) return CT_ENOMEM;
    ct__work_describe(&o->w, dt, count, root, op);
    o->buf = buf;
    o->count = (int)count;
    o->dt = dt;
    o->op = op;
    o->root = root;
    o->agree = agree;
    o->ref = ref;
    return ct__submit(&o->w, work);
}
