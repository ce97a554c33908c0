/*
 * Fake node boundaries (ct_comm_set_fake_nodes, CTRAIN_FAKE_NODES): with K
 * fake nodes the ranks of a world of P sit on nodes of contiguous ranks,
 * rank r on node r*K/P, and everything that asks "which node" follows:
 * local rank and size, shared-memory windows (never across nodes) and the
 * two-level collectives, which must give the flat collectives' results.
 *
 * The world's nodes are fixed at ct_comm_init, so each test sets K and
 * splits the world into a copy that has them.
 */
#include <stdint.h>
#include <stdlib.h>

#include "coll_ref.h"
#include "comm/internal.h" /* ct__shm_window_ranks: who maps a window */

static int node_of(int r, int p, int k)
{
    if (k > p) k = p;
    return k > 0 ? (int)((int64_t)r * k / p) : 0;
}

/* A copy of the world whose nodes are k fake ones. */
static ct_group *world_on_fake_nodes(int k)
{
    ct_group *g = NULL;
    int saved = ct_comm_get_fake_nodes();
    ct_comm_set_fake_nodes(k);
    ct_status s = ct_group_split(W(), 0, ct_group_rank(W()), &g);
    ct_comm_set_fake_nodes(saved);
    ASSERT_OK(s);
    return g;
}

static int shm_enabled(void)
{
    const char *e = getenv("CTRAIN_COMM_SHM");
    return !(e && !strcmp(e, "0"));
}

TEST(fake_nodes_set_local_rank_and_size)
{
    int p = ct_group_size(W()), me = ct_group_rank(W());
    int ks[] = {1, 2, 3, p + 1};
    for (int i = 0; i < 4; i++) {
        int k = ks[i];
        ct_group *g = world_on_fake_nodes(k);
        int size = 0, rank = 0;
        for (int r = 0; r < p; r++)
            if (node_of(r, p, k) == node_of(me, p, k)) {
                size++;
                rank += r < me;
            }
        ASSERT_EQ(ct_group_size(g), p);
        ASSERT_EQ(ct_group_local_size(g), size);
        ASSERT_EQ(ct_group_local_rank(g), rank);
        ct_group_destroy(g);
    }
    /* 4 ranks, K=2: ranks 0,1 on node 0 and 2,3 on node 1 */
    if (p == 4) ASSERT_EQ(node_of(me, 4, 2), me / 2);
}

/* A group that spans fake nodes never gets one window over all its ranks;
 * a group inside one fake node does, over just its ranks. */
TEST(fake_nodes_no_shared_window_across_nodes)
{
    soft_begin();
    int p = ct_group_size(W()), me = ct_group_rank(W());
    ct_group *g = world_on_fake_nodes(2);
    int64_t n = 4099;
    float *x = NULL;
    ASSERT_OK(ct_group_alloc_shared(g, (size_t)n * 4, CT_MEM_COMM, (void **)&x));
    int ranks = ct__shm_window_ranks(g, x);
    if (ranks > ct_group_local_size(g))
        soft_fail("a window of %d ranks on a group whose nodes have at most %d", ranks,
                  ct_group_local_size(g));
    for (int64_t i = 0; i < n; i++) x[i] = (float)(me + i % 100);
    ASSERT_OK(ct_group_allreduce(g, x, n, CT_F32, CT_OP_SUM, NULL));
    for (int64_t i = 0; i < n; i++)
        if (x[i] != (float)(p * (p - 1) / 2 + p * (i % 100))) {
            soft_fail("allreduce over fake nodes: x[%lld] = %g", (long long)i, x[i]);
            break;
        }
    ct_group_free_shared(g, x);
    /* one group per fake node: a window over exactly its ranks */
    ct_group *node = NULL;
    ASSERT_OK(ct_group_split(g, node_of(me, p, 2), me, &node));
    int np = ct_group_size(node);
    ASSERT_EQ(np, ct_group_local_size(g));
    ASSERT_EQ(ct_group_local_size(node), np);
    ASSERT_OK(ct_group_alloc_shared(node, (size_t)n * 4, CT_MEM_COMM, (void **)&x));
    ASSERT_EQ(ct__shm_window_ranks(node, x), np > 1 && shm_enabled() ? np : 0);
    ASSERT_EQ(ct_group_is_shared(node, x, (size_t)n * 4), np > 1 && shm_enabled());
    for (int64_t i = 0; i < n; i++) x[i] = (float)(me + i % 100);
    ASSERT_OK(ct_group_allreduce(node, x, n, CT_F32, CT_OP_SUM, NULL));
    float members = 0;
    for (int r = 0; r < p; r++)
        if (node_of(r, p, 2) == node_of(me, p, 2)) members += (float)r;
    for (int64_t i = 0; i < n; i++)
        if (x[i] != members + (float)(np * (i % 100))) {
            soft_fail("allreduce in one fake node: x[%lld] = %g", (long long)i, x[i]);
            break;
        }
    ct_group_free_shared(node, x);
    ct_group_destroy(node);
    ct_group_destroy(g);
    ASSERT_NO_SOFT_FAIL();
}

