/*
 * The shared-memory paths of reduce-scatter, all-gather and reduce
 * (src/comm/reduce_scatter.c, allgather.c, reduce.c), under the rules the
 * shared-memory allreduce tests follow (test_comm_shm.c):
 *   - "exact" f32 inputs (multiples of 2^-10 below 8) sum exactly in any
 *     order: results must equal the reference bit for bit, for every op;
 *   - full-mantissa f32 sums: at 2 ranks the direct path must equal MPI's
 *     result on private memory bit for bit (one addition, commutative); at
 *     any size it must equal the float sum in rank order, ((x0 + x1) + x2)
 *     + ..., bit for bit (the fixed order the direct path promises; MPI's
 *     own order may differ), which also shows the direct path ran;
 *   - bf16/f16 within P*u*sum|x| of the exact sum (coll_ref.h);
 *   - arguments that differ across ranks fail on every rank and change
 *     nothing.
 * Tests that need the direct path check ct_group_is_shared, so the suite
 * also passes (testing the MPI fallback) with CTRAIN_COMM_SHM=0.
 */
#include <stdint.h>
#include <stdlib.h>

#include "coll_ref.h"

static void *alloc_shared(ct_group *g, size_t bytes)
{
    void *p = NULL;
    ASSERT_OK(ct_group_alloc_shared(g, bytes, CT_MEM_COMM, &p));
    ASSERT(p);
    return p;
}

/* Full-mantissa float of rank r, element i. */
static float rnd(int r, int64_t i, int seed)
{
    uint64_t h = mix(((uint64_t)seed << 48) ^ ((uint64_t)r << 40) ^ (uint64_t)i ^ 0x7777);
    double u = (double)(h >> 11) / 9007199254740992.0 * 2 - 1;
    return (float)(u * (double)(1 << (h % 7)));
}

/* The reduction of rnd over ranks in rank order, in float, as the direct path computes it. */
static float rank_order(int p, int64_t i, int seed, ct_reduce_op op)
{
    float f = rnd(0, i, seed);
    for (int r = 1; r < p; r++) {
        float x = rnd(r, i, seed);
        if (op == CT_OP_MAX) f = f > x ? f : x;
        else if (op == CT_OP_MIN) f = f < x ? f : x;
        else f += x;
    }
    return op == CT_OP_AVG ? f * (1.0f / (float)p) : f;
}

static void check_at(const void *buf, ct_dtype dt, ct_reduce_op op, int64_t n, int64_t first,
                     int p, int seed, const char *what)
{
    for (int64_t i = 0; i < n; i++) {
        double sa, want = reference(dt, op, first + i, p, seed, &sa), got = get(buf, dt, i);
        double tol = tolerance(dt, op, p, want, sa);
        if (!(fabs(got - want) <= tol)) {
            soft_fail("%s %s %s n=%lld: [%lld] = %.9g, want %.9g (tol %g)", what,
                      ct_dtype_name(dt), op_name(op), (long long)n, (long long)i, got, want, tol);
            return;
        }
    }
}

/* ---- reduce-scatter ---------------------------------------------------- */

TEST(shm_reduce_scatter_every_dtype_and_op)
{
    soft_begin();
    ct_group *g = W();
    int p = ct_group_size(g), me = ct_group_rank(g);
    static const int64_t counts[] = {1, 7, 1001, 65537};
    static const ct_dtype dts[] = {CT_F32, CT_BF16, CT_F16};
    size_t cap = (size_t)65537 * 4 * (size_t)p;
    char *send = alloc_shared(g, cap);
    char *priv = ct_alloc_zeroed((size_t)65537 * 4, CT_MEM_COMM);
    for (int d = 0; d < 3; d++)
        for (int c = 0; c < 4; c++)
            for (int op = CT_OP_SUM; op <= CT_OP_MIN; op++)
                for (int inplace = 0; inplace < 2; inplace++) {
                    ct_dtype dt = dts[d];
                    int64_t n = counts[c];
                    size_t esz = ct_dtype_size(dt);
                    int seed = 2000 + 100 * d + 10 * c + op;
                    for (int64_t i = 0; i < n * p; i++) put(send, dt, i, input(me, i, seed, dt));
                    char *recv = inplace ? send + (size_t)(me * n) * esz : priv;
                    ASSERT_OK(ct_group_reduce_scatter(g, send, recv, n, dt, (ct_reduce_op)op, NULL));
                    check_at(recv, dt, (ct_reduce_op)op, n, me * n, p, seed,
                             inplace ? "shm reduce_scatter in place" : "shm reduce_scatter");
                }
    ct_free(priv);
    ct_group_free_shared(g, send);
    ASSERT_NO_SOFT_FAIL();
}

