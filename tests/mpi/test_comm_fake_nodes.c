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