/* With fake nodes, the two-level allreduce on shared memory gives the flat
 * MPI allreduce's result on private memory: bit for bit for exact f32
 * inputs and every op, within tolerance for bf16/f16; and it ran. */
TEST(fake_nodes_two_level_allreduce_equals_flat)
{
    soft_begin();
    int p = ct_group_size(W()), me = ct_group_rank(W());
    static const int64_t sizes[] = {1, 7, 4099, 262147};
    static const ct_dtype dts[] = {CT_F32, CT_BF16, CT_F16};
    for (int k = 2; k <= 3; k++) {
        ct_group *g = world_on_fake_nodes(k);
        int64_t cap = 262147;
        char *x = NULL;
        ASSERT_OK(ct_group_alloc_shared(g, (size_t)cap * 4 + 64, CT_MEM_COMM, (void **)&x));
        char *y = ct_alloc_zeroed((size_t)cap * 4, CT_MEM_COMM);
        /* shared within a node when some node has two ranks of g */
        int maxlocal = ct_group_local_size(g);
        ASSERT_OK(ct_group_allreduce(g, &maxlocal, 1, CT_I32, CT_OP_MAX, NULL));
        int expect_two_level = shm_enabled() && maxlocal > 1;
        ASSERT_EQ(ct__shm_window_ranks(g, x), expect_two_level ? ct_group_local_size(g) : 0);
        uint64_t runs0 = atomic_load(&ct__allreduce_two_level_runs), nruns = 0;
        for (int d = 0; d < 3; d++)
            for (int s = 0; s < 4; s++)
                for (int op = CT_OP_SUM; op <= CT_OP_MIN; op++) {
                    ct_dtype dt = dts[d];
                    int64_t n = sizes[s];
                    int seed = 5000 + 100 * k + 10 * d + s * 4 + op;
                    char *b = x + (s % 2) * 4; /* aligned and not */
                    for (int64_t i = 0; i < n; i++) {
                        put(b, dt, i, input(me, i, seed, dt));
                        put(y, dt, i, input(me, i, seed, dt));
                    }
                    ct_work *w;
                    ASSERT_OK(ct_group_allreduce(g, b, n, dt, (ct_reduce_op)op, &w));
                    ASSERT_OK(ct_group_allreduce(g, y, n, dt, (ct_reduce_op)op, NULL));
                    ASSERT_OK(ct_work_wait(w));
                    ct_work_destroy(w);
                    nruns++;
                    for (int64_t i = 0; i < n; i++) {
                        double sa, want = reference(dt, (ct_reduce_op)op, i, p, seed, &sa);
                        double tol = tolerance(dt, (ct_reduce_op)op, p, want, sa);
                        double got = get(b, dt, i), flat = get(y, dt, i);
                        int bad = !(fabs(got - want) <= tol);
                        if (dt == CT_F32) bad = bad || got != flat;
                        if (bad) {
                            soft_fail("K=%d %s %s n=%lld: two-level [%lld] = %.9g, flat %.9g, "
                                      "want %.9g", k, ct_dtype_name(dt), op_name((ct_reduce_op)op),
                                      (long long)n, (long long)i, got, flat, want);
                            break;
                        }
                    }
                }
        uint64_t ran = atomic_load(&ct__allreduce_two_level_runs) - runs0;
        if (ran != (expect_two_level ? nruns : 0))
            soft_fail("K=%d: %llu of %llu allreduces took the two-level path, want %llu", k,
                      (unsigned long long)ran, (unsigned long long)nruns,
                      (unsigned long long)(expect_two_level ? nruns : 0));
        ct_free(y);
        ct_group_free_shared(g, x);
        ct_group_destroy(g);
    }
    ASSERT_NO_SOFT_FAIL();
}

