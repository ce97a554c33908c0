/*
 * What only a real cluster shows, run by tests/test_cluster.c under
 * scripts/cluster (hosts that are network namespaces talking over TCP):
 * ctrain's nodes are the hosts (Open MPI's locality, not a fake), no
 * shared-memory window ever spans two hosts, the two-level allreduce over
 * them is exact, and FSDP's hybrid sharding shards inside a host and
 * replicates across hosts.  Under a plain mpirun (one machine, no
 * CTRAIN_CLUSTER_HOSTS) each test skips, saying where it runs.
 */
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>

#include "coll_ref.h"
#include "comm/internal.h" /* ct__shm_window_ranks: who maps a window */
#include "train_util.h"

/* The launcher's layout (hosts, ranks per host), or a skip. */
static void cluster_layout(int *hosts, int *per_host)
{
    const char *h = getenv("CTRAIN_CLUSTER_HOSTS"), *k = getenv("CTRAIN_CLUSTER_PER_HOST");
    if (!h || !k) SKIP("not on a cluster: runs under scripts/cluster (tests/test_cluster.c)");
    *hosts = atoi(h);
    *per_host = atoi(k);
    ASSERT_EQ(*hosts * *per_host, ct_group_size(W()));
}

/* Every rank's host is told apart by its hostname (the launcher gives each
 * host its own), and ctrain's node numbering matches it: ranks fill host 0
 * first, so rank r is on node r / per_host. */
TEST(cluster_nodes_are_the_hosts)
{
    int hosts, per;
    cluster_layout(&hosts, &per);
    int me = ct_group_rank(W()), p = ct_group_size(W());
    ASSERT_EQ(ct_group_num_nodes(W()), hosts);
    ASSERT_EQ(ct_group_node(W()), me / per);
    ASSERT_EQ(ct_group_local_size(W()), per);
    ASSERT_EQ(ct_group_local_rank(W()), me % per);
    char name[64] = "";
    ASSERT_EQ(gethostname(name, sizeof name - 1), 0);
    int64_t mine = (int64_t)(ct_hash64(name, strlen(name)) >> 1), *all = calloc((size_t)p, sizeof *all);
    ASSERT(all);
    ASSERT_OK(ct_group_allgather(W(), &mine, all, 1, CT_I64, NULL));
    int bad = -1, same = 0;
    for (int r = 0; r < p && bad < 0; r++)
        if ((all[r] == mine) != (r / per == me / per)) bad = r, same = all[r] == mine;
    free(all);
    if (bad >= 0)
        ct_test_fail(__FILE__, __LINE__, "rank %d's hostname %s the same as rank %d's, but they are on %s hosts", bad,
                     same ? "is" : "is not", me, same ? "different" : "the same");
}

/* A window over the world maps only the ranks of one host (none when a
 * host has one rank), and the allreduce over it (two levels: shared memory
 * in a host, TCP between them) gives the exact sum. */
TEST(cluster_no_shared_memory_across_hosts)
{
    int hosts, per;
    cluster_layout(&hosts, &per);
    soft_begin();
    int p = ct_group_size(W()), me = ct_group_rank(W());
    int64_t n = 100003;
    float *x = NULL;
    ASSERT_OK(ct_group_alloc_shared(W(), (size_t)n * 4, CT_MEM_COMM, (void **)&x));
    int ranks = ct__shm_window_ranks(W(), x);
    const char *e = getenv("CTRAIN_COMM_SHM");
    int shm = !(e && !strcmp(e, "0"));
    if (ranks != (per > 1 && shm ? per : 0))
        soft_fail("a window over %d ranks with %d ranks a host", ranks, per);
    if (ct_group_is_shared(W(), x, (size_t)n * 4) != (per > 1 && shm))
        soft_fail("ct_group_is_shared says %d with %d ranks a host", ct_group_is_shared(W(), x, (size_t)n * 4), per);
    for (int64_t i = 0; i < n; i++) x[i] = (float)(me + i % 100);
    ASSERT_OK(ct_group_allreduce(W(), x, n, CT_F32, CT_OP_SUM, NULL));
    for (int64_t i = 0; i < n; i++)
        if (x[i] != (float)(p * (p - 1) / 2 + p * (i % 100))) {
            soft_fail("allreduce across hosts: x[%lld] = %g", (long long)i, x[i]);
            break;
        }
    ct_group_free_shared(W(), x);
    ASSERT_NO_SOFT_FAIL();
}

/* HYBRID_SHARD on real hosts: each unit's pieces are cut over one host's
 * ranks (the partition has per-host owners), and training equals one
 * process on the whole batch. */
TEST(cluster_fsdp_hybrid_shards_inside_a_host_and_equals_one_process)
{
    int hosts, per;
    cluster_layout(&hosts, &per);
    ct_group *g = W();
    int rank = ct_group_rank(g), world = ct_group_size(g);
    int64_t n = 6 * world + 2;
    ct_module *dm = mlp8(31 + (uint64_t)rank, 24), *rm = mlp8(31, 24);
    ct_optim_opts oo = optim_for(CT_OPT_ADAMW);
    ct_strategy *ds, *rs;
    ASSERT_OK(ct_strategy_create("fsdp", dm, &oo, g, "sharding=hybrid,wrap_kinds=linear", &ds));
    ASSERT_OK(ct_strategy_create("none", rm, &oo, NULL, NULL, &rs));
    const ct_partition *pt = ct_strategy_partition(ds);
    ASSERT(pt != NULL);
    ASSERT_EQ(pt->nranks, per);
    steps_vs_one(ds, rs, 3, n, rank, world);
    UNWRAP(ds);
    ct_strategy_destroy(rs);
    assert_params_close(dm, rm, 1e-4);
    ct_module_destroy(dm);
    ct_module_destroy(rm);
}
