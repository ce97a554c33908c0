/*
 * What the collectives share: argument checks, run in the caller's thread
 * before anything is queued so that a bad call returns at once, and the
 * tensor forms of the collectives.
 */
#include <limits.h>
#include <string.h>

#include "internal.h"

int64_t ct__args_hash(int kind, const ct__shm_ref *ref, int64_t count, ct_dtype dt, int op, int inplace)
{
    if (!ref->a) return 0;
    struct {
        uint64_t kind, id, off;
        int64_t count;
        int32_t dt, op, inplace, pad;
    } k;
    memset(&k, 0, sizeof k); /* the padding too: the hash reads every byte */
    k.kind = (uint64_t)kind;
    k.id = ct__shm_alloc_id(ref);
    k.off = ref->off;
    k.count = count;
    k.dt = (int32_t)dt;
    k.op = op;
    k.inplace = inplace;
    return (int64_t)(ct_hash64(&k, sizeof k) >> 2);
}

int ct__hash_agree_start(ct_work *w, int64_t h[2], int64_t hash, const char *what)
{
    h[0] = hash;
    h[1] = -hash;
    return ct__op_mpi(w, MPI_Iallreduce(MPI_IN_PLACE, h, 2, MPI_INT64_T, MPI_MIN, w->g->comm, &w->req), what);
}

ct_status ct__check_args(const ct_group *g, const void *buf, int64_t count, ct_dtype dt,
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

ct_status ct__check_rank(const ct_group *g, int r, const char *role, const char *what)
{
    if (r < 0 || r >= g->size)
        return ct_error(CT_EINVAL, "%s: %s %d is out of range for a group of %d ranks (0..%d)",
                        what, role, r, g->size, g->size - 1);
    return CT_OK;
}

int ct__overlaps(const void *a, size_t na, const void *b, size_t nb)
{
    const char *x = a, *y = b;
    return na && nb && x < y + nb && y < x + na;
}

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