/* Across nodes the agreement is an MPI allreduce of a hash: ranks that pass
 * different ranges, or private memory on one rank, all fail. */
TEST(fake_nodes_two_level_mismatch_fails_on_every_rank)
{
    soft_begin();
    int p = ct_group_size(W()), me = ct_group_rank(W());
    ct_group *g = world_on_fake_nodes(2);
    int64_t n = 4096;
    float *x = NULL;
    ASSERT_OK(ct_group_alloc_shared(g, (size_t)n * 4, CT_MEM_COMM, (void **)&x));
    if (!ct__shm_window_ranks(g, x)) { /* no node with two ranks: flat MPI, nothing to agree */
        ct_group_free_shared(g, x);
        ct_group_destroy(g);
        return;
    }
    float *priv = ct_alloc_zeroed((size_t)n * 4, CT_MEM_COMM);
    for (int64_t i = 0; i < n; i++) x[i] = priv[i] = (float)(me * 10000 + i);
    ASSERT_ERR(ct_group_allreduce(g, x + 16 * me, 1000, CT_F32, CT_OP_SUM, NULL), CT_EINVAL,
               "different arguments");
    ASSERT_ERR(ct_group_allreduce(g, me == p - 1 ? priv : x, n, CT_F32, CT_OP_SUM, NULL),
               CT_EINVAL, "different arguments");
    for (int64_t i = 0; i < n; i++)
        if (x[i] != (float)(me * 10000 + i)) {
            soft_fail("a failed allreduce changed x[%lld]", (long long)i);
            break;
        }
    ASSERT_OK(ct_group_allreduce(g, x, n, CT_F32, CT_OP_AVG, NULL));
    for (int64_t i = 0; i < n; i++)
        if (x[i] != (float)(10000 * p * (p - 1) / 2 + p * i) * (1.0f / (float)p)) {
            soft_fail("allreduce after the errors: x[%lld] = %g", (long long)i, x[i]);
            break;
        }
    ct_free(priv);
    ct_group_free_shared(g, x);
    ct_group_destroy(g);
    ASSERT_NO_SOFT_FAIL();
}

/* ---- two-level reduce-scatter and all-gather ---------------------------- */

/* A copy of the world on k fake nodes; interleaved: even world ranks first,
 * then odd, so a node's ranks are not contiguous in the group (the leaders'
 * pack-and-unpack layout). */
static ct_group *fake_nodes_ordered(int k, int interleaved)
{
    int p = ct_group_size(W()), me = ct_group_rank(W());
    ct_group *g = NULL;
    int saved = ct_comm_get_fake_nodes();
    ct_comm_set_fake_nodes(k);
    ct_status s = ct_group_split(W(), 0, interleaved ? (me % 2) * p + me : me, &g);
    ct_comm_set_fake_nodes(saved);
    ASSERT_OK(s);
    return g;
}

static const ct_dtype all_dts[] = {CT_F32, CT_BF16, CT_F16, CT_I32, CT_I64, CT_U8};

/* Two-level on shared memory equals the flat MPI collective on private
 * memory, in place and not.  Equality rule (as for the two-level
 * allreduce): all-gather is a copy, so bytes equal for every dtype;
 * reduce-scatter with f32 inputs that sum exactly (coll_ref.h) equals flat
 * bit for bit for every op, integers (MPI path) exactly, bf16/f16 within
 * tolerance of the exact sum.  Counters prove the two-level path ran. */