TEST(shm_reduce_scatter_f32_matches_mpi_and_rank_order)
{
    soft_begin();
    ct_group *g = W();
    int p = ct_group_size(g), me = ct_group_rank(g);
    int64_t n = 30011;
    float *sh = alloc_shared(g, (size_t)(n * p) * 4);
    /* the direct path: shared, on one node (spanning nodes these go through MPI) */
    int direct = ct_group_is_shared(g, sh, (size_t)(n * p) * 4) &&
                 ct_group_local_size(g) == ct_group_size(g);
    float *pr = ct_alloc_zeroed((size_t)(n * p) * 4, CT_MEM_COMM);
    float *out_sh = ct_alloc_zeroed((size_t)n * 4, CT_MEM_COMM), *out_pr = ct_alloc_zeroed((size_t)n * 4, CT_MEM_COMM);
    for (int op = CT_OP_SUM; op <= CT_OP_MIN; op++) {
        for (int64_t i = 0; i < n * p; i++) sh[i] = pr[i] = rnd(me, i, op);
        ASSERT_OK(ct_group_reduce_scatter(g, sh, out_sh, n, CT_F32, (ct_reduce_op)op, NULL));
        ASSERT_OK(ct_group_reduce_scatter(g, pr, out_pr, n, CT_F32, (ct_reduce_op)op, NULL));
        int64_t bad = 0, at = -1;
        for (int64_t i = 0; i < n; i++) {
            float want = rank_order(p, me * n + i, op, (ct_reduce_op)op);
            int ok = 1;
            if (p == 2 || op == CT_OP_MAX || op == CT_OP_MIN) ok = !memcmp(&out_sh[i], &out_pr[i], 4);
            if (direct) ok = ok && !memcmp(&out_sh[i], &want, 4);
            if (!ok && !bad++) at = i;
        }
        if (bad)
            soft_fail("reduce_scatter %s: %lld elements differ; first [%lld]: shm %.9g, mpi %.9g, "
                      "rank order %.9g", op_name((ct_reduce_op)op), (long long)bad, (long long)at,
                      out_sh[at], out_pr[at], rank_order(p, me * n + at, op, (ct_reduce_op)op));
    }
    ct_free(pr), ct_free(out_sh), ct_free(out_pr);
    ct_group_free_shared(g, sh);
    ASSERT_NO_SOFT_FAIL();
}

/* ---- all-gather -------------------------------------------------------- */

TEST(shm_allgather_every_dtype)
{
    soft_begin();
    ct_group *g = W();
    int p = ct_group_size(g), me = ct_group_rank(g);
    static const int64_t counts[] = {1, 7, 1001, 65537};
    char *recv = alloc_shared(g, (size_t)65537 * 8 * (size_t)p);
    char *send = ct_alloc_zeroed((size_t)65537 * 8, CT_MEM_COMM);
    for (int dt = 0; dt < CT_NDTYPE; dt++)
        for (int c = 0; c < 4; c++)
            for (int inplace = 0; inplace < 2; inplace++) {
                int64_t n = counts[c];
                size_t esz = ct_dtype_size((ct_dtype)dt);
                int seed = 3000 + 10 * dt + c;
                memset(recv, 0x5a, (size_t)(n * p) * esz);
                char *mine = inplace ? recv + (size_t)(me * n) * esz : send;
                for (int64_t i = 0; i < n; i++) put(mine, (ct_dtype)dt, i, input(me, i, seed, (ct_dtype)dt));
                ct_work *w;
                ASSERT_OK(ct_group_allgather(g, mine, recv, n, (ct_dtype)dt, &w));
                ASSERT_OK(ct_work_wait(w));
                ct_work_destroy(w);
                for (int r = 0; r < p; r++)
                    for (int64_t i = 0; i < n; i++)
                        if (get(recv + (size_t)(r * n) * esz, (ct_dtype)dt, i) !=
                            input(r, i, seed, (ct_dtype)dt)) {
                            soft_fail("shm allgather %s n=%lld inplace=%d: block %d [%lld] wrong",
                                      ct_dtype_name((ct_dtype)dt), (long long)n, inplace, r,
                                      (long long)i);
                            r = p;
                            break;
                        }
            }
    ct_free(send);
    ct_group_free_shared(g, recv);
    ASSERT_NO_SOFT_FAIL();
}

/* ---- reduce ------------------------------------------------------------ */

TEST(shm_reduce_every_root_dtype_and_op)
{
    soft_begin();
    ct_group *g = W();
    int p = ct_group_size(g), me = ct_group_rank(g);
    static const int64_t counts[] = {1, 7, 4099, 100003};
    static const ct_dtype dts[] = {CT_F32, CT_BF16, CT_F16};
    char *buf = alloc_shared(g, (size_t)100003 * 4 + 64);
    for (int root = 0; root < p; root++)
        for (int d = 0; d < 3; d++)
            for (int c = 0; c < 4; c++)
                for (int op = CT_OP_SUM; op <= CT_OP_MIN; op++) {
                    ct_dtype dt = dts[d];
                    int64_t n = counts[c];
                    int seed = 4000 + 1000 * root + 100 * d + 10 * c + op;
                    char *b = buf + (c % 2) * 12; /* aligned and not */
                    for (int64_t i = 0; i < n; i++) put(b, dt, i, input(me, i, seed, dt));
                    ASSERT_OK(ct_group_reduce(g, b, n, dt, (ct_reduce_op)op, root, NULL));
                    if (me == root) {
                        check_at(b, dt, (ct_reduce_op)op, n, 0, p, seed, "shm reduce");
                    } else {
                        for (int64_t i = 0; i < n; i++)
                            if (get(b, dt, i) != input(me, i, seed, dt)) {
                                soft_fail("reduce to %d changed rank %d's buffer at [%lld]", root,
                                          me, (long long)i);
                                break;
                            }
                    }
                }
    ct_group_free_shared(g, buf);
    ASSERT_NO_SOFT_FAIL();
}

