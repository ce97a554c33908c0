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