TEST(fake_nodes_two_level_allgather_reduce_scatter_equal_flat)
{
    soft_begin();
    int p = ct_group_size(W());
    static const int64_t sizes[] = {1, 7, 1001, 65537};
    for (int k = 2; k <= 3; k++)
        for (int il = 0; il < 2; il++) {
            ct_group *g = fake_nodes_ordered(k, il);
            int me = ct_group_rank(g), wme = ct_group_rank(W());
            int64_t cap = 65537 * (int64_t)p;
            char *x = NULL;
            ASSERT_OK(ct_group_alloc_shared(g, (size_t)cap * 8, CT_MEM_COMM, (void **)&x));
            char *y = ct_alloc_zeroed((size_t)cap * 8, CT_MEM_COMM);
            char *a = ct_alloc_zeroed((size_t)65537 * 8, CT_MEM_COMM);
            char *b = ct_alloc_zeroed((size_t)65537 * 8, CT_MEM_COMM);
            int maxlocal = ct_group_local_size(g);
            ASSERT_OK(ct_group_allreduce(g, &maxlocal, 1, CT_I32, CT_OP_MAX, NULL));
            int expect = shm_enabled() && maxlocal > 1;
            uint64_t ag0 = atomic_load(&ct__allgather_two_level_runs);
            uint64_t rs0 = atomic_load(&ct__reduce_scatter_two_level_runs);
            uint64_t nag = 0, nrs = 0;
            for (int d = 0; d < 6; d++)
                for (int s = 0; s < 4; s++)
                    for (int inplace = 0; inplace < 2; inplace++) {
                        ct_dtype dt = all_dts[d];
                        int64_t n = sizes[s];
                        size_t esz = ct_dtype_size(dt), blk = (size_t)n * esz;
                        int seed = 7000 + 100 * k + 50 * il + 10 * d + 2 * s + inplace;
                        /* all-gather: rank r's block is input(r) */
                        for (int64_t i = 0; i < n; i++) {
                            put(a, dt, i, input(me, i, seed, dt));
                            put(x + (size_t)me * blk, dt, i, input(me, i, seed, dt));
                            put(y + (size_t)me * blk, dt, i, input(me, i, seed, dt));
                        }
                        ct_work *w;
                        ASSERT_OK(ct_group_allgather(g, inplace ? x + (size_t)me * blk : a, x, n,
                                                     dt, &w));
                        ASSERT_OK(ct_group_allgather(g, inplace ? y + (size_t)me * blk : a, y, n,
                                                     dt, NULL));
                        ASSERT_OK(ct_work_wait(w));
                        ct_work_destroy(w);
                        nag++;
                        if (memcmp(x, y, blk * (size_t)p))
                            soft_fail("K=%d%s %s n=%lld%s: two-level all-gather differs from "
                                      "flat", k, il ? " interleaved" : "", ct_dtype_name(dt),
                                      (long long)n, inplace ? " in place" : "");
                        for (int r = 0; r < p; r++)
                            if (get(x + (size_t)r * blk, dt, n - 1) != input(r, n - 1, seed, dt)) {
                                soft_fail("K=%d %s n=%lld: all-gather block %d wrong", k,
                                          ct_dtype_name(dt), (long long)n, r);
                                break;
                            }
                        /* reduce-scatter: block j of rank r is input(r) at j*n + i */
                        int nops = d < 3 ? 4 : 1;
                        for (int op = 0; op < nops; op++) {
                            int sd = seed * 4 + op;
                            for (int64_t i = 0; i < n * p; i++) {
                                put(x, dt, i, input(me, i, sd, dt));
                                put(y, dt, i, input(me, i, sd, dt));
                            }
                            char *rx = inplace ? x + (size_t)me * blk : a;
                            char *ry = inplace ? y + (size_t)me * blk : b;
                            ASSERT_OK(ct_group_reduce_scatter(g, x, rx, n, dt, (ct_reduce_op)op,
                                                              &w));
                            ASSERT_OK(ct_group_reduce_scatter(g, y, ry, n, dt, (ct_reduce_op)op,
                                                              NULL));
                            ASSERT_OK(ct_work_wait(w));
                            ct_work_destroy(w);
                            nrs += d < 3;
                            for (int64_t i = 0; i < n; i++) {
                                int64_t at = (int64_t)me * n + i;
                                double sa, want = reference(dt, (ct_reduce_op)op, at, p, sd, &sa);
                                double tol = tolerance(dt, (ct_reduce_op)op, p, want, sa);
                                double got = get(rx, dt, i), flat = get(ry, dt, i);
                                int bad = !(fabs(got - want) <= tol);
                                if (dt == CT_F32 || d >= 3)
                                    bad = bad || memcmp(rx + (size_t)i * esz, ry + (size_t)i * esz,
                                                        esz);
                                if (bad) {
                                    soft_fail("K=%d%s %s %s n=%lld%s: two-level reduce-scatter "
                                              "[%lld] = %.9g, flat %.9g, want %.9g", k,
                                              il ? " interleaved" : "", ct_dtype_name(dt),
                                              op_name((ct_reduce_op)op), (long long)n,
                                              inplace ? " in place" : "", (long long)i, got, flat,
                                              want);
                                    break;
                                }
                            }
                        }
                    }
            uint64_t ag = atomic_load(&ct__allgather_two_level_runs) - ag0;
            uint64_t rs = atomic_load(&ct__reduce_scatter_two_level_runs) - rs0;
            if (ag != (expect ? nag : 0) || rs != (expect ? nrs : 0))
                soft_fail("K=%d%s (world rank %d): %llu of %llu all-gathers and %llu of %llu "
                          "reduce-scatters took the two-level path, want %s", k,
                          il ? " interleaved" : "", wme, (unsigned long long)ag,
                          (unsigned long long)nag, (unsigned long long)rs,
                          (unsigned long long)nrs, expect ? "all (floats)" : "none");
            ct_free(a);
            ct_free(b);
            ct_free(y);
            ct_group_free_shared(g, x);
            ct_group_destroy(g);
        }
    ASSERT_NO_SOFT_FAIL();
}