TEST(shm_reduce_f32_matches_mpi_and_rank_order)
{
    soft_begin();
    ct_group *g = W();
    int p = ct_group_size(g), me = ct_group_rank(g);
    int64_t n = 100003;
    float *sh = alloc_shared(g, (size_t)n * 4);
    int direct = ct_group_is_shared(g, sh, (size_t)n * 4) &&
                 ct_group_local_size(g) == ct_group_size(g);
    float *pr = ct_alloc_zeroed((size_t)n * 4, CT_MEM_COMM);
    int root = p - 1;
    for (int op = CT_OP_SUM; op <= CT_OP_MIN; op++) {
        for (int64_t i = 0; i < n; i++) sh[i] = pr[i] = rnd(me, i, 10 + op);
        ASSERT_OK(ct_group_reduce(g, sh, n, CT_F32, (ct_reduce_op)op, root, NULL));
        ASSERT_OK(ct_group_reduce(g, pr, n, CT_F32, (ct_reduce_op)op, root, NULL));
        if (me != root) continue;
        int64_t bad = 0, at = -1;
        for (int64_t i = 0; i < n; i++) {
            float want = rank_order(p, i, 10 + op, (ct_reduce_op)op);
            int ok = 1;
            if (p == 2 || op == CT_OP_MAX || op == CT_OP_MIN) ok = !memcmp(&sh[i], &pr[i], 4);
            if (direct) ok = ok && !memcmp(&sh[i], &want, 4);
            if (!ok && !bad++) at = i;
        }
        if (bad)
            soft_fail("reduce %s: %lld elements differ; first [%lld]: shm %.9g, mpi %.9g",
                      op_name((ct_reduce_op)op), (long long)bad, (long long)at, sh[at], pr[at]);
    }
    ct_free(pr);
    ct_group_free_shared(g, sh);
    ASSERT_NO_SOFT_FAIL();
}

/* ---- arguments that differ across ranks --------------------------------- */

TEST(shm_coll_mismatch_fails_on_every_rank)
{
    soft_begin();
    ct_group *g = W();
    int p = ct_group_size(g), me = ct_group_rank(g);
    int64_t n = 1024;
    float *x = alloc_shared(g, (size_t)(n * p) * 4);
    if (!ct_group_is_shared(g, x, (size_t)(n * p) * 4) ||
        ct_group_local_size(g) != ct_group_size(g)) { /* MPI path: nothing to agree */
        ct_group_free_shared(g, x);
        return;
    }
    float *priv = ct_alloc_zeroed((size_t)(n * p) * 4, CT_MEM_COMM);
    for (int64_t i = 0; i < n * p; i++) x[i] = priv[i] = (float)(me * 100000 + i);
    float out[1024];
    /* reduce_scatter: counts differ */
    ASSERT_ERR(ct_group_reduce_scatter(g, x, out, me ? 100 : 101, CT_F32, CT_OP_SUM, NULL),
               CT_EINVAL, "different arguments");
    /* reduce: roots differ */
    ASSERT_ERR(ct_group_reduce(g, x, n, CT_F32, CT_OP_SUM, me == 0 ? 0 : p - 1, NULL), CT_EINVAL,
               "root");
    /* allgather: the last rank gathers into private memory */
    ASSERT_ERR(ct_group_allgather(g, out, me == p - 1 ? priv : x, 16, CT_F32, NULL), CT_EINVAL,
               "private memory");
    /* different collectives at the same point */
    ct_status s = me == 0 ? ct_group_reduce(g, x, n, CT_F32, CT_OP_SUM, 0, NULL)
                          : ct_group_allreduce(g, x, n, CT_F32, CT_OP_SUM, NULL);
    ASSERT_EQ(s, CT_EINVAL);
    ASSERT_STR_CONTAINS(ct_last_error(), "different arguments");
    for (int64_t i = 0; i < n * p; i++)
        if (x[i] != (float)(me * 100000 + i)) {
            soft_fail("a failed collective changed x[%lld]", (long long)i);
            break;
        }
    /* and the group still works */
    ASSERT_OK(ct_group_reduce_scatter(g, x, out, n, CT_F32, CT_OP_SUM, NULL));
    for (int64_t i = 0; i < n; i++)
        if (out[i] != (float)(100000 * p * (p - 1) / 2 + p * (me * n + i))) {
            soft_fail("reduce_scatter after the errors: [%lld] = %g", (long long)i, out[i]);
            break;
        }
    ct_free(priv);
    ct_group_free_shared(g, x);
    ASSERT_NO_SOFT_FAIL();
}