/* Mismatched arguments across nodes fail on every rank and change nothing. */
TEST(fake_nodes_two_level_allgather_reduce_scatter_mismatch_fails_on_every_rank)
{
    soft_begin();
    int p = ct_group_size(W()), me = ct_group_rank(W());
    ct_group *g = world_on_fake_nodes(2);
    int64_t n = 1024, tot = n * p + 64;
    float *x = NULL;
    ASSERT_OK(ct_group_alloc_shared(g, (size_t)tot * 4, CT_MEM_COMM, (void **)&x));
    if (!ct__shm_window_ranks(g, x)) { /* no node with two ranks: flat MPI, nothing to agree */
        ct_group_free_shared(g, x);
        ct_group_destroy(g);
        return;
    }
    float *priv = ct_alloc_zeroed((size_t)tot * 4, CT_MEM_COMM);
    float *r = ct_alloc_zeroed((size_t)n * 4, CT_MEM_COMM);
    for (int64_t i = 0; i < tot; i++) x[i] = priv[i] = (float)(me * 10000 + i);
    /* all-gather: different ranges; private memory on one rank */
    ASSERT_ERR(ct_group_allgather(g, r, x + 16 * me, 100, CT_F32, NULL), CT_EINVAL,
               "different arguments");
    ASSERT_ERR(ct_group_allgather(g, r, me == p - 1 ? priv : x, n, CT_F32, NULL), CT_EINVAL,
               "different arguments");
    /* reduce-scatter: different ranges; private on one rank; in place on one rank */
    ASSERT_ERR(ct_group_reduce_scatter(g, x + 16 * me, r, 100, CT_F32, CT_OP_SUM, NULL),
               CT_EINVAL, "different arguments");
    ASSERT_ERR(ct_group_reduce_scatter(g, me == p - 1 ? priv : x, r, n, CT_F32, CT_OP_SUM, NULL),
               CT_EINVAL, "different arguments");
    ASSERT_ERR(ct_group_reduce_scatter(g, x, me == 0 ? x + n * me : r, n, CT_F32, CT_OP_SUM,
                                       NULL),
               CT_EINVAL, "different arguments");
    ASSERT_ERR(ct_group_reduce_scatter(g, x, r, n, CT_F32, me == 0 ? CT_OP_MAX : CT_OP_SUM,
                                       NULL),
               CT_EINVAL, "different arguments");
    for (int64_t i = 0; i < tot; i++)
        if (x[i] != (float)(me * 10000 + i)) {
            soft_fail("a failed collective changed x[%lld]", (long long)i);
            break;
        }
    /* and the group still works */
    ASSERT_OK(ct_group_reduce_scatter(g, x, r, n, CT_F32, CT_OP_SUM, NULL));
    for (int64_t i = 0; i < n; i++)
        if (r[i] != (float)(10000 * p * (p - 1) / 2 + p * (me * n + i))) {
            soft_fail("reduce-scatter after the errors: r[%lld] = %g", (long long)i, r[i]);
            break;
        }
    ct_free(r);
    ct_free(priv);
    ct_group_free_shared(g, x);
    ct_group_destroy(g);
    ASSERT_NO_SOFT_FAIL();
}
